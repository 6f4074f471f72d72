#!/usr/bin/env bash
# A/B of token-to-wave preemption (EngineConfig.preempt_token2wav) and final-pass phase size
# (final_phase_streams) on one machine: closed loop c=16 and the open loop at 15 req/s (= 150x real time).
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/preempt_ab.sh      (JSON under $OUT)
source benchmarks/gpu_prep.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B="python3 benchmarks/bench_engine.py --model-dir /tmp/m05 --device cuda --dtype bfloat16 --warmup-requests 3 \
   --config flow_slots=28 --config flow_frames=832 --timeout 150"
for v in ${VARIANTS:-on off on_f4}; do
  case $v in
    on) X="--config preempt_token2wav=1";;
    off) X="--config preempt_token2wav=0";;
    on_f4) X="--config preempt_token2wav=1 --config final_phase_streams=4";;
    on_f8) X="--config preempt_token2wav=1 --config final_phase_streams=8";;
  esac
  echo "== $v"
  $B $X ${LEVELS:---concurrency 16 --requests-per-level 80} --rate 15 --duration 15 --seed ${SEED:-0} \
    --out "$OUT/preempt_$v.json" 2>&1 | grep -E "^\| [cr]|Error|Traceback"
done
