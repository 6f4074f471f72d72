"""The CosyVoice2 speech LM: a Qwen2 decoder fed hand-assembled embeddings, with a speech-token head.

spec/llm.md §1-4. Our own implementation: fused q/k/v and gate/up projections, a static KV cache
(`KVCache`) indexed by stream slot, and one `forward` for prefill, extension and batched decode, so
the decode step has static shapes and can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from cosystream.checkpoint.hparams import LLMDims
from cosystream.errors import CheckpointError

# Official key prefix of the Qwen2 backbone inside llm.pt (Qwen2LM.llm.model.model).
_QWEN = "llm.model.model."


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PARITY: normalise in float32 then cast back (spec/llm.md §1); PERF: one fused kernel.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class KVCache(nn.Module):
    """Preallocated keys/values: [layers, slots, kv_heads, max_len, head_dim]; a stream owns one slot.

    Bytes per cached position: 2 · layers · kv_heads · head_dim · dtype size (12 KiB for the 0.5B model
    in bf16).
    """

    def __init__(self, dims: LLMDims, max_slots: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        super().__init__()
        shape = (dims.num_layers, max_slots, dims.num_kv_heads, max_len, dims.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.max_slots = max_slots
        self.max_len = max_len


def rope_tables(dims: LLMDims, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., head_dim] for integer positions (rotate-half layout, base rope_theta)."""
    half = dims.head_dim // 2
    inv_freq = dims.rope_theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, dims: LLMDims) -> None:
        super().__init__()
        self.dims = dims
        q_size, kv_size = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.qkv_proj = nn.Linear(dims.hidden_size, q_size + 2 * kv_size, bias=True)
        self.o_proj = nn.Linear(q_size, dims.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.gate_up_proj = nn.Linear(dims.hidden_size, 2 * dims.intermediate_size, bias=False)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache_k: torch.Tensor,
                cache_v: torch.Tensor, write: tuple[torch.Tensor, torch.Tensor], attn_bias: torch.Tensor,
                slots: torch.Tensor | None) -> torch.Tensor:
        h = h + self._attention(self.input_layernorm(h), rope, cache_k, cache_v, write, attn_bias, slots)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def _attention(self, a: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache_k: torch.Tensor,
                   cache_v: torch.Tensor, write: tuple[torch.Tensor, torch.Tensor], attn_bias: torch.Tensor,
                   slots: torch.Tensor | None) -> torch.Tensor:
        d = self.dims
        batch, n, _ = a.shape
        groups = d.num_heads // d.num_kv_heads
        qkv = self.qkv_proj(a).view(batch, n, d.num_heads + 2 * d.num_kv_heads, d.head_dim)
        # PERF: rotate q and k heads in one pass
        qk = apply_rope(qkv[:, :, :d.num_heads + d.num_kv_heads], *rope)
        q, k = qk[:, :, :d.num_heads], qk[:, :, d.num_heads:]
        v = qkv[:, :, d.num_heads + d.num_kv_heads:]
        rows, cols = write  # [B, n] each: cache row and position of every new token
        cache_k[rows, :, cols] = k
        cache_v[rows, :, cols] = v
        attn_len = attn_bias.shape[-1]
        # PERF: decode uses the contiguous rows [0, B) so keys are a view, not a gathered copy.
        keys = cache_k[:batch, :, :attn_len] if slots is None else cache_k[slots, :, :attn_len]
        values = cache_v[:batch, :, :attn_len] if slots is None else cache_v[slots, :, :attn_len]
        # PERF: GQA without repeating K/V: the `groups` query heads of one KV head become extra rows.
        q = q.view(batch, n, d.num_kv_heads, groups, d.head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch, d.num_kv_heads, groups * n, d.head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_bias)
        out = out.view(batch, d.num_kv_heads, groups, n, d.head_dim).permute(0, 3, 1, 2, 4)
        return self.o_proj(out.reshape(batch, n, d.num_heads * d.head_dim))


class KeepEveryToken:
    """The token filter of a family that sends every generated speech token to the flow."""

    def keep(self, token: int) -> bool:
        return True


