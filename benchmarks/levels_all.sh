#!/usr/bin/env bash
# Every table of docs/benchmarks.md for one commit on one GPU machine, in parts that each fit a ten-minute
# device call and write at most 8 files under $OUT. Timestamps between steps show what each step cost.
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/levels_all.sh check      # GPU tests, floor, stage times, c=1..128 in-process
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/levels_all.sh more       # first hop 15, open loop (seeds 0-2), offline
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/levels_all.sh http       # over HTTP: c=1 and c=16 (httpx, raw), first hop 15
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/levels_all.sh http_open  # over HTTP: the open loop at 15 req/s, SEEDS (0 1)
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/levels_all.sh open       # in-process open loop at 8, 16, 17 req/s
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/levels_all.sh voices     # zero-shot (same / new recording), 16 s
#                                                                     # utterances, a 20 s prompt
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/levels_all.sh zeroshot_analysis  # prompt analysis on the released
#                                                     # side-model architectures: times, bf16/fp16 token agreement
#   COSYSTREAM_COMMIT=<hash> bash benchmarks/levels_all.sh zeroshot   # c=1,16: registered voice, a new recording
#                                                     # each request (with and without prompt passes ahead)
#   SERVE_ARGS="--first-audio-budget-s 0.5" CAPACITY=21 MULTS="1 2 4" SEEDS="0 1 2" [CLOSED=1,16] \
#     COSYSTREAM_COMMIT=<hash> bash benchmarks/levels_all.sh overload  # over HTTP: open loop at MULTS x CAPACITY req/s
#                                                     # (CLOSED: closed-loop levels on the same server first)
#   (then: python3 benchmarks/open_loop_table.py --first-audio-deadline-s 0.5 $OUT/overload_*.json; PROCS=4 splits
#   the client over 4 processes, so that its own event loop adds less to the refusal times it measures; the table
#   prints the server's refusal times beside the client's either way)
source benchmarks/gpu_prep.sh || exit 1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
C=${COSYSTREAM_COMMIT:-unknown}
B="python3 benchmarks/bench_engine.py --model-dir /tmp/m05 --device cuda --dtype bfloat16 --warmup-requests 3 \
  --timeout 150 --config flow_slots=28 --config flow_frames=832"
stamp() { echo "== $(date +%T) $*"; }
rows() { grep -E "^\| [cro]|^\| level|busy|Error|Traceback"; }
metrics() {  # the server's /metrics page (a level's GPU time: benchmarks/metrics_delta.py of two of them)
  python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "http://127.0.0.1:$PORT/metrics"
}

case "${1:-check}" in
check)
  stamp tests
  if [ -d .fixtures ]; then
    COSYSTREAM_FIXTURES=$PWD/.fixtures/cosyvoice2-tiny timeout 300 python3 -m pytest -q -p no:cacheprovider \
      tests/gpu tests/kernels > "$OUT/tests.log" 2>&1
    tail -3 "$OUT/tests.log"
  fi
  stamp floor
  timeout 60 python3 benchmarks/floor.py 2>&1 | tee "$OUT/floor.txt"
  stamp stages
  timeout 150 python3 benchmarks/profile_stages.py --model-dir /tmp/m05 --batches 1,16 --iters 10 \
    --json "$OUT/stages.json" 2>&1 | grep "^|"
  stamp "closed loop c=1,4,16 (64 a level)"
  timeout 200 $B --concurrency 1,4,16 --requests-per-level 64 --out "$OUT/engine_low.json" 2>&1 | rows
  stamp "closed loop c=64,128 (128 a level)"
  timeout 200 $B --concurrency 64,128 --requests-per-level 128 --out "$OUT/engine_high.json" 2>&1 | rows
  stamp done
  ;;
more)
  stamp "first hop 15"
  timeout 120 $B --first-hop 15 --concurrency 1 --requests-per-level 32 --out "$OUT/hop15.json" 2>&1 | rows
  for seed in 0 1 2; do
    stamp "open loop 15 req/s seed $seed"
    timeout 120 $B --rate 15 --duration 15 --seed "$seed" --out "$OUT/open_s$seed.json" 2>&1 | rows
  done
  stamp "offline c=64"
  timeout 120 $B --offline --concurrency 64 --requests-per-level 128 --out "$OUT/offline.json" 2>&1 | rows
  stamp done
  ;;
