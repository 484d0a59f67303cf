#!/usr/bin/env bash
# Sets up and runs the GPU tests and benchmarks on a fresh CUDA machine that has only this
# repository (its python3 must hold torch, triton and transformers).
#   bash scripts/gpu_run.sh [PART ...]        PART: tests torchlet single single-gemv decode-sat
#                                             decode-sat-sampled
#                                             offline closed-loop kernels progression fidelity
#                                             load all (default); fidelity-diag (issue 15,
#                                             not in all: attention/RoPE precision, ~3 min)
#                                             and, not in all (issue 14, ~12 min together):
#                                             nocompile warm e2e shapes tune (e2e-lazy: e2e
#                                             without the start warm-up, for comparison)
#                                             and fused (issue 16, not in all: needs the CuTe DSL,
#                                             see below; ~2-4 min); fused-decode-tests and
#                                             fused-decode (issue 16's fused one-sequence
#                                             decode path: its tests; tok/s with and without
#                                             it; CuTe DSL, no FlashInfer; ~6 and ~10 min;
#                                             fused-decode-c: plan C's three paths, ~5 min); tp tp-tests (tensor parallelism, 2
#                                             GPUs; not in all); serve (the server against
#                                             in-process, same workload; not in all);
#                                             serve-api2 (issue 13: serve's comparison with
#                                             --api-server-count 2 and 4, with the server's own
#                                             diagnostics table; not in all, ~15 min;
#                                             CLIENT_PROCS=N: the bench's --client-procs, also
#                                             for serve); client-ceiling (issue 13: the bench's
#                                             --url client against a stub SSE server, 1-4
#                                             processes and the old httpx reader; ~2 min);
#                                             core-ab sampled-ab (issue 20 / 17 A-B tables)
#                                             fused-timeline (issue 16: one fused step's
#                                             kernels in order; CuTe DSL)
#                                             gemv-sweep, gemv-sweep-nopdl (issue 16: the
#                                             CuTe GEMV plan sweep, with / without PDL, ~4 min
#                                             each; CuTe DSL)
#                                             fi-diag (issue 14: a FlashInfer decode-sat
#                                             step profiled, its end-to-end figure twice)
#                                             sampler (issue 17: the sampled path alone, ms per
#                                             128 x 151,936 step, torch vs kernel; GPU tests)
#                                             lm-head-sweep (issue 16: the GEMV sweep at
#                                             the LM head + argmax; CuTe DSL, ~3 min)
#                                             fused-best (issue 16: fused engine tests, per-op
#                                             vs the best fused path; ~4 min)
#                                             fused-shapes (issue 16: per-op vs the best
#                                             fused path at the 1.5B and 7B shapes; CuTe DSL)
#                                             generate-trace (issue 16: a single-stream
#                                             LLM.generate step's host time by part; CuTe DSL)
#                                             fused-auto (issue 16: the default turns the fused
#                                             path on here; its tests, the warm-up's, and
#                                             tok/s of no flag against per-op; CuTe DSL, ~8 min)
#                                             step-anatomy (issue 13: host launch vs device
#                                             time per step kind, alone and beside 12 busy
#                                             processes; ~2 min)
#                                             step-load (a step's inputs in one upload: graph
#                                             replays as page counts change, load's host time,
#                                             one step's timeline; ~3 min)
# Two GPUs: run two instances side by side, each on one, e.g.
#   CUDA_VISIBLE_DEVICES=0 OUT=o/g0 bash scripts/gpu_run.sh tests &
#   CUDA_VISIBLE_DEVICES=1 OUT=o/g1 bash scripts/gpu_run.sh fidelity & wait
# Every benchmark runs the torch, flashinfer and triton backends in one invocation, beside the
# Hugging Face peers, on the qwen2.5-0.5b preset in bf16.
# Wheels for FlashInfer (flashinfer-python and the few packages it needs that such a machine
# lacks) are installed from .whl/ when present; compiled FlashInfer kernels are kept in
# .fi_cache/ (FLASHINFER_WORKSPACE_BASE; unpacked from .fi_prev/fi_cache.tgz when present) so a
# second start skips compilation. The fused part takes the CuTe DSL from /tmp/cute when a run
# before it installed it there (pip install --no-deps --target /tmp/cute
# nvidia_cutlass_dsl-4.3.5-cp312-*.whl, plus cuda-bindings and cuda-pathfinder wheels if the
# machine's python lacks `cuda.bindings`), else from the wheels in .whl/cute/; --target skips
# the wheel's .pth file, so its two import roots go on PYTHONPATH here, in front of /tmp/site
# (FlashInfer's dependencies may bring a newer cutlass).
# `serve` (the server against in-process, same workload) needs the server's wheels in .whl/
# and the tokenizer folder .tok/smollm2 (scripts/export_tokenizer.py).
# Everything it writes goes to ${OUT:-gpu-out}/: log.txt, the
# JSON results in results.tgz, and fi_cache.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=("$@")
[[ ${#PARTS[@]} -eq 0 || ${PARTS[0]} == all ]] && \
  PARTS=(tests torchlet single single-gemv decode-sat decode-sat-sampled offline closed-loop
         kernels progression fidelity load)
OUT=${OUT:-gpu-out}
mkdir -p "$OUT" "$OUT/json"
LOG="$OUT/log.txt"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# Installed once per machine (/tmp/site/.installed), so instances side by side do not race.
if ls .whl/*.whl >/dev/null 2>&1; then
  [[ -f /tmp/site/.installed ]] || { python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
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
BF="python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet
    --backend flashinfer triton"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rs"
cute_env() {  # the CuTe DSL from /tmp/cute (installed there from .whl/cute/ or .whl-cute/ on
             # first use: its 56 MB wheel and FlashInfer's cannot travel in one call)
  local wheels
  wheels=$(ls .whl/cute/*.whl .whl-cute/*.whl 2>/dev/null | head -1)
  if [[ ! -d /tmp/cute/nvidia_cutlass_dsl && -n $wheels ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cute "$wheels"
  fi
  export PYTHONPATH="/tmp/cute/nvidia_cutlass_dsl/python_packages:/tmp/cute:$PYTHONPATH"
  python3 -c "import cuda.bindings.driver, cutlass; print('cuda.bindings ok; cutlass', cutlass.__file__)" \
    2>&1 | tail -1 | tee -a "$LOG"
}
for part in "${PARTS[@]}"; do
  case $part in
    tests) run 420 $PYTEST tests/gpu tests/test_attention_backends.py tests/kernels/test_kern_gpu.py ;;
    core-ab)  # issue 20's before/after table: the harness workloads, no peers, the two fast
              # backends (the "before" is the same command on the older tree, same day)
      for w in single decode-sat; do
        run 250 $BF --max-num-pages 8192 --workload $w --out "$OUT/json/ab-$w.json"
      done
      run 280 $BF --max-num-pages 32768 --workload offline --out "$OUT/json/ab-offline.json" ;;
    sampled-ab)  # issue 17: decode-sat greedy vs temperature 0.7 / top-p 0.9 / penalties
      run 200 $BF --max-num-pages 8192 --workload decode-sat --out "$OUT/json/sab-greedy.json"
      run 200 $BF --max-num-pages 8192 --workload decode-sat --temperature 0.7 --top-p 0.9 \
        --presence-penalty 0.5 --frequency-penalty 0.5 --repetition-penalty 1.1 \
        --out "$OUT/json/sab-sampled.json" ;;
    sampler)  # issue 17: Sampler.sample per step, torch path vs Triton kernel, flat and peaked
      run 200 python3 scripts/bench_sampler.py --sweep --json "$OUT/json/sampler-flat.json"
      run 120 python3 scripts/bench_sampler.py --scale 6 --json "$OUT/json/sampler-peaked.json"
      run 300 $PYTEST tests/gpu/test_gpu_sampler.py ;;
    step-load)  # the step arena: graph replays read each step's inputs (GPU test), the host
                # time of StepBuffers.load, then one triton batch-1 step's timeline (one HtoD copy)
      run 300 $PYTEST tests/gpu/test_gpu_graph_inputs.py
      run 60 python3 scripts/bench_step_load.py --json "$OUT/json/step-load.json"
      run 150 python3 scripts/profile_step.py --backend triton --batch 1 --prompt-len 32 \
        --timeline --rows 8 ;;
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
    fidelity) run 540 python3 scripts/fidelity.py --dtype bfloat16 --num-seqs 16 \
                --json "$OUT/json/fidelity.json" ;;  # 11 presets x 4096 positions
    fidelity-diag)  # issue 15: which component costs FlashInfer / Triton precision (~3 min)
      run 240 python3 scripts/fidelity.py --diagnose --json "$OUT/json/fidelity-diag.json"
      run 240 python3 scripts/fidelity.py --dtype bfloat16 --config llama-3.2-1b qwen2.5-1.5b \
        --num-seqs 16 --backend torch triton flashinfer flashinfer-nosplit \
        --json "$OUT/json/fidelity-nosplit.json" ;;
    load) run 400 python3 scripts/load_bench.py --config qwen2.5-7b --target-s 10 \
            --dir "${LOAD_DIR:-/tmp/flashlet-load-qwen2.5-7b}" ;;
    # ---- issue 14: what a user gets (each bounded; together about 12 minutes) ----
    nocompile) run 300 $PYTEST tests/gpu/test_gpu_warmup.py ;;  # nothing compiles after start
    warm)  # engine start, cold (empty Triton and FlashInfer caches) then warm (the same caches)
      for b in triton flashinfer; do
        d=$(mktemp -d) && mkdir -p "$d/triton" "$d/fi"
        for label in cold warm; do
          run 240 env TRITON_CACHE_DIR="$d/triton" FLASHINFER_WORKSPACE_BASE="$d/fi" \
            python3 scripts/start_time.py --config qwen2.5-0.5b --backend $b --label $label \
            --append "$OUT/json/start.jsonl"
        done
      done
      run 20 python3 scripts/start_time.py --table "$OUT/json/start.jsonl" ;;
    e2e)  # offline first run in a fresh process vs a repeat; decode-sat T(129)-T(1) vs harness
      for b in triton flashinfer; do
        run 180 python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet \
          --backend $b --max-num-pages 32768 --workload offline --out "$OUT/json/e2e-offline-$b.json"
        run 150 python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet \
          --backend $b --max-num-pages 8192 --workload decode-sat --decode-tokens 128 \
          --out "$OUT/json/e2e-decode-$b.json"
      done
      run 20 python3 scripts/bench_summary.py "$OUT"/json/e2e-*.json ;;
    fi-diag)  # issue 14: where a FlashInfer decode-sat step goes (kernels and host functions,
              # torch.profiler), then the end-to-end figure twice more, each in a fresh process
      run 200 python3 scripts/profile_step.py --backend flashinfer --batch 128 --prompt-len 300 \
        --timeline
      for i in 1 2; do
        run 150 python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet \
          --backend flashinfer --max-num-pages 8192 --workload decode-sat --decode-tokens 128 \
          --out "$OUT/json/fi-diag-decode-$i.json"
      done
      run 20 python3 scripts/bench_summary.py "$OUT"/json/fi-diag-*.json ;;
    e2e-lazy)  # the same decode-sat without the start warm-up: what graphs built lazily cost
      for b in triton flashinfer; do
        run 150 python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet \
          --backend $b --max-num-pages 8192 --workload decode-sat --decode-tokens 128 \
          --no-warmup-at-start --out "$OUT/json/e2e-lazy-decode-$b.json"
      done
      run 20 python3 scripts/bench_summary.py "$OUT"/json/e2e-lazy-*.json ;;
    shapes)  # 64 x 300-token prompts, 64 new tokens, end to end (first run) and repeated
      for c in tinyllama-1.1b qwen2.5-1.5b qwen2.5-7b; do
        run 240 python3 -m flashlet.bench --config $c --dtype bfloat16 --quiet \
          --backend triton flashinfer auto --workload offline --num-requests 64 \
          --prompt-len-range 300 300 --output-len-range 64 64 --max-num-pages 8192 \
          --out "$OUT/json/shapes-$c.json"
      done
      run 20 python3 scripts/bench_summary.py "$OUT"/json/shapes-*.json ;;
    tune) run 260 python3 scripts/tune_triton.py --budget-s 160 --json "$OUT/json/tune.json" ;;
    fused) cute_env
           run 200 python3 scripts/fused_gemv_bench.py --json "$OUT/json/fused-gemv.json"
           run 150 $PYTEST tests/kernels/test_cute_gemv.py ;;
    gemv-sweep)  # issue 16: the GEMV plan sweep at the fused path's shapes, PDL on (its form):
                 # warps, rows, looping grids, cp.async pipeline, g after the wait, register
                 # caps; best per shape, TUNED_PLANS lines, a 24-layer chain (~4 min)
      cute_env
      run 290 python3 scripts/gemv_sweep.py --pdl on --budget-s 215 --json "$OUT/json/gemv-sweep.json" \
        --plans-out "${GEMV_PLANS:-/tmp/gemv-plans.json}" ;;  # FLASHLET_GEMV_PLANS for the next parts
    lm-head-sweep)  # issue 16: the LM head + norm + argmax (80 us a token against a ~65 us
                    # byte floor, session 6) through the same sweep (~3 min)
      cute_env
      run 290 python3 scripts/gemv_sweep.py --only lm_head --pdl on --budget-s 215 \
        --json "$OUT/json/lm-head-sweep.json" --plans-out "${GEMV_PLANS:-/tmp/gemv-plans.json}" ;;
    gemv-sweep-nopdl)  # the same without PDL (~4 min), then the plan knobs' GPU tests (~1 min)
      cute_env
      run 290 python3 scripts/gemv_sweep.py --pdl off --budget-s 215 --json "$OUT/json/gemv-sweep-nopdl.json"
      run 150 $PYTEST tests/kernels/test_cute_gemv.py -k "knobs or rope_kv_epilogue_matches_fp32" ;;
    fused-decode-tests)  # issue 16 stage 2: the fused one-sequence decode path's kernels
                         # (RMSNorm prologue, in-place residual) and engine tests (~4 min)
      cute_env
      # (the -k selects kernel tests only: given to both files, it once deselected most engine tests)
      run 300 $PYTEST tests/kernels/test_cute_gemv.py -k "norm or in_place or silu or rope"
      run 400 $PYTEST tests/gpu/test_gpu_fused_decode.py
      # plan C: the one-launch attention (last split program merges) and the PDL gather
      run 200 $PYTEST tests/kernels/test_kern_gpu.py -k "one_launch or gather" ;;
    fused-decode)  # its tok/s: harness single + LLM.generate, per-op / fused / fused + PDL /
                   # fused + PDL + RoPE-in-QKV (plan A) / + one-launch attention (plan C),
                   # triton backend, no FlashInfer (~6-8 min)
      cute_env
      run 580 python3 scripts/fused_decode_bench.py --json "$OUT/json/fused-decode.json" ;;
    fused-decode-c)  # plan C against its baseline only: per-op / fused + PDL + RoPE-in-QKV /
                     # + one-launch attention (~5 min, where fused-decode's five paths take ~10)
      cute_env
      run 420 python3 scripts/fused_decode_bench.py --paths per-op fused+pdl+rope fused+pdl+rope+attn \
        --json "$OUT/json/fused-decode-c.json" ;;
    fused-best)  # issue 16, short: the fused engine tests, then per-op against the best path
                 # (fused + PDL + RoPE-in-QKV + one-launch attention) only (~4 min)
      cute_env
      run 400 $PYTEST tests/gpu/test_gpu_fused_decode.py
      run 300 python3 scripts/fused_decode_bench.py --paths per-op fused+pdl+rope+attn \
        --json "$OUT/json/fused-best.json" ;;
    fused-auto)  # issue 16's default (fused_decode auto): the engine built with no fused flag
                 # runs the fused path with every sub-flag, per-op tokens within the near-tie
                 # rule, per-op where a condition fails; nothing compiles after start (its
                 # CuTe GEMVs included); then tok/s of no flag ("default") against per-op
      cute_env
      run 300 $PYTEST tests/gpu/test_gpu_fused_decode.py -k "default_config"
      run 400 $PYTEST tests/gpu/test_gpu_warmup.py
      run 300 python3 scripts/fused_decode_bench.py --paths per-op default \
        --json "$OUT/json/fused-auto.json" ;;
    fused-shapes)  # issue 16: per-op against the best fused path at the Qwen2.5-1.5B and -7B
                   # shapes (random weights, bf16; built-in GEMV plans are the 0.5B's), ~3 min
      cute_env
      for c in qwen2.5-1.5b qwen2.5-7b; do
        run 240 python3 scripts/fused_decode_bench.py --config $c --paths per-op fused+pdl+rope+attn \
          --json "$OUT/json/fused-shapes-$c.json"
      done ;;
    fused-timeline)  # issue 16: one fused decode step's kernels in order (torch.profiler), with
                     # PDL, then with PDL and RoPE in the QKV epilogue, then with the
                     # one-launch attention too (plan C) (~3 min)
                     # TIMELINE_SETS="--fused-decode-rope --fused-decode-attn;..." picks
                     # the flag sets (';' between them)
      cute_env
      IFS=';' read -ra flag_sets <<< "${TIMELINE_SETS:---fused-decode-pdl;--fused-decode-pdl --fused-decode-rope;--fused-decode-pdl --fused-decode-rope --fused-decode-attn}"
      for flags in "${flag_sets[@]}"; do
        run 150 python3 scripts/profile_step.py --backend triton --batch 1 --prompt-len 32 \
          --fused-decode $flags --timeline --rows 8
      done ;;
    generate-trace)  # issue 16: where a single-stream LLM.generate step's host time goes,
                     # per-op and with the fused path (+ one-launch attention), ~2 min
      cute_env
      run 150 python3 scripts/generate_trace.py --backend triton
      run 200 python3 scripts/generate_trace.py --backend triton --fused-decode --fused-decode-pdl \
        --fused-decode-rope --fused-decode-attn ;;
    tp) # TP=1 vs TP=2 at the Qwen2.5-7B and -14B shapes (random weights, bf16), one table;
        # TP_BACKEND=flashinfer if its kernels for head_dim 128 are compiled in .fi_cache
        if [[ $(nvidia-smi -L | wc -l) -lt 2 ]]; then
          echo "part tp needs 2 GPUs" | tee -a "$LOG"; status=2; continue
        fi
        for shape in qwen2.5-7b qwen2.5-14b; do
          for n in 1 2; do
            run 170 python3 scripts/tp_bench.py run --config $shape --tp $n --single-tokens 128 \
              --backend "${TP_BACKEND:-triton}" --out "$OUT/json/tp-$shape-$n.json"
          done
        done
        run 30 python3 scripts/tp_bench.py report "$OUT"/json/tp-*.json ;;
    tp-tests) run 300 $PYTEST tests/gpu/test_gpu_tensor_parallel.py ;;
    serve) run 560 python3 scripts/serve_compare.py --out "$OUT/json/serve" \
             --tokenizer .tok/smollm2 --concurrency 1 16 64 256 --max-new-tokens 128 \
             ${CLIENT_PROCS:+--client-procs $CLIENT_PROCS} \
             -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 \
             --max-num-pages 16384
           run 200 python3 scripts/api_overhead.py --tokenizer .tok/smollm2 --step-ms 2 \
             --seconds 8 --out "$OUT/json/serve/api_overhead.json" ;;
    serve-api2)  # API_COUNTS="2" runs one count only (each count is up to ~9 min);
                 # SERVE_LEVELS="1 256" runs those concurrencies only; SERVE_MIN_REQUESTS=1024
                 # runs at least that many requests a level (c=256's 512 are two a slot)
      for n in ${API_COUNTS:-2 4}; do
        run 560 python3 scripts/serve_compare.py --out "$OUT/json/serve-api$n" \
          --tokenizer .tok/smollm2 --concurrency ${SERVE_LEVELS:-1 16 64 256} --max-new-tokens 128 \
          --api-server-count $n ${CLIENT_PROCS:+--client-procs $CLIENT_PROCS} \
          ${SERVE_MIN_REQUESTS:+--min-requests $SERVE_MIN_REQUESTS} \
          -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 \
          --max-num-pages 16384
      done ;;
    step-anatomy)  # issue 13: host launch vs device time per step kind in-process, the
                   # server's workload (c=1 / 64 / 256), then beside 12 CPU-spinning processes
      run 300 python3 scripts/step_anatomy.py --config qwen2.5-0.5b-smolvocab --backend triton \
        --concurrency 1 64 256 --burn 12 ;;
    client-ceiling) run 300 python3 scripts/client_ceiling.py --streams 64 256 --procs 1 2 4 \
                      --httpx --step-ms 1 ;;
    *) echo "unknown part $part" | tee -a "$LOG"; status=2 ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$OUT" json && rm -rf "$OUT/json"
tar czf "$OUT/fi_cache.tgz" .fi_cache 2>/dev/null || true
exit $status
