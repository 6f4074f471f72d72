#!/usr/bin/env bash
# c=16 over HTTP measured from one load-generator process and from four (`cosystream bench --procs`), two
# interleaved rounds against one server; the server's request_done lines (engine stage times) come back too.
#   C=<hash> bash benchmarks/http_procs.sh      (JSON under $OUT)
source benchmarks/gpu_prep.sh || exit 1; mkdir -p "$OUT"
source benchmarks/serve_bg.sh || exit 1
BN="python3 -m cosystream.cli bench --url http://127.0.0.1:8000 --target tts --workload /tmp/wl/workload.json --tag commit=$C"
for r in 1 2; do
  for p in 1 4; do
    echo "== round $r procs $p"
    $BN --concurrency 16 --requests-per-level 80 --warmup-requests 3 --procs $p --out "$OUT/http_procs${p}_r$r.json" 2>&1 \
      | grep -E "^\| c|rror"
  done
done
kill $SERVER; sleep 2; grep request_done /tmp/serve.log > "$OUT/serve_requests.log"
