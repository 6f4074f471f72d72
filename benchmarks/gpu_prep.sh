#!/usr/bin/env bash
# Prepare a fresh device machine: carried wheels (.whl, see README "GPU runs") and the 0.5B random model.
# Usage: source benchmarks/gpu_prep.sh   (sets PYTHONPATH; writes /tmp/m05 once per machine)
set -e
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:${PKG:-$PWD}  # PKG: another tree's package (e.g. .base, the baseline) ...
# ... which `python3 -m cosystream...` run from this tree would not import without this (python puts the working
# folder first on its path)
# (then the scripts' own folder, which that also keeps off python's path, goes on it by name: bench_engine.py
# imports workload.py beside it)
if [ -n "${PKG:-}" ]; then export PYTHONSAFEPATH=1 PYTHONPATH=$PYTHONPATH:$PWD/benchmarks; fi
if ! python3 -c "import soundfile, fastapi, uvicorn, wetext" 2>/dev/null; then
  echo "gpu_prep: cosystream's dependencies are missing here: carry .whl/ (bash benchmarks/fetch_wheels.sh)" >&2
  set +e
  return 1 2>/dev/null || exit 1
fi
if [ "${NO_M05:-0}" = 0 ] && [ ! -f /tmp/m05/llm.pt ]; then  # NO_M05=1: a run that needs no CosyVoice2 model
  python3 -m cosystream.cli make-random-model --size 0.5b /tmp/m05 > /tmp/make_model.log 2>&1
fi
set +e
