"""POST /v1/tts (every engine knob, JSON or multipart with prompt/source wavs) and /v1/voices CRUD.

/v1/tts streams raw audio by default; `?events=sse|ndjson` (or `Accept: text/event-stream` /
`application/x-ndjson`) streams JSON events instead: `audio` chunks (base64), then `done` with the
engine's per-stage timings, which raw HTTP audio has no reliable place for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends, File, Form, Path, Query, Request, Response, UploadFile
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile as StarletteUploadFile

from cosystream.engine.voices import DEFAULT_FAMILY
from cosystream.errors import UnknownVoice
from cosystream.params import Mode, SamplingParams, SynthesisParams
from cosystream.server.errors import ApiError, bad_input, from_validation_errors, to_api_error
from cosystream.server.inputs import (
    MAX_VOICE_NAME_CHARS,
    check_audio_duration,
    check_length,
    check_text,
    check_voice_name,
    decode_json_object,
    is_json,
    media_type,
)
from cosystream.server.openai_speech import AUDIO_RESPONSES
from cosystream.server.protocol import (
    ErrorResponse,
    FinishedRequest,
    Speaker,
    SpeakerList,
    SynthesisOptions,
    TTSRequest,
    Voice,
    VoiceList,
)
from cosystream.server.session import (
    NDJSON_MEDIA_TYPE,
    SSE_MEDIA_TYPE,
    SynthesisSession,
    arrival_time,
    audio_response,
    events_response,
    log_event,
    new_request_id,
)
from cosystream.server.state import client_id, get_state

router = APIRouter()

UPLOAD_FIELDS = ("prompt_wav", "source_wav")
MAX_FORM_FIELDS = 64
TOKENS_PER_S = 25  # speech token rate, for voice durations

_TTS_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/TTSRequest"}},
    "multipart/form-data": {"schema": {"$ref": "#/components/schemas/TTSUpload"}}}}}
# /v1/tts answers like the OpenAI endpoint, and can also stream ndjson events
_TTS_RESPONSES: dict = {**AUDIO_RESPONSES, 200: {**AUDIO_RESPONSES[200], "content": {
    **AUDIO_RESPONSES[200]["content"], NDJSON_MEDIA_TYPE: {}}}}
_VOICE_ERRORS: dict = {
    400: {"model": ErrorResponse, "description": "bad name or unreadable recording"},
    401: {"model": ErrorResponse, "description": "API keys are configured and the bearer token is missing or wrong"},
    404: {"model": ErrorResponse, "description": "no voice of that name"},
    413: {"model": ErrorResponse, "description": "request body over the upload limit"},
    415: {"model": ErrorResponse, "description": "registration needs multipart/form-data"},
}


def options_to_params(opts: SynthesisOptions, text: Any, files: dict[str, bytes], request_id: str) -> SynthesisParams:
    """Protocol options → engine params; shared by /v1/tts and the WebSocket (`text` may be an async iterator)."""
    sampling = SamplingParams(top_p=opts.top_p, top_k=opts.top_k, win_size=opts.win_size, tau_r=opts.tau_r,
                              seed=opts.seed, greedy=opts.greedy)
    return SynthesisParams(
        text=text, mode=opts.mode, voice=opts.voice, prompt_audio=files.get("prompt_wav"), prompt_text=opts.prompt_text,
        instruct_text=opts.instruct_text, source_audio=files.get("source_wav"), sft_speaker=opts.sft_speaker,
        stream=opts.stream, speed=opts.speed, first_hop=opts.first_hop, sampling=sampling,
        force_tokens=opts.force_tokens, request_id=request_id)


async def read_tts_body(request: Request, max_audio_s: float) -> tuple[TTSRequest, dict[str, bytes]]:
    """The TTSRequest from a JSON body or multipart form fields, plus the uploaded files' bytes."""
    content_type = media_type(request)
    files: dict[str, bytes] = {}
    data: dict[str, Any] = {}
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form = await request.form(max_files=len(UPLOAD_FIELDS), max_fields=MAX_FORM_FIELDS)
        for key, value in form.multi_items():
            if isinstance(value, StarletteUploadFile):
                if key not in UPLOAD_FIELDS:
                    raise bad_input(f"{key}: unexpected file (files: {', '.join(UPLOAD_FIELDS)})")
                files[key] = await value.read()
                check_audio_duration(files[key], key, max_audio_s)
            else:
                data[key] = value
    elif is_json(content_type):
        data = decode_json_object(await request.body() or b"{}", "body")
    else:
        raise ApiError(415, "unsupported_media_type", f"content-type {content_type!r}: send application/json "
                       "or multipart/form-data")
    try:
        return TTSRequest.model_validate(data), files
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def expecting_recording(engine: Any, request: Request) -> contextlib.AbstractContextManager[Callable[[], None]]:
    """While a multipart body (which may carry a prompt recording) is read and its request handed over, the
    engine's prompt batcher counts the recording as on its way, so a batch opened by the burst's first uploads
    waits for the rest (engine/prompt_batcher.py). Yields the function that withdraws the announcement."""
    announce = getattr(engine, "expecting_recording", None)  # the AsyncEngine's; other engines batch nothing
    if announce is None or media_type(request) != "multipart/form-data":
        return contextlib.nullcontext(lambda: None)
    return announce()


