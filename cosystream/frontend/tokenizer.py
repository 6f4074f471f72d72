"""The Qwen2 byte-level BPE text tokenizer with the special tokens CosyVoice2 / CosyVoice3 add
(spec/frontend.md §3, spec/cosyvoice3.md §3.1)."""

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

# CosyVoice3 adds, after the CosyVoice2 list: `<|endofsystem|>`, the ARPAbet phones (15 vowels with no or
# 0/1/2 stress, 24 consonants) and 176 pinyin pieces, each as `[...]`, every group in sorted order.


def _words(text: str) -> list[str]:
    return text.split()


_ARPABET_VOWELS = _words("AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW")
_ARPABET_CONSONANTS = _words("B CH D DH F G HH JH K L M N NG P R S SH T TH V W Y Z ZH")
_PINYIN = _words(
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng "
    "iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo "
    "uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x "
    "y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn "
    "ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn "
    "ǘ ǚ ǜ"
)
_ARPABET = sorted([v + stress for v in _ARPABET_VOWELS for stress in ("", "0", "1", "2")] + _ARPABET_CONSONANTS)
COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = (
    *COSYVOICE2_SPECIAL_TOKENS, "<|endofsystem|>",
    *(f"[{p}]" for p in _ARPABET), *(f"[{p}]" for p in sorted(_PINYIN)),
)
SPECIAL_TOKENS = {"cosyvoice2": COSYVOICE2_SPECIAL_TOKENS, "cosyvoice3": COSYVOICE3_SPECIAL_TOKENS}
END_OF_TEXT = "<|endoftext|>"
END_OF_PROMPT = "<|endofprompt|>"


class TextTokenizer:
    """`AutoTokenizer` over `CosyVoice-BlankEN/` plus the family's specials; no BOS/EOS on encode.

    Safe to call from several threads (a lock serialises the underlying tokenizer).
    """

    def __init__(self, tokenizer_dir: str | Path, family: str = "cosyvoice2") -> None:
        # Imported here: transformers takes seconds to import and most users of the frontend
        # package (voice store, CLI listing) never tokenise.
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self._tokenizer.add_special_tokens({
            "eos_token": END_OF_TEXT,
            "pad_token": END_OF_TEXT,
            "additional_special_tokens": list(SPECIAL_TOKENS[family]),
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
