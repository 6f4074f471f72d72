"""CosyVoice3 token-to-wave per chunk: incremental (cosystream) vs the official recompute, and the DiT's FLOP floor.

Random weights with the real Fun-CosyVoice3-0.5B shapes (no download). For the official schedule (hop 25 +
prompt pad, ×2 up to 100, 3 look-ahead tokens, full-attention final call) it times, per chunk:
  * `dit_ms`: the incremental flow (Token2WavStream.new_mel: DiT over the new frames with cached keys/values),
  * `dit_floor_ms`: the FLOP floor of those DiT passes (10 Euler steps × 2 CFG rows; per frame ≈ 2·MACs of the
    linear layers + the attention over the keys it sees) at `--peak-tflops`,
  * `voc_ms`: the windowed causal vocoder on the new frames,
  * `official_ms`: the official token2wav for the same call (flow over every token so far + vocoder over the
    whole accumulated mel).
Prints a Markdown table (device, dtype, commit in the header). Example (GPU):
    python benchmarks/cv3_token2wav.py --device cuda --dtype bfloat16 --prompt-tokens 150 --tokens 250
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch

from cosystream.checkpoint.hparams import CV3HParams
from cosystream.models.cosyvoice3.flow import CV3Flow
from cosystream.models.cosyvoice3.hift import CausalHiFT
from cosystream.models.cosyvoice3.stream import StreamSchedule, Token2WavStream
from cosystream.testing.random_model_cv3 import SIZES_CV3, hparams_cv3

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dit_flops(hp: CV3HParams, new: int, keys: int) -> float:
    """FLOPs of one chunk's DiT work: 10 steps × 2 rows of `new` query frames attending to `keys` frames."""
    d = hp.flow.dit
    inner = d.heads * d.dim_head
    per_frame_macs = d.depth * (4 * d.dim * inner + 2 * d.ff_mult * d.dim * d.dim + 6 * d.dim * d.dim)
    per_frame_macs += 2 * d.dim * d.dim * d.conv_pos_kernel // d.conv_pos_groups  # the two grouped convs
    per_frame_macs += 4 * 80 * d.dim + d.dim * 80  # input projection and output projection
    attn_macs = d.depth * 2 * inner * keys  # q·k and p·v for each query frame
    return 2.0 * hp.flow.n_timesteps * 2 * new * (per_frame_macs + attn_macs)


def timed(fn, device: torch.device) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - t) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES_CV3))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--prompt-tokens", type=int, default=150)
    p.add_argument("--tokens", type=int, default=250)
    p.add_argument("--repeats", type=int, default=3, help="runs of the whole schedule; the last one is reported")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense peak of the device (H100 SXM bf16)")
    args = p.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    hp = hparams_cv3(args.size)
    torch.manual_seed(0)
    flow = CV3Flow(hp.flow).to(device=device, dtype=dtype).eval()
    flow.decoder.rand_noise = flow.decoder.rand_noise.float()
    hift = CausalHiFT(hp.hift).to(device=device, dtype=dtype).eval()
    hift.f0_predictor.double()
    hift.init_noise(2 + (args.prompt_tokens + args.tokens) / 25)
    prompt = torch.randint(0, 6561, (1, args.prompt_tokens), device=device)
    prompt_feat = torch.randn(1, 2 * args.prompt_tokens, 80, device=device, dtype=dtype)
    xvec = torch.randn(1, 192, device=device)
    tokens = torch.randint(0, 6561, (1, args.tokens), device=device)
    rows = []
    with torch.inference_mode():
        for _ in range(args.repeats):
            rows = []
            stream = Token2WavStream(flow, hift, prompt, prompt_feat, xvec)
            acc_mel = None
            for call in StreamSchedule(args.prompt_tokens).all_calls(args.tokens):
                keys_before = stream.flow_stream.state.caches[0].length
                mel, dit_ms = timed(lambda c=call, s=stream: s.new_mel(tokens, c), device)
                _, voc_ms = timed(lambda m=mel, c=call, s=stream: s.vocode(m, c.finalize), device)
                acc_mel = mel if acc_mel is None else torch.cat([acc_mel, mel], dim=2)

                def official(c=call, whole=acc_mel):
                    m = flow.inference(tokens[:, :c.num_tokens], prompt, prompt_feat, xvec, streaming=not c.finalize,
                                       finalize=c.finalize)
                    return hift.inference(whole, finalize=c.finalize)[0], m

                _, official_ms = timed(official, device)
                new = mel.shape[2]
                lookahead = 0 if call.finalize else hp.flow.pre_lookahead_len
                total = hp.flow.token_mel_ratio * (args.prompt_tokens + call.num_tokens - lookahead)
                # the official full-attention final call runs every frame; other chunks only the uncached ones
                computed = total if call.finalize else total - keys_before
                keys = total
                floor_ms = dit_flops(hp, computed, keys) / (args.peak_tflops * 1e12) * 1e3
                rows.append((call.num_tokens, call.token_offset, call.finalize, new, dit_ms, floor_ms, voc_ms,
                             official_ms))
    commit = os.environ.get("COSYSTREAM_COMMIT") or subprocess.run(  # the device's copy has a stale .git
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"CosyVoice3 {args.size} token2wav per chunk · {name} · {args.dtype} · prompt {args.prompt_tokens} · "
          f"{args.tokens} tokens · commit {commit}\n")
    print("| tokens | offset | final | new frames | DiT ms | DiT floor ms | vocoder ms | official token2wav ms |")
    print("|---|---|---|---|---|---|---|---|")
    for n, off, fin, new, dit, floor, voc, off_ms in rows:
        print(f"| {n} | {off} | {fin} | {new} | {dit:.1f} | {floor:.2f} | {voc:.1f} | {off_ms:.1f} |")


if __name__ == "__main__":
    main()
