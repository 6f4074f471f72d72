"""Prompt analysis with torch on any device, batched: speech tokens, CAM++ x-vector and the flow's prompt mel.

The same analysis as `Frontend.make_voice_prompt` (spec/frontend.md §4-§6), for a list of prompts at
once: the three spectral front ends run on the device, and the two official ONNX models run through
`TorchOnnxGraph` (the exact graphs, in torch) in as few calls as their graphs allow:

* `padded`: prompts of any lengths in one call, zero-padded, with the per-prompt lengths as the
  graph's length input (the speech tokenizer's `feats_length`);
* `same_length`: one call per group of prompts with the same number of frames;
* `single`: one call per prompt.

Which mode a graph allows is measured when it is loaded, not assumed (`probe_batching`): the graph
must give each prompt of a batch the result it gives that prompt alone, with loud noise in the
padding. Results are CPU tensors, equal to the unbatched ones.

On CUDA the padded tokenizer's calls replay CUDA graphs of shape buckets, captured over the interpreter at load
and checked against its eager calls (`padded_graphs.PaddedGraphs`), so its few hundred operator calls a call
become one launch.

CAM++ runs as a hand-written network with the graph's weights (`campplus.CamPlusPlus`), all prompts of
any lengths in one call, when the graph has the released architecture and the network reproduces it on
the analysis device at load (`campplus.load_fast_campplus`); otherwise (another graph, another dtype than
float32, `fast_campplus=False`) the graph runs through `TorchOnnxGraph` in its probed batch mode.

The calls of a `same_length` or `single` graph (CAM++ over prompts of distinct lengths: one call each)
may run on `threads` threads at once, each on its own CUDA stream: a call of a small network is bound
by the host's work per operator, and torch releases the GIL inside each operator.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from cosystream.checkpoint import Checkpoint, MelDims
from cosystream.frontend.audio import (
    FBANK_FRAME,
    FBANK_SHIFT,
    MAX_PROMPT_S,
    TOKENIZER_SAMPLE_RATE,
    WHISPER_HOP,
    PromptAudio,
    prompt_mel,
    speaker_features,
    whisper_log_mel,
)
from cosystream.frontend.campplus import CamPlusPlus, load_fast_campplus
from cosystream.frontend.onnx_torch import TorchOnnxGraph, UnsupportedGraph, torch_dtype
from cosystream.frontend.padded_graphs import PaddedGraphs, capture_shapes
from cosystream.frontend.speaker import SpeakerEncoder
from cosystream.transfers import to_device

BATCH_MODES = ("padded", "same_length", "single")
FAST_SPEAKER_MODE = "campplus_module"  # speaker_mode while the batched CAM++ network runs
# With CAM++ on CUDA graphs, the graphs of calls up to this many prompts (the engine's prompt batches) of up to
# MAX_PROMPT_S are captured at load
GRAPH_ROWS = 16
PROBE_SEED = 20240538
PROBE_FRAMES = (61, 64, 67, 130)  # feature lengths the probe runs: several residues mod 4 and one longer
PROBE_PAD_STD = 8.0  # padding noise far outside the features' range, so a graph that reads it shows it
PROBE_FLOAT_TOL = 1e-3  # relative: batched float outputs (x-vectors) vs the same prompt alone


@dataclass(frozen=True, eq=False)
class PromptAnalysis:
    """One prompt's raw analysis, before alignment (CPU tensors)."""

    tokens: torch.Tensor  # int32 [P'], 25 Hz speech tokens
    mel: torch.Tensor  # float32 [F', num_mels], the flow's prompt mel
    xvector: torch.Tensor  # float32 [192], CAM++ output (not normalised)


