#!/usr/bin/env bash
# Ray Serve for the device machines, which have no package index: its wheels, carried in parts (the device tool
# moves 64 MiB per call, the working tree included; the ray wheel alone is about 79 MB).
#   bash benchmarks/scale_ray_wheels.sh fetch    # here: ray[serve] and the dependencies the device image lacks,
#                                                # for its python 3.12, in folders .whl_ray/1 .. K of <= PART_MB
#   bash benchmarks/scale_ray_wheels.sh stash    # there, one call per folder (carry .whl_ray/k): keep it in
#                                                # /tmp/ray_parts (kept while the machine stays warm)
#   bash benchmarks/scale_ray_wheels.sh install  # there, after the last: join the ray wheel, install everything
#                                                # into /tmp/site_ray (then PYTHONPATH=/tmp/site_ray:$PYTHONPATH)
# PART_MB (default 24) plus the working tree (git ls-files: about 36 MB) must stay under 64 MiB.
# .whl_ray/ is git-ignored (.gitignore); wheels are never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_VERSION=${RAY_VERSION:-2.60.0}
# installed in the device image (/work/.library/device/KINDS.md, "Python packages already there"): not carried
HAVE="aiohttp aiohappyeyeballs aiosignal annotated_types anyio attrs certifi charset_normalizer click cloudpickle
filelock frozenlist fsspec grpcio h11 httpcore httpx idna jinja2 markupsafe msgpack multidict numpy packaging pillow
prometheus_client propcache protobuf psutil pyyaml requests setuptools typing_extensions urllib3 uvloop wrapt yarl
pydantic pydantic_core starlette fastapi uvicorn typing_inspection httptools websockets"
# (the last line: cosystream's own dependencies, carried in .whl by benchmarks/fetch_wheels.sh)
PART_MB=${PART_MB:-24}

case "${1:-}" in
fetch)
  rm -rf .whl_ray && mkdir -p .whl_ray/all
  PLAT=()
  for n in 17 24 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl_ray/all "ray[serve]==$RAY_VERSION"
  for wheel in .whl_ray/all/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z.-' 'a-z__')
    if grep -qw "$name" <<< "$HAVE"; then rm "$wheel"; fi
  done
  ray_wheel=$(ls .whl_ray/all/ray-*.whl)
  split -b "$((PART_MB - 1))M" -d -a 2 "$ray_wheel" "$ray_wheel.part"
  rm "$ray_wheel"
  python3 - "$PART_MB" <<'PY'
import shutil, sys
from pathlib import Path
limit = int(sys.argv[1]) * 1024 * 1024
files = sorted(Path(".whl_ray/all").iterdir(), key=lambda f: f.stat().st_size, reverse=True)
bins: list[list] = []  # first fit, largest first
for f in files:
    for b in bins:
        if b[0] + f.stat().st_size <= limit:
            b[0] += f.stat().st_size
            b[1].append(f)
            break
    else:
        bins.append([f.stat().st_size, [f]])
for i, (_, members) in enumerate(bins, 1):
    (Path(".whl_ray") / str(i)).mkdir()
    for f in members:
        shutil.move(str(f), str(Path(".whl_ray") / str(i) / f.name))
PY
  rmdir .whl_ray/all
  du -sh .whl_ray/*
  ;;
stash)
  mkdir -p /tmp/ray_parts && cp .whl_ray/*/* /tmp/ray_parts/ && du -sh /tmp/ray_parts
  ;;
install)
  mkdir -p /tmp/ray_parts /tmp/ray_wheels && cp .whl_ray/*/* /tmp/ray_parts/ 2>/dev/null || true
  for first in /tmp/ray_parts/*.part00; do cat "${first%.part00}".part* > "/tmp/ray_wheels/$(basename "${first%.part00}")"; done
  cp /tmp/ray_parts/*.whl /tmp/ray_wheels/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_ray /tmp/ray_wheels/*.whl
  PYTHONPATH=/tmp/site_ray:${PYTHONPATH:-} python3 -c "import ray, ray.serve; print('ray', ray.__version__)"
  ;;
*)
  echo "scale_ray_wheels.sh: fetch (here), stash or install (on the device)" >&2; exit 2
  ;;
esac
