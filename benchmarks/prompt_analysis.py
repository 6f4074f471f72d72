"""Prompt analysis per prompt: the ONNX path vs the torch path (frontend/torch_prompt.py), unbatched and batched,
and what bf16/fp16 change in the tokens and x-vectors against the ONNX (float32) results.

    python benchmarks/prompt_analysis.py --model-dir MODEL_DIR --device cuda \
        [--seconds 6] [--batch-sizes 1,4,16] [--dtypes float32,bfloat16,float16] [--speaker-threads 8] \
        [--graph-threads 4] [--compare-unfolded] [--compare-interpreter] [--repeats 5] [--out FILE.json]

Prompts are synthetic voiced signals of `--seconds` (each one a little longer than the one before,
`--jitter-ms`, so every batch holds distinct lengths as real traffic does; 0 gives equal lengths) at
`--rate` Hz, decoded and resampled before timing: the times are the analysis alone (features,
speech tokenizer, CAM++, prompt mel), as the engine's batcher runs it; batch 1 is the unbatched time,
and the ONNX time is the engine's CPU path for one prompt. A model directory needs its
yaml, `speech_tokenizer_v*.onnx` and `campplus.onnx` (CosyVoice2 or CosyVoice3).

Every timed call gets prompts of lengths not seen before (each cut 10 ms shorter than in any earlier
call), as real traffic with a new recording in each request: the torch runner folds its shape
arithmetic per input shape, and a repeated shape would time only its cached path. The same batch
repeated is reported beside it (`cached_shapes`). Per graph, the report gives the operator calls one
call ran (new length / cached shape / without folding) and, on CUDA, the host synchronisations of one
analysis of the largest batch (counted by torch's sync debug mode; the copies of the results back to
the CPU are among them). `--compare-unfolded` also times float32 with every node interpreted on every
call (the runner without shape folding). `--graph-threads N` also times float32 with CAM++'s calls (one
per distinct prompt length) on N threads at once, each on its own CUDA stream.

CAM++ runs as the batched network of `frontend/campplus.py` (every prompt of a batch in one call) where the
graph is the released architecture and the network reproduces it at load (`speaker_batch_mode`
`campplus_module`; otherwise `speaker_fallback` says why, and the graph runs through the interpreter; the
network runs in float32 only; on CUDA its calls are padded to shape buckets and replayed as CUDA graphs, every
bucket captured when the analyzer is built, so the timed calls are replays). `--compare-interpreter` also times
float32 with CAM++ on the interpreter (`fast_campplus=False`). For the network the report gives the torch operator
calls of one call (views included) for one prompt and for the largest batch.
"""

from __future__ import annotations

import argparse
import itertools
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
from cosystream.testing.host_syncs import recorded_host_syncs

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


