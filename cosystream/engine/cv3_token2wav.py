"""CV3Token2WavRunner: the CosyVoice3 token-to-wave side of the engine, behind the runner contract that
`EngineCore` uses for CosyVoice2's `Token2WavRunner` (start / run / release / slot queries / watch).

Per request it holds a `Token2WavStream` (models/cosyvoice3/stream.py): the DiT runs over new frames only
(keys/values of complete attention blocks kept per Euler step) and the causal vocoder over new frames plus
a fixed left context. The official final chunk (full attention) re-runs the flow once over the whole
sequence unless `final_attention` is "chunk". Chunks run one request at a time: correct for any mix of
requests, not yet batched across requests (no flow pool, no CUDA graphs).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cosystream.engine.chunking import ChunkPlan
from cosystream.engine.stopwatch import Stopwatch
from cosystream.models.cosyvoice3.flow import CV3Flow, PromptBlocks, encode_prompt_blocks
from cosystream.models.cosyvoice3.hift import CausalHiFT
from cosystream.models.cosyvoice3.stream import ChunkCall, Token2WavStream


@dataclass
class CV3Token2WavState:
    """One segment's token-to-wave stream."""

    stream: Token2WavStream
    key: Any
    speed: float = 1.0
    chunk_index: int = 0
    samples_done: int = 0
    finished: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


