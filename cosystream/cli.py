"""The `cosystream` command: serve | say | voices | bench | make-random-model.

Every user error prints one line naming the file or flag and exits with status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from cosystream.errors import CosyStreamError


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")


def add_model_flag(p: argparse.ArgumentParser) -> None:
    from cosystream.checkpoint.hub import DEFAULT_MODEL_ID

    p.add_argument("--model-dir", "--model", dest="model_dir", default=DEFAULT_MODEL_ID, metavar="DIR_OR_ID",
                   help="a model directory (official layout) or a hub id, downloaded once into the Hugging Face "
                        "cache (default: %(default)s)")


def show_progress_logs() -> None:
    """Print the engine's loading lines (what loads, how long it took) on stderr while a command runs."""
    logger = logging.getLogger("cosystream")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(relativeCreated)7.0f ms  %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time (a handler holding the stream would outlive a redirect)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _check_say_inputs(args: argparse.Namespace) -> None:
    """What can be checked in a second, before the model load: the model name, the files and the voice."""
    from cosystream.checkpoint.hub import DEFAULT_MODEL_ID, is_model_id

    if not Path(args.model_dir).expanduser().is_dir() and not is_model_id(args.model_dir):
        raise CosyStreamError(f"--model-dir: no directory {args.model_dir}, and it is not a model id like "
                              f"{DEFAULT_MODEL_ID}")
    if args.prompt_wav and not Path(args.prompt_wav).is_file():
        raise CosyStreamError(f"--prompt-wav: no such file: {args.prompt_wav}")
    out_dir = Path(args.output).expanduser().resolve().parent
    if not out_dir.is_dir():
        raise CosyStreamError(f"-o/--output: no directory {out_dir} to write {args.output} in")
    if args.voice:
        from cosystream.engine.voices import VoiceStore

        with VoiceStore(getattr(args, "db", None)) as store:
            if args.voice not in store:
                raise CosyStreamError(f"--voice: no voice named {args.voice!r} in {store.path} "
                                      "(see `cosystream voices list`)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    kwargs = {"device": device, "dtype": dtype}
    if getattr(args, "db", None):
        kwargs["voices_db"] = args.db
    return kwargs


def _add_say(sub) -> None:
    p = sub.add_parser("say", help="synthesise one text to a wav file and print the timings")
    p.add_argument("text")
    _add_engine_flags(p)
    voice = p.add_mutually_exclusive_group(required=True)
    voice.add_argument("--voice", help="a registered voice name")
    voice.add_argument("--prompt-wav", help="a prompt recording (0.5-30 s)")
    p.add_argument("--prompt-text", default="", help="the prompt recording's transcript")
    p.add_argument("--db", help="voice store (default: $COSYSTREAM_HOME/voices.db)")
    p.add_argument("--mode", default="zero_shot", choices=["zero_shot", "cross_lingual", "instruct2"])
    p.add_argument("--instruct", default="", help="instruct2: the instruction")
    p.add_argument("-o", "--output", required=True, help="output wav (24 kHz)")
    p.add_argument("--stream", action="store_true", help="stream chunks (prints when each arrives)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--force-tokens", type=int, default=None, help="benchmark: generate exactly N tokens")
    p.set_defaults(func=_run_say)


def _run_say(args: argparse.Namespace) -> int:
    import numpy as np
    import soundfile as sf

    from cosystream.engine.sync_engine import Engine
    from cosystream.params import Mode, SamplingParams, SynthesisParams

    _check_say_inputs(args)
    show_progress_logs()
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model_dir, **_engine_kwargs(args))
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    params = SynthesisParams(text=args.text, mode=Mode(args.mode), voice=args.voice, prompt_audio=args.prompt_wav,
                             prompt_text=args.prompt_text, instruct_text=args.instruct, stream=args.stream,
                             sampling=SamplingParams(seed=args.seed), force_tokens=args.force_tokens)
    try:
        pieces, times = [], None
        t_start = time.perf_counter()
        for chunk in engine.stream(params):
            pieces.append(chunk.pcm)
            if args.stream:
                arrived_ms = (time.perf_counter() - t_start) * 1000
                print(f"chunk {chunk.index}: {chunk.pcm.shape[0] / chunk.sample_rate:.2f} s of audio, "
                      f"arrived {arrived_ms:.0f} ms after the request")
            times = chunk.times or times
        sf.write(args.output, np.concatenate(pieces), 24000, subtype="PCM_16")
    finally:
        engine.close()
    print(f"wrote {args.output}")
    if times is not None:
        for key, value in times.as_dict().items():
            print(f"  {key:>22}: {value}")
    return 0


def _add_make_random_model(sub) -> None:
    p = sub.add_parser("make-random-model", help="write a random-weight model dir in the official layout")
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--family", default="cosyvoice2", choices=["cosyvoice2", "cosyvoice3"])
    p.add_argument("--size", default="tiny", choices=["tiny", "0.5b"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side-models", default="standin", choices=["standin", "realistic"],
                   help="speech tokenizer and CAM++: tiny stand-ins with the official interfaces (default), or "
                        "the released architectures at their released size with random weights (≈ 0.5 GB for "
                        "v2, 1 GB for v3; to measure the prompt analysis on a GPU)")
    p.set_defaults(func=_run_make_random_model)


def _run_make_random_model(args: argparse.Namespace) -> int:
    from cosystream.testing.random_model import random_checkpoint
    from cosystream.testing.random_model_cv3 import random_checkpoint_cv3

    write = random_checkpoint_cv3 if args.family == "cosyvoice3" else random_checkpoint
    try:
        out = write(args.out, args.size, args.seed)
    except FileExistsError as e:
        raise CosyStreamError(f"OUT: {e}") from e
    name = "CosyVoice3" if args.family == "cosyvoice3" else "CosyVoice2"
    if args.side_models == "realistic":
        from cosystream.testing.realistic_side_models import replace_side_models

        replace_side_models(out, "full", args.seed)
    print(f"wrote a random {args.size} {name} model to {out} ({args.side_models} side models)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosystream", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_say(sub)
    _add_make_random_model(sub)
    from cosystream.cli_voices import add_parser as add_voices

    add_voices(sub)
    for module, name in (("cosystream.server.cli", "add_serve_parser"), ("cosystream.bench.cli", "add_bench_parser")):
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError:  # an optional part missing from a partial install
            continue
        getattr(mod, name)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "func", None) or getattr(args, "handler", None)
    if run is None:
        parser.error(f"{args.command}: missing sub-command")
    try:
        return int(run(args) or 0)
    except CosyStreamError as e:
        print(f"cosystream {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
