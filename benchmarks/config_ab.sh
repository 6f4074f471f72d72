#!/usr/bin/env bash
# A/B of one EngineConfig field on one machine: closed-loop levels and the open loop at 15 req/s (= 150x
# real time), each value in turn, for each arrival seed.
#   FIELD=rider_streams VALUES="16 0" SEEDS="0 1" COSYSTREAM_COMMIT=<hash> bash benchmarks/config_ab.sh
# LEVELS: closed-loop arguments (default c=1,16, 80 requests each; " ": the open loop alone, then it is
# level 0 and --seed draws its arrivals). JSON under $OUT: ab_<field>_<value>_seed<seed>.json.
source benchmarks/gpu_prep.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B="python3 benchmarks/bench_engine.py --model-dir /tmp/m05 --device cuda --dtype bfloat16 --warmup-requests 3 \
   --config flow_slots=28 --config flow_frames=832 --timeout 150"
for seed in ${SEEDS:-0}; do
  for v in ${VALUES:?VALUES: the values to compare}; do
    echo "== ${FIELD:?FIELD: an EngineConfig field}=$v seed $seed"
    $B --config "$FIELD=$v" ${LEVELS:---concurrency 1,16 --requests-per-level 80} --rate 15 --duration 15 \
      --seed "$seed" --out "$OUT/ab_${FIELD}_${v}_seed${seed}.json" 2>&1 | grep -E "^\| [cr]|Error|Traceback|beyond the flow pool|decode step beside|token-to-wave calls"
  done
done
