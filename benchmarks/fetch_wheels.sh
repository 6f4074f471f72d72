#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks (its image has torch, numpy, onnxruntime, transformers,
# prometheus-client, httpx, uvloop ... but not the server's and the frontend's packages) into .whl/ (git-ignored).
# Carry ".whl" in the device call; benchmarks/gpu_prep.sh installs them there into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(
  annotated-types==0.7.0 anyascii==0.3.3 cffi==2.0.0 contractions==0.1.73 fastapi==0.165.0 httptools==0.9.0 inflect==7.6.0
  jaraco.functools==4.6.0 kaldifst==1.8.3 more-itertools==11.2.1 opentelemetry-api==1.45.2
  pyahocorasick==2.3.1 pycparser==3.0 pydantic==2.13.4 pydantic-core==2.46.4 pytest-asyncio==1.5.0
  python-multipart==0.0.34 soundfile==0.14.0 soxr==1.1.0 starlette==1.10.0 textsearch==0.0.24
  typeguard==4.6.1 typing-inspection==0.4.2 uvicorn==0.54.0 websockets==17.4 wetext==0.1.8
)
PLAT=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64; do
  PLAT+=(--platform "$p")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLAT[@]}" -d .whl "${PKGS[@]}"
ls .whl | wc -l
