"""The proxy middleware that ends a stream whose replica died (scale/proxy.py), on fake ASGI apps."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from cosystream.scale.proxy import LOST_CODE, StreamEndGuard, proxy_middlewares


def _run(app, scope_type: str = "http") -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(StreamEndGuard(app)({"type": scope_type, "headers": []}, receive, send))
    return sent


def _http_app(content_type: bytes, finish: bool, fail: bool = False):
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        if finish:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if fail:
            raise RuntimeError("replica died")
    return app


@pytest.mark.parametrize("fail", [False, True])
@pytest.mark.parametrize(("content_type", "prefix", "suffix"), [
    (b"application/x-ndjson", b"", b"\n"), (b"text/event-stream; charset=utf-8", b"data: ", b"\n\n")])
def test_an_unfinished_event_stream_ends_with_an_error_event(content_type, prefix, suffix, fail) -> None:
    sent = _run(_http_app(content_type, finish=False, fail=fail))
    last = sent[-1]
    assert last["type"] == "http.response.body" and last["more_body"] is False
    body = last["body"]
    assert body.startswith(prefix) and body.endswith(suffix)
    event = json.loads(body[len(prefix):-len(suffix)])
    assert event == {"type": "error", "error": {"code": LOST_CODE, "message": event["error"]["message"],
                                                "field": None}}


def test_finished_streams_and_raw_audio_are_left_alone() -> None:
    finished = _run(_http_app(b"application/x-ndjson", finish=True))
    assert [m.get("body") for m in finished[1:]] == [b"first", b""]  # nothing added
    raw = _run(_http_app(b"audio/pcm", finish=False))
    assert raw[-1].get("more_body") is True  # cut off: the client sees an incomplete transfer
    with pytest.raises(RuntimeError):  # and a failure still propagates (the connection is dropped)
        _run(_http_app(b"audio/pcm", finish=False, fail=True))


def test_an_unclosed_websocket_gets_an_error_event_and_close_4503() -> None:
    async def dropped(scope, receive, send) -> None:
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "bytes": b"audio"})

    sent = _run(dropped, "websocket")
    assert json.loads(sent[-2]["text"])["error"]["code"] == LOST_CODE
    assert sent[-1] == {"type": "websocket.close", "code": 4503, "reason": LOST_CODE}

    async def closed(scope, receive, send) -> None:
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})

    assert _run(closed, "websocket")[-1] == {"type": "websocket.close", "code": 1000}


def test_ray_gets_starlette_middlewares() -> None:
    from starlette.middleware import Middleware

    assert len(proxy_middlewares()) == 2 and all(isinstance(m, Middleware) for m in proxy_middlewares())


def _hinted(body: bytes, path: str = "/v1/tts", content_type: bytes = b"application/json") -> tuple[dict, bytes]:
    """(the scope the proxy app gets, the body it reads) for one request through VoiceHint."""
    from cosystream.scale.proxy import VoiceHint

    seen: dict = {}
    chunks = [body[:5], body[5:]]

    async def receive() -> dict:
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def app(scope, receive, send) -> None:
        data = b""
        while True:
            message = await receive()
            data += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["scope"], seen["body"] = scope, data

    async def send(message: dict) -> None:
        pass

    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(VoiceHint(app)(scope, receive, send))
    return seen["scope"], seen["body"]


def test_the_voice_of_a_json_request_reaches_the_router_and_the_body_is_unchanged() -> None:
    from cosystream.scale.proxy import VOICE_HINT_HEADER

    body = json.dumps({"text": "Hello.", "voice": "anna"}).encode()
    scope, seen_body = _hinted(body)
    assert dict(scope["headers"])[VOICE_HINT_HEADER] == b"anna" and seen_body == body
    for other in (_hinted(b"{not json"), _hinted(json.dumps({"voice": "bad name!"}).encode()),
                  _hinted(body, path="/v1/voices"), _hinted(body, content_type=b"multipart/form-data")):
        assert VOICE_HINT_HEADER not in dict(other[0]["headers"])
    assert _hinted(b"{not json")[1] == b"{not json"  # passed on for the app to refuse


def _multipart(fields: dict[str, str], files: dict[str, bytes]) -> tuple[bytes, bytes]:
    """(body, content-type) of a multipart form, built by httpx as a client would send it."""
    import httpx

    request = httpx.Request("POST", "http://x/v1/tts", data=fields,
                            files={k: (f"{k}.wav", v, "audio/wav") for k, v in files.items()})
    return request.read(), request.headers["content-type"].encode()


def test_an_uploaded_recording_is_hinted_by_the_engines_own_key() -> None:
    """The proxy's key of a multipart upload is the digest the engine keys the analysed upload by, so the
    router's preference matches what the replica reports holding."""
    from cosystream.engine.async_engine import _UPLOAD_PREFIX, _upload_key
    from cosystream.scale.load import upload_key
    from cosystream.scale.proxy import VOICE_HINT_HEADER

    audio = bytes(range(256)) * 40
    body, content_type = _multipart({"text": "Hello.", "prompt_text": "the sun rose.", "voice": "anna"},
                                    {"prompt_wav": audio})
    scope, seen_body = _hinted(body, content_type=content_type)
    assert seen_body == body  # passed on unchanged
    engine_key = _upload_key(audio, "the sun rose.")
    assert dict(scope["headers"])[VOICE_HINT_HEADER].decode() == upload_key(engine_key[len(_UPLOAD_PREFIX):])
    other_text = _hinted(*_swap(_multipart({"text": "Hi.", "prompt_text": "another."}, {"prompt_wav": audio})))[0]
    assert dict(other_text["headers"])[VOICE_HINT_HEADER] != dict(scope["headers"])[VOICE_HINT_HEADER]
    # a form (urlencoded: no file) naming a registered voice: the voice; an upload to another path: nothing
    voice_form = _hinted(*_swap(_multipart({"text": "Hi.", "voice": "anna"}, {})))[0]
    assert dict(voice_form["headers"])[VOICE_HINT_HEADER] == b"anna"
    assert VOICE_HINT_HEADER not in dict(_hinted(body, path="/v1/voices", content_type=content_type)[0]["headers"])
    broken = _hinted(b"--x\r\nnot a form", content_type=b"multipart/form-data; boundary=x")
    assert VOICE_HINT_HEADER not in dict(broken[0]["headers"]) and broken[1] == b"--x\r\nnot a form"


