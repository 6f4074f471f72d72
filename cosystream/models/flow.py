"""CosyVoice2 flow (`CausalMaskedDiffWithXvec`): speech tokens + speaker + prompt -> 80-bin mel.

spec/flow.md §1-3 (token embedding, `UpsampleConformerEncoder`, conditioning) and §6; the CFM and the
estimator are in cfm.py / estimator.py. The encoder runs as `step` over new tokens with an exact
`EncoderState` (attention keys/values, conv tails), so the whole-sequence call and the incremental
stream (flow_stream.py) share one code path. State-dict keys equal the official flow.pt keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cosystream.checkpoint.hparams import EncoderDims, FlowDims
from cosystream.models.cfm import CausalConditionalCFM
from cosystream.models.estimator import chunk_attention_bias, masked_value

LOOKAHEAD_CONTEXT = 2  # left frames of the pre-look-ahead conv2 (kernel 3)
UPSAMPLE = 2  # frames per token; PARITY: the official up_layer hard-codes stride 2 (token_mel_ratio)
UP_CONTEXT = 4  # left frames of the upsample conv (kernel 5)


def grow_axis(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` if its `dim` holds >= size entries, else a zero-padded copy (at least doubled, amortised)."""
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = max(size, 2 * t.shape[dim])
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


@dataclass
class EncoderState:
    """Exact encoder state after its first `num_tokens` tokens (batch 1, positions from 0).

    kv_tokens [L1, 2, cap, D]: keys/values of the token-rate layers; kv_frames [L2, 2, 2·cap, D]: of the
    frame-rate layers; lookahead_tail [2, D]: pre-look-ahead conv1 outputs of the 2 tokens before
    num_tokens; up_tail [4, D]: upsampled frames before frame 2·num_tokens. Zeros = official padding.
    """

    kv_tokens: torch.Tensor
    kv_frames: torch.Tensor
    lookahead_tail: torch.Tensor
    up_tail: torch.Tensor
    num_tokens: int = 0

    def reserve(self, num_tokens: int) -> None:
        self.kv_tokens = grow_axis(self.kv_tokens, 2, num_tokens)
        self.kv_frames = grow_axis(self.kv_frames, 2, UPSAMPLE * num_tokens)

    def batch_rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """kv_tokens, kv_frames, lookahead_tail, up_tail copied into `rows` batch rows (step_batch's layout)."""
        tensors = (self.kv_tokens, self.kv_frames, self.lookahead_tail, self.up_tail)
        return tuple(t.unsqueeze(0).repeat(rows, *[1] * t.dim()) for t in tensors)  # type: ignore[return-value]

    def trimmed(self) -> EncoderState:
        """A compact copy holding exactly num_tokens positions."""
        n = self.num_tokens
        return EncoderState(self.kv_tokens[:, :, :n].clone(), self.kv_frames[:, :, :UPSAMPLE * n].clone(),
                            self.lookahead_tail.clone(), self.up_tail.clone(), n)


def rel_position_table(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """ESPnet rel-pos encodings for float32 distances [R] -> [R, dim] (sin even, cos odd; spec §2.3)."""
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=distances.device)
                    * -(math.log(10000.0) / dim))
    # PARITY: distance × frequency in float32, as the official table (same value for the same distance,
    # whatever the table length, so incremental calls see the official numbers).
    arg = distances.unsqueeze(1) * div
    return torch.stack([arg.sin(), arg.cos()], dim=-1).flatten(1)