def check_options(opts: SynthesisOptions, max_chars: int) -> None:
    """What the schema cannot say: voice names and the length of the texts besides `text`."""
    for field in ("voice", "sft_speaker"):
        name = getattr(opts, field)
        if name is not None:
            check_voice_name(name, field)
    for field in ("prompt_text", "instruct_text"):
        check_length(getattr(opts, field), field, max_chars)


EventsParam = Literal["sse", "ndjson", "true", "false", "1", "0", "none"]


def choose_events(events: EventsParam | None, accept: str) -> str | None:
    """'sse', 'ndjson' or None (raw audio) from ?events= and the Accept header."""
    if events is not None:
        return {"ndjson": "ndjson", "sse": "sse", "true": "sse", "1": "sse"}.get(events)
    if SSE_MEDIA_TYPE in accept:
        return "sse"
    return "ndjson" if NDJSON_MEDIA_TYPE in accept else None


@router.post("/v1/tts", tags=["native"], openapi_extra=_TTS_BODY, responses=_TTS_RESPONSES, response_class=Response,
             summary="Text to speech with every engine setting; audio or timing events")
async def tts(request: Request,
              events: EventsParam | None = Query(None, description="sse | ndjson | true (= sse) | false")) -> Response:
    """Synthesise with any mode and voice (registered, or an uploaded prompt_wav + prompt_text).

    Raw audio (`response_format`), or with `events` a stream of `audio` events and a final `done`
    event holding the per-stage timings. `X-Request-Id` names the request in logs either way.
    """
    state = get_state(request)
    state.check_ready()
    events_mode = choose_events(events, request.headers.get("accept", ""))
    with expecting_recording(state.engine, request) as withdraw:
        body, files = await read_tts_body(request, state.settings.max_audio_s)
        if "prompt_wav" not in files:
            withdraw()
        check_options(body, state.max_text_chars)
        if body.mode != Mode.vc:
            check_text(body.text, "text", state.max_text_chars)
        params = options_to_params(body, body.text, files, new_request_id())
        session = SynthesisSession(state, "tts", params, body.response_format, arrival_time(request),
                                   client_id(request))
        await session.open()
    if events_mode is None:
        return audio_response(session)
    return events_response(session, sse=events_mode == "sse")


@router.get("/v1/requests/{request_id}", tags=["native"], response_model=FinishedRequest,
            responses={404: {"model": ErrorResponse, "description": "unknown, still running, or no longer kept"},
                       401: {"model": ErrorResponse, "description": "API keys are configured and the bearer "
                             "token is missing or wrong"}},
            summary="A finished request's stage times (its X-Request-Id)")
async def get_request(request: Request, request_id: str = Path(..., min_length=1, max_length=64)) -> FinishedRequest:
    """Where a finished request's time went: the server's own share (arrival to the engine, to the first audio
    bytes) and the engine's stages. Raw audio responses have no place for them; this is where a client
    (`cosystream bench`) reads them afterwards, outside what it times."""
    state = get_state(request)
    record = state.finished.get(request_id)
    if record is None:
        raise ApiError(404, "request_not_found", f"request {request_id!r} is unknown, still running, or no longer "
                       f"kept (the server keeps the last {state.settings.requests_kept} finished requests)",
                       field="request_id")
    return record


