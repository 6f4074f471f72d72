"""Time each hot path of the engine in isolation (LM decode step, flow chunk, HiFT chunk, LM prefill).

    python benchmarks/profile_stages.py --model-dir /tmp/cv2-0.5b --device cuda --dtype bfloat16

Prints one markdown table; every number is the median of `--iters` timed runs after warm-up, measured
with CUDA events (host clock on CPU). Used for docs/benchmarks.md "stage times" and "floor" rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cosystream import kernels
from cosystream.checkpoint import load_checkpoint
from cosystream.config import ChunkSchedule, EngineConfig
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.lm_runner import LMRunner, RowSampling
from cosystream.engine.loader import load_flow, load_hift, load_llm
from cosystream.engine.token2wav import Token2WavRunner
from cosystream.frontend import ModelInputs
from cosystream.kernels import decode as decode_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def share_weights(modules: list[torch.nn.Module]) -> None:
    """Make every module of `modules` read the first one's parameters (and fused q/k/v weight).

    For `--shared-weights`: the stage then reads one layer's weights over and over, which stay in L2, so
    the difference to the normal run is what fetching each layer's weights from HBM costs the stage (an
    upper bound on what prefetching them into L2 ahead of use could save). Outputs are meaningless."""
    first = modules[0]
    for module in modules[1:]:
        for name, sub in module.named_modules():
            src = first.get_submodule(name)
            for pname, _ in list(sub.named_parameters(recurse=False)):
                setattr(sub, pname, getattr(src, pname))
            if getattr(sub, "qkv_weight", None) is not None:
                sub.qkv_weight = src.qkv_weight


def share_flow_weights(flow) -> None:
    """share_weights over the estimator's 56 transformer blocks and its 12 mid ResNets."""
    from cosystream.models.estimator import TransformerBlock

    est = flow.decoder.estimator
    share_weights([m for m in est.modules() if isinstance(m, TransformerBlock)])
    share_weights([blocks[0] for blocks in est.mid_blocks])


def timed(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def count_kernels(fn, device: torch.device, show: int = 0) -> int:
    """GPU kernels one eager call of fn launches (what a CUDA graph of it replays); `show` prints the
    kernel names that take the most device time (count, total µs): their sum against the graph's time
    tells kernel work from the gaps between kernels."""
    if device.type != "cuda":
        return 0
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = Counter(e.name[:90] for e in kernels)
    busy: Counter = Counter()
    for e in kernels:
        busy[e.name[:90]] += getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
    if show:
        print(f"  kernel time {sum(busy.values()):.0f} µs in {sum(names.values())} kernels", flush=True)
    for name, us in busy.most_common(show):
        print(f"  {names[name]:5d}  {us:8.0f} µs  {name}", flush=True)
    return sum(names.values())


def bench_lm(ckpt, device, dtype, batches, iters, graphs: bool, compile: bool = False, fused: bool = True,
             shared: bool = False, prefetch_mb: float | None = None) -> dict:
    lm = load_llm(ckpt, device, dtype)
    if shared:
        share_weights(list(lm.layers))
    t0 = time.perf_counter()
    runner = LMRunner(lm, max_slots=max(batches), max_len=1024, use_graphs=graphs, compile=compile,
                      fused_kernels=fused, l2_prefetch_mb=prefetch_mb)
    d = lm.dims
    sampling = RowSampling(seed=0, top_p=d.top_p, top_k=d.top_k, win_size=d.win_size, tau_r=d.tau_r,
                           min_len=10_000, ban_special=True)
    prompt = torch.randn(212, d.hidden_size, device=device, dtype=dtype) * 0.02
    out = {}
    for slot in range(max(batches)):
        runner.set_row_sampling(slot, sampling)
    runner.prefill(0, prompt)
    out["first_prefill_incl_compile_s"] = time.perf_counter() - t0
    out["prefill_212_ms"] = timed(lambda: runner.prefill(0, prompt), device, iters)
    padded = torch.zeros(1, 224, d.hidden_size, device=device, dtype=dtype)
    padded[0, :212] = prompt
    one = torch.zeros(1, dtype=torch.long, device=device)
    out["prefill_kernels"] = count_kernels(lambda: runner._prefill_core(padded, one, one + 211, one), device, show=12)
    for slot in range(max(batches)):
        runner.prefill(slot, prompt)
        runner.set_active(slot, True)
    for b in batches:
        out[f"decode_b{b}_ms"] = timed(lambda b=b: runner.decode(b, 500), device, iters)
    out["decode_kernels_per_step"] = count_kernels(lambda: runner._step(1, 512), device, show=25)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in lm.named_parameters()
                       if not n.startswith("text_embedding"))
    out["decode_weight_bytes"] = weight_bytes
    return out


