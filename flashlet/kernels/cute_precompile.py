"""The fused path's CuTe GEMVs compiled side by side in worker processes, for a first start.

A machine's first engine start compiles each of the fused decode path's GEMVs one after
another in the engine's process: 30 at the 0.5B shape, 10-18 s of a 31-53 s cold start on an
H100 (FUSED_NOTES.md, "Session 50"); later starts load them from cute_disk_cache. A GEMV's
compile needs no GPU: traced with stand-ins of its arguments' shapes (`CuteGemv._fake_args`,
what the CPU's PTX tests lower), it lowers for the arch it is told, and computes what the
launcher traced with the GPU's own tensors computes, bit for bit (the GPU test in
tests/kernels/test_cute_precompile.py; H100, 2026-12-06). So as soon as the plans are known
(FusedDecode's constructor, before the warm-up), `start` hands those not on disk to a few
worker processes (`python -m flashlet.kernels.cute_precompile`), which trace and export them
into the cache folder while the engine goes on with its own warm-up; a GEMV's first call
(`CuteGemv.compile`) then waits for its file, loads it, and compiles the kernel itself only
where a worker failed.

A worker's own start (Python and the DSL imported; torch kept out) takes seconds, so on an engine
configuration's first start on a machine (no stamp for it in the cache folder: `prestart`) the
workers are started before the weights load, and wait for their plans; the stamp is written
once the engine has started (`mark_started`), and later starts spawn workers only for plans
found missing.

On by default (FLASHLET_CUTE_PRECOMPILE=0 turns it off; =late starts the workers only once the
plans are known, an A/B). On an H100, a start of the 0.5B with an empty CuTe cache took 21 s
with late workers against 35 s without (FUSED_NOTES.md, "Session 52"); with torch kept out of
the workers (a worker's start 2.2-2.4 s against 4.8-5.1), 8.9-10.5 s, early and late level
("Session 53"). A worker's file has the usual key, so a later start loads it as any other.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import select
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
IDLE_S = 600.0  # the longest a pre-started worker waits for its plans (an engine that failed)

_PENDING: dict[str, "Precompile"] = {}  # a worker's key -> the job compiling it
_PRESTARTED: "Workers | None" = None  # this process's workers started before its plans were known


def mode() -> str:
    """FLASHLET_CUTE_PRECOMPILE: "1" (the default: workers, started early on a first start),
    "late" (started only once the plans are known) or "0" (none)."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in ("0", "1", "late"):
        raise ValueError(f"{ENV} must be 0, 1 or late, got {value!r}")
    return value


def enabled() -> bool:
    return mode() != "0"