http)
  stamp "server start"
  SERVE_LOG_LEVEL=warning source benchmarks/serve_bg.sh || exit 1
  BENCH="python3 -m cosystream.cli bench --url http://127.0.0.1:$PORT --target tts --workload /tmp/wl/workload.json \
    --warmup-requests 3 --tag commit=$C"
  for run in 1 2; do
    stamp "c=1,16 over HTTP, run $run"
    timeout 100 $BENCH --concurrency 1,16 --requests-per-level 80 --out "$OUT/http_r$run.json" 2>&1 | rows
  done
  stamp "first hop 15 over HTTP"
  timeout 60 $BENCH --first-hop 15 --concurrency 1 --requests-per-level 32 --out "$OUT/http_hop15.json" 2>&1 | rows
  kill "$SERVER"; wait "$SERVER" 2>/dev/null
  stamp done
  ;;
http_open)
  stamp "server start"
  SERVE_LOG_LEVEL=warning source benchmarks/serve_bg.sh || exit 1
  for seed in ${SEEDS:-0 1}; do
    stamp "open loop 15 req/s over HTTP, seed $seed"
    timeout 100 python3 -m cosystream.cli bench --url http://127.0.0.1:$PORT --target tts --workload /tmp/wl/workload.json \
      --warmup-requests 3 --tag commit=$C --rate 15 --duration 15 --seed "$seed" --out "$OUT/http_open_s$seed.json" 2>&1 | rows
  done
  kill "$SERVER"; wait "$SERVER" 2>/dev/null
  stamp done
  ;;
overload)
  # issue 34's table: Poisson arrivals at 1x, 2x and 4x the closed-loop capacity (CAPACITY req/s), against a
  # server with SERVE_ARGS (its admission budget); 15 s of arrivals a level, each seed a level of its own
  stamp "server start ($SERVE_ARGS)"
  SERVE_LOG_LEVEL=warning source benchmarks/serve_bg.sh || exit 1
  if [ -n "${CLOSED:-}" ]; then  # the closed-loop targets on the same server first (e.g. CLOSED=1,16)
    stamp "closed loop c=$CLOSED over HTTP, ${CLOSED_REQS:-48} requests a level"
    metrics > "$OUT/metrics_closed_before.txt"
    timeout 150 python3 -m cosystream.cli bench --url "http://127.0.0.1:$PORT" --target tts \
      --workload /tmp/wl/workload.json --warmup-requests 3 --tag commit=$C --tag "serve=$SERVE_ARGS" \
      --concurrency "$CLOSED" --requests-per-level "${CLOSED_REQS:-48}" --timeout 60 \
      --out "$OUT/closed.json" 2>&1 | rows
    metrics > "$OUT/metrics_closed_after.txt"
  fi
  for mult in ${MULTS:-1 2 4}; do
    rate=$(python3 -c "print(round(${CAPACITY:-21} * $mult, 2))")
    for seed in ${SEEDS:-0 1 2}; do
      stamp "open loop ${rate} req/s (${mult}x) over HTTP, seed $seed"
      metrics > "$OUT/metrics_x${mult}_s${seed}_before.txt"
      timeout 150 python3 -m cosystream.cli bench --url "http://127.0.0.1:$PORT" --target tts \
        --workload /tmp/wl/workload.json --warmup-requests 3 --tag commit=$C --tag "serve=$SERVE_ARGS" --rate "$rate" \
        --duration "${DURATION:-15}" --seed "$seed" \
        --timeout 60 --procs "${PROCS:-1}" --out "$OUT/overload_x${mult}_s$seed.json" 2>&1 | rows
      metrics > "$OUT/metrics_x${mult}_s${seed}_after.txt"
    done
  done
  python3 benchmarks/metrics_delta.py --dir "$OUT" --json "$OUT/overload_levels.json"  # each level's GPU time
  # admission's own account: prediction error, refusal times at the server, deadline misses by stage
  metrics > "$OUT/overload_metrics.txt" && grep -E "^cosystream_(first_audio_prediction_error|refusal)_seconds_(count|bucket)|^cosystream_(deadline_miss|admission)" \
    "$OUT/overload_metrics.txt" | grep -v "_created"
  kill "$SERVER"; wait "$SERVER" 2>/dev/null
  stamp done
  ;;
open)
  stamp "open loop 8, 16, 17 req/s, seed 0"
  timeout 300 $B --rate 8,16,17 --duration 15 --seed 0 --out "$OUT/open_overload.json" 2>&1 | rows
  stamp done
  ;;
