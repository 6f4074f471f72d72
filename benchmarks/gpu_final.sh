#!/usr/bin/env bash
# The device runs behind docs/benchmarks.md's tables for this commit (H100, 0.5B random weights, standard
# workload). Two parts, each under the device tool's 10-minute limit per command:
#   bash benchmarks/gpu_final.sh engine   # GPU tests, stage times, closed-loop engine levels 1..128
#   bash benchmarks/gpu_final.sh more     # first hop 15, open loop, offline batch RTF, HTTP
#   bash benchmarks/gpu_final.sh stages   # GPU tests, stage times, levels 1/16/28 with token-to-wave stage lines
#   bash benchmarks/gpu_final.sh http     # only the HTTP levels (HTTP_LEVELS, HTTP_N)
#   bash benchmarks/gpu_final.sh check    # after CPU-only work: GPU tests (tests/gpu, tests/kernels compiled),
#                                         # the stage times and the launch counts they should follow
#   bash benchmarks/gpu_final.sh refresh  # no tests: LM stage times, first hop 15, c=4, c=64/128, open loop,
#                                         # offline (the levels besides c=1/16 and HTTP, one call)
# JSON/PNG go under $OUT.
source benchmarks/gpu_prep.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
POOL="--config flow_slots=28 --config flow_frames=832"
B="python3 benchmarks/bench_engine.py --model-dir /tmp/m05 --device cuda --dtype bfloat16 --warmup-requests 3 $POOL"

http_bench() {  # cosystream serve + cosystream bench over HTTP; HTTP_LEVELS (1,16) and HTTP_N (32) requests per level
  SERVE_LOG_LEVEL=warning source benchmarks/serve_bg.sh || return 1
  python3 -m cosystream.cli bench --url http://127.0.0.1:8000 --target tts --workload /tmp/wl/workload.json \
    --concurrency ${HTTP_LEVELS:-1,16} --requests-per-level ${HTTP_N:-32} --warmup-requests 3 --out "$OUT/http.json" \
    --plot "$OUT/http.png" --tag "commit=${COSYSTREAM_COMMIT:-unknown}" \
    --tag gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" 2>&1 | grep -E "^\| c|^\| level \| requests|Error"
  kill $SERVER
}

if [ "${1:-engine}" = check ]; then
  if [ -d .fixtures ]; then
    COSYSTREAM_FIXTURES=$PWD/.fixtures/cosyvoice2-tiny python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels \
      2>&1 | tail -3
  fi
  python3 benchmarks/op_census.py --model-dir /tmp/m05 --top 0 2>&1 | grep "^##"
  for only in lm t2w; do
    python3 benchmarks/profile_stages.py --model-dir /tmp/m05 --only $only --batches 1,16 --iters 20 \
      --json "$OUT/stages_$only.json" 2>&1 | grep "^|"
  done
elif [ "${1:-engine}" = refresh ]; then
  python3 benchmarks/profile_stages.py --model-dir /tmp/m05 --only lm --batches 1,16 --iters 20 \
    --json "$OUT/stages_lm.json" 2>&1 | grep "^|"
  $B --first-hop 15 --concurrency 1 --requests-per-level 16 --out "$OUT/hop15.json" 2>&1 | grep -E "^\| c|Error"
  $B --concurrency 4 --requests-per-level 32 --out "$OUT/engine_c4.json" 2>&1 | grep -E "^\| c|busy|Error"
  $B --concurrency 64,128 --requests-per-level 128 --out "$OUT/engine_high.json" 2>&1 | grep -E "^\| c|busy|Error"
  $B --rate ${RATES:-8,15} --duration 15 --out "$OUT/open.json" 2>&1 | grep -E "^\| r|busy|Error"
  $B --offline --concurrency 64 --requests-per-level 128 --out "$OUT/offline.json" 2>&1 | grep -E "^\| c|busy|Error"
elif [ "${1:-engine}" = stages ]; then
  # where the time goes: GPU tests, token-to-wave stage times, engine levels with per-level busy/stage lines
  if [ -d .fixtures ]; then
    COSYSTREAM_FIXTURES=$PWD/.fixtures/cosyvoice2-tiny python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels \
      tests/models/test_flow.py 2>&1 | tail -1
  fi
  python3 benchmarks/profile_stages.py --model-dir /tmp/m05 --only t2w --batches 1,16 --iters 5 \
    --json "$OUT/stages.json" 2>&1 | grep "^|" | grep -v "^|  *[0-9]"
  $B ${EXTRA:-} --concurrency ${LEVELS:-1,16,28} --requests-per-level 32 --out "$OUT/engine_stages.json" 2>&1 \
    | grep -E "^\| c|busy|stages|Error|Traceback"
elif [ "${1:-engine}" = ab ]; then
  # the LM/token-to-wave overlap against the serial loop; a hang dumps every thread's stack (faulthandler)
  export PYTHONFAULTHANDLER=1
  python3 benchmarks/profile_stages.py --model-dir /tmp/m05 --only t2w --batches 1 --iters 5 2>&1 | grep "^|" | grep -v kernels
  for ov in 1 0; do
    timeout -s ABRT 280 $B --config overlap_token2wav=$ov --concurrency ${LEVELS:-1,16,28} --requests-per-level 32 \
      --out "$OUT/engine_overlap$ov.json" 2>&1 | grep -E "^\| [cro]|engine busy|Error|Fatal Python|Thread 0x|File \"" | head -80
  done
elif [ "${1:-engine}" = http ]; then
  http_bench
elif [ "${1:-engine}" = engine ]; then
  if [ -d .fixtures ]; then
    COSYSTREAM_FIXTURES=$PWD/.fixtures/cosyvoice2-tiny python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels \
      tests/models/test_flow.py tests/engine/test_flow_runner.py 2>&1 | tail -1
  fi
  python3 benchmarks/profile_stages.py --model-dir /tmp/m05 --batches 1,16 --iters 10 --json "$OUT/stages.json" 2>&1 \
    | grep "^|"
  $B --concurrency 1,4,16,28 --requests-per-level 32 --out "$OUT/engine.json" --plot "$OUT/engine.png" 2>&1 \
    | grep -E "^\| c|busy|stages|Error"
  $B --concurrency 64,128 --requests-per-level 128 --out "$OUT/engine_high.json" 2>&1 | grep -E "^\| c|busy|stages|Error"
else
  $B --first-hop 15 --concurrency 1 --requests-per-level 16 --out "$OUT/hop15.json" 2>&1 | grep -E "^\| c|Error"
  $B --rate ${RATES:-8,15} --duration 15 --out "$OUT/open.json" 2>&1 | grep -E "^\| r|busy|Error"
  $B --offline --concurrency 64 --requests-per-level 128 --out "$OUT/offline.json" 2>&1 | grep -E "^\| c|busy|Error"
  http_bench
fi
