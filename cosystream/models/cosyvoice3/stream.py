"""Incremental CosyVoice3 token-to-wav streaming that reproduces the official `tts(stream=True)` chunks.

spec/cosyvoice3.md §7. The official loop re-runs the flow over every token so far and the vocoder over
the whole accumulated mel at every chunk (both quadratic in the utterance length). Here:

* the flow runs the DiT only over frames not yet final: with the block-causal mask, keys/values of
  complete 50-frame blocks are kept per Euler step (`FlowStream`); the official final call uses full
  attention over everything (`stream=False`), which no cache can reproduce, so that one call re-runs
  the flow over the whole sequence unless `final_full_attention=False` is chosen (then the last chunk
  is block-causal too, cheaper, and differs from the official last chunk);
* the vocoder is causal, so each chunk is vocoded from a fixed left context (its receptive field) plus
  the new frames, with the phase sum carried (`HiftStream`): the emitted samples equal the official
  whole-mel re-run's within float rounding.

`StreamSchedule` is the official chunking (hop 25 + prompt pad, doubled up to 100, 3 look-ahead tokens).
The official code keeps the doubled hop on the model object across requests; here every request starts
from `first_hop` (docs/cosyvoice3.md explains why), and a caller that wants to replay the official object
state can pass the persisted hop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cosystream.models.cosyvoice3.flow import CV3Flow, FlowStream, PromptBlocks
from cosystream.models.cosyvoice3.hift import CausalHiFT, HiftStream

TOKEN_HOP = 25  # PARITY: CosyVoice3Model.token_hop_len (must match the training chunk size)
MAX_HOP = 4 * TOKEN_HOP
HOP_SCALE = 2


@dataclass(frozen=True)
class ChunkCall:
    """One token2wav call: the first `num_tokens` generated tokens, new mel from `2·token_offset`."""

    num_tokens: int
    token_offset: int
    finalize: bool


class StreamSchedule:
    """The official streaming schedule for one request (`CosyVoice2Model.tts`, inherited by CosyVoice3).

    `next_call(available, done)` returns the call to make now, or None to wait for more tokens.
    """

    def __init__(self, prompt_tokens: int, lookahead: int = 3, first_hop: int = TOKEN_HOP, max_hop: int = MAX_HOP,
                 scale: int = HOP_SCALE) -> None:
        self.lookahead, self.max_hop, self.scale = lookahead, max_hop, scale
        self.hop = first_hop
        # PARITY: the prompt pad is taken modulo the hop in force when the request starts
        self.prompt_pad = math.ceil(prompt_tokens / first_hop) * first_hop - prompt_tokens
        self.offset = 0
        self.finished = False

    def current_hop(self) -> int:
        return self.hop + self.prompt_pad if self.offset == 0 else self.hop

    def next_call(self, available: int, done: bool) -> ChunkCall | None:
        if self.finished:
            return None
        hop = self.current_hop()
        if available - self.offset >= hop + self.lookahead:
            call = ChunkCall(self.offset + hop + self.lookahead, self.offset, finalize=False)
            self.offset += hop
            self.hop = min(self.max_hop, self.hop * self.scale)
            return call
        if done:
            self.finished = True
            return ChunkCall(available, self.offset, finalize=True)
        return None

    def all_calls(self, total: int) -> list[ChunkCall]:
        """Every call for a request whose `total` tokens are all known (voice conversion, replay)."""
        calls = []
        while (call := self.next_call(total, done=True)) is not None:
            calls.append(call)
        return calls


@dataclass
class ChunkOutput:
    mel: torch.Tensor  # [1, 80, m] the new mel frames (what the official appends to its cache)
    wav: torch.Tensor  # [1, n] the new samples


class Token2WavStream:
    """One streaming request: `push(tokens so far, call)` -> the official chunk's new mel and audio,
    computing only what was not computed before (see the module docstring)."""

    def __init__(self, flow: CV3Flow, hift: CausalHiFT, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                 embedding: torch.Tensor, final_full_attention: bool = True,
                 prompt_blocks: PromptBlocks | None = None) -> None:
        self.flow_stream = FlowStream(flow, prompt_token, prompt_feat, embedding, prompt_blocks)
        self.hift_stream = HiftStream(hift)
        self.final_full_attention = final_full_attention
        self.flow = flow
        self.prompt_token, self.prompt_feat, self.embedding = prompt_token, prompt_feat, embedding

    def push(self, tokens: torch.Tensor, call: ChunkCall) -> ChunkOutput:
        """tokens [1, ≥ call.num_tokens] generated tokens; returns this call's new mel and samples."""
        mel = self.new_mel(tokens, call)
        return ChunkOutput(mel=mel, wav=self.vocode(mel, call.finalize))

    def vocode(self, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """The new samples [1, n] of this chunk's new mel frames."""
        return self.hift_stream.push(mel, finalize)

    def new_mel(self, tokens: torch.Tensor, call: ChunkCall) -> torch.Tensor:
        """The chunk's new mel frames [1, 80, m] (from 2·token_offset)."""
        tokens = tokens[:, :call.num_tokens]
        if call.finalize and self.final_full_attention:
            # PARITY: the official last call uses stream=False: full attention over every frame.
            mel = self.flow.inference(tokens, self.prompt_token, self.prompt_feat, self.embedding,
                                      streaming=False, finalize=True)
            return mel[:, :, self.flow.ratio * call.token_offset:]
        return self.flow_stream.push(tokens, call.token_offset, call.finalize)


def synthesize_offline(flow: CV3Flow, hift: CausalHiFT, tokens: torch.Tensor, prompt_token: torch.Tensor,
                       prompt_feat: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """The official non-streaming token2wav: one full-attention flow call and one vocoder call."""
    mel = flow.inference(tokens, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
    return hift.inference(mel, finalize=True)[0]
