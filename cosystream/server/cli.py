"""`cosystream serve`: load a model, warm it up and serve HTTP/WebSocket (wired in cosystream/cli.py).

    cosystream serve --model-dir pretrained_models/CosyVoice2-0.5B --host 0.0.0.0 --port 8000
"""

from __future__ import annotations

import argparse
import sys

from cosystream.errors import CosyStreamError
from cosystream.server.state import ServerSettings

MIB = 1024 * 1024
EXIT_USAGE = 2  # as argparse and `cosystream voices`


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve`; it sets `handler(args) -> exit status` like the other sub-commands."""
    serve = subparsers.add_parser("serve", help="run the HTTP/WebSocket server (OpenAI-compatible speech API)")
    serve.add_argument("--model-dir", required=True, help="CosyVoice2 model directory (official layout)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    serve.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                       help="default: bfloat16 on GPU, float32 on CPU")
    serve.add_argument("--voices-db", default=None, help="voice database (default: $COSYSTREAM_HOME/voices.db)")
    serve.add_argument("--max-streams", type=int, default=None, help="concurrent streams (EngineConfig.max_streams)")
    serve.add_argument("--max-upload-mb", type=float, default=20.0, help="largest request body, MiB (413 above)")
    serve.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                       help="any EngineConfig field, e.g. final_attention=chunk, flow_slots=28, flow_frames=832")
    serve.add_argument("--no-warmup", action="store_true", help="skip CUDA graph capture at start (debugging)")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    serve.set_defaults(handler=run_serve)
    return serve


def run_serve(args: argparse.Namespace) -> int:
    from cosystream.server.app import serve

    settings = ServerSettings(max_upload_bytes=int(args.max_upload_mb * MIB), warmup=not args.no_warmup)
    engine_kwargs: dict = {"max_streams": args.max_streams} if args.max_streams is not None else {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"cosystream serve: error: --config {item!r}: expected FIELD=VALUE",
                  file=sys.stderr)
            return EXIT_USAGE
        engine_kwargs[key] = int(value) if value.lstrip("-").isdigit() else value
    try:
        serve(args.model_dir, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
              voices_db=args.voices_db, settings=settings, log_level=args.log_level, **engine_kwargs)
    except (CosyStreamError, ValueError, TypeError) as exc:  # bad model dir or setting: one line, no traceback
        print(f"cosystream serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0
