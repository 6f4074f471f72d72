"""cosystream on Ray Serve: one engine replica per GPU behind Ray's HTTP proxy, the same HTTP API.

    cosystream serve --model-dir DIR --replicas 2                                  # a local Ray cluster
    serve run cosystream.scale.ray_app:app_builder model_dir=DIR num_replicas=4   # an existing cluster
    serve run examples/ray_serve.yaml                                            # the same, from a config

Each replica of the deployment `CosyStream` is the application's ASGI ingress, so Ray's proxy carries every HTTP
request and WebSocket straight to one replica (a WebSocket session lives on the replica that accepted it). The
replica starts a process of its own for the engine and the unchanged FastAPI app (server/app.py) and forwards
every request to it over a Unix socket (scale/engine_process.py): Ray's request path stays in the replica's
process, and its GIL, apart from the engine's. What the replica adds around the app:

* routing: it publishes a `LoadReport` (scale/load.py) through Ray's `record_routing_stats`; the deployment's
  `EngineAwareRouter` ranks replicas by whether they can meet the first-audio budget, then by the request's
  prompt (a voice, or an uploaded recording's digest, found by the proxy middleware of scale/proxy.py in every
  entry point's request) and by load; the chosen replica's own admission
  refuses at once (503 overloaded) when even it cannot, and when every replica is known to be full the proxy
  middleware answers that refusal itself (scale/proxy.py);
* voices: every replica reads one store (a shared SQLite file, or a named actor on the head node), and a
  registration or deletion through any replica is broadcast to all, which drop and reload their copy;
* one place to read: /metrics merges every replica's metrics (label `replica`), /ready reports the cluster,
  GET /v1/requests/{id} finds the request on whichever replica served it, GET /v1/replicas lists them;
  every response names its replica in `X-Cosystream-Replica`;
* faults: `check_health` fails when the engine process ended, or its engine loop stopped or does not answer in
  time, so Ray takes the replica out of routing and restarts it (the engine process ends with its replica); a
  stream whose replica or engine process died ends with an `error` event, sent by the proxy middleware of
  scale/proxy.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.serve.schema import LoggingConfig
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosystream import errors as cosy_errors
from cosystream.scale import proxy as scale_proxy  # its LEDGER by module: the router class may travel by value
from cosystream.scale.engine_process import EngineProcess, Forwarder
from cosystream.scale.load import (
    LoadReport,
    every_replica_full,
    in_flight_now,
    merge_metrics,
    rank_replicas,
)
from cosystream.scale.proxy import CALLBACK_ENV as PROXY_CALLBACK_ENV
from cosystream.scale.proxy import CALLBACK_PATH as PROXY_CALLBACK_PATH
from cosystream.scale.proxy import from_proxy, register_refusal_check, register_retry_check
from cosystream.server.errors import ApiError
from cosystream.server.metrics import CONTENT_TYPE
from cosystream.server.session import proxy_wait_s, request_id_override
from cosystream.server.state import ServerSettings

log = logging.getLogger("cosystream.server")

APP_NAME = "cosystream"
DEPLOYMENT_NAME = "CosyStream"
REPLICA_HEADER = b"x-cosystream-replica"
REQUEST_ID_HEADER = b"x-request-id"  # set by Ray's proxy on the way in, returned by it on the way out
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # ids the app adopts (GET /v1/requests/{id} takes them)
VOICE_STORE_ACTOR = "cosystream_voice_store"
VOICE_STORE_NAMESPACE = "cosystream"
VOICE_BROADCAST_TIMEOUT_S = 1.0  # a registration answers once every replica dropped its copy, or after this
PEER_CALL_TIMEOUT_S = 5.0  # /metrics, /v1/requests/{id}, /v1/replicas: how long to wait for the other replicas
ROUTING_STATS_PERIOD_S = 0.5  # how often each replica publishes its LoadReport
PROXY_REFUSAL_FRESH_S = 2 * ROUTING_STATS_PERIOD_S  # the proxy refuses on reports at most this old
REFUSED_OUTCOME = "overloaded"  # a finished request's outcome when admission refused it (server/session.py)
PICK_HOLD_S = 2.0  # a router's choice counts as a stream on its replica until Ray confirms it, at most this long
# The environment of a local cluster's processes (`serve_replicas`; on a cluster, that of `ray start`): the proxy
# middlewares, and Ray Serve's gRPC data plane between the proxy and the replicas (what its throughput-optimized
# mode uses; a few ms less per request than Ray actor calls), whose message cap must hold the largest response
# the app sends in one piece (a non-streamed WAV; gRPC's default is 4 MiB). Two more settings of that mode keep
# each message on one event loop: the app runs on the replica's own loop, not on a second one in another thread,
# and the proxy's router on the proxy's loop; every hop between two loops is a thread switch per message, and in a
# replica each one waits for the GIL its engine thread holds while it drives the GPU (docs/scaling.md, "The data
# path"). Values already set are kept.
RAY_ENV_DEFAULTS = {PROXY_CALLBACK_ENV: PROXY_CALLBACK_PATH, "RAY_SERVE_PROXY_USE_GRPC": "1",
                    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(1 << 30),
                    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def replica_logging(ray_access_log: bool = False) -> LoggingConfig:
    """Ray Serve's logging in each replica. By default Serve writes an access line there for every request, and
    building it costs the replica CPU, GIL time its engine thread waits for, even when the line is then filtered
    out (`enable_access_log=False` alone still builds it): Serve's logger in the replica logs warnings and errors
    only (a request that failed still is), so the line is never built. cosystream's own line per request
    (`event=request_done`: the request id, outcome, stage times) stays; `ray_access_log` brings Ray's back, with
    Serve's informational lines of the replica."""
    return LoggingConfig() if ray_access_log else LoggingConfig(enable_access_log=False, log_level="WARNING")


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds: the engine's arguments and the server's settings (picklable)."""

    model_dir: str
    device: str | None = None  # None: cuda when Ray gave the replica a GPU, else cpu
    dtype: str | None = None  # None: bfloat16 on GPU, float32 on CPU
    voice_store: str = "file"  # "file": voices_db on a filesystem every replica sees; "actor": on the head node
    voices_db: str | None = None  # None: $COSYSTREAM_HOME/voices.db (of the head node for "actor")
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    settings: ServerSettings = field(default_factory=ServerSettings)
    health_timeout_s: float = 10.0  # the engine loop must answer a no-op within this
    log_level: str = "info"
    # "module:callable" applied to the built engine, whose result the app serves (benchmarks/scale_overhead.py
    # swaps synthesis for a stand-in to measure the serving path alone); None: the engine itself
    engine_hook: str | None = None

    def __post_init__(self) -> None:
        if self.voice_store not in ("file", "actor"):
            raise ValueError(f"voice_store: expected 'file' or 'actor', got {self.voice_store!r}")


# ---------------------------------------------------------------- the voice store for several machines

@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class VoiceStoreActor:
    """The voice database of a cluster: one SQLite file on the head node, read and written through this named
    actor (replicas on other machines cannot share one SQLite file: its locks do not work across hosts).
    Failures travel back as (class name, message), re-raised as the same cosystream error by the client."""

    def __init__(self, path: str | None) -> None:
        from cosystream.engine.voices import VoiceStore

        self.store = VoiceStore(path)

    def call(self, method: str, *args: Any) -> tuple[str, Any]:
        try:
            if method == "contains":
                return "ok", args[0] in self.store
            return "ok", getattr(self.store, method)(*args)
        except cosy_errors.CosyStreamError as exc:
            return "error", (type(exc).__name__, str(exc))

    def path(self) -> str:
        return str(self.store.path)


def voice_store_actor(path: str | None) -> Any:
    """The cluster's voice store actor, started on the head node by whichever replica asks first."""
    return VoiceStoreActor.options(name=VOICE_STORE_ACTOR, namespace=VOICE_STORE_NAMESPACE, get_if_exists=True,
                                   lifetime="detached", resources={"node:__internal_head__": 0.001}).remote(path)


