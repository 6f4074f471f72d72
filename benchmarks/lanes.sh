#!/usr/bin/env bash
# Several measurements at once on one multi-GPU machine, one lane per GPU group, so that a before/after pair
# (or a scale-out run beside them) shares one lease and one machine start. Each lane runs its parts in order
# with CUDA_VISIBLE_DEVICES set to its GPUs and a port of its own; its results and log go to one archive,
# $OUT/lane_<name>.tar.gz (the device call brings back at most 8 files).
#
#   COSYSTREAM_COMMIT=<hash> SERVE_ARGS="--first-audio-budget-s 0.5" CAPACITY=22 SEEDS="0 1 2" PROCS=4 \
#     DURATION=10 ZS_REQS=32 bash benchmarks/lanes.sh "ray=0,1:scale_ray,prompt_analysis" \
#     "base=2:overload_base,zeroshot" "new=3:overload,cv3"
#
# A lane is NAME=GPUS:PART[,PART...]; parts:
#   scale_ray      REPLICAS=${REPLICAS:-2} bash benchmarks/scale_ray.sh all (the single-process server and Ray)
#   scale_single, scale_rayonly  its single-process half and its Ray half, each in a lane of its own (the same
#                  lease, at once; `OUT=<folder with both> bash benchmarks/scale_ray.sh table` joins them)
#   overload       levels_all.sh overload on this tree (SERVE_ARGS, CAPACITY, MULTS, SEEDS, PROCS, DURATION as
#                  there), with the scheduler's decision trace (COSYSTREAM_TRACE)
#   overload_default, overload_default@DIR  the same with the server's default admission budget (SERVE_ARGS
#                  ignored), on this tree or the package in DIR
#   overload_base  the same on the baseline package in .base (git archive <commit> cosystream benchmarks | tar
#                  -x -C .base), the benchmark scripts of this tree; BASE_MULTS, BASE_SEEDS: its own levels
#   overload@DIR   the same on the package in DIR (another carried `git archive` folder, e.g. .v1): several
#                  variants against one baseline in one lease
#   cv3            CosyVoice3 0.5B random model: the pooled flow per chunk (cv3_fast.py), the engine at 1 and 16
#                  streams and offline (bench_engine.py; CV3_OFFLINE=0: not offline)
#   cv3_offline    CosyVoice3 0.5B offline (stream=False), 32 at once
#   cv3_tests      CosyVoice3 GPU tests: compiled kernels vs reference, graphed pool vs eager, the fixtures
#   cv3_http       CosyVoice3 0.5B over HTTP, one stream
#   zeroshot       levels_all.sh zeroshot (registered voice and a new recording each request, ZS_LEVELS (c=1,16); ZS_RUNS;
#                  ZS_TRACE=1: with the scheduler's decision trace; ZS_WARMUP=0: the new recordings without warm-up
#                  requests, e.g. first in a lease: does the first wave wait for first-use costs?)
#   zeroshot@DIR   the same on the package in DIR (e.g. a prompt-batcher variant in .v3)
#   zeroshot_http  a new recording in every /v1/tts request over HTTP (cosystream bench --distinct-prompts), c=1,16
#   open_profile   benchmarks/open_profile.py: the worker's opening of waves of 16 new voices
#   prompt_pass    benchmarks/prompt_pass.py: a wave of new voices' prompt pass alone on the GPU, by part, then
#                  the kernels of one eager pass of each of PP_PROFILE (15 1) voices by GPU time
#   flow_tiles     benchmarks/flow_tiles.py (FT_ARGS): the flow kernels' launch tiles at the engine's shapes
#   pool_copies    benchmarks/pool_copies.py: the flow pool's big copies, element by element against words
#   gpu_tests      the engine's GPU tests (CUDA against the CPU, the engine on CUDA)
#   prompt_analysis  benchmarks/prompt_analysis.py on the released side-model architectures (/tmp/m05r), and
#                  the prompt analysis GPU tests
#   prompt_tests   the prompt analysis GPU tests alone (CAM++, the speech tokenizer's graphs, the analyzer)
#   prompt_stages  benchmarks/prompt_stages.py on /tmp/m05r: one new recording's analysis stage by stage, and the
#                  frontend stage of an in-process engine split at its calls (one stream)
# Carry .whl (benchmarks/fetch_wheels.sh), .whl_ray (scale_ray) and .base (overload_base); the GPU tests read
# the fixture sets shipped in tests/fixtures. Shared preparation (wheels, the 0.5B
# CosyVoice2 model in /tmp/m05 and /tmp/m05r unless NO_M05=1, the workload) runs once, first.
set -u
OUT=${OUT:?set OUT to a folder for the results}
export PYTHONUNBUFFERED=1 COSYSTREAM_COMMIT=${COSYSTREAM_COMMIT:-unknown}
stamp() { echo "== $(date +%T) $*"; }

