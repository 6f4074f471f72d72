"""Faults fail the requests they touch and no other: bad prompt audio, NaN in a model output, out of memory.

Every test runs the faulty request beside healthy ones and checks that those finish whole and equal to the
same requests run without the fault, that the engine serves afterwards and that nothing stays held.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_threads import synthesize_together

from cosystream.engine import faults
from cosystream.engine.accounting import take_accounts
from cosystream.errors import BadInput, SynthesisFailed
from cosystream.params import Mode, SamplingParams, SynthesisParams

PROMPT_TEXT = "Hello there. This is a short synthetic prompt."
TEXTS = ["the first healthy line.", "a second healthy line here.", "and a third one."]
BAD = "bad"  # request id of the faulty request


@pytest.fixture(scope="module")
def voice(engine, fixture_dir) -> str:
    engine.run(engine.async_engine.add_voice("f", str(fixture_dir / "prompt_24k.wav"), PROMPT_TEXT))
    return "f"


def _params(voice: str, i: int, **kw) -> SynthesisParams:
    kw.setdefault("force_tokens", 60)  # two streamed chunks and a final one
    return SynthesisParams(text=TEXTS[i % len(TEXTS)], voice=voice, request_id=kw.pop("request_id", f"ok-{i}"),
                           sampling=SamplingParams(greedy=True, seed=i), **kw)


@pytest.fixture(scope="module")
def alone(engine, voice) -> list[np.ndarray]:
    """The healthy requests' audio, each run by itself."""
    return [engine.synthesize(_params(voice, i)).pcm for i in range(len(TEXTS))]


def _together(engine, params: list[SynthesisParams]) -> list:
    """Run every request at once; each result is its audio or the exception it ended with."""
    return [r if isinstance(r, Exception) else r.pcm for r in synthesize_together(engine, params)]


def _check_healthy(results: list, alone: list[np.ndarray]) -> None:
    for got, want in zip(results, alone, strict=True):
        assert isinstance(got, np.ndarray), got
        assert got.shape == want.shape  # whole: every sample of every chunk
        # batched GEMMs round a little differently: equal up to float32 noise, rare peaks near 1e-3
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
        assert float(np.abs(got - want).mean()) < 1e-4  # vs. a signal of ~0.1 RMS


def _check_serving(engine, voice: str) -> None:
    assert engine.async_engine.stats()["alive"] == 1.0
    assert engine.synthesize(_params(voice, 0, force_tokens=30)).pcm.shape[0] == 960 * 30
    assert take_accounts(engine.async_engine).is_idle


def _expect(error: object, code: str) -> None:
    assert isinstance(error, SynthesisFailed), error
    assert error.code == code and str(error).startswith("synthesis failed:")