class NewLengths:
    """Prompts cut shorter by one more 10 ms step at each call: every call meets input shapes not seen before."""

    def __init__(self) -> None:
        self._steps = itertools.count(1)

    def __call__(self, prompts: Sequence[PromptAudio]) -> list[PromptAudio]:
        cut = next(self._steps)
        return [PromptAudio(p.samples[: p.samples.numel() - cut * p.sample_rate // 100], p.sample_rate,
                            p.flow_sample_rate) for p in prompts]


def timed_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of `fn` in ms (results come back on the CPU, so the device work is included)."""
    fn()  # warm-up: kernels, cuFFT plans, allocator
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def timed_new_ms(fn: Callable[[Sequence[PromptAudio]], Any], prompts: Sequence[PromptAudio], fresh: NewLengths,
                 repeats: int) -> float:
    """Median wall time of `fn` in ms, each call (warm-up included) on prompts of lengths not seen before; the
    cutting is outside the timed region."""
    fn(fresh(prompts))
    samples = []
    for _ in range(repeats):
        batch = fresh(prompts)
        t0 = time.perf_counter()
        fn(batch)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def parts_ms(analyzer: TorchPromptAnalyzer, prompts: Sequence[PromptAudio], fresh: NewLengths,
             repeats: int) -> dict[str, float]:
    """Per prompt, in the largest batch of new lengths: speech tokens, x-vectors and prompt mels timed apart (each
    synchronised by its copy back to the CPU), to show which part dominates."""
    def wavs_16k(batch: Sequence[PromptAudio]) -> list[torch.Tensor]:
        return [p.wav_16k for p in batch]

    parts = {"tokens": lambda b: analyzer.tokenize(wavs_16k(b)), "xvector": lambda b: analyzer.embed(wavs_16k(b)),
             "mel": lambda b: analyzer.mels([p.wav_24k for p in b])}
    return {name: timed_new_ms(fn, prompts, fresh, repeats) / len(prompts) for name, fn in parts.items()}


def graph_ops(analyzer: TorchPromptAnalyzer, prompts: Sequence[PromptAudio], fresh: NewLengths) -> dict[str, Any]:
    """Operator calls of one call of each interpreted graph, for one prompt: a new length, then the same length
    again; for the batched CAM++ network, its torch operator calls for one prompt and for all of `prompts`."""
    graphs = {"speech_tokenizer": analyzer.tokenizer.graph}
    if analyzer.speaker is not None and analyzer.fast_speaker is None:
        graphs["campplus"] = analyzer.speaker.graph
    batch = fresh(prompts[:1])
    report: dict[str, Any] = {}
    for label in ("new_length", "cached_shape"):
        analyzer.analyse(batch)
        for name, graph in graphs.items():
            entry = report.setdefault(name, dict(graph.node_counts))
            entry[f"ops_{label}"] = graph.stats.ops_run  # 0 for a CUDA-graph replay (no operator on the host)
            entry[f"replayed_{label}"] = graph.stats.replayed
    if analyzer.fast_speaker is not None:
        report["campplus_module"] = {"torch_ops_one_prompt": torch_ops(lambda: analyzer.embed([batch[0].wav_16k])),
                                     f"torch_ops_batch{len(prompts)}": torch_ops(
                                         lambda: analyzer.embed([p.wav_16k for p in fresh(prompts)]))}
    return report


def torch_ops(fn: Callable[[], Any]) -> int:
    """Torch operator calls (views included) `fn` makes, the features and copies back included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def host_syncs(analyzer: TorchPromptAnalyzer, prompts: Sequence[PromptAudio]) -> int | None:
    """Synchronisations of the host with the GPU in one analysis (torch's sync debug mode), None off CUDA."""
    if analyzer.device.type != "cuda":
        return None
    with recorded_host_syncs() as syncs:
        analyzer.analyse(prompts)
    return len(syncs)


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
    fresh = NewLengths()
    # (dtype, CAM++ CPU threads, shape folding, graph call threads, CAM++ path: "network" where the graph allows,
    # or "interpreter")
    variants = [(name, 0, True, 1, "network") for name in args.dtypes.split(",")]
    if args.speaker_threads > 0:
        variants += [(name, args.speaker_threads, True, 1, "network") for name in args.dtypes.split(",")]
    if args.compare_unfolded:
        variants.append(("float32", 0, False, 1, "interpreter"))
    if args.graph_threads > 1:
        variants.append(("float32", 0, True, args.graph_threads, "interpreter"))
    if args.compare_interpreter:
        variants.append(("float32", 0, True, 1, "interpreter"))
    for name, threads, fold, graph_threads, campplus in variants:
        analyzer = TorchPromptAnalyzer(tokenizer_path, campplus_path, mel_dims, args.device, DTYPES[name],
                                       speaker_threads=threads, fold_shapes=fold, graph_threads=graph_threads,
                                       fast_campplus=campplus != "interpreter")
        entry = measure(analyzer, prompts, batch_sizes, fresh, args.repeats)
        entry.update(agreement(reference, analyzer.analyse(prompts)))
        label = name if threads == 0 else f"{name}+campplus_cpu{threads}"
        label += "" if fold else "_unfolded"
        label += "" if graph_threads == 1 else f"+graph_threads{graph_threads}"
        plain = threads == 0 and fold and graph_threads == 1
        label += f"+campplus_{campplus}" if plain and campplus != "network" else ""
        report["dtypes"][label] = entry
        analyzer.close()
    return report


def measure(analyzer: TorchPromptAnalyzer, prompts: Sequence[PromptAudio], batch_sizes: Sequence[int],
            fresh: NewLengths, repeats: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"tokenizer_batch_mode": analyzer.tokenizer.mode,
                             "speaker_batch_mode": analyzer.speaker_mode,
                             "speaker_fallback": analyzer.speaker_fallback}
    for size in batch_sizes:  # batch 1 is the unbatched analysis
        batch = prompts[:size]
        entry[f"batch{size}_ms_per_prompt"] = timed_new_ms(analyzer.analyse, batch, fresh, repeats) / size
    for size in batch_sizes:
        batch = prompts[:size]
        entry[f"batch{size}_cached_shapes_ms_per_prompt"] = timed_ms(lambda b=batch: analyzer.analyse(b),
                                                                     repeats) / size
    largest = prompts[:max(batch_sizes)]
    entry["parts_ms_per_prompt"] = parts_ms(analyzer, largest, fresh, repeats)
    entry["graph_ops_per_call"] = graph_ops(analyzer, prompts, fresh)
    entry["host_syncs_largest_batch"] = host_syncs(analyzer, fresh(largest))
    return entry


def print_report(report: dict[str, Any]) -> None:
    print(f"device {report['device']}, {report['seconds']} s prompts (+{report['jitter_ms']} ms each); "
          f"ONNX on the CPU: {report['onnx_cpu_ms_per_prompt']:.1f} ms per prompt")
    for name, entry in report["dtypes"].items():
        times = ", ".join(f"{k.removesuffix('_ms_per_prompt')} {v:.2f}" for k, v in entry.items()
                          if k.startswith("batch") and "cached" not in k)
        cached = ", ".join(f"{k.removesuffix('_cached_shapes_ms_per_prompt')} {v:.2f}" for k, v in entry.items()
                           if k.endswith("_cached_shapes_ms_per_prompt"))
        parts = ", ".join(f"{k} {v:.2f}" for k, v in entry["parts_ms_per_prompt"].items())
        times += f" (largest batch: {parts})"
        print(f"  {name}: ms per prompt, new lengths: {times}; modes {entry['tokenizer_batch_mode']}/"
              f"{entry['speaker_batch_mode']}")
        print(f"    repeated batch (cached shapes): {cached}; host syncs in one largest batch: "
              f"{entry['host_syncs_largest_batch']}")
        for graph, ops in entry["graph_ops_per_call"].items():
            if graph == "campplus_module":
                print(f"    {graph}: torch operator calls per call: " + ", ".join(f"{k.removeprefix('torch_ops_')} {v}"
                                                                             for k, v in ops.items()))
                continue
            replays = " (CUDA-graph replays)" if ops.get("replayed_new_length") else ""
            print(f"    {graph}: operator calls per call: new length {ops['ops_new_length']}, cached shape "
                  f"{ops['ops_cached_shape']}{replays} (plan {ops['plan']} nodes, compute {ops['compute']})")
        if entry["speaker_fallback"]:
            print(f"    CAM++ not on the batched network: {entry['speaker_fallback']}")
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
    p.add_argument("--graph-threads", type=int, default=0,
                   help="also time float32 with CAM++'s calls on this many threads at once (0 or 1: skip)")
    p.add_argument("--compare-interpreter", action="store_true",
                   help="also time float32 with CAM++ on the ONNX interpreter instead of the batched network")
    p.add_argument("--compare-unfolded", action="store_true",
                   help="also time float32 with the runner's shape folding off (every node on every call)")
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
