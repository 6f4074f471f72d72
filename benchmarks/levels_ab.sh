#!/usr/bin/env bash
# Before/after on one GPU machine: the standard in-process levels for a base package and for the working tree,
# run on the same machine, so a change can be judged against run-to-run noise. Here, first:
#   rm -rf .base && mkdir .base && git archive <base> cosystream benchmarks | tar -x -C .base   # (.base is ignored)
# then carry `.whl` and `.base` in the device call and run one part per call (each under ten minutes):
#   bash benchmarks/levels_ab.sh tests     # GPU tests of the working tree, then its c=1 and c=16
#   bash benchmarks/levels_ab.sh base      # the base package's c=1 and c=16, then offline c=64 for both
source benchmarks/gpu_prep.sh || exit 1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ARGS="--model-dir /tmp/m05 --device cuda --dtype bfloat16 --warmup-requests 3 --timeout 150 \
  --config flow_slots=28 --config flow_frames=832"
stamp() { echo "== $(date +%T) $*"; }
rows() { grep -E "^\| [cro]|^\| level|busy|Error|Traceback"; }
levels() {  # NAME PACKAGE_DIR [bench_engine.py flags]
  local name=$1 pkg=$2; shift 2
  stamp "$name"
  PYTHONPATH=/tmp/site:$pkg timeout 240 python3 "$pkg/benchmarks/bench_engine.py" $ARGS "$@" \
    --out "$OUT/$name.json" 2>&1 | rows
}
case "${1:-tests}" in
tests)
  stamp "GPU tests"
  timeout 280 python3 -m pytest -q -p no:cacheprovider -m "" tests/gpu tests/kernels tests/engine/test_flow_fast.py \
    tests/models/cosyvoice3/test_cv3_cuda.py > "$OUT/gpu_tests.log" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu_tests.log" | tail -15
  levels new_closed "$PWD" --concurrency 1,16 --requests-per-level 48
  ;;
base)
  levels base_closed "$PWD/.base" --concurrency 1,16 --requests-per-level 48
  levels base_offline "$PWD/.base" --offline --concurrency 64 --requests-per-level 128
  levels new_offline "$PWD" --offline --concurrency 64 --requests-per-level 128
  ;;
*)
  echo "levels_ab.sh: unknown part '$1' (tests or base)" >&2; exit 2
  ;;
esac
stamp done
