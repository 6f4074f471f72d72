"""Text normalisation and splitting (spec/frontend.md §2): official cases, rules, and our fallbacks."""

from __future__ import annotations

import json

import pytest

from cosystream.frontend.text import (
    MERGE_LEN,
    TOKEN_MAX_N,
    TOKEN_MIN_N,
    is_only_punctuation,
    remove_bracket,
    replace_blank,
    spell_out_number,
    split_paragraph,
    wetext_normalize,
)


@pytest.fixture(scope="module")
def text_cases(fixture_dir):
    return json.loads((fixture_dir / "text_frontend.json").read_text(encoding="utf-8"))["text_normalize"]


def _ok_cases(cases):
    return [case for case in cases if "error" not in case]


@pytest.mark.parity
def test_text_normalize_matches_official(frontend, text_cases):
    cases = _ok_cases(text_cases)
    assert cases
    for case in cases:
        assert frontend.normalize(case["input"]) == case["split_true"], case["name"]
        assert frontend.normalize(case["input"], split=False) == [case["split_false"]], case["name"]


@pytest.mark.parity
def test_segment_token_ids_match_official(frontend, text_cases):
    for case in _ok_cases(text_cases):
        ids = [frontend.encode_text(segment) for segment in frontend.normalize(case["input"])]
        assert ids == case["segment_token_ids"], case["name"]
        assert [len(segment) for segment in frontend.normalize(case["input"])] == case["segment_char_lens"]


@pytest.mark.parity
def test_text_the_official_code_fails_on_is_normalised(frontend, text_cases):
    # The official run raised inside wetext for these (the English FST rejects runs of blanks);
    # we collapse the blanks and normalise: digits spelled out, no newlines, nothing dropped.
    failing = [case for case in text_cases if "error" in case]
    for case in failing:
        segments = frontend.normalize(case["input"])
        whole = frontend.normalize(case["input"], split=False)[0]
        assert segments, case["name"]
        for text in [*segments, whole]:
            assert "\n" not in text and not any(char.isdigit() for char in text)
        words = [word.strip(".!?,") for word in case["input"].split() if not word.strip(".!?,").isdigit()]
        assert all(word in whole for word in words)


def test_english_blank_runs_are_collapsed_only_when_wetext_fails():
    assert wetext_normalize("a  b 2", "en") == "a b two"
    assert wetext_normalize("no digits  here", "en") == "no digits  here"  # wetext only sees text with digits


def test_chinese_rules():
    assert replace_blank("你 好 hello world 世 界") == "你好hello world世界"
    assert replace_blank(" edge ") == "edge"
    assert remove_bracket("（注）【重要】`x`——完") == "注重要x 完"


def test_spell_out_number_handles_runs_inflect_refuses():
    spelled = spell_out_number("I have 3 and " + "9" * 80 + ".", lambda digits: _words(digits))
    assert spelled.startswith("I have three and nine nine") and spelled.endswith(".")


def _words(digits: str) -> str:
    if len(digits) > 60:
        raise ValueError("number out of range")
    return {"3": "three", "9": "nine"}.get(digits, "many")


def test_split_appends_a_terminator_and_attaches_closing_quotes():
    assert split_paragraph("你好", "zh", len) == ["你好。"]
    assert split_paragraph('他说："走吧。"然后走了', "zh", len) == ['他说："走吧。"然后走了。']
    assert split_paragraph("Hi there", "en", len) == ["Hi there."]


def test_split_drops_a_terminator_after_a_cut_and_survives_a_leading_quote():
    assert split_paragraph("你好。。世界", "zh", len) == ["你好。世界。"]
    assert split_paragraph('。"你好', "zh", len) == ["你好。"]  # the official code raises IndexError here
    assert split_paragraph("", "zh", len) == []


# spec/frontend.md §2, written out here so that a terminator dropped from (or added to) the code shows
SPEC_TERMINATORS = {"zh": "。？！；：、.?!;", "en": ".?!;:"}


@pytest.mark.parametrize(("lang", "terminator"), [(lang, t) for lang, ts in SPEC_TERMINATORS.items() for t in ts])
def test_every_terminator_of_the_spec_cuts(lang, terminator):
    """Two clauses longer than TOKEN_MIN_N joined by one terminator: cut there, they exceed TOKEN_MAX_N together
    and stay two segments; not cut, they would be one."""
    a, b = ("甲" if lang == "zh" else "a") * (TOKEN_MIN_N + 5), ("乙" if lang == "zh" else "b") * (TOKEN_MIN_N + 5)
    end = "。" if lang == "zh" else "."
    assert split_paragraph(a + terminator + b + end, lang, len) == [a + terminator, b + end]


def test_a_character_outside_the_spec_does_not_cut():
    a, b = "a" * (TOKEN_MIN_N + 5), "b" * (TOKEN_MIN_N + 5)
    assert split_paragraph(a + "," + b + ".", "en", len) == [a + "," + b + "."]
    assert split_paragraph(a + "、" + b + ".", "en", len) == [a + "、" + b + "."]


def test_split_respects_the_length_limits():
    sentence = "这是一个用来测试切分的句子。"  # 14 characters
    segments = split_paragraph(sentence * 40, "zh", len)
    assert "".join(segments) == sentence * 40
    for segment in segments[:-1]:
        assert TOKEN_MIN_N < len(segment) <= TOKEN_MAX_N + MERGE_LEN
    assert len(segments[-1]) >= MERGE_LEN


def test_only_punctuation():
    assert is_only_punctuation("") and is_only_punctuation("...!?") and is_only_punctuation("。，！？")
    assert is_only_punctuation("😀🎉")  # emoji are Unicode symbols
    assert not is_only_punctuation("a.") and not is_only_punctuation("好。")


def test_special_token_markup_bypasses_normalisation(frontend):
    text = "You are a helpful assistant.<|endofprompt|>今天2024年"
    assert frontend.normalize(text) == [text]
