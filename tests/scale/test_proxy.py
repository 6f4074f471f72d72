"""The proxy middleware that ends a stream whose replica died (scale/proxy.py), on fake ASGI apps."""

from __future__ import annotations

import asyncio
import json

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
