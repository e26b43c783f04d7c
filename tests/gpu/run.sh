#!/usr/bin/env bash
# The GPU check, for a machine with CUDA and the package installed, in about 8 minutes on one H200 (written
# 2026-12-04 without a GPU to run it on: the step budgets below are estimates). On random models of Qwen3-0.6B's
# and Qwen3-8B's shapes with the real vocabulary (built on the spot, no downloaded weights):
#   1. the CUDA tests (tests/gpu/test_cuda.py);
#   2. `bench runner`: decode steps eager and as CUDA graphs at batch 1/16/64 and context 512/2048/4096, against
#      transformers and the weights-plus-KV floor at the device's copy rate  -> $OUT/gpu-runner.json
#   3. `bench serve`: the routed engine (random:share=0.15, 256-token outputs) against lockstep and all-large at
#      concurrency 1, then 16 and 64 in both single-GPU placements      -> $OUT/gpu-serve-c1.json, gpu-serve.json
# Every step runs even if an earlier one failed; the script fails if any did.
#     bash tests/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
OUT=${OUT:-.}
mkdir -p "$OUT"  # the benchmarks write their JSON at the end and do not create the folder
CONFIG=config/gpu-check/qwen3-0.6b_8b-shapes.yaml
failed=()
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
    timeout "$limit" "$@" || failed+=("$name (exit $?)")
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.device_count(), 'GPU(s)')"
step tests 240 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py
step runner 150 $PY -m tokenrouter.bench runner --config "$CONFIG" --batch 1,16,64 --contexts 512,2048,4096 \
    --steps 10 --json "$OUT/gpu-runner.json"
step serve-c1 60 $PY -m tokenrouter.bench serve --config "$CONFIG" --policy random:share=0.15 --concurrency 1 \
    --requests 4 --max-tokens 256 --baselines lockstep,all-large --json "$OUT/gpu-serve-c1.json"
step serve 130 $PY -m tokenrouter.bench serve --config "$CONFIG" --policy random:share=0.15 --concurrency 16,64 \
    --requests 64 --max-tokens 256 --baselines lockstep,all-large --placement local,process --json "$OUT/gpu-serve.json"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
