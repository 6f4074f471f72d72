"""The analyses of prompt recordings sent with requests, kept by content and bounded in memory.

A client that sends the same reference recording with every request (the official server's API) gets its
analysis, and through its key the encoded flow prompt, reused. The cache holds at most `max_entries`
analyses and `max_bytes` of their tensors, least recently used dropped first; an analysis larger than the
byte bound alone is returned but not kept. Requests that bring the same recording while it is being analysed
wait for that one analysis instead of starting their own. Thread-safe: frontend threads resolve voices
concurrently.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from cosystream.frontend import VoicePrompt

# Voice keys of uploaded recordings start with this (no voice name contains the separator, a control character).
UPLOAD_KEY_PREFIX = "upload\x00"
MAX_UPLOADS = 64  # analyses kept (CPU: tokens, mel, x-vector, ≈ 0.1 MB for a 6 s prompt)
MAX_UPLOAD_BYTES = 32 * 2**20  # their tensors together (a 30 s prompt's analysis is ≈ 0.5 MB)


def is_upload_key(voice_key: str) -> bool:
    """Does this voice key name a recording sent with a request (not a registered voice)?"""
    return voice_key.startswith(UPLOAD_KEY_PREFIX)


def prompt_bytes(prompt: VoicePrompt) -> int:
    return sum(t.numel() * t.element_size() for t in prompt.tensors().values())


class UploadCache:
    def __init__(self, max_entries: int = MAX_UPLOADS, max_bytes: int = MAX_UPLOAD_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[VoicePrompt, int]] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __getitem__(self, key: str) -> VoicePrompt:
        return self._entries[key][0]

    def held(self) -> list[str]:
        """The keys held, least recently used first (a copy: other threads add and drop entries)."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def get_or_make(self, key: str, make: Callable[[], VoicePrompt]) -> VoicePrompt:
        """The analysis kept under `key` (now the most recent), else the one being made for it by another
        thread, else `make()` (kept if it fits). An error of `make` reaches every request waiting for it."""
        with self._lock:
            held = self._entries.get(key)
            if held is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return held[0]
            pending = self._pending.get(key)
            owner = pending is None
            if owner:
                pending = self._pending[key] = Future()
                self.misses += 1
            else:
                self.hits += 1
        if not owner:
            return pending.result()
        try:
            prompt = make()
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._pending[key]
            self._keep(key, prompt)
        pending.set_result(prompt)
        return prompt

    def _keep(self, key: str, prompt: VoicePrompt) -> None:
        size = prompt_bytes(prompt)
        if size > self.max_bytes or self.max_entries <= 0:
            return
        if key in self._entries:
            self.bytes -= self._entries.pop(key)[1]
        self._entries[key] = (prompt, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
            self.evictions += 1
