"""`cosystream serve`: load a model, warm it up and serve HTTP/WebSocket (wired in cosystream/cli.py).

    cosystream serve --model-dir pretrained_models/CosyVoice2-0.5B --host 0.0.0.0 --port 8000
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from cosystream.config import config_overrides
from cosystream.errors import CosyStreamError
from cosystream.server.state import ServerSettings

MIB = 1024 * 1024
EXIT_USAGE = 2  # as argparse and `cosystream voices`
API_KEYS_ENV = "COSYSTREAM_API_KEYS"  # comma-separated; keeps keys out of the process list
_DEFAULTS = ServerSettings()
# the default model (cosystream.checkpoint.hub.DEFAULT_MODEL_ID; the server layer does not import checkpoint)
DEFAULT_MODEL = "FunAudioLLM/CosyVoice2-0.5B"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve`; it sets `handler(args) -> exit status` like the other sub-commands."""
    serve = subparsers.add_parser("serve", help="run the HTTP/WebSocket server (OpenAI-compatible speech API)")
    serve.add_argument("--model-dir", "--model", dest="model_dir", default=DEFAULT_MODEL, metavar="DIR_OR_ID",
                       help="a model directory (official layout) or a hub id, downloaded once into the Hugging "
                            "Face cache (default: %(default)s)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="bind address; 0.0.0.0 for every interface (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    serve.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    serve.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                       help="default: bfloat16 on GPU, float32 on CPU")
    serve.add_argument("--voices-db", default=None, help="voice database (default: $COSYSTREAM_HOME/voices.db)")
    serve.add_argument("--max-streams", type=int, default=None, help="concurrent streams (EngineConfig.max_streams)")
    serve.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                       help="any EngineConfig field, e.g. final_attention=chunk, flow_slots=28, flow_frames=832")
    serve.add_argument("--no-warmup", action="store_true", help="skip CUDA graph capture at start (debugging)")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    _add_limit_flags(serve)
    _add_access_flags(serve)
    _add_openai_flags(serve)
    serve.set_defaults(handler=run_serve)
    return serve


def _add_limit_flags(serve: argparse.ArgumentParser) -> None:
    limits = serve.add_argument_group("limits (docs/reliability.md)")
    limits.add_argument("--max-upload-mb", type=float, default=_DEFAULTS.max_upload_bytes / MIB,
                        help="largest request body, MiB (413 above)")
    limits.add_argument("--max-audio-s", type=float, default=_DEFAULTS.max_audio_s,
                        help="longest uploaded prompt_wav/source_wav, seconds (400 above)")
    limits.add_argument("--first-audio-budget-s", type=float, default=None,
                        help="refuse new streams (503 overloaded) whose expected first audio is later (default: off)")
    limits.add_argument("--max-streams-per-client", type=int, default=None,
                        help="open streams per API key, or per address without keys (429 above; default: off)")
    limits.add_argument("--request-timeout-s", type=float, default=_DEFAULTS.request_timeout_s,
                        help="longest synthesis request, arrival to last byte (504 / close 4504); 0: none")
    limits.add_argument("--ws-max-message-kb", type=float, default=_DEFAULTS.ws_max_message_bytes / 1024,
                        help="largest WebSocket client message, KiB (close 4413 above)")
    limits.add_argument("--requests-kept", type=int, default=_DEFAULTS.requests_kept,
                        help="finished requests whose stage times GET /v1/requests/{id} answers (oldest dropped)")
    limits.add_argument("--ws-max-messages-per-s", type=float, default=_DEFAULTS.ws_max_messages_per_s,
                        help="sustained WebSocket client message rate (close 4429 above)")


def _add_access_flags(serve: argparse.ArgumentParser) -> None:
    access = serve.add_argument_group("access")
    access.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"accept this bearer token (repeatable; also ${API_KEYS_ENV}=k1,k2 or --api-keys-file); "
                             "any key set turns authentication on")
    access.add_argument("--api-keys-file", default=None, metavar="PATH", help="bearer tokens, one per line")
    access.add_argument("--auth-exempt", action="append", default=None, metavar="PATH",
                        help="a path that needs no key (repeatable; default: /health and /ready)")
    access.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="allow browser calls from this origin, e.g. https://app.example.com, or * (repeatable)")


def _add_openai_flags(serve: argparse.ArgumentParser) -> None:
    openai = serve.add_argument_group("OpenAI clients (/v1/audio/speech)")
    openai.add_argument("--default-voice", default=None, metavar="VOICE",
                        help="registered voice that speaks OpenAI's voice names (alloy, echo, nova, ...) when no "
                             "voice of that name is registered")
    openai.add_argument("--voice-alias", action="append", default=[], metavar="NAME=VOICE",
                        help="a request's voice NAME speaks in registered VOICE, e.g. alloy=alice (repeatable)")


def voice_aliases_from(values: list[str]) -> tuple[tuple[str, str], ...]:
    """(name, voice) pairs from --voice-alias NAME=VOICE values; ValueError naming the flag for a bad one."""
    pairs = []
    for value in values:
        name, sep, voice = value.partition("=")
        if not sep or not name.strip() or not voice.strip():
            raise ValueError(f"--voice-alias: expected NAME=VOICE, got {value!r}")
        pairs.append((name.strip(), voice.strip()))
    return tuple(pairs)


def api_keys_from(args: argparse.Namespace, environ: dict[str, str] | os._Environ = os.environ) -> frozenset[str]:
    keys = [*args.api_key, *environ.get(API_KEYS_ENV, "").split(",")]
    if args.api_keys_file:
        keys += Path(args.api_keys_file).read_text().splitlines()
    return frozenset(key.strip() for key in keys if key.strip())


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | os._Environ = os.environ
                       ) -> ServerSettings:
    """ServerSettings from `serve` flags and the environment; ValueError for an impossible value."""
    return ServerSettings(
        max_upload_bytes=int(args.max_upload_mb * MIB), max_audio_s=args.max_audio_s,
        first_audio_budget_s=args.first_audio_budget_s, max_streams_per_client=args.max_streams_per_client,
        request_timeout_s=args.request_timeout_s or None, ws_max_message_bytes=int(args.ws_max_message_kb * 1024),
        ws_max_messages_per_s=args.ws_max_messages_per_s, api_keys=api_keys_from(args, environ),
        auth_exempt_paths=tuple(args.auth_exempt) if args.auth_exempt is not None else _DEFAULTS.auth_exempt_paths,
        cors_origins=tuple(args.cors_origin), warmup=not args.no_warmup, requests_kept=args.requests_kept,
        default_voice=args.default_voice, voice_aliases=voice_aliases_from(args.voice_alias))


def model_name(model: str) -> str:
    """What GET /v1/models calls the model: a hub id as given, a directory by its name."""
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def run_serve(args: argparse.Namespace) -> int:
    from cosystream.server.app import serve

    engine_kwargs: dict = {"max_streams": args.max_streams} if args.max_streams is not None else {}
    try:
        engine_kwargs.update(config_overrides(args.config))
    except ValueError as exc:
        print(f"cosystream serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        settings = replace(settings_from_args(args), model_id=model_name(args.model_dir))
        serve(args.model_dir, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
              voices_db=args.voices_db, settings=settings, log_level=args.log_level, **engine_kwargs)
    except (CosyStreamError, ValueError, TypeError, OSError) as exc:  # bad model dir or setting: one line
        print(f"cosystream serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0
