"""CosyVoice3LM: the CosyVoice2 Qwen2 speech LM with every special id inside the speech vocabulary.

spec/cosyvoice3.md §4. Differences from `SpeechLM` (CosyVoice2): no `llm_embedding` (SOS and TASK are
rows 6561 and 6563 of `speech_embedding`), 6561 + 200 speech classes, a bias-free head, and any id
from 6561 upwards stops decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from cosystream.checkpoint.hparams import EXTRA_SPEECH_IDS, LLMDims
from cosystream.models.qwen2 import _QWEN, SpeechLM, check_official_keys, fused_layers, official_layer_keys

ENDOFPROMPT_ID = 151646  # PARITY: `<|endofprompt|>`, hard-coded by CosyVoice3LM.inference
# PARITY: "FSQ silent and breath" ids dropped by CosyVoice3Model.llm_job after more than 5 in a row.
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT_RUN = 5


class CosyVoice3LM(SpeechLM):
    """Qwen2 decoder (shared with CosyVoice2) with the CosyVoice3 speech embedding and head."""

    def __init__(self, dims: LLMDims) -> None:
        super().__init__(dims)
        del self.llm_embedding
        classes = dims.speech_token_size + EXTRA_SPEECH_IDS
        self.speech_embedding = nn.Embedding(classes, dims.hidden_size)
        self.llm_decoder = nn.Linear(dims.hidden_size, classes, bias=False)

    # ------------------------------------------------------------------ special ids (spec/cosyvoice3.md §4)
    @property
    def sos(self) -> int:
        return self.dims.speech_token_size

    @property
    def eos(self) -> int:
        return self.dims.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.dims.speech_token_size + 2

    @property
    def fill(self) -> int:
        return self.dims.speech_token_size + 3

    @property
    def num_speech_classes(self) -> int:
        return self.dims.speech_token_size + EXTRA_SPEECH_IDS

    @property
    def ignore_eos_index(self) -> int:
        """The one id masked before `min_len`. PARITY: the official code masks index
        `speech_token_size`, which in CosyVoice3 is SOS (6561), not EOS (6562)."""
        return self.dims.speech_token_size

    def special_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The SOS and TASK embeddings [d] (rows of the speech embedding; CosyVoice2 has `llm_embedding`)."""
        weight = self.speech_embedding.weight
        return weight[self.sos], weight[self.task_id]

    def bistream_prompt(self, prompt_text_ids: torch.Tensor, prompt_speech_tokens: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Text-streaming prompt (official `inference_bistream`, CosyVoice3 branch): (prefix [n, d] fed right
        after SOS = the prompt text up to and including `<|endofprompt|>`, the rest of the prompt text
        [m, d] that joins the 5:15 interleave, the prompt speech [P, d]). ValueError without the marker."""
        ids = prompt_text_ids.flatten().to(torch.long)
        where = (ids == ENDOFPROMPT_ID).nonzero()
        if where.numel() == 0:
            raise ValueError("<|endofprompt|> not detected in CosyVoice3 prompt_text: text streaming needs it "
                             "in the prompt text (the instruction or the system prefix)")
        cut = int(where[0]) + 1
        dev = self.text_embedding.weight.device
        return (self.text_embedding(ids[:cut].to(dev)), self.text_embedding(ids[cut:].to(dev)),
                self.speech_embedding(prompt_speech_tokens.flatten().to(dev, torch.long)))

    def token_filter(self) -> SilentTokenFilter:
        """A new per-segment silent-token filter (the official consumer keeps one per request)."""
        return SilentTokenFilter()

    def is_stop(self, token: int) -> bool:
        """Any id from `speech_token_size` upwards ends decoding."""
        return token >= self.dims.speech_token_size

    # ------------------------------------------------------------------ input assembly
    def embed_prompt(self, text_ids: torch.Tensor, speech_tokens: torch.Tensor,
                     prompt_text_ids: torch.Tensor | None = None) -> torch.Tensor:
        """E_s[SOS] ⊕ E_text(T_p ⊕ T) ⊕ E_s[TASK] ⊕ E_s(S_p) -> [L0, d] (1-D id tensors in).

        Raises ValueError when `<|endofprompt|>` is in neither text (the official code asserts it).
        """
        ids = text_ids if prompt_text_ids is None else torch.cat([prompt_text_ids, text_ids])
        if not bool((ids == ENDOFPROMPT_ID).any()):
            raise ValueError("<|endofprompt|> not detected in CosyVoice3 text or prompt_text: CosyVoice3 "
                             "needs it in the prompt text (or, without a prompt, at the end of the "
                             "system prefix of the target text)")
        return super().embed_prompt(ids, speech_tokens)

    def sampler_scores(self, logp: torch.Tensor, step: int, min_len: int) -> torch.Tensor:
        """What the official sampler receives at `step`: logp with the `ignore_eos` index at −inf
        while step < min_len."""
        if step >= min_len:
            return logp
        scores = logp.clone()
        scores[..., self.ignore_eos_index] = float("-inf")
        return scores


def text_length_limits(text_len: int, min_ratio: int = 2, max_ratio: int = 20) -> tuple[int, int]:
    """(min_len, max_len) of generated tokens for a target text of `text_len` ids (the official ratios)."""
    return text_len * min_ratio, text_len * max_ratio


class SilentTokenFilter:
    """The official consumer-side filter: a silent/breath id is dropped once more than 5 ids of the
    set have come in a row (the run counts every silent id, dropped or not; any other id resets it).
    Dropped ids are still fed back to the LM: this filter only decides what reaches the flow."""

    def __init__(self) -> None:
        self.run = 0

    def keep(self, token: int) -> bool:
        if token in SILENT_TOKENS:
            self.run += 1
            return self.run <= MAX_SILENT_RUN
        self.run = 0
        return True


def official_keys(dims: LLMDims) -> list[str]:
    """Every key of an official CosyVoice3 llm.pt (spec/checkpoints.md §3.2)."""
    keys = ["speech_embedding.weight", "llm_decoder.weight", _QWEN + "embed_tokens.weight", _QWEN + "norm.weight",
            "llm.model.lm_head.weight"]
    return keys + official_layer_keys(dims)


def convert_official_state(state: dict[str, torch.Tensor], dims: LLMDims) -> dict[str, torch.Tensor]:
    """Map a CosyVoice3 llm.pt onto `CosyVoice3LM` names (q/k/v and gate/up fused, tied lm_head dropped)."""
    check_official_keys(state, official_keys(dims))
    out = {
        "text_embedding.weight": state[_QWEN + "embed_tokens.weight"],
        "norm.weight": state[_QWEN + "norm.weight"],
        "speech_embedding.weight": state["speech_embedding.weight"],
        "llm_decoder.weight": state["llm_decoder.weight"],
    }
    return out | fused_layers(state, dims)
