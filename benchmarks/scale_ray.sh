#!/usr/bin/env bash
# The scale-out over HTTP (docs/scaling.md): the single-process server and the Ray app of N replicas in ONE device
# call, on one warm machine, the standard workload (0.5B random model written there, 250 forced tokens), the
# issue's three targets measured the same way for every server:
#   c=1 first audio ($C1_REQUESTS requests): Ray within 5 ms of the single-process server;
#   a closed-loop sweep ($CAP_LEVELS streams per replica, each level $LEVEL_S s of back-to-back requests; REQS=N
#     instead: N requests per replica a level): capacity = the clean level (all accepted, played without an
#     underrun) of the highest steady aggregate, the audio s per wall s delivered while every stream of the level
#     had a request open (benchmarks/scale_table.py); Ray's against the single process's: >= 1.9x with 2 replicas,
#     >= 3.7x with 4;
#   an open loop at twice that level's request rate for $OPEN_S s: accepted first audio p99 within the budget
#     (refusals are 503 overloaded, counted apart).
# Every server runs with --first-audio-budget-s $BUDGET_S, so one start serves all three measurements. On 2x H200
# the previous defaults (40 requests at c=1, 8-32 streams per replica at 48 requests a level, 12 s of open loop)
# took 6 min 51 s in all, of which the two server starts 170 and 97 s; these were chosen to fit about the same
# time (not timed on a GPU yet).
#
# Here, once:  bash benchmarks/fetch_wheels.sh && bash benchmarks/scale_ray_wheels.sh bundle   # .whl, .whl_ray
# There, one call (carry .whl and .whl_ray):
#   REPLICAS=2 bash benchmarks/scale_ray.sh all       # prep, the single-process server, Ray with 2 replicas
#   REPLICAS="4 2" bash benchmarks/scale_ray.sh all   # ... then Ray with 4 replicas, then with 2
#   parts: prep | single | ray (REPLICAS=N or "N M") | table; RAY1=1 adds Ray with one replica (the proxy's own cost);
#   ACTOR=1 adds Ray with N replicas reached by Ray actor calls instead of the gRPC data plane (ray<N>actor)
# Results in $OUT (at most 8 files come back): <server>.json.gz (the bench JSON of its c=1, sweep and open loop:
# {"c1": ..., "sweep": ..., "open": ...}), summary.md (the table), serve_<server>.log (its log's tail, then the CPU
# use of its processes, the proxy's and each replica's, over the run: benchmarks/proc_cpu.py).
#
# On a CPU, for a dry run with the fixture model (small levels, a few tokens), after
# `python ../shared/fixtures/materialize.py ../shared/fixtures/cosyvoice2-tiny /tmp/x`:
#   OUT=/tmp/out PREP=0 MODEL=/tmp/x/model SERVE_FLAGS="--device cpu --no-warmup" FORCE_TOKENS=4 \
#   CAP_LEVELS="1 2" LEVEL_S=3 C1_REQUESTS=4 OPEN_S=3 PROCS=1 BUDGET_S=5 REPLICAS=2 bash benchmarks/scale_ray.sh all
set -u
OUT=${OUT:?set OUT to a folder for the results}
MODEL=${MODEL:-/tmp/m05}
SERVE_FLAGS=${SERVE_FLAGS:---config flow_slots=28 --config flow_frames=832}
BUDGET_S=${BUDGET_S:-0.5}
CAP_LEVELS=${CAP_LEVELS:-12 16 20 24}
LEVEL_S=${LEVEL_S:-4}
REQS=${REQS:-}
C1_REQUESTS=${C1_REQUESTS:-30}
OPEN_S=${OPEN_S:-10}
PROCS=${PROCS:-4}
REPLICAS=${REPLICAS:-2}
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT" /tmp/scale_parts
export PYTHONUNBUFFERED=1
# Ray: no usage report (the machine has no network); an object store in /tmp if /dev/shm is small (never an error)
export RAY_USAGE_STATS_ENABLED=0 RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1

stamp() { echo "== $(date +%T) $*"; }
get() { python3 -c 'import sys, httpx; print(httpx.get(sys.argv[1], timeout=10).text)' "$1" 2>/dev/null; }

prep() {
  if [ "${PREP:-1}" = 1 ]; then
    source benchmarks/gpu_prep.sh || exit 1
    bash benchmarks/scale_ray_wheels.sh install || exit 1
    nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
  fi
  export PYTHONPATH=/tmp/site_ray:${PYTHONPATH:-$PWD}
  python3 benchmarks/workload.py /tmp/wl > /dev/null || exit 1
}

