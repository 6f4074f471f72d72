#!/usr/bin/env bash
# Sourced by the HTTP benchmark scripts: `cosystream serve` on /tmp/m05 (the standard pool) in the background at
# log level ${SERVE_LOG_LEVEL:-info} (/tmp/serve.log), the standard workload in /tmp/wl, then waits until the
# server answers /ready. Sets SERVER (its pid). SERVE_ARGS: more `serve` flags, e.g. "--first-audio-budget-s 0.5"
# (the default budget is 1 s; "--first-audio-budget-s off" for none). PORT: its port (8000).
PORT=${PORT:-8000}
python3 -m cosystream.cli serve --model-dir /tmp/m05 --config flow_slots=28 --config flow_frames=832 ${SERVE_ARGS:-} \
  --port "$PORT" --log-level "${SERVE_LOG_LEVEL:-info}" > "/tmp/serve_$PORT.log" 2>&1 &
SERVER=$!
[ -f /tmp/wl/workload.json ] || python3 benchmarks/workload.py /tmp/wl > /dev/null
python3 benchmarks/wait_ready.py "http://127.0.0.1:$PORT" --pid "$SERVER" --log "/tmp/serve_$PORT.log" \
  || return 1 2>/dev/null || exit 1
