#!/usr/bin/env bash
# A/B of token-to-wave preemption (EngineConfig.preempt_token2wav) on one machine: closed loop c=16 and the
# open loop at 15 req/s (= 150x real time).
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/preempt_ab.sh      (JSON under $OUT)
source benchmarks/gpu_prep.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B="python3 benchmarks/bench_engine.py --model-dir /tmp/m05 --device cuda --dtype bfloat16 --warmup-requests 3 \
   --config flow_slots=28 --config flow_frames=832 --timeout 150"
for v in ${VARIANTS:-on off}; do
  case $v in
    on) X="--config preempt_token2wav=1";;
    off) X="--config preempt_token2wav=0";;
  esac
  echo "== $v"
  # LEVELS=" ": the open loop alone (then it is level 0: --seed draws its arrivals)
  $B $X ${LEVELS:---concurrency 16 --requests-per-level 80} --rate 15 --duration 15 --seed ${SEED:-0} \
    --out "$OUT/preempt_${v}_seed${SEED:-0}.json" 2>&1 | grep -E "^\| [cr]|Error|Traceback"
done