class BatchedGraph:
    """An ONNX side model with one float sequence input (+ an optional int length input), run batched.

    `sequence_axis` is the time axis of the float input in the graph's layout ([1, 128, T] for the
    speech tokenizer: 2; [1, T, 80] for CAM++: 1).
    """

    def __init__(self, graph: TorchOnnxGraph, sequence_axis: int) -> None:
        self.graph = graph
        self.sequence_axis = sequence_axis
        names = graph.input_names
        self.feature_name = names[0]  # PARITY: the official frontend addresses the inputs by position
        self.length_name = names[1] if len(names) > 1 else None
        # the declared type of the length input (int32 in the released tokenizers)
        self.length_dtype = torch_dtype(graph.input_types.get(self.length_name, 6)) if self.length_name else torch.int32
        self.output_name = graph.output_names[0]
        self.frames_per_output: int | None = None  # set by the probe for graphs with a length input
        self.mode = "single"
        self.threads = 1  # calls run at once when a list needs several (see the module's docstring)
        self._pool: ThreadPoolExecutor | None = None
        # padded calls replayed as CUDA graphs of shape buckets (set by TorchPromptAnalyzer on CUDA; see
        # padded_graphs.py); a call without a graph of its shape runs eagerly
        self.graphs: PaddedGraphs | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def run(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-prompt features [C, T_i] (feature axis first) -> one output row per prompt."""
        if self.mode == "padded" and (len(features) > 1 or (self.graphs is not None and len(features) == 1)):
            return self._run_padded(features)
        groups: dict[int, list[int]] = {}
        for index, feats in enumerate(features):
            key = feats.shape[-1] if self.mode == "same_length" else index
            groups.setdefault(key, []).append(index)
        calls = [(torch.stack([features[i] for i in members]), [features[i].shape[-1] for i in members])
                 for members in groups.values()]
        results: list[torch.Tensor | None] = [None] * len(features)
        for members, rows in zip(groups.values(), self._call_all(calls), strict=True):
            for i, row in zip(members, rows, strict=True):
                results[i] = row
        return _complete(results)

    def _call_all(self, calls: list[tuple[torch.Tensor, list[int]]]) -> list[list[torch.Tensor]]:
        """`_call` of each (batch, lengths), on up to `threads` threads at once (each on a CUDA stream of its own,
        ordered after the caller's stream, which waits for them before the rows are used)."""
        if self.threads <= 1 or len(calls) < 2:
            return [self._call(batch, lengths) for batch, lengths in calls]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="graph-call")
        device = self.graph.ctx.device
        if device.type != "cuda":
            return list(self._pool.map(lambda call: self._call(*call), calls))
        caller = torch.cuda.current_stream(device)

        def on_own_stream(call: tuple[torch.Tensor, list[int]]) -> tuple[list[torch.Tensor], torch.cuda.Stream]:
            stream = _thread_stream(device)
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                rows = self._call(*call)
            for row in rows:
                row.record_stream(caller)  # the caller's stream reads it: not reused before that work is done
            return rows, stream

        done = list(self._pool.map(on_own_stream, calls))
        for _, stream in done:
            caller.wait_stream(stream)
        return [rows for rows, _ in done]

    def _run_padded(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # longest first: a graph may size its output by the first length of the batch
        order = sorted(range(len(features)), key=lambda i: -features[i].shape[-1])
        rows = self.graphs.run([features[i] for i in order]) if self.graphs is not None else None
        if rows is None:
            longest = features[order[0]].shape[-1]
            batch = features[order[0]].new_zeros(len(features), features[order[0]].shape[0], longest)
            for row, i in enumerate(order):
                batch[row, :, : features[i].shape[-1]] = features[i]
            rows = self._call(batch, [features[i].shape[-1] for i in order])
        results: list[torch.Tensor | None] = [None] * len(features)
        for row, i in enumerate(order):
            results[i] = rows[row][: self.outputs_for(features[i].shape[-1])]
        return _complete(results)

    def outputs_for(self, frames: int) -> int:
        assert self.frames_per_output is not None, "only padded graphs slice their rows"
        return math.ceil(frames / self.frames_per_output)

    def call_eager(self, batch: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        """One interpreted call (never a replay): batch [B, C, T] and each row's length -> B output rows."""
        return self._call(batch, lengths)

    def _call(self, batch: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        """batch [B, C, T] -> B output rows (the graph's own output shape, batch axis dropped)."""
        feats = batch if self.sequence_axis == 2 else batch.transpose(1, 2)
        inputs = {self.feature_name: feats}
        if self.length_name is not None:
            inputs[self.length_name] = torch.tensor(lengths, dtype=self.length_dtype)
        out = self.graph(inputs)[self.output_name]
        if batch.shape[0] == 1 and (out.ndim < 2 or out.shape[0] != 1):  # a graph that flattens its output
            return [out.reshape(-1)]
        if out.shape[0] != batch.shape[0]:
            raise RuntimeError(f"{self.graph.path.name}: {out.shape[0]} output rows for a batch of {batch.shape[0]}")
        return list(out.unbind(0))

    # -------------------------------------------------------------- probing
    def probe_batching(self, channels: int) -> str:
        """Measure which batch mode reproduces the single-prompt results; sets and returns `mode`."""
        gen = torch.Generator().manual_seed(PROBE_SEED)
        device, dtype = self.graph.ctx.device, torch.float32
        feats = [torch.randn(channels, t, generator=gen).to(device, dtype) for t in PROBE_FRAMES]
        self.mode = "single"
        alone = [self._call(f[None], [f.shape[-1]])[0] for f in feats]
        paddable = self.length_name is not None and self._output_rate(feats, alone)
        if paddable and self._padding_ignored(feats, alone, gen):
            self.mode = "padded"
        elif self._same_length_ok(feats[0], alone[0], gen):
            self.mode = "same_length"
        return self.mode

    def _output_rate(self, feats: list[torch.Tensor], alone: list[torch.Tensor]) -> bool:
        """A padded batch needs each prompt's output length: the graph must give ceil(T / r) outputs."""
        if any(out.ndim != 1 for out in alone):
            return False
        longest = max(range(len(feats)), key=lambda i: feats[i].shape[-1])
        rate = round(feats[longest].shape[-1] / max(alone[longest].shape[0], 1))
        if rate < 1 or any(out.shape[0] != math.ceil(f.shape[-1] / rate) for f, out in zip(feats, alone, strict=True)):
            return False
        self.frames_per_output = rate
        return True

    def _padding_ignored(self, feats: list[torch.Tensor], alone: list[torch.Tensor], gen: torch.Generator) -> bool:
        try:
            order = sorted(range(len(feats)), key=lambda i: -feats[i].shape[-1])
            longest = feats[order[0]].shape[-1]
            noise = PROBE_PAD_STD * torch.randn(len(feats), feats[0].shape[0], longest, generator=gen)
            batch = noise.to(feats[0].device)
            for row, i in enumerate(order):
                batch[row, :, : feats[i].shape[-1]] = feats[i]
            rows = self._call(batch, [feats[i].shape[-1] for i in order])
            return all(_same(rows[row][: alone[i].shape[0]], alone[i]) for row, i in enumerate(order))
        except (RuntimeError, ValueError, IndexError):  # the graph cannot take this batch at all
            return False

    def _same_length_ok(self, feats: torch.Tensor, alone: torch.Tensor, gen: torch.Generator) -> bool:
        other = torch.randn(feats.shape, generator=gen).to(feats.device)
        try:
            rows = self._call(torch.stack([other, feats]), [feats.shape[-1]] * 2)
        except (RuntimeError, ValueError, IndexError):
            return False
        return _same(rows[1], alone)


_THREAD_STREAMS = threading.local()


def _thread_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's own CUDA stream on `device` (made once)."""
    streams = getattr(_THREAD_STREAMS, "by_device", None)
    if streams is None:
        streams = _THREAD_STREAMS.by_device = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


@contextlib.contextmanager
def ieee_float32(active: bool) -> Iterator[None]:
    """No TF32 in float32 convolutions and matmuls while active. cuDNN convolutions use TF32 by default
    (about 1e-3 relative error), enough to move a value across an FSQ rounding boundary and change a token;
    the official tokens are computed in IEEE float32. The flags are process-wide, so they are lowered only
    for the analysis and restored after it (the engine's float32 kernels outside captured graphs run in
    IEEE float32 meanwhile: slower, never less exact)."""
    if not active:
        yield
        return
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _complete(results: list[torch.Tensor | None]) -> list[torch.Tensor]:
    missing = [i for i, r in enumerate(results) if r is None]
    assert not missing, f"no result for prompts {missing}"
    return [r for r in results if r is not None]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if not a.dtype.is_floating_point:
        return bool(torch.equal(a, b))
    scale = float(b.float().abs().max()) or 1.0
    return float((a.float() - b.float()).abs().max()) <= PROBE_FLOAT_TOL * scale


class TorchPromptAnalyzer:
    """Speech tokenizer (v2 or v3) + CAM++ + the three spectral front ends, in torch, for lists of prompts.

    `fold_shapes=False` interprets every node of the two graphs on every call (see `TorchOnnxGraph`), to
    measure what the folding saves. `graph_threads` > 1 runs that many calls of a graph at once where a list
    needs several (CAM++ over prompts of distinct lengths; see `BatchedGraph`).

    `speaker_threads` > 0 runs CAM++ on onnxruntime on the CPU instead, that many prompts at once, while
    the device computes the tokens and mels: an option for a CAM++ graph that cannot batch prompts of
    different lengths (its batch mode is measured), where one device call per prompt may cost more than
    parallel CPU runs (benchmarks/prompt_analysis.py measures both).

    `fast_campplus` (the default) runs CAM++ as `campplus.CamPlusPlus` where the graph allows it (see the
    module's docstring); `speaker_fallback` then is None, else it says why the graph runs instead. On CUDA its
    calls are padded to shape buckets and replayed as CUDA graphs, all captured here (for up to GRAPH_ROWS
    prompts of up to MAX_PROMPT_S).

    `tokenizer_graphs` (the default) replays the padded tokenizer's calls as CUDA graphs of shape buckets on CUDA in
    float32, all captured and self-checked here (padded_graphs.py); `tokenizer_fallback` then is None, else it says
    why the tokenizer runs operator by operator (off CUDA, another dtype, another batch mode, a failed check).

    Not thread-safe: one caller at a time (the engine's prompt batcher owns one).
    """

    def __init__(self, speech_tokenizer: str | Path, campplus: str | Path, mel_dims: MelDims,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 speaker_threads: int = 0, fold_shapes: bool = True, graph_threads: int = 1,
                 fast_campplus: bool = True, tokenizer_graphs: bool = True) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.mel_dims = mel_dims
        # on CUDA, CAM++ and the prompt mels run on this stream beside the speech tokenizer (see `analyse`)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.tokenizer = BatchedGraph(TorchOnnxGraph(speech_tokenizer, self.device, dtype, fold_shapes),
                                      sequence_axis=2)
        channels = _feature_channels(self.tokenizer, axis=1)
        with self._exact():
            self.tokenizer.probe_batching(channels)
            self.tokenizer_fallback = self._graph_tokenizer(channels) if tokenizer_graphs else \
                "the tokenizer's CUDA graphs are switched off (tokenizer_graphs=False)"
        self.speaker: BatchedGraph | None = None
        self.fast_speaker: CamPlusPlus | None = None
        self.speaker_fallback: str | None = None  # why CAM++ is not the batched module, when it is not
        self._cpu_speaker: SpeakerEncoder | None = None
        self._speaker_pool: ThreadPoolExecutor | None = None
        if speaker_threads > 0:
            self._cpu_speaker = SpeakerEncoder(campplus)
            self._speaker_pool = ThreadPoolExecutor(speaker_threads, thread_name_prefix="campplus")
            self.speaker_fallback = "CAM++ runs on onnxruntime on the CPU (speaker_threads > 0)"
        else:
            self.speaker = BatchedGraph(TorchOnnxGraph(campplus, self.device, dtype, fold_shapes), sequence_axis=1)
            with self._exact():
                if fast_campplus:
                    self.fast_speaker, self.speaker_fallback = load_fast_campplus(self.speaker.graph)
                else:
                    self.speaker_fallback = "the batched CAM++ module is switched off (fast_campplus=False)"
                if self.fast_speaker is None:
                    self.speaker.probe_batching(channels=_feature_channels(self.speaker, axis=2))
                else:
                    longest = 1 + (int(MAX_PROMPT_S * TOKENIZER_SAMPLE_RATE) - FBANK_FRAME) // FBANK_SHIFT
                    self.fast_speaker.capture_buckets(longest, GRAPH_ROWS)
            self.speaker.threads = graph_threads

    def _graph_tokenizer(self, channels: int) -> str | None:
        """On CUDA, in float32, with a padded tokenizer: capture its calls' CUDA graphs, for every bucket of up to
        GRAPH_ROWS prompts of up to MAX_PROMPT_S (padded_graphs.py). None when they replay, else why not."""
        if self.device.type != "cuda":
            return "no CUDA graphs off CUDA"
        if self.dtype != torch.float32:
            return f"the tokenizer's CUDA graphs run in float32 only (analysis dtype {self.dtype})"
        if self.tokenizer.mode != "padded":
            return f"the tokenizer's CUDA graphs need the padded batch mode (probed: {self.tokenizer.mode})"
        # a fast path never stops the analysis from loading: whatever fails here leaves the interpreter in charge
        try:
            graphs = PaddedGraphs(self.tokenizer, channels)
        except Exception as exc:  # noqa: BLE001 (out of memory for its buffers)
            return f"the tokenizer's CUDA graphs could not be set up: {exc!r}"
        graphs.capture(capture_shapes(GRAPH_ROWS, int(MAX_PROMPT_S * TOKENIZER_SAMPLE_RATE) // WHISPER_HOP))
        if graphs.disabled is not None:
            return graphs.disabled
        self.tokenizer.graphs = graphs
        return None

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, speaker_threads: int = 0,
                        graph_threads: int = 1, fast_campplus: bool = True,
                        tokenizer_graphs: bool = True) -> TorchPromptAnalyzer:
        files = checkpoint.files
        return cls(files.speech_tokenizer, files.campplus, checkpoint.hparams.mel, device, dtype, speaker_threads,
                   graph_threads=graph_threads, fast_campplus=fast_campplus, tokenizer_graphs=tokenizer_graphs)

    @property
    def speaker_mode(self) -> str:
        """How CAM++ runs: FAST_SPEAKER_MODE (the batched module, every prompt in one call), a batch mode of
        BATCH_MODES of the graph on the device, or on the CPU."""
        if self.fast_speaker is not None:
            return FAST_SPEAKER_MODE
        return self.speaker.mode if self.speaker is not None else "onnxruntime_cpu"

    def close(self) -> None:
        """Stop the CPU speaker threads and the graphs' call threads, if any."""
        if self._speaker_pool is not None:
            self._speaker_pool.shutdown(wait=False)
        for graph in (self.tokenizer, self.speaker):
            if graph is not None:
                graph.close()

    def _exact(self) -> contextlib.AbstractContextManager[None]:
        return ieee_float32(self.dtype == torch.float32 and self.device.type == "cuda")

    def tokenize(self, wavs_16k: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """16 kHz waveforms [N_i] -> raw speech tokens, int32 [~N_i / 640] each (CPU)."""
        with self._exact():
            return [t.to("cpu", torch.int32) for t in self._tokens(wavs_16k)]

    def embed(self, wavs_16k: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """16 kHz waveforms -> CAM++ x-vectors, float32 [192] each (CPU)."""
        if self._speaker_pool is not None:
            return [f.result() for f in self._cpu_xvectors(wavs_16k)]
        with self._exact():
            return [x.to("cpu", torch.float32) for x in self._xvectors(wavs_16k)]

    def mels(self, wavs_24k: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Flow-rate waveforms -> prompt mels, float32 [M_i // hop, num_mels] each (CPU)."""
        with self._exact():
            return [m.cpu() for m in self._mels(wavs_24k)]

    def analyse(self, prompts: Sequence[PromptAudio]) -> list[PromptAnalysis]:
        """The raw analysis of each prompt (align with `build_voice_prompt`), batched across the list.

        On CUDA the waveforms go to the device first without waiting, then CAM++ (the network's CUDA-graph replays,
        bound by the device) and the prompt mels are queued on a stream of their own, then the speech tokenizer
        (operator by operator, bound by the host's launches) on the caller's stream: the device runs the speaker
        network while the host launches the tokenizer. The same kernels on the same inputs as in one stream: the
        results do not change."""
        if not prompts:
            return []
        on_cpu = self._cpu_xvectors([p.wav_16k for p in prompts]) if self._speaker_pool is not None else None
        with self._exact():
            wavs_16k, wavs_24k = self._on_device(prompts)
            with self._beside(wavs_16k + wavs_24k):
                xvectors = self._xvectors(wavs_16k) if on_cpu is None else None
                mels = self._mels(wavs_24k)
            tokens = self._tokens(wavs_16k)
            self._join_beside()
            if on_cpu is not None:
                xvectors = [f.result() for f in on_cpu]
            assert xvectors is not None
            # everything is queued on the device before the first copy back waits for it
            return [PromptAnalysis(t.to("cpu", torch.int32), m.cpu(), x.to("cpu", torch.float32))
                    for t, m, x in zip(tokens, mels, xvectors, strict=True)]

    def _on_device(self, prompts: Sequence[PromptAudio]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each prompt's 16 kHz and flow-rate waveforms, resampled on the device from one upload of its samples:
        on CUDA the frontend threads that decoded them do not resample on the CPU."""
        waves = [p.at_rates(to_device(p.samples, self.device, torch.float32)) for p in prompts]
        return [w16 for w16, _ in waves], [w24 for _, w24 in waves]

    @contextlib.contextmanager
    def _beside(self, inputs: Sequence[torch.Tensor]) -> Iterator[None]:
        """On CUDA, the work inside is queued on the side stream, after the caller's stream's queued work (the
        uploads of `inputs`); elsewhere it runs as it is. `_join_beside` then orders the caller's stream after it."""
        if self._side is None:
            yield
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        for tensor in inputs:
            tensor.record_stream(self._side)  # the caller's allocations, read beside: not reused before that
        with torch.cuda.stream(self._side):
            yield

    def _join_beside(self) -> None:
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def _cpu_xvectors(self, wavs_16k: Sequence[torch.Tensor]) -> list[Future]:
        assert self._speaker_pool is not None and self._cpu_speaker is not None
        return [self._speaker_pool.submit(self._cpu_speaker.embed, w.cpu()) for w in wavs_16k]

    def _tokens(self, wavs_16k: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        feats = [whisper_log_mel(w.to(self.device, torch.float32)) for w in wavs_16k]
        return [t.reshape(-1) for t in self.tokenizer.run(feats)]

    def _xvectors(self, wavs_16k: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        assert self.speaker is not None
        feats = [speaker_features(w.to(self.device, torch.float32)).T for w in wavs_16k]
        if self.fast_speaker is not None:
            return self.fast_speaker.embed(feats)
        return [x.reshape(-1) for x in self.speaker.run(feats)]

    def _mels(self, wavs_24k: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [prompt_mel(w.to(self.device, torch.float32), self.mel_dims) for w in wavs_24k]


def _feature_channels(graph: BatchedGraph, axis: int) -> int:
    """The feature size of the graph's float input, read from the ONNX input shape."""
    shape = graph.graph.input_shapes.get(graph.feature_name, [])
    size = shape[axis] if len(shape) > axis else None
    if not isinstance(size, int):
        raise UnsupportedGraph(f"{graph.graph.path.name}: input {graph.feature_name!r} has no fixed feature size "
                               f"on axis {axis}")
    return size
