"""The fused path's CuTe GEMVs compiled side by side in worker processes, for a first start.

A machine's first engine start compiles each of the fused decode path's GEMVs one after
another in the engine's process: 30 at the 0.5B shape, 10-18 s of a 31-53 s cold start on an
H100 (FUSED_NOTES.md, "Session 50"); later starts load them from cute_disk_cache. A GEMV's
compile needs no GPU: traced with stand-ins of its arguments' shapes (`CuteGemv._fake_args`,
what the CPU's PTX tests lower), it lowers for the arch it is told, and computes what the
launcher traced with the GPU's own tensors computes, bit for bit (the GPU test in
tests/kernels/test_cute_precompile.py; H100, 2026-12-06). So as soon
as the plans are known (FusedDecode's constructor, before the warm-up), `start` hands those not
on disk to a few worker processes (`python -m flashlet.kernels.cute_precompile`), which trace
and export them into the cache folder while the engine goes on with its own warm-up; a GEMV's
first call (`CuteGemv.compile`) then waits for its file, loads it, and compiles the kernel
itself only where a worker failed.

On by default (FLASHLET_CUTE_PRECOMPILE=0 turns it off): on an H100 a first start of the 0.5B
took 21 s with the workers against 35 s without (FUSED_NOTES.md, "Session 52"). A worker's file
has the usual key, so a later start loads it as any other.
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
MIN_PLANS = 2   # fewer plans missing than this: compiling them in the engine costs no more
MAX_WORKERS = 8
WAIT_S = 300.0  # the longest a GEMV's first call waits for a worker's file
EXIT_S = 5.0    # the longest a worker with all its files written is given to exit

_PENDING: dict[str, "Precompile"] = {}  # a worker's key -> the job compiling it


def enabled() -> bool:
    value = os.environ.get(ENV, "1").strip()
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
        self.started = time.time()  # wall clock: compared with the files' mtimes
        self.waited_s = 0.0  # the engine's GEMVs' waits for the workers' files
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
        t0 = time.monotonic()
        try:
            while not path.is_file():
                if proc is None or proc.poll() is not None or time.monotonic() > t0 + timeout:
                    return path.is_file()
                time.sleep(0.005)
            return True
        finally:
            _PENDING.pop(key, None)
            self.waited_s += time.monotonic() - t0

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

    def report(self) -> dict:
        """When the workers' files came, in seconds from their start (the first file: a worker's
        imports and one plan), and how long the engine waited for them in all."""
        made = sorted(path.stat().st_mtime - self.started for path in
                      (self.folder / f"{key}.o" for key in self.worker_of) if path.is_file())
        return {"workers": len(set(self.worker_of.values())), "plans": len(self.worker_of),
                "files": len(made), "first_file_s": made[0] if made else None,
                "last_file_s": made[-1] if made else None, "waited_s": self.waited_s}


def start(gemvs) -> Precompile | None:
    """Workers for the plans of `gemvs` (CuteGemv objects on one GPU) not on disk yet, or None: precompiling off, the cache off, or fewer than MIN_PLANS missing."""
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
        key = _disk_key(gemv.plan, gemv.device)
        if key is not None and key not in _PENDING and not (folder / f"{key}.o").is_file():
            jobs.append((gemv.plan, key))
    if len(jobs) < MIN_PLANS:
        return None
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return Precompile(jobs, folder, f"sm_{major}{minor}{'a' if major >= 9 else ''}")


def load(key: str):
    """The launcher a worker is compiling under this disk key, once its file is there, or None:
    no worker at it (precompiling off, or the plan was on disk before), or a worker that failed."""
    job = _PENDING.get(key)
    if job is None or not job.wait(key):
        return None
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
