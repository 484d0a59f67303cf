#!/usr/bin/env bash
# Sets up and runs the GPU tests and benchmarks on a fresh CUDA machine that has only this
# repository (its python3 must hold torch, triton and transformers).
#   bash scripts/gpu_run.sh [PART ...]        PART: tests torchlet single single-gemv decode-sat
#                                             decode-sat-sampled offline closed-loop kernels
#                                             progression serve all (default: every part but serve)
# Every benchmark runs the torch, flashinfer and triton backends in one invocation, beside the
# Hugging Face peers, on the qwen2.5-0.5b preset in bf16.
# Wheels for FlashInfer (flashinfer-python and the few packages it needs that such a machine
# lacks) are installed from .whl/ when present; compiled FlashInfer kernels are kept in
# .fi_cache/ (FLASHINFER_WORKSPACE_BASE; unpacked from .fi_prev/fi_cache.tgz when present) so a
# second start skips compilation. `serve` (the server against in-process, same workload) needs the
# server's wheels in .whl/ and the tokenizer folder .tok/smollm2 (scripts/export_tokenizer.py). Everything it writes goes to ${OUT:-gpu-out}/: log.txt, the
# JSON results in results.tgz, and fi_cache.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=("$@")
[[ ${#PARTS[@]} -eq 0 || ${PARTS[0]} == all ]] && \
  PARTS=(tests torchlet single single-gemv decode-sat decode-sat-sampled offline closed-loop kernels progression)
OUT=${OUT:-gpu-out}
mkdir -p "$OUT" "$OUT/json"
LOG="$OUT/log.txt"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
[[ -f .fi_prev/fi_cache.tgz && ! -d .fi_cache ]] && tar xzf .fi_prev/fi_cache.tgz
mkdir -p .fi_cache && export FLASHINFER_WORKSPACE_BASE="$PWD/.fi_cache"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
  python3 -c "import transformers; print('transformers', transformers.__version__)"
  date -u; } | tee -a "$LOG"

status=0
run() {  # run a step with a time limit, its output into the log; remember a failure
  local limit=$1; shift
  echo "### $* (limit ${limit}s)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "### rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  [[ $rc -ne 0 ]] && status=$rc
  return 0
}
B="python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet
   --backend torch flashinfer triton"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rs"
for part in "${PARTS[@]}"; do
  case $part in
    tests) run 420 $PYTEST tests/gpu tests/test_attention_backends.py tests/kernels/test_kern_gpu.py ;;
    torchlet) run 300 $PYTEST tests/torchlet/test_torchlet_equivalence.py \
                tests/torchlet/test_torchlet_bf16.py tests/torchlet/test_torchlet_triton_kernels.py ;;
    single) run 420 $B --max-num-pages 8192 --workload single --peer hf hf-static \
              --out "$OUT/json/single.json" ;;
    single-gemv) run 200 $B --max-num-pages 8192 --workload single --gemv \
                   --out "$OUT/json/single-gemv.json" ;;
    decode-sat) run 300 $B --max-num-pages 8192 --workload decode-sat --peer hf \
                  --out "$OUT/json/decode-sat.json" ;;
    decode-sat-sampled) run 300 $B --max-num-pages 8192 --workload decode-sat \
                  --temperature 0.7 --top-p 0.9 --presence-penalty 0.5 --frequency-penalty 0.5 \
                  --repetition-penalty 1.1 --out "$OUT/json/decode-sat-sampled.json" ;;
    offline) run 500 $B --max-num-pages 32768 --workload offline --peer hf \
               --peer-max-requests 32 --out "$OUT/json/offline.json" ;;
    closed-loop) run 400 $B --max-num-pages 8192 --workload closed-loop \
                   --concurrency 1 8 32 128 --max-new-tokens 32 --peer hf \
                   --out "$OUT/json/closed-loop.json" ;;
    kernels) run 400 python3 -m flashlet.bench --workload kernels --quiet \
               --out "$OUT/json/kernels.json" ;;
    progression) run 400 python3 -m torchlet.bench --config qwen2.5-0.5b --dtype bfloat16 \
                   --markdown --json "$OUT/json/torchlet-progression.json" ;;
    serve) run 560 python3 scripts/serve_compare.py --out "$OUT/json/serve" \
             --tokenizer .tok/smollm2 --concurrency 1 16 64 256 --max-new-tokens 128 \
             -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 \
             --max-num-pages 16384 ;;
    *) echo "unknown part $part" | tee -a "$LOG"; status=2 ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$OUT" json && rm -rf "$OUT/json"
tar czf "$OUT/fi_cache.tgz" .fi_cache 2>/dev/null || true
exit $status
