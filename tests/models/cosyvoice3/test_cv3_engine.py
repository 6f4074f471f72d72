"""The engine (Engine / AsyncEngine, its core, scheduler and runners) on the CosyVoice3 fixture model, against
the streamed chunks of the official `tts()` loop (fixtures README §C2 `e2e.safetensors`, tolerances §C3).

The official LM samples with torch's global generator, so its tokens are recorded, not re-derivable (README
§C4). The engine runs its own LM on the official inputs; `ReplayedTokens` puts the official token values in
place of the sampled ones as they leave the LM runner (every other id passes unchanged). So when each
segment stops is still the engine's own decision (the masked index before `min_len`, the stop ids), and what
happens after the LM (the silent-token filter, the chunk schedule, the token-to-wave runner, the emitted
chunks) is the engine's own, end to end. The frontend's features are covered by test_cv3_frontend.py; here
the requests carry the features the official model received.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.sync_engine import Engine
from cosystream.errors import BadInput
from cosystream.frontend.prompt import BuiltinSpeaker, ModelInputs, VoicePrompt
from cosystream.models.cosyvoice3.lm import ENDOFPROMPT_ID, MAX_SILENT_RUN, SILENT_TOKENS, SilentTokenFilter
from cosystream.params import SamplingParams, SynthesisParams
from cosystream.testing.concurrency import synthesize_concurrently

AUDIO_ATOL = 5e-3  # README §C3: e2e streamed audio per call
SAMPLES_PER_TOKEN = 960  # 24 kHz, 25 Hz tokens
VOICE = "fixture-voice"

pytestmark = pytest.mark.parity


class ReplayedTokens:
    """The engine's LM runner with the speech-token values of its rows replaced, in order, by `tokens`; stop
    ids (>= `num_codes`) and tokens past the list (computed ahead of a row's end, then dropped) pass as sampled."""

    def __init__(self, runner: Any, tokens: list[int], num_codes: int) -> None:
        self._runner, self._tokens, self._num_codes = runner, tokens, num_codes
        self.taken: dict[int, int] = {}  # slot -> tokens replaced so far
        self.prefills: list[torch.Tensor] = []  # embeddings of single-row feeds (text streaming)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def _swap(self, slot: int, token: int) -> int:
        taken = self.taken.get(slot)
        if taken is None or token >= self._num_codes or taken >= len(self._tokens):
            return token
        self.taken[slot] = taken + 1
        return self._tokens[taken]

    def prefill_many(self, items: list[tuple[int, torch.Tensor]]) -> list[int]:
        out = self._runner.prefill_many(items)
        for slot, _ in items:
            self.taken[slot] = 0
        return [self._swap(slot, token) for (slot, _), token in zip(items, out, strict=True)]

    def prefill(self, slot: int, embeds: torch.Tensor, start_pos: int = 0) -> int:
        if start_pos == 0:
            self.taken[slot] = 0
        self.prefills.append(embeds.detach().clone())
        return self._swap(slot, self._runner.prefill(slot, embeds, start_pos))

    def collect(self, ticket: Any) -> list[int]:
        out = list(self._runner.collect(ticket))
        for slot in self.taken:
            if slot < len(out):
                out[slot] = self._swap(slot, out[slot])
        return out


@pytest.fixture(scope="module")
def engine(cv3_model_dir, cv3_noise_table, tmp_path_factory):
    eng = Engine.from_pretrained(cv3_model_dir, device="cpu", dtype="float32", max_streams=4,
                                 voices_db=str(tmp_path_factory.mktemp("cv3_voices") / "voices.db"))
    if cv3_noise_table is not None:  # the set's exact noise prefix, as the model-level parity tests use
        eng.async_engine.token2wav.flow.decoder.set_noise_table(cv3_noise_table)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def voice(engine, cv3_load):
    """A registered voice holding the features the official zero-shot run received."""
    e2e = cv3_load("e2e")
    prompt = VoicePrompt(prompt_text_ids=e2e["zero_shot_in_prompt_text"][0],
                         prompt_speech_tokens=e2e["zero_shot_in_flow_prompt_speech_token"][0],
                         prompt_mel=e2e["zero_shot_in_prompt_speech_feat"][0],
                         xvector=e2e["zero_shot_in_flow_embedding"][0], family="cosyvoice3")
    engine.async_engine.voices.add(VOICE, prompt, "fixture transcript")
    return VOICE


def official_inputs(e2e: dict[str, torch.Tensor], mode: str, src: str) -> ModelInputs:
    """The model input of the official run `mode` (its prompt features from run `src`)."""
    def get(name: str) -> torch.Tensor:
        key = f"{src}_in_{name}"
        return e2e[key][0] if key in e2e else torch.zeros(0, dtype=torch.int32)

    engine_mode = "vc" if mode.startswith("vc") else mode
    return ModelInputs(
        mode=engine_mode, text_ids=get("text") if engine_mode != "vc" else torch.zeros(0, dtype=torch.int32),
        xvector=get("flow_embedding"), prompt_text_ids=get("prompt_text"),
        llm_prompt_speech_tokens=get("llm_prompt_speech_token"),
        flow_prompt_speech_tokens=get("flow_prompt_speech_token"), prompt_mel=get("prompt_speech_feat"),
        source_speech_tokens=e2e[f"{mode}_speech_tokens"][0] if engine_mode == "vc" else
        torch.zeros(0, dtype=torch.int32))


def synthesize(engine, monkeypatch, inputs: ModelInputs, tokens: list[int], params: SynthesisParams,
               voice: str | None) -> tuple[list[np.ndarray], ReplayedTokens]:
    """Stream one request whose segment has `inputs`, the LM's speech tokens replaced by `tokens`."""
    aeng = engine.async_engine
    seen: list[Any] = []

    def model_inputs(p: SynthesisParams, prompt: VoicePrompt | None) -> list[ModelInputs]:
        seen.append(prompt)
        return [inputs]

    monkeypatch.setattr(aeng, "_model_inputs", model_inputs)
    core = aeng.core
    real = core.lm_runner
    replay = ReplayedTokens(real, tokens, aeng.lm.dims.speech_token_size)
    aeng.core.call(setattr, core, "lm_runner", replay)  # on the engine thread, between its steps
    try:
        chunks = [chunk.pcm for chunk in engine.stream(params)]
    finally:
        aeng.core.call(setattr, core, "lm_runner", real)
    if voice is not None:
        assert seen and seen[0] is aeng.voice_prompt(voice)  # the registered voice's features were used
    return chunks, replay


@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct2", "vc_long"])
def test_engine_streams_the_official_chunks(engine, voice, monkeypatch, cv3_load, cv3_manifest, mode):
    e2e, run = cv3_load("e2e"), cv3_manifest["e2e"][mode]
    inputs = official_inputs(e2e, mode, run.get("prompt_inputs_from", mode))
    tokens = e2e[f"{mode}_speech_tokens"][0].tolist()
    params = SynthesisParams(text="replaced by the official inputs", voice=voice, mode=inputs.mode,
                             instruct_text="replaced", source_audio=b"replaced" if inputs.mode == "vc" else None)
    chunks, replay = synthesize(engine, monkeypatch, inputs, tokens, params, voice)
    if inputs.mode != "vc":
        # the engine's own LM ended the segment where the official one did (at min_len, README §C4)
        assert list(replay.taken.values()) == [len(tokens)]
    assert len(chunks) == len(run["schedule"])
    for i, pcm in enumerate(chunks):
        want = e2e[f"{mode}_call{i}_yield"][0].numpy()
        assert pcm.shape == want.shape, (i, pcm.shape, want.shape)
        np.testing.assert_allclose(pcm, want, rtol=0, atol=AUDIO_ATOL, err_msg=f"{mode} call {i}")
    assert sum(c.shape[0] for c in chunks) == run["stream_concat_samples"]


def test_silent_tokens_are_filtered_between_the_lm_and_the_flow(engine, voice, monkeypatch, cv3_load,
                                                                cv3_manifest):
    """A long run of silent ids from the LM: the LM keeps generating to min_len, the flow gets the official
    filter's output (independently computed here), and the audio is that of the filtered tokens."""
    e2e = cv3_load("e2e")
    inputs = official_inputs(e2e, "zero_shot", "zero_shot")
    tokens = e2e["zero_shot_speech_tokens"][0].tolist()
    silent = sorted(SILENT_TOKENS)
    run_length = MAX_SILENT_RUN + 4
    tokens[3:3 + run_length] = [silent[i % len(silent)] for i in range(run_length)]
    for edge in (2, 3 + run_length):  # the run is exactly this long whatever the recorded tokens around it
        if tokens[edge] in SILENT_TOKENS:
            tokens[edge] = min(set(range(len(SILENT_TOKENS) + 1)) - SILENT_TOKENS)
    kept = [t for i, t in enumerate(tokens) if not (3 + MAX_SILENT_RUN <= i < 3 + run_length)]
    params = SynthesisParams(text="replaced", voice=voice, mode="zero_shot", stream=False)
    chunks, replay = synthesize(engine, monkeypatch, inputs, tokens, params, voice)
    assert list(replay.taken.values()) == [len(tokens)]  # every token reached the LM ...
    pcm = np.concatenate(chunks)
    assert pcm.shape == (SAMPLES_PER_TOKEN * len(kept),)  # ... the flow got the filtered ones
    f = SilentTokenFilter()
    assert [t for t in tokens if f.keep(t)] == kept
    # the audio is what the token-to-wave runner makes of the filtered tokens alone
    t2w = engine.async_engine.token2wav
    plan = ChunkPlanner(ChunkSchedule(), inputs.flow_prompt_speech_tokens.numel(), stream=False).next_plan(
        len(kept), done=True)
    [(want, _, _)] = engine.async_engine.core.call(
        lambda: t2w.run([(t2w.start(inputs, None), kept, plan)]))
    np.testing.assert_allclose(pcm, want, rtol=0, atol=1e-5)


def test_text_streaming_feeds_the_cosyvoice3_prompt(engine, voice, monkeypatch, cv3_load):
    """Text in pieces (bistream): SOS and the prompt text through `<|endofprompt|>` come first, outside the 5:15
    interleave (spec/cosyvoice3.md §4), and the request streams audio of the forced length."""
    aeng = engine.async_engine
    lm = aeng.lm
    prompt = aeng.voice_prompt(voice)
    ids = prompt.prompt_text_ids.long()
    cut = int((ids == ENDOFPROMPT_ID).nonzero()[0]) + 1
    sos, _ = lm.special_rows()
    expected_head = torch.cat([sos[None], lm.text_embedding(ids[:cut])])
    core, real = aeng.core, aeng.core.lm_runner
    replay = ReplayedTokens(real, [], lm.dims.speech_token_size)
    aeng.core.call(setattr, core, "lm_runner", replay)

    async def pieces():
        for piece in ("Hello there, ", "how are ", "you today?"):
            yield piece

    try:
        result = engine.synthesize(SynthesisParams(text=pieces(), voice=voice, force_tokens=30))
    finally:
        aeng.core.call(setattr, core, "lm_runner", real)
    assert result.pcm.shape == (30 * SAMPLES_PER_TOKEN,)
    first = replay.prefills[0]
    torch.testing.assert_close(first[: expected_head.shape[0]], expected_head)


def test_a_voice_of_another_family_is_refused_by_name(engine, voice):
    aeng = engine.async_engine
    cv2_voice = dataclasses.replace(aeng.voice_prompt(voice), family="cosyvoice2")
    aeng.voices.add("from-cv2", cv2_voice, "registered on a CosyVoice2 model")
    with pytest.raises(BadInput, match="'from-cv2' was registered with a cosyvoice2 model.*cosyvoice3"):
        engine.synthesize(SynthesisParams(text="Hello.", voice="from-cv2", force_tokens=5))
    assert "from-cv2" in aeng.voices  # nothing lost: the record stays for the model it was made for
    assert engine.synthesize(SynthesisParams(text="Hello.", voice=voice, force_tokens=5)).pcm.shape == (
        5 * SAMPLES_PER_TOKEN,)


def test_sft_speaks_with_a_builtin_speaker_and_the_system_prefix(engine, monkeypatch, cv3_load):
    """sft (a speaker of spk2info.pt): no prompt, the flow conditioned on the speaker's embedding alone; the
    CosyVoice3 LM prompt is SOS ⊕ text(system prefix ⊕ segment) ⊕ TASK (its LM needs `<|endofprompt|>`). The
    engine's chunks are those of the token-to-wave runner driven by the official schedule without a prompt."""
    aeng = engine.async_engine
    e2e = cv3_load("e2e")
    xvector = e2e["zero_shot_in_flow_embedding"][0]
    monkeypatch.setitem(aeng.frontend.speakers, "builtin", BuiltinSpeaker(xvector=xvector, prompt=None))
    [inputs] = aeng._model_inputs(SynthesisParams(text="Hello there.", mode="sft", sft_speaker="builtin"), None)
    assert inputs.flow_prompt_speech_tokens.numel() == 0 and torch.equal(inputs.xvector, xvector)
    text = inputs.text_ids.long()
    assert int((text == ENDOFPROMPT_ID).sum()) == 1  # the system prefix's <|endofprompt|>
    lm_prompt = aeng.lm.embed_prompt(inputs.text_ids, inputs.llm_prompt_speech_tokens, inputs.prompt_text_ids)
    sos, task = aeng.lm.special_rows()
    assert lm_prompt.shape[0] == text.numel() + 2
    torch.testing.assert_close(lm_prompt[0], sos)
    torch.testing.assert_close(lm_prompt[-1], task)

    tokens = e2e["zero_shot_speech_tokens"][0].tolist()
    params = SynthesisParams(text="Hello there.", mode="sft", sft_speaker="builtin", force_tokens=len(tokens))
    chunks, _ = synthesize(engine, monkeypatch, inputs, tokens, params, None)
    assert sum(c.shape[0] for c in chunks) == SAMPLES_PER_TOKEN * len(tokens)
    t2w = aeng.token2wav
    planner = ChunkPlanner(ChunkSchedule(), 0)

    def runner_chunks() -> list[np.ndarray]:
        state, out = t2w.start(inputs, None), []
        while (plan := planner.next_plan(len(tokens), done=True)) is not None:
            [(pcm, _, _)] = t2w.run([(state, tokens, plan)])
            out.append(pcm)
        return out

    want = aeng.core.call(runner_chunks)
    assert [c.shape for c in chunks] == [w.shape for w in want]
    for got, ref in zip(chunks, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


def test_concurrent_requests_equal_requests_run_alone(engine, voice):
    """Streams of several modes at once: each keeps its own LM row, filter and token-to-wave stream (the voice's
    encoded prompt blocks are shared read-only), so each gets the audio it gets alone."""
    texts = ["Hello there.", "Good morning to you, my friend.", "A short line.", "The quick brown fox jumps."]
    modes = [dict(mode="zero_shot"), dict(mode="cross_lingual"), dict(mode="instruct2", instruct_text="Speak slowly."),
             dict(mode="zero_shot", stream=False)]
    params = [SynthesisParams(text=t, voice=voice, sampling=SamplingParams(greedy=True, seed=i), **m)
              for i, (t, m) in enumerate(zip(texts, modes, strict=True))]
    alone = [engine.synthesize(p) for p in params]
    together = synthesize_concurrently(engine, params)
    for a, b in zip(alone, together, strict=True):
        assert b is not None and a.num_chunks == b.num_chunks and a.times.num_tokens == b.times.num_tokens > 0
        np.testing.assert_allclose(b.pcm, a.pcm, rtol=0, atol=1e-5)
    assert len({a.times.num_tokens for a in alone}) > 1
