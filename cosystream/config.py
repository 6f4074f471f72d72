"""EngineConfig: every engine knob in one frozen, validated record (static for the engine's life)."""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ChunkSchedule:
    """Streaming hops in speech tokens (spec/streaming.md §1-2).

    Defaults are the official CosyVoice2 schedule: first hop 25 plus the prompt padding that aligns
    chunk boundaries with the flow's 25-token attention blocks, then ×2 per chunk up to 100.
    A smaller `first_hop` (e.g. 15) lowers first-audio latency by (25 - 15) LM steps; with it the
    first chunk no longer ends on an attention-block boundary, so its last frames see a partial
    block (a small deviation from the official output). `growth` 1 keeps every hop equal: lower
    latency per chunk, more (smaller) flow calls.
    """

    first_hop: int = 25
    growth: float = 2.0
    max_hop: int = 100
    pad_prompt: bool = True  # official: pad the first hop so prompt + hop is a multiple of the block
    lookahead: int = 3  # pre-look-ahead tokens of the flow

    def validate(self) -> None:
        if not 1 <= self.first_hop <= self.max_hop:
            raise ValueError(f"first_hop: must be in [1, max_hop={self.max_hop}], got {self.first_hop}")
        if self.growth < 1:
            raise ValueError(f"growth: must be >= 1, got {self.growth}")


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"  # "cpu", "cuda", "cuda:1"
    dtype: str = "float32"  # float32 | bfloat16 | float16 (CPU: float32 only is sensible)
    max_streams: int = 64  # concurrent LM rows (KV-cache slots)
    max_len: int = 2048  # LM positions per stream (prompt + text + generated speech tokens)
    max_queue: int = 256  # waiting requests beyond which new ones are refused (Overloaded)
    cuda_graphs: bool = True  # capture decode/flow/vocoder steps on CUDA
    # Flow/HiFT batches on a second thread (and CUDA stream) beside LM decode. None: on with CUDA (the
    # GPU runs both at once), off on the CPU (the cores are already shared by both).
    overlap_token2wav: bool | None = None
    # While the LM is producing tokens, a ready chunk whose client still has more than this many seconds
    # of audio buffered waits for a batch that an urgent chunk (a first chunk, a client about to run dry)
    # opens: fewer, fuller flow batches. 0: every ready chunk runs at once.
    chunk_slack_s: float = 0.6
    # A batch opened for an urgent chunk leaves out later chunks (not final ones) whose client still has at
    # least this many seconds of audio buffered, unless they share a first chunk's ODE call (riders): they
    # wait for a later batch and meet the chunks of other streams there. An ODE call costs ≈ 25 ms before
    # its first stream on the H100 (launch-bound), and at 15 req/s later chunks went out 1-3 at a time; with
    # 1.5 the worker was busy 0.4-1.1 s less in a 16 s run (docs/benchmarks.md, sixteenth session).
    # 0: a batch takes every ready chunk. Below chunk_slack_s it acts as chunk_slack_s.
    later_chunk_hold_s: float = 1.5
    # A ready first chunk waits up to this long for other streams whose first chunk is due sooner than
    # that (their missing tokens × the measured decode step), so a burst's first chunks share one flow
    # batch instead of queueing behind the earliest stream's lone one. 0: never wait.
    first_chunk_wait_s: float = 0.05
    # A first chunk (or a chunk of a client about to run dry) that becomes ready while a token-to-wave
    # batch runs asks the worker to hand back the batch's phases it has not started (later chunks, official
    # final passes), so it waits for one phase, not the whole batch. False: batches always run to the end.
    preempt_token2wav: bool = True
    # With preemption on, a phase of official final passes (whole-utterance ODEs, ≈ 270 ms for 16 streams
    # on the H100) also stops between two of its Euler steps for such a chunk (the worker waits for each step
    # on the GPU) and goes on after it; passes that are due (final_slack_s) stop only for a client about to
    # run dry. Default since the seventeenth session: with phases of at most 16 passes and the later-chunk
    # hold, at 15 req/s on the H100 first audio p95 was 229-245 ms against 342-406 without it over three
    # arrival seeds (216-232 arrivals), zero underruns either way, and c=1 / c=16 unchanged (53 ms; 116 ms,
    # 220x). Before those two settings the passes it deferred piled up and made up to 34 requests' last
    # chunk late (docs/benchmarks.md). False: a phase of them runs whole.
    pause_final_passes: bool = True
    # With pause_final_passes: an official final pass is due when its client's audio left, less the measured
    # cost of the waiting passes whose clients run dry no later (earliest deadline first), is under this many
    # seconds: no batch leaves it out for a first chunk, and it pauses only for a client about to run dry.
    final_slack_s: float = 2.0
    # Official final passes run in phases of at most this many streams, so a first chunk (or a client about
    # to run dry) that preempts the worker waits for one such phase, not for up to 64 passes (a pass costs
    # 16.3 ms in a phase of 32 streams on the H100, 17.6 ms in one of 16). At 15 req/s it cut first audio
    # p95 from 442 to 356 ms and from 543-661 to 412 ms (two seeds, docs/benchmarks.md, sixteenth session);
    # phases of 4 cost too much batching (c=16: 207x -> 157x). 0: all the passes of a batch in one phase.
    final_phase_streams: int = 16
    # While a new request's first chunk is on the token-to-wave worker, decode steps pause unless another
    # request still waits for its first audio: beside decode steps that chunk took ≈ 10 ms longer on the H100
    # (GPU contention; the GIL switch interval made no difference). False: decoding goes on beside it, so a
    # lone stream's whole utterance comes ≈ 9% sooner (RTF 0.0256 -> 0.0233) but its first audio 11 ms later
    # (51 -> 62 ms; c=16 p90 118 -> 147 ms; docs/benchmarks.md, nineteenth session).
    pause_decode_for_first_chunks: bool = True
    # A phase of first chunks takes along later chunks whose ODE has the same shape (a second chunk's new
    # frames equal a first chunk's), up to this many streams in the call: small ODE calls are launch-bound,
    # so the first chunks wait little longer and the token-to-wave worker saves a call. 0: never.
    rider_streams: int = 16
    # A new stream's flow state (its pool slot with a copy of the voice's encoded prompt, ≈ 0.7 GB for a
    # 6 s prompt; for a voice not in memory a flow pass over its prompt) is made while the LM still decodes
    # its first chunk's tokens, whenever the token-to-wave worker is idle, instead of in the first chunk's
    # batch. False: streams open with their first chunk.
    open_ahead: bool = True
    fused_kernels: bool = True  # CUDA: Triton kernels for the LM decode step (False: the unfused torch step)
    # CUDA (Hopper or newer): the decode step pulls the weights of its next linears into L2 on a side stream,
    # up to this many MB ahead (cosystream.kernels.prefetch), in steps of up to prefetch.MAX_ROWS (8) rows.
    # None: that module's default (8 MB: on the H100 a batch-1 step 0.705 -> 0.645 ms, c=1 first audio
    # 51-52 -> 49-50 ms, RTF 0.026 -> 0.025; docs/benchmarks.md); 0: off.
    l2_prefetch_mb: float | None = None
    # The same for the flow estimator's steps (its next ResNets' and transformer blocks' weights). On the
    # H100 at 4 MB a first chunk's ODE 21.07 -> 20.41 ms (docs/benchmarks.md). 0: off.
    flow_l2_prefetch_mb: float = 4.0
    compile: bool = False  # torch.compile the hot steps (fewer, fused kernels; minutes of compile at start)
    schedule: ChunkSchedule = ChunkSchedule()
    final_attention: str = "full"  # "full": official final chunk; "chunk": incremental, cheaper
    # incremental-flow pool on CUDA: streams voiced at once x frames each (prompt included);
    # ≈ 2.3 MB per frame for CosyVoice2-0.5B in bf16, so 28 x 832 frames ≈ 54 GB. None: as many slots
    # as 70% of the GPU memory left after loading the models holds (at least 1, at most 64); 0: no pool.
    # A stream takes a slot when its first chunk fits; its chunks past the slot's frames recompute all
    # its frames, as the official code does at every chunk (one graphed pass each), so the frames bound
    # what a stream keeps, not how long it may be: 832 keeps 10.6 s of audio after a 6 s prompt.
    flow_slots: int | None = None
    flow_frames: int = 832
    # Keep a registered voice's encoded flow prompt in its voice record (survives restarts). None: on
    # the CPU only, where rebuilding it is slow; on a GPU one graphed chunk of the flow in a pool slot
    # (≈ 30 ms for a 6 s prompt on the H100) is faster than reading its ~0.7 GB back (2.3 MB per prompt
    # frame for CosyVoice2-0.5B in bf16).
    persist_voice_caches: bool | None = None
    # Encoded flow prompts kept in memory (on the GPU: its memory) for voices in use, registered or uploaded
    # with requests (by content), least recently used dropped beyond this many GiB (and 16 voices).
    max_voice_cache_gb: float = 8.0
    max_text_chars: int = 5000  # longer inputs are refused with BadInput
    voices_db: str | None = None  # None: $COSYSTREAM_HOME/voices.db or ~/.cache/cosystream/voices.db
    frontend_threads: int = 2
    # A request in a voice already in memory (or a built-in speaker) whose text has at most this many
    # characters is prepared on the caller's event loop (≈ 0.1 ms of normalising and tokenising) instead
    # of a frontend thread: two thread hops fewer, and a burst of requests is not queued behind the
    # frontend threads. Longer texts, prompt audio and voice conversion go to the threads. 0: always them.
    inline_frontend_chars: int = 400
    # Python's thread switch interval while an engine runs (sys.setswitchinterval; process-wide, restored
    # by close). The engine thread drives the GPU from Python; with the interpreter's default of 5 ms a
    # request's frontend thread or the server's event loop can wait that long for the GIL behind it.
    # None: leave the interpreter's setting.
    gil_switch_interval_s: float | None = 0.0005
    # gc.freeze() once the engine is built and after warm-up (process-wide; undone by close): the cyclic
    # collector then never walks the engine's and the libraries' objects, whose full collection holds the
    # GIL for ≈ 0.1 s (benchmarks/gc_pause.py, tiny test engine). False: leave the collector alone.
    gc_freeze: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_streams < 1 or self.max_len < 64:
            raise ValueError("max_streams must be >= 1 and max_len >= 64")
        if self.final_attention not in ("full", "chunk"):
            raise ValueError(f"final_attention: 'full' or 'chunk', got {self.final_attention!r}")
        if self.chunk_slack_s < 0:
            raise ValueError(f"chunk_slack_s: must be >= 0, got {self.chunk_slack_s}")
        if self.inline_frontend_chars < 0:
            raise ValueError(f"inline_frontend_chars: must be >= 0, got {self.inline_frontend_chars}")
        if self.rider_streams < 0:
            raise ValueError(f"rider_streams: must be >= 0, got {self.rider_streams}")
        if self.l2_prefetch_mb is not None and self.l2_prefetch_mb < 0:
            raise ValueError(f"l2_prefetch_mb: must be >= 0 (0: off), got {self.l2_prefetch_mb}")
        if self.flow_l2_prefetch_mb < 0:
            raise ValueError(f"flow_l2_prefetch_mb: must be >= 0 (0: off), got {self.flow_l2_prefetch_mb}")
        if self.final_slack_s < 0:
            raise ValueError(f"final_slack_s: must be >= 0, got {self.final_slack_s}")
        if self.final_phase_streams < 0:
            raise ValueError(f"final_phase_streams: must be >= 0 (0: no limit), got {self.final_phase_streams}")
        if self.later_chunk_hold_s < 0:
            raise ValueError(f"later_chunk_hold_s: must be >= 0, got {self.later_chunk_hold_s}")
        if self.first_chunk_wait_s < 0:
            raise ValueError(f"first_chunk_wait_s: must be >= 0, got {self.first_chunk_wait_s}")
        if not self.max_voice_cache_gb >= 0:
            raise ValueError(f"max_voice_cache_gb: must be >= 0, got {self.max_voice_cache_gb}")
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            raise ValueError(f"gil_switch_interval_s: must be > 0 (or None), got {self.gil_switch_interval_s}")
        self.schedule.validate()

    @property
    def overlap(self) -> bool:
        """Whether token-to-wave batches run beside LM decode (overlap_token2wav resolved)."""
        if self.overlap_token2wav is None:
            return self.device.startswith("cuda")
        return self.overlap_token2wav

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown EngineConfig field(s): {', '.join(unknown)}")
        return cls(**kwargs)


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def config_overrides(items: Sequence[str]) -> dict[str, Any]:
    """EngineConfig fields from command-line FIELD=VALUE items, each value converted to its field's type
    (bool: true/false/yes/no/on/off/1/0; int; float; str; `none` where the field may be None). A
    ValueError names the item that is wrong."""
    hints = typing.get_type_hints(EngineConfig)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--config {item!r}: expected FIELD=VALUE")
        if key not in hints:
            raise ValueError(f"--config {item!r}: EngineConfig has no field {key!r}")
        out[key] = _parse_field(key, hints[key], text.strip())
    return out


def _parse_field(key: str, hint: Any, text: str) -> Any:
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if type(None) in kinds and text.lower() == "none":
        return None
    kind = next((k for k in kinds if k is not type(None)), None)
    if kind is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"--config {key}={text}: expected true or false")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"--config {key}={text}: expected {'an integer' if kind is int else 'a number'}"
                             ) from None
    if kind is str:
        return text
    raise ValueError(f"--config {key}: not settable from the command line")