bench() {  # $1: output JSON, then `cosystream bench` flags
  local out=$1; shift
  python3 -m cosystream.cli bench --url "$URL" --target tts --workload /tmp/wl/workload.json --warmup-requests 3 \
    --timeout 150 --first-audio-deadline-s "$BUDGET_S" ${FORCE_TOKENS:+--force-tokens $FORCE_TOKENS} \
    --out "$out" "$@" 2>&1 | grep -E "^\| |Error|Traceback|refused|error" | tail -20
}

levels() {  # $1: replicas; the closed-loop levels, scaled by it
  local out=() c; for c in $CAP_LEVELS; do out+=($((c * $1))); done; (IFS=,; echo "${out[*]}")
}

measure() {  # $1: server name, $2: replicas, then extra `serve` flags
  local name=$1 n=$2 t0 server; shift 2
  rm -f /tmp/scale_parts/"$name"_*.json
  stamp "$name: start"
  t0=$(date +%s)
  python3 -m cosystream.cli serve --model-dir "$MODEL" $SERVE_FLAGS --first-audio-budget-s "$BUDGET_S" \
    --port "$PORT" --log-level warning "$@" > "/tmp/serve_$name.log" 2>&1 &
  server=$!
  if ! python3 benchmarks/wait_ready.py "$URL" --pid "$server" --log "/tmp/serve_$name.log" --timeout 400; then
    tail -n 60 "/tmp/serve_$name.log" > "$OUT/serve_$name.log"; kill -INT "$server" 2>/dev/null; wait "$server"
    return 1
  fi
  for _ in $(seq 300); do  # Ray's /ready says "degraded" until every replica runs
    get "$URL/ready" | grep -q '"status":"ok"' && break; sleep 1
  done
  stamp "$name: ready after $(( $(date +%s) - t0 )) s"
  get "$URL/v1/replicas" | head -c 600; echo
  rm -f "/tmp/scale_parts/${name}_cpu.jsonl"
  python3 benchmarks/proc_cpu.py watch "/tmp/scale_parts/${name}_cpu.jsonl" --interval 1 &
  local watcher=$!
  stamp "$name: CPU of its processes sampled from now (benchmarks/proc_cpu.py)"
  stamp "$name: c=1, $C1_REQUESTS requests"
  bench "/tmp/scale_parts/${name}_c1.json" --concurrency 1 --requests-per-level "$C1_REQUESTS"
  stamp "$name: closed loop $(levels "$n")"
  local per_level=(--duration "$LEVEL_S")
  if [ -n "$REQS" ]; then per_level=(--requests-per-level $((REQS * n))); fi
  bench "/tmp/scale_parts/${name}_sweep.json" --concurrency "$(levels "$n")" "${per_level[@]}" --procs "$PROCS"
  local rate
  rate=$(python3 benchmarks/scale_table.py rate "/tmp/scale_parts/${name}_sweep.json") || rate=0
  if [ "$rate" != 0 ]; then
    stamp "$name: open loop at 2x capacity: $rate req/s for $OPEN_S s"
    bench "/tmp/scale_parts/${name}_open.json" --rate "$rate" --duration "$OPEN_S" --seed 0 --procs "$PROCS"
  else
    echo "$name: no level was clean: no open loop"
  fi
  kill "$watcher"; wait "$watcher" 2>/dev/null
  get "$URL/metrics" | grep -E '^cosystream_requests_total' | head -20
  kill -INT "$server"; wait "$server"
  tail -n 40 "/tmp/serve_$name.log" > "$OUT/serve_$name.log"
  { echo "---- CPU in cores (CPU s per wall s) per 2 s window, from the c=1 run on"
    python3 benchmarks/proc_cpu.py summary "/tmp/scale_parts/${name}_cpu.jsonl" --window 2; } \
    | tee -a "$OUT/serve_$name.log" | grep -E "busiest process at most"
  python3 benchmarks/scale_table.py pack "$OUT/$name.json.gz" "$n" /tmp/scale_parts/"$name"_{c1,sweep,open}.json
}

table() {
  python3 benchmarks/scale_table.py table --budget-s "$BUDGET_S" "$OUT"/single.json.gz "$OUT"/ray*.json.gz \
    | tee "$OUT/summary.md"
}

case "${1:-}" in
prep) prep ;;
single) prep; measure single 1 ;;
ray) prep; for n in $REPLICAS; do measure "ray$n" "$n" --replicas "$n"; done ;;
table) table ;;
all)
  prep
  measure single 1
  if [ "${RAY1:-0}" = 1 ]; then measure ray1 1 --replicas 1; fi
  for n in $REPLICAS; do measure "ray$n" "$n" --replicas "$n"; done
  if [ "${ACTOR:-0}" = 1 ]; then
    n=${REPLICAS%% *}; RAY_SERVE_PROXY_USE_GRPC=0 measure "ray${n}actor" "$n" --replicas "$n"
  fi
  table
  ;;
*) echo "scale_ray.sh: all, prep, single, ray (REPLICAS=N) or table" >&2; exit 2 ;;
esac
