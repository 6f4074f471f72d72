#!/usr/bin/env bash
# Where first audio goes over HTTP: `cosystream serve` at log level info (each request's request_done line
# carries the engine's stage times beside the server's first audio), `cosystream bench` at c=1 and c=16, then
# the in-process engine at c=16 on the same machine (ENGINE=0: not). C=<commit> names the run.
#   C=<hash> bash benchmarks/http_stages.sh      (JSON and the request_done lines under $OUT)
source benchmarks/gpu_prep.sh || exit 1; mkdir -p $OUT
source benchmarks/serve_bg.sh || exit 1
python3 -m cosystream.cli bench --url http://127.0.0.1:8000 --target tts --workload /tmp/wl/workload.json --concurrency 1,16 --requests-per-level 80 --warmup-requests 3 --out $OUT/http.json --tag commit=$C 2>&1 | grep -E "^\| c"
kill $SERVER; sleep 2; grep -E "request_done" /tmp/serve.log > $OUT/serve_requests.log; wc -l $OUT/serve_requests.log
[ "${ENGINE:-1}" = 0 ] || python3 benchmarks/bench_engine.py --model-dir /tmp/m05 --device cuda --dtype bfloat16 --warmup-requests 3 --config flow_slots=28 --config flow_frames=832 --concurrency 16 --requests-per-level 80 --out $OUT/engine_c16.json 2>&1 | grep -E "^\| c"
