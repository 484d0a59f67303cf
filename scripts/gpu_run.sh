#!/usr/bin/env bash
# Sets up and runs the GPU tests and benchmarks on a fresh CUDA machine that has only this
# repository (its python3 must hold torch, triton and transformers).
#   bash scripts/gpu_run.sh [tests|bench|all] [extra bench args]
# Wheels for FlashInfer (flashinfer-python and the few packages it needs that such a machine
# lacks) are installed from .whl/ when present; compiled FlashInfer kernels are kept in
# .fi_cache/ (FLASHINFER_WORKSPACE_BASE) so a second start skips compilation.
# Everything it writes goes to ${OUT:-gpu-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
mkdir -p .fi_cache && export FLASHINFER_WORKSPACE_BASE="$PWD/.fi_cache"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$OUT/device.txt"

status=0
if [[ $MODE == tests || $MODE == all ]]; then
  python3 -m pytest -q -p no:cacheprovider -rs tests/gpu tests/kernels tests/torchlet \
    tests/test_attention_backends.py -x --timeout=900 2>&1 | tee "$OUT/gpu-tests.log"
  status=${PIPESTATUS[0]}
fi
if [[ $MODE == bench || $MODE == all ]]; then
  shift || true
  B="python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --max-num-pages 8192"
  for backend in torch flashinfer triton; do
    peer=""; [[ $backend == torch ]] && peer="--peer hf hf-static"
    for w in single decode-sat offline closed-loop; do
      $B --backend $backend --workload $w $peer --out "$OUT/bench-$backend-$w.json" "$@" \
        2>&1 | tee -a "$OUT/bench.log"
    done
  done
fi
tar czf "$OUT/fi_cache.tgz" .fi_cache 2>/dev/null || true
exit $status
