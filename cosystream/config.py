"""EngineConfig: every engine knob in one frozen, validated record (static for the engine's life)."""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

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


DEFAULT_MAX_TEXT_CHARS = 5000  # about five minutes of speech


@dataclass(frozen=True)
class Tuning:
    """Engine internals that benchmarks and tests switch; the defaults are the measured best on the H100
    (docs/benchmarks.md). Set them through `EngineConfig.from_kwargs` / `--config NAME=VALUE` like any field."""

    overlap_token2wav: bool | None = None
    """Flow/HiFT batches on a second thread and CUDA stream beside LM decode. None: on with CUDA (the GPU
    runs both at once), off on the CPU (its cores are shared by both anyway)."""
    open_ahead: bool = True
    """Open a new stream's flow state (a slot and a copy of the voice's encoded prompt) while the LM still
    decodes its first chunk, when the token-to-wave worker idles. False: streams open with their first chunk."""
    cuda_graphs: bool = True
    """Capture the decode, flow and vocoder steps as CUDA graphs (False: eager launches, for debugging)."""
    fused_kernels: bool = True
    """CUDA: the Triton kernels of the decode step, flow and vocoder (False: the torch statements)."""
    compile: bool = False
    """torch.compile the hot steps (minutes of compiling at start)."""
    gil_switch_interval_s: float | None = 0.0005
    """Python's thread switch interval while an engine runs (process-wide, restored by close): the engine
    thread drives the GPU from Python, and at the interpreter's 5 ms a frontend thread or the event loop can
    hold the GIL that long. Shorter: less waiting for the GIL, more switching. None: leave it."""
    gc_freeze: bool = True
    """gc.freeze() once the engine is built and after warm-up (process-wide; undone by close): a full
    cyclic collection of the engine's and the libraries' objects holds the GIL ≈ 0.1 s (measured with
    benchmarks/gc_pause.py, retired in f313fec: `git show f313fec^:benchmarks/gc_pause.py`)."""
    persist_voice_caches: bool | None = None
    """Keep a registered voice's encoded flow prompt in its voice record. None: on the CPU only, where
    rebuilding it is slow; on a GPU one graphed flow chunk rebuilds it faster than ~0.7 GB reads back."""

    def __post_init__(self) -> None:
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            raise ValueError(f"gil_switch_interval_s: must be > 0 (or None), got {self.gil_switch_interval_s}")


@dataclass(frozen=True)
class EngineConfig:
    """What a user sets; each field says what it trades. Static for the engine's life."""

    device: str = "cpu"
    """"cpu", "cuda" or "cuda:N"."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16. Half precision halves memory and time on a GPU (the CPU: float32)."""
    max_streams: int = 64
    """Concurrent LM rows (KV-cache slots): more streams at once, more GPU memory and longer decode steps."""
    max_len: int = 2048
    """LM positions per stream (prompt + text + speech tokens): longer sentences, more KV-cache memory."""
    schedule: ChunkSchedule = ChunkSchedule()
    """Streaming hops: smaller first hops mean earlier first audio and more, smaller flow calls."""
    final_attention: str = "full"
    """"full": the official whole-utterance final chunk; "chunk": incremental, cheaper, not bit-official."""
    flow_slots: int | None = None
    """Streams voiced at once from the incremental-flow pool (CUDA), each holding `flow_frames` frames of
    keys/values (≈ 2.3 MB a frame for CosyVoice2-0.5B in bf16). None: as many as 70% of the GPU memory left
    after loading holds (1-64); 0: no pool. More slots, more concurrent streams and less memory for others."""
    flow_frames: int = 832
    """Frames a slot keeps (prompt included): a stream past them recomputes each chunk (slower, any length)."""
    max_voice_cache_gb: float = 8.0
    """Encoded flow prompts kept in (GPU) memory for voices in use, least recently used dropped beyond this
    (and 16 voices): more voices without a rebuild, less memory for streams."""
    first_audio_budget_s: float | None = None
    """Admission: a new stream is refused (Overloaded, HTTP 503) unless its first audio is predicted within
    this many seconds with every running stream still on time. None: admit all (queues may grow).
    `cosystream serve` sets 1.0 unless told otherwise."""
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    """Longest text of one request, every entry point (BadInput / HTTP 400 beyond)."""
    voices_db: str | None = None
    """The voice store (None: $COSYSTREAM_HOME/voices.db or ~/.cache/cosystream/voices.db)."""
    tuning: Tuning = Tuning()
    """Engine internals for benchmarks and tests (see Tuning)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_streams < 1 or self.max_len < 64:
            raise ValueError("max_streams must be >= 1 and max_len >= 64")
        if self.final_attention not in ("full", "chunk"):
            raise ValueError(f"final_attention: 'full' or 'chunk', got {self.final_attention!r}")
        if not self.max_voice_cache_gb >= 0:
            raise ValueError(f"max_voice_cache_gb: must be >= 0, got {self.max_voice_cache_gb}")
        if self.first_audio_budget_s is not None and not self.first_audio_budget_s > 0:
            raise ValueError(f"first_audio_budget_s: must be > 0 (None: off), got {self.first_audio_budget_s}")
        if self.max_text_chars < 1:
            raise ValueError(f"max_text_chars: must be >= 1, got {self.max_text_chars}")
        self.schedule.validate()

    @property
    def overlap(self) -> bool:
        """Whether token-to-wave batches run beside LM decode (Tuning.overlap_token2wav resolved)."""
        if self.tuning.overlap_token2wav is None:
            return self.device.startswith("cuda")
        return self.tuning.overlap_token2wav

    # the runners read these tuning switches from the config they are given
    @property
    def cuda_graphs(self) -> bool:
        return self.tuning.cuda_graphs

    @property
    def fused_kernels(self) -> bool:
        return self.tuning.fused_kernels

    @property
    def compile(self) -> bool:
        return self.tuning.compile

    @property
    def open_ahead(self) -> bool:
        return self.tuning.open_ahead

    @property
    def gil_switch_interval_s(self) -> float | None:
        return self.tuning.gil_switch_interval_s

    flow_l2_prefetch_mb: ClassVar[float] = 4.0
    """The flow estimator's steps pull their next weights into L2 this many MB ahead (kernels/prefetch.py):
    a first chunk's ODE 21.07 -> 20.41 ms on the H100 (benchmarks/profile_stages.py)."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """EngineConfig from flat keywords: its own fields and Tuning's (an unknown name: TypeError)."""
        names = {f.name for f in fields(cls)}
        tuning_names = {f.name for f in fields(Tuning)}
        unknown = sorted(set(kwargs) - names - tuning_names)
        if unknown:
            raise TypeError(f"unknown EngineConfig field(s): {', '.join(unknown)}")
        tuning = {k: kwargs.pop(k) for k in list(kwargs) if k in tuning_names}
        if tuning:
            kwargs["tuning"] = replace(kwargs.get("tuning", Tuning()), **tuning)
        return cls(**kwargs)


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def config_overrides(items: Sequence[str]) -> dict[str, Any]:
    """EngineConfig fields from command-line FIELD=VALUE items, each value converted to its field's type
    (bool: true/false/yes/no/on/off/1/0; int; float; str; `none` where the field may be None). A
    ValueError names the item that is wrong."""
    hints = {name: hint for cls in (Tuning, EngineConfig) for name, hint in typing.get_type_hints(cls).items()
             if name in {f.name for f in fields(cls)} and name != "tuning"}
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
