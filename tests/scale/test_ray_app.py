"""The Ray Serve application on the CPU fixture model: two replicas behind Ray's proxy (docs/scaling.md).

One Ray cluster and one application for the module (the engine loads once per replica). The tests show
requests spread over both replicas, a voice registered once and used on both, and a replica killed mid-stream:
its stream fails cleanly, the other replica's stream completes, Ray restarts it, readiness follows and the
restarted replica serves the voice again. Requests use `force_tokens`, so audio lengths are exact.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cosystream.engine.voices import VoiceStore
from cosystream.testing.audio import tone_wav
from cosystream.testing.ray_extra import import_ray_or_skip
from cosystream.testing.refusal import REFUSE_DIR_ENV, refusal_marker

ray, serve = import_ray_or_skip()

from cosystream.scale.proxy import LOST_CODE  # noqa: E402
from cosystream.scale.ray_app import (  # noqa: E402
    APP_NAME,
    RAY_ENV_DEFAULTS,
    REPLICA_HEADER,
    ReplicaSpec,
    build_application,
)
from cosystream.server.state import ServerSettings  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a Ray cluster and two engines: ~2 min

SAMPLES_PER_TOKEN = 960
VOICE = "bob"
VOICE_TEXT = "Hello there, this is my voice."
UPLOAD_TEXT = "A recording sent with the request."
REPLICA = REPLICA_HEADER.decode()
RECOVERY_TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def voices_db(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray_voices") / "voices.db"


@pytest.fixture(scope="module")
def refuse_dir(tmp_path_factory) -> Path:
    """Where a test puts a replica's marker (cosystream/testing/refusal.py) to make it refuse new streams."""
    return tmp_path_factory.mktemp("ray_refuse")


