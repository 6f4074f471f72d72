"""POST /v1/audio/speech: the OpenAI speech endpoint (thin: parse → params → engine → encode).

The OpenAI SDK works unchanged against it (`client.audio.speech.create`, `with_streaming_response`).
`voice` is a voice registered with POST /v1/voices, or a name `serve --voice-alias` maps to one; OpenAI's own
voice names (alloy, echo, ...) speak in `serve --default-voice`. `instructions` switches to instruct2 mode.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from cosystream.errors import UnknownVoice
from cosystream.params import Mode, SamplingParams, SynthesisParams
from cosystream.server.encode import MEDIA_TYPES
from cosystream.server.errors import HTTP_VOICES_HINT, bad_input, from_validation_errors
from cosystream.server.inputs import check_length, check_text, check_voice_name, read_json_object
from cosystream.server.protocol import ErrorResponse, SpeechRequest
from cosystream.server.session import (
    SSE_MEDIA_TYPE,
    SynthesisSession,
    arrival_time,
    audio_response,
    new_request_id,
    openai_sse_response,
)
from cosystream.server.state import ServerState, client_id, get_state

router = APIRouter(tags=["OpenAI-compatible"])

AUDIO_RESPONSES: dict = {
    200: {"description": "the audio, streamed as it is produced (chunked transfer)",
          "content": {**{media: {} for media in MEDIA_TYPES.values()}, SSE_MEDIA_TYPE: {}}},
    400: {"model": ErrorResponse, "description": "bad input (text, voice, format, speed, ...)"},
    401: {"model": ErrorResponse, "description": "API keys are configured and the bearer token is missing or wrong"},
    413: {"model": ErrorResponse, "description": "request body over the upload limit"},
    415: {"model": ErrorResponse, "description": "a body that is not JSON (or, on /v1/tts, not a form)"},
    429: {"model": ErrorResponse, "description": "too many streams open for this client; see Retry-After"},
    503: {"model": ErrorResponse, "description": "overloaded or warming up; see Retry-After"},
    504: {"model": ErrorResponse, "description": "the request timed out before its first audio"},
}
_SPEECH_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/SpeechRequest"}}}}}


async def read_speech_request(request: Request) -> SpeechRequest:
    # read by hand rather than as a FastAPI body parameter: a wrong media type is then 415, not a 400
    # about a missing object, and JSON errors name the body like on every other endpoint
    data = await read_json_object(request)
    try:
        return SpeechRequest.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


# OpenAI's built-in voice names: clients send them as they are; `serve --default-voice` speaks them
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx",
                           "sage", "shimmer", "verse"})


def _is_registered(engine: Any, name: str) -> bool:
    try:
        engine.get_voice(name)
    except UnknownVoice:
        return False
    return True


def resolve_voice(state: ServerState, name: str) -> str:
    """The registered voice a request's `voice` names: an alias (`--voice-alias`) first, then the name itself;
    an OpenAI voice name that is not registered is the default voice (`--default-voice`). Other unknown names
    stay as they are, so the engine answers unknown_voice for them (a typo is not silently replaced)."""
    aliases = dict(state.settings.voice_aliases)
    if name in aliases:
        return aliases[name]
    if name not in OPENAI_VOICES or _is_registered(state.engine, name):
        return name
    if state.settings.default_voice is None:
        raise bad_input(f"voice: no voice named {name!r}: OpenAI's voice names need a voice of that name "
                        "(POST /v1/voices) or a server started with --default-voice or --voice-alias "
                        f"{name}=VOICE{HTTP_VOICES_HINT}", code="unknown_voice")
    return state.settings.default_voice


def to_params(body: SpeechRequest, request_id: str, max_text_chars: int, voice: str | None = None
              ) -> SynthesisParams:
    """Engine parameters of one speech request; `voice` is the resolved registered voice (default: body's)."""
    check_text(body.input, "input", max_text_chars)
    check_voice_name(body.voice, "voice")
    voice = voice or body.voice
    check_length(body.instructions or "", "instructions", max_text_chars)
    # speed != 1 is an offline transform in the model, so it needs the non-streaming path
    stream = body.stream if body.stream is not None else body.speed == 1.0
    return SynthesisParams(
        text=body.input, mode=Mode.instruct2 if body.instructions else Mode.zero_shot, voice=voice,
        instruct_text=body.instructions or "", stream=stream, speed=body.speed, request_id=request_id,
        sampling=SamplingParams(seed=body.seed), force_tokens=body.force_tokens)


@router.post("/v1/audio/speech", responses=AUDIO_RESPONSES, response_class=Response, openapi_extra=_SPEECH_BODY,
             summary="Text to speech (OpenAI audio.speech.create)")
async def create_speech(request: Request) -> Response:
    """Speak `input` in a registered `voice`; audio bytes are sent as each chunk is synthesised.

    `stream_format="sse"` answers with OpenAI's `speech.audio.delta` / `speech.audio.done` events instead.
    """
    state = get_state(request)
    state.check_ready()
    body = await read_speech_request(request)
    params = to_params(body, new_request_id(), state.max_text_chars, resolve_voice(state, body.voice))
    session = SynthesisSession(state, "speech", params, body.response_format, arrival_time(request),
                               client_id(request))
    await session.open()
    if body.stream_format == "sse":
        return openai_sse_response(session, len(body.input))
    return audio_response(session)