voices)
  stamp "zero-shot: the same recording in every request"
  timeout 120 $B --prompt-per-request --concurrency 1,4,16 --requests-per-level 32 \
    --out "$OUT/zeroshot_same.json" 2>&1 | rows
  stamp "zero-shot: a new recording in every request"
  timeout 120 $B --prompt-per-request --distinct-prompts --concurrency 1,4,16 --requests-per-level 32 \
    --out "$OUT/zeroshot_distinct.json" 2>&1 | rows
  stamp "16 s utterances (400 tokens, past a flow slot)"
  timeout 120 $B --force-tokens 400 --concurrency 1,4,16 --requests-per-level 16 --out "$OUT/long400.json" 2>&1 | rows
  stamp "a 20 s prompt (longer than a flow slot)"
  python3 benchmarks/workload.py /tmp/wl20 --prompt-seconds 20 > /dev/null
  timeout 180 $B --prompt-wav /tmp/wl20/voice.wav --concurrency 1,4,16 --requests-per-level 16 \
    --out "$OUT/prompt20s.json" 2>&1 | rows
  stamp done
  ;;
zeroshot_analysis|zeroshot)
  # issue 38: the released side-model architectures at full size (random weights) beside /tmp/m05's other files
  if [ ! -f /tmp/m05r/.realistic ]; then
    stamp "realistic side models into /tmp/m05r"
    mkdir -p /tmp/m05r && for f in /tmp/m05/*; do ln -sfn "$f" /tmp/m05r/; done
    python3 -m cosystream.testing.realistic_side_models /tmp/m05r && touch /tmp/m05r/.realistic
  fi
  R="${B//\/tmp\/m05 /\/tmp\/m05r }"
  if [ "$1" = zeroshot_analysis ]; then
    stamp "prompt analysis: float32 / bfloat16 / float16 against onnxruntime float32, batches 1, 4, 16"
    timeout 400 python3 benchmarks/prompt_analysis.py --model-dir /tmp/m05r --device cuda --seconds 6 \
      --batch-sizes 1,4,16 --dtypes float32,bfloat16,float16 --speaker-threads 8 --out "$OUT/prompt_analysis.json"
  else
    # ZS_RUNS: which of the three runs (default all: registered distinct no_open_ahead)
    runs=" ${ZS_RUNS:-registered distinct no_open_ahead} "
    if [[ $runs == *" registered "* ]]; then
      stamp "registered voice, c=1,16"
      timeout 300 $R --concurrency "${ZS_LEVELS:-1,16}" --requests-per-level "${ZS_REQS:-64}" --out "$OUT/zs_registered.json" 2>&1 \
        | rows
      [ -f "$OUT/zs_registered.json" ] && python3 benchmarks/first_audio_path.py "$OUT/zs_registered.json"
    fi
    if [[ $runs == *" distinct "* ]]; then
      stamp "a new recording in every request, c=1,16"
      # ZS_WARMUP=0: no warm-up requests, so the first wave meets the engine as its own warm-up left it
      timeout 300 $R --prompt-per-request --distinct-prompts --concurrency "${ZS_LEVELS:-1,16}" --requests-per-level "${ZS_REQS:-64}" \
        ${ZS_WARMUP:+--warmup-requests "$ZS_WARMUP"} --out "$OUT/zs_distinct.json" 2>&1 | rows
      # where the first audio waits, level by level (stage medians beside the worker's record)
      [ -f "$OUT/zs_distinct.json" ] && python3 benchmarks/first_audio_path.py "$OUT/zs_distinct.json"
    fi
    if [[ $runs == *" no_open_ahead "* ]]; then
      stamp "the same, prompt passes with the first chunk only (open_ahead=false)"
      timeout 300 $R --config open_ahead=false --prompt-per-request --distinct-prompts --concurrency 1,16 \
        --requests-per-level "${ZS_REQS:-64}" --out "$OUT/zs_distinct_no_open_ahead.json" 2>&1 | rows
      [ -f "$OUT/zs_distinct_no_open_ahead.json" ] && python3 benchmarks/first_audio_path.py \
        "$OUT/zs_distinct_no_open_ahead.json"
    fi
  fi
  stamp done
  ;;
*)
  echo "levels_all.sh: unknown part '$1' (check, more, http, http_open, overload, open, voices, zeroshot_analysis" \
    "or zeroshot)" >&2; exit 2
  ;;
esac
