"""On a GPU: the whole engine with its CUDA-only parts (the flow pool, the token-to-wave worker beside LM
decode on two CUDA streams). Needs CUDA; CI (CPU only) does not run it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosystream.engine.sync_engine import Engine
from cosystream.params import SamplingParams, SynthesisParams
from cosystream.testing.host_syncs import recorded_host_syncs
from cosystream.transfers import ints_to_device, to_device, to_host

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TEXTS = ["hello there.", "good morning to you.", "a short line."]


def test_streams_opened_ahead_of_their_first_chunk_on_cuda_give_the_same_audio(model_dir, fixture_dir, tmp_path):
    """EngineConfig.open_ahead on the real pool: streams opened in a batch of their own while the LM
    decodes (on the worker's CUDA stream, beside the LM's) voice as streams opened with their first chunk.
    One request at a time: requests sent together share batches by timing, and on the GPU a batch's
    size moves tf32 sums enough to flip a greedy token of the random test model (the CPU test
    test_overlap.py sends them together)."""
    params = [SynthesisParams(text=t, voice="v", force_tokens=60, sampling=SamplingParams(greedy=True, seed=i))
              for i, t in enumerate(TEXTS)]
    runs = {}
    for ahead in (True, False):
        eng = Engine.from_pretrained(model_dir, device="cuda", voices_db=str(tmp_path / f"v{ahead}.db"),
                                     max_streams=4, flow_slots=2, flow_frames=512, open_ahead=ahead)
        try:
            eng.run(eng.async_engine.add_voice("v", str(fixture_dir / "prompt_24k.wav"), "Hello there."))
            t2w = eng.async_engine.core.t2w
            assert eng.async_engine.config.overlap and t2w.pool is not None  # the worker runs beside the LM
            open_batches: list[int] = []
            real_opened = t2w.opened
            t2w.opened = lambda real=real_opened, seen=open_batches: (seen.append(1), real())
            runs[ahead] = ([eng.synthesize(p) for p in params], len(open_batches))
            assert sorted(t2w.pool.free) == [0, 1]
        finally:
            eng.close()
    (with_ahead, opened_ahead), (without, opened_without) = runs[True], runs[False]
    assert opened_ahead >= 1 and opened_without == 0
    for a, b in zip(without, with_ahead, strict=True):
        assert a.num_chunks == b.num_chunks >= 2
        np.testing.assert_allclose(b.pcm, a.pcm, atol=2e-3, rtol=0)



def test_host_tensors_reach_the_device_without_a_host_sync():
    host = torch.arange(1000, dtype=torch.float32)
    torch.cuda.synchronize()
    with recorded_host_syncs() as syncs:
        torch.cuda._sleep(10_000_000)  # the stream is busy: a blocking copy would wait for it
        floats = to_device(host, "cuda", torch.bfloat16)
        ints = ints_to_device([5, 6, 7], "cuda")
    assert syncs == []
    assert torch.equal(floats.cpu(), host.to(torch.bfloat16)) and ints.cpu().tolist() == [5, 6, 7]


def test_a_batch_of_results_reaches_the_host_with_one_wait():
    tensors = [torch.randn(100 + i, device="cuda") for i in range(8)]
    with recorded_host_syncs() as syncs:
        arrays = to_host(tensors)
    assert len(syncs) == 1
    for array, tensor in zip(arrays, tensors, strict=True):
        np.testing.assert_array_equal(array, tensor.cpu().numpy())
