"""Measure the two ceilings of the device (copy bandwidth, bf16 matmul rate) and print the floors they
imply for CosyVoice2-0.5B (spec/README.md "Cost per generated second").

    python benchmarks/floor.py
"""

from __future__ import annotations

import torch

LM_DECODE_BYTES = 739_338_312  # bf16 weights read per decode step (LM without the text embedding; measured)
ESTIMATOR_GFLOP_PER_AUDIO_S = 132.0  # 20 passes x 50 frames x 66 M MACs x 2 (spec/flow.md §8)
HIFT_GFLOP_PER_AUDIO_S = 30.6  # spec/hift.md §8


def _time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    src = torch.randn(1024, 1024, 1024, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * 2 / (copy_ms / 1e3)  # bytes read + written per second
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _time_ms(lambda: a @ b)
    flops = 2 * 8192**3 / (mm_ms / 1e3)
    step_floor_ms = LM_DECODE_BYTES / bandwidth * 1e3
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s; bf16 matmul: {flops / 1e12:.0f} TFLOP/s")
    print(f"LM decode step floor (weights once per step): {step_floor_ms:.3f} ms")
    print(f"estimator floor: {ESTIMATOR_GFLOP_PER_AUDIO_S * 1e9 / flops * 1e3:.3f} ms per audio second")
    print(f"HiFT floor (FLOPs only): {HIFT_GFLOP_PER_AUDIO_S * 1e9 / flops * 1e3:.3f} ms per audio second")


if __name__ == "__main__":
    main()
