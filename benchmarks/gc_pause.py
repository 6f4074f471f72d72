"""How long a full cyclic garbage collection holds the GIL in a process with an engine, before and after the
heap freeze the engine does (EngineConfig.gc_freeze); the engine thread, and so every stream, waits that long.

    python benchmarks/gc_pause.py --model-dir MODEL_DIR [--device cuda --dtype bfloat16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

from cosystream.engine.sync_engine import Engine


def collect_ms(rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        gc.collect()
        samples.append(round((time.perf_counter() - t0) * 1e3, 1))
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.from_pretrained(args.model_dir, device=args.device, dtype=args.dtype,
                                        voices_db=f"{tmp}/v.db", gc_freeze=False)
        try:
            gc.collect()
            print(f"tracked objects: {len(gc.get_objects())}")
            print(f"full collection, ms: {collect_ms(args.rounds)}")
            gc.freeze()
            print(f"after gc.freeze ({gc.get_freeze_count()} objects), ms: {collect_ms(args.rounds)}")
        finally:
            engine.close()
            gc.unfreeze()


if __name__ == "__main__":
    main()
