"""Prompt analysis per prompt: the ONNX path vs the torch path (frontend/torch_prompt.py), unbatched and batched,
and what bf16/fp16 change in the tokens and x-vectors against the ONNX (float32) results.

    python benchmarks/prompt_analysis.py --model-dir MODEL_DIR --device cuda \
        [--seconds 6] [--batch-sizes 1,4,16] [--dtypes float32,bfloat16,float16] [--speaker-threads 8] \
        [--repeats 5] [--out FILE.json]

Prompts are synthetic voiced signals of `--seconds` (each one a little longer than the one before,
`--jitter-ms`, so every batch holds distinct lengths as real traffic does; 0 gives equal lengths) at
`--rate` Hz, decoded and resampled before timing: the times are the analysis alone (features,
speech tokenizer, CAM++, prompt mel), as the engine's batcher runs it; batch 1 is the unbatched time,
and the ONNX time is the engine's CPU path for one prompt. A model directory needs its
yaml, `speech_tokenizer_v*.onnx` and `campplus.onnx` (CosyVoice2 or CosyVoice3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cosystream.checkpoint.hparams import _mel_dims, _Reader, read_hyperpyyaml
from cosystream.frontend.audio import PromptAudio, prepare_prompt_audio, prompt_mel
from cosystream.frontend.speaker import SpeakerEncoder
from cosystream.frontend.speech_tokenizer import SpeechTokenizer
from cosystream.frontend.torch_prompt import PromptAnalysis, TorchPromptAnalyzer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def synthetic_prompts(count: int, seconds: float, jitter_ms: float, rate: int, flow_rate: int) -> list[PromptAudio]:
    """Voiced, syllable-modulated signals with distinct pitch contours; prompt i is i*jitter longer."""
    prompts = []
    for i in range(count):
        n = int((seconds + i * jitter_ms / 1000) * rate)
        t = np.arange(n) / rate
        pitch = 100 + 15 * i % 90 + 30 * np.sin(2 * np.pi * (0.5 + 0.1 * i) * t)
        phase = 2 * np.pi * np.cumsum(pitch) / rate
        voiced = sum(np.sin(k * phase) / k for k in range(1, 10))
        envelope = 0.5 * (1 + np.sin(2 * np.pi * (3.5 + 0.2 * i) * t))
        noise = np.random.default_rng(i).normal(0, 0.01, n)
        prompts.append(prepare_prompt_audio(((0.2 * voiced * envelope + noise).astype(np.float32), rate), flow_rate))
    return prompts


def model_files(model_dir: Path) -> tuple[Path, Path, Any]:
    yaml_path = next(model_dir.glob("cosyvoice*.yaml"))
    hp = read_hyperpyyaml(yaml_path, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})
    return next(model_dir.glob("speech_tokenizer_v*.onnx")), model_dir / "campplus.onnx", _mel_dims(_Reader(
        yaml_path.name, hp))


def onnx_analysis(tokenizer: SpeechTokenizer, speaker: SpeakerEncoder, mel_dims: Any,
                  prompt: PromptAudio) -> PromptAnalysis:
    """The engine's CPU path (Frontend.make_voice_prompt without the transcript)."""
    return PromptAnalysis(tokens=tokenizer.tokenize(prompt.wav_16k), mel=prompt_mel(prompt.wav_24k, mel_dims),
                          xvector=speaker.embed(prompt.wav_16k))