def _swap(pair: tuple[bytes, bytes]) -> tuple[bytes, str, bytes]:
    return pair[0], "/v1/tts", pair[1]


def _ws_through_hint(client: list[dict], inner_closes: bool = True, wait_s: float | None = None,
                     first_delay_s: float = 0.0, delay_at: int = 0):
    """Run VoiceHint over a WebSocket: `client` are the messages after the handshake's connect (client[delay_at]
    after `first_delay_s`). Returns (what the client was sent, the scope the app behind saw, the messages it
    received)."""
    from cosystream.scale import proxy

    sent: list[dict] = []
    seen: dict = {"received": []}
    incoming = [{"type": "websocket.connect"}, *client]

    async def receive() -> dict:
        if incoming:
            if len(incoming) == len(client) - delay_at and first_delay_s:
                await asyncio.sleep(first_delay_s)
            return incoming.pop(0)
        await asyncio.sleep(3600)
        return {}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive, send) -> None:  # Ray's proxy and the replica, as the client sees them
        seen["scope"] = scope
        for _ in range(1 + len(client)):
            seen["received"].append(await receive())
        await send({"type": "websocket.accept", "headers": [(b"x-cosystream-replica", b"r1")]})
        await send({"type": "websocket.send", "text": '{"type": "started"}'})
        if inner_closes:
            await send({"type": "websocket.close", "code": 1000})

    async def run() -> None:
        if wait_s is not None:
            proxy.WS_FIRST_MESSAGE_WAIT_S, saved = wait_s, proxy.WS_FIRST_MESSAGE_WAIT_S
        try:
            await proxy.VoiceHint(app)({"type": "websocket", "path": "/v1/tts/stream", "headers": []}, receive, send)
        finally:
            if wait_s is not None:
                proxy.WS_FIRST_MESSAGE_WAIT_S = saved

    asyncio.run(run())
    return sent, seen["scope"], seen["received"]


