#!/usr/bin/env bash
# Sourced by the HTTP benchmark scripts: `cosystream serve` on /tmp/m05 (the standard pool) in the background at
# log level ${SERVE_LOG_LEVEL:-info} (/tmp/serve.log), the standard workload in /tmp/wl, then waits until the
# server answers /ready. Sets SERVER (its pid). SERVE_ARGS: more `serve` flags, e.g. "--first-audio-budget-s 0.5"
# (the default budget is 1 s; "--first-audio-budget-s off" for none).
python3 -m cosystream.cli serve --model-dir /tmp/m05 --config flow_slots=28 --config flow_frames=832 ${SERVE_ARGS:-} \
  --log-level "${SERVE_LOG_LEVEL:-info}" > /tmp/serve.log 2>&1 &
SERVER=$!
python3 benchmarks/workload.py /tmp/wl > /dev/null
python3 benchmarks/wait_ready.py --pid "$SERVER" --log /tmp/serve.log || return 1 2>/dev/null || exit 1
