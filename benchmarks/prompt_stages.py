"""Where the analysis of one new prompt recording spends its wall time on the path to first audio (issue 38).

    python benchmarks/prompt_stages.py --model-dir /tmp/m05r --device cuda [--seconds 6] [--repeats 20] \
        [--engine] [--dtype bfloat16] [--config FIELD=VALUE ...] [--out FILE.json]

Every repeat is a recording not seen before: a synthetic voiced signal (benchmarks/workload.py's voice with its own
seed), as WAV file bytes (what `/v1/tts` receives), of a length not seen before (10 ms steps around `--seconds`), so
the speech tokenizer's shape arithmetic is folded anew as for real traffic. Medians in ms.

Part 1, one prompt alone, outside the engine (`Frontend` + `PromptBatcher.for_engine`, as the engine builds them on
CUDA; on the CPU the torch analysis is forced, where the engine keeps onnxruntime):

* `decode`: WAV bytes -> the checked samples at their own rate (CPU, `prepare_prompt_audio`);
* `upload`, `resample` (to 16 kHz and the flow rate, where the analysis does it), `whisper_log_mel`,
  `speech_tokenizer`, `fbank`, `campplus`, `prompt_mel`, `copies_back`: each stage alone, the device synchronised
  after it, so each one's wall time; beside each device stage, `queued`: when its call returned (the host's work:
  the launches, and any wait for the device inside); `stages_sum` adds them;
* `analyse`: `TorchPromptAnalyzer.analyse([prompt])`, the stages as the batcher's thread runs them (CAM++ and the
  mel beside the tokenizer);
* `batcher`: `PromptBatcher.analyse(prompt)` from the calling thread: the hand-off to the analysis thread, its batch
  of one (a recording that arrives alone does not wait for companions) and the result back;
* `voice_prompt`: `PromptBatcher.make_voice_prompt(wav_bytes, transcript)` on the calling thread: decoding, the
  batcher, the transcript's normalisation and ids, the alignment;
* `via_pool`: the same handed to the batcher's threads (`executor`, as the engine's `run_in_executor` does) and
  waited for from this thread;
* `host_syncs`: where one `analyse` of a new prompt synchronised the host with the device (torch's sync debug
  mode; the copies of the results back are three of them);
* `tokenizer_graphs`: the shape buckets whose tokenizer calls replay CUDA graphs (0 off CUDA; `tokenizer_graphs_off`
  says why none; `--tokenizer-eager` leaves them out of part 1), and `analyzer_load_s`: the analysis' load, its
  graph captures included.

Part 2 (`--engine`): `AsyncEngine` on the model (`--dtype`, `--config` as for bench_engine.py), one request at a time
(zero-shot, the workload's texts, `--force-tokens`, streamed to the end before the next), each with a new recording.
The frontend stage, from submission to the request handed to the engine core, split at the engine's calls (each
time from the previous mark): `admit`, `to_thread` (to `_build_request` on a frontend thread), `decode`,
`to_analysis` (the batcher's hand-off), `analyse` (`TorchPromptAnalyzer.analyse`), `from_analysis` (the result back
to the frontend thread), `transcript` (its normalisation, ids and the voice prompt), `request` (the target text and
the request), `to_loop` (back to the event loop and into the core); `engine_frontend` is the engine's own stage
time (its `frontend_s`).
A CPU engine analyses with onnxruntime on the frontend thread: `onnx_analysis_transcript` replaces the four steps
from `to_analysis` to `transcript`.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import soundfile as sf
import torch
import workload  # beside this file: python puts the script's folder first on sys.path

from cosystream.checkpoint import load_checkpoint
from cosystream.config import config_overrides
from cosystream.engine.prompt_batcher import PromptBatcher
from cosystream.frontend import Frontend
from cosystream.frontend.audio import MIN_PROMPT_S, prepare_prompt_audio, prompt_mel, speaker_features, whisper_log_mel
from cosystream.frontend.torch_prompt import TorchPromptAnalyzer
from cosystream.params import Mode, SamplingParams, SynthesisParams
from cosystream.testing.host_syncs import recorded_host_syncs

STEP_S = 0.010  # lengths of the recordings this far apart: one tokenizer frame, a length not seen before


def recordings(seconds: float, rate: int) -> Iterator[bytes]:
    """WAV bytes of new recordings: the workload's voice with another noise seed each time, its lengths around
    `seconds` (+10 ms, -10 ms, +20 ms, ...), each one a length not seen before."""
    for index in itertools.count():
        offset = (index + 1) // 2 * STEP_S * (1 if index % 2 else -1)
        if seconds + offset < MIN_PROMPT_S:
            raise RuntimeError(f"--seconds {seconds}: too short for this many recordings of distinct lengths")
        wav = workload.synth_voice(rate, seconds + offset, seed=workload.SEED + index)
        buffer = io.BytesIO()
        sf.write(buffer, wav, rate, format="WAV", subtype="PCM_16")
        yield buffer.getvalue()


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


class Clock:
    """Wall times of named stages, the device synchronised at the end of each (`stage`), and when each stage's
    call returned (`queued_<name>`)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.samples: dict[str, list[float]] = {}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        queued = time.perf_counter()
        self.sync()
        done = time.perf_counter()
        self.samples.setdefault(name, []).append(done - t0)
        if self.cuda:
            self.samples.setdefault(f"queued_{name}", []).append(queued - t0)
        return out

    def medians(self) -> dict[str, float]:
        return {name: median_ms(values) for name, values in self.samples.items()}


