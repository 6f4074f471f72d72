"""Text normalisation and sentence splitting, as the official frontend does without ttsfrd.

Implements spec/frontend.md §2 with the wetext back-end: wetext TN for zh/en, the official
character rules (blanks, corner marks, brackets, trailing commas), inflect for the digits left
in English, `split_paragraph` (max 80, min 60, merge 20) and the removal of punctuation-only
segments.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import regex

TOKEN_MAX_N = 80  # a segment is closed once it would exceed this length...
TOKEN_MIN_N = 60  # ...provided it is already longer than this
MERGE_LEN = 20  # a shorter tail is glued onto the previous segment

ZH_TERMINATORS = frozenset("。？！；：、.?!;")
EN_TERMINATORS = frozenset(".?!;:")
CLOSING_QUOTES = frozenset('"”')

_CJK = re.compile(r"[\u4e00-\u9fff]")
_ANY_DIGIT = re.compile(r"\d")
_WHITESPACE_RUN = re.compile(r"\s+")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_ONLY_PUNCTUATION = regex.compile(r"^[\p{P}\p{S}]*$")


def contains_chinese(text: str) -> bool:
    return _CJK.search(text) is not None


def is_only_punctuation(text: str) -> bool:
    """True for '' and for strings made only of Unicode punctuation/symbols (\\p{P}, \\p{S})."""
    return _ONLY_PUNCTUATION.match(text) is not None


def replace_blank(text: str) -> str:
    """Drop every space that does not sit between two non-space ASCII characters."""
    kept = []
    for i, char in enumerate(text):
        if char == " ":
            before = text[i - 1] if i > 0 else ""
            after = text[i + 1] if i + 1 < len(text) else ""
            if not (_ascii_word_neighbour(before) and _ascii_word_neighbour(after)):
                continue
        kept.append(char)
    return "".join(kept)


def _ascii_word_neighbour(char: str) -> bool:
    return char != "" and char.isascii() and char != " "


def replace_corner_mark(text: str) -> str:
    return text.replace("²", "平方").replace("³", "立方")


def remove_bracket(text: str) -> str:
    for mark in ("（", "）", "【", "】", "`"):
        text = text.replace(mark, "")
    return text.replace("——", " ")


def spell_out_number(text: str, number_to_words: Callable[[str], str]) -> str:
    """Replace every maximal run of `str.isdigit()` characters by its English words."""
    out: list[str] = []
    run: list[str] = []
    for char in text + "\0":  # the sentinel flushes a trailing run
        if char.isdigit():
            run.append(char)
            continue
        if run:
            out.append(_digits_to_words("".join(run), number_to_words))
            run = []
        out.append(char)
    return "".join(out[:-1])


def _digits_to_words(digits: str, number_to_words: Callable[[str], str]) -> str:
    # inflect refuses runs beyond its largest named power (and a few exotic digits), where the
    # official code crashes; fall back to reading digit by digit, then to the digit itself.
    try:
        return number_to_words(digits)
    except Exception:
        if len(digits) == 1:
            return digits
        return " ".join(_digits_to_words(digit, number_to_words) for digit in digits)


def split_paragraph(text: str, lang: str, length: Callable[[str], int]) -> list[str]:
    """Cut after terminators, then merge greedily into segments of length <= TOKEN_MAX_N.

    `length` measures a string: characters for zh, tokenizer tokens for en (spec/frontend.md §2).
    """
    if text == "":  # the official code indexes text[-1] and fails here
        return []
    terminators = ZH_TERMINATORS if lang == "zh" else EN_TERMINATORS
    if text[-1] not in terminators:
        text += "。" if lang == "zh" else "."
    return _merge_pieces(_cut_at_terminators(text, terminators), length)


def _cut_at_terminators(text: str, terminators: frozenset[str]) -> list[str]:
    pieces: list[str] = []
    start = 0
    for i, char in enumerate(text):
        if char not in terminators:
            continue
        if i > start:  # PARITY: a terminator right after a cut is dropped
            pieces.append(text[start:i] + char)
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES:
            if pieces:  # the official code pops from an empty list here and fails
                pieces[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1
    return pieces


def _merge_pieces(pieces: list[str], length: Callable[[str], int]) -> list[str]:
    segments: list[str] = []
    current = ""
    for piece in pieces:
        if length(current + piece) > TOKEN_MAX_N and length(current) > TOKEN_MIN_N:
            segments.append(current)
            current = ""
        current += piece
    if current:
        if length(current) < MERGE_LEN and segments:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


class TextNormalizer:
    """`text_normalize` of the official frontend with the wetext back-end.

    `tokenize` is the text tokenizer's encode; it measures English segment lengths.
    """

    def __init__(self, tokenize: Callable[[str], list[int]]) -> None:
        import inflect  # imported here so that importing the frontend package stays cheap

        self._tokenize = tokenize
        self._inflect = inflect.engine()

    def normalize(self, text: str, split: bool = True) -> list[str] | str:
        """Segments (split=True) or the whole normalised string (split=False), as the official code."""
        if ("<|" in text and "|>" in text) or text == "":  # special-token markup bypasses the frontend
            return [text] if split else text
        text = text.strip()
        if contains_chinese(text):
            text = self._normalize_zh(text)
            segments = split_paragraph(text, "zh", len)
        else:
            text = spell_out_number(wetext_normalize(text, "en"), self._inflect.number_to_words)
            segments = split_paragraph(text, "en", lambda s: len(self._tokenize(s)))
        if not split:
            return text
        return [segment for segment in segments if not is_only_punctuation(segment)]

    def _normalize_zh(self, text: str) -> str:
        text = wetext_normalize(text, "zh").replace("\n", "")
        text = replace_corner_mark(replace_blank(text))
        text = text.replace(".", "。").replace(" - ", "，")
        return _TRAILING_COMMAS.sub("。", remove_bracket(text))


def wetext_normalize(text: str, lang: str) -> str:
    """wetext TN as version 0.0.4 (the official pin) applies it, run on the installed FSTs.

    PARITY: 0.0.4 only touches text that contains a digit; later releases changed the language
    detection and always run English, so we call the tag/reorder/verbalize stages directly.
    When the tagger finds no path (the English FST rejects runs of blanks, e.g. "a  b" or
    newlines between words), the official code fails; we retry with blanks collapsed and
    otherwise leave the text to the rules that follow.
    """
    if _ANY_DIGIT.search(text) is None:
        return text
    for candidate in (text, _WHITESPACE_RUN.sub(" ", text)):
        normalized = _run_wetext(candidate, lang)
        if normalized is not None:
            return normalized
    return text


def _run_wetext(text: str, lang: str) -> str | None:
    import wetext  # loads its FSTs on import (~0.3 s); only needed once text is normalised

    tagged = wetext.tag(text, lang, "tn")
    if tagged == "":
        return None
    verbalized = wetext.verbalize(wetext.reorder(tagged, lang, "tn"), lang, "tn")
    return verbalized if verbalized != "" else None