def random_voice(prompt_tokens: int, target_tokens: int = 300) -> tuple[ModelInputs, list[int]]:
    """A voice of random prompt tokens, mel and embedding (seed 0), and random target speech tokens."""
    g = torch.Generator().manual_seed(0)
    inputs = ModelInputs(mode="vc", text_ids=torch.zeros(0, dtype=torch.int32),
                         xvector=torch.randn(192, generator=g),
                         flow_prompt_speech_tokens=torch.randint(0, 6561, (prompt_tokens,), generator=g,
                                                                 dtype=torch.int32),
                         prompt_mel=torch.randn(2 * prompt_tokens, 80, generator=g) - 5,
                         source_speech_tokens=torch.zeros(0, dtype=torch.int32))
    return inputs, torch.randint(0, 6561, (target_tokens,), generator=g).tolist()


def bench_token2wav(ckpt, device, dtype, batches, iters, prompt_tokens: int = 150, fused: bool = True,
                    shared: bool = False, prefetch_mb: float = 0.0) -> dict:
    flow, hift = load_flow(ckpt, device, dtype), load_hift(ckpt, device, dtype)
    if shared:
        share_flow_weights(flow)
    flow.decoder.estimator.l2_prefetch_mb = prefetch_mb
    runner = Token2WavRunner(flow, hift, EngineConfig.from_kwargs(device=str(device), fused_kernels=fused,
                                                      flow_slots=max(batches) + 2, flow_frames=832))
    inputs, tokens = random_voice(prompt_tokens)
    out = {"prompt_cache_ms": timed(lambda: runner.prompt_cache(inputs, None), device, max(iters // 4, 2))}
    runner.prompt_cache(inputs, "voice")
    for b in batches:
        def first_chunk(b=b):
            states = [runner.start(inputs, "voice", seed=i) for i in range(b)]
            planners = [ChunkPlanner(ChunkSchedule(), prompt_tokens) for _ in range(b)]
            plans = [p.next_plan(len(tokens), False) for p in planners]
            out = runner.run([(s, tokens, p) for s, p in zip(states, plans, strict=True)])
            for s in states:
                runner.release(s)  # frees the pool slot, so every timed call runs on the pooled path
            return out
        out[f"first_chunk_b{b}_ms"] = timed(first_chunk, device, iters)
        if runner.pool is not None and device.type == "cuda":
            # the engine's stage stopwatch over one more call: "encoder" the batched encoder steps, "ode" the
            # graph replay and its output copies (the setup between them is a stage of its own)
            before = runner.watch.stats()
            runner.watch.start()
            first_chunk()
            after = runner.watch.stats()
            for stage in ("encoder", "ode"):
                key = f"token2wav_{stage}_gpu_seconds"
                out[f"first_chunk_b{b}_{stage}_ms"] = 1e3 * (after[key] - before.get(key, 0.0))
            # the graph this batch replayed (the most rows so far): where its kernel time goes
            key = max(runner.pool.graphs.graphs)
            if f"ode_kernels_{key}" not in out:
                _, static_in, _ = runner.pool.graphs.graphs[key]
                out[f"ode_kernels_{key}"] = count_kernels(lambda s=static_in: runner.pool._ode(*s), device, show=20)
        mel = torch.randn(b, 80, 108, device=device, dtype=dtype) - 5
        out[f"hift_108_b{b}_ms"] = timed(lambda mel=mel: hift.inference(mel), device, iters)
        out[f"hift_108_b{b}_kernels"] = count_kernels(lambda mel=mel: hift.inference(mel), device, show=12)
    if runner.pool is not None:  # the official final chunk: one full-attention pass over prompt + 250 tokens
        prompt = runner.prompt_cache(inputs, "voice")
        target = torch.tensor(tokens[:250], device=device)
        out["final_full_pass_250_ms"] = timed(lambda: runner.pool.full_pass(prompt, target), device, iters)
        for b in batches[1:]:
            items = [(prompt, target)] * b
            out[f"final_full_pass_250_b{b}_ms"] = timed(lambda items=items: runner.pool.full_passes(items), device,
                                                        max(iters // 2, 2))
        if device.type == "cuda":  # where an Euler step of the largest batch's final pass spends its kernel time
            key = max(runner.pool.final_step_graphs.graphs)
            _, static_in, _ = runner.pool.final_step_graphs.graphs[key]
            out[f"final_step_kernels_{key}"] = count_kernels(lambda s=static_in: runner.pool._final_step_core(*s),
                                                             device, show=20)
    mel = torch.randn(1, 80, 800, device=device, dtype=dtype)
    mu = torch.randn(1, 80, 800, device=device, dtype=dtype)
    out["flow_offline_800_frames_ms"] = timed(
        lambda: flow.decoder.sample(mu, torch.randn(1, 80, device=device, dtype=dtype), mel, False), device,
        max(iters // 4, 2))
    return out


def _report(results: dict, new: dict) -> None:
    results.update(new)
    for k, v in new.items():
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--no-fused", action="store_true", help="the unfused torch decode step (A/B)")
    ap.add_argument("--cublas-linear", action="store_true",
                    help="the decode step's linears on cuBLAS, not the weight-streaming kernel (A/B)")
    ap.add_argument("--pdl", type=int, choices=(0, 1), default=None,
                    help="programmatic dependent launch of the decode and flow kernels (A/B; default: "
                    "cosystream.kernels.PDL)")
    ap.add_argument("--shared-weights", action="store_true",
                    help="every LM layer / estimator block reads the first one's weights (L2-resident): an upper "
                    "bound on what fetching weights from HBM costs (timings only; outputs meaningless)")
    ap.add_argument("--lm-prefetch-mb", type=float, default=None,
                    help="the decode step's L2 prefetch window (cosystream.kernels.prefetch; default: its WINDOW_MB)")
    ap.add_argument("--flow-prefetch-mb", type=float, default=0.0,
                    help="the flow estimator's L2 prefetch window (Estimator.l2_prefetch_mb; 0: off)")
    ap.add_argument("--only", default="lm,t2w")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.cublas_linear:
        decode_ops.MAX_LINEAR_ROWS = 0
    if args.pdl is not None:
        kernels.PDL = bool(args.pdl)
    batches = [int(b) for b in args.batches.split(",")]
    ckpt = load_checkpoint(args.model_dir)
    results = {}
    print("| measure | value |\n|---|---|", flush=True)
    with torch.inference_mode():
        if "lm" in args.only:
            _report(results, bench_lm(ckpt, device, dtype, batches, args.iters, not args.no_graphs,
                                      args.compile, fused=not args.no_fused, shared=args.shared_weights,
                                      prefetch_mb=args.lm_prefetch_mb))
        if "t2w" in args.only:
            _report(results, bench_token2wav(ckpt, device, dtype, batches, args.iters, fused=not args.no_fused,
                                             shared=args.shared_weights, prefetch_mb=args.flow_prefetch_mb))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
