#!/usr/bin/env bash
# A/B of the flow kernels' programmatic dependent launch in the engine, in-process, on one machine: off, on the
# chunk path of one or two streams only (the default: kernels.flow.PDL_MAX_ROWS = SMALL_ROWS = 512), and on every row class.
# Each variant runs bench_engine.py with the module setting changed before the engine starts (its kernels are
# compiled for it first: give each run its warm-up). LEVELS (default 16), N requests a level (default 48).
#   bash benchmarks/flow_pdl_ab.sh
source benchmarks/gpu_prep.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ARGS="--model-dir /tmp/m05 --device cuda --dtype bfloat16 --warmup-requests 3 --timeout 150 --config flow_slots=28 \
  --config flow_frames=832 --concurrency ${LEVELS:-16} --requests-per-level ${N:-48}"
for variant in "off:PDL=False" "small:PDL_MAX_ROWS=512" "all:PDL_MAX_ROWS=10**9"; do
  name=${variant%%:*}; setting=${variant#*:}
  echo "== flow PDL $name ($setting)"
  python3 -c "import runpy, sys; sys.path.insert(0, 'benchmarks'); import cosystream.kernels.flow as f; f.$setting; \
sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" benchmarks/bench_engine.py $ARGS \
    --out "$OUT/flow_pdl_$name.json" 2>&1 | grep -E "^\| c|Error|Traceback"
done
