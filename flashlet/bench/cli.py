"""The command line: flags, validation (every bad input is refused before a model is loaded or
any work starts), dispatch to a workload, then the JSON / markdown / plots.

    python -m flashlet.bench --backend torch --concurrency 1 8 32 128 --max-new-tokens 32 \
        --max-num-pages 8192 --out results.json
    python -m flashlet.bench --config qwen2.5-0.5b --dtype bfloat16 \
        --backend torch flashinfer triton --workload decode-sat --peer hf

Several --backend names run the workload once per backend, in that order, each on a fresh
Engine with the same (seeded) weights; the peers run once, after the last backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
from pathlib import Path

import torch

from flashlet.attention import create_backend
from flashlet.bench import engines, peers, remote, report, workloads
from flashlet.bench.common import Progress, environment, git_commit, utc_now
from flashlet.config import BACKENDS, EngineConfig
from flashlet.models.weights import preset_config_path
from flashlet.kvcache.kv_pool import KVPool
from flashlet.models.model import ModelConfig
from flashlet.models.weights import ModelLoadError

WORKLOADS = ("closed-loop", "decode-sat", "single", "offline", "long-prompt-gaps", "scheduler",
             "kernels")
MODEL_WORKLOADS = ("closed-loop", "decode-sat", "single", "offline", "long-prompt-gaps")
PEER_WORKLOADS = ("closed-loop", "decode-sat", "single", "offline")
PEERS = ("hf", "hf-static")
DEFAULT_CONCURRENCY = [1, 8, 32, 128]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashlet.bench", conflict_handler="resolve",
        description="Benchmark the flashlet engine in-process (or a flashlet server with --url), "
                    "optionally next to Hugging Face transformers on the same weights.",
        epilog="Sizes default per workload: closed-loop prompts 32-768 tokens, 32 new tokens, "
               "max(2 x concurrency, 8) requests per level; decode-sat 128 x 300-token prompts, "
               "128 decode steps; single 256 tokens after a 32-token prompt; offline 256 requests, "
               "input and output lengths uniform in [100, 1024]; scheduler 256 running requests.")
    eng = p.add_argument_group("engine (flashlet.EngineConfig; --config NAME|FILE = random weights "
                               "at that shape, e.g. qwen2.5-0.5b; neither = the embedded model)")
    EngineConfig.add_cli_args(eng)
    eng.add_argument("--backend", dest="backends", nargs="+", choices=BACKENDS, metavar="NAME",
                     default=[EngineConfig.backend],
                     help=f"attention backend(s) from {', '.join(BACKENDS)} (default: "
                          f"{EngineConfig.backend}); several run one after another, in this order")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="closed-loop")
    w.add_argument("--seed", type=int, default=0,
                   help="seeds the prompts and lengths (--weights-seed seeds random weights)")
    w.add_argument("--concurrency", type=int, nargs="+", default=DEFAULT_CONCURRENCY,
                   help="closed-loop client counts, one level each")
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests per level (closed-loop: default max(--requests-per-stream x "
                        "concurrency, --min-requests); "
                        "offline: 256; --rate: 64)")
    w.add_argument("--min-requests", type=int, default=8,
                   help="closed-loop: at least this many requests per level when --num-requests "
                        "is not given (default %(default)s; 32 or more makes p99 a percentile)")
    w.add_argument("--requests-per-stream", type=int, default=2,
                   help="closed-loop: requests each client sends per level when --num-requests is "
                        "not given (default %(default)s; more weighs a level's start, when every "
                        "client arrives at once, less against its steady state)")
    w.add_argument("--max-new-tokens", type=int, default=None,
                   help="output tokens of every request (closed-loop default 32; decode-sat: the "
                        "decode steps, default 128; single: default 256)")
    w.add_argument("--prompt-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None)
    w.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                   help="output lengths uniform in [LO, HI] (overrides --max-new-tokens)")
    w.add_argument("--decode-batch", type=int, default=128)
    w.add_argument("--decode-prompt-len", type=int, default=300)
    w.add_argument("--decode-tokens", type=int, default=None, help="timed decode steps")
    w.add_argument("--single-tokens", type=int, default=None)
    w.add_argument("--single-prompt-len", type=int, default=32)
    w.add_argument("--bandwidth-mib", type=int, default=None,
                   help="copy-bandwidth probe buffer (default 1024 MiB on CUDA, 256 on CPU)")
    w.add_argument("--gap-streams", type=int, default=64,
                   help="long-prompt-gaps: streams decoding while the long prompts arrive")
    w.add_argument("--gap-stream-prompt-len", type=int, default=128)
    w.add_argument("--gap-long-prompts", type=int, default=8,
                   help="long-prompt-gaps: prompts arriving at once beside the streams")
    w.add_argument("--gap-long-prompt-len", type=int, default=8000)
    w.add_argument("--gap-baseline-steps", type=int, default=32,
                   help="long-prompt-gaps: pure-decode steps timed before the prompts arrive")
    w.add_argument("--sched-running", type=int, default=256)
    w.add_argument("--sched-prefill-chunks", type=int, default=16)
    w.add_argument("--sched-context", type=int, default=512, help="prompt length of the decodes")
    w.add_argument("--sched-chunk-len", type=int, default=None,
                   help="tokens per prefill chunk (default: what fills --max-num-batched-tokens)")
    w.add_argument("--sched-steps", type=int, default=200)
    w.add_argument("--kernels-quick", action="store_true", help="a short kernel sweep")
    w.add_argument("--kernels-smoke", action="store_true",
                   help="one tiny shape per kernel (a functional check; runs on the CPU)")
    w.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run a small untimed batch first")
    w.add_argument("--allow-preemption", action="store_true",
                   help="run even when the KV pool cannot hold every concurrent request")

    samp = p.add_argument_group("sampling (decode-sat; greedy unless given)")
    for flag, kind in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float),
                       ("presence-penalty", float), ("frequency-penalty", float),
                       ("repetition-penalty", float)):
        samp.add_argument(f"--{flag}", type=kind, default=None)

    peer = p.add_argument_group("peers")
    peer.add_argument("--peer", choices=PEERS, nargs="+", action="extend", default=None,
                      help="also run Hugging Face transformers generate on the same weights")
    peer.add_argument("--peer-max-requests", type=int, default=256,
                      help="at most this many requests per level for a peer")
    peer.add_argument("--peer-batch-size", type=int, default=None,
                      help="offline: the peer's static batch (default: all at once)")

    r = p.add_argument_group("server (--url)")
    r.add_argument("--url", default=None, help="benchmark a running flashlet server instead")
    r.add_argument("--rate", type=float, default=None,
                   help="open loop: Poisson arrivals at this many requests/s (needs --url)")
    r.add_argument("--request-timeout", type=float, default=600.0)
    r.add_argument("--client-procs", type=int, default=None, metavar="N",
                   help="client processes that share the streams (each its part of the closed "
                        "loop or of the --rate schedule; default: one per 32 streams, at most "
                        "half the CPUs; --rate: 4, at most half the CPUs)")

    w.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (torch.set_num_threads); default: torch's choice")

    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="write every figure to this JSON file")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    o.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    return p


# ---- validation ----------------------------------------------------------------------------
def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Check every input and fill in the workload's sizes; parser.error (exit 2) on bad input.
    Returns what is known about the model (nothing is loaded here)."""
    err = parser.error
    wl = args.workload
    if args.url is not None:
        if wl not in ("closed-loop", "long-prompt-gaps"):
            err(f"--url runs the closed-loop (or --rate open-loop) and long-prompt-gaps workloads, not {wl!r}")
        if wl == "long-prompt-gaps" and args.rate is not None:
            err("--rate is the closed-loop workload's open loop; long-prompt-gaps sends its own arrivals")
        if not args.url.startswith(("http://", "https://")):
            err(f"--url must start with http:// or https://, got {args.url!r}")
        if args.peer:
            err("--peer runs in-process; it cannot be combined with --url")
    if args.client_procs is not None:
        if args.url is None:
            err("--client-procs applies to --url only")
        if args.client_procs < 1:
            err(f"--client-procs must be >= 1, got {args.client_procs}")
    if args.rate is not None:
        if args.url is None:
            err("--rate (open-loop Poisson arrivals) needs --url")
        if not args.rate > 0:
            err(f"--rate must be > 0 requests/s, got {args.rate}")
    for name in ("threads", "num_requests", "max_new_tokens", "decode_batch", "decode_prompt_len",
                 "decode_tokens", "single_tokens", "single_prompt_len", "sched_running",
                 "sched_context", "sched_chunk_len", "sched_steps", "bandwidth_mib",
                 "gap_streams", "gap_stream_prompt_len", "gap_long_prompts",
                 "gap_long_prompt_len", "gap_baseline_steps",
                 "peer_max_requests", "peer_batch_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            err(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if any(c < 1 for c in args.concurrency):
        err(f"--concurrency levels must be >= 1, got {' '.join(map(str, args.concurrency))}")
    if len(set(args.concurrency)) != len(args.concurrency):
        err("--concurrency levels must be distinct")
    for name in ("prompt_len_range", "output_len_range"):
        v = getattr(args, name)
        if v is not None and not 1 <= v[0] <= v[1]:
            err(f"--{name.replace('_', '-')} must be LO HI with 1 <= LO <= HI, got {v[0]} {v[1]}")
    if args.peer and wl not in PEER_WORKLOADS:
        err(f"--peer applies to {', '.join(PEER_WORKLOADS)}, not {wl!r}")
    if args.peer and args.tensor_parallel_size > 1:
        err("--peer runs the engine's weights on one device: use --tensor-parallel-size 1")
    if args.peer:
        args.peer = list(dict.fromkeys(args.peer))
    repeated = [b for b in dict.fromkeys(args.backends) if args.backends.count(b) > 1]
    if repeated:
        err(f"--backend names {', '.join(repeated)} more than once")
    if len(args.backends) > 1 and (args.url is not None or wl not in MODEL_WORKLOADS):
        err(f"several --backend names apply only to the in-process {', '.join(MODEL_WORKLOADS)} "
            f"workloads, not {'--url' if args.url is not None else repr(wl)}")
    if args.request_timeout <= 0:
        err("--request-timeout must be > 0")

    mnt = args.max_new_tokens
    if wl == "closed-loop":
        args.prompt_len_range = args.prompt_len_range or [32, 768]
        args.output_len_range = args.output_len_range or [mnt or 32] * 2
        if args.rate is not None:
            args.num_requests = args.num_requests or 64
        elif args.num_requests is not None and args.num_requests < max(args.concurrency):
            err(f"--num-requests ({args.num_requests}) must be >= the largest concurrency "
                f"({max(args.concurrency)}): every client must send at least one request")
        if args.requests_per_stream < 1 or args.min_requests < 1:
            err("--requests-per-stream and --min-requests take positive counts")
        args.level_requests = [args.num_requests or max(args.requests_per_stream * c, args.min_requests)
                               for c in args.concurrency]
    elif wl == "offline":
        args.num_requests = args.num_requests or 256
        args.prompt_len_range = args.prompt_len_range or [100, 1024]
        args.output_len_range = args.output_len_range or ([mnt] * 2 if mnt else [100, 1024])
    elif wl == "decode-sat":
        args.decode_tokens = args.decode_tokens or mnt or 128
    elif wl == "single":
        args.single_tokens = args.single_tokens or mnt or 256
        if args.single_tokens < 2:
            err("--single-tokens must be >= 2 (decode speed is timed from the second token)")
    elif wl == "scheduler":
        _resolve_scheduler(err, args)
    elif wl == "kernels":
        import importlib.util

        try:
            found = importlib.util.find_spec("flashlet.kernels.bench") is not None
        except ImportError:
            found = False
        if not found:
            err("the kernels workload delegates to flashlet.kernels.bench.run_kernel_sweep, "
                "which is not in this build (flashlet/kernels/bench.py is missing)")
        args.kernel_device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        kdev = _device(err, args.kernel_device)
        if kdev.type == "cuda" and not torch.cuda.is_available():
            err("--device cuda was asked for but CUDA is not available on this machine")
        if kdev.type != "cuda" and not args.kernels_smoke:
            err(f"the kernel sweep times Triton kernels on a CUDA device, not {kdev}; "
                "pass --kernels-smoke for a functional check on the CPU")
        if args.model is not None and args.config is not None:
            err("give --model or --config, not both")
        if args.config is not None:
            try:
                preset_config_path(args.config)
            except ValueError as e:
                err(str(e))

    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            err("--plot needs matplotlib (pip install matplotlib)")
        _check_writable_dir(err, Path(args.plot), "--plot")
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            err(f"--out {out} is a directory; give a file name")
        _check_writable_dir(err, out.parent if str(out.parent) else Path("."), "--out")

    if args.url is not None:
        try:
            import httptools  # noqa: F401 - the --url client's HTTP parser (sse.py)
        except ImportError:
            err("--url needs httptools (pip install 'flashlet[server]')")
        _check_server(err, args.url)
        if wl == "long-prompt-gaps":  # the server's step bounds are its own: a length for any
            args.gap_stream_tokens = remote.gap_stream_tokens(args)
        return {}
    if wl not in MODEL_WORKLOADS:
        return {}
    return _resolve_model(err, args)


def _resolve_scheduler(err, args) -> None:
    R, K = args.sched_running, args.sched_prefill_chunks
    if not 0 <= K < R:
        err(f"--sched-prefill-chunks must be in [0, --sched-running), got {K}")
    # The host's cost of a GPU step: by default at the GPU's budget, wherever this runs.
    budget = args.max_num_batched_tokens or EngineConfig(device="cuda").max_num_batched_tokens
    decodes = R - K
    if K:
        args.sched_chunk_len = args.sched_chunk_len or (budget - decodes) // K
        if args.sched_chunk_len < 2:
            err(f"--max-num-batched-tokens {budget} leaves no room for {K} prefill chunks "
                f"next to {decodes} decodes")
        if decodes + K * args.sched_chunk_len > budget:
            err(f"{decodes} decodes + {K} chunks of {args.sched_chunk_len} tokens exceed "
                f"--max-num-batched-tokens {budget}")
    else:
        args.sched_chunk_len = args.sched_chunk_len or 2
    if budget < R:
        err(f"--max-num-batched-tokens ({budget}) must be >= --sched-running ({R})")
    args.sched_budget = budget


def _device(err, name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        err(f"--device {name!r} is not a device: {str(e).splitlines()[0]}")
    if device.type not in ("cpu", "cuda"):
        err(f"--device {name!r}: flashlet runs on cpu or cuda")
    return device


def _check_writable_dir(err, folder: Path, flag: str) -> None:
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        err(f"{flag}: cannot write into {folder}")


def _check_server(err, url: str) -> None:
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=5).close()
    except OSError as e:
        err(f"cannot connect to the server at {url}: {e}")


def _resolve_model(err, args) -> dict:
    """Model, device, backends, lengths and pool size, all before a weight is read."""
    if args.model is not None and args.config is not None:
        err("give --model (real weights) or --config (random weights at a shape), not both")
    try:  # the first backend; the others differ in nothing else
        ecfg = EngineConfig.from_cli(argparse.Namespace(**vars(args), backend=args.backends[0]))
        if args.workload == "long-prompt-gaps":  # streams as a server serves them
            ecfg = ecfg.for_serving(args.max_decode_step_tokens is not None)
    except (ValueError, TypeError) as e:
        err(str(e))
    # The device's defaults, resolved (the workloads size themselves by them).
    args.max_num_batched_tokens = ecfg.max_num_batched_tokens
    args.max_decode_step_tokens = ecfg.max_decode_step_tokens
    try:
        hf_cfg = engines.hf_config_dict(ecfg)
        mcfg = ModelConfig.from_hf(hf_cfg)
    except (ValueError, KeyError, OSError, ModelLoadError) as e:
        err(f"model: {e}")
    device = _device(err, ecfg.device) if ecfg.device else ecfg.resolved_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        err("--device cuda was asked for but CUDA is not available on this machine")
    for backend in args.backends:
        _check_backend(err, ecfg.replace(backend=backend), mcfg, device)

    max_len = min(args.max_model_len or mcfg.max_context_len, mcfg.max_context_len)
    wl = args.workload
    if wl == "closed-loop":
        longest, batch = args.prompt_len_range[1] + args.output_len_range[1], max(args.concurrency)
    elif wl == "offline":
        longest, batch = args.prompt_len_range[1] + args.output_len_range[1], 1
    elif wl == "decode-sat":
        longest = args.decode_prompt_len + args.decode_tokens + workloads.decode_sat_margin(args)
        batch = args.decode_batch
    elif wl == "long-prompt-gaps":
        args.gap_stream_tokens = workloads.gap_stream_tokens(args, ecfg)
        longest = max(args.gap_long_prompt_len + 1,
                      args.gap_stream_prompt_len + args.gap_stream_tokens)
        batch = args.gap_streams + args.gap_long_prompts
    else:
        longest, batch = args.single_prompt_len + args.single_tokens, 1
    if longest > max_len:
        err(f"the longest request ({longest} tokens, prompt + output) exceeds the model's "
            f"context of {max_len} tokens: shorten the lengths")
    if batch > ecfg.max_num_seqs:
        err(f"{batch} concurrent sequences exceed --max-num-seqs {ecfg.max_num_seqs}")
    args.pages_per_request = math.ceil(longest / ecfg.page_size)
    args.pool_batch = batch
    if ecfg.max_num_pages is not None:
        check_pool(err, args, ecfg.max_num_pages)
    return {"engine_config": ecfg, "hf_config": hf_cfg, "model_config": mcfg, "device": device,
            "max_model_len": max_len}


def check_pool(err, args, num_pages: int) -> None:
    need1 = args.pages_per_request
    if need1 > num_pages:
        err(f"KV pool too small: one request of up to {need1 * args.page_size} tokens needs "
            f"{need1} pages of {args.page_size} tokens but the pool has {num_pages} "
            f"(raise --max-num-pages or shorten the lengths)")
    need = need1 * args.pool_batch
    if args.workload in ("closed-loop", "decode-sat") and need > num_pages and not args.allow_preemption:
        err(f"KV pool too small for {args.pool_batch} concurrent requests: they may need "
            f"{need} pages ({args.pool_batch} x {need1}) but the pool has {num_pages}; raise "
            f"--max-num-pages, lower the concurrency, or pass --allow-preemption")


def _check_backend(err, ecfg: EngineConfig, mcfg, device: torch.device) -> None:
    """Build the chosen attention backend over a one-page pool: the engine's own check."""
    if ecfg.backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        err("the triton backend needs a CUDA device (on CPU it runs only in the Triton "
            "interpreter: set TRITON_INTERPRET=1, very slow); use --backend torch on CPU")
    try:
        pool = KVPool(1, 1, ecfg.page_size, mcfg.num_kv_heads, mcfg.head_dim,
                      ecfg.resolved_dtype(), device, cache_dtype=ecfg.resolved_kv_cache_dtype())
        create_backend(ecfg.backend, pool, mcfg.num_heads)
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here
        err(f"backend {ecfg.backend!r} is not available on {device}: {e}")


# ---- running -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    info = resolve(parser, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    progress = Progress(enabled=not args.quiet)
    say = (lambda *a: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))

    record = {
        "schema": "flashlet-bench/1",
        "workload": "url" if args.url and args.workload == "closed-loop" else args.workload,
        "command": shlex.join(["python", "-m", "flashlet.bench", *argv]),
        "argv": argv,
        "date": utc_now(),
        "git": git_commit(),
        "params": _params(args),
        "notes": [],
    }
    with progress:
        if args.url is not None:
            record.update(url=args.url, env=environment(None))
            record["env"]["device"] = "remote server"
            record["results"] = remote.run(args, progress)
            record["notes"].append("TTFT and ITL measured on the client; " + report_note())
        elif args.workload == "scheduler":
            record["env"] = environment("cpu")
            record["results"] = workloads.scheduler_bench(args, progress)
        elif args.workload == "kernels":
            record["env"] = environment(args.kernel_device)
            record["results"] = workloads.kernels(args, progress, log=None if args.quiet else say)
        else:
            _run_model_workload(parser, args, info, record, progress, say)

    if args.plot is not None:
        record["plots"] = report.plot(record, args.plot)
    if args.out is not None:
        report.write_json(record, args.out)
        say(f"wrote {args.out}")
    sys.stdout.write(report.markdown(record))
    sys.stdout.flush()
    return 0


