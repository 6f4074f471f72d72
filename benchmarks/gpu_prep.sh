#!/usr/bin/env bash
# Prepare a fresh device machine: carried wheels (.whl, see README "GPU runs") and the 0.5B random model.
# Usage: source benchmarks/gpu_prep.sh   (sets PYTHONPATH; writes /tmp/m05 once per machine)
set -e
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
if [ ! -f /tmp/m05/llm.pt ]; then
  python3 -m cosystream.cli make-random-model --size 0.5b /tmp/m05 > /tmp/make_model.log 2>&1
fi
set +e
