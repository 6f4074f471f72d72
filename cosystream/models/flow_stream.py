"""Incremental streaming flow: a chunk computes only its new mel frames (spec/flow.md §6, streaming.md §2).

The official scheduler re-runs the flow over prompt + all tokens at every chunk. Chunk-causal masks,
causal convs and position-indexed noise make earlier frames independent of later ones, so we keep,
per request, the encoder state and, for each Euler step and both CFG rows, the estimator's attention
keys/values of finished frames and the 2-frame tail of every causal conv. This is exact for every
non-final chunk that ends on a chunk boundary (25 tokens, counted from the first prompt token), which
the official prompt-padding rule guarantees.

Final chunk: the official scheduler switches to full attention, so its new frames depend on all old
frames. `final_attention="full"` reproduces it with one whole recomputation; `"chunk"` keeps chunk
masks for the tail too (incremental, cheaper; a documented deviation: it equals the official
`streaming=True, finalize=True` call, not the official final chunk).

Cache size per frame (prompt frames included), with NB = n_blocks·(num_mid_blocks + 2) attention
blocks, inner = num_heads·head_dim, D = encoder width, L1/L2 = token/frame-rate conformer layers:

    bytes/frame = itemsize · (n_timesteps · 2 (CFG rows) · NB · 2 (K,V) · inner + (L1/2 + L2) · 2 · D)

CosyVoice2-0.5B in bf16: 2 B · (10·2·56·2·512 + (6/2 + 4)·2·512) = 2,308,096 B ≈ 2.31 MB/frame
(2.29 MB of it estimator K/V), i.e. ≈ 115 MB per second of audio; a 6 s prompt (P = 150) caches
250 frames ≈ 577 MB per voice, copied into each request's cache at `start`.
Plus a fixed conv-tail state of n_timesteps · 2 · conv_channels · 2 values per request (0.66 MB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cosystream.checkpoint.hparams import FlowDims
from cosystream.models.estimator import chunk_attention_bias
from cosystream.models.flow import UPSAMPLE, EncoderState, Flow, grow_axis

FINAL_ATTENTION = ("full", "chunk")
Window = tuple[torch.Tensor, torch.Tensor | None]  # (new position ids [n], look-ahead ids [3] or None)


def cache_bytes_per_frame(dims: FlowDims, dtype: torch.dtype) -> int:
    """Bytes of K/V cache one mel frame costs a stream (estimator + encoder), in `dtype`."""
    est, enc = dims.estimator, dims.encoder
    num_blocks = est.n_blocks * (est.num_mid_blocks + 2)
    estimator = dims.n_timesteps * 2 * num_blocks * 2 * est.num_heads * est.attention_head_dim
    encoder = enc.num_blocks * 2 * enc.output_size // UPSAMPLE + enc.num_up_blocks * 2 * enc.output_size
    return (estimator + encoder) * torch.tensor([], dtype=dtype).element_size()


@dataclass
class PromptCache:
    """Per-voice flow state for the prompt's first `num_tokens` tokens (plain tensors, reusable).

    num_tokens is the last chunk boundary b with b + 3 <= P: positions before it depend on prompt
    tokens only (their pre-look-ahead reads 3 tokens ahead). kv [steps, blocks, 2, 2, 2b, inner] and
    conv [steps, 2, conv_channels, 2] are the estimator caches after frame 2b.
    """

    prompt_tokens: torch.Tensor  # [P] int64
    prompt_mel: torch.Tensor  # [2P, 80]
    spks: torch.Tensor  # [80]
    encoder: EncoderState
    kv: torch.Tensor
    conv: torch.Tensor
    # CUDA: recorded once the tensors above are written, when a stream other than their reader's writes them
    # (the prompt lane, engine/flow_runner.py); None: ready
    written: torch.cuda.Event | None = None

    @property
    def num_tokens(self) -> int:
        return self.encoder.num_tokens

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat dict for a voice store (safetensors-compatible)."""
        e = self.encoder
        return {"prompt_tokens": self.prompt_tokens, "prompt_mel": self.prompt_mel, "spks": self.spks,
                "encoder.kv_tokens": e.kv_tokens, "encoder.kv_frames": e.kv_frames,
                "encoder.lookahead_tail": e.lookahead_tail, "encoder.up_tail": e.up_tail,
                "kv": self.kv, "conv": self.conv}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> PromptCache:
        enc = EncoderState(t["encoder.kv_tokens"], t["encoder.kv_frames"], t["encoder.lookahead_tail"],
                           t["encoder.up_tail"], num_tokens=t["encoder.kv_tokens"].shape[2])
        return cls(t["prompt_tokens"], t["prompt_mel"], t["spks"], enc, t["kv"], t["conv"])