def report_note() -> str:
    return report.TTFT_NOTE


def _run_model_workload(parser, args, info, record, progress, say) -> None:
    """Each backend in turn on a fresh Engine (the previous one released first), then the peers
    on the last engine's weights, which every backend shared (seeded random or loaded)."""
    ecfg, mcfg = info["engine_config"], info["model_config"]
    record["env"] = environment(info["device"])
    fn = {"closed-loop": workloads.closed_loop, "decode-sat": workloads.decode_sat,
          "single": workloads.single, "offline": workloads.offline,
          "long-prompt-gaps": workloads.long_prompt_gaps}[args.workload]
    what = f"config {ecfg.config}" if ecfg.config else f"model {ecfg.model or 'embedded default'}"
    engine = None
    for i, backend in enumerate(args.backends):
        engines.release(engine)  # the previous backend's (none the first time)
        say(f"loading {what} on {info['device']} with the {backend} backend ...")
        engine = engines.build_engine(ecfg.replace(backend=backend))
        if ecfg.max_num_pages is None:  # the pool size is known only now: check it before any work
            check_pool(parser.error, args, engine.stats()["kv_pages_total"])
        engine_info = {**dataclasses.asdict(engine.config),
                       "num_pages": engine.stats()["kv_pages_total"],
                       "kv_tokens_total": engine.stats()["kv_tokens_total"],
                       "max_model_len": engine.max_model_len,
                       "backend": engine.backend_name,  # what "auto" resolved to
                       "start": _jsonable_start(engine)}
        results = fn(engine, args, progress)
        if "first_run" in results:  # first in a fresh process only for the first engine built
            results["first_run"]["first_engine_in_process"] = i == 0
        if i == 0:  # the first backend is where readers of one-backend records look
            record.update(model=_model_record(ecfg, mcfg, engine), engine=engine_info,
                          results=results, backends={}, engines={})
        record["backends"][backend] = results
        record["engines"][backend] = engine_info
        _checkpoint(args, record)
        _say_results(say, args.workload, results, f"flashlet ({backend})")
    if args.workload in ("closed-loop", "offline"):
        record["notes"].append(report_note())
    if args.peer:
        say("building the Hugging Face model on the same weights ...")
        hf_model = engines.hf_model_for(engine)
        vocab, device = mcfg.vocab_size, engine.device
        engines.release(engine)  # give the KV pool's memory to the peer
        del engine
        record["peers"] = {}
        for kind in args.peer:  # ratios and token matches against the first backend
            res = peers.run(kind, hf_model, args.workload, args, record["results"], vocab, device,
                            progress)
            record["peers"][kind] = res
            _checkpoint(args, record)
            _say_results(say, args.workload, res, kind)
        del hf_model


