"""Shared pieces of the harness: request specs, timing on CPU and CUDA, statistics, the copy
bandwidth probe, the environment record and a progress bar that stays off stdout."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_SAMPLES = 20_000  # raw latency samples kept per series in the JSON (evenly thinned beyond)


# ---- what to send --------------------------------------------------------------------------
@dataclass
class Spec:
    """One request: its prompt (token ids, or text for --url) and how many tokens to generate."""

    prompt: list[int] | str
    max_new_tokens: int
    prompt_len: int  # tokens (for text prompts: the number of words asked for)


def make_specs(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
               vocab_size: int, seed: int, stream: int = 0) -> list[Spec]:
    """`n` requests with lengths uniform in the (inclusive) ranges. Lengths depend on `seed`
    only; token contents on (`seed`, `stream`), so that every concurrency level sends the same
    length mix with different tokens (no prefix-cache hits carried over from a previous level)."""
    lengths = np.random.default_rng(seed)
    prompt_lens = lengths.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    output_lens = lengths.integers(output_range[0], output_range[1] + 1, size=n)
    tokens = np.random.default_rng([seed, stream, 7919])
    return [Spec(tokens.integers(0, vocab_size, size=int(p)).tolist(), int(o), int(p))
            for p, o in zip(prompt_lens, output_lens)]


# ---- timing --------------------------------------------------------------------------------
def synchronizer(device: torch.device):
    """A function that waits for the device's queued work (a no-op on the CPU)."""
    import torch  # here: the --url client processes import this module and need no torch

    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def now() -> float:
    return time.perf_counter()


# ---- the machine's CPUs --------------------------------------------------------------------
PROC_STAT = "/proc/stat"


def machine_cpu() -> tuple[int, ...] | None:
    """The whole machine's CPU time counters so far, in ticks (Linux /proc/stat's `cpu` line:
    user, nice, system, idle, iowait, irq, softirq, steal); None where there is no such file."""
    try:
        with open(PROC_STAT) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    return tuple(int(x) for x in (fields[1:9] + ["0"] * 8)[:8])


def cpu_shares(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> dict | None:
    """Between two machine_cpu readings, shares of all the CPUs' time: `busy` (running
    anything: neither idle, waiting on I/O, nor stolen) and `steal` (taken by the hypervisor
    for other guests: a virtual machine's noisy neighbours). None without both readings."""
    if before is None or after is None:
        return None
    d = [a - b for a, b in zip(after, before)]
    total = sum(d)
    if total <= 0:
        return None
    idle, iowait, steal = d[3], d[4], d[7]
    return {"busy": (total - idle - iowait - steal) / total, "steal": steal / total}


# ---- statistics ----------------------------------------------------------------------------
def summarize(values, scale: float = 1.0) -> dict:
    """n, mean, p50, p90, p99, min, max of `values` (times `scale`); zeros when empty."""
    a = np.asarray(list(values), dtype=np.float64) * scale
    if a.size == 0:
        return {"n": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "min": 0.0, "max": 0.0}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "min": float(a.min()), "max": float(a.max())}


def samples(values, scale: float = 1.0, digits: int = 4) -> list[float]:
    """Raw samples for the JSON and the distribution plots, thinned evenly past MAX_SAMPLES."""
    a = np.asarray(list(values), dtype=np.float64) * scale
    if a.size > MAX_SAMPLES:
        a = a[np.linspace(0, a.size - 1, MAX_SAMPLES).astype(np.int64)]
    return [round(float(x), digits) for x in a]


def token_gaps(token_times: list[list[float]], start: float, end: float) -> list[float]:
    """Every stream's gaps between consecutive tokens that end inside (start, end]."""
    return [b - a for times in token_times for a, b in zip(times, times[1:]) if start < b <= end]


def gap_figures(token_times: list[list[float]], baseline_start: float, arrival: float, end: float,
                ttft_s: list[float]) -> dict:
    """The long-prompt-gaps figures (in-process or through a server): the streams' token gaps
    from the long prompts' arrival to the last one's first token, against the window before it,
    and the long prompts' TTFT (from their arrival)."""
    itl, base = token_gaps(token_times, arrival, end), token_gaps(token_times, baseline_start, arrival)
    under, before = summarize(itl, 1e3), summarize(base, 1e3)
    return {
        "streams": len(token_times),
        "itl_ms": under, "itl_p99_over_p50": under["p99"] / under["p50"] if under["p50"] else None,
        "baseline_itl_ms": before,
        "itl_p99_over_baseline_p50": under["p99"] / before["p50"] if before["p50"] else None,
        "long_ttft_ms": summarize(ttft_s, 1e3), "long_ttft_ms_each": [round(t * 1e3, 3) for t in ttft_s],
        "window_s": end - arrival,
        "samples": {"itl_ms": samples(itl, 1e3), "baseline_itl_ms": samples(base, 1e3)},
    }


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if not ours or not theirs:
        return None
    return ours / theirs


# ---- memory bandwidth ----------------------------------------------------------------------
def copy_bandwidth(device: torch.device, mib: int | None = None, iters: int = 10) -> dict:
    """Measure device memory bandwidth with a large tensor copy: (bytes read + bytes written)
    per second, the best of `iters` timed copies after a warm-up. CUDA events on the GPU."""
    import torch  # here: the --url client processes import this module and need no torch

    device = torch.device(device)
    if mib is None:
        mib = 1024 if device.type == "cuda" else 256
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            mib = max(16, min(mib, int(free / 2**20 / 4)))
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (page faults, allocator)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(max(3, iters // 2)):
            t0 = now()
            dst.copy_(src)
            times.append(now() - t0)
    nbytes = 2 * n * 4
    best = min(times)
    del src, dst
    return {"bytes_per_copy": nbytes, "buffer_mib": mib, "iters": len(times),
            "best_s": best, "median_s": float(np.median(times)),
            "gb_per_s": nbytes / best / 1e9, "method": "tensor copy, (read + write) bytes / time, best of iters"}


# ---- the environment -----------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> dict:
    """HEAD of the checkout flashlet runs from ("unknown" outside git), and whether it is dirty."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return {"commit": "unknown", "dirty": None}
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=20)
        return {"commit": head.stdout.strip(),
                "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


def environment(device: torch.device | str | None) -> dict:
    """Device name, library versions and host facts for the JSON."""
    import torch  # here: the --url client processes import this module and need no torch

    info = {
        "device": str(device) if device is not None else None,
        "device_name": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "flashinfer": _version("flashinfer-python") or _version("flashinfer"),
        "flashlet": _version("flashlet"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(device_name=props.name, gpu_count=torch.cuda.device_count(),
                    gpu_memory_gib=round(props.total_memory / 2**30, 2),
                    gpu_sm_count=props.multi_processor_count,
                    gpu_capability=f"{props.major}.{props.minor}", gpu_driver=_nvidia_driver())
    elif dev is not None:
        info["device_name"] = info["cpu"]
    return info


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ---- progress ------------------------------------------------------------------------------
class Progress:
    """A rich progress bar on stderr, off when stderr is not a terminal (or when quiet)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and sys.stderr.isatty()
        self._progress = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                          MofNCompleteColumn(), TimeElapsedColumn(),
                                          console=Console(stderr=True), transient=False)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None

    def task(self, description: str, total: int) -> "Task":
        if self._progress is None:
            return Task(None, None)
        return Task(self._progress, self._progress.add_task(description, total=total))


class Task:
    def __init__(self, progress, task_id):
        self._progress, self._id = progress, task_id

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._id, n)


NO_PROGRESS = Progress(enabled=False)