class CV3Token2WavRunner:
    """Owns the CosyVoice3 flow and vocoder; turns ready chunks into audio."""

    final_attention: str
    pool = None  # no flow pool: every stream keeps its own caches
    overflow_started = 0

    def __init__(self, flow: CV3Flow, hift: CausalHiFT, final_attention: str = "full",
                 max_voice_caches: int = 16) -> None:
        if final_attention not in ("full", "chunk"):
            raise ValueError(f"final_attention: 'full' or 'chunk', got {final_attention!r}")
        self.flow, self.hift = flow, hift
        self.final_attention = final_attention
        self.device = flow.input_embedding.weight.device
        self.watch = Stopwatch(self.device)
        self.on_new_voice_cache: Callable[[str, dict[str, torch.Tensor]], None] | None = None
        # a registered voice's target-independent prompt blocks, encoded once (LRU)
        self.voice_caches: OrderedDict[str, PromptBlocks] = OrderedDict()
        self.max_voice_caches = max_voice_caches

    # ------------------------------------------------------------------ per-request state
    def start(self, inputs: Any, voice_key: str | None, key: Any = None, speed: float = 1.0,
              max_target_tokens: int = 256, seed: int = 0, stored: dict | None = None) -> CV3Token2WavState:
        """A new stream from a segment's `ModelInputs` (flow prompt tokens, prompt mel, x-vector).

        A registered voice (`voice_key`) reuses its encoded prompt blocks. seed and max_target_tokens are
        accepted for the runner contract: CosyVoice3's source noise is the model's fixed table (indexed by
        sample), and the caches grow as chunks arrive.
        """
        del max_target_tokens, seed, stored
        dev = self.device
        prompt_token = inputs.flow_prompt_speech_tokens.to(dev, torch.long).view(1, -1)
        prompt_feat = inputs.prompt_mel.to(dev).view(1, -1, inputs.prompt_mel.shape[-1])
        embedding = inputs.xvector.to(dev).view(1, -1)
        blocks = self._prompt_blocks(voice_key, prompt_token, prompt_feat, embedding) if voice_key else None
        stream = Token2WavStream(self.flow, self.hift, prompt_token, prompt_feat, embedding,
                                 final_full_attention=self.final_attention == "full", prompt_blocks=blocks)
        return CV3Token2WavState(stream=stream, key=key, speed=speed)

    @torch.inference_mode()
    def _prompt_blocks(self, voice_key: str, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                       embedding: torch.Tensor) -> PromptBlocks:
        if voice_key in self.voice_caches:
            self.voice_caches.move_to_end(voice_key)
            return self.voice_caches[voice_key]
        blocks = encode_prompt_blocks(self.flow, prompt_token, prompt_feat, embedding)
        self.voice_caches[voice_key] = blocks
        while len(self.voice_caches) > self.max_voice_caches:
            self.voice_caches.popitem(last=False)
        return blocks

    def opened(self) -> None:
        self.watch.settle()

    def release(self, state: CV3Token2WavState) -> None:
        """No flow slot to give back (the stream's caches go with its state). The core releases a stream before
        its official final chunk too (that pass reads no slot), so this does not end the stream."""
        del state

    def has_prompt(self, voice_key: str | None, stored: dict[str, torch.Tensor] | None = None) -> bool:
        """Whether a stream in this voice starts without encoding its prompt blocks first."""
        return voice_key is None or voice_key in self.voice_caches

    def forget_voice(self, voice_key: str) -> None:
        self.voice_caches.pop(voice_key, None)

    def can_start(self, inputs: Any, max_target_tokens: int) -> bool:
        return True

    def needs_slot(self, inputs: Any, max_target_tokens: int) -> bool:
        return False

    def free_slots(self) -> int | None:
        return None

    def flow_slots(self) -> int | None:
        return None

    def overflow_room(self) -> int:
        return 0

    def slot_gauges(self) -> dict[str, float]:
        """No flow pool: no slot gauges for /metrics."""
        return {}

    def flow_group(self, state: CV3Token2WavState, plan: ChunkPlan) -> None:
        """Chunks are not batched across requests: no group."""
        return None

    def pausable(self, jobs: Sequence[tuple[CV3Token2WavState, list[int], ChunkPlan]]) -> bool:
        return False

    def warmup(self, prompt_tokens: int = 150, target_tokens: int = 250, schedule: Any = None) -> int:
        return 0

    # ------------------------------------------------------------------ chunks
    @torch.inference_mode()
    def run(self, jobs: Sequence[tuple[CV3Token2WavState, list[int], ChunkPlan]],
            should_stop: Callable[[], bool] | None = None) -> list[tuple[np.ndarray, float, float]]:
        """Audio for each job (state, all tokens of the segment so far, plan): (pcm, flow_s, vocoder_s)."""
        del should_stop
        results = []
        for state, tokens, plan in jobs:
            results.append(self._chunk(state, tokens, plan))
        self.watch.settle()
        return results

    def _chunk(self, state: CV3Token2WavState, tokens: list[int], plan: ChunkPlan
               ) -> tuple[np.ndarray, float, float]:
        if state.finished:
            raise RuntimeError("CV3Token2WavRunner: chunk for a finished stream")
        ids = torch.tensor(tokens[:plan.token_end], dtype=torch.long, device=self.device).view(1, -1)
        call = ChunkCall(plan.token_end, plan.offset, plan.is_final)
        t0 = time.perf_counter()
        if state.speed != 1.0:
            mel = self._speed_mel(state, ids, call)
        else:
            mel = state.stream.new_mel(ids, call)
        self._sync()
        t1 = time.perf_counter()
        wav = self.hift.inference(mel, finalize=True)[0] if state.speed != 1.0 else state.stream.vocode(
            mel, call.finalize)
        self._sync()
        t2 = time.perf_counter()
        state.chunk_index += 1
        state.samples_done += wav.shape[1]
        if plan.is_final:
            state.finished = True
        pcm = wav[0].float().cpu().numpy()
        return pcm, t1 - t0, t2 - t1

    def _speed_mel(self, state: CV3Token2WavState, ids: torch.Tensor, call: ChunkCall) -> torch.Tensor:
        """The official speed change: non-streaming only; the mel is linearly resampled to ⌊F / speed⌋."""
        if call.token_offset != 0 or not call.finalize:
            raise ValueError("speed: a speed other than 1 needs a non-streaming request (official constraint)")
        s = state.stream
        mel = self.flow.inference(ids, s.prompt_token, s.prompt_feat, s.embedding, streaming=False, finalize=True)
        return F.interpolate(mel, size=int(mel.shape[2] / state.speed), mode="linear")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