def _jsonable_start(engine) -> dict:
    """Engine start: seconds to load, warm up and capture graphs, and what warm-up ran."""
    return dict(getattr(engine, "start_report", None) or {})


def _model_record(ecfg: EngineConfig, mcfg, engine) -> dict:
    return {
        "name": ecfg.config or ecfg.model or "embedded default (smollm2-135m-instruct)",
        "weights": "random (seeded) at the config's shape" if ecfg.config else "loaded",
        "model_dir": str(engine.model_dir) if engine.model_dir else None,
        "num_params": mcfg.num_params(), "dtype": str(engine.dtype).removeprefix("torch."),
        "config": dataclasses.asdict(mcfg),
    }


def _checkpoint(args, record: dict) -> None:
    """Write what is measured so far (a run killed during a later backend or a long peer keeps
    the figures already measured)."""
    if args.out is not None:
        report.write_json({**record, "partial": True}, args.out)


def _say_results(say, workload: str, res: dict, name: str) -> None:
    if res.get("skipped") or res.get("error"):
        say(f"{name}: {res.get('skipped') or res.get('error')}")
    elif "levels" in res:
        for lv in res["levels"]:
            say(f"{name} c={lv['concurrency']}: {lv['output_tok_s']:.1f} output tok/s, "
                f"TTFT p50 {lv['ttft_ms']['p50']:.1f} ms")
    elif "itl_p99_over_p50" in res:
        say(f"{name}: decode ITL p50 {res['itl_ms']['p50']:.2f} ms, p99 {res['itl_ms']['p99']:.2f} "
            f"ms while the long prompts prefill; their TTFT p50 {res['long_ttft_ms']['p50']:.0f} ms")
    elif "decode_tok_s" in res:
        say(f"{name}: {res['decode_tok_s']:.1f} decode tok/s")
    elif "output_tok_s" in res:
        say(f"{name}: {res['output_tok_s']:.1f} output tok/s in {res['duration_s']:.2f} s")