def one_prompt_stages(analyzer: TorchPromptAnalyzer, data: bytes, rate: int, clock: Clock) -> None:
    """Each stage of one prompt's analysis alone, as `TorchPromptAnalyzer.analyse` computes it."""
    device = analyzer.device
    prompt = clock.stage("decode", lambda: prepare_prompt_audio(data, rate))
    samples = clock.stage("upload", lambda: prompt.samples.to(device))
    with analyzer._exact():
        wav_16k, wav_24k = clock.stage("resample", lambda: prompt.at_rates(samples))
        feats = clock.stage("whisper_log_mel", lambda: whisper_log_mel(wav_16k))
        tokens = clock.stage("speech_tokenizer", lambda: analyzer.tokenizer.run([feats])[0])
        fbank = clock.stage("fbank", lambda: speaker_features(wav_16k).T)
        if analyzer.fast_speaker is not None:
            xvector = clock.stage("campplus", lambda: analyzer.fast_speaker.embed([fbank])[0])
        elif analyzer.speaker is not None:
            xvector = clock.stage("campplus", lambda: analyzer.speaker.run([fbank])[0])
        else:  # CAM++ on onnxruntime on the CPU (SPEAKER_THREADS > 0): timed from the waveform
            xvector = clock.stage("campplus", lambda: analyzer.embed([prompt.wav_16k])[0])
        mel = clock.stage("prompt_mel", lambda: prompt_mel(wav_24k, analyzer.mel_dims))
    clock.stage("copies_back", lambda: (tokens.cpu(), xvector.cpu(), mel.cpu()))


def host_syncs(analyzer: TorchPromptAnalyzer, data: bytes, rate: int) -> list[str]:
    """Call sites (file:line) where one analysis synchronised the host with the device; [] off CUDA."""
    if analyzer.device.type != "cuda":
        return []
    prompt = prepare_prompt_audio(data, rate)
    with recorded_host_syncs() as syncs:
        analyzer.analyse([prompt])
    return [f"{Path(w.filename).name}:{w.lineno}" for w in syncs]


