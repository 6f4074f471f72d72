"""The content-keyed cache of uploaded prompts' analyses: bounded by entries and bytes, one analysis per
recording even when requests bring it at the same time."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cosystream.engine.upload_cache import UploadCache, prompt_bytes
from cosystream.errors import BadInput
from cosystream.frontend import VoicePrompt


def _prompt(tokens: int, seed: int = 0) -> VoicePrompt:
    gen = torch.Generator().manual_seed(seed)
    return VoicePrompt(prompt_text_ids=torch.arange(5, dtype=torch.int32),
                       prompt_speech_tokens=torch.randint(0, 6561, (tokens,), generator=gen, dtype=torch.int32),
                       prompt_mel=torch.randn(2 * tokens, 80, generator=gen), xvector=torch.randn(192, generator=gen))


def test_prompt_bytes_counts_every_tensor():
    p = _prompt(10)
    assert prompt_bytes(p) == 5 * 4 + 10 * 4 + 20 * 80 * 4 + 192 * 4 + len(p.family.encode())


def test_bounded_by_entries_least_recently_used_first():
    cache = UploadCache(max_entries=2, max_bytes=1 << 30)
    made: list[str] = []

    def get(key: str) -> VoicePrompt:
        return cache.get_or_make(key, lambda: made.append(key) or _prompt(4))

    a = get("a")
    assert get("a") is a and made == ["a"]  # seen before: reused
    get("b")
    get("a")  # the most recent again
    get("c")  # drops b
    assert len(cache) == 2 and "b" not in cache and "a" in cache and cache.evictions == 1
    get("b")
    assert made == ["a", "b", "c", "b"] and (cache.hits, cache.misses) == (2, 4)


def test_bounded_by_bytes():
    one = prompt_bytes(_prompt(50))
    cache = UploadCache(max_entries=100, max_bytes=int(2.5 * one))
    for key in "abcd":
        cache.get_or_make(key, lambda: _prompt(50))
    assert len(cache) == 2 and cache.bytes == 2 * one and "c" in cache and "d" in cache
    # an analysis larger than the whole bound is returned, not kept (and evicts nothing)
    big = cache.get_or_make("big", lambda: _prompt(200))
    assert big.prompt_speech_tokens.numel() == 200 and "big" not in cache and len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0


def test_requests_bringing_one_recording_together_share_its_analysis():
    cache = UploadCache()
    started, release, calls = threading.Event(), threading.Event(), []

    def analyse() -> VoicePrompt:
        calls.append(1)
        started.set()
        release.wait(timeout=10)
        return _prompt(8)

    results: list[VoicePrompt] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_make("k", analyse))) for _ in range(4)]
    threads[0].start()
    assert started.wait(timeout=10)
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 10
    while cache.hits < 3 and time.monotonic() < deadline:  # the others join the analysis under way
        time.sleep(0.01)
    assert cache.hits == 3 and len(cache) == 0 and len(calls) == 1  # waiting for it, nothing kept yet
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert len(calls) == 1 and len(results) == 4 and all(r is results[0] for r in results)


def test_a_failed_analysis_reaches_its_waiters_and_is_not_kept():
    cache = UploadCache()
    with pytest.raises(BadInput, match="prompt_wav"):
        cache.get_or_make("bad", lambda: (_ for _ in ()).throw(BadInput("prompt_wav: not audio")))
    assert "bad" not in cache
    assert cache.get_or_make("bad", lambda: _prompt(3)).prompt_speech_tokens.numel() == 3  # tried again