def _params(args) -> dict:
    """The resolved workload sizes (what actually ran), for the JSON."""
    keys = {
        "closed-loop": ["concurrency", "level_requests", "prompt_len_range", "output_len_range",
                        "num_requests", "rate", "client_procs"],
        "offline": ["num_requests", "prompt_len_range", "output_len_range"],
        "decode-sat": ["decode_batch", "decode_prompt_len", "decode_tokens", "temperature",
                       "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                       "repetition_penalty"],
        "single": ["single_prompt_len", "single_tokens", "bandwidth_mib"],
        "long-prompt-gaps": ["gap_streams", "gap_stream_prompt_len", "gap_stream_tokens",
                             "gap_long_prompts", "gap_long_prompt_len", "gap_baseline_steps"],
        "scheduler": ["sched_running", "sched_prefill_chunks", "sched_context", "sched_chunk_len",
                      "sched_steps", "sched_budget"],
        "kernels": ["kernel_device", "kernels_quick", "kernels_smoke", "model", "config"],
    }[args.workload]
    out = {k: getattr(args, k, None) for k in keys}
    out.update(seed=args.seed, warmup=args.warmup, peers=args.peer or [],
               peer_max_requests=args.peer_max_requests,
               greedy=args.workload != "decode-sat" or not args.temperature, ignore_eos=True)
    return out
