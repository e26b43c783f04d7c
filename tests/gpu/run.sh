#!/usr/bin/env bash
# The GPU check, for a machine with CUDA and the package installed (written 2026-12-04 without a GPU to run it on:
# the step limits below are estimates). On random models of Qwen3-0.6B's and Qwen3-8B's shapes with the real
# vocabulary (built on the spot, no downloaded weights):
#   build     the two shaped models, drawn on the GPU and saved to the cache (16 GB for the 8B), once
#   tests     the CUDA tests (tests/gpu/test_cuda.py)
#   runner    `bench runner`: decode and verifying steps eager and as CUDA graphs at batch 1/16/64 and context
#             512/2048/4096, and catch-up steps, against transformers and the weights-plus-KV floor
#                                                                                     -> $OUT/gpu-runner.json
#   serve-c1  `bench serve`: the routed engine (random:share=0.15, 256-token outputs) against lockstep and
#             all-large at concurrency 1                                             -> $OUT/gpu-serve-c1.json
#   serve     the same at concurrency 16 and 64 in both single-GPU placements       -> $OUT/gpu-serve.json
#             and every engine step's time, rows and tokens (catch-ups and prefills too, for bench simulate's
#             calibration, docs/simulate.md)                                           -> $OUT/gpu-serve-steps.json
# Every stage runs even if an earlier one failed; the script fails if any did. Name stages to run only those:
#     bash tests/gpu/run.sh                          # all, up to 13 minutes of limits
#     bash tests/gpu/run.sh build tests runner       # a device call of at most 10 minutes (the lent machine's limit)
#     bash tests/gpu/run.sh serve-c1 serve           # then this, on the same machine (the models are cached there)
# `bench runner` rewrites its JSON after every row, so a stage stopped at its limit keeps what it measured.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
OUT=${OUT:-.}
mkdir -p "$OUT"  # the benchmarks do not create the folder
CONFIG=config/gpu-check/qwen3-0.6b_8b-shapes.yaml
STAGES=" ${*:-build tests runner serve-c1 serve} "
failed=()
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    [[ $STAGES == *" $name "* ]] || return 0
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
    timeout "$limit" "$@" || failed+=("$name (exit $?)")
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.device_count(), 'GPU(s)')"
step build 150 $PY -c "from tokenrouter.models.sources import resolve_model_dir as r; [print(r(s)) for s in ('tiny:qwen3-0.6b-shape', 'tiny:qwen3-8b-shape')]"
step tests 240 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py
step runner 200 $PY -m tokenrouter.bench runner --config "$CONFIG" --batch 1,16,64 --contexts 512,2048,4096 \
    --steps 10 --json "$OUT/gpu-runner.json"
step serve-c1 90 $PY -m tokenrouter.bench serve --config "$CONFIG" --policy random:share=0.15 --concurrency 1 \
    --requests 4 --max-tokens 256 --baselines lockstep,all-large --json "$OUT/gpu-serve-c1.json"
step serve 300 $PY -m tokenrouter.bench serve --config "$CONFIG" --policy random:share=0.15 --concurrency 16,64 \
    --requests 64 --max-tokens 256 --baselines lockstep,all-large --placement local,process --json "$OUT/gpu-serve.json" \
    --step-trace "$OUT/gpu-serve-steps.json"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