def _tone(seconds: float, sample_rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    return (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)


def _with_nan(samples: np.ndarray) -> np.ndarray:
    samples = samples.copy()
    samples[100] = np.nan
    return samples


BAD_AUDIO = {  # prompt audio -> words its error must name
    "silent": ((np.zeros(24000, np.float32), 24000), "silent"),
    "too_short": ((_tone(0.2), 16000), "too short"),
    "nan_samples": ((_with_nan(_tone(2.0)), 16000), "NaN"),
    "low_rate": ((_tone(2.0, 4000), 4000), "sample rate"),
    "not_audio": (b"RIFF not really a wav file", "not a readable audio file"),
}


def test_bad_prompt_audio_fails_each_such_request_alone_with_bad_input(engine, voice, alone):
    bad = [SynthesisParams(text="cloned from a broken recording.", prompt_audio=audio, prompt_text=PROMPT_TEXT,
                           request_id=f"{BAD}-{name}", force_tokens=60) for name, (audio, _) in BAD_AUDIO.items()]
    results = _together(engine, [_params(voice, 0), _params(voice, 1), *bad])
    for failed, (_, reason) in zip(results[2:], BAD_AUDIO.values(), strict=True):
        assert isinstance(failed, BadInput) and str(failed).startswith("prompt_wav:") and reason in str(failed)
    _check_healthy(results[:2], alone[:2])


def test_nan_in_the_lm_fails_that_row_and_its_slot_is_scrubbed(engine, voice, alone, monkeypatch):
    core = engine.async_engine.core
    runner = core.lm_runner
    real_prefill, poisoned = runner.prefill, []

    def prefill_then_poison(slot: int, embeds: torch.Tensor, start_pos: int = 0) -> int:
        token = real_prefill(slot, embeds, start_pos)
        if core.slot_owner[slot].request_id == BAD:  # its whole cache row turns to NaN: its logits too
            runner.cache.k[:, slot] = float("nan")
            poisoned.append(slot)
        return token

    monkeypatch.setattr(runner, "prefill", prefill_then_poison)
    *healthy, failed = _together(engine, [_params(voice, 0), _params(voice, 1), _params(voice, 3, request_id=BAD)])
    _expect(failed, "non_finite_output")
    assert "speech LM" in str(failed)
    _check_healthy(healthy, alone[:2])
    assert poisoned[0] <= 2 and torch.isfinite(runner.cache.k[:, poisoned[0]]).all()
    monkeypatch.undo()
    # three at once take slots 0-2, the poisoned one among them: stale NaN would fail its new owner
    _check_healthy(_together(engine, [_params(voice, i) for i in range(3)]), alone)
    _check_serving(engine, voice)


def test_nan_in_the_audio_fails_that_request(engine, voice, alone, monkeypatch):
    t2w = engine.async_engine.token2wav
    real_flow = t2w._flow

    def flow_with_nan(jobs):
        mels = real_flow(jobs)
        return [m * float("nan") if st.key[0] == BAD else m for (st, _, _), m in zip(jobs, mels, strict=True)]

    monkeypatch.setattr(t2w, "_flow", flow_with_nan)
    *healthy, failed = _together(engine, [_params(voice, 0), _params(voice, 1), _params(voice, 3, request_id=BAD)])
    _expect(failed, "non_finite_output")
    assert "vocoder" in str(failed)
    _check_healthy(healthy, alone[:2])
    _check_serving(engine, voice)


def _oom_for(request_id: str):
    return torch.OutOfMemoryError(f"CUDA out of memory (simulated for {request_id})")


def test_out_of_memory_in_a_token_to_wave_batch_fails_only_that_batch(engine, voice, alone, monkeypatch):
    t2w, core = engine.async_engine.token2wav, engine.async_engine.core
    real_run = t2w.run

    def run_or_oom(jobs, should_stop=None):
        if any(st.key[0] == BAD for st, _, _ in jobs):
            raise _oom_for(BAD)
        return real_run(jobs, should_stop=should_stop)

    monkeypatch.setattr(t2w, "run", run_or_oom)
    monkeypatch.setattr(core, "max_chunk_batch", 1)  # one request per batch, so the fault's batch is known
    *healthy, failed = _together(engine, [_params(voice, 0), _params(voice, 1), _params(voice, 3, request_id=BAD)])
    _expect(failed, "out_of_memory")
    _check_healthy(healthy, alone[:2])
    _check_serving(engine, voice)


def test_out_of_memory_in_an_lm_step_fails_the_decoding_rows_only(engine, voice, fixture_dir, monkeypatch):
    runner = engine.async_engine.core.lm_runner
    real_launch, calls = runner.launch, []

    def launch_or_oom(num_rows: int, max_position: int):
        calls.append(num_rows)
        if len(calls) == 5:
            raise _oom_for("the decode batch")
        return real_launch(num_rows, max_position)

    vc = SynthesisParams(mode=Mode.vc, voice=voice, source_audio=str(fixture_dir / "prompt_16k.wav"),
                         sampling=SamplingParams(seed=9))  # the seed also places the vocoder's noise
    vc_alone = engine.synthesize(vc).pcm
    monkeypatch.setattr(runner, "launch", launch_or_oom)
    decoding, converted = _together(engine, [_params(voice, 0, request_id=BAD), vc])
    _expect(decoding, "out_of_memory")
    assert isinstance(converted, np.ndarray)  # voice conversion has no LM rows: it was never in the batch
    _check_healthy([converted], [vc_alone])
    _check_serving(engine, voice)


@pytest.mark.parametrize("stage", ["prefill", "token2wav_start"])
def test_out_of_memory_setting_up_one_request_fails_it_alone(engine, voice, alone, monkeypatch, stage):
    core = engine.async_engine.core
    owner, method = (core.lm_runner, "prefill") if stage == "prefill" else (core.t2w, "start")
    real = getattr(owner, method)

    def failing(*args, **kwargs):
        key = kwargs.get("key")
        request_id = key[0] if key is not None else core.slot_owner[args[0]].request_id
        if request_id == BAD:
            raise _oom_for(BAD)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, method, failing)
    *healthy, failed = _together(engine, [_params(voice, 0), _params(voice, 1), _params(voice, 3, request_id=BAD)])
    _expect(failed, "out_of_memory")
    _check_healthy(healthy, alone[:2])
    _check_serving(engine, voice)


def test_release_device_memory_empties_the_cuda_cache_after_oom_only(monkeypatch):
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    faults.release_device_memory(RuntimeError("other"), torch.device("cuda"))
    faults.release_device_memory(_oom_for("x"), torch.device("cpu"))
    assert emptied == []
    faults.release_device_memory(_oom_for("x"), torch.device("cuda"))
    assert emptied == [True]


def test_non_finite_rows_are_marked_in_the_token_output():
    logp = torch.zeros(3, 5)
    logp[1, 2] = float("nan")
    logp[2, 0] = float("inf")
    marked = faults.mark_non_finite(logp, torch.tensor([4, 4, 4]))
    assert marked.tolist() == [4, faults.NON_FINITE_TOKEN, faults.NON_FINITE_TOKEN]