# ---------------------------------------------------------------- voices

def voice_out(info: Any) -> Voice:
    """Engine VoiceInfo (either the engine's or the store's shape) → protocol Voice."""
    tokens = int(getattr(info, "num_prompt_tokens", 0))
    seconds = getattr(info, "prompt_seconds", None)
    return Voice(name=info.name, prompt_text=info.prompt_text, num_prompt_tokens=tokens,
                 prompt_seconds=seconds if seconds is not None else tokens / TOKENS_PER_S,
                 created_at=getattr(info, "created_at", None), family=getattr(info, "family", DEFAULT_FAMILY))


VOICE_NAME_PATH = Path(..., min_length=1, max_length=MAX_VOICE_NAME_CHARS, description="a registered voice")


def require_form(request: Request) -> None:
    """415 for a body that is not a form (FastAPI would report each form field as missing instead)."""
    if media_type(request) not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        raise ApiError(415, "unsupported_media_type", f"content-type {media_type(request)!r}: send "
                       "multipart/form-data with name, prompt_text and the prompt_wav file")


@router.post("/v1/voices", tags=["voices"], status_code=201, response_model=Voice, responses=_VOICE_ERRORS,
             dependencies=[Depends(require_form)],
             summary="Register a voice from a prompt recording and its transcript")
async def add_voice(request: Request, name: str = Form(..., min_length=1, max_length=MAX_VOICE_NAME_CHARS,
                                                      description="1-64 of A-Z a-z 0-9 _ . -"),
                    prompt_text: str = Form("", description="transcript ('' for cross_lingual/instruct2 only)"),
                    prompt_wav: UploadFile = File(..., description="0.5-30 s of speech: wav/flac/mp3/ogg")) -> Voice:
    state = get_state(request)
    state.check_ready()
    check_voice_name(name, "name")
    check_length(prompt_text, "prompt_text", state.max_text_chars)
    audio = await prompt_wav.read()
    if not audio:
        raise bad_input("prompt_wav: empty file")
    check_audio_duration(audio, "prompt_wav", state.settings.max_audio_s)
    info = await state.engine.add_voice(name, audio, prompt_text)
    log_event("voice_added", name=name, num_prompt_tokens=getattr(info, "num_prompt_tokens", ""))
    return voice_out(info)


@router.get("/v1/voices", tags=["voices"], response_model=VoiceList, summary="List registered voices")
async def list_voices(request: Request) -> VoiceList:
    infos = await run_in_threadpool(get_state(request).engine.list_voices)  # SQLite read: off the loop
    return VoiceList(voices=[voice_out(info) for info in infos])


@router.get("/v1/speakers", tags=["voices"], response_model=SpeakerList,
            summary="The model's built-in speakers (spk2info.pt), for mode sft")
async def list_speakers(request: Request) -> SpeakerList:
    table = getattr(getattr(get_state(request).engine, "frontend", None), "speakers", None) or {}
    return SpeakerList(speakers=[Speaker(name=name, zero_shot=getattr(entry, "prompt", None) is not None)
                                 for name, entry in sorted(table.items())])


@router.get("/v1/voices/{name}", tags=["voices"], response_model=Voice, responses=_VOICE_ERRORS,
            summary="One registered voice")
async def get_voice(request: Request, name: str = VOICE_NAME_PATH) -> Voice:
    check_voice_name(name, "name")
    try:
        return voice_out(await run_in_threadpool(get_state(request).engine.get_voice, name))
    except UnknownVoice as exc:
        raise to_api_error(exc, unknown_voice_status=404) from None


@router.delete("/v1/voices/{name}", tags=["voices"], status_code=204, response_class=Response,
               responses=_VOICE_ERRORS, summary="Delete a registered voice")
async def delete_voice(request: Request, name: str = VOICE_NAME_PATH) -> Response:
    check_voice_name(name, "name")
    try:
        await get_state(request).engine.delete_voice(name)
    except UnknownVoice as exc:
        raise to_api_error(exc, unknown_voice_status=404) from None
    log_event("voice_deleted", name=name)
    return Response(status_code=204)
