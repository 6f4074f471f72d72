"""What the models receive: a registered voice (`VoicePrompt`) and one segment's `ModelInputs` per mode.

Implements spec/frontend.md §7 (alignment), §8 (the inputs of each mode) and §9 with
spec/checkpoints.md §6 (the two `spk2info.pt` layouts). Pure assembly: no audio or text
processing happens here, so one voice prompt serves every text segment of every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cosystream.errors import BadInput, CheckpointError

MODES = ("zero_shot", "cross_lingual", "instruct2", "sft", "vc")
DEFAULT_FAMILY = "cosyvoice2"
_FAMILY_KEY = "family"  # VoicePrompt.tensors(): the family's name as utf-8 bytes (uint8)
XVECTOR_DIM = 192


def _empty_ids() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int32)


def _empty_mel() -> torch.Tensor:
    return torch.zeros(0, 80, dtype=torch.float32)


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tensor.ndim != ndim:
        got = f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name}: expected a {ndim}-d {dtype} tensor, got {got}")


@dataclass(frozen=True, eq=False)  # tensor fields: `==` would be ambiguous, so identity it is
class VoicePrompt:
    """Everything a voice contributes to a request, computed once at registration (CPU tensors).

    prompt_speech_tokens and prompt_mel are already aligned: prompt_mel has exactly
    token_mel_ratio (2) frames per token.
    """

    prompt_text_ids: torch.Tensor  # int32 [Lp], the normalised transcript; [0] when none
    prompt_speech_tokens: torch.Tensor  # int32 [P], 25 Hz
    prompt_mel: torch.Tensor  # float32 [2P, 80], natural-log mel at 50 Hz
    xvector: torch.Tensor  # float32 [192], CAM++ output, not normalised
    # The model family whose frontend made it: the speech tokenizer (v2, v3), the mel's fmax and the transcript's
    # specials differ between families, so a prompt serves only models of its own family.
    family: str = DEFAULT_FAMILY

    def __post_init__(self) -> None:
        _check("prompt_text_ids", self.prompt_text_ids, torch.int32, 1)
        _check("prompt_speech_tokens", self.prompt_speech_tokens, torch.int32, 1)
        _check("prompt_mel", self.prompt_mel, torch.float32, 2)
        _check("xvector", self.xvector, torch.float32, 1)
        if self.prompt_mel.shape[0] != 2 * self.prompt_speech_tokens.shape[0]:
            raise ValueError(f"prompt_mel: {self.prompt_mel.shape[0]} frames for "
                             f"{self.prompt_speech_tokens.shape[0]} tokens (expected 2 per token)")
        if self.xvector.shape[0] != XVECTOR_DIM:
            raise ValueError(f"xvector: expected {XVECTOR_DIM} values, got {self.xvector.shape[0]}")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields as a flat dict (the layout the voice store serialises)."""
        return {"prompt_text_ids": self.prompt_text_ids, "prompt_speech_tokens": self.prompt_speech_tokens,
                "prompt_mel": self.prompt_mel, "xvector": self.xvector,
                _FAMILY_KEY: torch.tensor(list(self.family.encode()), dtype=torch.uint8)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> VoicePrompt:
        """The inverse of `tensors()`; a record without a family predates CosyVoice3 and is CosyVoice2's."""
        family = bytes(tensors[_FAMILY_KEY].tolist()).decode() if _FAMILY_KEY in tensors else DEFAULT_FAMILY
        return cls(**{name: tensors[name] for name in ("prompt_text_ids", "prompt_speech_tokens",
                                                        "prompt_mel", "xvector")}, family=family)


@dataclass(frozen=True, eq=False)
class ModelInputs:
    """The complete model input of one text segment (spec/frontend.md §8), unbatched CPU tensors.

    Fields a mode does not use are empty: int32 [0] ids/tokens, float32 [0, 80] mel.
    """

    mode: str  # one of MODES
    text_ids: torch.Tensor  # int32 [L]; empty for vc
    xvector: torch.Tensor  # float32 [192]; the flow's speaker (the LM ignores it)
    prompt_text_ids: torch.Tensor = field(default_factory=_empty_ids)  # int32 [Lp]: transcript or instruction
    llm_prompt_speech_tokens: torch.Tensor = field(default_factory=_empty_ids)  # int32 [P]; zero_shot only
    flow_prompt_speech_tokens: torch.Tensor = field(default_factory=_empty_ids)  # int32 [P]
    prompt_mel: torch.Tensor = field(default_factory=_empty_mel)  # float32 [2P, 80]
    source_speech_tokens: torch.Tensor = field(default_factory=_empty_ids)  # int32 [S]; vc only

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: {self.mode!r} is not one of {', '.join(MODES)}")
        for name in ("text_ids", "prompt_text_ids", "llm_prompt_speech_tokens", "flow_prompt_speech_tokens",
                     "source_speech_tokens"):
            _check(name, getattr(self, name), torch.int32, 1)
        _check("prompt_mel", self.prompt_mel, torch.float32, 2)
        _check("xvector", self.xvector, torch.float32, 1)

    def as_official_dict(self) -> dict[str, torch.Tensor]:
        """The official `model_input` dict: batch dim 1, int32 `*_len` companions, [1, 192] embeddings."""
        out: dict[str, torch.Tensor] = {}
        pairs = (("text", self.text_ids), ("prompt_text", self.prompt_text_ids),
                 ("llm_prompt_speech_token", self.llm_prompt_speech_tokens),
                 ("flow_prompt_speech_token", self.flow_prompt_speech_tokens),
                 ("prompt_speech_feat", self.prompt_mel), ("source_speech_token", self.source_speech_tokens))
        for key, tensor in pairs:
            out[key] = tensor[None]
            out[f"{key}_len"] = torch.tensor([tensor.shape[0]], dtype=torch.int32)
        out["llm_embedding"] = out["flow_embedding"] = self.xvector[None]
        return out


def build_voice_prompt(prompt_text_ids: list[int], raw_tokens: torch.Tensor, raw_mel: torch.Tensor,
                       xvector: torch.Tensor, token_mel_ratio: int = 2, family: str = DEFAULT_FAMILY) -> VoicePrompt:
    """Align raw tokens [P'] and mel [F', 80] to n = min(F' // 2, P') (PARITY: spec/frontend.md §7)."""
    num_tokens = min(raw_mel.shape[0] // token_mel_ratio, raw_tokens.shape[0])
    return VoicePrompt(
        prompt_text_ids=torch.tensor(prompt_text_ids, dtype=torch.int32),
        prompt_speech_tokens=raw_tokens[:num_tokens].to(torch.int32).contiguous(),
        prompt_mel=raw_mel[: token_mel_ratio * num_tokens].to(torch.float32).contiguous(),
        xvector=xvector.to(torch.float32).reshape(-1).contiguous(),
        family=family,
    )


def _text_ids(text_ids: list[int], what: str) -> torch.Tensor:
    if not text_ids:
        raise BadInput(f"{what}: empty after normalisation; nothing to synthesise")
    return torch.tensor(text_ids, dtype=torch.int32)


def zero_shot_inputs(text_ids: list[int], prompt: VoicePrompt) -> ModelInputs:
    """Transcript + prompt tokens prime the LM; prompt tokens + mel condition the flow."""
    return ModelInputs(mode="zero_shot", text_ids=_text_ids(text_ids, "text"), xvector=prompt.xvector,
                       prompt_text_ids=prompt.prompt_text_ids,
                       llm_prompt_speech_tokens=prompt.prompt_speech_tokens,
                       flow_prompt_speech_tokens=prompt.prompt_speech_tokens, prompt_mel=prompt.prompt_mel)


def cross_lingual_inputs(text_ids: list[int], prompt: VoicePrompt) -> ModelInputs:
    """No LM prompt at all: the voice only reaches the flow (text in another language than the prompt)."""
    return ModelInputs(mode="cross_lingual", text_ids=_text_ids(text_ids, "text"), xvector=prompt.xvector,
                       flow_prompt_speech_tokens=prompt.prompt_speech_tokens, prompt_mel=prompt.prompt_mel)


def instruct2_inputs(text_ids: list[int], instruct_ids: list[int], prompt: VoicePrompt) -> ModelInputs:
    """The instruction replaces the transcript in the LM prompt; no LM prompt speech."""
    return ModelInputs(mode="instruct2", text_ids=_text_ids(text_ids, "text"), xvector=prompt.xvector,
                       prompt_text_ids=_text_ids(instruct_ids, "instruct"),
                       flow_prompt_speech_tokens=prompt.prompt_speech_tokens, prompt_mel=prompt.prompt_mel)


def sft_inputs(text_ids: list[int], xvector: torch.Tensor) -> ModelInputs:
    """A built-in speaker: only its embedding conditions the flow."""
    return ModelInputs(mode="sft", text_ids=_text_ids(text_ids, "text"), xvector=xvector)


def vc_inputs(source_tokens: torch.Tensor, prompt: VoicePrompt) -> ModelInputs:
    """Voice conversion: the source's speech tokens are re-voiced by the flow; the LM is not used.

    Deviation: the official frontend passes the unaligned prompt here (up to one extra mel frame);
    we pass the aligned one, so the flow's prompt/target boundary falls on a token.
    """
    return ModelInputs(mode="vc", text_ids=_empty_ids(), xvector=prompt.xvector,
                       flow_prompt_speech_tokens=prompt.prompt_speech_tokens, prompt_mel=prompt.prompt_mel,
                       source_speech_tokens=source_tokens.to(torch.int32).contiguous())


@dataclass(frozen=True, eq=False)
class BuiltinSpeaker:
    """One entry of the model's `spk2info.pt` (spec/checkpoints.md §6)."""

    xvector: torch.Tensor  # float32 [192]
    prompt: VoicePrompt | None  # present for entries written by add_zero_shot_spk


def load_spk2info(path: str | Path, family: str = DEFAULT_FAMILY) -> dict[str, BuiltinSpeaker]:
    """Read both `spk2info.pt` layouts: SFT (`embedding`) and zero-shot (`flow_embedding` + prompt).

    Loaded with weights_only=True: the file is a plain dict of tensors, never code.
    """
    try:
        table = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle error can be of many types; name the file in any case
        raise CheckpointError(f"spk2info.pt: cannot be read as a tensor dict ({exc})") from None
    if not isinstance(table, dict):
        raise CheckpointError(f"spk2info.pt: expected a dict speaker -> entry, got {type(table).__name__}")
    return {str(name): _builtin_speaker(str(name), entry, family) for name, entry in table.items()}


def _builtin_speaker(name: str, entry: object, family: str = DEFAULT_FAMILY) -> BuiltinSpeaker:
    if not isinstance(entry, dict):
        raise CheckpointError(f"spk2info.pt: speaker {name!r} is a {type(entry).__name__}, expected a dict")
    if "embedding" in entry:  # SFT layout
        return BuiltinSpeaker(xvector=entry["embedding"].reshape(-1).float(), prompt=None)
    needed = ("prompt_text", "llm_prompt_speech_token", "prompt_speech_feat", "flow_embedding")
    missing = [key for key in needed if key not in entry]
    if missing:
        raise CheckpointError(f"spk2info.pt: speaker {name!r} lacks {', '.join(missing)} "
                              "(neither the SFT nor the zero-shot layout)")
    xvector = entry["flow_embedding"].reshape(-1).float()
    mel = entry["prompt_speech_feat"]
    try:
        prompt = VoicePrompt(
            prompt_text_ids=entry["prompt_text"].reshape(-1).to(torch.int32),
            prompt_speech_tokens=entry["llm_prompt_speech_token"].reshape(-1).to(torch.int32),
            prompt_mel=mel.reshape(-1, mel.shape[-1]).float(),
            xvector=xvector,
            family=family,
        )
    except ValueError as exc:
        raise CheckpointError(f"spk2info.pt: speaker {name!r}: {exc}") from None
    return BuiltinSpeaker(xvector=xvector, prompt=prompt)