def standalone(args: argparse.Namespace) -> dict[str, Any]:
    checkpoint = load_checkpoint(args.model_dir)
    rate = checkpoint.hparams.mel.sampling_rate
    frontend = Frontend(checkpoint)
    started = time.perf_counter()
    batcher = PromptBatcher.for_engine(frontend, checkpoint, args.device, use_torch=True)
    load_s = time.perf_counter() - started
    if batcher.analyzer is None:
        raise SystemExit("the torch runner cannot run this model's graphs (see the log)")
    analyzer, clock = batcher.analyzer, Clock(torch.device(args.device))
    if args.tokenizer_eager:
        analyzer.tokenizer.graphs = None
        analyzer.tokenizer_fallback = "--tokenizer-eager"
    new = recordings(args.seconds, workload.PROMPT_SAMPLE_RATE)
    try:
        for _ in range(2):  # warm-up: kernels, cuFFT plans, pinned host blocks
            batcher.make_voice_prompt(next(new), workload.PROMPT_TEXT)
        for _ in range(args.repeats):
            one_prompt_stages(analyzer, next(new), rate, clock)
            prompt = prepare_prompt_audio(next(new), rate)
            clock.stage("analyse", lambda p=prompt: analyzer.analyse([p]))
            prompt = prepare_prompt_audio(next(new), rate)
            clock.stage("batcher", lambda p=prompt: batcher.analyse(p))
            data = next(new)
            clock.stage("voice_prompt", lambda d=data: batcher.make_voice_prompt(d, workload.PROMPT_TEXT))
            data = next(new)
            assert batcher.executor is not None
            clock.stage("via_pool", lambda d=data: batcher.executor.submit(
                batcher.make_voice_prompt, d, workload.PROMPT_TEXT).result())
        report: dict[str, Any] = clock.medians()
        stages = ("decode", "upload", "resample", "whisper_log_mel", "speech_tokenizer", "fbank", "campplus",
                  "prompt_mel", "copies_back")
        report["stages_sum"] = round(sum(report[name] for name in stages), 3)
        report["host_syncs"] = host_syncs(analyzer, next(new), rate)
        report["tokenizer_mode"], report["speaker_mode"] = analyzer.tokenizer.mode, analyzer.speaker_mode
        graphs = analyzer.tokenizer.graphs
        report["tokenizer_graphs"] = len(graphs.replays) if graphs is not None else 0
        report["tokenizer_graphs_off"] = analyzer.tokenizer_fallback
        report["analyzer_load_s"] = round(load_s, 2)  # with the CUDA-graph captures of the tokenizer and CAM++
        report["collect_window_ms"] = batcher.collect_window_s * 1e3
        report["batches"] = batcher.stats.batches
    finally:
        batcher.close()
    return report


