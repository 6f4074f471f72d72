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
# The engine's admission budget under `cosystream serve`. One second: an H100 gives first audio in ≈ 50 ms
# alone and 115-160 ms p90 at 16 streams (docs/benchmarks.md), so a prediction over a second means the GPU
# is far past what it can keep playing (queues, not computing); a client waiting longer would do better to
# retry elsewhere, while a second still absorbs a burst's first chunks sharing batches.
DEFAULT_FIRST_AUDIO_BUDGET_S = 1.0
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
    serve.add_argument("--no-playground", action="store_true",
                       help="do not serve the web playground at / (docs/playground.md)")
    _add_limit_flags(serve)
    _add_access_flags(serve)
    _add_openai_flags(serve)
    _add_scale_flags(serve)
    serve.set_defaults(handler=run_serve)
    return serve


def _add_limit_flags(serve: argparse.ArgumentParser) -> None:
    limits = serve.add_argument_group("limits (docs/reliability.md)")
    limits.add_argument("--max-upload-mb", type=float, default=_DEFAULTS.max_upload_bytes / MIB,
                        help="largest request body, MiB (413 above)")
    limits.add_argument("--max-audio-s", type=float, default=_DEFAULTS.max_audio_s,
                        help="longest uploaded prompt_wav/source_wav, seconds (400 above)")
    limits.add_argument("--first-audio-budget-s", type=_budget, default=DEFAULT_FIRST_AUDIO_BUDGET_S,
                        metavar="SECONDS|off",
                        help="refuse a new stream (503 overloaded) unless the engine predicts its first audio "
                             f"within this budget with every running stream on time (default: "
                             f"{DEFAULT_FIRST_AUDIO_BUDGET_S:g}; 0 or off: admit every stream)")
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


def _add_scale_flags(serve: argparse.ArgumentParser) -> None:
    scale = serve.add_argument_group("several GPUs (Ray Serve; pip install cosystream[ray]; docs/scaling.md)")
    scale.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="run N engine replicas, one per GPU (CPU: one process each), behind Ray Serve's proxy")
    scale.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="with --replicas: join this Ray cluster (e.g. auto) instead of starting a local one")
    scale.add_argument("--voice-store", default="file", choices=("file", "actor"),
                       help="with --replicas: voices in one SQLite file every replica opens (one machine), or "
                            "behind a named actor on the head node (several machines)")
    scale.add_argument("--ray-access-log", action="store_true",
                       help="with --replicas: also write Ray Serve's access line per request in the replicas (off by "
                            "default: it costs each replica CPU; cosystream logs every request anyway)")


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
        max_streams_per_client=args.max_streams_per_client,
        request_timeout_s=args.request_timeout_s or None, ws_max_message_bytes=int(args.ws_max_message_kb * 1024),
        ws_max_messages_per_s=args.ws_max_messages_per_s, api_keys=api_keys_from(args, environ),
        auth_exempt_paths=tuple(args.auth_exempt) if args.auth_exempt is not None else _DEFAULTS.auth_exempt_paths,
        cors_origins=tuple(args.cors_origin), warmup=not args.no_warmup, requests_kept=args.requests_kept,
        playground=not args.no_playground, default_voice=args.default_voice,
        voice_aliases=voice_aliases_from(args.voice_alias))


def _budget(text: str) -> float | None:
    """--first-audio-budget-s: seconds > 0, or 0 / off (admission off)."""
    if text.strip().lower() in ("off", "none", "0", "0.0"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or off, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds (or 0 / off), got {text!r}")
    return value


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """EngineConfig fields from `serve` flags (--max-streams, --first-audio-budget-s, --config ...); the
    --config items win. ValueError names a bad item."""
    engine_kwargs: dict = {"first_audio_budget_s": args.first_audio_budget_s}
    if args.max_streams is not None:
        engine_kwargs["max_streams"] = args.max_streams
    engine_kwargs.update(config_overrides(args.config))
    return engine_kwargs


def model_name(model: str) -> str:
    """What GET /v1/models calls the model: a hub id as given, a directory by its name."""
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def run_serve(args: argparse.Namespace) -> int:
    from cosystream.server.app import serve

    try:
        engine_kwargs = engine_kwargs_from_args(args)
    except ValueError as exc:
        print(f"cosystream serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.replicas is not None:
        return _run_replicas(args, engine_kwargs)
    try:
        settings = replace(settings_from_args(args), model_id=model_name(args.model_dir))
        serve(args.model_dir, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
              voices_db=args.voices_db, settings=settings, log_level=args.log_level, **engine_kwargs)
    except (CosyStreamError, ValueError, TypeError, OSError) as exc:  # bad model dir or setting: one line
        print(f"cosystream serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _run_replicas(args: argparse.Namespace, engine_kwargs: dict) -> int:
    """`serve --replicas N`: the same server, N engine replicas on Ray Serve (cosystream/scale/ray_app.py)."""
    try:
        from cosystream.scale.ray_app import ReplicaSpec, serve_replicas
    except ImportError as exc:
        print(f"cosystream serve: error: --replicas needs Ray Serve ({exc}); pip install 'cosystream[ray]'",
              file=sys.stderr)
        return EXIT_USAGE
    from cosystream.server.app import configure_logging

    try:
        if args.replicas < 1:
            raise ValueError(f"--replicas: must be at least 1, got {args.replicas}")
        if not Path(args.model_dir).is_dir():
            raise ValueError(f"--model-dir: no such directory: {args.model_dir}")
        voices_db = args.voices_db
        if voices_db is not None:
            voices_db = str(Path(voices_db).expanduser().resolve())
        elif args.voice_store == "file":  # every replica opens the file this machine's default names
            from cosystream.engine.voices import default_db_path

            voices_db = str(default_db_path())
        spec = ReplicaSpec(model_dir=str(Path(args.model_dir).resolve()), device=args.device, dtype=args.dtype,
                           voice_store=args.voice_store, voices_db=voices_db, engine_kwargs=engine_kwargs,
                           settings=settings_from_args(args), log_level=args.log_level)
        configure_logging(args.log_level)
        serve_replicas(spec, args.replicas, args.host, args.port, ray_address=args.ray_address,
                       ray_access_log=args.ray_access_log)
    except (CosyStreamError, ValueError, TypeError, OSError) as exc:
        print(f"cosystream serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0