def _start_serve(attempts: int = 3) -> int:
    """Start Serve's proxy on a free port, and its port. The port is free when chosen, but Ray's own processes
    open ports of their own meanwhile (a CI run once lost one to them: "Failed to bind to address"): a port
    taken by then is given up for another."""
    for attempt in range(attempts):
        port = _free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except ray.exceptions.RayError as exc:
            if "Failed to bind" not in str(exc) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def base_url(model_dir, voices_db: Path, refuse_dir: Path) -> Iterator[str]:
    for key, value in RAY_ENV_DEFAULTS.items():  # as `cosystream serve --replicas`: the proxy Ray starts inherits
        os.environ.setdefault(key, value)
    os.environ[REFUSE_DIR_ENV] = str(refuse_dir)  # the replicas Ray starts inherit it too
    ray.init(num_cpus=4, object_store_memory=80 * 1024 * 1024, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        port = _start_serve()
        # the store a multi-machine cluster uses (a named actor on the head node); "file" is a plain VoiceStore
        spec = ReplicaSpec(model_dir=str(model_dir), device="cpu", voice_store="actor", voices_db=str(voices_db),
                           engine_kwargs={"max_streams": 4}, settings=ServerSettings(warmup=False),
                           log_level="warning", engine_hook="cosystream.testing.refusal:refusing_engine")
        serve.run(build_application(spec, num_replicas=2, num_cpus=1), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop(REFUSE_DIR_ENV, None)


def _client(base_url: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, timeout=60)


def _speak(client: httpx.Client, tokens: int, voice: str = VOICE) -> httpx.Response:
    return client.post("/v1/tts", json={"text": "Hi there.", "voice": voice, "response_format": "pcm",
                                        "force_tokens": tokens, "seed": 1})


def _replicas(client: httpx.Client) -> dict[str, dict]:
    response = client.get("/v1/replicas")
    assert response.status_code == 200, response.text
    return {r["replica"]: r for r in response.json()["replicas"]}


def _wait_all_running(client: httpx.Client, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = client.get("/ready")
        if response.status_code == 200 and response.json()["status"] == "ok" and len(_replicas(client)) == 2:
            return response.json()
        time.sleep(0.5)
    raise AssertionError(f"the application did not recover in {timeout_s} s: {client.get('/ready').text}")


def _wait_voice_on_every_replica(client: httpx.Client, timeout_s: float) -> None:
    """Until every replica's load report lists VOICE, then two report periods, so that the proxy's router has
    them too: it prefers a replica holding a request's voice to a less loaded one, and a report published before
    a re-registration reached a replica does not list it yet."""
    from cosystream.scale.ray_app import ROUTING_STATS_PERIOD_S

    deadline = time.monotonic() + timeout_s
    while not all(VOICE in r["load"]["voices"] for r in _replicas(client).values()):
        assert time.monotonic() < deadline, f"{VOICE} not on every replica: {_replicas(client)}"
        time.sleep(0.2)
    time.sleep(2 * ROUTING_STATS_PERIOD_S)


def _wait_status(client: httpx.Client, status: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = client.get("/ready")
        if response.status_code == 200 and response.json()["status"] == status:
            return
        time.sleep(0.2)
    raise AssertionError(f"/ready never said {status!r} in {timeout_s} s: {client.get('/ready').text}")


def _spread(client: httpx.Client, tokens: int, replicas: set[str], rounds: int = 6) -> dict[str, list[str]]:
    """Concurrent pairs of requests until every replica in `replicas` served one; replica → request ids."""
    served: dict[str, list[str]] = {}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(rounds):
            for response in pool.map(lambda _: _speak(client, tokens), range(2)):
                assert response.status_code == 200, response.text
                assert len(response.content) == 2 * SAMPLES_PER_TOKEN * tokens
                request_id = response.headers["x-request-id"]
                assert "," not in request_id  # one id: the proxy's, adopted by the app
                served.setdefault(response.headers[REPLICA], []).append(request_id)
            if replicas <= served.keys():
                break
    return served


def _ws_session(base_url: str, tokens: int, recording: bytes | None = None) -> tuple[int, list[dict]]:
    """One WebSocket request in text pieces: (audio bytes, JSON events). With `recording`: an
    uploaded prompt instead of the registered voice. (Ray's proxy accepts the socket before it routes it, by the
    prompt of `start`, so the handshake names no replica: the per-replica metrics tell which one served it.)"""
    audio, events = 0, []
    start = {"type": "start", "response_format": "pcm", "force_tokens": tokens}
    start.update({"prompt_wav": True, "prompt_text": UPLOAD_TEXT} if recording else {"voice": VOICE})
    with connect("ws" + base_url[len("http"):] + "/v1/tts/stream", open_timeout=60) as ws:
        ws.send(json.dumps(start))
        if recording:
            ws.send(recording)
        for piece in ("Hello ", "there."):
            ws.send(json.dumps({"type": "text", "text": piece}))
        ws.send(json.dumps({"type": "end"}))
        try:
            while True:
                message = ws.recv(timeout=60)
                if isinstance(message, bytes):
                    audio += len(message)
                else:
                    events.append(json.loads(message))
        except ConnectionClosed:
            pass
    return audio, events


def _requests_per_replica(client: httpx.Client, label: str, value: str) -> Counter:
    """Finished requests per replica whose `label` is `value` (e.g. endpoint="ws", outcome="overloaded"), from the
    application's /metrics (labelled by replica)."""
    counts: Counter = Counter()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "cosystream_requests_total" and sample.labels.get(label) == value:
                counts[sample.labels["replica"]] += int(sample.value)
    return counts


def _ws_served(client: httpx.Client) -> Counter:
    return _requests_per_replica(client, "endpoint", "ws")


def test_voice_registered_once_is_used_on_every_replica(base_url: str, voices_db: Path) -> None:
    with _client(base_url) as client:
        assert _wait_all_running(client, 120)["replicas_running"] == 2
        replicas = set(_replicas(client))
        assert len(replicas) == 2
        response = client.post("/v1/voices", data={"name": VOICE, "prompt_text": VOICE_TEXT},
                               files={"prompt_wav": ("bob.wav", tone_wav(), "audio/wav")})
        assert response.status_code == 201, response.text
        registered_on = response.headers[REPLICA]
        with VoiceStore(voices_db) as store:  # in the cluster's one store file: it outlives every replica
            assert VOICE in store
        # requests spread over both replicas, each using the voice registered through one of them
        served = _spread(client, tokens=4, replicas=replicas)
        assert served.keys() == replicas, served
        for ids in served.values():  # a request's stage times, whichever replica answers the lookup
            found = client.get(f"/v1/requests/{ids[0]}")
            assert found.status_code == 200 and found.json()["outcome"] == "ok", found.text
            # counted from the proxy's arrival, the proxy's share apart (one host: one clock)
            assert 0 < found.json()["proxy_s"] < found.json()["to_engine_s"], found.text
        assert client.get("/v1/requests/req_unknown").status_code == 404
        # a WebSocket session, on one replica from start to done
        before = _ws_served(client)
        audio_bytes, events = _ws_session(base_url, tokens=3)
        assert audio_bytes == 2 * SAMPLES_PER_TOKEN * 3
        assert events[0]["type"] == "started" and events[-1]["type"] == "done", events[-1]
        assert sum((_ws_served(client) - before).values()) == 1
        for replica in replicas:  # every replica now holds the voice's prompt in memory
            load = _replicas(client)[replica]["load"]
            assert VOICE in load["voices"], (replica, registered_on)
            assert abs(load["reported_at"] - time.time()) < 60 and load["open_access"] is True, load
        # one /metrics for the application: every replica's samples, labelled
        metrics = client.get("/metrics").text
        for replica in replicas:
            assert f'replica="{replica}"' in metrics
        # deleting it through one replica removes it everywhere at once
        assert client.delete(f"/v1/voices/{VOICE}").status_code == 204
        for _ in range(4):
            response = _speak(client, tokens=2)
            assert response.status_code == 400 and response.json()["error"]["code"] == "unknown_voice", response.text
        response = client.post("/v1/voices", data={"name": VOICE, "prompt_text": VOICE_TEXT},
                               files={"prompt_wav": ("bob.wav", tone_wav(), "audio/wav")})
        assert response.status_code == 201, response.text


def test_requests_go_to_the_replica_holding_their_uploaded_prompt_and_a_websocket_stays_on_one(
        base_url: str) -> None:
    """An uploaded recording is analysed on the replica that first gets it; the router sends later requests with
    the same recording there (multipart /v1/tts and WebSocket alike: the proxy keys both by the recording's
    digest), and a WebSocket session runs on one replica while other requests spread over both."""
    from cosystream.scale.proxy import upload_hint

    recording = tone_wav(seconds=1.5, seed=36)
    key = upload_hint(recording, UPLOAD_TEXT)
    form = {"text": "Hi there.", "prompt_text": UPLOAD_TEXT, "response_format": "pcm", "force_tokens": "2"}

    def upload() -> httpx.Response:
        response = client.post("/v1/tts", data=form, files={"prompt_wav": ("me.wav", recording, "audio/wav")})
        assert response.status_code == 200 and len(response.content) == 2 * SAMPLES_PER_TOKEN * 2, response.text
        return response

    with _client(base_url) as client:
        _wait_all_running(client, 120)
        holder = upload().headers[REPLICA]
        holding = {r: key in d["load"]["uploads"] for r, d in _replicas(client).items()}
        assert holding == {r: r == holder for r in holding}, holding  # analysed there, and only there
        time.sleep(1.5)  # the holder's next load report reaches the proxy's router
        # idle replicas tie on load: without the preference each request would pick either (1 in 32 all on one)
        assert {upload().headers[REPLICA] for _ in range(5)} == {holder}
        before = _ws_served(client)
        with ThreadPoolExecutor(1) as pool:
            # a long session, while plain requests spread over both replicas
            session = pool.submit(_ws_session, base_url, 150, recording)
            _spread(client, tokens=2, replicas=set(holding), rounds=3)
            audio_bytes, events = session.result(timeout=120)
        assert audio_bytes == 2 * SAMPLES_PER_TOKEN * 150 and events[-1]["type"] == "done", events[-1]
        for _ in range(3):
            assert _ws_session(base_url, 2, recording)[1][-1]["type"] == "done"
        assert _ws_served(client) - before == Counter({holder: 4})  # every session ran on the holder


def _refused(client: httpx.Client) -> Counter:
    """Requests each replica refused (503 overloaded)."""
    return _requests_per_replica(client, "outcome", "overloaded")


def test_a_request_one_replica_refuses_is_served_by_the_other(base_url: str, refuse_dir: Path) -> None:
    """A replica's refusal (its admission's 503 overloaded) does not reach the client while another replica may
    admit the request: the proxy sends it there once. The refusing replica is the one the router prefers (it alone
    holds the request's uploaded prompt), and its load report says nothing of the refusal, as one published before
    a burst. When every replica refuses, the client gets the refusal after that one retry."""
    recording = tone_wav(seconds=1.5, seed=37)
    form = {"text": "Hi there.", "prompt_text": UPLOAD_TEXT, "response_format": "pcm", "force_tokens": "2"}

    def upload() -> httpx.Response:
        return client.post("/v1/tts", data=form, files={"prompt_wav": ("me.wav", recording, "audio/wav")})

    with _client(base_url) as client:
        _wait_all_running(client, RECOVERY_TIMEOUT_S)
        replicas = _replicas(client)
        first = upload()
        assert first.status_code == 200, first.text
        holder = first.headers[REPLICA]
        (other,) = set(replicas) - {holder}
        time.sleep(1.5)  # the holder's next load report reaches the proxy's router
        markers = [refusal_marker(refuse_dir, replicas[r]["engine_pid"]) for r in (holder, other)]
        try:
            markers[0].touch()
            before = _refused(client)
            response = upload()
            assert response.status_code == 200, response.text
            assert response.headers[REPLICA] == other
            assert len(response.content) == 2 * SAMPLES_PER_TOKEN * 2
            assert _refused(client) - before == Counter({holder: 1})  # routed to the holder first, which refused
            found = client.get(f"/v1/requests/{response.headers['x-request-id']}")  # a record on both: the served one
            assert found.status_code == 200, found.text
            assert found.json()["outcome"] == "ok" and found.json()["replica"] == other, found.text
            markers[1].touch()
            before = _refused(client)
            response = upload()
            assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded", response.text
            assert float(response.headers["retry-after"]) >= 1
            assert _refused(client) - before == Counter({holder: 1, other: 1})  # one retry, no more
        finally:
            for marker in markers:
                marker.unlink(missing_ok=True)


def test_a_client_that_leaves_mid_stream_ends_its_request_on_the_replica(base_url: str) -> None:
    """The replica does not watch the client itself (no call back into the proxy for a request whose body came with
    it): the proxy, which relays the response, sees the client leave and cancels the request on the replica."""
    long_tokens = 400
    with _client(base_url) as client:
        _wait_all_running(client, 120)
        body = {"text": "Hi there.", "voice": VOICE, "response_format": "pcm", "force_tokens": long_tokens}
        with client.stream("POST", "/v1/tts", json=body) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            assert next(response.iter_bytes())  # streaming; then the client leaves
        deadline = time.monotonic() + 60
        while (found := client.get(f"/v1/requests/{request_id}")).status_code == 404:
            assert time.monotonic() < deadline, "the request never ended on its replica"
            time.sleep(0.2)
        record = found.json()
        assert record["outcome"] == "cancelled", record
        assert record["audio_s"] < long_tokens * SAMPLES_PER_TOKEN / 24000, record  # ended before its audio did


def test_a_replica_writes_no_ray_access_line_for_a_request(base_url: str) -> None:
    """By default a replica does not write Ray Serve's access line for a request (building it costs the replica
    CPU, ray_app.replica_logging): the request's id is in no replica's Serve log, while Ray's proxy, whose logging
    is Ray's default, writes its access line with that id."""
    with _client(base_url) as client:
        response = client.get("/health")  # any request a replica serves
    assert response.status_code == 200, response.text
    assert response.headers[REPLICA]
    request_id = response.headers["x-request-id"]
    serve_logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"  # this test's Ray session
    replica_logs = sorted(serve_logs.glob("replica_*CosyStream*.log"))
    proxy_logs = sorted(serve_logs.glob("proxy_*.log"))
    assert replica_logs, sorted(p.name for p in serve_logs.iterdir())
    deadline = time.monotonic() + 10  # the proxy logs a request once its response is sent
    while not any(request_id in p.read_text() for p in proxy_logs):
        assert time.monotonic() < deadline, f"no access line for {request_id} in {[p.name for p in proxy_logs]}"
        time.sleep(0.2)
    for path in replica_logs:
        assert request_id not in path.read_text(), f"{path.name} logged request {request_id}"


def test_killed_replica_fails_its_stream_and_the_app_recovers(base_url: str) -> None:
    with _client(base_url) as client:
        _wait_all_running(client, 120)
        _wait_voice_on_every_replica(client, 10)  # (so the two streams below spread over both)
        replicas = _replicas(client)
        long_tokens = 400
        body = {"text": "Hi there.", "voice": VOICE, "response_format": "pcm", "force_tokens": long_tokens}
        # two long streams on the two replicas (the router spreads concurrent streams): events, and raw audio
        events_stream = client.stream("POST", "/v1/tts?events=ndjson", json=body)
        raw_stream = client.stream("POST", "/v1/tts", json=body)
        victim, survivor = events_stream.__enter__(), raw_stream.__enter__()
        try:
            assert victim.status_code == survivor.status_code == 200, (victim.read(), survivor.read())
            assert {victim.headers[REPLICA], survivor.headers[REPLICA]} == set(replicas), "streams not spread"
            lines, audio = victim.iter_lines(), survivor.iter_bytes()
            first_event, first_audio = json.loads(next(lines)), next(audio)  # both are streaming
            assert first_event["type"] == "audio"
            os.kill(replicas[victim.headers[REPLICA]]["engine_pid"], signal.SIGKILL)  # as a GPU fault ends it
            t_kill = time.monotonic()
            with ThreadPoolExecutor(1) as pool:
                rest_of_audio = pool.submit(lambda: first_audio + b"".join(audio))
                events = [first_event, *(json.loads(line) for line in lines if line)]
                survivor_bytes = len(rest_of_audio.result(timeout=120))
        finally:
            events_stream.__exit__(None, None, None)
            raw_stream.__exit__(None, None, None)
        # the killed replica's event stream ends with an error event (sent by the proxy), promptly
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == LOST_CODE, events[-1]
        assert all(e["type"] == "audio" for e in events[:-1])
        assert time.monotonic() - t_kill < 60
        # the other replica's stream is untouched
        assert survivor_bytes == 2 * SAMPLES_PER_TOKEN * long_tokens
        # readiness says degraded while Ray restarts the replica, then ok; the new replica serves the stored voice
        _wait_status(client, "degraded", 30)
        recovered = _wait_all_running(client, RECOVERY_TIMEOUT_S)
        assert recovered["replicas_running"] == 2
        now = set(_replicas(client))
        assert len(now) == 2 and now != set(replicas)
        served = _spread(client, tokens=4, replicas=now)
        assert served.keys() == now, served


def _ready_status(client: httpx.Client) -> str | None:
    """/ready's status, or None when the answer does not come within 3 s (e.g. routed to a stopped replica)."""
    try:
        response = client.get("/ready", timeout=3)
    except httpx.TimeoutException:
        return None
    return response.json().get("status") if response.status_code == 200 else None


def test_a_wedged_replica_is_taken_out_of_routing_and_replaced(base_url: str) -> None:
    """A replica that stops answering (its process stopped, as a hung GPU driver call would leave it) fails Ray's
    health check (check_health, Ray's timeout health_timeout_s + 5 s): Ray takes it out of routing, every request
    then goes to the other replica and completes, and Ray replaces the wedged one."""
    with _client(base_url) as client:
        _wait_all_running(client, RECOVERY_TIMEOUT_S)
        replicas = _replicas(client)
        wedged_id, survivor_id = sorted(replicas)
        wedged_pid = replicas[wedged_id]["engine_pid"]
        os.kill(wedged_pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60  # health checks every 2 s, each given 15 s
            while _ready_status(client) != "degraded":
                assert time.monotonic() < deadline, "the wedged replica was never noticed"
                time.sleep(0.5)
            for _ in range(6):  # out of routing: none of these waits on the wedged replica
                response = client.post("/v1/tts", json={"text": "Hi there.", "voice": VOICE, "response_format": "pcm",
                                                        "force_tokens": 2, "seed": 1}, timeout=30)
                assert response.status_code == 200 and response.headers[REPLICA] == survivor_id, response.text
            _wait_all_running(client, RECOVERY_TIMEOUT_S)
            assert wedged_id not in _replicas(client)
        finally:
            with contextlib.suppress(ProcessLookupError):  # Ray normally killed it already
                os.kill(wedged_pid, signal.SIGKILL)


def test_example_config_builds_the_application(tmp_path) -> None:
    """examples/ray_serve.yaml is a valid Serve config that names an importable builder whose arguments it accepts
    (no cluster needed)."""
    import importlib

    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "ray_serve.yaml").read_text())
    ServeDeploySchema.model_validate(config)  # raises on what Serve rejects, e.g. a misspelt logging_config field
    (application,) = config["applications"]
    module, name = application["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    args = {**application["args"], "model_dir": str(tmp_path)}
    deployment = builder(args)._bound_deployment
    assert deployment.name == "CosyStream"
    assert deployment.num_replicas == application["args"]["num_replicas"]
    spec = deployment.init_args[0]
    budget = application["args"]["first_audio_budget_s"]
    assert spec.voice_store == "actor"
    assert spec.engine_kwargs == {**application["args"]["config"], "first_audio_budget_s": budget}


def test_a_local_cluster_gives_each_gpu_replica_its_share_of_the_cpus(monkeypatch) -> None:
    """Ray sets a replica's OpenMP threads to the CPUs it reserved (1 unless told), where one server process
    has them all: on a GPU machine each replica reserves its GPU's share of the CPUs, less one for Ray."""
    import torch

    from cosystream.scale import ray_app

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(ray_app, "_usable_cpus", lambda: 32)
    assert ray_app.local_resources(2, None) == (1.0, 15.0, {"num_gpus": 2, "num_cpus": 32})
    monkeypatch.setattr(ray_app, "_usable_cpus", lambda: 2)
    assert ray_app.local_resources(1, "cuda") == (1.0, 1.0, {"num_gpus": 2, "num_cpus": 2})  # never less than one
    monkeypatch.setattr(ray_app.os, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match="3 replicas need 3 GPUs"):
        ray_app.local_resources(3, None)
    assert ray_app.local_resources(2, "cpu") == (0.0, 1.0, {"num_cpus": 3})  # no GPU: one CPU process each
    app = ray_app.build_application(ray_app.ReplicaSpec(model_dir="/m"), 2, num_gpus=1.0, num_cpus=15.0)
    assert app._bound_deployment.ray_actor_options == {"num_cpus": 15.0, "num_gpus": 1.0}


def test_a_replica_looks_up_the_proxy_only_when_it_calls_it(monkeypatch) -> None:
    """Ray unpacks an HTTP request with the proxy's actor handle for its receive, looked up by name before the app
    runs; deferred, a request that never calls the proxy (its body carried) costs no look-up, and one that does
    looks it up once and calls it as Ray would."""
    import asyncio

    from ray.serve._private.common import StreamingHTTPRequest
    from ray.serve._private.constants import SERVE_NAMESPACE

    from cosystream.scale import ray_app

    looked_up: list[tuple[str, str]] = []

    class ProxyMethod:
        @staticmethod
        def remote(metadata: str):  # noqa: ANN205 (an awaitable, as Ray's ObjectRef)
            result = asyncio.get_running_loop().create_future()
            result.set_result(b"messages for " + metadata.encode())
            return result

    class ProxyActor:
        receive_asgi_messages = ProxyMethod

    def get_actor(name: str, namespace: str) -> ProxyActor:
        looked_up.append((name, namespace))
        return ProxyActor()

    monkeypatch.setattr(StreamingHTTPRequest, "receive_asgi_messages", StreamingHTTPRequest.receive_asgi_messages)
    monkeypatch.setattr(ray_app.ray, "get_actor", get_actor)
    assert ray_app.defer_proxy_lookup() and ray_app.defer_proxy_lookup()  # idempotent
    unpacked = StreamingHTTPRequest({"type": "http"}, proxy_actor_name="SERVE_PROXY_ACTOR-node")
    fetch = unpacked.receive_asgi_messages  # what Ray's replica does to every request before the app
    assert looked_up == []

    async def calls() -> list[bytes]:
        return [await fetch("first"), await fetch("second")]

    assert asyncio.run(calls()) == [b"messages for first", b"messages for second"]
    assert looked_up == [("SERVE_PROXY_ACTOR-node", SERVE_NAMESPACE)]  # once for the request


def test_the_router_spreads_a_burst_by_the_streams_each_replica_has_now(monkeypatch) -> None:
    """A closed loop's streams end in waves and their next requests come as a burst, routed back to back before any
    reaches its replica. The router counts each choice at once, and reads a replica's load as its last report
    moved on by the streams the proxy saw start and end there since: a report from before a wave ended must not
    send the whole burst to the other replica. Without a cluster: the router on fake replicas."""
    import asyncio
    from types import SimpleNamespace

    from cosystream.scale import proxy, ray_app
    from cosystream.scale.load import LoadReport

    clock = [100.0]
    ledger = proxy.StreamLedger(window_s=10.0, now=lambda: clock[0])
    monkeypatch.setattr(proxy, "LEDGER", ledger)
    clock[0] = 100.2  # 10 streams start on a, both replicas report (a: 16 streams, b: 8), then the 10 end
    for i in range(10):
        ledger.expect(f"old{i}")
        ledger.routed(f"old{i}", "a")
    stats = {r: LoadReport(in_flight=n, service_first_audio_s=0.1, budget_s=0.5, voices=("anna",),
                           reported_at=100.5).as_dict() for r, n in (("a", 16), ("b", 8))}
    clock[0] = 101.0
    for i in range(10):
        ledger.ended(f"old{i}")
    replicas = {r: SimpleNamespace(replica_id=r, routing_stats=stats[r]) for r in stats}
    router = object.__new__(ray_app.EngineAwareRouter)  # Ray's constructor wants a live deployment
    router._replicas, router._open, router._replica_of, router._picked, router._parsed = replicas, Counter(), {}, {}, {}

    def request(n: int) -> SimpleNamespace:
        ledger.expect(f"new{n}")  # as the proxy middleware does for a synthesis request
        return SimpleNamespace(metadata=SimpleNamespace(internal_request_id=f"internal{n}", request_id=f"new{n}",
                                                        multiplexed_model_id="anna"))

    async def burst(first: int, size: int) -> list[tuple[SimpleNamespace, str]]:
        chosen = []
        for n in range(first, first + size):
            pending = request(n)
            ranked = await router.choose_replicas(list(replicas.values()), pending)
            chosen.append((pending, ranked[0][0].replica_id))
        return chosen

    chosen = asyncio.run(burst(0, 10))
    # a has 6 streams now, b 8: the burst brings both to 12 (a report-only count, 16 against 8, sends all to b)
    assert Counter(r for _, r in chosen) == {"a": 6, "b": 4}
    for pending, replica in chosen:  # Ray confirms where each went: counted once, in the ledger and as open
        router.on_request_routed(pending, replica, None)
    assert router._picked == {}
    assert Counter(r for _, r in asyncio.run(burst(10, 24))) == {"a": 12, "b": 12}