# ------------------------------------------------------------------------------------------------ engine
class Marks:
    """Times (time.monotonic, the event loop's clock) at which the instrumented calls of a request started or ended."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any], at: str = "both") -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if at in ("both", "start"):
                self.now[f"{name}_start"] = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                if at in ("both", "end"):
                    self.now[f"{name}_end"] = time.monotonic()
        return timed


ENGINE_STEPS = (  # (name, from mark, to mark)
    ("admit", "submit", "admit_end"),
    ("to_thread", "admit_end", "build_start"),
    ("decode", "build_start", "decode_end"),
    ("to_analysis", "decode_end", "analyse_start"),
    ("analyse", "analyse_start", "analyse_end"),
    ("from_analysis", "analyse_end", "batcher_end"),
    ("transcript", "batcher_end", "voice_end"),
    ("request", "voice_end", "build_end"),
    ("to_loop", "build_end", "core_start"),
)


async def engine_stages(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import cosystream.frontend as frontend_module
    from cosystream.engine.async_engine import AsyncEngine

    config: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "voices_db": str(tmp / "voices.db")}
    config.update(config_overrides(args.config))
    started = time.perf_counter()
    engine = AsyncEngine.from_pretrained(args.model_dir, **config)
    load_s = time.perf_counter() - started
    marks = Marks()
    batcher = engine.prompt_batcher
    engine._admit = marks.wrap("admit", engine._admit, "end")
    engine._build_request = marks.wrap("build", engine._build_request)
    batcher.analyse = marks.wrap("batcher", batcher.analyse, "end")
    if batcher.analyzer is not None:
        batcher.analyzer.analyse = marks.wrap("analyse", batcher.analyzer.analyse)
    engine.frontend.make_voice_prompt = marks.wrap("voice", engine.frontend.make_voice_prompt, "end")
    engine.core.submit = marks.wrap("core", engine.core.submit, "start")
    real_prepare = frontend_module.prepare_prompt_audio
    frontend_module.prepare_prompt_audio = marks.wrap("decode", real_prepare, "end")  # type: ignore[assignment]
    samples: dict[str, list[float]] = {}
    new = recordings(args.seconds, workload.PROMPT_SAMPLE_RATE)
    try:
        await asyncio.to_thread(engine.warmup)
        for index in range(args.warmup + args.repeats):
            params = SynthesisParams(text=workload.TARGET_TEXT, mode=Mode.zero_shot, prompt_audio=next(new),
                                     prompt_text=workload.PROMPT_TEXT, force_tokens=args.force_tokens,
                                     sampling=SamplingParams(seed=index))
            marks.now = {"submit": time.monotonic()}
            frontend_s = None
            async for chunk in engine.synthesize(params):
                if chunk.times is not None:
                    frontend_s = chunk.times.as_dict().get("frontend_s")
            if index < args.warmup:
                continue
            for name, start, end in ENGINE_STEPS:
                if start in marks.now and end in marks.now:
                    samples.setdefault(name, []).append(marks.now[end] - marks.now[start])
            if "analyse_start" not in marks.now:  # the frontend's onnxruntime analysis (CPU engines): no hand-offs
                onnx_s = marks.now["voice_end"] - marks.now["decode_end"]
                samples.setdefault("onnx_analysis_transcript", []).append(onnx_s)
            samples.setdefault("submit_to_core", []).append(marks.now["core_start"] - marks.now["submit"])
            if frontend_s is not None:
                samples.setdefault("engine_frontend", []).append(frontend_s)
    finally:
        frontend_module.prepare_prompt_audio = real_prepare  # type: ignore[assignment]
        flow_slots = int(engine.stats().get("num_flow_slots", 0))
        engine.close()
    report: dict[str, Any] = {name: median_ms(values) for name, values in samples.items()}
    report["batches"], report["prompts"] = batcher.stats.batches, batcher.stats.prompts
    report["engine_load_s"] = round(load_s, 2)
    report["num_flow_slots"] = flow_slots
    return report


# ------------------------------------------------------------------------------------------------ report
def print_report(report: dict[str, Any]) -> None:
    one = report["one_prompt"]
    print(f"package {report['package']}")
    print(f"{report['device']}, {report['seconds']} s recordings, medians of {report['repeats']} (ms); tokenizer "
          f"{one['tokenizer_mode']}, CAM++ {one['speaker_mode']}, collect window {one['collect_window_ms']:.1f} ms")
    print(f"tokenizer CUDA graphs: {one['tokenizer_graphs']} ({one['tokenizer_graphs_off'] or 'on'}); analysis "
          f"loaded in {one['analyzer_load_s']:.1f} s")
    print("one prompt alone, each stage synchronised (queued: when its call returned):")
    for name in ("decode", "upload", "resample", "whisper_log_mel", "speech_tokenizer", "fbank", "campplus",
                 "prompt_mel", "copies_back"):
        queued = one.get(f"queued_{name}")
        print(f"  {name:18s} {one[name]:8.2f}" + (f"   (queued {queued:.2f})" if queued is not None else ""))
    print(f"  {'stages_sum':18s} {one['stages_sum']:8.2f}")
    for name in ("analyse", "batcher", "voice_prompt", "via_pool"):
        print(f"  {name:18s} {one[name]:8.2f}")
    print(f"  host syncs in one analysis: {len(one['host_syncs'])} at {', '.join(one['host_syncs']) or '-'}")
    if "engine" in report:
        eng = report["engine"]
        print(f"engine loaded in {eng['engine_load_s']:.1f} s with {eng['num_flow_slots']} flow slots; one request "
              f"at a time ({eng['prompts']} recordings in {eng['batches']} batches):")
        for name in [step[0] for step in ENGINE_STEPS] + ["onnx_analysis_transcript"]:
            if name in eng:
                print(f"  {name:18s} {eng[name]:8.2f}")
        print(f"  {'submit_to_core':18s} {eng['submit_to_core']:8.2f}   (the engine's frontend_s "
              f"{eng.get('engine_frontend', float('nan')):.2f})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seconds", type=float, default=workload.PROMPT_SECONDS)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--engine", action="store_true", help="also time the frontend stage inside an AsyncEngine")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="--engine: the engine's dtype (the analysis stays float32)")
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE", help="--engine: EngineConfig")
    p.add_argument("--force-tokens", type=int, default=workload.FORCE_TOKENS)
    p.add_argument("--warmup", type=int, default=3, help="--engine: requests before the timed ones")
    p.add_argument("--tokenizer-eager", action="store_true",
                   help="part 1: the speech tokenizer operator by operator, its CUDA graphs not replayed")
    p.add_argument("--out", help="write the report as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import cosystream

    report: dict[str, Any] = {"device": args.device, "seconds": args.seconds, "repeats": args.repeats,
                              "package": str(Path(cosystream.__file__).parent), "one_prompt": standalone(args)}
    if args.engine:
        with tempfile.TemporaryDirectory(prefix="prompt-stages-") as tmp:
            report["engine"] = asyncio.run(engine_stages(args, Path(tmp)))
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
