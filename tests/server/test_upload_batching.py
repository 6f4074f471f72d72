"""/v1/tts multipart uploads and the engine's prompt batcher: a request whose body is still arriving counts as a
recording on its way, so the batch opened by a burst's first upload waits for the rest (engine/prompt_batcher.py);
a body without a recording withdraws at once."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
from fake_engine import FakeEngine, fake_server
from server_live import make_wav

from cosystream.engine.prompt_batcher import PromptBatcher
from cosystream.frontend import Frontend
from cosystream.outputs import AudioChunk
from cosystream.params import SynthesisParams
from cosystream.server.state import ServerSettings
from cosystream.testing.prompt_analysis import RecordingAnalyzer

LONG_WINDOW_S = 60.0  # far beyond the tests' timeouts: only the announcements decide how long a batch waits
BOUNDARY = "cosystream-test-boundary"


@dataclass
class BatchingEngine(FakeEngine):
    """The fake engine with a real prompt batcher: a request's recording is prepared on the batcher's threads as
    the AsyncEngine prepares it, and the server's announcements reach the batcher."""

    batcher: PromptBatcher | None = None
    announced: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=2))

    @contextlib.contextmanager
    def expecting_recording(self) -> Iterator:
        assert self.batcher is not None
        with self.batcher.expecting_recording() as withdraw:
            self.announced.release()
            yield withdraw

    async def synthesize(self, params: SynthesisParams) -> AsyncIterator[AudioChunk]:
        assert self.batcher is not None
        if params.prompt_audio is not None:
            await asyncio.get_running_loop().run_in_executor(
                self.batcher.pool_for(params, self.pool), self.batcher.make_voice_prompt, params.prompt_audio,
                params.prompt_text or "")
        async for chunk in super().synthesize(params):
            yield chunk


@pytest.fixture(scope="module")
def frontend(checkpoint) -> Frontend:
    return Frontend(checkpoint)


@pytest.fixture
def served(frontend) -> Iterator:
    analyzer = RecordingAnalyzer()
    engine = BatchingEngine(batcher=PromptBatcher(frontend, analyzer, collect_window_s=LONG_WINDOW_S))
    try:
        with fake_server(ServerSettings(), engine) as server:
            yield server, engine, analyzer
    finally:
        engine.batcher.close()
        engine.pool.shutdown()


def _multipart(fields: dict[str, str], wav: bytes | None) -> tuple[bytes, bytes]:
    """A /v1/tts multipart body in two parts (everything but its end, and its end)."""
    parts = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    if wav is not None:
        parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="prompt_wav"; filename="p.wav"\r\n'
                     'Content-Type: audio/wav\r\n\r\n'.encode() + wav + b"\r\n")
    return b"".join(parts), f"--{BOUNDARY}--\r\n".encode()


class SlowUpload:
    """A multipart /v1/tts request whose body ends only when `finish()` is called."""

    def __init__(self, server, engine: BatchingEngine, fields: dict[str, str], wav: bytes | None) -> None:
        self.head, self.tail = _multipart(fields, wav)
        self.release = threading.Event()
        self.response: httpx.Response | None = None
        self.thread = threading.Thread(target=self._post, args=(server,))
        self.thread.start()
        assert engine.announced.acquire(timeout=10), "the server did not announce the upload"

    def _body(self) -> Iterator[bytes]:
        yield self.head
        self.release.wait(timeout=10)
        yield self.tail

    def _post(self, server) -> None:
        with server.client() as client:
            self.response = client.post("/v1/tts", content=self._body(),
                                        headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"})

    def finish(self) -> httpx.Response:
        self.release.set()
        self.thread.join(timeout=30)
        assert self.response is not None
        return self.response


ZERO_SHOT = {"text": "Hello there.", "prompt_text": "a prompt.", "response_format": "pcm"}


def _upload(server, wav: bytes) -> httpx.Response:
    with server.client() as client:
        return client.post("/v1/tts", data=ZERO_SHOT, files={"prompt_wav": ("p.wav", wav, "audio/wav")})


def test_uploads_of_a_burst_meet_in_one_analysis_batch(served):
    server, engine, analyzer = served
    slow = SlowUpload(server, engine, ZERO_SHOT, make_wav(seconds=1.0, seed=2))
    with ThreadPoolExecutor(max_workers=1) as pool:
        fast = pool.submit(_upload, server, make_wav(seconds=1.0, seed=1))
        with pytest.raises(TimeoutError):
            fast.result(timeout=0.3)  # its batch waits for the upload still arriving
        assert analyzer.batches == []
        assert slow.finish().status_code == 200
        assert fast.result(timeout=30).status_code == 200
    assert analyzer.batches == [2]
    assert _upload(server, make_wav(seconds=1.0, seed=3)).status_code == 200  # nothing left counted: at once
    assert analyzer.batches == [2, 1]


def test_a_multipart_body_without_a_recording_lets_the_batch_go(served):
    server, engine, analyzer = served
    slow = SlowUpload(server, engine, {"text": "Hello.", "voice": "alice", "response_format": "pcm"}, None)
    with ThreadPoolExecutor(max_workers=1) as pool:
        fast = pool.submit(_upload, server, make_wav(seconds=1.0, seed=4))
        assert slow.finish().status_code == 200
        assert fast.result(timeout=30).status_code == 200
    assert analyzer.batches == [1]
