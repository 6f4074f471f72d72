"""Pydantic schemas of every endpoint and WebSocket message (they generate the OpenAPI document).

Wire names follow OpenAI where an OpenAI endpoint exists (`input`, `voice`, `response_format`) and
the engine's SynthesisParams elsewhere (`text`, `mode`, `first_hop`, ...). docs/server.md has examples.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cosystream.params import Mode
from cosystream.server.encode import AudioFormat

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range; the engine allows speed != 1 only with stream=false
# Upper bounds on sampling knobs: far beyond any useful value (the speech vocabulary has 6,561 tokens),
# low enough that no value overflows the engine's int64/float32 tensors.
MAX_TOP_K, MAX_WIN_SIZE, MAX_TAU_R = 10_000, 1_000, 100.0


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine code: bad_input, unknown_voice, voice_exists, payload_too_large, "
                                  "unsupported_media_type, unauthorized, too_many_streams, rate_limited, "
                                  "overloaded, deadline_exceeded, timeout, engine_dead, not_ready, not_found, "
                                  "internal, ...")
    message: str = Field(description="human-readable; starts with the field name when one input is at fault")
    field: str | None = Field(None, description="the offending input field, when there is one")


class ErrorResponse(BaseModel):
    """The body of every non-2xx response, and of WebSocket/stream `error` events."""

    error: ErrorDetail


# ---------------------------------------------------------------- OpenAI: POST /v1/audio/speech

class SpeechRequest(BaseModel):
    """OpenAI `audio.speech.create` body. `model` is accepted and ignored (one model is served)."""

    # newer OpenAI SDK fields must not break old servers; NaN/inf are never a meaningful number here
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field("cosyvoice2", description="ignored; any value is accepted")
    input: str = Field(..., min_length=1, description="the text to speak")
    voice: str = Field(..., description="a registered voice (POST /v1/voices), a name the server aliases to one "
                                         "(serve --voice-alias), or an OpenAI voice name (serve --default-voice)")
    instructions: str | None = Field(None, description="style instruction: switches to instruct2 mode")
    response_format: AudioFormat = AudioFormat.mp3
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED,
                         description="playback speed; != 1 renders offline (stream=false) then sends")
    stream: bool | None = Field(None, description="cosystream extension: engine chunked streaming "
                                                  "(default: true unless speed != 1)")
    stream_format: Literal["audio", "sse"] = Field("audio", description="sse: OpenAI speech.audio.delta events")
    # cosystream extensions (OpenAI SDK: extra_body={...})
    seed: int | None = Field(None, ge=0, lt=2**31, description="cosystream extension: sampling seed")
    force_tokens: int | None = Field(None, ge=1, le=4000, description="cosystream extension (benchmarks): "
                                                                      "exactly this many speech tokens")


# ---------------------------------------------------------------- native: POST /v1/tts, WS /v1/tts/stream

class SynthesisOptions(BaseModel):
    """Every per-request knob of the engine (cosystream.params.SynthesisParams), flat."""

    # a misspelt knob must fail, not be silently dropped; NaN/inf are never a meaningful number here
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Mode = Mode.zero_shot
    voice: str | None = Field(None, description="registered voice; or upload prompt_wav + prompt_text")
    prompt_text: str = Field("", description="transcript of an uploaded prompt_wav")
    instruct_text: str = Field("", description="instruct2: the instruction, e.g. 'Speak happily.'")
    sft_speaker: str | None = Field(None, description="sft: a built-in speaker id of spk2info.pt")
    response_format: AudioFormat = AudioFormat.wav
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED, description="!= 1 needs stream=false")
    stream: bool = Field(True, description="engine chunked streaming; false renders the whole audio first")
    first_hop: int | None = Field(None, ge=1, le=100, description="speech tokens in the first chunk")
    force_tokens: int | None = Field(None, ge=1, le=4000,
                                     description="benchmarks: exactly this many speech tokens (960 samples each)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=MAX_TOP_K)
    win_size: int | None = Field(None, ge=1, le=MAX_WIN_SIZE, description="RAS repetition window")
    tau_r: float | None = Field(None, ge=0.0, le=MAX_TAU_R, description="RAS repetition threshold")
    seed: int | None = Field(None, ge=0, lt=2**31)
    greedy: bool = False


class TTSRequest(SynthesisOptions):
    """POST /v1/tts as JSON, or as multipart form fields plus files `prompt_wav` / `source_wav`."""

    text: str = Field("", description="what to say (empty only for mode=vc)")


class TTSUpload(TTSRequest):
    """The multipart/form-data variant of TTSRequest (documentation schema)."""

    prompt_wav: bytes | None = Field(None, json_schema_extra={"format": "binary"},
                                     description="prompt recording (wav/flac/mp3/ogg) for an unregistered voice")
    source_wav: bytes | None = Field(None, json_schema_extra={"format": "binary"},
                                     description="vc: the speech to convert")


class StageTimes(BaseModel):
    """Per-request engine timings in seconds (cosystream.outputs.StageTimes)."""

    model_config = ConfigDict(extra="allow")  # the engine may add stages

    queue_s: float = 0.0
    frontend_s: float = 0.0
    prompt_s: float = Field(0.0, description="of frontend_s: the voice made ready (a new recording: its decoding, "
                                             "analysis and transcript)")
    prompt_analysis_s: float = Field(0.0, description="of prompt_s: the recording's batched analysis on the GPU, "
                                                      "the wait for its batch included (0: none, or on the CPU)")
    llm_prefill_s: float = 0.0
    first_token_s: float = 0.0
    first_chunk_ready_s: float = 0.0
    first_chunk_start_s: float = 0.0
    first_chunk_flow_s: float = 0.0
    first_chunk_vocoder_s: float = 0.0
    first_audio_s: float = 0.0
    total_s: float = 0.0
    num_tokens: int = 0
    audio_s: float = 0.0
    rtf: float | None = None
    predicted_first_audio_s: float | None = Field(
        None, description="the engine admission's prediction of first_audio_s (null: admission off)")
    predicted_first_chunk_start_s: float | None = Field(
        None, description="... of first_chunk_start_s: when its tokens and a flow slot are there (null: not "
                          "predicted)")


class StartedEvent(BaseModel):
    type: Literal["started"] = "started"
    request_id: str
    sample_rate: int
    response_format: AudioFormat


class AudioEvent(BaseModel):
    """One audio chunk of an event stream: the next bytes of the response_format file, base64."""

    type: Literal["audio"] = "audio"
    index: int
    audio: str = Field(description="base64 of the next encoded bytes (concatenate all to get the file)")
    num_samples: int
    elapsed_s: float = Field(description="seconds since the request arrived")


class ChunkEvent(BaseModel):
    """WebSocket: describes the binary frame sent just before it."""

    type: Literal["chunk"] = "chunk"
    index: int
    num_samples: int
    num_bytes: int
    elapsed_s: float


class DoneEvent(BaseModel):
    type: Literal["done"] = "done"
    request_id: str
    num_chunks: int
    num_samples: int
    audio_s: float
    times: StageTimes
    server_first_audio_s: float | None = Field(None, description="request arrival → first audio bytes sent")


class FinishedRequest(BaseModel):
    """A finished synthesis request as the server saw it (GET /v1/requests/{request_id})."""

    request_id: str
    endpoint: str = Field(description="tts | openai | ws")
    outcome: str = Field(description="ok, cancelled, or the error code that ended it")
    num_chunks: int
    audio_s: float
    to_engine_s: float | None = Field(None, description="request arrival → handed to the engine (parsing, checks, "
                                      "admission)")
    proxy_s: float | None = Field(None, description="behind Ray Serve's proxy (`serve --replicas`): its share of "
                                  "to_engine_s, the proxy's arrival → the replica's (routing, transport); null on "
                                  "the single-process server")
    server_first_audio_s: float | None = Field(None, description="request arrival → first audio bytes sent")
    server_total_s: float = Field(description="request arrival → the request closed")
    times: StageTimes | None = Field(None, description="the engine's stages, from its submission (requests that "
                                     "finished with audio)")


class ErrorEvent(ErrorResponse):
    type: Literal["error"] = "error"


class WsStart(SynthesisOptions):
    """WebSocket first message. `text` may hold the whole text; otherwise send `text` messages."""

    type: Literal["start"]
    text: str = ""
    response_format: AudioFormat = AudioFormat.pcm
    prompt_wav: bool = Field(False, description="zero-shot without a registered voice: the next message is one "
                                                "binary frame holding the prompt recording (wav/flac/mp3/ogg); "
                                                "give its transcript as prompt_text")


class WsText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class WsEnd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["end"]


# ---------------------------------------------------------------- voices

class Voice(BaseModel):
    name: str
    prompt_text: str
    num_prompt_tokens: int = Field(description="25 Hz speech tokens of the prompt")
    prompt_seconds: float
    created_at: float | None = Field(None, description="unix seconds")
    family: str = Field(description="the model family whose frontend analysed the prompt (cosyvoice2 or "
                                    "cosyvoice3): the voice serves models of that family only")


class VoiceList(BaseModel):
    voices: list[Voice]


class Speaker(BaseModel):
    name: str
    zero_shot: bool = Field(description="true: the entry holds a prompt, so it also works as `voice` (zero_shot, "
                                        "cross_lingual, instruct2); false: sft only")


class SpeakerList(BaseModel):
    """The model's built-in speakers (spk2info.pt): `sft_speaker` values of mode sft. Empty: no sft."""

    speakers: list[Speaker]


class Health(BaseModel):
    status: Literal["ok", "starting"]


# Schemas not reachable from a route signature, added to the OpenAPI components by app.py.
EXTRA_SCHEMAS: tuple[type[BaseModel], ...] = (
    SpeechRequest, TTSRequest, TTSUpload, StartedEvent, AudioEvent, ChunkEvent, DoneEvent, ErrorEvent, WsStart,
    WsText, WsEnd)