def worker_count(num_plans: int, cpus: int | None = None) -> int:
    """Half the machine's CPUs (the engine's own warm-up compiles Triton kernels meanwhile), at
    most MAX_WORKERS, never more than the plans."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 2)
    return max(1, min(num_plans, cpus // 2, MAX_WORKERS))


class Workers:
    """Worker processes (`python -m flashlet.kernels.cute_precompile`) that import what a trace
    needs at once, then wait on stdin for their plans (`hand`)."""

    def __init__(self, count: int, arch: str, command: list[str] | None = None):
        """arch: the GPU's (sm_90a), which the workers trace for (the DSL reads it at import).
        command: the worker's argv (a test's stand-in; default this module)."""
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.setdefault("CUTE_DSL_ARCH", arch)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        argv = command or [sys.executable, "-m", "flashlet.kernels.cute_precompile"]
        self.arch = arch
        self.started = time.time()  # wall clock: compared with the files' mtimes
        self.procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, env=env) for _ in range(count)]

    def hand(self, shares: list[list[tuple[object, str, str]]]) -> None:
        """Each worker its share of (plan, key, folder) jobs; workers past the shares get none
        (they exit). A worker is handed its share once."""
        for i, proc in enumerate(self.procs):
            if proc.stdin.closed:
                continue
            try:
                proc.stdin.write(pickle.dumps(shares[i] if i < len(shares) else []))
                proc.stdin.close()
            except OSError:  # the worker died: its plans compile in the engine
                pass

    def release(self) -> None:
        """No plans for any worker not handed its share yet: they exit."""
        self.hand([])


class Precompile:
    """Worker processes compiling plans into the cache folder; `wait` for one plan's file."""

    def __init__(self, jobs: list[tuple[object, str]], folder: Path, arch: str,
                 command: list[str] | None = None, workers: int | None = None,
                 pool: Workers | None = None):
        """jobs: (plan, key) pairs; arch: the GPU's (sm_90a), which the workers trace for.
        command: the worker's argv (a test's stand-in; default this module). pool: workers
        started before (prestart), of which those past the jobs are let go."""
        self.folder = folder
        if pool is None:
            count = min(workers, len(jobs)) if workers is not None else worker_count(len(jobs))
            pool = Workers(count, arch, command)
        self.pool = pool
        self.waited_s = 0.0  # the engine's GEMVs' waits for the workers' files
        count = min(len(pool.procs), len(jobs))
        shares = [jobs[i::count] for i in range(count)]  # round robin: each a mix of the rows
        pool.hand([[(plan, key, str(folder)) for plan, key in share] for share in shares])
        self.worker_of: dict[str, subprocess.Popen] = {}
        for proc, share in zip(pool.procs, shares):
            for _, key in share:
                self.worker_of[key] = proc
                _PENDING[key] = self
        log.info("CuTe GEMVs: %d plans compiling in %d worker processes (%s)",
                 len(jobs), len(shares), ENV)

    def wait(self, key: str, timeout: float = WAIT_S) -> bool:
        """Until the key's file is there (True) or its worker has ended without it (False)."""
        path = cute_disk_cache.file_of(self.folder, key)
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
        """Reap the workers: one whose files are all there (or that had none) is let exit (a
        moment); one still at a plan (hung, or slower than the engine, which compiled the plan
        itself) is killed."""
        for proc in self.pool.procs:
            done = all(cute_disk_cache.file_of(self.folder, key).is_file()
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
        made = sorted(path.stat().st_mtime - self.pool.started for path in
                      (cute_disk_cache.file_of(self.folder, key) for key in self.worker_of) if path.is_file())
        return {"workers": len(set(self.worker_of.values())), "plans": len(self.worker_of),
                "files": len(made), "first_file_s": made[0] if made else None,
                "last_file_s": made[-1] if made else None, "waited_s": self.waited_s}


def _stamp(engine_config, arch: str) -> Path | None:
    """The file that says an engine of this configuration started on this machine's GPU kind
    with this kernel source and DSL (None with the cache off)."""
    folder = cute_disk_cache.usable_dir()
    if folder is None:
        return None
    from flashlet.kernels.cute_gemv import dsl_version

    # hashed as a launcher's file name is, the configuration in the plan's place
    return folder / f"{cute_disk_cache.kernel_key(engine_config, arch, dsl_version())}.started"


def _arch(device) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def prestart(engine_config, device) -> None:
    """On this configuration's first start on this machine, start the workers now (before the
    weights load) so that their imports are done when the plans are known; `start` hands them
    the plans. Nothing where precompiling is off or late, off CUDA, with the cache off, or once
    the stamp is there."""
    global _PRESTARTED
    release_prestarted()
    if mode() != "1" or device.type != "cuda" or cute_disk_cache.usable_dir() is None:
        return  # (no DSL that loads files: nothing asks the GPU its arch)
    arch = _arch(device)
    stamp = _stamp(engine_config, arch)
    if stamp is None or stamp.is_file():
        return
    _PRESTARTED = Workers(worker_count(MAX_WORKERS), arch)
    log.info("CuTe GEMVs: %d worker processes started ahead of the plans (a first start: no %s)",
             len(_PRESTARTED.procs), stamp.name)


def release_prestarted() -> None:
    """The pre-started workers `start` did not take (the fused path off, or its plans on disk)
    are let go."""
    global _PRESTARTED
    if _PRESTARTED is not None:
        _PRESTARTED.release()
        _PRESTARTED = None


def mark_started(engine_config, device) -> None:
    """Write the stamp `prestart` looks for: this configuration has started here."""
    if device.type != "cuda" or not enabled() or cute_disk_cache.usable_dir() is None:
        return
    stamp = _stamp(engine_config, _arch(device))
    if stamp is not None and not stamp.is_file():
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(repr(engine_config) + "\n")
        except OSError as e:  # a read-only cache: the next start starts workers early again
            log.warning("could not write %s (%s)", stamp, e)


def start(gemvs) -> Precompile | None:
    """Workers for the plans of `gemvs` (CuteGemv objects on one GPU) not on disk yet (the
    pre-started ones where there are), or None: precompiling off, the cache off, or fewer than
    MIN_PLANS missing."""
    global _PRESTARTED
    pool, _PRESTARTED = _PRESTARTED, None
    job = None
    try:
        job = _start(gemvs, pool)
    finally:
        if pool is not None and (job is None or job.pool is not pool):
            pool.release()
    return job


def _start(gemvs, pool: Workers | None) -> Precompile | None:
    if not enabled():
        return None
    from flashlet.kernels.cute_gemv import _COMPILED, _disk_key

    folder = cute_disk_cache.usable_dir()
    if folder is None:
        return None
    jobs, seen, device = [], set(), None
    for gemv in gemvs:
        if getattr(getattr(gemv, "device", None), "type", None) != "cuda":
            return None  # a CPU engine's, or a stand-in class's (the CPU wiring tests')
        if gemv.plan in seen or (gemv.plan, str(gemv.device)) in _COMPILED:
            continue
        seen.add(gemv.plan)
        device = gemv.device
        key = _disk_key(gemv.plan, gemv.device)
        if key is not None and key not in _PENDING and not cute_disk_cache.file_of(folder, key).is_file():
            jobs.append((gemv.plan, key))
    if len(jobs) < MIN_PLANS:
        return None
    arch = _arch(device)
    return Precompile(jobs, folder, arch, pool=pool if pool is not None and pool.arch == arch else None)


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
    from flashlet.kernels.cute_gemv import CuteGemv

    failed, parent = 0, os.getppid()
    for plan, key, folder in jobs:
        if os.getppid() != parent:  # the engine is gone: nobody waits for the rest
            return failed
        os.environ[cute_disk_cache.ENV] = folder
        try:
            compiled = CuteGemv.stand_in(plan)._compile_now(None)
        except Exception as e:  # the engine compiles this one itself
            log.warning("precompiling the CuTe GEMV %s failed (%s: %s); the engine compiles it",
                        _named(plan), type(e).__name__, brief(e))
            log.debug("the worker's trace of %s", plan, exc_info=True)
            failed += 1
            continue
        failed += not cute_disk_cache.store(key, compiled)
    return failed


def _named(plan) -> str:
    """A plan as the warnings name it: its shape, epilogue and plan tag."""
    describe = getattr(plan, "describe", None)
    return f"{plan.n_rows} x {plan.k} {plan.epilogue} ({describe()})" if describe else repr(plan)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def brief(e: Exception) -> str:
    """An exception's message in one line: the DSL's are dozens of coloured lines (the error, the
    GPU, suggestions), of which the first with text says what failed."""
    lines = [line.strip() for line in _ANSI.sub("", str(e)).splitlines()]
    return next((line for line in lines if line), "")


def read_jobs(stdin, idle_s: float = IDLE_S) -> list:
    """The plans handed to this worker (none: the engine let it go or its process ended, or
    nothing came within idle_s)."""
    ready, _, _ = select.select([stdin], [], [], idle_s)
    data = stdin.read() if ready else b""
    return pickle.loads(data) if data else []


def init_driver() -> bool:
    """The CUDA driver initialised in this process (cuInit: no context, no GPU memory). The DSL
    reads the GPU's shared memory per SM while it traces a register-capped plan (min_ctas > 1,
    for the carveout), which fails with CUDA_ERROR_NOT_INITIALIZED in a process that never
    called cuInit: a torch-free worker (session 54, an H100: the engine then compiled those
    GEMVs itself). False where no driver answers (a host without a GPU): such plans then fail
    in the worker, as before, and the engine compiles them."""
    try:
        from cuda.bindings import driver
        return driver.cuInit(0)[0] == driver.CUresult.CUDA_SUCCESS
    except Exception:  # noqa: BLE001  (no cuda-python, no driver library, no device)
        return False


def main() -> int:
    """A worker: import what a trace needs (the kernels, the DSL) and initialise the driver
    before the plans come, then compile them; 1 if any failed. Torch stays out: a stand-in trace
    needs none, and its import was half a worker's start (2.6 of 4.8-5.1 s on an H100 machine,
    FUSED_NOTES "Session 52")."""
    logging.basicConfig(level=logging.WARNING, format="cute_precompile: %(message)s")
    sys.modules["torch"] = None  # an import of torch now raises ImportError (cute_gemv's is optional)
    from flashlet.kernels.cute_gemv import cute_available

    cute_available()
    init_driver()
    return 1 if compile_into(read_jobs(sys.stdin.buffer)) else 0


if __name__ == "__main__":
    sys.exit(main())