class RemoteVoiceStore:
    """VoiceStore's interface over the store actor (engine/voices.py), used by each replica's engine."""

    def __init__(self, actor: Any, timeout_s: float = 30.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self.path = Path(ray.get(actor.path.remote(), timeout=timeout_s))

    def _call(self, method: str, *args: Any) -> Any:
        status, value = ray.get(self.actor.call.remote(method, *args), timeout=self.timeout_s)
        if status == "error":
            name, message = value
            raise getattr(cosy_errors, name, cosy_errors.CosyStreamError)(message)
        return value

    def add(self, name: str, prompt: Any, prompt_text: str, extras: Any = None) -> Any:
        return self._call("add", name, prompt, prompt_text, extras)

    def get(self, name: str) -> Any:
        return self._call("get", name)

    def list(self) -> Any:
        return self._call("list")

    def delete(self, name: str) -> None:
        self._call("delete", name)

    def set_extras(self, name: str, extras: Any) -> None:
        self._call("set_extras", name, extras)

    def __contains__(self, name: object) -> bool:
        return bool(self._call("contains", name))

    def close(self) -> None:
        pass  # the actor outlives replicas


# ---------------------------------------------------------------- the replica

class _ReplicaHeaders:
    """ASGI wrapper: every HTTP response and WebSocket accept names the replica that served it, and a request
    keeps one id. Ray's proxy returns its own `x-request-id` (the one it logs) on every response, so the app
    adopts that id (request_id_override) and its own X-Request-Id header is left out: clients see one id, the
    one GET /v1/requests/{id}, the `done` event and the log line carry. What the proxy middleware carried
    (scale/proxy.py) is taken here: the body, and the proxy's arrival, which becomes the request's arrival
    (the server's stage times count from it; `proxy_s` in GET /v1/requests/{id} is its share)."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER, replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope, receive, proxy_s = from_proxy(scope, receive)
        if proxy_s is not None:
            scope["state"] = {**scope.get("state", {}), "t_arrival": time.perf_counter() - proxy_s}
        proxy_id = dict(scope.get("headers", [])).get(REQUEST_ID_HEADER, b"").decode("latin-1")
        adopted = REQUEST_ID_PATTERN.fullmatch(proxy_id) is not None

        held: list[Message] = []  # a response's start, sent with its first body

        async def named_send(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                headers = message.get("headers", [])
                if adopted:
                    headers = [(k, v) for k, v in headers if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, self.header]}
                if message["type"] == "http.response.start":  # the body follows at once (the app starts a
                    held.append(message)  # stream with its first audio ready): one trip to the proxy for both
                    return
            while held:
                await send(held.pop())
            await send(message)

        token = request_id_override.set(proxy_id if adopted else None)
        proxy_token = proxy_wait_s.set(proxy_s)
        try:
            await self.app(scope, receive, named_send)
        finally:
            proxy_wait_s.reset(proxy_token)
            request_id_override.reset(token)
            while held:  # a start with no body (the app ended there)
                await send(held.pop())


def defer_proxy_lookup() -> bool:
    """Make Ray's replica look up the proxy actor of an HTTP request only when it calls it. Ray unpacks each request
    with the proxy's actor handle for its receive, looked up by name (a call to Ray's control store, about half a
    millisecond, synchronous on the replica's loop) before the app runs; for a request whose body the proxy carried,
    the app never calls the proxy (scale/proxy.py's skip_fetch), so the look-up is wasted on the request's path.
    Here the receive Ray unpacks resolves the handle at its first call instead, and keeps it for the request as Ray
    does. Process-wide, idempotent; False (nothing changed) where Ray's request class has another shape."""
    try:
        from ray.serve._private.common import StreamingHTTPRequest
        from ray.serve._private.constants import SERVE_NAMESPACE
    except ImportError:
        return False
    current = getattr(StreamingHTTPRequest, "receive_asgi_messages", None)
    if getattr(getattr(current, "fget", None), "_cosystream_deferred", False):
        return True
    probe = StreamingHTTPRequest({"type": "http"}, proxy_actor_name="probe")
    if not isinstance(current, property) or not all(
            hasattr(probe, a) for a in ("_proxy_actor_name", "_cached_proxy_actor", "_receive_asgi_messages")):
        return False

    def receive_asgi_messages(request: Any) -> Any:
        if request._receive_asgi_messages is None:
            async def fetch(request_metadata: Any) -> bytes:
                if request._cached_proxy_actor is None:
                    request._cached_proxy_actor = ray.get_actor(request._proxy_actor_name, namespace=SERVE_NAMESPACE)
                return await request._cached_proxy_actor.receive_asgi_messages.remote(request_metadata)

            request._receive_asgi_messages = fetch
        return request._receive_asgi_messages

    receive_asgi_messages._cosystream_deferred = True  # type: ignore[attr-defined]
    StreamingHTTPRequest.receive_asgi_messages = property(receive_asgi_messages)  # type: ignore[method-assign]
    return True


@serve.ingress()
class CosyStreamReplica:
    """Ray Serve's ASGI ingress for every route: forwards each request to the engine process it started
    (scale/engine_process.py) and answers what concerns the whole application."""

    async def __init__(self, spec: ReplicaSpec) -> None:
        from cosystream.server.app import configure_logging

        configure_logging(spec.log_level)
        defer_proxy_lookup()
        context = serve.get_replica_context()
        self.replica_id: str = context.replica_id.unique_id
        self.spec = spec
        self.device = spec.device or ("cuda" if ray.get_gpu_ids() else "cpu")
        self._deployment_id = (context.app_name, context.deployment)
        self.peers = serve.get_deployment_handle(context.deployment, context.app_name)
        # loaded, warmed up and listening before the constructor returns: Ray routes to a replica once it is built
        self.engine = await EngineProcess.start(spec, self.replica_id, self.device,
                                                ray.get_runtime_context().gcs_address)
        self._forwarder = Forwarder(self.engine, self._cluster_answer, self._announce_voice_change,
                                    spec.settings.max_upload_bytes)
        log.info("event=replica_ready replica=%s pid=%d engine_pid=%d device=%s", self.replica_id, os.getpid(),
                 self.engine.pid, self.device)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return _ReplicaHeaders(self._forwarder, self.replica_id)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()

    # -------------------------------------------------------- what Ray asks of a replica
    async def record_routing_stats(self) -> dict[str, Any]:
        """The LoadReport the router ranks replicas by (published every ROUTING_STATS_PERIOD_S), made by the
        engine process: with the prompt keys it holds, under the names requests give them (scale/proxy.py finds
        a request's key)."""
        return await self.engine.get_json("report", timeout_s=4 * ROUTING_STATS_PERIOD_S)

    async def check_health(self) -> None:
        """Raise when the engine process ended, or its engine loop stopped or does not run a no-op within
        health_timeout_s (a wedged GPU): Ray then stops routing to this replica and replaces it."""
        self.engine.check_alive()
        await self.engine.get_json("health", timeout_s=self.spec.health_timeout_s + 1.0)

    # -------------------------------------------------------- calls between replicas (handle.broadcast)
    async def voice_changed(self, name: str) -> str:
        """Another replica registered or deleted `name`: the engine drops its copy, then loads the stored one
        (if any), so the next request here uses what the store holds now."""
        await self.engine.post_json("voice_changed", name=name)
        return self.replica_id

    async def metrics_text(self) -> tuple[str, str]:
        return self.replica_id, await self.engine.get_text("metrics")

    async def finished_request(self, request_id: str) -> dict[str, Any] | None:
        """A finished request's record, with the replica that kept it (`replica`)."""
        found = await self.engine.get_json("finished", request_id=request_id)
        return None if found is None else {**found, "replica": self.replica_id}

    async def describe(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "pid": os.getpid(), "engine_pid": self.engine.pid,
                "node_id": ray.get_runtime_context().get_node_id(), "device": self.device,
                "load": await self.record_routing_stats()}

    # -------------------------------------------------------- helpers
    async def _announce_voice_change(self, name: str) -> None:
        response = self.peers.broadcast("voice_changed", name)
        try:
            results = await asyncio.wait_for(response.results_async(return_exceptions=True),
                                             VOICE_BROADCAST_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("event=voice_broadcast_slow name=%s", name)
            return
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # a replica that is going away: it starts again with an empty cache
            log.warning("event=voice_broadcast_failed name=%s errors=%r", name, failed)

    async def _peer_results(self, method: str, *args: Any) -> list[Any]:
        """Every live replica's answer to `method` (this one's included); failures are left out."""
        response = self.peers.broadcast(method, *args)
        results = await asyncio.wait_for(response.results_async(return_exceptions=True), PEER_CALL_TIMEOUT_S)
        return [r for r in results if not isinstance(r, BaseException)]

    # -------------------------------------------------------- routes that answer for the whole application
    async def _cluster_answer(self, route: str, scope: Scope) -> ASGIApp:
        """The answer to an application-wide route the engine process handed back (CLUSTER_ROUTES; it checked
        the API key and, for /ready, that this replica serves)."""
        try:
            if route == "metrics":
                return await self._metrics()
            if route == "ready":
                return await self._ready()
            if route == "finished":
                return await self._finished_request(scope["path"].rsplit("/", 1)[-1])
            if route == "replicas":
                return await self._replicas()
        except ApiError as error:
            return error.response()
        return ApiError(404, "not_found", f"path: {scope['path']} is not a route", field="path").response()

    async def _metrics(self) -> Response:
        texts = dict(await self._peer_results("metrics_text"))
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE)

    async def _ready(self) -> JSONResponse:
        running, target = await run_in_threadpool(_replica_counts, *self._deployment_id)
        status = "ok" if running >= target else "degraded"
        return JSONResponse({"status": status, "replicas_running": running, "replicas_target": target})

    async def _finished_request(self, request_id: str) -> JSONResponse:
        """The request's record from whichever replica served it. A request one replica refused and the proxy
        sent on to another (scale/proxy.py) has a record on both, under one id: the served one is returned."""
        local = await self.finished_request(request_id)
        if local is None or local.get("outcome") == REFUSED_OUTCOME:
            found = [r for r in await self._peer_results("finished_request", request_id) if r is not None]
            found.sort(key=lambda r: r.get("outcome") == REFUSED_OUTCOME)  # served first
            local = found[0] if found else local
        if local is None:
            raise ApiError(404, "request_not_found", f"request {request_id!r} is unknown, still running, or no "
                           "longer kept by any replica", field="request_id")
        return JSONResponse(local)

    async def _replicas(self) -> JSONResponse:
        described = sorted(await self._peer_results("describe"), key=lambda d: d["replica"])
        return JSONResponse({"replicas": described})


def _replica_counts(app_name: str, deployment: str) -> tuple[int, int]:
    """(running, target) replicas of the deployment, as the Serve controller sees them."""
    status = serve.status().applications[app_name].deployments[deployment]
    states = {str(getattr(k, "value", k)): n for k, n in status.replica_states.items()}
    running = states.get("RUNNING", 0)
    target = sum(n for state, n in states.items() if state not in ("STOPPING",))
    return running, max(target, running)


# ---------------------------------------------------------------- the router

class EngineAwareRouter(RequestRouter):
    """Ranks replicas by their published LoadReports (scale/load.rank_replicas), each replica's streams counted as
    the router can tell them now (scale/load.in_flight_now: the report moved on by the streams this proxy saw
    start and end there since, StreamLedger of scale/proxy.py). Runs in every caller of the deployment: Ray's
    HTTP proxies.

    A burst of requests (a closed loop's streams end together and their next requests come together) is routed
    back to back, before any of them reaches its replica and is counted there or in the ledger: each choice
    counts at once as a stream on the replica ranked first (`_picked`), until Ray reports where the request went
    (on_request_routed) or that it ended (on_request_completed), so a burst is spread instead of all going to the
    replica that was least loaded before it.

    In a proxy it also tells the proxy middleware when every replica is known to be full
    (scale/load.every_replica_full), so the refusal is answered there, without a trip to a replica; those
    refusals are counted in Ray's metric `cosystream_proxy_refusals` (a replica never sees them). A request a
    replica refused goes once more to the best replica that has not refused it, when there is one that is not
    known to be full (scale/proxy.py's VoiceHint), counted in `cosystream_proxy_retries`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open: Counter[ReplicaID] = Counter()
        self._replica_of: dict[str, ReplicaID] = {}
        self._picked: dict[str, tuple[ReplicaID, float]] = {}  # internal request id -> (replica ranked first, when)
        self._counters: dict[str, Any] = {}  # Ray's counters by name, each made at its first count
        self._parsed: dict[ReplicaID, tuple[Any, LoadReport | None]] = {}  # replica -> (its stats, their report)
        register_refusal_check(getattr(self, "_deployment_id", None), self.refuse_new_stream)
        register_retry_check(getattr(self, "_deployment_id", None), self.retry_refused)

    def _report(self, replica: RunningReplica) -> LoadReport | None:
        """The replica's LoadReport, parsed once per published report (every request reads every replica's)."""
        stats = replica.routing_stats
        parsed = self._parsed.get(replica.replica_id)
        if parsed is None or parsed[0] is not stats:
            parsed = (stats, LoadReport.from_dict(stats))
            if len(self._parsed) > 2 * len(self.curr_replicas) + 8:  # forget replicas that are gone
                current = self.curr_replicas
                self._parsed = {k: v for k, v in self._parsed.items() if k in current}
            self._parsed[replica.replica_id] = parsed
        return parsed[1]

    def refuse_new_stream(self) -> bool:
        """True (and counted) when every replica would refuse a new stream now; called by the proxy middleware
        from the proxy's own event loop, so it only reads what the router's loop replaces whole."""
        entries = [self._full_entry(r) for r in list(self.curr_replicas.values())]
        if not every_replica_full(entries, time.time(), PROXY_REFUSAL_FRESH_S):
            return False
        self._count("cosystream_proxy_refusals",
                    "synthesis requests refused by the proxy: every replica was at its first-audio budget")
        return True

    def retry_refused(self, request_id: str) -> bool:
        """True (and counted) when a replica that has not refused `request_id` yet may admit it: one that is not
        known to be full (LoadReport.known_full). Called by the proxy middleware as refuse_new_stream is."""
        refused_by = scale_proxy.LEDGER.refused_by(request_id)
        now = time.time()
        others = [r for r in list(self.curr_replicas.values()) if r.replica_id not in refused_by]
        if all(every_replica_full([self._full_entry(r)], now, PROXY_REFUSAL_FRESH_S) for r in others):
            return False
        self._count("cosystream_proxy_retries", "synthesis requests a replica refused that the proxy sent to another "
                    "replica")
        return True

    def _full_entry(self, replica: RunningReplica) -> tuple[LoadReport | None, Callable[[float], int | None]]:
        """What every_replica_full reads of a replica: its last report and the ledger's streams since one."""
        return self._report(replica), functools.partial(scale_proxy.LEDGER.net_since, replica.replica_id)

    def _count(self, name: str, description: str) -> None:
        """One more in Ray's counter `name` (made at its first count)."""
        if name not in self._counters:
            from ray.util.metrics import Counter as RayCounter

            self._counters[name] = RayCounter(name, description)
        self._counters[name].inc()

    def _picked_per_replica(self, now: float) -> Counter[ReplicaID]:
        """Choices not yet confirmed by Ray, per replica; a choice older than PICK_HOLD_S (a request cancelled
        while it was routed: Ray calls neither hook) is forgotten."""
        if any(now - t > PICK_HOLD_S for _, t in self._picked.values()):
            self._picked = {k: v for k, v in self._picked.items() if now - v[1] <= PICK_HOLD_S}
        return Counter(replica for replica, _ in self._picked.values())

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {r.replica_id: self._report(r) for r in candidate_replicas}
        now = time.time()
        picked = self._picked_per_replica(now)
        ledger = scale_proxy.LEDGER
        in_flight = {}
        for replica_id, load in loads.items():
            since = load.reported_at if load is not None else None
            net = ledger.net_since(replica_id, since) if since is not None else None
            in_flight[replica_id] = in_flight_now(load, self._open[replica_id], net) + picked[replica_id]
        # the request's prompt key (a voice or an upload's digest), when the proxy's VoiceHint (scale/proxy.py)
        # found one in it; the replicas that already refused it (the proxy sends a refused request once more)
        metadata = pending_request.metadata if pending_request is not None else None
        voice = (metadata.multiplexed_model_id or None) if metadata is not None else None
        avoid = ledger.refused_by(metadata.request_id) if metadata is not None else frozenset()
        ranked = rank_replicas(loads, voice=voice, in_flight=in_flight, avoid=avoid)
        if metadata is not None and ranked:
            self._picked[metadata.internal_request_id] = (ranked[0], now)
        return [[by_id[replica_id]] for replica_id in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._picked.pop(pending_request.metadata.internal_request_id, None)
        self._open[replica_id] += 1
        self._replica_of[pending_request.metadata.internal_request_id] = replica_id
        scale_proxy.LEDGER.routed(pending_request.metadata.request_id, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._picked.pop(internal_request_id, None)  # e.g. the replica's queue refused it: Ray routes it again
        if self._replica_of.pop(internal_request_id, None) is None:
            return
        self._open[replica_id] -= 1
        if self._open[replica_id] <= 0:
            del self._open[replica_id]


# ---------------------------------------------------------------- the application

def build_application(spec: ReplicaSpec, num_replicas: int, num_gpus: float = 0.0, num_cpus: float = 1.0,
                      max_ongoing_requests: int = 1024, health_check_period_s: float = 2.0,
                      health_check_timeout_s: float | None = None, ray_access_log: bool = False) -> Any:
    """The bound Serve application: `num_replicas` replicas of `spec`, each with `num_gpus` GPUs (1: one GPU
    each; 0: none) and `num_cpus` CPUs (Ray gives the replica's process that many OpenMP threads).
    max_ongoing_requests is far above any engine's slots on purpose: the engine's admission decides when a replica
    is full, not Ray's queue. Ray's access line per request is left out unless `ray_access_log` (replica_logging)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas: must be at least 1, got {num_replicas}")
    actor_options: dict[str, Any] = {"num_cpus": num_cpus, **({"num_gpus": num_gpus} if num_gpus > 0 else {})}
    router = RequestRouterConfig(request_router_class=EngineAwareRouter,
                                 request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                                 request_routing_stats_timeout_s=max(ROUTING_STATS_PERIOD_S, 5.0))
    deployment = serve.deployment(CosyStreamReplica, name=DEPLOYMENT_NAME).options(
        num_replicas=num_replicas, ray_actor_options=actor_options, max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=health_check_timeout_s or spec.health_timeout_s + 5.0,
        request_router_config=router, logging_config=replica_logging(ray_access_log))
    return deployment.bind(spec)


_TRUE = {"1", "true", "yes", "on"}


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run cosystream.scale.ray_app:app_builder model_dir=DIR [key=value ...]` or a config's `args`.

    Keys: model_dir (required), num_replicas (1), num_gpus (1 per replica when the cluster has GPUs, else 0),
    num_cpus (1 per replica), device, dtype, voice_store (actor; file for one host), voices_db,
    max_streams, first_audio_budget_s, max_streams_per_client, warmup (true), config (FIELD=VALUE,... or a
    mapping of EngineConfig fields), health_timeout_s (10), log_level (info), ray_access_log (false: Ray's
    access line per request in the replicas, replica_logging). API keys: $COSYSTREAM_API_KEYS.
    """
    from cosystream.config import config_overrides

    args = dict(args)
    if "model_dir" not in args:
        raise ValueError("model_dir: required (the CosyVoice2 model directory, on every node)")
    engine_kwargs: dict[str, Any] = {}
    config = args.get("config")
    if isinstance(config, dict):
        engine_kwargs.update(config)
    elif config:
        engine_kwargs.update(config_overrides([c for c in str(config).split(",") if c]))
    if args.get("max_streams") is not None:
        engine_kwargs["max_streams"] = int(args["max_streams"])
    budget = str(args.get("first_audio_budget_s", 1.0)).strip().lower()  # as `cosystream serve`: 1 s, 0/off: none
    engine_kwargs["first_audio_budget_s"] = None if budget in ("0", "0.0", "off", "none", "") else float(budget)
    keys = frozenset(k.strip() for k in os.environ.get("COSYSTREAM_API_KEYS", "").split(",") if k.strip())
    settings = ServerSettings(
        max_streams_per_client=int(args["max_streams_per_client"]) if args.get("max_streams_per_client") else None,
        warmup=str(args.get("warmup", "true")).lower() in _TRUE, api_keys=keys)
    spec = ReplicaSpec(model_dir=str(args["model_dir"]), device=args.get("device"), dtype=args.get("dtype"),
                       voice_store=str(args.get("voice_store", "actor")), voices_db=args.get("voices_db"),
                       engine_kwargs=engine_kwargs, settings=settings,
                       health_timeout_s=float(args.get("health_timeout_s", 10.0)),
                       log_level=str(args.get("log_level", "info")))
    num_gpus = args.get("num_gpus")
    if num_gpus is None:
        num_gpus = 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    return build_application(spec, int(args.get("num_replicas", 1)), num_gpus=float(num_gpus),
                             num_cpus=float(args.get("num_cpus", 1.0)),
                             ray_access_log=str(args.get("ray_access_log", "false")).lower() in _TRUE)


# ---------------------------------------------------------------- `cosystream serve --replicas N`

def local_resources(num_replicas: int, device: str | None) -> tuple[float, float, dict[str, Any]]:
    """(num_gpus, num_cpus) per replica and ray.init's resources for a local cluster on this machine."""
    import torch

    gpus = torch.cuda.device_count() if device in (None, "cuda") else 0
    if gpus:
        if num_replicas > gpus:
            raise ValueError(f"--replicas: {num_replicas} replicas need {num_replicas} GPUs, this machine has {gpus}")
        # each GPU's share of the CPUs, less one for the proxy and Ray's own processes: Ray gives a replica's
        # process as many OpenMP threads as CPUs it reserved (1 by default), where one server process has them all;
        # the cluster is told the same count (Ray's own may differ in a container), so the shares always fit
        cpus = _usable_cpus()
        return 1.0, float(max(1, cpus // gpus - 1)), {"num_gpus": gpus, "num_cpus": cpus}
    return 0.0, 1.0, {"num_cpus": max(os.cpu_count() or 1, num_replicas + 1)}


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def serve_replicas(spec: ReplicaSpec, num_replicas: int, host: str, port: int, ray_address: str | None = None,
                   ready: threading.Event | None = None, ray_access_log: bool = False) -> None:
    """Start (or join, with `ray_address`) a Ray cluster, deploy `num_replicas` replicas and serve until
    interrupted (SIGINT/SIGTERM), then tear the application down. `ray_access_log`: Ray's access line per
    request in the replicas too (replica_logging)."""
    if ray_address:  # its proxies run with the environment of `ray start` (docs/scaling.md)
        num_gpus, num_cpus = (1.0 if spec.device != "cpu" else 0.0), 1.0
        ray.init(address=ray_address, log_to_driver=False)
    else:
        num_gpus, num_cpus, resources = local_resources(num_replicas, spec.device)
        for key, value in RAY_ENV_DEFAULTS.items():  # inherited by the proxy and replicas Ray starts
            os.environ.setdefault(key, value)
        ray.init(include_dashboard=False, log_to_driver=False, **resources)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_application(spec, num_replicas, num_gpus=num_gpus, num_cpus=num_cpus,
                                    ray_access_log=ray_access_log), name=APP_NAME, route_prefix="/")
        log.info("event=ray_app_ready replicas=%d url=http://%s:%d", num_replicas, host, port)
        if ready is not None:
            ready.set()
        while not stop.wait(1.0):  # a timed wait: signal handlers run between waits
            pass
    finally:
        serve.shutdown()
        ray.shutdown()