class LinearInput(nn.Module):
    """Linear + LayerNorm, then ×√D (the rel-pos "encoding" adds nothing; spec §2.2)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(in_dim, dim), nn.LayerNorm(dim, eps=1e-5))
        self.xscale = math.sqrt(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class RelPositionAttention(nn.Module):
    """Transformer-XL style relative-position MHA with pos_bias_u/v (spec §2.5)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.h, self.d_k = num_heads, dim // num_heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(num_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(num_heads, self.d_k))
        self.qkv: tuple[torch.Tensor, torch.Tensor] | None = None  # fuse_projections (not state-dict keys)

    def fuse_projections(self) -> None:
        """PERF: one q/k/v GEMM and one cache write instead of three GEMMs and two writes (call after the
        weights are loaded and cast)."""
        self.qkv = (torch.cat([self.linear_q.weight, self.linear_k.weight, self.linear_v.weight]),
                    torch.cat([self.linear_q.bias, self.linear_k.bias, self.linear_v.bias]))

    def forward(self, x: torch.Tensor, kv: torch.Tensor, start: int, rel_table: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
        """x [B, n, D] at positions [start, start+n) of every row; kv [B, 2, cap, D] (written at those
        positions); rel_table [start+2n-1, D] for distances start+n-1 … -(n-1); bias [B or 1, n, start+n]."""
        b, n, end = x.shape[0], x.shape[1], start + x.shape[1]
        if self.qkv is None:
            kv[:, 0, start:end] = self.linear_k(x)
            kv[:, 1, start:end] = self.linear_v(x)
            q = self.linear_q(x).view(b, n, self.h, self.d_k)
        else:
            qkv = F.linear(x, *self.qkv).view(b, n, 3, self.h * self.d_k)
            kv[:, :, start:end] = qkv[:, :, 1:].transpose(1, 2)
            q = qkv[:, :, 0].view(b, n, self.h, self.d_k)
        k = kv[:, 0, :end].view(b, end, self.h, self.d_k).transpose(1, 2)  # [B, H, end, d_k]
        v = kv[:, 1, :end].view(b, end, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(rel_table).view(-1, self.h, self.d_k).transpose(0, 1)  # [H, R, d_k]
        ac = (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(2, 3)  # [B, H, n, end]
        bd_all = ((q + self.pos_bias_v).transpose(1, 2) @ p.transpose(1, 2)).contiguous()  # [B, H, n, R]
        # Query i (local) vs key j has distance start+i-j, table row n-1-i+j: a strided diagonal view
        # (what the official rel_shift computes).
        rows = bd_all.shape[-1]
        bd = bd_all.as_strided((b, self.h, n, end), (self.h * n * rows, n * rows, rows - 1, 1),
                               bd_all.storage_offset() + n - 1)
        scores = (ac + bd) / math.sqrt(self.d_k) + bias.unsqueeze(1)
        out = torch.softmax(scores, dim=-1) @ v  # [B, H, n, d_k]
        return self.linear_out(out.transpose(1, 2).reshape(b, n, -1))


class ConformerLayer(nn.Module):
    """Pre-LN conformer layer without macaron or conv module (spec §2.5)."""

    def __init__(self, dims: EncoderDims) -> None:
        super().__init__()
        d = dims.output_size
        self.self_attn = RelPositionAttention(d, dims.attention_heads)
        self.feed_forward = nn.Module()
        self.feed_forward.w_1 = nn.Linear(d, dims.linear_units)
        self.feed_forward.w_2 = nn.Linear(dims.linear_units, d)
        self.norm_mha = nn.LayerNorm(d, eps=1e-12)  # PARITY: ESPnet's 1e-12, not torch's 1e-5
        self.norm_ff = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, start: int, rel_table: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), kv, start, rel_table, bias)
        ff = self.feed_forward
        return x + ff.w_2(F.silu(ff.w_1(self.norm_ff(x))))


class PreLookahead(nn.Module):
    """x + conv2(left-pad 2, LeakyReLU(conv1([x; context]))) (spec §2.4)."""

    def __init__(self, dim: int, lookahead: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(dim, dim, lookahead + 1)
        self.conv2 = nn.Conv1d(dim, dim, LOOKAHEAD_CONTEXT + 1)

    def forward(self, u: torch.Tensor, context: torch.Tensor, tail: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """u [B, n, D] new positions, context [B, lookahead, D] (zeros when finalizing), tail [B, 2, D]
        (conv1 outputs of the 2 positions before u) -> ([B, n, D], the new tail)."""
        # PARITY: LeakyReLU with torch's default slope 0.01 (spec §2.4).
        a = F.leaky_relu(self.conv1(torch.cat([u, context], dim=1).transpose(1, 2)))  # [B, D, n]
        a = torch.cat([tail.transpose(1, 2), a], dim=2)
        return u + self.conv2(a).transpose(1, 2), a[:, :, -LOOKAHEAD_CONTEXT:].transpose(1, 2).clone()


class Upsample(nn.Module):
    """Nearest ×2 then a causal kernel-5 conv (`up_layer`, spec §2.7)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, UP_CONTEXT + 1)

    def forward(self, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, D], tail [B, 4, D] (upsampled frames before these) -> ([B, 2n, D], the new tail)."""
        z = torch.cat([tail, x.repeat_interleave(UPSAMPLE, dim=1)], dim=1)
        return self.conv(z.transpose(1, 2)).transpose(1, 2), z[:, -UP_CONTEXT:].clone()


class UpsampleConformerEncoder(nn.Module):
    """Token encoder: linear input, pre-look-ahead, conformer (25 Hz), ×2 upsample, conformer (50 Hz)."""

    def __init__(self, dims: EncoderDims, input_size: int, lookahead: int) -> None:
        super().__init__()
        d = dims.output_size
        self.dims, self.lookahead = dims, lookahead
        self.embed = LinearInput(input_size, d)
        self.pre_lookahead_layer = PreLookahead(d, lookahead)
        self.encoders = nn.ModuleList([ConformerLayer(dims) for _ in range(dims.num_blocks)])
        self.up_layer = Upsample(d)
        self.up_embed = LinearInput(d, d)
        self.up_encoders = nn.ModuleList([ConformerLayer(dims) for _ in range(dims.num_up_blocks)])
        self.after_norm = nn.LayerNorm(d, eps=1e-5)
        self._rel_tables: dict[tuple, tuple[int, torch.Tensor]] = {}  # (device, dtype) -> (max distance, table)
        self._outgrown: list[torch.Tensor] = []  # tables replaced by larger ones: graphs captured earlier read them

    def fuse_projections(self) -> None:
        """Fuse every conformer layer's q/k/v projections (RelPositionAttention.fuse_projections)."""
        for layer in [*self.encoders, *self.up_encoders]:
            layer.self_attn.fuse_projections()

    def rel_table(self, start: int, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """rel_position_table rows for distances start+n-1 … -(n-1) in `dtype` [start+2n-1, D]: a slice of one
        table of every distance up to the largest asked for so far. PERF: no launches a call (a graph
        replays ~9 for it otherwise, twice an encoder step); the same numbers, row by row."""
        key = (str(device), dtype)
        largest = start + n - 1
        made = self._rel_tables.get(key)
        if made is None or made[0] < largest:
            top = max(largest, 2 * made[0] if made else 4096)
            distances = torch.arange(top, -top - 1, -1, device=device, dtype=torch.float32)
            made = (top, rel_position_table(distances, self.dims.output_size).to(dtype))
            # one made inside a CUDA-graph capture belongs to the graph's memory: used, not kept
            if not (made[1].is_cuda and torch.cuda.is_current_stream_capturing()):
                if key in self._rel_tables:
                    self._outgrown.append(self._rel_tables[key][1])  # never freed under a graph that reads it
                self._rel_tables[key] = made
        top, table = made
        return table[top - largest: top + n]

    def new_state(self, capacity_tokens: int) -> EncoderState:
        w = self.after_norm.weight
        d, kw = self.dims.output_size, {"device": w.device, "dtype": w.dtype}
        return EncoderState(
            kv_tokens=torch.zeros(len(self.encoders), 2, capacity_tokens, d, **kw),
            kv_frames=torch.zeros(len(self.up_encoders), 2, UPSAMPLE * capacity_tokens, d, **kw),
            lookahead_tail=torch.zeros(LOOKAHEAD_CONTEXT, d, **kw), up_tail=torch.zeros(UP_CONTEXT, d, **kw))

    def step(self, emb: torch.Tensor, context: torch.Tensor | None, state: EncoderState,
             streaming: bool) -> torch.Tensor:
        """Encode n new tokens that follow state.num_tokens; returns h [2n, D] (after after_norm).

        emb [n, input_size]: token embeddings; context [lookahead, input_size]: embeddings of the
        look-ahead tokens, or None when finalizing (zeros). Exact when state.num_tokens is a chunk
        boundary (or streaming is False and the state is empty). Updates `state`.
        """
        start, n = state.num_tokens, emb.shape[0]
        state.reserve(start + n)
        h, lookahead_tail, up_tail = self.step_batch(
            emb[None], None if context is None else context[None], state.kv_tokens[None], state.kv_frames[None],
            state.lookahead_tail[None], state.up_tail[None], start, streaming)
        state.lookahead_tail, state.up_tail = lookahead_tail[0], up_tail[0]
        state.num_tokens = start + n
        return h[0]

    def step_batch(self, emb: torch.Tensor, context: torch.Tensor | None, kv_tokens: torch.Tensor,
                   kv_frames: torch.Tensor, lookahead_tail: torch.Tensor, up_tail: torch.Tensor, start: int,
                   streaming: bool, valid: torch.Tensor | None = None, positions: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`step` for B streams that are all at token `start`: emb [B, n, input_size], context
        [B, lookahead, input_size] or None, caches kv_tokens [B, L1, 2, cap, D] / kv_frames [B, L2, 2,
        2·cap, D] (written in place), tails [B, 2, D] / [B, 4, D]. Returns (h [B, 2n, D], new tails).

        valid [B] (full passes from token 0 only): row b holds valid[b] real tokens followed by padding.
        The padding acts as the zero look-ahead of a finalizing call and is masked out of every
        attention, so each row's first valid[b] tokens get what a call over those tokens alone gives.
        positions [B] (default valid): keys from positions[b] on are masked, so a row's tokens between
        positions[b] and valid[b] act as the look-ahead context of a non-finalizing call.
        """
        n = emb.shape[1]
        u = self.embed(emb)
        if valid is not None:
            u = u * (torch.arange(n, device=u.device)[None, :] < valid[:, None]).unsqueeze(-1).to(u.dtype)
        ctx = self.embed(context) if context is not None else u.new_zeros(u.shape[0], self.lookahead, u.shape[2])
        x, lookahead_tail = self.pre_lookahead_layer(u, ctx, lookahead_tail)
        keys = valid if positions is None else positions
        x = self._layers(self.encoders, x, kv_tokens, start, self.dims.static_chunk_size, streaming, keys)
        up, up_tail = self.up_layer(x, up_tail)
        z = self.up_embed(up)
        chunk = UPSAMPLE * self.dims.static_chunk_size
        z = self._layers(self.up_encoders, z, kv_frames, UPSAMPLE * start, chunk, streaming,
                         None if keys is None else UPSAMPLE * keys)
        return self.after_norm(z), lookahead_tail, up_tail

    def _layers(self, layers: nn.ModuleList, x: torch.Tensor, kv: torch.Tensor, start: int, chunk: int,
                streaming: bool, valid: torch.Tensor | None) -> torch.Tensor:
        n = x.shape[1]
        rel_table = self.rel_table(start, n, x.device, x.dtype)
        q_pos = torch.arange(start, start + n, device=x.device)
        bias = chunk_attention_bias(q_pos, start + n, chunk if streaming else 0, x.dtype)[None]
        if valid is not None:  # keys beyond each row's valid length are padding
            real = torch.arange(start + n, device=x.device)[None, None, :] < valid[:, None, None]
            bias = torch.where(real, bias, torch.full((), masked_value(x.dtype), device=x.device, dtype=x.dtype))
        for i, layer in enumerate(layers):
            x = layer(x, kv[:, i], start, rel_table, bias)
        return x


class Flow(nn.Module):
    """`CausalMaskedDiffWithXvec` (CosyVoice2 flow); `state_dict()` keys/shapes equal flow.pt's."""

    def __init__(self, dims: FlowDims) -> None:
        super().__init__()
        self.dims = dims
        self.input_embedding = nn.Embedding(dims.vocab_size, dims.input_size)
        self.spk_embed_affine_layer = nn.Linear(dims.spk_embed_dim, dims.output_size)
        self.encoder = UpsampleConformerEncoder(dims.encoder, dims.input_size, dims.pre_lookahead_len)
        self.encoder_proj = nn.Linear(dims.encoder.output_size, dims.output_size)
        self.decoder = CausalConditionalCFM(dims)

    def project_speaker(self, xvector: torch.Tensor) -> torch.Tensor:
        """Raw x-vector [B, 192] -> spks [B, 80] (L2-normalised, then affine)."""
        w = self.spk_embed_affine_layer.weight
        return self.spk_embed_affine_layer(F.normalize(xvector.to(w.dtype), dim=1))

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Speech token ids [..., T] -> [..., T, input_size] (negative ids read row 0, as official)."""
        return self.input_embedding(tokens.long().clamp(min=0))

    def encode_step(self, tokens: torch.Tensor, context: torch.Tensor | None, state: EncoderState,
                    streaming: bool) -> torch.Tensor:
        """New token ids [n] (+ look-ahead ids [3] or None) -> mu [80, 2n] for frames 2·state.num_tokens…"""
        ctx = self.embed_tokens(context) if context is not None else None
        h = self.encoder.step(self.embed_tokens(tokens), ctx, state, streaming)
        return self.encoder_proj(h).T

    def encode(self, tokens: torch.Tensor, streaming: bool, finalize: bool) -> torch.Tensor:
        """Whole-sequence encoder: ids [1, T] -> h [1, 2T', D] (T' = T − 3 unless finalize)."""
        ids = tokens[0]
        context = None if finalize else ids[-self.dims.pre_lookahead_len:]
        ids = ids if finalize else ids[:-self.dims.pre_lookahead_len]
        ctx = self.embed_tokens(context) if context is not None else None
        state = self.encoder.new_state(ids.shape[0])
        return self.encoder.step(self.embed_tokens(ids), ctx, state, streaming).unsqueeze(0)

    def encode_padded(self, tokens: torch.Tensor, valid: torch.Tensor, streaming: bool = False,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder over B padded rows from token 0: ids [B, T], valid [B] real tokens per row -> mu
        [B, 80, 2T]. streaming=False: the finalizing full-attention call, each row's first 2·valid[b]
        frames equal `encode` of its real tokens alone (projected). streaming=True: chunk masks;
        positions [B] (default valid): a row's tokens that are positions, the rest of its real tokens
        being look-ahead context only, so its first 2·positions[b] frames equal `encode` with finalize
        False (positions = valid − 3) or True (positions = valid: the padding is the zero look-ahead).
        The rest is padding."""
        b, t = tokens.shape
        caches = self.encoder.new_state(t).batch_rows(b)
        h, _, _ = self.encoder.step_batch(self.embed_tokens(tokens), None, *caches, 0, streaming=streaming,
                                          valid=valid, positions=positions)
        return self.encoder_proj(h).transpose(1, 2)

    def generate(self, tokens: torch.Tensor, prompt_mel: torch.Tensor, spks: torch.Tensor, streaming: bool,
                 finalize: bool) -> torch.Tensor:
        """All ids [1, P+N], prompt mel [1, F_p, 80], spks [1, 80] -> mel [1, 80, F] float32 (with prompt)."""
        mu = self.encoder_proj(self.encode(tokens, streaming, finalize)).transpose(1, 2)  # [1, 80, F]
        cond = torch.zeros_like(mu)
        # PARITY: copies F_p prompt frames even if F_p != 2P (spec/flow.md §3).
        cond[:, :, :prompt_mel.shape[1]] = prompt_mel.transpose(1, 2).to(cond.dtype)
        return self.decoder.sample(mu, spks, cond, streaming)

    @torch.no_grad()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool = False, finalize: bool = True) -> torch.Tensor:
        """Official call contract (spec/flow.md §1).

        token [1, N] int, prompt_token [1, P] int, prompt_feat [1, 2P, 80], embedding [1, 192] ->
        mel [1, 80, F_out] float32 with F_out = 2N (finalize) or 2(N − 3); the prompt frames are removed.
        """
        if token.shape[0] != 1:
            raise ValueError(f"flow inference takes batch 1, got token shape {tuple(token.shape)}")
        device = self.input_embedding.weight.device
        tokens = torch.cat([prompt_token, token], dim=1).to(device)
        mel = self.generate(tokens, prompt_feat.to(device), self.project_speaker(embedding.to(device)),
                            streaming, finalize)
        return mel[:, :, prompt_feat.shape[1]:]