class EncoderProgress:
    """How far a stream is, read from its `encoder` state (for the per-stream state classes)."""

    encoder: EncoderState

    @property
    def num_tokens(self) -> int:
        """Tokens (prompt + target) whose frames are final."""
        return self.encoder.num_tokens

    @property
    def num_frames(self) -> int:
        return UPSAMPLE * self.encoder.num_tokens


@dataclass
class FlowStreamState(EncoderProgress):
    """Mutable per-request flow state; `kv` [steps, blocks, 2, 2, capacity, inner], `conv` as PromptCache."""

    prompt: PromptCache
    encoder: EncoderState
    kv: torch.Tensor
    conv: torch.Tensor
    is_finished: bool = False

    def reserve(self, num_frames: int) -> None:
        self.kv = grow_axis(self.kv, 4, num_frames)


class FlowStream:
    """Runs a `Flow` chunk by chunk, computing only new frames.

        stream = FlowStream(flow)
        voice = stream.build_prompt_cache(prompt_tokens, prompt_mel, xvector)   # once per voice
        state = stream.start(voice, max_target_tokens=400)                      # per request
        mel = stream.feed(state, tokens[:, :offset + hop + 3])                  # each non-final chunk
        mel = stream.finish(state, tokens)                                      # last chunk
        mels = stream.feed_batch([state_a, state_b], [tokens_a, tokens_b])      # batched chunks

    Batched chunks must add the same number of frames per request; cache lengths may differ (each
    request's attention reads its own cache, the dense layers run on the whole batch).
    """

    def __init__(self, flow: Flow, final_attention: str = "full") -> None:
        if final_attention not in FINAL_ATTENTION:
            raise ValueError(f"final_attention must be one of {FINAL_ATTENTION}, got {final_attention!r}")
        dims = flow.dims
        if dims.estimator.static_chunk_size != UPSAMPLE * dims.encoder.static_chunk_size:
            raise ValueError("incremental flow needs the estimator chunk to be 2 × the encoder chunk")
        self.flow, self.final_attention = flow, final_attention
        self.chunk_tokens = dims.encoder.static_chunk_size
        self.lookahead = dims.pre_lookahead_len
        self._empty: tuple[tuple[torch.device, torch.dtype], tuple[EncoderState, torch.Tensor, torch.Tensor]] | None
        self._empty = None
        self._nothing_encoded()  # made here, at load, not by the first new voice's opening

    def prompt_cache_tokens(self, num_prompt_tokens: int) -> int:
        """Last chunk boundary b with b + look-ahead <= P (0 if none)."""
        usable = max(num_prompt_tokens - self.lookahead, 0)
        return usable // self.chunk_tokens * self.chunk_tokens

    @torch.no_grad()
    def empty_prompt(self, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor, xvector: torch.Tensor
                     ) -> PromptCache:
        """The voice's PromptCache before any of its frames is encoded (where build_prompt_cache starts)."""
        num_prompt = prompt_tokens.shape[1]
        if prompt_mel.shape[1] != UPSAMPLE * num_prompt:
            raise ValueError(f"prompt mel has {prompt_mel.shape[1]} frames, expected 2 × {num_prompt}")
        w = self.flow.input_embedding.weight
        encoder, kv, conv = self._nothing_encoded()
        return PromptCache(prompt_tokens[0].to(w.device, torch.long), prompt_mel[0].to(w.device, w.dtype),
                           self.flow.project_speaker(xvector.to(w.device))[0], encoder, kv, conv)

    def without_cache(self, prompt: PromptCache) -> PromptCache:
        """The voice's prompt with none of its frames encoded: a stream opened with it computes the prompt's
        frames in its first chunk (exact: incremental from frame 0), or recomputes them at every chunk."""
        return PromptCache(prompt.prompt_tokens, prompt.prompt_mel, prompt.spks, *self._nothing_encoded())

    def _nothing_encoded(self) -> tuple[EncoderState, torch.Tensor, torch.Tensor]:
        """(encoder state, kv, conv) of a prompt none of whose frames is encoded: zeros, made once per device
        and dtype (at construction, again only if the model moves) and shared by every such prompt. Nothing
        writes them (a stream opened from one copies them). PERF: a wave of new voices opens without ~10
        launches a voice for these zeros."""
        w = self.flow.input_embedding.weight
        key = (w.device, w.dtype)
        if self._empty is None or self._empty[0] != key:
            est = self.flow.decoder.estimator
            kv, conv = est.new_cache(2, 0)
            steps = self.flow.decoder.num_steps
            made = (self.flow.encoder.new_state(0), kv.unsqueeze(0).expand(steps, *kv.shape),
                    conv.unsqueeze(0).repeat(steps, 1, 1, 1))
            if w.is_cuda:  # zeroed on this thread's stream: done before any other stream reads them
                torch.cuda.synchronize(w.device)
            self._empty = (key, made)
        return self._empty[1]

    @torch.no_grad()
    def build_prompt_cache(self, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
                           xvector: torch.Tensor) -> PromptCache:
        """prompt_tokens [1, P] int, prompt_mel [1, 2P, 80], xvector [1, 192] -> PromptCache."""
        empty = self.empty_prompt(prompt_tokens, prompt_mel, xvector)
        boundary = self.prompt_cache_tokens(prompt_tokens.shape[1])
        state = self.start(empty, max_target_tokens=0)
        if boundary > 0:
            ids = empty.prompt_tokens
            window = (ids[:boundary], ids[boundary:boundary + self.lookahead])
            self._advance([state], [window], streaming=True)
        return PromptCache(empty.prompt_tokens, empty.prompt_mel, empty.spks, state.encoder.trimmed(),
                           state.kv[..., :state.num_frames, :].clone(), state.conv.clone())

    def encoder_from_prompt(self, prompt: PromptCache, capacity_tokens: int) -> EncoderState:
        """A fresh encoder state of `capacity_tokens` that continues right after the voice's prompt."""
        encoder = self.flow.encoder.new_state(capacity_tokens)
        n = prompt.num_tokens
        encoder.kv_tokens[:, :, :n] = prompt.encoder.kv_tokens
        encoder.kv_frames[:, :, :UPSAMPLE * n] = prompt.encoder.kv_frames
        encoder.lookahead_tail = prompt.encoder.lookahead_tail.clone()
        encoder.up_tail = prompt.encoder.up_tail.clone()
        encoder.num_tokens = n
        return encoder

    def start(self, prompt: PromptCache, max_target_tokens: int = 0) -> FlowStreamState:
        """A request's state, with caches sized for prompt + max_target_tokens (they grow if exceeded)."""
        capacity = prompt.prompt_tokens.shape[0] + max_target_tokens
        encoder = self.encoder_from_prompt(prompt, capacity)
        n = prompt.num_tokens
        kv = prompt.kv.new_zeros(*prompt.kv.shape[:4], UPSAMPLE * capacity, prompt.kv.shape[-1])
        kv[..., :UPSAMPLE * n, :] = prompt.kv
        return FlowStreamState(prompt, encoder, kv, prompt.conv.clone())

    def feed(self, state: FlowStreamState, tokens: torch.Tensor) -> torch.Tensor:
        """One non-final chunk (official streaming=True, finalize=False): tokens [1, N] are all target
        tokens this chunk uses, the last 3 being look-ahead only. Returns the new target mel
        [1, 80, 2·(N − 3) − emitted] float32. P + N − 3 must be a multiple of the chunk (25)."""
        return self.feed_batch([state], [tokens])[0]

    @torch.no_grad()
    def feed_batch(self, states: Sequence[FlowStreamState], tokens: Sequence[torch.Tensor]
                   ) -> list[torch.Tensor]:
        """`feed` for B requests in one estimator batch; every request must add the same number of
        frames (prompt frames included). Returns each request's new target mel [1, 80, F_b]."""
        windows = [self._window(st, tok, finalize=False) for st, tok in zip(states, tokens, strict=True)]
        if len({ids.shape[0] for ids, _ in windows}) != 1:
            lengths = [ids.shape[0] for ids, _ in windows]
            raise ValueError(f"batched chunks must have equal lengths, got {lengths}")
        starts = [st.num_frames for st in states]
        mels = self._advance(states, windows, streaming=True)
        return [self._target_frames(st, m, f0) for st, m, f0 in zip(states, mels, starts, strict=True)]

    @torch.no_grad()
    def finish(self, state: FlowStreamState, tokens: torch.Tensor) -> torch.Tensor:
        """The final chunk: tokens [1, N] are all target tokens (no look-ahead). Returns the remaining
        target mel [1, 80, 2N − emitted] float32; the state is finished afterwards."""
        ids, _ = self._window(state, tokens, finalize=True)
        start = state.num_frames
        if self.final_attention == "full":
            p = state.prompt
            all_ids = torch.cat([p.prompt_tokens, tokens[0].to(p.prompt_tokens.device, torch.long)])
            mel = self.flow.generate(all_ids[None], p.prompt_mel[None], p.spks[None], streaming=False,
                                     finalize=True)[:, :, start:]
        elif ids.shape[0] == 0:
            mel = state.kv.new_zeros(1, self.flow.dims.output_size, 0, dtype=torch.float32)
        else:
            mel = self._advance([state], [(ids, None)], streaming=True)[0]
        state.is_finished = True
        return self._target_frames(state, mel, start)

    def window_end(self, state: FlowStreamState, num_target_tokens: int, finalize: bool) -> int:
        """Prompt + target position where a chunk over the first `num_target_tokens` target tokens ends (its
        window is [state.num_tokens, end)); the look-ahead tokens after it are context only."""
        return state.prompt.prompt_tokens.shape[0] + num_target_tokens - (0 if finalize else self.lookahead)

    def _window(self, state: FlowStreamState, tokens: torch.Tensor, finalize: bool) -> Window:
        """(ids of the new positions, look-ahead ids or None) for a request's next chunk."""
        if state.is_finished:
            raise ValueError("the flow stream of this request is already finished")
        p = state.prompt.prompt_tokens
        all_ids = torch.cat([p, tokens[0].to(p.device, torch.long)])
        end = self.window_end(state, tokens.shape[1], finalize)
        if end < state.num_tokens or (not finalize and end == state.num_tokens):
            raise ValueError(f"chunk ends at token {end}, but {state.num_tokens} tokens are already done")
        if not finalize and end % self.chunk_tokens:
            raise ValueError(f"a non-final chunk must end on a {self.chunk_tokens}-token boundary counted "
                             f"from the first prompt token (prompt padding rule); it ends at {end}")
        context = None if finalize else all_ids[end:]
        return all_ids[state.num_tokens:end], context

    def _target_frames(self, state: FlowStreamState, mel: torch.Tensor, start: int) -> torch.Tensor:
        skip = max(UPSAMPLE * state.prompt.prompt_tokens.shape[0] - start, 0)
        return mel[:, :, skip:]

    def _advance(self, states: Sequence[FlowStreamState], windows: Sequence[Window], streaming: bool
                 ) -> list[torch.Tensor]:
        """Encode each request's new tokens, then integrate all new frames in one batch -> [1, 80, C] each."""
        cfm = self.flow.decoder
        starts = [st.num_frames for st in states]
        # PERF: the encoder (~2% of the cost) runs per request; the estimator runs batched.
        mus = [self.flow.encode_step(ids, ctx, st.encoder, streaming)
               for st, (ids, ctx) in zip(states, windows, strict=True)]
        num_new = mus[0].shape[1]
        conds = [self._cond(st.prompt, f0, num_new) for st, f0 in zip(states, starts, strict=True)]
        z = torch.cat([cfm.noise(f0, num_new) for f0 in starts]).to(mus[0].device)
        spks = torch.stack([st.prompt.spks for st in states])
        x = self._integrate(states, starts, z, torch.stack(mus), spks, torch.stack(conds), streaming)
        return list(x.split(1))

    @staticmethod
    def _cond(prompt: PromptCache, start: int, num_new: int) -> torch.Tensor:
        """cond [80, num_new] for frames [start, start + num_new): prompt mel where it exists, else 0."""
        cond = prompt.prompt_mel.new_zeros(prompt.prompt_mel.shape[1], num_new)
        m = min(max(prompt.prompt_mel.shape[0] - start, 0), num_new)
        cond[:, :m] = prompt.prompt_mel[start:start + m].T
        return cond

    def _integrate(self, states: Sequence[FlowStreamState], starts: list[int], z: torch.Tensor,
                   mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool) -> torch.Tensor:
        """Euler-integrate C new frames per request (z, mu, cond [B, 80, C]) against each request's caches."""
        est = self.flow.decoder.estimator
        num_new = z.shape[-1]
        for st, f0 in zip(states, starts, strict=True):
            st.reserve(f0 + num_new)
        pos = torch.stack([torch.arange(f0, f0 + num_new, device=z.device) for f0 in starts])  # [B, C]
        chunk = est.dims.static_chunk_size if streaming else 0
        dtype = states[0].kv.dtype
        bias = [chunk_attention_bias(p, f0 + num_new, chunk, dtype)
                for p, f0 in zip(pos, starts, strict=True)]
        single = len(states) == 1

        def velocity(k: int, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                     t: torch.Tensor) -> torch.Tensor:
            conv = states[0].conv[k] if single else torch.cat([st.conv[k] for st in states])
            v = est.step(x, mu, spks, cond, t, [st.kv[k] for st in states], conv, pos, bias)
            if not single:
                for b, st in enumerate(states):
                    st.conv[k].copy_(conv[2 * b:2 * b + 2])
            return v

        return self.flow.decoder.solve(z, mu, spks, cond, velocity)
