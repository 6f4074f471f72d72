"""The Qwen2 byte-level BPE text tokenizer with the special tokens CosyVoice2 adds (spec/frontend.md §3)."""

from __future__ import annotations

import threading
from pathlib import Path

# PARITY: added in this order after the base vocabulary, so they get consecutive ids
# (151646... on the real model); `<|im_start|>`/`<|im_end|>` already exist and keep their ids.
COSYVOICE2_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>",
    "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)
END_OF_TEXT = "<|endoftext|>"
END_OF_PROMPT = "<|endofprompt|>"


class TextTokenizer:
    """`AutoTokenizer` over `CosyVoice-BlankEN/` plus the CosyVoice2 specials; no BOS/EOS on encode.

    Safe to call from several threads (a lock serialises the underlying tokenizer).
    """

    def __init__(self, tokenizer_dir: str | Path) -> None:
        # Imported here: transformers takes seconds to import and most users of the frontend
        # package (voice store, CLI listing) never tokenise.
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self._tokenizer.add_special_tokens({
            "eos_token": END_OF_TEXT,
            "pad_token": END_OF_TEXT,
            "additional_special_tokens": list(COSYVOICE2_SPECIAL_TOKENS),
        })
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens such as `<|endofprompt|>` are matched atomically."""
        with self._lock:
            return list(self._tokenizer([text])["input_ids"][0])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        with self._lock:
            return int(self._tokenizer.convert_tokens_to_ids(token))

    def __len__(self) -> int:
        return len(self._tokenizer)