def test_a_websocket_is_routed_by_the_voice_or_recording_of_its_start_message() -> None:
    from cosystream.scale.proxy import LOST_CODE, VOICE_HINT_HEADER, upload_hint

    start = {"type": "start", "voice": "anna", "response_format": "pcm"}
    text = {"type": "websocket.receive", "text": '{"type": "text", "text": "Hello."}'}
    first = {"type": "websocket.receive", "text": json.dumps(start)}
    sent, scope, received = _ws_through_hint([first, text])
    assert dict(scope["headers"])[VOICE_HINT_HEADER] == b"anna"
    assert received == [{"type": "websocket.connect"}, first, text]  # the app sees the whole session, in order
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.close"]  # one accept
    # an uploaded recording announced by `start`: its key, as for a multipart upload
    upload = {"type": "start", "prompt_wav": True, "prompt_text": "the sun rose."}
    recording = {"type": "websocket.receive", "bytes": b"RIFF recording"}
    _, scope, received = _ws_through_hint([{"type": "websocket.receive", "text": json.dumps(upload)}, recording])
    assert dict(scope["headers"])[VOICE_HINT_HEADER] == upload_hint(b"RIFF recording", "the sun rose.").encode()
    assert received[-1] == recording
    # a session the app behind leaves open (its replica died) still ends with the error event and 4503
    sent, _, _ = _ws_through_hint([first], inner_closes=False)
    assert json.loads(sent[-2]["text"])["error"]["code"] == LOST_CODE and sent[-1]["code"] == 4503


def test_a_websocket_without_a_start_in_time_is_routed_by_load_and_loses_nothing() -> None:
    from cosystream.scale.proxy import VOICE_HINT_HEADER

    late = {"type": "websocket.receive", "text": '{"type": "start", "voice": "anna"}'}
    sent, scope, received = _ws_through_hint([late], wait_s=0.05, first_delay_s=0.3)
    assert VOICE_HINT_HEADER not in dict(scope["headers"])
    assert received == [{"type": "websocket.connect"}, late]  # the message that came late still reaches the app
    assert sent[0]["type"] == "websocket.accept" and sent[-1] == {"type": "websocket.close", "code": 1000}
    # a recording announced by `start` that comes late: routed by load, and the app still gets both messages
    announced = {"type": "websocket.receive", "text": '{"type": "start", "prompt_wav": true, "prompt_text": "hi"}'}
    recording = {"type": "websocket.receive", "bytes": b"RIFF"}
    sent, scope, received = _ws_through_hint([announced, recording], wait_s=0.05, first_delay_s=0.0)
    assert VOICE_HINT_HEADER in dict(scope["headers"])  # in time: hinted
    _, late_scope, late_received = _ws_through_hint([announced, recording], wait_s=0.05, first_delay_s=0.3,
                                                    delay_at=1)
    assert VOICE_HINT_HEADER not in dict(late_scope["headers"])
    assert late_received == [{"type": "websocket.connect"}, announced, recording]


def test_the_proxy_carries_the_body_it_read_and_its_arrival_to_the_replica() -> None:
    """The replica answers from the body the proxy read (no call back into the proxy on the request's path): it
    gets the body once, then only what Ray's own receive adds after the copies of the body (the disconnect)."""
    from cosystream.scale.proxy import PROXY_ARRIVAL_KEY, PROXY_BODY_KEY, from_proxy

    body = json.dumps({"text": "Hello.", "voice": "anna"}).encode()
    scope, _ = _hinted(body)
    assert scope[PROXY_BODY_KEY] == body and isinstance(scope[PROXY_ARRIVAL_KEY], float)
    ray_messages = [{"type": "http.request", "body": body[:5], "more_body": True},
                    {"type": "http.request", "body": body[5:], "more_body": False}, {"type": "http.disconnect"}]

    async def ray_receive() -> dict:  # what Ray's replica fetches from the proxy in the background
        return ray_messages.pop(0)

    async def replica() -> tuple[dict, list[dict], float | None]:
        replica_scope, receive, proxy_s = from_proxy(scope, ray_receive, now=lambda: scope[PROXY_ARRIVAL_KEY] + 0.25)
        return replica_scope, [await receive(), await receive()], proxy_s

    replica_scope, received, proxy_s = asyncio.run(replica())
    assert received == [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]
    assert PROXY_BODY_KEY not in replica_scope and proxy_s == pytest.approx(0.25)
    assert from_proxy(scope, ray_receive, now=lambda: scope[PROXY_ARRIVAL_KEY] - 1.0)[2] == 0.0  # skewed clocks
    plain = {"type": "http", "headers": []}  # not through the proxy middleware: left as it is
    assert from_proxy(plain, ray_receive) == (plain, ray_receive, None)


