"""PromptBatcher: the analysis of prompt recordings sent with requests, batched on the GPU.

Frontend threads call `make_voice_prompt` as they would call the frontend's. On a CUDA device the
checked audio goes to one worker thread that runs `TorchPromptAnalyzer` on everything that has
arrived: the first prompt opens a batch, which takes whatever is already waiting and, while other
recordings are on their way (requests handed to the batcher's threads, `executor`, still decoding
theirs), whatever arrives within `COLLECT_WINDOW_S` (up to `MAX_BATCH`); prompts that arrive while
the worker is busy form the next batch. A recording that arrives alone is analysed at once: no
companion is on its way, so waiting could only delay it. A request whose recording is still being
uploaded counts as on its way too from the moment the server announces it (`expecting_recording`, around
reading an HTTP body): a burst of uploads meets in one batch, as a burst of in-process requests does, even
though the event loop reads and parses their bodies one after another. Waiting is on a queue (no sleeping, no
polling). Decoding, resampling and the transcript stay on the calling thread, so they run in
parallel with the GPU work.

Admission reads `backlog()` (recordings waiting and the batch running) and, through `costs`, the measured
seconds of each analysis (engine/prompt_load.py).

On the CPU, or where the torch runner cannot run the model's graphs, the frontend's ONNX
analysis is used unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from cosystream.checkpoint import Checkpoint
from cosystream.engine.prompt_load import PromptBacklog, PromptCosts
from cosystream.errors import CosyStreamError
from cosystream.frontend import AudioInput, Frontend, VoicePrompt
from cosystream.frontend.audio import PromptAudio, voiced_signal
from cosystream.frontend.onnx_torch import UnsupportedGraph
from cosystream.frontend.torch_prompt import PromptAnalysis, TorchPromptAnalyzer
from cosystream.params import SynthesisParams

log = logging.getLogger(__name__)

COLLECT_WINDOW_S = 0.030  # how long a batch stays open for recordings on their way (being decoded) when it opens
MAX_BATCH = 16  # prompts per batch; a burst larger than this becomes several batches
# float32 keeps the official tokens; benchmarks/prompt_analysis.py measures what bf16/fp16 change
ANALYSIS_DTYPE = torch.float32
# 0: CAM++ on the GPU; N > 0: CAM++ on onnxruntime on the CPU, N prompts at once, beside the GPU work
# (benchmarks/prompt_analysis.py --speaker-threads measures which is faster for prompts of distinct lengths)
SPEAKER_THREADS = 0
# where CAM++ stays on the ONNX interpreter (a graph other than the released one), its calls (one per distinct
# prompt length) run on this many threads at once, each on its own CUDA stream (benchmarks/prompt_analysis.py
# --graph-threads measures what it gains)
GRAPH_THREADS = 1


@dataclass
class _Job:
    prompt: PromptAudio
    future: Future = field(default_factory=Future)
    warm_up: bool = False  # a synthetic recording of the warm-up: not a request, not a measurement


# the upload rates the warm-up's recordings come at (each resampled to 16 kHz and the flow's rate on first use)
WARM_UP_RATES = (16000, 22050, 24000, 44100, 48000)
WARM_UP_SECONDS = 3.0


class _Wake:
    """Queued when a recording on its way will not come (its request failed before its analysis): a batch waiting
    for it stops waiting."""


_WAKE = _Wake()


class _Announced:
    """A request announced by `expecting_recording` while it still counts as on its way."""

    def __init__(self) -> None:
        self.counted = True


# the announcement of the request running in this context: its hand-over to the batcher's threads takes it over
_ANNOUNCED: contextvars.ContextVar[_Announced | None] = contextvars.ContextVar("cosystream_recording_announced",
                                                                              default=None)


@dataclass
class BatcherStats:
    batches: int = 0
    prompts: int = 0
    largest_batch: int = 0


class PromptBatcher:
    """`make_voice_prompt(audio, text)` for the engine: batched torch analysis, or the frontend's own."""

    def __init__(self, frontend: Frontend, analyzer: TorchPromptAnalyzer | None = None,
                 collect_window_s: float = COLLECT_WINDOW_S, max_batch: int = MAX_BATCH) -> None:
        self.frontend = frontend
        self.analyzer = analyzer
        self.collect_window_s = collect_window_s
        self.max_batch = max_batch
        self.stats = BatcherStats()
        # where each analysis's seconds go: in an engine, the scheduler's PromptCosts (asked at each analysis)
        self.costs: Callable[[], PromptCosts] | None = None
        self._line = threading.Lock()  # guards the three counts below (frontend threads and the worker)
        self._queued = 0  # submitted, not in a batch yet
        self._running = 0  # in the batch analysed now ...
        self._running_since: float | None = None  # ... since then (time.perf_counter)
        self._on_the_way = 0  # requests handed to `executor` that have neither submitted their recording nor ended
        self._preparing = threading.local()  # per executor thread: does its request count in `_on_the_way`?
        self._waited = threading.local()  # per calling thread: its last `analyse` call's seconds (take_analysis_s)
        self._queue: queue.SimpleQueue[_Job | _Wake | None] = queue.SimpleQueue()
        self._closed = False
        self._stream = (torch.cuda.Stream(analyzer.device)
                        if analyzer is not None and analyzer.device.type == "cuda" else None)
        self._thread: threading.Thread | None = None
        # Requests that bring a recording are prepared on these threads: each one mostly waits for its batch,
        # so a burst needs as many threads as a batch holds (the engine's frontend pool is kept small).
        self.executor: ThreadPoolExecutor | None = None
        if analyzer is not None:
            self.executor = _ArrivalsPool(self, max_workers=max_batch)
            self._thread = threading.Thread(target=self._serve, name="prompt-analysis", daemon=True)
            self._thread.start()

    @classmethod
    def for_engine(cls, frontend: Frontend, checkpoint: Checkpoint, device: str,
                   use_torch: bool | None = None) -> PromptBatcher:
        """Torch analysis on CUDA devices (or when `use_torch`), else the frontend's ONNX analysis."""
        if use_torch is None:
            use_torch = torch.device(device).type == "cuda"
        if not use_torch:
            return cls(frontend)
        try:
            analyzer = TorchPromptAnalyzer.from_checkpoint(checkpoint, device, ANALYSIS_DTYPE, SPEAKER_THREADS,
                                                           GRAPH_THREADS)
        except UnsupportedGraph as exc:
            log.warning("prompt analysis stays on onnxruntime: %s", exc)
            return cls(frontend)
        return cls(frontend, analyzer)

    @property
    def batched(self) -> bool:
        return self.analyzer is not None

    def pool_for(self, params: SynthesisParams, default: Executor) -> Executor:
        """Where to prepare a request: this batcher's threads when it brings a recording to analyse in a batch."""
        if self.executor is not None and params.prompt_audio is not None:
            return self.executor
        return default

    def make_voice_prompt(self, audio: AudioInput, prompt_text: str = "") -> VoicePrompt:
        """What `Frontend.make_voice_prompt` returns, with the audio analysed in a batch when batching."""
        if self.analyzer is None:
            t0 = time.perf_counter()
            prompt = self.frontend.make_voice_prompt(audio, prompt_text)
            self._observe(1, time.perf_counter() - t0)  # the frontend's own analysis, one prompt per thread
            return prompt
        return self.frontend.make_voice_prompt(audio, prompt_text, analyse=self.analyse)

    def backlog(self, new_recording: bool = False) -> PromptBacklog:
        """The analysis as a request arriving now finds it (its own recording new or not). Without batching,
        each recording is analysed on its own frontend thread: nothing waits in line."""
        if self.analyzer is None:
            return PromptBacklog(new_recording, max_batch=1)
        with self._line:
            return PromptBacklog(new_recording, self._queued, self._running, self._running_since, self.max_batch)

    def _observe(self, prompts: int, seconds: float) -> None:
        if self.costs is not None:
            self.costs().observe_analysis(prompts, seconds)

    def analyse(self, prompt: PromptAudio) -> PromptAnalysis:
        """Blocking: the analysis of one checked prompt, computed with whatever arrives with it."""
        started = time.perf_counter()
        try:
            return self.submit(prompt).result()
        finally:
            self._waited.seconds = time.perf_counter() - started

    def warm_up(self) -> int:
        """Analyse a synthetic recording at each of WARM_UP_RATES before serving, alone and then together, so
        that whatever the analysis's kernels cost on first use in a process (run-time compiled kernels, FFT plans,
        resampling filters) is not paid by the first requests. Not a measurement: admission's analysis costs
        and the stats stay untouched. Returns the recordings analysed (0 without batched analysis)."""
        if self.analyzer is None:
            return 0
        prompts = [PromptAudio(voiced_signal(WARM_UP_SECONDS, rate, seed=0), rate) for rate in WARM_UP_RATES]
        self._warm(prompts[:1])
        self._warm(prompts)
        return 1 + len(prompts)

    def _warm(self, prompts: Sequence[PromptAudio]) -> None:
        for future in [self.submit(prompt, warm_up=True) for prompt in prompts]:
            future.result()

    def take_analysis_s(self) -> float:
        """Seconds of this thread's last `analyse` call (the hand-off, the wait for its batch, the batch's
        analysis, the result back), then forgotten; 0.0 if it made none since."""
        seconds = getattr(self._waited, "seconds", 0.0)
        self._waited.seconds = 0.0
        return seconds

    def submit(self, prompt: PromptAudio, warm_up: bool = False) -> Future:
        if self._closed or self.analyzer is None:
            raise CosyStreamError("prompt analysis: the batcher is closed")
        job = _Job(prompt, warm_up=warm_up)
        with self._line:
            self._queued += 1
            if getattr(self._preparing, "counted", False):  # its request is no longer on its way: it is queued
                self._preparing.counted = False
                self._on_the_way -= 1
        self._queue.put(job)
        return job.future

    # ------------------------------------------------------- requests on their way (see _ArrivalsPool)
    @contextlib.contextmanager
    def expecting_recording(self) -> Iterator[Callable[[], None]]:
        """The request running in this context is about to bring a recording (its body is still arriving):
        it counts as on its way from now until it is handed to the batcher's threads (which count it from then
        on) or, failing that, until the block ends or the yielded function is called (say, its body held no
        recording after all). A batch opened meanwhile waits for it, within its window. No-op without batching."""
        if self.executor is None:
            yield lambda: None
            return
        mark = _Announced()
        with self._line:
            self._on_the_way += 1
        token = _ANNOUNCED.set(mark)

        def withdraw() -> None:
            if mark.counted:
                mark.counted = False
                self._gone()

        try:
            yield withdraw
        finally:
            _ANNOUNCED.reset(token)
            withdraw()

    def _arriving(self) -> None:
        mark = _ANNOUNCED.get()
        if mark is not None and mark.counted:  # announced: it counts already, now as a request in preparation
            mark.counted = False
            return
        with self._line:
            self._on_the_way += 1

    def _prepare(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a request's preparation on an executor thread; it counts as on its way until it submits its
        recording (`submit`) or ends without one (a bad recording, a recording seen before)."""
        self._preparing.counted = True
        try:
            return fn(*args, **kwargs)
        finally:
            if self._preparing.counted:
                self._preparing.counted = False
                self._gone()

    def _gone(self) -> None:
        """A request counted as on its way ends without submitting: a batch waiting for it need not wait."""
        with self._line:
            self._on_the_way -= 1
        self._queue.put(_WAKE)

    def close(self) -> None:
        """Stop the worker after the batches already queued; later submissions are refused."""
        self._closed = True
        if self.executor is not None:
            self.executor.shutdown(wait=False)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        if self.analyzer is not None:
            self.analyzer.close()
        while True:  # a submission that raced with closing: its caller must not wait forever
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Job):
                job.future.set_exception(CosyStreamError("prompt analysis: the engine is closing"))

    # ------------------------------------------------------------------ worker
    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            if first is _WAKE:
                continue
            batch, stop = self._collect(first)
            with self._line:
                self._queued -= len(batch)
                self._running, self._running_since = len(batch), time.perf_counter()
            try:
                self._run(batch)
            finally:
                with self._line:
                    self._running, self._running_since = 0, None
            if stop:
                return

    def _collect(self, first: _Job) -> tuple[list[_Job], bool]:
        """The opened batch plus what is already waiting and, while other recordings are on their way, what
        arrives within the window; True on shutdown."""
        batch = [first]
        deadline = time.monotonic() + self.collect_window_s
        while len(batch) < self.max_batch:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._companions_coming(len(batch)):
                    break
                try:
                    job = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if job is None:
                return batch, True
            if isinstance(job, _Job):
                batch.append(job)
        return batch, False

    def _companions_coming(self, taken: int) -> bool:
        """Is a recording on its way (being decoded), or submitted and about to reach the queue?"""
        with self._line:
            return self._on_the_way > 0 or self._queued > taken

    def _run(self, batch: Sequence[_Job]) -> None:
        t0 = time.perf_counter()
        try:
            results = self._analyse([job.prompt for job in batch])
        except Exception as exc:  # one bad prompt must not fail the others: retry each alone
            if len(batch) > 1:
                for job in batch:
                    self._run([job])
            else:
                batch[0].future.set_exception(exc)
            return
        if not all(job.warm_up for job in batch):
            self._observe(len(batch), time.perf_counter() - t0)
            self.stats.batches += 1
            self.stats.prompts += len(batch)
            self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
        for job, result in zip(batch, results, strict=True):
            job.future.set_result(result)

    def _analyse(self, prompts: list[PromptAudio]) -> list[PromptAnalysis]:
        assert self.analyzer is not None
        if self._stream is None:
            return self.analyzer.analyse(prompts)
        # its own stream: the engine thread's LM and flow work on the default stream is not serialised behind it
        with torch.cuda.stream(self._stream):
            return self.analyzer.analyse(prompts)


class _ArrivalsPool(ThreadPoolExecutor):
    """The batcher's frontend threads: a request handed over counts as on its way (`PromptBatcher._on_the_way`)
    from then until it submits its recording or ends, so an open batch waits for it and for nothing else."""

    def __init__(self, batcher: PromptBatcher, max_workers: int) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix="prompt-frontend")
        self._batcher = batcher

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        self._batcher._arriving()
        try:
            return super().submit(self._batcher._prepare, fn, *args, **kwargs)
        except BaseException:  # shut down: the request never starts
            self._batcher._gone()
            raise
