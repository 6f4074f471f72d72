#!/usr/bin/env bash
# The scale-out over HTTP on a 2- or 4-GPU machine (docs/scaling.md): one replica's numbers and N replicas' in
# the same lease, the standard workload (0.5B random model, 250 forced tokens), `cosystream bench` unchanged.
# Each part fits one device call of under ten minutes, all on one warm machine (nvidia-h100-x2 or -x4). The
# wheels travel first: here `bash benchmarks/fetch_wheels.sh` (.whl) and `bash benchmarks/scale_ray_wheels.sh
# fetch` (.whl_ray/1 .. K, K = 5 for ray 2.60 at PART_MB=24), then on the device:
#   calls 1 .. K-1 (carry .whl_ray/k):     bash benchmarks/scale_ray.sh stash
#   call K (carry .whl .whl_ray/K):        bash benchmarks/scale_ray.sh single   # installs ray, then 1 GPU
#   next call:                             REPLICAS=2 bash benchmarks/scale_ray.sh ray   # (4 on 4 GPUs)
#   optional:                              REPLICAS=1 bash benchmarks/scale_ray.sh ray   # the proxy's cost, 1 GPU
# What each part measures, per server:
#   c=1 first audio (80 requests): the issue's "within 5 ms of the single-process server";
#   a closed-loop sweep (CAP_LEVELS x replicas): capacity = the highest level with zero underrun requests and no
#     errors, and its requests/s;
#   an open loop at twice that rate for 20 s on a server restarted with --first-audio-budget-s $BUDGET_S:
#     accepted p99 against the budget (refusals are 503 overloaded and counted apart).
# Results: $OUT/<part>_*.json (bench JSON), $OUT/<part>_summary.txt.
if [ "${1:-}" = stash ]; then  # a part of the wheels only: nothing else is needed yet
  exec bash benchmarks/scale_ray_wheels.sh stash
fi
source benchmarks/gpu_prep.sh || exit 1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site_ray:$PYTHONPATH
BUDGET_S=${BUDGET_S:-0.5}
CAP_LEVELS=${CAP_LEVELS:-16 32 48 64 96}
stamp() { echo "== $(date +%T) $*"; }
rows() { grep -E "^\| [cro]|^\| level|Error|Traceback"; }
BENCH="python3 -m cosystream.cli bench --url http://127.0.0.1:8000 --target tts --workload /tmp/wl/workload.json \
  --warmup-requests 3 --timeout 150"
SERVE="python3 -m cosystream.cli serve --model-dir /tmp/m05 --config flow_slots=28 --config flow_frames=832 \
  --log-level warning"

levels() {  # $1: per-replica multiplier; echoes the concurrency levels
  local out=() c; for c in $CAP_LEVELS; do out+=($((c * $1))); done; (IFS=,; echo "${out[*]}")
}

start() {  # the server, with any extra `serve` flags; sets SERVER
  $SERVE "$@" > /tmp/serve.log 2>&1 &
  SERVER=$!
  python3 benchmarks/wait_ready.py --pid "$SERVER" --log /tmp/serve.log --timeout 400
}

stop() { kill -INT "$SERVER"; wait "$SERVER" 2>/dev/null; }

measure() {  # $1: part name, $2: replicas (levels scale with it), then extra `serve` flags
  local name=$1 n=$2; shift 2
  start "$@" || exit 1
  curl -s http://127.0.0.1:8000/v1/replicas | head -c 1500; echo
  stamp "$name: c=1 first audio"
  timeout 120 $BENCH --concurrency 1 --requests-per-level 80 --out "$OUT/${name}_c1.json" 2>&1 | rows
  stamp "$name: closed loop $(levels "$n")"
  timeout 300 $BENCH --concurrency "$(levels "$n")" --requests-per-level $((128 * n)) --out "$OUT/${name}_sweep.json" \
    2>&1 | rows
  curl -s http://127.0.0.1:8000/metrics | grep -E "^cosystream_requests_total" > "$OUT/${name}_requests.txt"
  stop
  rate=$(python3 - "$OUT/${name}_sweep.json" <<'PY'
import json, sys
levels = json.load(open(sys.argv[1]))["levels"]
clean = [l for l in levels if l["underrun_requests"] == 0 and l["num_errors"] == 0 and l["num_ok"] == l["num_requests"]]
best = max(clean, key=lambda l: l["value"], default=None)
print(f"{2 * best['achieved_rate']:.2f}" if best else "0")
print(f"capacity: {best['level'] if best else 'none'} at {best['achieved_rate'] if best else 0:.2f} req/s "
      f"({best['aggregate_rtf'] if best else 0:.1f}x real time), zero underruns", file=sys.stderr)
PY
  )
  [ "$rate" != "0" ] || return
  stamp "$name: open loop at 2x capacity: $rate req/s, --first-audio-budget-s $BUDGET_S"
  start "$@" --first-audio-budget-s "$BUDGET_S" || exit 1
  timeout 120 $BENCH --rate "$rate" --duration 20 --seed 0 --out "$OUT/${name}_open.json" 2>&1 | rows
  stop
}

case "${1:-}" in
single)
  bash benchmarks/scale_ray_wheels.sh install || exit 1
  stamp "single-process server"
  python3 benchmarks/workload.py /tmp/wl > /dev/null
  measure single 1 2>&1 | tee "$OUT/single_summary.txt"
  ;;
ray)
  N=${REPLICAS:-2}
  python3 -c "import ray" 2>/dev/null || { echo "ray is not installed here: run the 'single' part first" >&2; exit 1; }
  stamp "Ray Serve, $N replicas"
  python3 benchmarks/workload.py /tmp/wl > /dev/null
  measure "ray$N" "$N" --replicas "$N" 2>&1 | tee "$OUT/ray${N}_summary.txt"
  ;;
*)
  echo "scale_ray.sh: stash, single or ray (REPLICAS=N)" >&2; exit 2
  ;;
esac