def _ray_receive_proxy():
    """Ray's own receive of a replica (ray.serve's ASGIReceiveProxy), or a skip where the extra is not installed."""
    import os

    try:
        from ray.serve._private.http_util import ASGIReceiveProxy
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":  # the optional extra: CI installs it and must not skip
            raise
        pytest.skip("ray[serve] is not installed")
    return ASGIReceiveProxy


def test_a_replica_given_the_whole_body_does_not_call_back_into_the_proxy() -> None:
    """Ray's receive starts, before the app runs, a task that calls the proxy for the request's messages; with the
    body carried that call is never made (the app still gets the body once), and without it Ray's call stays."""
    from cosystream.scale.proxy import from_proxy

    asgi_receive_proxy = _ray_receive_proxy()
    body = json.dumps({"text": "Hello.", "voice": "anna"}).encode()
    carried, _ = _hinted(body)
    plain = {"type": "http", "method": "POST", "path": "/v1/tts", "headers": []}

    async def replica(scope: dict) -> tuple[list, list[dict]]:
        calls: list = []

        async def call_the_proxy(metadata) -> bytes:  # what Ray's replica does: an actor call to the proxy
            calls.append(metadata)
            if len(calls) > 1:  # the proxy answers the next call when the client leaves
                await asyncio.sleep(3600)
            return pickle.dumps([{"type": "http.request", "body": body, "more_body": False}])

        ray_receive = asgi_receive_proxy(scope, "request metadata", call_the_proxy)
        fetch = asyncio.create_task(ray_receive.fetch_until_disconnect())  # as Ray does, just before the app
        _, receive, _ = from_proxy(scope, ray_receive)
        received = [await receive()]
        await asyncio.sleep(0.05)
        done = fetch.done()
        fetch.cancel()
        assert not done  # spared or not, the task itself ends only when Ray cancels it
        return calls, received

    calls, received = asyncio.run(replica(carried))
    assert calls == [] and received == [{"type": "http.request", "body": body, "more_body": False}]
    calls, received = asyncio.run(replica(plain))
    assert calls == ["request metadata"] * 2 and received[0]["body"] == body  # the body, then the wait


