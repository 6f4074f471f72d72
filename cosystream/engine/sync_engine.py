"""Engine: a blocking facade over AsyncEngine for scripts and the CLI (runs its own event loop thread)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cosystream.engine.async_engine import AsyncEngine
from cosystream.outputs import AudioChunk, StageTimes, SynthesisResult
from cosystream.params import SynthesisParams


class Engine:
    def __init__(self, engine: AsyncEngine) -> None:
        self.async_engine = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cosystream-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> Engine:
        return cls(AsyncEngine.from_pretrained(model_dir, **kwargs))

    def stream(self, params: SynthesisParams) -> Iterator[AudioChunk]:
        """Yield chunks as they are produced; breaking out of the loop aborts the request."""
        agen = self.async_engine.synthesize(params)
        try:
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop).result()
                except StopAsyncIteration:
                    return
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop).result()

    def synthesize(self, params: SynthesisParams) -> SynthesisResult:
        chunks = list(self.stream(params))
        pcm = np.concatenate([c.pcm for c in chunks]) if chunks else np.zeros(0, np.float32)
        times = chunks[-1].times if chunks and chunks[-1].times else StageTimes()
        return SynthesisResult(pcm=pcm, times=times, num_chunks=len(chunks))

    def run(self, coro) -> Any:
        """Run a coroutine of the async engine (e.g. add_voice) and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        self.async_engine.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