prep() {
  source benchmarks/gpu_prep.sh || exit 1
  python3 benchmarks/workload.py /tmp/wl > /dev/null || exit 1
  if [ "${NO_M05:-0}" = 0 ] && [ ! -f /tmp/m05r/.realistic ]; then  # /tmp/m05 with the released side-model architectures (levels_all.sh)
    mkdir -p /tmp/m05r && for f in /tmp/m05/*; do ln -sfn "$f" /tmp/m05r/; done
    python3 -m cosystream.testing.realistic_side_models /tmp/m05r && touch /tmp/m05r/.realistic
  fi
  if [ -d .whl_ray ]; then bash benchmarks/scale_ray_wheels.sh install || exit 1; fi  # once, before lanes share it
  nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
}

cv3_model() {  # the CosyVoice3 0.5B random model in /tmp/cv3, once per machine
  [ -f /tmp/cv3/llm.pt ] || python3 -m cosystream.cli make-random-model --family cosyvoice3 --size 0.5b /tmp/cv3 \
    > "$1/make_cv3.log" 2>&1
}

part() {  # $1: part, $2: lane folder, $3: port
  local dir=$2
  case "$1" in
  scale_ray)
    OUT=$dir/scale PORT=$3 bash benchmarks/scale_ray.sh all ;;
  scale_single|scale_rayonly)  # the two halves of scale_ray in two lanes at once (then scale_ray.sh table)
    local which=single prep=0  # (the single process needs no Ray wheels: it runs without .whl_ray)
    [ "$1" = scale_rayonly ] && which=ray prep=1
    OUT=$dir/scale PORT=$3 PREP=$prep bash benchmarks/scale_ray.sh "$which" ;;
  overload)
    OUT=$dir PORT=$3 COSYSTREAM_TRACE=$dir/trace.jsonl bash benchmarks/levels_all.sh overload ;;
  overload_default)  # the same with the server's own admission default (no --first-audio-budget-s)
    OUT=$dir PORT=$3 SERVE_ARGS= COSYSTREAM_TRACE=$dir/trace.jsonl bash benchmarks/levels_all.sh overload ;;
  overload_default@*)
    OUT=$dir PORT=$3 SERVE_ARGS= PKG=$PWD/${1#overload_default@} COSYSTREAM_TRACE=$dir/trace.jsonl \
      bash benchmarks/levels_all.sh overload ;;
  overload_base)
    OUT=$dir PORT=$3 PKG=$PWD/.base COSYSTREAM_TRACE=$dir/trace.jsonl MULTS=${BASE_MULTS:-${MULTS:-1 2 4}} \
      SEEDS=${BASE_SEEDS:-${SEEDS:-0 1 2}} bash benchmarks/levels_all.sh overload ;;
  overload@*)
    OUT=$dir PORT=$3 PKG=$PWD/${1#overload@} COSYSTREAM_TRACE=$dir/trace.jsonl bash benchmarks/levels_all.sh overload ;;
  cv3)
    cv3_model "$dir"
    stamp "cv3: pooled flow per chunk, batches 1, 16"
    timeout 150 python3 benchmarks/cv3_fast.py --device cuda --dtype bfloat16 --batches 1,16 > "$dir/cv3_fast.txt" 2>&1
    grep -E "^\| (1|16) |MISMATCH|fast ==" "$dir/cv3_fast.txt"
    stamp "cv3: engine c=1,16"
    timeout 200 python3 benchmarks/bench_engine.py --model-dir /tmp/cv3 --device cuda --dtype bfloat16 \
      --warmup-requests 3 --timeout 150 --concurrency 1,16 --requests-per-level 32 --out "$dir/cv3_engine.json" 2>&1 \
      | grep -E "^\| [cro]|^\| level|Error|Traceback"
    [ "${CV3_OFFLINE:-1}" = 1 ] || return 0
    part cv3_offline "$dir" "$3" ;;
  cv3_offline)
    cv3_model "$dir"
    stamp "cv3: offline, 32 at once"
    timeout 150 python3 benchmarks/bench_engine.py --model-dir /tmp/cv3 --device cuda --dtype bfloat16 \
      --warmup-requests 3 --timeout 120 --offline --concurrency 32 --requests-per-level 64 \
      --out "$dir/cv3_offline.json" 2>&1 | grep -E "^\| [cro]|^\| level|Error|Traceback" ;;
  cv3_tests)
    stamp "cv3: GPU tests (compiled kernels vs reference, graphed pool vs eager, fixtures)"
    timeout ${CV3_TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider \
      tests/kernels/test_dit_kernels.py tests/models/cosyvoice3/test_cv3_cuda.py > "$dir/cv3_gpu_tests.log" 2>&1
    tail -3 "$dir/cv3_gpu_tests.log" ;;
  cv3_http)
    cv3_model "$dir"
    stamp "cv3: over HTTP, c=1"
    python3 -m cosystream.cli serve --model-dir /tmp/cv3 --port "$3" --log-level warning > "$dir/serve_cv3.log" 2>&1 &
    local server=$!
    if python3 benchmarks/wait_ready.py "http://127.0.0.1:$3" --pid "$server" --log "$dir/serve_cv3.log"; then
      timeout 120 python3 -m cosystream.cli bench --url "http://127.0.0.1:$3" --target tts \
        --workload /tmp/wl/workload.json --warmup-requests 3 --concurrency 1 --requests-per-level 32 \
        --out "$dir/cv3_http.json" 2>&1 | grep -E "^\| [cro]|^\| level|Error|Traceback"
    fi
    kill -INT "$server"; wait "$server" ;;
  zeroshot)
    OUT=$dir COSYSTREAM_TRACE=${ZS_TRACE:+$dir/trace.jsonl} bash benchmarks/levels_all.sh zeroshot ;;
  zeroshot@*)  # the same on the package in a carried folder (a variant against this tree in one lease)
    OUT=$dir PKG=$PWD/${1#zeroshot@} COSYSTREAM_TRACE=${ZS_TRACE:+$dir/trace.jsonl} \
      bash benchmarks/levels_all.sh zeroshot ;;
  open_profile)
    stamp "open_profile: the worker's opening of waves of 16 new voices (wall, host syncs, profile)"
    timeout 300 python3 benchmarks/open_profile.py --model-dir /tmp/m05r --config flow_slots=28 \
      --config flow_frames=832 --out "$dir/open_profile.json" > "$dir/open_profile.txt" 2>&1
    head -60 "$dir/open_profile.txt" ;;
  prompt_pass)
    stamp "prompt_pass: new voices' prompt passes alone on the GPU (encoder, Euler steps, copies into the caches)"
    timeout 200 python3 benchmarks/prompt_pass.py /tmp/m05 --voices 1,4,15 --out "$dir/prompt_pass.json" \
      > "$dir/prompt_pass.txt" 2>&1
    tail -8 "$dir/prompt_pass.txt"
    for v in ${PP_PROFILE:-15 1}; do  # the kernels of one eager pass of v voices, by GPU time
      timeout 200 python3 benchmarks/prompt_pass.py /tmp/m05 --profile "$v" > "$dir/prompt_pass_profile$v.txt" 2>&1
      head -25 "$dir/prompt_pass_profile$v.txt"
    done ;;
  pool_copies)
    stamp "the flow pool's copies: element by element against 8-byte words"
    timeout 200 python3 benchmarks/pool_copies.py /tmp/m05 > "$dir/pool_copies.txt" 2>&1
    tail -8 "$dir/pool_copies.txt" ;;
  flow_tiles)  # FT_ARGS: benchmarks/flow_tiles.py's arguments (its whole sweep runs for minutes)
    stamp "flow kernels' launch tiles at the engine's shapes"
    timeout 540 python3 benchmarks/flow_tiles.py ${FT_ARGS:-} --json "$dir/flow_tiles.json" > "$dir/flow_tiles.txt" 2>&1
    grep -v "^<!--" "$dir/flow_tiles.txt" | tail -20 ;;
  gpu_tests)
    stamp "engine GPU tests: CUDA against the CPU, the engine on CUDA"
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_matches_cpu.py \
      tests/gpu/test_engine_cuda.py > "$dir/gpu_tests.log" 2>&1
    tail -3 "$dir/gpu_tests.log" ;;
  zeroshot_http)
    stamp "zero-shot over HTTP: a new recording in every /v1/tts request (multipart), c=1,16"
    python3 -m cosystream.cli serve --model-dir /tmp/m05r --config flow_slots=28 --config flow_frames=832 \
      --port "$3" --log-level warning > "$dir/serve_zs.log" 2>&1 &
    local server=$!
    local said
    said=$(python3 -c 'import json; print(json.load(open("/tmp/wl/workload.json"))["prompt_text"])')
    if python3 benchmarks/wait_ready.py "http://127.0.0.1:$3" --pid "$server" --log "$dir/serve_zs.log"; then
      timeout 150 python3 -m cosystream.cli bench --url "http://127.0.0.1:$3" --target tts \
        --workload /tmp/wl/workload.json --prompt-wav /tmp/wl/voice.wav --prompt-text "$said" \
        --distinct-prompts --warmup-requests 3 --concurrency 1,16 --requests-per-level "${ZS_REQS:-64}" \
        --out "$dir/zs_http.json" 2>&1 | grep -E "^\| [cro]|^\| level|Error|Traceback"
    fi
    kill -INT "$server"; wait "$server" ;;
  prompt_analysis)
    stamp "prompt analysis: the CAM++ network against the interpreter, batches 1, 16"
    timeout 200 python3 benchmarks/prompt_analysis.py --model-dir /tmp/m05r --device cuda --seconds 6 \
      --batch-sizes 1,16 --dtypes float32 --speaker-threads 0 --compare-interpreter \
      --repeats 2 --out "$dir/prompt_analysis.json" > "$dir/prompt_analysis.txt" 2>&1
    tail -40 "$dir/prompt_analysis.txt"
    stamp "prompt analysis GPU tests (CAM++ network and graphs against the interpreter and onnxruntime)"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_campplus_cuda.py \
      tests/gpu/test_torch_prompt_cuda.py > "$dir/prompt_gpu_tests.log" 2>&1
    tail -3 "$dir/prompt_gpu_tests.log" ;;
  prompt_tests)
    stamp "prompt analysis GPU tests (CAM++ network and graphs, the tokenizer's graphs, the analyzer's host syncs)"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_campplus_cuda.py \
      tests/gpu/test_torch_prompt_cuda.py tests/gpu/test_tokenizer_graphs_cuda.py > "$dir/prompt_gpu_tests.log" 2>&1
    tail -3 "$dir/prompt_gpu_tests.log" ;;
  prompt_stages)
    stamp "prompt stages: the tokenizer's eager calls (one prompt alone, the comparison)"
    timeout 200 python3 benchmarks/prompt_stages.py --model-dir /tmp/m05r --device cuda --tokenizer-eager \
      --repeats "${STAGES_REPEATS:-20}" --out "$dir/prompt_stages_eager.json" > "$dir/prompt_stages_eager.txt" 2>&1
    grep -E "tokenizer|analyse|loaded" "$dir/prompt_stages_eager.txt"
    stamp "prompt stages: one new recording's analysis stage by stage, then inside the engine (one stream)"
    timeout 400 python3 benchmarks/prompt_stages.py --model-dir /tmp/m05r --device cuda \
      --repeats "${STAGES_REPEATS:-20}" --engine --out "$dir/prompt_stages.json" > "$dir/prompt_stages.txt" 2>&1
    tail -40 "$dir/prompt_stages.txt"
    stamp "prompt analysis GPU tests (CAM++ network and graphs, the tokenizer's graphs, the analyzer's host syncs)"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_campplus_cuda.py \
      tests/gpu/test_torch_prompt_cuda.py tests/gpu/test_tokenizer_graphs_cuda.py > "$dir/prompt_gpu_tests.log" 2>&1
    tail -3 "$dir/prompt_gpu_tests.log" ;;
  *) echo "lanes.sh: unknown part $1" >&2; return 2 ;;
  esac
}

lane() {  # $1: NAME=GPUS:PARTS, $2: port
  local name=${1%%=*} rest=${1#*=} gpus parts dir p
  gpus=${rest%%:*}; parts=${rest#*:}; dir=/tmp/lanes/$name
  mkdir -p "$dir"
  # a lane past LANE_S seconds is stopped (the device call has a limit), its results so far still archived
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "${LANE_S:-560}" bash -c '
    for p in ${3//,/ }; do
      stamp "lane $1 (GPUs $CUDA_VISIBLE_DEVICES): $p"
      part "$p" "$2" "$4"
    done
    stamp "lane $1: done"' _ "$name" "$dir" "$parts" "$2" > "$dir/lane.log" 2>&1 &
  echo $! > "$dir.group"  # timeout leads a process group of its own, servers included: what finish stops
  wait $!
  rm -f "$dir.group"
  tar -czf "$OUT/lane_$name.tar.gz" -C /tmp/lanes "$name"
}

finish() {  # however lanes.sh ends (killed too, e.g. by an outer timeout shorter than LANE_S): stop what each lane
  # still runs, so no server of this call stays up beside the next measurement, and archive what it has
  trap - EXIT TERM INT
  local spec name
  for spec in "${specs[@]}"; do
    name=${spec%%=*}
    if [ -f "/tmp/lanes/$name.group" ]; then
      kill -TERM -- "-$(cat "/tmp/lanes/$name.group")" 2>/dev/null
      rm -f "/tmp/lanes/$name.group"
    fi
    [ -f "$OUT/lane_$name.tar.gz" ] || [ ! -d "/tmp/lanes/$name" ] || tar -czf "$OUT/lane_$name.tar.gz" -C /tmp/lanes "$name"
  done
}

export -f stamp part cv3_model
specs=("$@")
trap finish EXIT
trap 'exit 143' TERM INT
mkdir -p "$OUT" /tmp/lanes
stamp prep
prep
port=8000 pids=()
for spec in "$@"; do
  lane "$spec" "$port" &
  pids+=($!)
  port=$((port + 1))
done
wait "${pids[@]}"
stamp "all lanes done"
for spec in "$@"; do
  name=${spec%%=*}
  echo "---- lane $name"; grep -E "^== |^\| |MISMATCH|Error|Traceback|NOT met|met" "/tmp/lanes/$name/lane.log" | tail -40
done
