"""CosyVoice3 flow `CausalMaskedDiffWithDiT`: token embedding, pre-look-ahead conv, ×2 repeat, CFM with
the DiT estimator (spec/cosyvoice3.md §5).

`CV3Flow.inference` is the official whole-sequence call. `FlowStream` is the incremental form used for
streaming: the estimator keeps, per Euler step, the keys/values of the complete attention blocks, so a
chunk only runs the DiT over its own new frames (plus the frames of a block it completes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cosystream.checkpoint.hparams import CV3FlowDims
from cosystream.models.cfm import build_noise_table, cosine_schedule
from cosystream.models.cosyvoice3.dit import DiT, DiTCache, DiTPending, commit


class PreLookaheadLayer(nn.Module):
    """Conv1d(80→C, k = L+1) over L frames of right context → LeakyReLU(0.01) → left pad 2 →
    Conv1d(C→80, k 3) → + input."""

    def __init__(self, in_channels: int, channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(in_channels, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, 3)

    def forward(self, inputs: torch.Tensor, finalize: bool) -> torch.Tensor:
        """inputs [B, T, 80] -> [B, T, 80] (finalize: zero right context) or [B, T − L, 80] (not finalize:
        the last L tokens are context only)."""
        if finalize:
            body = inputs
            h = F.pad(inputs.transpose(1, 2), (0, self.lookahead))
        else:
            body = inputs[:, :-self.lookahead]
            h = inputs.transpose(1, 2)
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + body


class CV3CFM(nn.Module):
    """The flow's `decoder`: the DiT estimator (keys `decoder.estimator.*`), the seed-0 noise table, the
    cosine grid and the CFG pair (identical to CosyVoice2's, spec/cosyvoice3.md §5.2)."""

    def __init__(self, dims: CV3FlowDims) -> None:
        super().__init__()
        self.estimator = DiT(dims.dit)
        self.cfg_rate = dims.inference_cfg_rate
        self.t_steps, self.dt_steps = cosine_schedule(dims.n_timesteps)
        self.register_buffer("rand_noise", build_noise_table(dims.output_size), persistent=False)

    def set_noise_table(self, table: torch.Tensor) -> None:
        self.rand_noise = table.to(device=self.rand_noise.device, dtype=torch.float32)

    def noise(self, start: int, num_frames: int) -> torch.Tensor:
        if start + num_frames > self.rand_noise.shape[-1]:
            raise ValueError(f"flow call needs noise frames up to {start + num_frames}, "
                             f"the table has {self.rand_noise.shape[-1]}")
        return self.rand_noise[:, :, start:start + num_frames].float()

    def cfg_rows(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch-1 inputs as the official two estimator rows: (conditional, all-zero unconditional)."""
        dtype = self.estimator.proj_out.weight.dtype
        return tuple(torch.cat([a, torch.zeros_like(a)]).to(dtype) for a in (mu, spks, cond))  # type: ignore

    def euler(self, x: torch.Tensor, v: torch.Tensor, dt: float) -> torch.Tensor:
        v = v.float()
        # PARITY: v = (1 + λ)·v_c − λ·v_u, x += dt·v in float32
        return x + dt * ((1.0 + self.cfg_rate) * v[0:1] - self.cfg_rate * v[1:2])

    def sample(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool) -> torch.Tensor:
        """Whole-sequence integration from frame 0: mu, cond [1, 80, F], spks [1, 80] -> x1 [1, 80, F] float32."""
        return self.sample_frames(mu, spks, cond, streaming)[0]

    def sample_frames(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool,
                      caches: list[DiTCache] | None = None, start: int = 0
                      ) -> tuple[torch.Tensor, list[DiTPending]]:
        """Integrate frames [start, start + n) from the noise table: mu, cond [1, 80, n], spks [1, 80] ->
        (x1 [1, 80, n] float32, what each Euler step's estimator computed, when `caches` are given). With
        `caches` (one per step) the estimator also attends to the cached frames [0, start); the caller
        `commit`s what it keeps."""
        mu_in, spks_in, cond_in = self.cfg_rows(mu, spks, cond)
        x = self.noise(start, mu.shape[2])
        pendings = []
        for k, (t, dt) in enumerate(zip(self.t_steps, self.dt_steps, strict=True)):
            t_in = torch.full((2,), t, device=x.device, dtype=torch.float32)
            rows = x.expand(2, -1, -1).to(mu_in.dtype)
            cache = caches[k] if caches is not None else None
            v, pending = self.estimator(rows, mu_in, spks_in, cond_in, t_in, streaming, cache)
            if caches is not None:  # without caches nothing is kept (a full pass's keys would be large)
                pendings.append(pending)
            x = self.euler(x, v, dt)
        return x, pendings


class CV3Flow(nn.Module):
    """`CausalMaskedDiffWithDiT` (keys as in flow.pt)."""

    def __init__(self, dims: CV3FlowDims) -> None:
        super().__init__()
        self.dims = dims
        self.input_embedding = nn.Embedding(dims.vocab_size, dims.input_size)
        self.spk_embed_affine_layer = nn.Linear(dims.spk_embed_dim, dims.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(dims.input_size, dims.pre_lookahead_channels,
                                                     dims.pre_lookahead_len)
        self.decoder = CV3CFM(dims)

    @property
    def ratio(self) -> int:
        return self.dims.token_mel_ratio

    def project_speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        """x-vector [1, 192] -> spks [1, 80]."""
        emb = F.normalize(embedding.float(), dim=1).to(self.spk_embed_affine_layer.weight.dtype)
        return self.spk_embed_affine_layer(emb)

    def token_features(self, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        """All tokens (prompt ⊕ generated) [1, T] -> mu [1, 80, ratio·T'] (T' = T, or T − L if not finalize)."""
        dev = self.input_embedding.weight.device
        e = self.input_embedding(tokens.to(dev, torch.long).clamp(min=0))
        h = self.pre_lookahead_layer(e, finalize)
        return h.repeat_interleave(self.ratio, dim=1).transpose(1, 2)

    @staticmethod
    def conditions(prompt_feat: torch.Tensor, num_frames: int, start: int = 0) -> torch.Tensor:
        """cond [1, 80, n] for frames [start, start + n): the prompt mel, then zeros."""
        cond = torch.zeros(1, prompt_feat.shape[2], num_frames, device=prompt_feat.device, dtype=prompt_feat.dtype)
        end = min(prompt_feat.shape[1], start + num_frames)
        if end > start:
            cond[:, :, :end - start] = prompt_feat[:, start:end].transpose(1, 2)
        return cond

    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool, finalize: bool) -> torch.Tensor:
        """The official whole-sequence call: mel [1, 80, F − 2P] float32 (prompt frames dropped).

        token [1, N], prompt_token [1, P], prompt_feat [1, 2P, 80], embedding [1, 192].
        """
        spks = self.project_speaker(embedding)
        mu = self.token_features(torch.cat([prompt_token.to(token.device), token], dim=1), finalize)
        feat = prompt_feat.to(mu.device, mu.dtype)
        cond = self.conditions(feat, mu.shape[2])
        mel = self.decoder.sample(mu, spks, cond, streaming)
        return mel[:, :, feat.shape[1]:].float()


def cache_bytes_per_frame(dims: CV3FlowDims, dtype: torch.dtype) -> int:
    """Bytes a `FlowStream` keeps per committed frame: keys and values of every layer, for both CFG rows,
    at every Euler step (the conv tails are a constant 2·30 frames per step and row)."""
    d = dims.dit
    return dims.n_timesteps * d.depth * 2 * 2 * d.heads * d.dim_head * torch.finfo(dtype).bits // 8


@dataclass
class PromptBlocks:
    """A voice's prompt frames that no target token can change, encoded once: per Euler step, the DiT
    keys/values and conv tails of the complete attention blocks among them. Shared read-only by every
    stream in that voice (`commit` appends by concatenation, never in place)."""

    caches: list[DiTCache]
    frames: int


def encode_prompt_blocks(flow: CV3Flow, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                         embedding: torch.Tensor) -> PromptBlocks:
    """Run the DiT over the prompt's complete blocks whose token features do not depend on the target.

    A frame of token t sees tokens up to t + L (the pre-look-ahead), so frames of tokens [0, P − L) are
    fixed by the prompt alone; the blocks entirely inside them are computed and kept.
    """
    dev = flow.input_embedding.weight.device
    block = flow.decoder.estimator.dims.static_chunk_size
    fixed_frames = flow.ratio * max(prompt_token.shape[1] - flow.dims.pre_lookahead_len, 0)
    frames = (fixed_frames // block) * block
    caches = [DiTCache() for _ in flow.decoder.t_steps]
    if frames == 0:
        return PromptBlocks(caches=caches, frames=0)
    feat = prompt_feat.to(dev, flow.spk_embed_affine_layer.weight.dtype)
    mu = flow.token_features(prompt_token.to(dev), finalize=False)[:, :, :frames]
    spks = flow.project_speaker(embedding.to(dev))
    _, pendings = flow.decoder.sample_frames(mu, spks, flow.conditions(feat, frames), streaming=True,
                                             caches=caches)
    for cache, pending in zip(caches, pendings, strict=True):
        commit(cache, pending, frames)
    return PromptBlocks(caches=caches, frames=frames)


@dataclass
class FlowStreamState:
    caches: list[DiTCache]
    spks: torch.Tensor


class FlowStream:
    """Incremental flow for one streaming request (block-causal attention).

    `push(all tokens so far, token_offset, finalize)` returns the mel frames from `2·token_offset`, as the
    official `flow.inference(..., streaming=True)` would, but runs the DiT only from the start of the
    first attention block not yet complete: keys/values of complete blocks are kept per Euler step.
    """

    def __init__(self, flow: CV3Flow, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                 embedding: torch.Tensor, prompt_blocks: PromptBlocks | None = None) -> None:
        """prompt_blocks: the voice's encoded prompt blocks (`encode_prompt_blocks` of the same prompt),
        so that the first chunk starts after them."""
        self.flow = flow
        dev = flow.input_embedding.weight.device
        self.prompt_token = prompt_token.to(dev)
        self.prompt_feat = prompt_feat.to(dev, flow.spk_embed_affine_layer.weight.dtype)
        self.prompt_frames = prompt_feat.shape[1]
        caches = ([DiTCache(list(c.keys), list(c.values), c.tail1, c.tail2, c.length) for c in prompt_blocks.caches]
                  if prompt_blocks is not None else [DiTCache() for _ in flow.decoder.t_steps])
        self.state = FlowStreamState(caches=caches, spks=flow.project_speaker(embedding.to(dev)))

    @property
    def block(self) -> int:
        return self.flow.decoder.estimator.dims.static_chunk_size

    def push(self, tokens: torch.Tensor, token_offset: int, finalize: bool) -> torch.Tensor:
        """tokens [1, N] (all generated so far) -> new mel [1, 80, m] float32, frames from 2·token_offset."""
        flow, st = self.flow, self.state
        mu = flow.token_features(torch.cat([self.prompt_token, tokens.to(self.prompt_token.device)], dim=1),
                                 finalize)
        total = mu.shape[2]
        first_new = self.prompt_frames + flow.ratio * token_offset
        start = st.caches[0].length
        if first_new < start:
            raise ValueError(f"FlowStream: frames from {first_new} requested, but frames before {start} are "
                             "committed (token_offset went backwards)")
        cond = flow.conditions(self.prompt_feat, total - start, start)
        mel, pendings = flow.decoder.sample_frames(mu[:, :, start:], st.spks, cond, streaming=True, caches=st.caches,
                                                   start=start)
        complete = (total // self.block) * self.block if not finalize else total
        for cache, pending in zip(st.caches, pendings, strict=True):
            commit(cache, pending, complete - start)
        return mel[:, :, first_new - start:].float()
