#!/usr/bin/env bash
# c=16 over HTTP from one load-generator process and from 2 and 4 processes (8 and 4 streams each), started
# together at one wall-clock time; two rounds. Answers: is the load generator's own CPU part of the c=16 first
# audio? The server's request_done lines (engine stage times) come back with the JSON.
#   C=<hash> bash benchmarks/split_clients.sh
source benchmarks/gpu_prep.sh || exit 1; mkdir -p $OUT
source benchmarks/serve_bg.sh || exit 1
BN="python3 -m cosystream.cli bench --url http://127.0.0.1:8000 --target tts --workload /tmp/wl/workload.json --tag commit=$C"
$BN --concurrency 1 --requests-per-level 8 --warmup-requests 3 --out $OUT/warm.json > /dev/null 2>&1
for r in 1 2; do
  for p in 1 2 4; do
    c=$((16 / p)); n=$((80 / p))
    pids=""; T=$(python3 -c "import time; print(time.time() + 4)")
    for i in $(seq 1 $p); do
      python3 -c "import sys, time; from cosystream.cli import main; import cosystream.bench.cli, cosystream.bench.clients; time.sleep(max(0.0, float(sys.argv[1]) - time.time())); sys.exit(main(sys.argv[2:]))" $T bench --url http://127.0.0.1:8000 --target tts --workload /tmp/wl/workload.json --tag commit=$C --no-register-voice --concurrency $c --requests-per-level $n --warmup-requests 0 --out $OUT/split_r${r}_p${p}_$i.json > /dev/null 2>&1 &
      pids="$pids $!"
    done
    wait $pids
    echo "round $r procs $p done"
  done
done
kill $SERVER; sleep 2; grep request_done /tmp/serve.log > $OUT/serve_requests.log
