"""Incremental CosyVoice3 streaming against the official `tts(stream=True)` chunks (e2e.safetensors, §C2)."""

from __future__ import annotations

import pytest
import torch

from cosystream.models.cosyvoice3.hift import HiftStream
from cosystream.models.cosyvoice3.stream import StreamSchedule, Token2WavStream, synthesize_offline

pytestmark = pytest.mark.parity

MEL_ATOL = 1e-4  # README §C3: e2e flow mel per call
AUDIO_ATOL = 5e-3  # README §C3: e2e streamed audio per call (float32 phase accumulation over seconds)
EXACT_PHASE_AUDIO_ATOL = 1e-5  # README §C3: the same, when the source phase is computed as the reference does


def _modes(manifest: dict) -> list[str]:
    return [m for m, run in manifest["e2e"].items() if isinstance(run, dict) and "schedule" in run]


def _prompt(e2e: dict, manifest: dict, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    src = manifest["e2e"][mode].get("prompt_inputs_from", mode)
    return (e2e[f"{src}_in_flow_prompt_speech_token"], e2e[f"{src}_in_prompt_speech_feat"],
            e2e[f"{src}_in_flow_embedding"])


def test_fixture_runs_present(cv3_manifest):
    assert {"zero_shot", "cross_lingual", "instruct2", "vc_long"} <= set(_modes(cv3_manifest))


@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct2", "vc_long"])
def test_schedule_matches_the_official_calls(cv3_load, cv3_manifest, mode):
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"][mode]
    prompt_token = _prompt(e2e, cv3_manifest, mode)[0]
    calls = StreamSchedule(prompt_token.shape[1]).all_calls(e2e[f"{mode}_speech_tokens"].shape[1])
    assert [(c.num_tokens, c.token_offset, c.finalize) for c in calls] == [
        (s["n_tokens"], s["token_offset"], s["finalize"]) for s in run["schedule"]]
    assert all(s["flow_streaming"] == (not s["finalize"]) for s in run["schedule"])


@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct2", "vc_long"])
def test_streamed_chunks_match_the_official_tts(cv3_flow, cv3_hift, cv3_load, cv3_manifest, mode):
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"][mode]
    prompt_token, prompt_feat, embedding = _prompt(e2e, cv3_manifest, mode)
    tokens = e2e[f"{mode}_speech_tokens"]
    stream = Token2WavStream(cv3_flow, cv3_hift, prompt_token, prompt_feat, embedding)
    schedule = StreamSchedule(prompt_token.shape[1])
    total = 0
    with torch.no_grad():
        for i, official in enumerate(run["schedule"]):
            call = schedule.next_call(tokens.shape[1], done=True)
            out = stream.push(tokens, call)
            assert out.mel.shape[2] == official["new_mel_frames"]
            assert out.wav.shape[1] == official["yield_samples"]
            torch.testing.assert_close(out.mel, e2e[f"{mode}_call{i}_flow_mel_new"], rtol=0, atol=MEL_ATOL)
            torch.testing.assert_close(out.wav, e2e[f"{mode}_call{i}_yield"], rtol=0, atol=AUDIO_ATOL)
            total += out.wav.shape[1]
    assert schedule.next_call(tokens.shape[1], done=True) is None
    assert total == run["stream_concat_samples"]


@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct2", "vc_long"])
def test_incremental_vocoder_reproduces_the_whole_mel_rerun(cv3_hift, cv3_load, cv3_manifest, mode):
    """Fed the official new mel of each call, the windowed vocoder emits the official samples."""
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"][mode]
    stream = HiftStream(cv3_hift)
    with torch.no_grad():
        for i, official in enumerate(run["schedule"]):
            wav = stream.push(e2e[f"{mode}_call{i}_flow_mel_new"], official["finalize"])
            torch.testing.assert_close(wav, e2e[f"{mode}_call{i}_yield"], rtol=0, atol=EXACT_PHASE_AUDIO_ATOL)


def test_nothing_already_sent_is_recomputed(cv3_flow, cv3_hift, cv3_load, cv3_manifest):
    """Per non-final chunk after the first, the DiT runs over exactly the new frames, and the vocoder over
    the new frames plus its fixed left context, whatever was emitted before."""
    mode = max(_modes(cv3_manifest), key=lambda m: len(cv3_manifest["e2e"][m]["schedule"]))
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"][mode]
    prompt_token, prompt_feat, embedding = _prompt(e2e, cv3_manifest, mode)
    tokens = e2e[f"{mode}_speech_tokens"]
    dit_frames: list[int] = []
    hift_frames: list[int] = []
    h1 = cv3_flow.decoder.estimator.register_forward_hook(lambda m, a, o: dit_frames.append(a[0].shape[2]))
    h2 = cv3_hift.conv_pre.register_forward_hook(lambda m, a, o: hift_frames.append(a[0].shape[2]))
    stream = Token2WavStream(cv3_flow, cv3_hift, prompt_token, prompt_feat, embedding)
    schedule = StreamSchedule(prompt_token.shape[1])
    context = stream.hift_stream.context
    try:
        with torch.no_grad():
            for i, official in enumerate(run["schedule"]):
                dit_frames.clear()
                hift_frames.clear()
                out = stream.push(tokens, schedule.next_call(tokens.shape[1], done=True))
                if i > 0 and not official["finalize"]:
                    assert set(dit_frames) == {out.mel.shape[2]}
                    assert len(dit_frames) == cv3_flow.dims.n_timesteps
                if i > 0:
                    # the frames withheld by the previous non-final call, and the zero right pad when finalizing
                    withheld = cv3_hift.f0_predictor.look_right + cv3_hift.look_right + 1
                    assert hift_frames[0] <= context + withheld + out.mel.shape[2] + cv3_hift.look_right
                    assert hift_frames[0] < official["hift_in_frames"]
    finally:
        h1.remove()
        h2.remove()
    assert len(run["schedule"]) >= 3  # the set must have a run long enough for this to mean something


def test_non_streaming_request(cv3_flow, cv3_hift, cv3_load, cv3_manifest):
    e2e = cv3_load("e2e")
    prompt_token, prompt_feat, embedding = _prompt(e2e, cv3_manifest, "zero_shot")
    with torch.no_grad():
        wav = synthesize_offline(cv3_flow, cv3_hift, e2e["zero_shot_speech_tokens"], prompt_token, prompt_feat,
                                 embedding)
    torch.testing.assert_close(wav, e2e["zero_shot_nonstream_yield"], rtol=0, atol=AUDIO_ATOL)


def test_persisted_hop_quirk_can_be_replayed():
    """spec/cosyvoice3.md §7: with the official object's hop left at 100, a 76-token prompt is padded to 100
    and the first chunk is hop + pad + 3 tokens; each request here starts at 25 unless told otherwise."""
    assert StreamSchedule(76, first_hop=100).next_call(500, done=False).num_tokens == 100 + 24 + 3
    assert StreamSchedule(76).next_call(500, done=False).num_tokens == 25 + 24 + 3


def test_encoded_prompt_blocks_are_reused_and_change_nothing(cv3_flow, cv3_hift, cv3_load, cv3_manifest):
    """A voice's target-independent prompt blocks, encoded once, serve two requests: same official chunks,
    and the first chunk's DiT starts after them."""
    from cosystream.models.cosyvoice3.flow import encode_prompt_blocks

    e2e = cv3_load("e2e")
    prompt_token, prompt_feat, embedding = _prompt(e2e, cv3_manifest, "zero_shot")
    with torch.no_grad():
        blocks = encode_prompt_blocks(cv3_flow, prompt_token, prompt_feat, embedding)
    block = cv3_flow.decoder.estimator.dims.static_chunk_size
    assert blocks.frames == block * (cv3_flow.ratio * (prompt_token.shape[1] - cv3_flow.dims.pre_lookahead_len)
                                     // block) > 0
    frames_seen: list[int] = []
    hook = cv3_flow.decoder.estimator.register_forward_hook(lambda m, a, o: frames_seen.append(a[0].shape[2]))
    try:
        for mode in ("zero_shot", "vc_long"):
            run = cv3_manifest["e2e"][mode]
            tokens = e2e[f"{mode}_speech_tokens"]
            stream = Token2WavStream(cv3_flow, cv3_hift, prompt_token, prompt_feat, embedding, prompt_blocks=blocks)
            schedule = StreamSchedule(prompt_token.shape[1])
            with torch.no_grad():
                for i, official in enumerate(run["schedule"]):
                    frames_seen.clear()
                    out = stream.push(tokens, schedule.next_call(tokens.shape[1], done=True))
                    if i == 0 and not official["finalize"]:
                        lookahead = cv3_flow.dims.pre_lookahead_len
                        total = cv3_flow.ratio * (prompt_token.shape[1] + official["n_tokens"] - lookahead)
                        assert set(frames_seen) == {total - blocks.frames}
                    torch.testing.assert_close(out.mel, e2e[f"{mode}_call{i}_flow_mel_new"], rtol=0, atol=MEL_ATOL)
                    torch.testing.assert_close(out.wav, e2e[f"{mode}_call{i}_yield"], rtol=0, atol=AUDIO_ATOL)
    finally:
        hook.remove()


def test_block_causal_last_chunk_equals_the_whole_sequence_streaming_call(cv3_flow, cv3_hift, cv3_load,
                                                                           cv3_manifest):
    """final_full_attention=False: every chunk, the last included, is what one whole-sequence
    `inference(streaming=True, finalize)` gives for its frames (the Triton runtime's final call)."""
    mode = "vc_long"
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"][mode]
    prompt_token, prompt_feat, embedding = _prompt(e2e, cv3_manifest, mode)
    tokens = e2e[f"{mode}_speech_tokens"]
    stream = Token2WavStream(cv3_flow, cv3_hift, prompt_token, prompt_feat, embedding, final_full_attention=False)
    schedule = StreamSchedule(prompt_token.shape[1])
    mels = []
    with torch.no_grad():
        while (call := schedule.next_call(tokens.shape[1], done=True)) is not None:
            mels.append(stream.push(tokens, call).mel)
        whole = cv3_flow.inference(tokens, prompt_token, prompt_feat, embedding, streaming=True, finalize=True)
    torch.testing.assert_close(torch.cat(mels, dim=2), whole, rtol=0, atol=MEL_ATOL)
    official_last = e2e[f"{mode}_call{len(run['schedule']) - 1}_flow_mel_new"]
    assert (mels[-1] - official_last).abs().max() > MEL_ATOL  # the official last chunk uses full attention


def test_cache_bytes_per_frame_counts_what_the_stream_keeps(cv3_flow, cv3_hift, cv3_load, cv3_manifest):
    from cosystream.models.cosyvoice3.flow import cache_bytes_per_frame

    e2e = cv3_load("e2e")
    prompt_token, prompt_feat, embedding = _prompt(e2e, cv3_manifest, "vc_long")
    tokens = e2e["vc_long_speech_tokens"]
    stream = Token2WavStream(cv3_flow, cv3_hift, prompt_token, prompt_feat, embedding)
    call = StreamSchedule(prompt_token.shape[1]).next_call(tokens.shape[1], done=False)
    with torch.no_grad():
        stream.push(tokens, call)
    caches = stream.flow_stream.state.caches
    kept = sum(t.numel() * t.element_size() for c in caches for t in (*c.keys, *c.values))
    assert kept == caches[0].length * cache_bytes_per_frame(cv3_flow.dims, torch.float32) > 0
