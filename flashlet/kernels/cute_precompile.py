"""The fused path's CuTe GEMVs compiled side by side in worker processes, for a first start.

A machine's first engine start compiles each of the fused decode path's GEMVs one after
another in the engine's process: 30 at the 0.5B shape, 10-18 s of a 31-53 s cold start on an
H100 (FUSED_NOTES.md, "Session 50"); later starts load them from cute_disk_cache. A GEMV's
compile needs no GPU: traced with stand-ins of its arguments' shapes (`CuteGemv._fake_args`,
what the CPU's PTX tests lower), it lowers for the arch it is told, and should compute what
the launcher traced with the GPU's own tensors computes (a GPU test compares them). So as soon
as the plans are known (FusedDecode's constructor, before the warm-up), `start` hands those not
on disk to a few worker processes (`python -m flashlet.kernels.cute_precompile`), which trace
and export them into the cache folder while the engine goes on with its own warm-up; a GEMV's
first call (`CuteGemv.compile`) then waits for its file, loads it, and compiles the kernel
itself only where a worker failed.

Off by default until a GPU run has compared these files with the usual ones (FLASHLET_CUTE_PRECOMPILE=1
turns it on): the worker's files are keyed apart (`TRACED`), so the two never mix.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

from flashlet.kernels import cute_disk_cache

log = logging.getLogger(__name__)

ENV = "FLASHLET_CUTE_PRECOMPILE"
TRACED = "stand-ins on the host"  # the workers' way of tracing, part of their files' keys
MIN_PLANS = 2   # fewer plans missing than this: compiling them in the engine costs no more
MAX_WORKERS = 8
WAIT_S = 300.0  # the longest a GEMV's first call waits for a worker's file
EXIT_S = 5.0    # the longest a worker with all its files written is given to exit

_PENDING: dict[str, "Precompile"] = {}  # a worker's key -> the job compiling it


def enabled() -> bool:
    value = os.environ.get(ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def worker_count(num_plans: int, cpus: int | None = None) -> int:
    """Half the machine's CPUs (the engine's own warm-up compiles Triton kernels meanwhile), at
    most MAX_WORKERS, never more than the plans."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 2)
    return max(1, min(num_plans, cpus // 2, MAX_WORKERS))


class Precompile:
    """Worker processes compiling plans into the cache folder; `wait` for one plan's file."""

    def __init__(self, jobs: list[tuple[object, str]], folder: Path, arch: str,
                 command: list[str] | None = None, workers: int | None = None):
        """jobs: (plan, key) pairs; arch: the GPU's (sm_90a), which the workers trace for.
        command: the worker's argv (a test's stand-in; default this module)."""
        self.folder = folder
        count = min(workers, len(jobs)) if workers is not None else worker_count(len(jobs))
        shares = [jobs[i::count] for i in range(count)]  # round robin: each a mix of the rows
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.setdefault("CUTE_DSL_ARCH", arch)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        argv = command or [sys.executable, "-m", "flashlet.kernels.cute_precompile"]
        self.worker_of: dict[str, subprocess.Popen] = {}
        for share in shares:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)
            try:
                proc.stdin.write(pickle.dumps([(plan, key, str(folder)) for plan, key in share]))
                proc.stdin.close()
            except OSError:  # the worker died at once: its plans compile in the engine
                pass
            for _, key in share:
                self.worker_of[key] = proc
                _PENDING[key] = self
        log.info("CuTe GEMVs: %d plans compiling in %d worker processes (%s=1)",
                 len(jobs), len(shares), ENV)

    def wait(self, key: str, timeout: float = WAIT_S) -> bool:
        """Until the key's file is there (True) or its worker has ended without it (False)."""
        path = self.folder / f"{key}.o"
        proc = self.worker_of.get(key)
        deadline = time.monotonic() + timeout
        while not path.is_file():
            if proc is None or proc.poll() is not None or time.monotonic() > deadline:
                _PENDING.pop(key, None)
                return path.is_file()
            time.sleep(0.005)
        _PENDING.pop(key, None)
        return True

    def close(self) -> None:
        """Reap the workers: one whose files are all there is let exit (a moment); one still at
        a plan (hung, or slower than the engine, which compiled the plan itself) is killed."""
        for proc in set(self.worker_of.values()):
            done = all((self.folder / f"{key}.o").is_file()
                       for key, owner in self.worker_of.items() if owner is proc)
            try:
                proc.wait(timeout=EXIT_S if done else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for key in self.worker_of:
            _PENDING.pop(key, None)


def stand_in_key(plan, device) -> str | None:
    from flashlet.kernels.cute_gemv import _disk_key

    return _disk_key(plan, device, TRACED)


def start(gemvs) -> Precompile | None:
    """Workers for the plans of `gemvs` (CuteGemv objects on one GPU) found on disk neither way,
    or None: precompiling off, the cache off, or fewer than MIN_PLANS missing."""
    if not enabled():
        return None
    from flashlet.kernels.cute_gemv import _COMPILED, _disk_key

    folder = cute_disk_cache.usable_dir()
    if folder is None:
        return None
    jobs, seen, device = [], set(), None
    for gemv in gemvs:
        if gemv.device.type != "cuda":
            return None
        if gemv.plan in seen or (gemv.plan, str(gemv.device)) in _COMPILED:
            continue
        seen.add(gemv.plan)
        device = gemv.device
        usual, key = _disk_key(gemv.plan, gemv.device), stand_in_key(gemv.plan, gemv.device)
        if key is None or key in _PENDING:
            continue
        if not (folder / f"{usual}.o").is_file() and not (folder / f"{key}.o").is_file():
            jobs.append((gemv.plan, key))
    if len(jobs) < MIN_PLANS:
        return None
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return Precompile(jobs, folder, f"sm_{major}{minor}{'a' if major >= 9 else ''}")


def load(plan, device):
    """The launcher a worker traced for this plan (waiting for the worker where one is at it),
    or None: precompiling off, no such file, or a worker that failed."""
    if not enabled():
        return None
    key = stand_in_key(plan, device)
    if key is None:
        return None
    job = _PENDING.get(key)
    if job is not None:
        job.wait(key)
    return cute_disk_cache.load(key)


def compile_into(jobs: list[tuple[object, str, str]]) -> int:
    """A worker's part: trace each plan with stand-ins, export it under its key into its folder
    (cute_disk_cache.store), stopping early if the engine's process ends; returns how many
    failed."""
    import torch

    from flashlet.kernels.cute_gemv import CuteGemv

    torch.set_num_threads(1)
    failed, parent = 0, os.getppid()
    for plan, key, folder in jobs:
        if os.getppid() != parent:  # the engine is gone: nobody waits for the rest
            return failed
        os.environ[cute_disk_cache.ENV] = folder
        try:
            compiled = CuteGemv.of_plan(plan, "cpu")._compile_now(None)
        except Exception as e:  # the engine compiles this one itself
            log.warning("precompiling a CuTe GEMV failed (%s: %s)", type(e).__name__, e)
            failed += 1
            continue
        failed += not cute_disk_cache.store(key, compiled)
    return failed


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="cute_precompile: %(message)s")
    sys.exit(1 if compile_into(pickle.loads(sys.stdin.buffer.read())) else 0)
