"""`cosystream voices add|list|delete`: register prompt voices once, reuse them from every request.

    cosystream voices add alice --model-dir pretrained_models/CosyVoice2-0.5B \
        --prompt-wav alice.wav --prompt-text "What alice says in the recording."
    cosystream voices list
    cosystream voices delete alice

The store defaults to $COSYSTREAM_HOME/voices.db, else ~/.cache/cosystream/voices.db (--db
overrides). Errors print one line naming the flag and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from cosystream.errors import CosyStreamError

EXIT_USAGE = 2  # argparse's status for bad arguments; ours for any unusable input
MAX_LISTED_TEXT = 48  # characters of the transcript shown by `list`

# Fields named in BadInput messages -> the flag the user typed.
_FLAG_OF_FIELD = {"prompt_wav": "--prompt-wav", "prompt_text": "--prompt-text", "db": "--db", "name": "NAME",
                  "voice": "NAME", "model": "--model-dir"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `voices` and its sub-commands; each sets `handler(args) -> exit status`."""
    from cosystream.cli import add_model_flag

    voices = subparsers.add_parser("voices", help="register, list and delete prompt voices")
    commands = voices.add_subparsers(dest="voices_command", required=True, metavar="{add,list,delete}")

    add = commands.add_parser("add", help="analyse a prompt recording and store it under NAME")
    add.add_argument("name", metavar="NAME", help="1-64 characters from A-Z a-z 0-9 _ . -")
    add_model_flag(add)
    add.add_argument("--prompt-wav", required=True, help="prompt recording: wav/flac/mp3/ogg, 0.5-30 s")
    add.add_argument("--prompt-text", required=True, help="transcript of the recording ('' for none)")
    add.add_argument("--device", default="cpu", help="onnxruntime device for the prompt models (cpu, cuda:N)")
    add.set_defaults(handler=_guarded(run_add))

    listing = commands.add_parser("list", help="show the registered voices")
    listing.set_defaults(handler=_guarded(run_list))

    delete = commands.add_parser("delete", help="remove a voice")
    delete.add_argument("name", metavar="NAME")
    delete.set_defaults(handler=_guarded(run_delete))

    for command in (add, listing, delete):
        command.add_argument("--db", default=None, help="voice database (default: $COSYSTREAM_HOME/voices.db)")
    return voices


def run_add(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cosystream.checkpoint import load_checkpoint
    from cosystream.checkpoint.hub import DEFAULT_MODEL_ID, is_model_id, resolve_model
    from cosystream.cli import show_progress_logs
    from cosystream.engine.load_log import loading
    from cosystream.engine.voices import VoiceStore, check_voice_name
    from cosystream.errors import CheckpointError, VoiceExists
    from cosystream.frontend import Frontend

    check_voice_name(args.name)
    if not Path(args.model_dir).expanduser().is_dir() and not is_model_id(args.model_dir):  # before the slow load
        raise CosyStreamError(f"model: no directory {args.model_dir}, and it is not a model id like {DEFAULT_MODEL_ID}")
    if not Path(args.prompt_wav).is_file():
        raise CosyStreamError(f"prompt_wav: no such file: {args.prompt_wav}")
    with VoiceStore(args.db) as store:
        if args.name in store:  # before the slow analysis
            raise VoiceExists(f"name: a voice named {args.name!r} already exists in {store.path}")
        show_progress_logs()
        try:
            with loading(f"checkpoint {args.model_dir} (yaml, files)"):
                checkpoint = load_checkpoint(resolve_model(args.model_dir))
        except CheckpointError as exc:
            raise CheckpointError(f"--model-dir: {exc}") from None
        with loading("frontend (tokenizer, ONNX speaker and speech-token models)"):
            frontend = Frontend(checkpoint, device=args.device)
        with loading(f"prompt analysis of {args.prompt_wav}"):
            prompt = frontend.make_voice_prompt(args.prompt_wav, args.prompt_text)
        info = store.add(args.name, prompt, args.prompt_text)
        print(f"added voice {info.name!r} ({info.prompt_seconds:.1f} s of prompt) to {store.path}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from cosystream.engine.voices import VoiceStore

    with VoiceStore(args.db) as store:
        voices = store.list()
        if not voices:
            print(f"no voices in {store.path}")
            return 0
        width = max(len("NAME"), *(len(v.name) for v in voices))
        print(f"{'NAME':<{width}}  FAMILY      PROMPT_S  CREATED           PROMPT_TEXT")
        for voice in voices:
            created = time.strftime("%Y-%m-%d %H:%M", time.localtime(voice.created_at))
            text = voice.prompt_text if len(voice.prompt_text) <= MAX_LISTED_TEXT else \
                voice.prompt_text[: MAX_LISTED_TEXT - 3] + "..."
            print(f"{voice.name:<{width}}  {voice.family:<10}  {voice.prompt_seconds:8.1f}  {created}  {text}")
    return 0


def run_delete(args: argparse.Namespace) -> int:
    from cosystream.engine.voices import VoiceStore

    with VoiceStore(args.db) as store:
        store.delete(args.name)
        print(f"deleted voice {args.name!r} from {store.path}")
    return 0


def _guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn our errors into one line on stderr and exit status 2, never a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except CosyStreamError as exc:
            print(f"cosystream voices {args.voices_command}: error: {_with_flag(str(exc))}", file=sys.stderr)
            return EXIT_USAGE

    return run


def _with_flag(message: str) -> str:
    field, sep, rest = message.partition(": ")
    return f"{_FLAG_OF_FIELD[field]}: {rest}" if sep and field in _FLAG_OF_FIELD else message
