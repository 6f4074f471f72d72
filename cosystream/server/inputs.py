"""Checks on what clients send, shared by the endpoints: request bodies, text, voice names, uploaded audio.

Each failure is an ApiError naming the field (400 bad_input, 415 unsupported_media_type), so hostile
or broken input never reaches the engine as something it has to reject with a 500.
docs/reliability.md#hostile-input lists them.
"""

from __future__ import annotations

import io
import json
from typing import Any

import soundfile as sf
from starlette.requests import Request

from cosystream.engine.voices import MAX_VOICE_NAME_CHARS, voice_name_problem  # noqa: F401 (routes use it)
from cosystream.server.errors import ApiError, bad_input

JSON_MEDIA_TYPE = "application/json"


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def is_json(content_type: str) -> bool:
    """JSON, or no Content-Type at all (clients that omit it send JSON in practice)."""
    return content_type in (JSON_MEDIA_TYPE, "") or content_type.endswith("+json")


async def read_json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object: 415 for another media type, 400 for anything that is not one JSON object."""
    content_type = media_type(request)
    if not is_json(content_type):
        raise ApiError(415, "unsupported_media_type", f"content-type {content_type!r}: send {JSON_MEDIA_TYPE}")
    return decode_json_object(await request.body() or b"{}", "body")


def decode_json_object(raw: bytes | str, field: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_input(f"{field}: not valid UTF-8") from None
    except RecursionError:  # json recurses once per nesting level
        raise bad_input(f"{field}: JSON nested too deeply") from None
    except ValueError as exc:  # also int() of more than 4300 digits
        raise bad_input(f"{field}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise bad_input(f"{field}: expected a JSON object")
    return data


def check_text(text: str, field: str, max_chars: int) -> None:
    if not text.strip():
        raise bad_input(f"{field}: empty")
    check_length(text, field, max_chars)


def check_length(text: str, field: str, max_chars: int) -> None:
    if len(text) > max_chars:
        raise bad_input(f"{field}: {len(text)} characters, more than the limit of {max_chars}")


def check_voice_name(name: str, field: str) -> None:
    """The engine's voice-name rule (engine/voices.py voice_name_problem), as a 400 naming `field`."""
    problem = voice_name_problem(name)
    if problem is not None:
        raise bad_input(f"{field}: {name!r} is not a valid voice name: {problem}")


def check_audio_duration(data: bytes, field: str, max_s: float) -> None:
    """Refuse an upload longer than `max_s` from its header alone, before anything decodes it. A file the
    header reader cannot open passes: the engine's decoder then reports it with the precise reason."""
    try:
        info = sf.info(io.BytesIO(data))
    except Exception:  # libsndfile raises several types for junk; the engine's decoder names the problem
        return
    if info.samplerate > 0 and info.frames / info.samplerate > max_s:
        raise bad_input(f"{field}: {info.frames / info.samplerate:.1f} s of audio, more than the limit of {max_s:g} s")
