"""PromptBatcher (engine/prompt_batcher.py): prompts that arrive together are analysed together, results
equal the frontend's own analysis, failures stay with their prompt; and the engine's cache of uploaded
recordings is bounded."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from cosystream.engine.prompt_batcher import WARM_UP_RATES, PromptBatcher
from cosystream.errors import CosyStreamError
from cosystream.frontend import Frontend
from cosystream.frontend.audio import PromptAudio
from cosystream.frontend.torch_prompt import PromptAnalysis
from cosystream.params import SynthesisParams
from cosystream.testing.prompt_analysis import RecordingAnalyzer


def _speech(seconds: float, seed: int, rate: int = 16000) -> tuple[np.ndarray, int]:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    wav = 0.3 * np.sin(2 * np.pi * (110 + 40 * seed) * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    return (wav + rng.normal(0, 0.01, t.shape)).astype(np.float32), rate


class GatedAnalyzer:
    """Records each batch; the first batch waits for `release`, so later prompts pile up behind it."""

    def __init__(self, fail_on: float | None = None) -> None:
        self.batches: list[int] = []
        self.release = threading.Event()
        self.started = threading.Event()
        self.fail_on = fail_on
        self.device = torch.device("cpu")

    def close(self) -> None:
        self.release.set()

    def analyse(self, prompts: list[PromptAudio]) -> list[PromptAnalysis]:
        self.batches.append(len(prompts))
        self.started.set()
        self.release.wait(timeout=10)
        if self.fail_on is not None and any(float(p.wav_16k[0]) == self.fail_on for p in prompts):
            raise RuntimeError("bad prompt")
        return [PromptAnalysis(tokens=torch.tensor([len(p.wav_16k)], dtype=torch.int32),
                               mel=torch.zeros(2, 80), xvector=torch.full((192,), float(p.wav_16k[0])))
                for p in prompts]


def _prompt(first: float, n: int = 1600) -> PromptAudio:
    wav = torch.zeros(n)
    wav[0] = first
    return PromptAudio(wav, sample_rate=16000, flow_sample_rate=24000)


def test_prompts_arriving_while_the_worker_is_busy_form_one_batch(frontend):
    analyzer = GatedAnalyzer()
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=0.0, max_batch=8)  # type: ignore[arg-type]
    try:
        first = batcher.submit(_prompt(1.0))
        assert analyzer.started.wait(timeout=10)
        later = [batcher.submit(_prompt(float(i), n=1600 + i)) for i in range(2, 6)]
        analyzer.release.set()
        assert float(first.result(timeout=10).xvector[0]) == 1.0
        for i, future in enumerate(later, start=2):
            result = future.result(timeout=10)
            assert float(result.xvector[0]) == float(i) and int(result.tokens[0]) == 1600 + i  # its own result
        assert analyzer.batches == [1, 4]
        assert (batcher.stats.batches, batcher.stats.prompts, batcher.stats.largest_batch) == (2, 5, 4)
    finally:
        batcher.close()


def test_max_batch_splits_a_burst(frontend):
    analyzer = GatedAnalyzer()
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=0.0, max_batch=2)  # type: ignore[arg-type]
    try:
        first = batcher.submit(_prompt(1.0))
        assert analyzer.started.wait(timeout=10)
        later = [batcher.submit(_prompt(float(i))) for i in range(2, 7)]
        analyzer.release.set()
        for future in [first, *later]:
            future.result(timeout=10)
        assert analyzer.batches == [1, 2, 2, 1]
    finally:
        batcher.close()


def test_a_failing_prompt_fails_alone(frontend):
    analyzer = GatedAnalyzer(fail_on=3.0)
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=0.0)  # type: ignore[arg-type]
    try:
        first = batcher.submit(_prompt(1.0))
        assert analyzer.started.wait(timeout=10)
        good, bad, other = (batcher.submit(_prompt(v)) for v in (2.0, 3.0, 4.0))
        analyzer.release.set()
        assert float(first.result(timeout=10).xvector[0]) == 1.0
        assert float(good.result(timeout=10).xvector[0]) == 2.0
        assert float(other.result(timeout=10).xvector[0]) == 4.0
        with pytest.raises(RuntimeError, match="bad prompt"):
            bad.result(timeout=10)
        assert float(batcher.analyse(_prompt(5.0)).xvector[0]) == 5.0  # still serving
    finally:
        batcher.close()


def test_closed_batcher_refuses_new_prompts(frontend):
    analyzer = GatedAnalyzer()
    analyzer.release.set()
    batcher = PromptBatcher(frontend, analyzer)  # type: ignore[arg-type]
    batcher.close()
    with pytest.raises(CosyStreamError, match="closed"):
        batcher.submit(_prompt(1.0))


@pytest.fixture(scope="module")
def frontend(checkpoint) -> Frontend:
    return Frontend(checkpoint)


def test_torch_batched_voice_prompts_equal_the_onnx_ones(frontend, checkpoint):
    """The real torch analysis (forced on the CPU) through the batcher, from several threads at once, after
    its warm-up (synthetic recordings at every upload rate, which leave no trace in the results or stats)."""
    batcher = PromptBatcher.for_engine(frontend, checkpoint, "cpu", use_torch=True)
    assert batcher.batched
    assert batcher.warm_up() == 1 + len(WARM_UP_RATES)
    recordings = [_speech(s, seed) for seed, s in enumerate((1.3, 2.1, 2.1, 0.9))]
    try:
        with ThreadPoolExecutor(4) as pool:
            voices = list(pool.map(lambda r: batcher.make_voice_prompt(r, "a prompt."), recordings))
    finally:
        batcher.close()
    assert batcher.stats.prompts == len(recordings)
    for recording, voice in zip(recordings, voices, strict=True):
        want = frontend.make_voice_prompt(recording, "a prompt.")
        assert torch.equal(voice.prompt_speech_tokens, want.prompt_speech_tokens)
        assert torch.equal(voice.prompt_text_ids, want.prompt_text_ids)
        torch.testing.assert_close(voice.prompt_mel, want.prompt_mel, atol=1e-5, rtol=0)
        torch.testing.assert_close(voice.xvector, want.xvector, atol=1e-4, rtol=1e-4)


def test_cpu_engines_keep_the_onnx_analysis(frontend, checkpoint):
    batcher = PromptBatcher.for_engine(frontend, checkpoint, "cpu")
    assert not batcher.batched
    recording = _speech(1.0, 9)
    assert torch.equal(batcher.make_voice_prompt(recording).prompt_speech_tokens,
                       frontend.make_voice_prompt(recording).prompt_speech_tokens)
    batcher.close()


def test_uploaded_recordings_are_reused_by_content_and_bounded(engine, monkeypatch):
    """The engine keeps the analyses of recordings sent with requests, keyed by content, at most
    `max_entries` of them, the least recently used dropped first."""
    from cosystream.engine.upload_cache import UPLOAD_KEY_PREFIX

    ae = engine.async_engine
    analysed: list[int] = []
    real = ae.prompt_batcher.make_voice_prompt
    monkeypatch.setattr(ae.prompt_batcher, "make_voice_prompt",
                        lambda audio, text: analysed.append(len(analysed)) or real(audio, text))
    monkeypatch.setattr(ae._uploads, "max_entries", 2)
    ae._uploads.clear()
    recordings = [_speech(0.8, seed) for seed in range(3)]

    def resolve(recording):
        return ae._resolve_voice(SynthesisParams(text="x.", prompt_audio=recording, prompt_text="a prompt."))

    first, key_a = resolve(recordings[0])
    again, key_again = resolve(recordings[0])
    assert again is first and key_again == key_a and len(analysed) == 1  # seen before: reused
    resolve(recordings[1])
    resolve(recordings[0])  # most recent again
    resolve(recordings[2])  # evicts recordings[1], the least recently used
    assert len(ae._uploads) == 2 and len(analysed) == 3
    resolve(recordings[0])
    assert len(analysed) == 3
    _, key_b = resolve(recordings[1])
    assert len(analysed) == 4 and len(ae._uploads) == 2
    # what a replica reports to the router: the digests it holds, most recently used last
    assert [k.removeprefix(UPLOAD_KEY_PREFIX) for k in (key_a, key_b)] == ae.cached_uploads()


def test_a_graph_the_torch_runner_cannot_run_keeps_the_onnx_analysis(frontend, checkpoint, monkeypatch, caplog):
    from cosystream.engine import prompt_batcher
    from cosystream.frontend.onnx_torch import UnsupportedGraph

    def refuse(*args, **kwargs):
        raise UnsupportedGraph("speech_tokenizer_v2.onnx: operators not supported by the torch runner: Loop")

    monkeypatch.setattr(prompt_batcher.TorchPromptAnalyzer, "from_checkpoint", refuse)
    batcher = PromptBatcher.for_engine(frontend, checkpoint, "cpu", use_torch=True)
    assert not batcher.batched
    assert "Loop" in caplog.text
    recording = _speech(1.0, 11)
    assert torch.equal(batcher.make_voice_prompt(recording).prompt_speech_tokens,
                       frontend.make_voice_prompt(recording).prompt_speech_tokens)
    batcher.close()


def test_requests_with_a_recording_are_prepared_on_the_batchers_threads(frontend, checkpoint):
    """The engine's frontend pool is small; requests that wait for a batch get threads of their own, as many as
    a batch holds, so a burst of recordings can meet in one batch."""
    default = ThreadPoolExecutor(1)
    with_audio = SynthesisParams(text="x.", prompt_audio=b"RIFF", prompt_text="a prompt.")
    registered = SynthesisParams(text="x.", voice="alice")
    analyzer = GatedAnalyzer()
    analyzer.release.set()
    batched = PromptBatcher(frontend, analyzer, max_batch=5)  # type: ignore[arg-type]
    plain = PromptBatcher.for_engine(frontend, checkpoint, "cpu")
    try:
        assert batched.pool_for(with_audio, default) is batched.executor
        assert batched.executor is not None and batched.executor._max_workers == 5
        assert batched.pool_for(registered, default) is default
        assert plain.pool_for(with_audio, default) is default
    finally:
        batched.close()
        plain.close()
        default.shutdown()


def test_backlog_and_measured_batches_for_admission(frontend):
    """Admission reads what waits for the analysis (PromptBatcher.backlog) and the seconds each batch took."""
    from cosystream.engine.prompt_load import PromptCosts

    analyzer = GatedAnalyzer()
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=0.0, max_batch=8)  # type: ignore[arg-type]
    costs = PromptCosts()
    batcher.costs = lambda: costs
    try:
        assert batcher.backlog() == type(batcher.backlog())(max_batch=8)  # nothing in line
        first = batcher.submit(_prompt(1.0))
        assert analyzer.started.wait(timeout=10)
        later = [batcher.submit(_prompt(float(i))) for i in range(2, 5)]
        line = batcher.backlog(new_recording=True)
        assert (line.new_recording, line.running, line.queued, line.max_batch) == (True, 1, 3, 8)
        assert line.running_since_s is not None and line.waiting == 5
        assert costs.analysis_s(1) == 0.0  # nothing measured yet
        analyzer.release.set()
        for future in [first, *later]:
            future.result(timeout=10)
        batcher.close()  # the worker has finished its last batch
        after = batcher.backlog()
        assert (after.running, after.queued, after.running_since_s) == (0, 0, None)
        assert costs.analysis_s(1) > 0.0 and costs.analysis_s(3) >= costs.analysis_s(1)
    finally:
        batcher.close()


def test_without_batching_nothing_waits_in_line(frontend):
    """The frontend's own analysis runs on each request's thread: no line, each call measured as one prompt."""
    from cosystream.engine.prompt_load import PromptCosts

    batcher = PromptBatcher(frontend)
    costs = PromptCosts()
    batcher.costs = lambda: costs
    line = batcher.backlog(new_recording=True)
    assert (line.queued, line.running, line.waiting) == (0, 0, 1)
    batcher.make_voice_prompt(_speech(1.0, seed=3))
    assert costs.analysis_s(1) > 0.0


LONG_WINDOW_S = 60.0  # far longer than any test's timeout: a batch that waited for it would fail the test


def _hand_over_together(batcher: PromptBatcher, recordings: list) -> list:
    """Requests handed to the batcher's threads as the engine does (`pool_for`), all of them before any starts
    its preparation: they arrive together."""
    assert batcher.executor is not None
    gate = threading.Event()

    def prepare(recording):
        gate.wait(timeout=10)
        return batcher.make_voice_prompt(recording, "a prompt.")

    futures = [batcher.executor.submit(prepare, recording) for recording in recordings]
    gate.set()
    return futures


def test_a_recording_that_arrives_alone_is_analysed_without_waiting_for_companions(frontend):
    analyzer = RecordingAnalyzer()
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=LONG_WINDOW_S)  # type: ignore[arg-type]
    try:
        alone = _hand_over_together(batcher, [_speech(1.0, seed=1)])[0]
        assert alone.result(timeout=10).prompt_speech_tokens.numel() > 0
        direct = batcher.make_voice_prompt(_speech(0.8, seed=2))  # not through the batcher's threads
        assert direct.xvector.numel() == 192
        assert analyzer.batches == [1, 1]
        assert batcher.backlog().waiting == 0
    finally:
        batcher.close()


def test_recordings_that_arrive_together_are_analysed_in_one_batch(frontend):
    """The batch opened by the first recording decoded waits for those still being decoded, however long their
    decoding takes within the window."""
    analyzer = RecordingAnalyzer()
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=LONG_WINDOW_S, max_batch=8)  # type: ignore[arg-type]
    recordings = [_speech(0.5 + 0.3 * seed, seed) for seed in range(5)]
    try:
        voices = [f.result(timeout=10) for f in _hand_over_together(batcher, recordings)]
        assert analyzer.batches == [len(recordings)]
        for recording, voice in zip(recordings, voices, strict=True):
            assert float(voice.xvector[0]) == pytest.approx(float(recording[0][0]))  # its own analysis
    finally:
        batcher.close()


def test_a_bad_recording_on_its_way_fails_alone_and_holds_no_batch(frontend):
    """A request whose recording cannot be decoded ends without reaching the batcher: its error is its own, and
    the batch waiting for it runs without waiting out the window."""
    from cosystream.errors import BadInput

    analyzer = RecordingAnalyzer()
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=LONG_WINDOW_S, max_batch=8)  # type: ignore[arg-type]
    good = [_speech(0.6, seed) for seed in (1, 2)]
    try:
        first, bad, second = _hand_over_together(batcher, [good[0], b"RIFF not a wav file", good[1]])
        with pytest.raises(BadInput):
            bad.result(timeout=10)
        assert first.result(timeout=10).xvector.numel() == second.result(timeout=10).xvector.numel() == 192
        assert analyzer.batches == [2]
        assert batcher.backlog().waiting == 0
        assert batcher.make_voice_prompt(_speech(0.7, seed=3)).xvector.numel() == 192  # still serving
    finally:
        batcher.close()


class AnnouncedUpload:
    """A request announced to the batcher while its body is still arriving (as the server's /v1/tts does), on a
    thread of its own (its own context): `arrive()` hands its recording over as the engine does, `fail()` ends it
    without one."""

    def __init__(self, batcher: PromptBatcher, recording) -> None:
        self.batcher, self.recording = batcher, recording
        self.announced, self.go, self.done = threading.Event(), threading.Event(), threading.Event()
        self.future = None
        self.arrives = True
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        assert self.announced.wait(timeout=10)

    def _run(self) -> None:
        with self.batcher.expecting_recording():
            self.announced.set()
            self.go.wait(timeout=10)
            if self.arrives:
                assert self.batcher.executor is not None
                self.future = self.batcher.executor.submit(self.batcher.make_voice_prompt, self.recording, "a prompt.")
        self.done.set()

    def arrive(self) -> None:
        self.go.set()
        self.thread.join(timeout=10)

    def fail(self) -> None:
        self.arrives = False
        self.arrive()


def test_a_batch_waits_for_a_recording_announced_before_its_upload_is_read(frontend):
    """The first upload of a burst opens a batch; another request of the burst, announced while its body is still
    being read, joins that batch when it arrives instead of forming one of its own after it."""
    analyzer = RecordingAnalyzer()
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=LONG_WINDOW_S, max_batch=8)  # type: ignore[arg-type]
    try:
        late = AnnouncedUpload(batcher, _speech(0.9, seed=4))
        first = _hand_over_together(batcher, [_speech(0.6, seed=3)])[0]
        assert not first.done() and not analyzer.batches  # waiting for the announced one
        late.arrive()
        assert first.result(timeout=10).xvector.numel() == late.future.result(timeout=10).xvector.numel() == 192
        assert analyzer.batches == [2]
        # the announcement went over to the request's preparation and ended with it: a lone recording waits for none
        assert batcher.make_voice_prompt(_speech(0.7, seed=5)).xvector.numel() == 192
        assert analyzer.batches == [2, 1]
    finally:
        batcher.close()


def test_an_announced_upload_without_a_recording_holds_no_batch(frontend):
    """An announced request that ends without a recording (its body held none, or was bad) lets the batch that
    waits for it go at once, and is not counted again later."""
    analyzer = RecordingAnalyzer()
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=LONG_WINDOW_S, max_batch=8)  # type: ignore[arg-type]
    try:
        late = AnnouncedUpload(batcher, None)
        first = _hand_over_together(batcher, [_speech(0.6, seed=6)])[0]
        late.fail()
        assert first.result(timeout=10).xvector.numel() == 192
        assert analyzer.batches == [1]
        with batcher.expecting_recording() as withdraw:  # withdrawn early: leaving the block does not count it twice
            withdraw()
            withdraw()
        assert batcher.make_voice_prompt(_speech(0.7, seed=7)).xvector.numel() == 192
        assert analyzer.batches == [1, 1] and batcher.backlog().waiting == 0
    finally:
        batcher.close()


def test_without_batching_an_announcement_changes_nothing(frontend):
    batcher = PromptBatcher(frontend)
    with batcher.expecting_recording() as withdraw:
        withdraw()
    assert batcher.make_voice_prompt(_speech(0.5, seed=8)).xvector.numel() == 192


def test_the_calling_thread_learns_how_long_its_analysis_took(frontend):
    """take_analysis_s: the seconds of this thread's last `analyse` (its wait for the batch included), once."""
    import time

    analyzer = GatedAnalyzer()
    batcher = PromptBatcher(frontend, analyzer, collect_window_s=0.0)  # type: ignore[arg-type]
    held_s = 0.05

    def release_after_hold() -> None:
        assert analyzer.started.wait(timeout=10)
        time.sleep(held_s)  # the batch the prompt waits for takes this long
        analyzer.release.set()

    helper = threading.Thread(target=release_after_hold)
    try:
        helper.start()
        started = time.perf_counter()
        batcher.analyse(_prompt(1.0))
        outer = time.perf_counter() - started
        helper.join(timeout=10)
        taken = batcher.take_analysis_s()
        assert held_s <= taken <= outer
        assert batcher.take_analysis_s() == 0.0  # once
        other: list[float] = []
        thread = threading.Thread(target=lambda: other.append(batcher.take_analysis_s()))
        thread.start()
        thread.join(timeout=10)
        assert other == [0.0]  # another thread made no call
    finally:
        analyzer.release.set()
        batcher.close()


def test_a_requests_times_show_its_recordings_part_of_the_frontend(engine):
    """A new recording's preparation (decoding, analysis, transcript) is `prompt_s` of the request's frontend_s;
    sent again it is reused and takes next to nothing. The batched analysis is part of it where the engine
    batches (CUDA); a CPU engine analyses on the frontend thread: none to report."""
    recording = _speech(1.2, seed=21)

    def zero_shot():
        return engine.synthesize(SynthesisParams(text="hello there.", prompt_audio=recording, prompt_text="a prompt.",
                                                 force_tokens=4)).times

    new = zero_shot()
    assert 0.0 < new.prompt_s <= new.frontend_s
    if engine.async_engine.prompt_batcher.batched:
        assert 0.0 < new.prompt_analysis_s <= new.prompt_s
    else:
        assert new.prompt_analysis_s == 0.0
    again = zero_shot()
    assert again.prompt_s < new.prompt_s


def test_warm_up_analyses_a_recording_at_each_upload_rate_and_measures_nothing(frontend):
    analyzer = GatedAnalyzer()
    analyzer.release.set()
    seen: list[int] = []
    original = analyzer.analyse

    def analyse(prompts: list[PromptAudio]) -> list[PromptAnalysis]:
        seen.extend(p.sample_rate for p in prompts)
        return original(prompts)

    analyzer.analyse = analyse  # type: ignore[method-assign]
    observed: list[tuple[int, float]] = []

    class Costs:
        def observe_analysis(self, prompts: int, seconds: float) -> None:
            observed.append((prompts, seconds))

    batcher = PromptBatcher(frontend, analyzer)  # type: ignore[arg-type]
    batcher.costs = Costs  # type: ignore[assignment]
    try:
        assert batcher.warm_up() == 1 + len(WARM_UP_RATES)
        assert analyzer.batches[0] == 1 and sum(analyzer.batches) == 1 + len(WARM_UP_RATES)  # alone, then together
        assert sorted(seen[1:]) == sorted(WARM_UP_RATES)
        assert observed == [] and batcher.stats.prompts == 0  # admission's costs and the stats: requests only
        batcher.submit(_prompt(2.0)).result(timeout=10)  # a request afterwards is measured as before
        assert len(observed) == 1 and batcher.stats.prompts == 1
    finally:
        batcher.close()


def test_warm_up_without_batched_analysis_does_nothing(frontend):
    assert PromptBatcher(frontend).warm_up() == 0
