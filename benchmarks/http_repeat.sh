#!/usr/bin/env bash
# Repeated HTTP runs against one server per configuration: c=1 and c=16 (80 requests each) RUNS times, then c=1
# with a first hop of 15 tokens. CONFIGS: space-separated server configurations, "defaults" (no --config) or
# one EngineConfig FIELD=VALUE item each. CLIENTS: the load generator's HTTP clients, each run in turn against the
# same server (default httpx; "httpx raw" for an A/B). JSON under $OUT: http_<config>[_<client>]_r<n>.json,
# http_<config>_hop15.json (first client).
#   CONFIGS="defaults gc_freeze=false" RUNS=3 C=<commit> bash benchmarks/http_repeat.sh
#   CLIENTS="httpx raw" RUNS=2 C=<commit> bash benchmarks/http_repeat.sh
source benchmarks/gpu_prep.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 benchmarks/workload.py /tmp/wl > /dev/null
BENCH="python3 -m cosystream.cli bench --url http://127.0.0.1:8000 --target tts --workload /tmp/wl/workload.json \
  --warmup-requests 3 --tag commit=${C:-unknown}"
for cfg in ${CONFIGS:-defaults}; do
  name=${cfg//=/_}
  extra=(); [ "$cfg" = defaults ] || extra=(--config "$cfg")
  python3 -m cosystream.cli serve --model-dir /tmp/m05 "${extra[@]}" > "/tmp/serve_$name.log" 2>&1 &
  server=$!
  python3 benchmarks/wait_ready.py --pid "$server" --log "/tmp/serve_$name.log" || continue
  clients=(${CLIENTS:-httpx})
  for r in $(seq 1 "${RUNS:-3}"); do
    for client in "${clients[@]}"; do
      suffix=""; [ "${#clients[@]}" -gt 1 ] && suffix="_$client"
      echo "== $cfg run $r, client $client"
      $BENCH --http-client "$client" --concurrency 1,16 --requests-per-level 80 --tag "config=$cfg" \
        --tag "client=$client" --out "$OUT/http_${name}${suffix}_r$r.json" 2>&1 | grep -E "^\| c|^\| level \| requests|Error|Traceback"
    done
  done
  echo "== $cfg first hop 15"
  $BENCH --http-client "${clients[0]}" --first-hop 15 --concurrency 1 --requests-per-level 32 --tag "config=$cfg" --out "$OUT/http_${name}_hop15.json" \
    2>&1 | grep -E "^\| c|^\| level \| requests|Error|Traceback"
  kill "$server"; wait "$server" 2>/dev/null
done
