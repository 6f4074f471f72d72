"""The standard benchmark workload: one fixed voice prompt, one target text, 250 forced speech tokens.

Every number in docs/benchmarks.md uses this workload, so it is fixed here and generated deterministically
(no binary in the repo):

- prompt audio: 6.00 s of a synthetic voiced signal (harmonic tone with a pitch contour, a syllable-rate
  amplitude envelope and a little seeded noise). 6.00 s = 600 whisper frames at 16 kHz -> 150 prompt speech
  tokens (25 Hz), and 300 prompt mel frames (50 Hz) at 24 kHz. It only has to be valid audio of that length.
- prompt text: 20 text tokens; target text: 40 text tokens. Token counts are those of the model's tokenizer.
  The random models of `cosystream make-random-model` (cosystream/testing/random_model.py) use a byte-level
  BPE without merges, so plain ASCII has one token per character: both texts are lowercase letters, spaces
  and one final period, exactly 20 and 40 characters, with no digits (the English normaliser leaves them
  unchanged). With the real Qwen tokenizer the counts are smaller; the forced length below is what matters.
- FORCE_TOKENS = 250 generated speech tokens = 10.00 s of 24 kHz audio (960 samples per token).
- the official chunk schedule (`cosystream.config.ChunkSchedule()`: first hop 25 padded to the 25-token
  block, then x2 up to 100). With 150 prompt tokens the padding is zero.

    python benchmarks/workload.py OUT_DIR   # writes OUT_DIR/voice.wav and OUT_DIR/workload.json
    cosystream bench --workload OUT_DIR/workload.json --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import wave
from pathlib import Path

import numpy as np

from cosystream.config import ChunkSchedule

VOICE_NAME = "bench_voice"
PROMPT_TEXT = "the sun rose slowly."  # 20 characters = 20 tokens (byte-level BPE, no merges)
TARGET_TEXT = "a quiet river flows past the green mill."  # 40 characters = 40 tokens
FORCE_TOKENS = 250  # generated speech tokens: 250 / 25 Hz = 10.00 s of audio
SCHEDULE = ChunkSchedule()  # the official streaming schedule

PROMPT_SECONDS = 6.00
PROMPT_SAMPLE_RATE = 24000  # the frontend resamples to 16 kHz for the tokenizer; 24 kHz is the flow's rate
PROMPT_NUM_TOKENS = 150  # 25 speech tokens per second
PROMPT_NUM_MEL_FRAMES = 300  # 50 mel frames per second
SAMPLES_PER_TOKEN = 960  # 24 kHz output samples per speech token
SEED = 20240601


def synth_voice(sample_rate: int = PROMPT_SAMPLE_RATE, seconds: float = PROMPT_SECONDS,
                seed: int = SEED) -> np.ndarray:
    """A deterministic voiced-speech-like signal, float32 [round(seconds * sample_rate)] in [-1, 1]."""
    num_samples = round(seconds * sample_rate)
    t = np.arange(num_samples, dtype=np.float64) / sample_rate
    # pitch glides 110-170 Hz like a sentence's intonation; phase is the integral of frequency
    f0 = 140.0 + 30.0 * np.sin(2 * np.pi * 0.35 * t) - 10.0 * t / seconds
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    harmonics = sum(np.sin(k * phase) / k for k in range(1, 13) if k * f0.max() < sample_rate / 2)
    # ~4 syllables per second, with short pauses, and 50 ms fades so the file starts and ends quietly
    syllables = np.clip(np.sin(2 * np.pi * 2.0 * t) ** 2 * 1.4 - 0.2, 0.0, 1.0)
    fade = np.clip(np.minimum(t, seconds - t) / 0.05, 0.0, 1.0)
    noise = np.random.default_rng(seed).standard_normal(num_samples) * 0.01
    signal = (harmonics * syllables + noise) * fade
    return (0.5 * signal / np.abs(signal).max()).astype(np.float32)


def write_workload_wav(path: str | Path, sample_rate: int = PROMPT_SAMPLE_RATE,
                       seconds: float = PROMPT_SECONDS) -> Path:
    """Write the prompt (6.00 s unless told) as 16-bit PCM mono wav; the same bytes on every run."""
    pcm16 = np.round(synth_voice(sample_rate, seconds) * 32767).astype("<i2")
    path = Path(path)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm16.tobytes())
    return path


def workload_dict(prompt_wav: str | Path) -> dict[str, object]:
    """The workload in the JSON form `cosystream bench --workload` reads."""
    return {"texts": [TARGET_TEXT], "voice": VOICE_NAME, "prompt_text": PROMPT_TEXT,
            "prompt_wav": str(prompt_wav), "force_tokens": FORCE_TOKENS}


def write_workload(out_dir: str | Path, prompt_seconds: float = PROMPT_SECONDS) -> Path:
    """Write voice.wav and workload.json into `out_dir`; return the json's path. A prompt_seconds other than
    6.00 makes a variant (e.g. a prompt longer than a flow-pool slot), not the standard workload."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wav = write_workload_wav(out / "voice.wav", seconds=prompt_seconds)
    path = out / "workload.json"
    path.write_text(json.dumps(workload_dict(wav.resolve()), indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder for voice.wav and workload.json")
    parser.add_argument("--prompt-seconds", type=float, default=PROMPT_SECONDS,
                        help="prompt length (default: the standard 6.00 s)")
    args = parser.parse_args(argv)
    if args.prompt_seconds <= 0:
        parser.error(f"--prompt-seconds: must be > 0, got {args.prompt_seconds}")
    print(write_workload(args.out_dir, args.prompt_seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
