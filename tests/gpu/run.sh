#!/usr/bin/env bash
# The GPU check, for a machine with CUDA and the package installed (the tests took 41 s on one H200 on 2026-12-04; the
# benchmark has not completed there yet, see docs/placement.md): the CUDA tests, then a
# short routed-serving benchmark on random models of Qwen3-0.6B's and Qwen3-8B's shapes (built on the spot, no
# downloaded weights). Figures go to ${OUT:-.}/gpu-serve.json.
#     bash tests/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPU(s)')"
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py
timeout 300 $PY -m tokenrouter.bench serve --config config/gpu-check/qwen3-0.6b_8b-shapes.yaml \
    --policy random:share=0.15 --concurrency 1,16 --requests 16 --max-tokens 32 --baselines lockstep \
    --json "${OUT:-.}/gpu-serve.json"
