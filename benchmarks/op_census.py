"""Count the device operations each hot path launches, by the line of cosystream that launches them.

    python benchmarks/op_census.py --model-dir /tmp/m05 [--paths final,chunk,prefill] [--top 25]

A CUDA graph replays every kernel its capture launched, and the chunk ODE, the official final pass and the LM
prefill are latency-bound chains of small kernels (docs/benchmarks.md): a launch removed from a graph body is
time saved at every replay. This counts them without a GPU: every aten operation that is not a view or an
allocation counts as one launch, and each fused op of `cosystream.kernels.flow` / `.decode` (run here as its
torch statement in `cosystream.kernels.reference`) as the launches its Triton kernel makes on CUDA. The paths
are built as on CUDA (fused estimator ops, the fused ODE tail, constant step times), so the counts follow
the CUDA graphs' bodies up to library internals (cuBLAS/cuDNN may add a kernel here and there); on a GPU the
profiler's count (`profile_stages.py`) is the reference.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cosystream
from cosystream.checkpoint import load_checkpoint
from cosystream.engine import vocoder_fast
from cosystream.engine.flow_runner import FlowRunner
from cosystream.engine.lm_runner import LMRunner
from cosystream.engine.loader import load_flow, load_hift, load_llm
from cosystream.kernels import reference
from cosystream.models.flow import LOOKAHEAD_CONTEXT, UP_CONTEXT

PACKAGE = str(Path(cosystream.__file__).resolve().parent)
# Fused ops that launch more than one kernel on CUDA (the rest launch one): the causal conv of a small batch
# runs its output-channel split and then its epilogue (kernels.flow.causal_conv, TILES[("conv", 0)]).
CUDA_LAUNCHES = {"causal_conv": 2}


def is_free(func: torch._ops.OpOverload) -> bool:
    """Views, aliases and allocations launch nothing; in-place ops and everything else launch a kernel."""
    name = func.overloadpacket.__name__
    if name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                "detach", "detach_", "alias", "_local_scalar_dense", "item", "set_", "resize_"):
        return True
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class Census(TorchDispatchMode):
    """Launches counted per (operation, call site in cosystream)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.inside_fused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside_fused and not is_free(func):
            self.counts[(func.overloadpacket.__name__, call_site())] += 1
        return out

    def fused(self, name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.counts[(f"fused:{name}", call_site())] += CUDA_LAUNCHES.get(name, 1)
            self.inside_fused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_fused -= 1
        return counted

    def total(self) -> int:
        return sum(self.counts.values())


def call_site() -> str:
    """The innermost frame in the cosystream package (not this script, not the torch statements of fused ops)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(PACKAGE) and not frame.filename.endswith("kernels/reference.py"):
            return f"{Path(frame.filename).relative_to(Path(PACKAGE).parent)}:{frame.lineno} {frame.name}"
    return "?"


def counting_ops(census: Census, module) -> SimpleNamespace:
    """`module`'s functions, each counted as its CUDA launches and not op by op."""
    names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
    return SimpleNamespace(**{n: census.fused(n, getattr(module, n)) for n in names})


@contextlib.contextmanager
def census_of(census: Census) -> Iterator[Census]:
    with torch.inference_mode(), census:
        yield census


def flow_runner_as_on_cuda(model_dir: str, census: Census, max_frames: int) -> FlowRunner:
    """A FlowRunner on the CPU set up the way the CUDA one is: fused estimator ops (counted), the fused ODE
    tail, and each Euler step's time terms made once (constants of the graphs)."""
    flow = load_flow(load_checkpoint(model_dir))
    runner = FlowRunner(flow, num_slots=1, max_frames=max_frames, use_graphs=False)
    ops = counting_ops(census, reference)
    runner.use_fused_ops(ops)  # load_flow has fused its projections already
    runner.attention_ops = ops
    runner.use_constant_step_times()
    return runner


def final_step_launches(model_dir: str, frames: int) -> Census:
    """One Euler step of an official final pass of one stream over `frames` mel frames (its graph body)."""
    census = Census()
    runner = flow_runner_as_on_cuda(model_dir, census, max_frames=frames)
    x = torch.randn(1, 80, frames)
    mu, spks, cond = runner.cfm.cfg_inputs(torch.randn(1, 80, frames), torch.randn(1, 80), torch.randn(1, 80, frames))
    with census_of(census):
        runner._final_step_core(x, mu, spks, cond, torch.tensor([frames]), runner.step_index[3:4])
    return census


def chunk_ode_launches(model_dir: str, prompt_frames: int, new_frames: int) -> Census:
    """The 10-step ODE of one stream's chunk of `new_frames` after `prompt_frames` cached frames (its graph
    body), divided into its steps by the caller."""
    census = Census()
    runner = flow_runner_as_on_cuda(model_dir, census, max_frames=prompt_frames + new_frames + 64)
    z = torch.randn(1, 80, new_frames)
    mu, spks, cond = torch.randn(1, 80, new_frames), torch.randn(1, 80), torch.randn(1, 80, new_frames)
    slots, starts = torch.tensor([0]), torch.tensor([prompt_frames])
    marker = torch.empty(prompt_frames + new_frames)
    with census_of(census):
        runner._ode(z.float(), mu, spks, cond, slots, starts, marker)
    return census


@contextlib.contextmanager
def counted_sampler(census: Census) -> Iterator[None]:
    """`cosystream.kernels.sample` (Triton, CUDA only) as one counted launch that samples nothing: in place
    of the module and of the package's attribute (`from cosystream.kernels import sample` reads the latter
    once the module has been imported)."""
    import cosystream.kernels as package

    name = "cosystream.kernels.sample"
    counted = SimpleNamespace(sample_and_record=census.fused("sample_and_record", lambda *args, **kwargs: None))
    saved_module, saved_attr = sys.modules.get(name), getattr(package, "sample", None)
    sys.modules[name] = counted  # type: ignore[assignment]
    package.sample = counted  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if saved_module is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved_module
        if saved_attr is None:
            del package.sample
        else:
            package.sample = saved_attr


def lm_runner_as_on_cuda(model_dir: str, census: Census, max_slots: int, max_len: int) -> LMRunner:
    """An LMRunner on the CPU set up the way the CUDA one is: the decode ops (counted) and the fused sampler."""
    runner = LMRunner(load_llm(load_checkpoint(model_dir)), max_slots=max_slots, max_len=max_len, use_graphs=False)
    runner.ops = counting_ops(census, reference)
    runner.fused = runner.fused_sampler = True
    return runner


def prefill_launches(model_dir: str, positions: int) -> Census:
    """One prompt's batched LM prefill of `positions` positions (its graph body)."""
    census = Census()
    runner = lm_runner_as_on_cuda(model_dir, census, max_slots=2, max_len=positions + 64)
    x = torch.randn(1, positions, runner.dims.hidden_size)
    with counted_sampler(census), census_of(census):
        runner._prefill_core(x, torch.tensor([0]), torch.tensor([positions - 1]), torch.tensor([0]))
    return census


def decode_step_launches(model_dir: str, rows: int) -> Census:
    """One LM decode step of `rows` rows with the fused sampler (its graph body)."""
    census = Census()
    runner = lm_runner_as_on_cuda(model_dir, census, max_slots=rows, max_len=320)
    runner.positions[:rows] = 230
    with counted_sampler(census), census_of(census):
        runner._step(rows, 256)
    return census


def encoder_launches(model_dir: str, prompt_tokens: int, new_tokens: int) -> Census:
    """The flow encoder's streaming step for one stream's chunk of `new_tokens` (its graph body)."""
    census = Census()
    runner = flow_runner_as_on_cuda(model_dir, census, max_frames=2 * (prompt_tokens + new_tokens) + 64)
    dims = runner.flow.dims
    ids = torch.randint(0, dims.vocab_size, (1, new_tokens))
    ctx = torch.randint(0, dims.vocab_size, (1, dims.pre_lookahead_len))
    width = dims.encoder.output_size
    tails = (torch.zeros(1, LOOKAHEAD_CONTEXT, width), torch.zeros(1, UP_CONTEXT, width))
    args = (ids, ctx, *tails, torch.tensor([0]), torch.empty(prompt_tokens), torch.empty(1))
    with torch.inference_mode():
        runner._encode_core(*args)  # the warm-up call before a capture (it makes what later calls reuse)
    with census_of(census):
        runner._encode_core(*args)
    return census


def vocoder_launches(model_dir: str, frames: int) -> Census:
    """HiFT over a first chunk's `frames` mel frames, Snake as its one fused kernel (the graph body)."""
    census = Census()
    hift = load_hift(load_checkpoint(model_dir))
    vocoder_fast.accelerate(hift, counting_ops(census, reference))
    mel = torch.randn(1, 80, frames)
    noise = torch.randn(1, frames * hift.upsample_scale, hift.m_source.num_harmonics)
    with census_of(census):
        hift.inference(mel, None, noise=noise)
    return census


def report(title: str, census: Census, per: int, top: int) -> None:
    steps = f" a step ({census.total()} in all)" if per > 1 else ""
    print(f"\n## {title}: {census.total() / per:.0f} launches{steps}")
    print("| launches | operation | call site |\n|---|---|---|")
    for (op, site), n in census.counts.most_common(top):
        print(f"| {n / per:g} | {op} | {site} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--paths", default="final,chunk,encoder,vocoder,prefill,decode")
    ap.add_argument("--final-frames", type=int, default=800, help="a 6 s prompt and 10 s of speech: 300 + 500")
    ap.add_argument("--prompt-frames", type=int, default=300)
    ap.add_argument("--new-frames", type=int, default=50, help="a first chunk of 25 tokens")
    ap.add_argument("--positions", type=int, default=224, help="the standard workload's prompt, padded")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch.manual_seed(0)
    paths = args.paths.split(",")
    if "final" in paths:
        report(f"official final pass, one stream of {args.final_frames} frames, one Euler step",
               final_step_launches(args.model_dir, args.final_frames), 1, args.top)
    if "chunk" in paths:
        census = chunk_ode_launches(args.model_dir, args.prompt_frames, args.new_frames)
        report(f"chunk ODE, one stream, {args.new_frames} new frames after {args.prompt_frames}",
               census, 10, args.top)
    if "decode" in paths:
        report("LM decode step, one row", decode_step_launches(args.model_dir, 1), 1, args.top)
    if "encoder" in paths:
        report(f"flow encoder, one stream's chunk of {args.new_frames // 2} tokens",
               encoder_launches(args.model_dir, args.prompt_frames // 2, args.new_frames // 2), 1, args.top)
    if "vocoder" in paths:
        report(f"HiFT, one stream's first chunk of {args.new_frames} mel frames",
               vocoder_launches(args.model_dir, args.new_frames), 1, args.top)
    if "prefill" in paths:
        census = prefill_launches(args.model_dir, args.positions)
        report(f"LM prefill, one prompt of {args.positions} positions", census, 1, args.top)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
