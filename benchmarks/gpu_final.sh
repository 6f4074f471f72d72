#!/usr/bin/env bash
# The device run behind docs/benchmarks.md's tables for this commit (H100, 0.5B random weights, standard
# workload). Usage on the device machine: bash benchmarks/gpu_final.sh  (writes JSON/PNG under $OUT)
source benchmarks/gpu_prep.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .fixtures ]; then COSYSTREAM_FIXTURES=$PWD/.fixtures/cosyvoice2-tiny python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels 2>&1 | tail -1; fi
POOL="--config flow_slots=28 --config flow_frames=832"
B="python3 benchmarks/bench_engine.py --model-dir /tmp/m05 --device cuda --dtype bfloat16 --warmup-requests 3 $POOL"
$B --concurrency 1,4,16,28 --requests-per-level 32 --out "$OUT/engine.json" --plot "$OUT/engine.png" 2>&1 | tail -6
$B --first-hop 15 --concurrency 1 --requests-per-level 16 --out "$OUT/hop15.json" 2>&1 | tail -1
python3 -m cosystream.cli serve --model-dir /tmp/m05 $POOL --log-level warning > /tmp/serve.log 2>&1 &
SERVER=$!
python3 benchmarks/workload.py /tmp/wl > /dev/null
python3 - <<'PY'
import time, httpx
for _ in range(300):
    try:
        if httpx.get("http://127.0.0.1:8000/ready", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
PY
python3 -m cosystream.cli bench --url http://127.0.0.1:8000 --target tts --workload /tmp/wl/workload.json \
  --concurrency 1,16 --requests-per-level 32 --warmup-requests 3 --out "$OUT/http.json" --plot "$OUT/http.png" 2>&1 | tail -4
kill $SERVER