def timed_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of `fn` in ms (results come back on the CPU, so the device work is included)."""
    fn()  # warm-up: kernels, cuFFT plans, allocator
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def parts_ms(analyzer: TorchPromptAnalyzer, prompts: Sequence[PromptAudio], repeats: int) -> dict[str, float]:
    """Per prompt, in the largest batch: speech tokens, x-vectors and prompt mels timed apart (each synchronised
    by its copy back to the CPU), to show which part dominates."""
    wavs_16k = [p.wav_16k for p in prompts]
    wavs_24k = [p.wav_24k for p in prompts]
    return {"tokens": timed_ms(lambda: analyzer.tokenize(wavs_16k), repeats) / len(prompts),
            "xvector": timed_ms(lambda: analyzer.embed(wavs_16k), repeats) / len(prompts),
            "mel": timed_ms(lambda: analyzer.mels(wavs_24k), repeats) / len(prompts)}


def agreement(reference: Sequence[PromptAnalysis], results: Sequence[PromptAnalysis]) -> dict[str, float]:
    equal_tokens = total_tokens = prompts_equal = 0
    xvector_diff, cosine = 0.0, 1.0
    for ref, res in zip(reference, results, strict=True):
        same_len = ref.tokens.shape == res.tokens.shape
        matches = int((ref.tokens == res.tokens).sum()) if same_len else 0
        equal_tokens += matches
        total_tokens += ref.tokens.numel()
        prompts_equal += int(same_len and matches == ref.tokens.numel())
        xvector_diff = max(xvector_diff, float((ref.xvector - res.xvector).abs().max()))
        cosine = min(cosine, float(torch.nn.functional.cosine_similarity(ref.xvector, res.xvector, dim=0)))
    return {"token_agreement": equal_tokens / max(total_tokens, 1), "prompts_all_tokens_equal": prompts_equal,
            "prompts": len(reference), "xvector_max_abs_diff": xvector_diff, "xvector_min_cosine": cosine}


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer_path, campplus_path, mel_dims = model_files(Path(args.model_dir))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = synthetic_prompts(max(batch_sizes), args.seconds, args.jitter_ms, args.rate, mel_dims.sampling_rate)
    onnx_tok, onnx_spk = SpeechTokenizer(tokenizer_path), SpeakerEncoder(campplus_path)
    reference = [onnx_analysis(onnx_tok, onnx_spk, mel_dims, p) for p in prompts]
    report: dict[str, Any] = {"device": args.device, "seconds": args.seconds, "jitter_ms": args.jitter_ms,
                              "model_dir": str(args.model_dir), "dtypes": {}}
    report["onnx_cpu_ms_per_prompt"] = timed_ms(lambda: onnx_analysis(onnx_tok, onnx_spk, mel_dims, prompts[0]),
                                                args.repeats)
    variants = [(name, 0) for name in args.dtypes.split(",")]
    if args.speaker_threads > 0:
        variants += [(name, args.speaker_threads) for name in args.dtypes.split(",")]
    for name, threads in variants:
        analyzer = TorchPromptAnalyzer(tokenizer_path, campplus_path, mel_dims, args.device, DTYPES[name],
                                       speaker_threads=threads)
        entry: dict[str, Any] = {"tokenizer_batch_mode": analyzer.tokenizer.mode,
                                 "speaker_batch_mode": analyzer.speaker_mode}
        for size in batch_sizes:  # batch 1 is the unbatched analysis
            batch = prompts[:size]
            entry[f"batch{size}_ms_per_prompt"] = timed_ms(lambda a=analyzer, b=batch: a.analyse(b),
                                                           args.repeats) / size
        entry["parts_ms_per_prompt"] = parts_ms(analyzer, prompts[:max(batch_sizes)], args.repeats)
        entry.update(agreement(reference, analyzer.analyse(prompts)))
        report["dtypes"][name if threads == 0 else f"{name}+campplus_cpu{threads}"] = entry
        analyzer.close()
    return report


def print_report(report: dict[str, Any]) -> None:
    print(f"device {report['device']}, {report['seconds']} s prompts (+{report['jitter_ms']} ms each); "
          f"ONNX on the CPU: {report['onnx_cpu_ms_per_prompt']:.1f} ms per prompt")
    for name, entry in report["dtypes"].items():
        times = ", ".join(f"{k.removesuffix('_ms_per_prompt')} {v:.2f}" for k, v in entry.items()
                          if k.startswith("batch"))
        parts = ", ".join(f"{k} {v:.2f}" for k, v in entry["parts_ms_per_prompt"].items())
        times += f" (largest batch: {parts})"
        print(f"  {name}: ms per prompt: {times}; modes {entry['tokenizer_batch_mode']}/{entry['speaker_batch_mode']}")
        print(f"    vs ONNX: tokens {entry['token_agreement']:.4%} equal, {entry['prompts_all_tokens_equal']}/"
              f"{entry['prompts']} prompts all equal; x-vector max |diff| {entry['xvector_max_abs_diff']:.2e}, "
              f"min cosine {entry['xvector_min_cosine']:.6f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--jitter-ms", type=float, default=37.0)
    p.add_argument("--rate", type=int, default=24000, help="sample rate of the synthetic recordings")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--speaker-threads", type=int, default=8,
                   help="also time CAM++ on onnxruntime on the CPU, this many prompts at once (0: skip)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="write the report as JSON here")
    return p


def main() -> None:
    args = build_parser().parse_args()
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            build_parser().error(f"--dtypes: {name!r} is not one of {', '.join(DTYPES)}")
    report = run(args)
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
