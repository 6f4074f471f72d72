"""Qwen2 BPE + CosyVoice2 special tokens (spec/frontend.md §3)."""

from __future__ import annotations

import json

import pytest

from cosystream.frontend.tokenizer import COSYVOICE2_SPECIAL_TOKENS, END_OF_PROMPT


@pytest.fixture(scope="module")
def tokenizer_cases(fixture_dir):
    return json.loads((fixture_dir / "text_frontend.json").read_text(encoding="utf-8"))


@pytest.mark.parity
def test_tokenizer_matches_official(frontend, tokenizer_cases):
    assert tokenizer_cases["tokenizer"]
    for case in tokenizer_cases["tokenizer"]:
        ids = frontend.encode_text(case["text"])
        assert ids == case["ids"], case["text"]
        assert frontend.tokenizer.decode(ids) == case["decoded_skip_special"]


@pytest.mark.parity
def test_special_token_ids_match_official(frontend, tokenizer_cases):
    expected = tokenizer_cases["special_token_ids"]
    assert {token: frontend.tokenizer.token_id(token) for token in expected} == expected
    assert len(frontend.tokenizer) == tokenizer_cases["tokenizer_len_after_specials"]


def test_specials_are_consecutive_after_the_base_vocabulary(frontend):
    added = [token for token in COSYVOICE2_SPECIAL_TOKENS if token not in ("<|im_start|>", "<|im_end|>")]
    ids = [frontend.tokenizer.token_id(token) for token in added]
    assert ids == list(range(ids[0], ids[0] + len(added)))
    assert ids[-1] == len(frontend.tokenizer) - 1


def test_special_tokens_are_atomic(frontend):
    ids = frontend.encode_text(f"abc{END_OF_PROMPT}[breath]")
    assert ids[-2:] == [frontend.tokenizer.token_id(END_OF_PROMPT), frontend.tokenizer.token_id("[breath]")]


def test_encode_is_thread_safe(frontend):
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"sentence number {i} with 中文 and [breath]" for i in range(64)]
    expected = [frontend.encode_text(text) for text in texts]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(frontend.encode_text, texts)) == expected
