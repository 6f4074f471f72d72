"""A replica's engine process (scale/engine_process.py) on the CPU fixture model, without a Ray cluster: the
replica's ASGI side (its headers layer and the forwarder) in front of a real child process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from cosystream.testing.audio import tone_wav
from cosystream.testing.ray_extra import import_ray_or_skip

import_ray_or_skip()  # the replica's module needs it

from cosystream.scale.engine_process import (  # noqa: E402
    INTERNAL_PREFIX,
    ChildArgs,
    EngineProcess,
    EngineProcessDied,
    Forwarder,
    build_child_app,
)
from cosystream.scale.ray_app import ReplicaSpec, _ReplicaHeaders  # noqa: E402
from cosystream.server.state import ServerSettings  # noqa: E402

SAMPLES_PER_TOKEN = 960
REPLICA_ID = "r1"
MAX_BODY_BYTES = 1 << 20  # the replica's own limit on a body it holds for the engine process


def _spec(model_dir: Path, voices_db: Path) -> ReplicaSpec:
    return ReplicaSpec(model_dir=str(model_dir), device="cpu", voice_store="file", voices_db=str(voices_db),
                       engine_kwargs={"max_streams": 2}, settings=ServerSettings(warmup=False), log_level="warning")


class _Replica:
    """What the replica puts around the forwarder, with the application-wide answers and voice announcements
    recorded instead of sent to other replicas."""

    def __init__(self, engine: EngineProcess) -> None:
        self.announced: list[str] = []
        self.cluster_routes: list[str] = []
        self.app = _ReplicaHeaders(Forwarder(engine, self._cluster, self._announce, MAX_BODY_BYTES), REPLICA_ID)

    async def _cluster(self, route: str, scope: dict) -> httpx.Response:
        from fastapi.responses import JSONResponse

        self.cluster_routes.append(route)
        return JSONResponse({"answered_by": "replica", "route": route})

    async def _announce(self, name: str) -> None:
        self.announced.append(name)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://replica",
                                 timeout=60)


def test_requests_reach_the_engine_process_with_what_the_replica_knows(model_dir, tmp_path) -> None:
    async def run() -> None:
        engine = await EngineProcess.start(_spec(model_dir, tmp_path / "voices.db"), REPLICA_ID, "cpu", None)
        replica = _Replica(engine)
        try:
            async with replica.client() as client:
                # a voice registered through the replica is announced before the client hears of it
                response = await client.post("/v1/voices", data={"name": "bob", "prompt_text": "Hello there."},
                                             files={"prompt_wav": ("bob.wav", tone_wav(), "audio/wav")})
                assert response.status_code == 201, response.text
                assert replica.announced == ["bob"]
                assert not any(k.startswith("x-cosystream-voice") for k in response.headers)
                # synthesis streams through; the request keeps the id the proxy gave it (Ray's x-request-id)
                body = {"text": "Hi there.", "voice": "bob", "response_format": "pcm", "force_tokens": 5}
                response = await client.post("/v1/tts", json=body, headers={"x-request-id": "proxy-id-1"})
                assert response.status_code == 200, response.text
                assert len(response.content) == 2 * SAMPLES_PER_TOKEN * 5
                assert response.headers["x-cosystream-replica"] == REPLICA_ID
                assert "x-request-id" not in response.headers  # Ray's proxy adds its own, the same id
                record = await engine.get_json("finished", request_id="proxy-id-1")
                assert record is not None and record["outcome"] == "ok"
                # bad input is the engine process's answer, unchanged
                response = await client.post("/v1/tts", json={**body, "voice": "nobody"})
                assert response.status_code == 400, response.text
                assert response.json()["error"]["code"] == "unknown_voice"
                # routes that answer for the whole application are handed back to the replica
                for path, route in (("/metrics", "metrics"), ("/ready", "ready"), ("/v1/requests/x", "finished"),
                                    ("/v1/replicas", "replicas")):
                    response = await client.get(path)
                    assert response.json() == {"answered_by": "replica", "route": route}, path
                # the replica's own questions to the engine process are not reachable from outside
                response = await client.get(f"{INTERNAL_PREFIX}/report")
                assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
                # a header posing as the replica's own is dropped: the request id stays the proxy's
                response = await client.post("/v1/tts", json=body, headers={"x-request-id": "proxy-id-2",
                                                                            "x-cosystream-request-id": "forged"})
                assert response.status_code == 200
                assert await engine.get_json("finished", request_id="forged") is None
                assert (await engine.get_json("finished", request_id="proxy-id-2"))["outcome"] == "ok"
            report = await engine.get_json("report")
            assert report["ready"] is True and "bob" in report["voices"]
            await engine.get_json("health", timeout_s=10)
        finally:
            await engine.close()
            engine.stop()
        assert engine.exit_code() == 0  # it ended when its stdin closed, without being killed

    asyncio.run(run())


def test_a_body_past_the_upload_limit_is_refused_by_the_replica_before_it_holds_more(model_dir, tmp_path) -> None:
    """The replica holds a body before the engine process sees it: an endless upload (or one whose
    Content-Length says too much) gets 413 once past the limit, without the replica reading on."""
    async def endless_upload(replica: _Replica, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, int]:
        sent: list[dict] = []
        received = 0

        async def receive() -> dict:
            nonlocal received
            received += 1
            return {"type": "http.request", "body": b"x" * 65536, "more_body": True}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/tts", "query_string": b"", "state": {},
                 "headers": [(b"content-type", b"multipart/form-data; boundary=b"), *headers],
                 "client": ("127.0.0.1", 1)}
        await asyncio.wait_for(replica.app(scope, receive, send), 30)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], json.loads(body), received

    async def run() -> None:
        engine = await EngineProcess.start(_spec(model_dir, tmp_path / "voices.db"), REPLICA_ID, "cpu", None)
        replica = _Replica(engine)
        try:
            status, body, received = await endless_upload(replica, [])
            assert status == 413 and body["error"]["code"] == "payload_too_large", body
            assert received * 65536 <= MAX_BODY_BYTES + 65536  # it stopped reading once past the limit
            status, body, received = await endless_upload(replica, [(b"content-length", b"%d" % (2 * MAX_BODY_BYTES))])
            assert status == 413 and received == 0  # refused on its length, nothing read
        finally:
            await engine.close()
            engine.stop()

    asyncio.run(run())


def test_a_dead_engine_process_fails_health_and_requests_clearly(model_dir, tmp_path) -> None:
    async def run() -> None:
        engine = await EngineProcess.start(_spec(model_dir, tmp_path / "voices.db"), REPLICA_ID, "cpu", None)
        replica = _Replica(engine)
        try:
            engine.check_alive()
            os.kill(engine.pid, signal.SIGKILL)  # as a GPU fault would end it
            engine.process.wait(30)
            with pytest.raises(EngineProcessDied, match="ended with exit code"):
                engine.check_alive()
            async with replica.client() as client:
                response = await client.post("/v1/tts", json={"text": "Hi.", "force_tokens": 2})
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "engine_dead"
        finally:
            await engine.close()
            engine.stop()

    asyncio.run(run())


def test_an_engine_process_that_cannot_start_says_why(tmp_path) -> None:
    spec = _spec(tmp_path / "no_model_here", tmp_path / "voices.db")
    with pytest.raises(EngineProcessDied, match="could not start.*no_model_here"):
        asyncio.run(EngineProcess.start(spec, REPLICA_ID, "cpu", None))


class _Core:
    """An engine core whose thread takes `delay_s` to reach a message (0: a healthy loop)."""

    def __init__(self, delay_s: float, error: BaseException | None = None) -> None:
        self.delay_s = delay_s
        self.error = error

    def call(self, fn, timeout_s: float):  # noqa: ANN001, ANN201 (EngineCore.call's shape)
        time.sleep(self.delay_s)  # a wedged thread answers late, whatever the caller's timeout
        return fn()


def test_the_health_route_fails_for_a_stopped_or_wedged_engine() -> None:
    """What the replica's check_health asks the engine process (Ray replaces a replica whose check raises)."""
    def health(core: _Core) -> int:
        engine = SimpleNamespace(core=core, cached_voices=list, list_voices=list)
        spec = ReplicaSpec(model_dir="/m", health_timeout_s=0.3, settings=ServerSettings(warmup=False))
        app = build_child_app(engine, ChildArgs(spec=spec, replica_id=REPLICA_ID, device="cpu", socket_path="",
                                                ready_fd=-1))
        with TestClient(app, raise_server_exceptions=False) as client:
            return client.get(f"{INTERNAL_PREFIX}/health").status_code

    assert health(_Core(0.0)) == 200
    assert health(_Core(1.0)) >= 500  # the engine thread does not get to the no-op in time
    assert health(_Core(0.0, error=RuntimeError("CUDA error"))) == 503  # the engine loop ended