def test_large_or_unfinished_bodies_are_left_to_ray(monkeypatch) -> None:
    from cosystream.scale import proxy

    body = json.dumps({"text": "Hello." * 20, "voice": "anna"}).encode()
    monkeypatch.setattr(proxy, "CARRIED_BODY_MAX_BYTES", len(body) - 1)
    scope, seen_body = _hinted(body)
    assert proxy.PROXY_BODY_KEY not in scope and seen_body == body  # the replica fetches it as usual
    monkeypatch.undo()

    seen: dict = {}
    messages = [{"type": "http.request", "body": body[:5], "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict:
        return messages.pop(0)

    async def app(scope, receive, send) -> None:
        seen["scope"] = scope

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    asyncio.run(proxy.VoiceHint(app)({"type": "http", "method": "POST", "path": "/v1/tts", "headers": headers},
                                     receive, lambda m: None))
    assert proxy.PROXY_BODY_KEY not in seen["scope"]  # the client left mid-body: nothing to carry


def test_the_ledger_counts_streams_sent_and_ended_per_replica_since_a_time() -> None:
    from cosystream.scale.proxy import StreamLedger

    clock = [1000.0]
    ledger = StreamLedger(window_s=10.0, now=lambda: clock[0])
    clock[0] = 1001.0
    ledger.expect("a")
    ledger.expect("b")
    ledger.routed("a", "r1")
    ledger.routed("b", "r1")
    ledger.routed("health-check", "r1")  # not a synthesis request: not counted
    clock[0] = 1002.0
    ledger.ended("a")
    assert ledger.net_since("r1", 1000.5) == 1 and ledger.net_since("r1", 1001.5) == -1
    assert ledger.net_since("r2", 1001.5) == 0
    ledger.routed("b", "r2")  # routed again elsewhere: it left r1
    assert ledger.net_since("r1", 1001.5) == -2 and ledger.net_since("r2", 1001.5) == 1
    ledger.ended("never-routed")  # a request that ended before routing: nothing to count, nothing kept
    assert ledger.net_since("r1", 999.0) is None  # before the ledger started
    clock[0] = 1020.0
    assert ledger.net_since("r1", 1005.0) is None  # further back than its window


def _through_hint_with_router(full: bool, reply_status: int = 200) -> tuple[list[dict], bool, dict]:
    """One JSON /v1/tts request through VoiceHint with a registered router saying `full`: (what the client was
    sent, whether the app behind was called, the scope it got)."""
    from cosystream.scale import proxy

    seen: dict = {}
    body = json.dumps({"text": "Hello.", "voice": "anna"}).encode()
    chunks = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive, send) -> None:
        seen["scope"] = scope
        await send({"type": "http.response.start", "status": reply_status, "headers": []})
        await send({"type": "http.response.body", "body": b"audio", "more_body": False})

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    saved = dict(proxy._refusal_checks)
    proxy._refusal_checks.clear()
    proxy.register_refusal_check("deployment", lambda: full)
    try:
        asyncio.run(proxy.VoiceHint(app)({"type": "http", "method": "POST", "path": "/v1/tts", "headers": headers},
                                         receive, send))
    finally:
        proxy._refusal_checks.clear()
        proxy._refusal_checks.update(saved)
    return sent, "scope" in seen, seen


def test_the_proxy_answers_the_refusal_itself_when_its_router_says_every_replica_is_full() -> None:
    from cosystream.scale import proxy

    sent, called, _ = _through_hint_with_router(full=True)
    assert not called
    assert sent[0]["status"] == 503 and dict(sent[0]["headers"])[b"retry-after"] == b"1"
    assert json.loads(sent[1]["body"]) == {"error": {"code": "overloaded", "message": proxy.OVERLOADED_MESSAGE,
                                                     "field": None}}
    sent, called, seen = _through_hint_with_router(full=False)
    assert called and sent[0]["status"] == 200
    request_id = dict(seen["scope"]["headers"])[proxy.REQUEST_ID_HEADER].decode()  # the id Ray routes it under
    assert request_id not in proxy.LEDGER._expected and request_id not in proxy.LEDGER._replica_of  # ended
    saved = dict(proxy._refusal_checks)
    proxy._refusal_checks.clear()
    try:  # two applications behind one proxy: neither can speak for the other's paths
        proxy.register_refusal_check("one app", lambda: True)
        assert proxy.refused_here()
        proxy.register_refusal_check("another app", lambda: True)
        assert not proxy.refused_here()
    finally:
        proxy._refusal_checks.clear()
        proxy._refusal_checks.update(saved)


def test_streams_through_the_proxy_are_in_the_ledger_from_routing_to_their_last_message() -> None:
    """What the router routes (by the id the proxy put on the request) counts on its replica until the proxy
    forwards the stream's last message, for HTTP and WebSocket alike; the count is back to zero once it ended."""
    import time

    from cosystream.scale import proxy

    since = time.time()  # after the ledger started (at import): it reaches back to here
    seen_during: list[int | None] = []

    def route(scope: dict, replica: str) -> None:  # what EngineAwareRouter.on_request_routed does
        proxy.LEDGER.routed(dict(scope["headers"])[proxy.REQUEST_ID_HEADER].decode(), replica)
        seen_during.append(proxy.LEDGER.net_since(replica, since))

    async def http_app(scope, receive, send) -> None:
        route(scope, "http-replica")
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"audio", "more_body": False})

    body = json.dumps({"text": "Hello."}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    asyncio.run(proxy.VoiceHint(http_app)({"type": "http", "method": "POST", "path": "/v1/tts",
                                           "headers": headers}, receive, send))
    assert seen_during == [1] and proxy.LEDGER.net_since("http-replica", since) == 0

    async def ws_app(scope, receive, send) -> None:
        route(scope, "ws-replica")
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})

    ws_messages = [{"type": "websocket.connect"},
                   {"type": "websocket.receive", "text": '{"type": "start", "voice": "anna"}'}]

    async def ws_receive() -> dict:
        if ws_messages:
            return ws_messages.pop(0)
        await asyncio.sleep(3600)
        return {}

    asyncio.run(proxy.VoiceHint(ws_app)({"type": "websocket", "path": "/v1/tts/stream", "headers": []},
                                        ws_receive, send))
    assert seen_during == [1, 1] and proxy.LEDGER.net_since("ws-replica", since) == 0


