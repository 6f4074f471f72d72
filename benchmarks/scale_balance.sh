#!/usr/bin/env bash
# How evenly the Ray app's router spreads a closed loop's streams over its replicas, on a CPU: the app of 2
# replicas serving the stand-in engine of benchmarks/scale_overhead.py (every request the standard workload's
# audio on a fixed timetable, so every stream takes as long whatever its replica's load, and the requests of a
# level come in waves as on a GPU), `cosystream bench` closed loops of $LEVELS streams for $LEVEL_S s each, then per
# level the requests each replica served and the busiest replica's share of the streams open at a time
# (benchmarks/scale_table.py's busiest_share: 50 % is even at every moment).
#
#   python ../shared/fixtures/materialize.py ../shared/fixtures/cosyvoice2-tiny /tmp/x
#   MODEL=/tmp/x/model OUT=/tmp/balance bash benchmarks/scale_balance.sh
set -eu
MODEL=${MODEL:?set MODEL to a model directory (the fixture model is enough)}
OUT=${OUT:?set OUT to a folder for the results}
PORT=${PORT:-8791}
LEVELS=${LEVELS:-16 32}
LEVEL_S=${LEVEL_S:-8}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
cd "$ROOT"
python3 benchmarks/workload.py "$OUT/wl" > /dev/null
python3 benchmarks/scale_overhead.py serve-ray --replicas 2 --port "$PORT" --model-dir "$MODEL" > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 400); do curl -sf "http://127.0.0.1:$PORT/ready" > /dev/null && break; sleep 1; done
bench() {
  python3 -m cosystream.cli bench --url "http://127.0.0.1:$PORT" --target tts --workload "$OUT/wl/workload.json" \
    --force-tokens 250 --timeout 60 "$@"
}
bench --out "$OUT/warm.json" --concurrency 1 --requests-per-level 4 --warmup-requests 0 > /dev/null 2>&1  # registers the voice
for c in $LEVELS; do
  bench --out "$OUT/c$c.json" --concurrency "$c" --duration "$LEVEL_S" --warmup-requests 0 --no-register-voice \
    | grep "^c=" || true
  python3 - "$OUT/c$c.json" <<'PY'
import json, sys
from benchmarks.scale_table import busiest_share, replica_split
run = json.load(open(sys.argv[1]))
requests = [r for r in run["requests"] if r["level"] != "warmup"]
split = ", ".join(f"{replica}: {n} served" for replica, (n, _) in replica_split(requests).items())
share = busiest_share(requests)
print(f"  {split}; busiest replica's share of the open streams: {share:.1%}" if share else "  no replica in the records")
PY
done
