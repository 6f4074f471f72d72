"""POST /v1/audio/speech: the OpenAI speech endpoint (thin: parse → params → engine → encode).

The OpenAI SDK works unchanged against it (`client.audio.speech.create`, `with_streaming_response`).
`voice` is a voice registered with POST /v1/voices; `instructions` switches to instruct2 mode.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from cosystream.params import Mode, SamplingParams, SynthesisParams
from cosystream.server.encode import MEDIA_TYPES
from cosystream.server.protocol import ErrorResponse, SpeechRequest
from cosystream.server.session import (
    SSE_MEDIA_TYPE,
    AudioStreamResponse,
    SynthesisSession,
    arrival_time,
    audio_response,
    check_text,
    new_request_id,
    openai_sse_body,
)
from cosystream.server.state import get_state

router = APIRouter(tags=["OpenAI-compatible"])

AUDIO_RESPONSES: dict = {
    200: {"description": "the audio, streamed as it is produced (chunked transfer)",
          "content": {**{media: {} for media in MEDIA_TYPES.values()}, SSE_MEDIA_TYPE: {}}},
    400: {"model": ErrorResponse, "description": "bad input (text, voice, format, speed, ...)"},
    413: {"model": ErrorResponse, "description": "request body over the upload limit"},
    503: {"model": ErrorResponse, "description": "overloaded or warming up; see Retry-After"},
}


def to_params(body: SpeechRequest, request_id: str, max_text_chars: int) -> SynthesisParams:
    check_text(body.input, "input", max_text_chars)
    # speed != 1 is an offline transform in the model, so it needs the non-streaming path
    stream = body.stream if body.stream is not None else body.speed == 1.0
    return SynthesisParams(
        text=body.input, mode=Mode.instruct2 if body.instructions else Mode.zero_shot, voice=body.voice,
        instruct_text=body.instructions or "", stream=stream, speed=body.speed, request_id=request_id,
        sampling=SamplingParams(seed=body.seed), force_tokens=body.force_tokens)


@router.post("/v1/audio/speech", responses=AUDIO_RESPONSES, response_class=Response,
             summary="Text to speech (OpenAI audio.speech.create)")
async def create_speech(body: SpeechRequest, request: Request) -> Response:
    """Speak `input` in a registered `voice`; audio bytes are sent as each chunk is synthesised.

    `stream_format="sse"` answers with OpenAI's `speech.audio.delta` / `speech.audio.done` events instead.
    """
    state = get_state(request)
    state.check_ready()
    params = to_params(body, new_request_id(), state.max_text_chars)
    session = SynthesisSession(state, "speech", params, body.response_format, arrival_time(request))
    await session.open()
    if body.stream_format == "sse":
        return AudioStreamResponse(openai_sse_body(session, len(body.input)), media_type=SSE_MEDIA_TYPE,
                                   headers={"X-Request-Id": session.request_id})
    return audio_response(session)