def _refusal(code: str = "overloaded") -> list[dict]:
    body = json.dumps({"error": {"code": code, "message": f"{code}: from a replica", "field": None}}).encode()
    return [{"type": "http.response.start", "status": 503,
             "headers": [(b"content-type", b"application/json"), (b"retry-after", b"2")]},
            {"type": "http.response.body", "body": body[:10], "more_body": True},
            {"type": "http.response.body", "body": body[10:], "more_body": False}]


def _through_refusing_replicas(answers: dict[str, list[dict]], retry: bool) -> tuple[list[dict], list[str], set]:
    """One JSON /v1/tts request through VoiceHint in front of a fake Ray proxy that routes each attempt to the
    first replica in `answers` that has not refused the request yet (as EngineAwareRouter ranks them) and replays
    that replica's answer; the registered router says `retry` when asked for a second attempt. Returns (what the
    client was sent, the replicas each attempt went to, the replicas the router was told refused it)."""
    from cosystream.scale import proxy

    body = json.dumps({"text": "Hello.", "voice": "anna"}).encode()
    chunks = [{"type": "http.request", "body": body, "more_body": False}]
    sent, attempts, told = [], [], set()

    async def receive() -> dict:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def ray_proxy(scope, receive, send) -> None:
        request_id = dict(scope["headers"])[proxy.REQUEST_ID_HEADER].decode()
        assert (await receive())["body"] == body  # every attempt gets the whole body
        replica = next(r for r in answers if r not in proxy.LEDGER.refused_by(request_id))
        told.update(proxy.LEDGER.refused_by(request_id))
        attempts.append(replica)
        proxy.LEDGER.routed(request_id, replica)  # what EngineAwareRouter.on_request_routed does
        for message in answers[replica]:
            await send(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    saved = dict(proxy._retry_checks)
    proxy._retry_checks.clear()
    proxy.register_retry_check("deployment", lambda request_id: retry)
    try:
        asyncio.run(proxy.VoiceHint(ray_proxy)({"type": "http", "method": "POST", "path": "/v1/tts",
                                                "headers": headers}, receive, send))
    finally:
        proxy._retry_checks.clear()
        proxy._retry_checks.update(saved)
    return sent, attempts, told


def test_a_refused_request_goes_once_to_another_replica_before_the_client_hears_of_it() -> None:
    import time

    from cosystream.scale import proxy

    since = time.time()
    served = [{"type": "http.response.start", "status": 200, "headers": []},
              {"type": "http.response.body", "body": b"audio", "more_body": False}]
    sent, attempts, told = _through_refusing_replicas({"r1": _refusal(), "r2": served}, retry=True)
    assert attempts == ["r1", "r2"] and told == {"r1"}
    assert sent == served  # the client hears only the replica that served it
    assert proxy.LEDGER.net_since("r1", since) == 0 and proxy.LEDGER.net_since("r2", since) == 0  # both ended
    assert proxy.LEDGER._refused_by == {}  # forgotten once answered
    # every replica refuses: after one retry, the last refusal is the client's, as the replica sent it
    sent, attempts, _ = _through_refusing_replicas({"r1": _refusal(), "r2": _refusal(), "r3": served}, retry=True)
    assert attempts == ["r1", "r2"] and sent == _refusal()
    # no replica that may admit it (the router says so): the first refusal is the client's, at once
    sent, attempts, _ = _through_refusing_replicas({"r1": _refusal(), "r2": served}, retry=False)
    assert attempts == ["r1"] and sent == _refusal()
    # a 503 that is not a refusal (the engine stopped) is not sent elsewhere
    sent, attempts, _ = _through_refusing_replicas({"r1": _refusal("engine_dead"), "r2": served}, retry=True)
    assert attempts == ["r1"] and sent == _refusal("engine_dead")
    assert proxy.LEDGER.net_since("r1", since) == 0 and proxy.LEDGER._refused_by == {}