class SpeechLM(nn.Module):
    """Qwen2LM of CosyVoice2: text/speech embeddings, Qwen2 decoder, speech-token head.

    Parameters mirror llm.pt after `convert_official_state` (q/k/v and gate/up fused).
    """

    def __init__(self, dims: LLMDims) -> None:
        super().__init__()
        self.dims = dims
        self.text_embedding = nn.Embedding(dims.text_vocab_size, dims.hidden_size)
        self.speech_embedding = nn.Embedding(dims.num_speech_classes, dims.hidden_size)
        self.llm_embedding = nn.Embedding(2, dims.hidden_size)  # row 0 = SOS, row 1 = TASK_ID
        self.layers = nn.ModuleList(DecoderLayer(dims) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.llm_decoder = nn.Linear(dims.hidden_size, dims.num_speech_classes, bias=True)
        self._rope_key: tuple[int, str] | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ input assembly (spec/llm.md §3)
    def embed_prompt(self, text_ids: torch.Tensor, speech_tokens: torch.Tensor,
                     prompt_text_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[SOS] ⊕ E_text(T_p ⊕ T) ⊕ [TASK_ID] ⊕ E_speech(S_p) -> [L0, d] (1-D id tensors in); the SOS and
        TASK_ID rows are `special_rows()` (a subclass places them elsewhere)."""
        dev = self.speech_embedding.weight.device
        ids = text_ids if prompt_text_ids is None else torch.cat([prompt_text_ids, text_ids])
        sos, task = self.special_rows()
        return torch.cat([
            sos[None],
            self.text_embedding(ids.to(dev, torch.long)),
            task[None],
            self.speech_embedding(speech_tokens.to(dev, torch.long)),
        ])

    # ------------------------------------------------------------------ what the engine asks of a speech LM
    @property
    def fill(self) -> int:
        """The id text streaming forces where the training layout waits for more text."""
        return self.dims.fill_token

    def special_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The SOS and TASK_ID embeddings [d] (rows 0 and 1 of `llm_embedding`)."""
        return self.llm_embedding.weight[0], self.llm_embedding.weight[1]

    def bistream_prompt(self, prompt_text_ids: torch.Tensor, prompt_speech_tokens: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Text-streaming prompt: (prefix fed right after SOS [0, d]: none in CosyVoice2, the prompt text
        [m, d] that joins the 5:15 interleave, the prompt speech [P, d])."""
        dev = self.text_embedding.weight.device
        prefix = self.text_embedding.weight.new_zeros(0, self.dims.hidden_size)
        return (prefix, self.text_embedding(prompt_text_ids.flatten().to(dev, torch.long)),
                self.speech_embedding(prompt_speech_tokens.flatten().to(dev, torch.long)))

    def token_filter(self) -> KeepEveryToken:
        """A new per-segment filter of the tokens that reach the flow (CosyVoice2 drops none)."""
        return KeepEveryToken()

    # ------------------------------------------------------------------ forward
    def forward(self, embeds: torch.Tensor, start_pos: torch.Tensor, cache: KVCache, attn_len: int,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """Run `n` new positions per row and return the final-norm hidden states [B, n, d].

        embeds [B, n, d]; start_pos [B] (position of each row's first new token); slots [B] the cache
        rows, or None for rows [0, B) (the decode path: keys are then views, not copies); attn_len:
        cache positions attended over (>= max(start_pos) + n; a static bucket for graphs).
        """
        batch, n, _ = embeds.shape
        positions = start_pos.unsqueeze(1) + torch.arange(n, device=embeds.device)  # [B, n]
        cos, sin = rope_tables(self.dims, positions)
        rope = (cos.unsqueeze(2), sin.unsqueeze(2))  # broadcast over heads
        key_pos = torch.arange(attn_len, device=embeds.device)
        allowed = key_pos.view(1, 1, attn_len) <= positions.unsqueeze(-1)  # [B, n, L]
        attn_bias = torch.zeros(allowed.shape, device=embeds.device, dtype=embeds.dtype)
        attn_bias = attn_bias.masked_fill(~allowed, float("-inf"))
        groups = self.dims.num_heads // self.dims.num_kv_heads
        attn_bias = attn_bias.unsqueeze(1).repeat(1, 1, groups, 1)  # rows ordered (group, position)
        rows = torch.arange(batch, device=embeds.device) if slots is None else slots
        write = (rows.unsqueeze(1).expand(batch, n), positions)
        h = embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, cache.k[i], cache.v[i], write, attn_bias, slots)
        return self.norm(h)

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, attn_len: int,
               ops: ModuleType, prefetch_mb: float | None = None) -> torch.Tensor:
        """One new token for each of rows [0, B) (cache rows [0, B)), through fused ops: -> hidden [B, d].

        embeds [B, d]; positions [B] (where each row's token goes). `ops` is `cosystream.kernels.decode`
        (Triton, CUDA) or `cosystream.kernels.reference` (torch); both compute `forward`'s numbers.
        PERF: 8 kernels a layer. The residual add rides in the next norm's kernel; the attention kernel
        rotates q and the new key and writes the cache; `ops.linear` may hand its output on as split-K
        partial sums that the next kernel adds. prefetch_mb: the L2 prefetch window of `ops.prefetching`
        (the next weights pulled into L2 on a side stream; None: the ops' default).
        """
        d = self.dims
        cos, sin = self.rope_table(cache.max_len, embeds.device)

        def attention(i: int, qkv: torch.Tensor) -> torch.Tensor:
            return ops.rope_attention_linear(qkv, positions, cos, sin, cache.k[i], cache.v[i], d.num_heads,
                                             d.num_kv_heads, attn_len, self.layers[i].o_proj.weight)

        with ops.prefetching(self.decode_weights(), prefetch_mb):
            return self._fused_stack(embeds, cache, ops, attention)

    def decode_weights(self) -> list[torch.Tensor]:
        """The weights a decode step streams, in the order it reads them (the speech head last)."""
        weights = [w for layer in self.layers for w in (layer.qkv_proj.weight, layer.o_proj.weight,
                                                         layer.gate_up_proj.weight, layer.down_proj.weight)]
        return [*weights, self.llm_decoder.weight]

    def prefill(self, embeds: torch.Tensor, slots: torch.Tensor, cache: KVCache, ops: ModuleType) -> torch.Tensor:
        """Fresh prompts from position 0 into cache rows `slots` [B]: embeds [B, n, d] -> final-norm hidden
        [B, n, d], the numbers of `forward(embeds, zeros, cache, attn_len=n, slots=slots)`.

        PERF: ~8 kernels a layer instead of ~43: the decode step's fused ops on the B·n rows, and causal
        attention over the prompt's own keys (no mask tensor; GQA inside SDPA, no repeated K/V), taken from
        the RoPE kernel's output as it writes them to the cache (no gather of them back out of it).
        """
        d = self.dims
        batch, n, width = embeds.shape
        positions = torch.arange(n, device=embeds.device).repeat(batch)
        rows = slots.repeat_interleave(n)
        cos, sin = self.rope_table(cache.max_len, embeds.device)
        kv_start, kv_end = d.num_heads, d.num_heads + d.num_kv_heads

        def attention(i: int, qkv: torch.Tensor) -> torch.Tensor:
            heads = ops.rope_write_kv(qkv, positions, cos, sin, cache.k[i], cache.v[i], d.num_heads, d.num_kv_heads,
                                      slots=rows, all_heads=True)
            heads = heads.view(batch, n, kv_end + d.num_kv_heads, d.head_dim).transpose(1, 2)
            q, keys, values = heads[:, :kv_start], heads[:, kv_start:kv_end], heads[:, kv_end:]
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
            return ops.linear(out.transpose(1, 2).reshape(batch * n, width), self.layers[i].o_proj.weight)

        return self._fused_stack(embeds.reshape(batch * n, width), cache, ops, attention).view(batch, n, width)

    def _fused_stack(self, h: torch.Tensor, cache: KVCache, ops: ModuleType,
                     attention: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The fused-op layers over token rows h [R, d], shared by `decode` and `prefill`, which differ only
        in `attention(layer index, q/k/v projection) -> output projection`: RoPE, the K/V cache write,
        attention and o_proj. Returns the final-norm hidden states [R, d]."""
        d = self.dims
        residual = None
        for i, layer in enumerate(self.layers):
            a, residual = ops.add_rms_norm(h, residual, layer.input_layernorm.weight, d.rms_norm_eps)
            attn = attention(i, ops.linear(a, layer.qkv_proj.weight, layer.qkv_proj.bias))
            m, residual = ops.add_rms_norm(attn, residual, layer.post_attention_layernorm.weight, d.rms_norm_eps)
            h = ops.silu_linear(ops.linear(m, layer.gate_up_proj.weight, partials=False), layer.down_proj.weight)
        out, _ = ops.add_rms_norm(h, residual, self.norm.weight, d.rms_norm_eps)
        return out

    def rope_table(self, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_len, head_dim / 2] float32 for every position (the same values `rope_tables` makes)."""
        key = (max_len, str(device))
        if self._rope_key != key:
            cos, sin = rope_tables(self.dims, torch.arange(max_len, device=device))
            half = self.dims.head_dim // 2
            self._rope = (cos[:, :half].contiguous(), sin[:, :half].contiguous())
            self._rope_key = key
        return self._rope

    def logp(self, hidden: torch.Tensor) -> torch.Tensor:
        """log_softmax of the speech head in float32: [..., d] -> [..., num_speech_classes]."""
        return torch.log_softmax(self.llm_decoder(hidden).float(), dim=-1)


def official_keys(dims: LLMDims) -> list[str]:
    """Every key of an official CosyVoice2 llm.pt (spec/checkpoints.md §3.1)."""
    keys = ["llm_embedding.weight", "speech_embedding.weight", "llm_decoder.weight", "llm_decoder.bias",
            _QWEN + "embed_tokens.weight", _QWEN + "norm.weight", "llm.model.lm_head.weight"]
    return keys + official_layer_keys(dims)


def official_layer_keys(dims: LLMDims) -> list[str]:
    """The official keys of the Qwen2 decoder layers, layer by layer (the same in both families' llm.pt)."""
    return [f"{_QWEN}layers.{i}.{name}" for i in range(dims.num_layers) for name in _LAYER_KEYS]


_LAYER_KEYS = (
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
    "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
    "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


def convert_official_state(state: dict[str, torch.Tensor], dims: LLMDims) -> dict[str, torch.Tensor]:
    """Map llm.pt onto `SpeechLM` names (q/k/v and gate/up fused; the unused tied Qwen `lm_head` dropped).

    Raises CheckpointError naming every missing or unexpected official key; shapes are checked by the
    caller's strict load against the model built from the yaml.
    """
    check_official_keys(state, official_keys(dims))
    out = {
        "text_embedding.weight": state[_QWEN + "embed_tokens.weight"],
        "norm.weight": state[_QWEN + "norm.weight"],
        **{k: state[k] for k in ("speech_embedding.weight", "llm_embedding.weight", "llm_decoder.weight",
                                  "llm_decoder.bias")},
    }
    return out | fused_layers(state, dims)


def check_official_keys(state: dict[str, torch.Tensor], expected: list[str]) -> None:
    """CheckpointError naming every key of `expected` that llm.pt lacks and every key it has beyond them."""
    missing = [k for k in expected if k not in state]
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = ([f"missing keys: {_short(missing)}"] if missing else []) + (
            [f"unexpected keys: {_short(unexpected)}"] if unexpected else [])
        raise CheckpointError("llm.pt: does not match the model built from the yaml; " + "; ".join(parts))


def fused_layers(state: dict[str, torch.Tensor], dims: LLMDims) -> dict[str, torch.Tensor]:
    """The official decoder layers under `SpeechLM` names: q/k/v and gate/up concatenated into one weight."""
    out: dict[str, torch.Tensor] = {}
    for i in range(dims.num_layers):
        src, dst = f"{_QWEN}layers.{i}.", f"layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "post_attention_layernorm.weight"]
        out[dst + "o_proj.weight"] = state[src + "self_attn.o_proj.weight"]
        out[dst + "down_proj.weight"] = state[src + "mlp.down_proj.weight"]
        for kind in ("weight", "bias"):
            out[dst + f"qkv_proj.{kind}"] = torch.cat(
                [state[f"{src}self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")])
        out[dst + "gate_up_proj.weight"] = torch.cat(
            [state[src + "mlp.gate_proj.weight"], state[src + "mlp.up_proj.weight"]])
    return out


def _short(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")
