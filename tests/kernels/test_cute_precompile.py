"""The fused path's GEMVs compiled in worker processes (flashlet.kernels.cute_precompile): which
plans `start` hands out and to how many workers, a GEMV's first call waiting for its worker's
file (or compiling itself where the worker failed), the workers ended; with the CuTe DSL on
the path, a worker really traces and exports the plans (the host needs no GPU for that)."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from flashlet.kernels import cute_disk_cache, cute_gemv, cute_precompile
from flashlet.kernels.cute_gemv import CuteGemv, RopeKV, RopeShape, plan_gemv

HAVE_CUTE, NO_CUTE_REASON = cute_gemv.cute_available()

# A worker standing in for the real one: writes each job's file after `delay` s, except keys
# starting with "fail", then exits 1 if any failed (the real worker's exit).
STUB_WORKER = textwrap.dedent("""
    import pickle, sys, time
    from pathlib import Path
    jobs = pickle.loads(sys.stdin.buffer.read())
    failed = 0
    for plan, key, folder in jobs:
        time.sleep(float(sys.argv[1]))
        if key.startswith("fail"):
            failed += 1
        else:
            Path(folder, key + ".o").write_text(repr(plan))
    sys.exit(1 if failed else 0)
""")


def stub(delay: float = 0.0) -> list[str]:
    return [sys.executable, "-c", STUB_WORKER, str(delay)]


def test_the_switch_is_on_by_default_and_reads_0_1_or_late(monkeypatch):
    monkeypatch.delenv(cute_precompile.ENV, raising=False)
    assert cute_precompile.enabled() and cute_precompile.mode() == "1"
    monkeypatch.setenv(cute_precompile.ENV, "late")
    assert cute_precompile.enabled() and cute_precompile.mode() == "late"
    monkeypatch.setenv(cute_precompile.ENV, "0")
    assert not cute_precompile.enabled()
    monkeypatch.setenv(cute_precompile.ENV, "yes")
    with pytest.raises(ValueError, match="must be 0, 1 or late"):
        cute_precompile.enabled()


def test_workers_are_half_the_cpus_at_most_eight_never_more_than_the_plans():
    assert cute_precompile.worker_count(30, cpus=16) == 8
    assert cute_precompile.worker_count(30, cpus=64) == 8
    assert cute_precompile.worker_count(3, cpus=16) == 3
    assert cute_precompile.worker_count(30, cpus=2) == 1
    assert cute_precompile.worker_count(30, cpus=1) == 1


def test_each_plan_goes_to_one_worker_and_its_first_call_waits_for_the_file(tmp_path):
    jobs = [(f"plan {i}", f"key{i}") for i in range(5)]
    job = cute_precompile.Precompile(jobs, tmp_path, "sm_90a", command=stub(0.2), workers=2)
    try:
        assert len(set(job.worker_of.values())) == 2
        assert all(cute_precompile._PENDING[key] is job for _, key in jobs)
        t0 = time.monotonic()
        assert job.wait("key4")  # round robin: worker 0 has key0, key2, key4 (0.2 s each)
        assert time.monotonic() - t0 >= 0.6 and (tmp_path / "key4.o").read_text() == "'plan 4'"
        assert "key4" not in cute_precompile._PENDING
        for _, key in jobs:
            assert job.wait(key)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"key{i}.o" for i in range(5)]
    finally:
        job.close()
    assert not cute_precompile._PENDING
    assert all(proc.returncode == 0 for proc in job.worker_of.values())
    # When the files came (from the workers' start: the first after one plan's 0.2 s, the last
    # after three), and the engine's waits (at least the 0.6 s for key4).
    report = job.report()
    assert (report["workers"], report["plans"], report["files"]) == (2, 5, 5)
    assert 0.15 <= report["first_file_s"] <= report["last_file_s"] and report["last_file_s"] >= 0.55
    assert report["waited_s"] >= 0.6


def test_a_failed_plan_is_not_waited_for_past_its_workers_end(tmp_path):
    job = cute_precompile.Precompile([("a", "fail-a"), ("b", "key-b")], tmp_path, "sm_90a",
                                     command=stub(), workers=1)
    try:
        assert not job.wait("fail-a", timeout=60)  # the worker ended without it
        assert job.wait("key-b")
    finally:
        job.close()
    assert next(iter(job.worker_of.values())).returncode == 1


def test_close_ends_workers_still_running(tmp_path):
    job = cute_precompile.Precompile([("a", "k-a"), ("b", "k-b")], tmp_path, "sm_90a",
                                     command=stub(60), workers=2)
    job.close()
    assert all(proc.returncode is not None for proc in job.worker_of.values())
    assert not cute_precompile._PENDING and not list(tmp_path.iterdir())


def test_a_worker_that_cannot_start_its_jobs_leaves_them_to_the_engine(tmp_path):
    job = cute_precompile.Precompile([("a", "k-a"), ("b", "k-b")], tmp_path, "sm_90a",
                                     command=[sys.executable, "-c", "import sys; sys.exit(3)"], workers=1)
    try:
        assert not job.wait("k-a", timeout=60) and not job.wait("k-b", timeout=60)
    finally:
        job.close()


def test_workers_get_the_gpus_arch_and_this_checkout_on_their_path(tmp_path, monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    script = ("import os, pickle, sys; from pathlib import Path; "
              "jobs = pickle.loads(sys.stdin.buffer.read()); "
              "Path(jobs[0][2], jobs[0][1] + '.o').write_text("
              "os.environ['CUTE_DSL_ARCH'] + '|' + os.environ['PYTHONPATH'] + '|' + os.environ['OMP_NUM_THREADS'])")
    job = cute_precompile.Precompile([("a", "k")], tmp_path, "sm_90a", command=[sys.executable, "-c", script])
    try:
        assert job.wait("k", timeout=60)
    finally:
        job.close()
    arch, path, threads = (tmp_path / "k.o").read_text().split("|")
    repo = str(cute_precompile.Path(cute_precompile.__file__).resolve().parents[2])
    assert arch == "sm_90a" and path.split(os.pathsep) == [repo, "/elsewhere"] and threads == "1"


class FakeGemv(SimpleNamespace):
    pass


def test_start_hands_out_the_plans_not_on_disk_once_each(tmp_path, monkeypatch):
    """A plan's file already there, a plan compiled in this process, a plan a worker of an
    earlier start is at, a plan twice: none handed out; the rest go to Precompile with their
    disk keys. No workers for a CPU engine, GEMVs with no device (the CPU wiring tests' stand-in
    class), the switch off or the cache off."""
    monkeypatch.delenv(cute_precompile.ENV, raising=False)  # on by default
    monkeypatch.setattr(cute_disk_cache, "usable_dir", lambda: tmp_path)
    monkeypatch.setattr(cute_gemv, "_disk_key", lambda plan, device: f"{plan}-key")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    made = []
    monkeypatch.setattr(cute_precompile, "Precompile",
                        lambda jobs, folder, arch, pool: made.append((jobs, folder, arch, pool)) or "job")
    (tmp_path / "on-disk-key.o").write_text("")
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(cute_gemv._COMPILED, ("here", str(cuda)), object())
    monkeypatch.setitem(cute_precompile._PENDING, "pending-key", object())
    plans = ["on-disk", "here", "pending", "a", "b", "a", "c"]
    assert cute_precompile.start(FakeGemv(plan=p, device=cuda) for p in plans) == "job"
    assert made == [([("a", "a-key"), ("b", "b-key"), ("c", "c-key")], tmp_path, "sm_90a", None)]
    # Fewer than MIN_PLANS missing, the switch off, the cache off, or a CPU engine: no workers.
    made.clear()
    assert cute_precompile.start([FakeGemv(plan="a", device=cuda)]) is None
    monkeypatch.setenv(cute_precompile.ENV, "0")
    assert cute_precompile.start(FakeGemv(plan=p, device=cuda) for p in "abc") is None
    monkeypatch.setenv(cute_precompile.ENV, "1")
    assert cute_precompile.start(FakeGemv(plan=p, device=torch.device("cpu")) for p in "abc") is None
    assert cute_precompile.start(FakeGemv(plan=p) for p in "abc") is None  # no device: a test's stand-in
    monkeypatch.setattr(cute_disk_cache, "usable_dir", lambda: None)
    assert cute_precompile.start(FakeGemv(plan=p, device=cuda) for p in "abc") is None
    assert not made


def test_a_gemvs_first_call_waits_for_its_workers_file_and_loads_it(tmp_path, monkeypatch):
    """CuteGemv.compile: the plan's file not there yet, a worker at it -> the file is waited for
    and loaded (counted as from disk), nothing compiled here."""
    monkeypatch.setenv(cute_disk_cache.ENV, str(tmp_path))
    monkeypatch.setattr(cute_gemv, "_disk_key", lambda plan, device: "k")
    job = cute_precompile.Precompile([("p", "k")], tmp_path, "sm_90a", command=stub(0.3), workers=1)
    loaded = []
    monkeypatch.setattr(cute_disk_cache, "load",
                        lambda key: loaded.append((key, (tmp_path / f"{key}.o").is_file())) or (
                            "launcher" if (tmp_path / f"{key}.o").is_file() else None))
    gemv = CuteGemv(896, 896, "residual", device="cpu")
    monkeypatch.setattr(gemv, "_compile_now", lambda rope_kv: pytest.fail("compiled in the engine"))
    try:
        gemv.compile()
    finally:
        job.close()
        cute_gemv._COMPILED.pop((gemv.plan, "cpu"), None)
    assert loaded == [("k", False), ("k", True)] and gemv._compiled == "launcher" and gemv.from_disk


def test_a_gemvs_first_call_compiles_where_its_worker_failed_or_none_is_at_it(tmp_path, monkeypatch):
    """CuteGemv.compile: the worker ended without the file, or no worker at all (precompiling
    off) -> compiled in the engine and stored under the same key."""
    monkeypatch.setenv(cute_disk_cache.ENV, str(tmp_path))
    monkeypatch.setattr(cute_gemv, "_disk_key", lambda plan, device: "fail-k")
    monkeypatch.setattr(cute_disk_cache, "load", lambda key: None)
    stored = []
    monkeypatch.setattr(cute_disk_cache, "store", lambda key, compiled: stored.append((key, compiled)))
    for worker in (True, False):
        job = (cute_precompile.Precompile([("p", "fail-k")], tmp_path, "sm_90a", command=stub(), workers=1)
               if worker else None)
        gemv = CuteGemv(896, 896, "residual", device="cpu")
        monkeypatch.setattr(gemv, "_compile_now", lambda rope_kv: "compiled here")
        try:
            gemv.compile()
        finally:
            if job is not None:
                job.close()
            cute_gemv._COMPILED.pop((gemv.plan, "cpu"), None)
        assert gemv._compiled == "compiled here" and not gemv.from_disk
    assert stored == [("fail-k", "compiled here")] * 2 and not cute_precompile._PENDING


# A pre-started worker standing in for the real one: it says it is up (its "imports" done),
# then waits for its plans as the real one does (read_jobs) and writes each job's file.
STUB_EARLY_WORKER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from flashlet.kernels.cute_precompile import read_jobs
    Path(sys.argv[1], "up-%d" % __import__("os").getpid()).write_text("")
    for plan, key, folder in read_jobs(sys.stdin.buffer, idle_s=float(sys.argv[2])):
        Path(folder, key + ".o").write_text(repr(plan))
""")


def early_stub(tmp_path, idle_s: float = 60.0) -> list[str]:
    return [sys.executable, "-c", STUB_EARLY_WORKER, str(tmp_path), str(idle_s)]


def wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_pre_started_workers_wait_for_their_plans_and_those_past_the_plans_exit(tmp_path):
    """Workers started before the plans are known: up and waiting; then 3 plans for 4 workers
    (round robin over 3 of them), the fourth handed nothing exits at once."""
    up, out = tmp_path / "up", tmp_path / "out"
    up.mkdir(), out.mkdir()
    pool, job = cute_precompile.Workers(4, "sm_90a", command=early_stub(up)), None
    try:
        assert wait_for(lambda: len(list(up.iterdir())) == 4)  # all up, nothing to do yet
        assert all(proc.poll() is None for proc in pool.procs)
        job = cute_precompile.Precompile([("a", "ka"), ("b", "kb"), ("c", "kc")], out, "sm_90a", pool=pool)
        assert job.pool is pool and [job.worker_of[k] for k in ("ka", "kb", "kc")] == pool.procs[:3]
        assert all(job.wait(key) for key in ("ka", "kb", "kc"))
        assert pool.procs[3].wait(timeout=60) == 0
    finally:
        job.close() if job is not None else pool.release()
    assert all(proc.returncode == 0 for proc in pool.procs)
    assert sorted(p.name for p in out.iterdir()) == ["ka.o", "kb.o", "kc.o"]
    assert (out / "kb.o").read_text() == "'b'"


def test_a_pre_started_worker_let_go_or_never_handed_plans_exits(tmp_path):
    """release: the workers exit with nothing done; a worker nobody hands plans to (an engine
    that failed while the weights loaded) gives up after its idle time."""
    pool = cute_precompile.Workers(2, "sm_90a", command=early_stub(tmp_path))
    pool.release()
    assert [proc.wait(timeout=60) for proc in pool.procs] == [0, 0]
    pool.release()  # twice: nothing more
    idle = cute_precompile.Workers(1, "sm_90a", command=early_stub(tmp_path, idle_s=0.2))
    try:
        assert idle.procs[0].wait(timeout=60) == 0
    finally:
        idle.release()
    assert not list(tmp_path.glob("*.o"))


class FakeWorkers:
    def __init__(self, count, arch, command=None):
        self.procs, self.arch, self.released = [None] * count, arch, False

    def release(self):
        self.released = True


def test_workers_start_ahead_on_a_configurations_first_start_only(tmp_path, monkeypatch):
    """prestart: workers started before the weights load where no stamp says this engine
    configuration started here before; mark_started writes the stamp (keyed by the
    configuration), after which the same configuration starts none ahead and another does.
    None with precompiling off or late, off CUDA, or with the cache off."""
    monkeypatch.delenv(cute_precompile.ENV, raising=False)
    monkeypatch.setattr(cute_disk_cache, "usable_dir", lambda: tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cute_precompile, "Workers", FakeWorkers)
    cuda, config, other = torch.device("cuda", 0), "EngineConfig(a)", "EngineConfig(b)"

    def ahead(config, device=cuda):
        cute_precompile.prestart(config, device)
        pool, cute_precompile._PRESTARTED = cute_precompile._PRESTARTED, None
        return pool

    pool = ahead(config)
    assert pool is not None and pool.arch == "sm_90a"
    assert len(pool.procs) == cute_precompile.worker_count(cute_precompile.MAX_WORKERS)
    cute_precompile.mark_started(config, cuda)
    assert len(list(tmp_path.glob("*.started"))) == 1
    assert ahead(config) is None and ahead(other) is not None
    assert ahead(other, torch.device("cpu")) is None
    for value in ("0", "late"):
        monkeypatch.setenv(cute_precompile.ENV, value)
        assert ahead(other) is None
    monkeypatch.delenv(cute_precompile.ENV)
    monkeypatch.setattr(cute_disk_cache, "usable_dir", lambda: None)
    assert ahead(other) is None
    cute_precompile.mark_started(other, cuda)  # the cache off: no stamp, no error
    assert len(list(tmp_path.glob("*.started"))) == 1


def test_start_takes_the_pre_started_workers_or_lets_them_go(tmp_path, monkeypatch):
    """start hands the plans to the pre-started workers; with too few plans missing it lets them
    go, and release_prestarted lets go of workers no fused path took."""
    monkeypatch.delenv(cute_precompile.ENV, raising=False)
    monkeypatch.setattr(cute_disk_cache, "usable_dir", lambda: tmp_path)
    monkeypatch.setattr(cute_gemv, "_disk_key", lambda plan, device: f"{plan}-key")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    made = []
    monkeypatch.setattr(cute_precompile, "Precompile", lambda jobs, folder, arch, pool: made.append(pool) or
                        SimpleNamespace(pool=pool))
    cuda = torch.device("cuda", 0)
    for plans, taken in (("abc", True), ("a", False)):
        pool = cute_precompile._PRESTARTED = FakeWorkers(8, "sm_90a")
        job = cute_precompile.start(FakeGemv(plan=p, device=cuda) for p in plans)
        assert (job is not None) == taken and pool.released != taken
        assert cute_precompile._PRESTARTED is None
    assert made == [made[0]] and made[0] is not None
    pool = cute_precompile._PRESTARTED = FakeWorkers(8, "sm_90a")
    cute_precompile.release_prestarted()
    assert pool.released and cute_precompile._PRESTARTED is None


def cubin_sm(obj: bytes) -> int:
    """The SM of the cubin inside an exported object file (the inner ELF's e_flags, low byte)."""
    inner = obj.find(b"\x7fELF", 1)
    assert inner > 0, "no cubin inside"
    return struct.unpack_from("<I", obj, inner + 48)[0] & 0xFF


def exported_by_workers(plans, folder, prefix: str, workers: int = 1):
    """The plans handed to `workers` real worker processes tracing for sm_90a, each one's file
    waited for in folder -> (the jobs, the ended Precompile)."""
    jobs = [(plan, f"{prefix}{i}") for i, plan in enumerate(plans)]
    job = cute_precompile.Precompile(jobs, folder, "sm_90a", workers=workers)
    try:
        assert all(job.wait(key, timeout=280) for _, key in jobs)
    finally:
        job.close()
    return jobs, job


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_CUTE, reason=f"needs the CuTe DSL: {NO_CUTE_REASON[:120]}")
def test_a_worker_traces_and_exports_each_plan_for_the_arch_it_is_given(tmp_path):
    """The real worker (`python -m flashlet.kernels.cute_precompile`), on this machine whether
    it has a GPU or not: three kinds of plan exported as object files under their keys, each
    launcher named for its key, each cubin for sm_90 (what the worker was told, where a DSL on a
    host without a GPU would default to sm_100)."""
    rope = RopeShape(64, 14, 2, 4096, 1024)
    plans = [plan_gemv(1152, 896, "bias_rope_kv", norm=True, rope=rope, pdl=True, num_sms=132),
             plan_gemv(896, 4864, "residual", pdl=True, num_sms=132, rows=4, mma=False),
             plan_gemv(4096, 256, "argmax", norm=True, num_sms=132)]
    jobs, job = exported_by_workers(plans, tmp_path, "plan", workers=2)
    assert all(proc.returncode == 0 for proc in job.worker_of.values())
    for _, key in jobs:
        obj = (tmp_path / f"{key}.o").read_bytes()
        assert f"flashlet_gemv_{key}_cuda_init".encode() in obj and cubin_sm(obj) == 90


def test_a_workers_modules_import_and_plan_without_torch(tmp_path):
    """What a worker imports (cute_precompile, cute_gemv, cute_disk_cache, tuning) with torch
    blocked as the worker blocks it: no module-level torch use creeps in (it would cost every
    worker torch's import, or fail it); a pickled plan loads and a stand-in GEMV is made."""
    rope = RopeShape(64, 14, 2, 4096, 1024)
    plan = plan_gemv(1152, 896, "bias_rope_kv", norm=True, rope=rope, pdl=True, num_sms=132, rows=4)
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    script = textwrap.dedent("""
        import pickle, sys
        sys.modules["torch"] = None
        from flashlet.kernels import cute_precompile
        from flashlet.kernels.cute_gemv import CuteGemv, _buffer_sizes
        plan = pickle.load(open(sys.argv[1], "rb"))
        gemv = CuteGemv.stand_in(plan)
        assert gemv.plan == plan and gemv.device.type == "cpu" and _buffer_sizes(plan)[0] >= 1
        assert sys.modules["torch"] is None
    """)
    repo = str(cute_precompile.Path(cute_precompile.__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "plan.pkl")], check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])))


TRACE_WITH_TORCH = textwrap.dedent("""
    import os, pickle, sys
    import torch  # loaded, as in the engine's process
    from flashlet.kernels import cute_disk_cache
    from flashlet.kernels.cute_gemv import CuteGemv
    jobs = pickle.load(open(sys.argv[1], "rb"))
    os.environ[cute_disk_cache.ENV] = sys.argv[2]
    for plan, key in jobs:
        assert cute_disk_cache.store(key, CuteGemv.stand_in(plan)._compile_now(None))
    assert "torch" in sys.modules
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_CUTE, reason=f"needs the CuTe DSL: {NO_CUTE_REASON[:120]}")
def test_a_worker_without_torch_exports_what_a_process_with_torch_does(tmp_path):
    """The worker keeps torch out of its process (half its start); its object files for a rope,
    a tensor-core and an fp8 plan are byte for byte those traced where torch is loaded."""
    rope = RopeShape(64, 14, 2, 4096, 1024)
    plans = [plan_gemv(1152, 896, "bias_rope_kv", norm=True, rope=rope, pdl=True, num_sms=132),
             plan_gemv(896, 4864, "residual", pdl=True, num_sms=132, rows=4, mma=True),
             plan_gemv(896, 896, "residual", pdl=True, num_sms=132, fp8=True)]
    (tmp_path / "worker").mkdir(), (tmp_path / "torch").mkdir()
    jobs, _ = exported_by_workers(plans, tmp_path / "worker", "plan")
    (tmp_path / "jobs.pkl").write_bytes(pickle.dumps(jobs))
    repo = str(cute_precompile.Path(cute_precompile.__file__).resolve().parents[2])
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", TRACE_WITH_TORCH, str(tmp_path / "jobs.pkl"), str(tmp_path / "torch")],
                   env=env, check=True, timeout=280)
    for _, key in jobs:
        assert (tmp_path / "worker" / f"{key}.o").read_bytes() == (tmp_path / "torch" / f"{key}.o").read_bytes()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or not HAVE_CUTE,
                    reason="needs CUDA and the CuTe DSL: the DSL reads the GPU while tracing a register cap")
def test_a_worker_exports_register_capped_plans_as_the_engine_traces_them(tmp_path, monkeypatch):
    """A register cap (min_ctas_per_sm > 1) makes the DSL read the GPU's shared memory per SM
    while it traces. A torch-free worker that never initialised the CUDA driver failed those
    plans (CUDA_ERROR_NOT_INITIALIZED, session 54 on an H100: TUNED_PLANS' regcap entries, which
    the engine then compiled itself). The worker's files are byte for byte this process's
    traces, where torch has initialised CUDA as the engine's has."""
    rope = RopeShape(64, 14, 2, 4096, 1024)
    plans = [plan_gemv(1152, 896, "bias_rope_kv", norm=True, rope=rope, pdl=True, num_sms=132,
                       rows=2, mma=True, min_ctas_per_sm=2),
             plan_gemv(4096, 1024, "none", norm=True, pdl=True, num_sms=132, rows=16, mma=True,
                       min_ctas_per_sm=2)]
    assert all(p.min_ctas == 2 for p in plans)
    (tmp_path / "worker").mkdir(), (tmp_path / "engine").mkdir()
    jobs, job = exported_by_workers(plans, tmp_path / "worker", "regcap")
    assert all(proc.returncode == 0 for proc in job.worker_of.values())
    torch.zeros(1, device="cuda")  # CUDA initialised here, as in the engine
    monkeypatch.setenv(cute_disk_cache.ENV, str(tmp_path / "engine"))
    for plan, key in jobs:
        assert cute_disk_cache.store(key, CuteGemv.stand_in(plan)._compile_now(None))
    for _, key in jobs:
        assert (tmp_path / "worker" / f"{key}.o").read_bytes() == (tmp_path / "engine" / f"{key}.o").read_bytes()


def test_init_driver_calls_cuinit_once_and_says_whether_it_answered(monkeypatch):
    """The worker's driver set-up: cuInit(0) through cuda-python, True only on CUDA_SUCCESS;
    no cuda-python (a CPU install) or an error code: False, never an exception."""
    calls, result = [], {"code": 0}
    driver = SimpleNamespace(CUresult=SimpleNamespace(CUDA_SUCCESS=0),
                             cuInit=lambda flags: calls.append(flags) or (result["code"],))
    bindings = SimpleNamespace(driver=driver)
    monkeypatch.setitem(sys.modules, "cuda", SimpleNamespace(bindings=bindings, __path__=[]))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
    assert cute_precompile.init_driver() is True and calls == [0]
    result["code"] = 100  # CUDA_ERROR_NO_DEVICE
    assert cute_precompile.init_driver() is False
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails
    assert cute_precompile.init_driver() is False


def test_a_worker_stops_when_the_engine_is_gone_and_counts_its_failures(monkeypatch, tmp_path):
    """compile_into: each plan traced and stored under its key in its folder; a trace that
    raises is counted; once the parent process has changed (the engine died: the worker was
    reparented) the rest are left."""
    stored, parents = [], iter([100, 100, 100, 100, 1])  # its start, then before each plan
    monkeypatch.setattr(cute_precompile.os, "getppid", lambda: next(parents))

    def stand_in(plan):
        if plan == "bad":
            return SimpleNamespace(_compile_now=lambda rope_kv: 1 / 0)
        return SimpleNamespace(_compile_now=lambda rope_kv: f"compiled {plan}")

    monkeypatch.setattr(CuteGemv, "stand_in", staticmethod(stand_in))
    monkeypatch.setattr(cute_disk_cache, "store", lambda key, compiled: stored.append(
        (key, compiled, os.environ[cute_disk_cache.ENV])) or True)
    monkeypatch.setenv(cute_disk_cache.ENV, "unset")
    jobs = [("a", "ka", str(tmp_path)), ("bad", "kb", str(tmp_path)), ("c", "kc", str(tmp_path)),
            ("d", "kd", str(tmp_path))]
    assert cute_precompile.compile_into(jobs) == 1
    assert stored == [("ka", "compiled a", str(tmp_path)), ("kc", "compiled c", str(tmp_path))]


def test_a_failed_plans_warning_is_one_line_naming_the_plan(monkeypatch, tmp_path, caplog):
    """The DSL's errors run to dozens of coloured lines (the error, the GPU, suggestions); a
    worker's warning keeps the first line with text, names the plan, and says who compiles it."""
    plan = plan_gemv(896, 896, "residual", pdl=True, num_sms=132, rows=2, min_ctas_per_sm=3)
    dsl_message = ("\n\x1b[91m\x1b[1merror:\x1b[0m CUDA_ERROR_NOT_INITIALIZED (error code: 3) \n"
                   "\x1b[91m\u274c CUDA context not initialized.\x1b[0m\n\n  suggestion: 1. Check CUDA driver installation\n")

    def stand_in(p):
        def fail(rope_kv):
            raise RuntimeError(dsl_message)
        return SimpleNamespace(_compile_now=fail)

    monkeypatch.setattr(CuteGemv, "stand_in", staticmethod(stand_in))
    monkeypatch.setattr(cute_precompile.os, "getppid", lambda: 7)
    with caplog.at_level("WARNING", logger=cute_precompile.log.name):
        assert cute_precompile.compile_into([(plan, "k", str(tmp_path))]) == 1
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert record.getMessage() == ("precompiling the CuTe GEMV 896 x 896 residual (" + plan.describe() + ") failed "
                                   "(RuntimeError: error: CUDA_ERROR_NOT_INITIALIZED (error code: 3)); "
                                   "the engine compiles it")
    assert cute_precompile.brief(ValueError("")) == ""


def test_jobs_pickle_with_their_plans():
    rope = RopeShape(64, 14, 2, 4096, 1024)
    plan = plan_gemv(1152, 896, "bias_rope_kv", norm=True, rope=rope, num_sms=132)
    assert pickle.loads(pickle.dumps([(plan, "k", "/f")])) == [(plan, "k", "/f")]


ROPE = RopeShape(64, 14, 2, 4096, 1024)
GPU_CASES = {  # the fused path's kinds of GEMV: every epilogue, M rows, the tensor-core form, fp8
    "qkv-rope": (1152, 896, "bias_rope_kv", dict(norm=True, pdl=True, rope=ROPE)),
    "qkv-rope-4-rows": (1152, 896, "bias_rope_kv", dict(norm=True, pdl=True, rope=ROPE, rows=4)),
    "o": (896, 896, "residual", dict(pdl=True)),
    "gate-up": (9728, 896, "silu_mul", dict(norm=True, pdl=True)),
    "down-8-rows": (896, 4864, "residual", dict(pdl=True, rows=8)),
    "lm-head-16-rows": (151936, 896, "none", dict(norm=True, pdl=True, rows=16)),
    "argmax": (151936, 896, "argmax", dict(norm=True, pdl=True)),
    "argmax-4-rows": (151936, 896, "argmax", dict(norm=True, pdl=True, rows=4)),
    "o-fp8": (896, 896, "residual", dict(pdl=True, fp8=True)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAVE_CUTE,
                    reason="needs CUDA and the CuTe DSL: both launchers run on the same inputs")
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_a_launcher_traced_with_stand_ins_computes_what_the_usual_one_does(case):
    """What a worker compiles (traced with stand-ins on the host, `CuteGemv.stand_in(plan)`)
    against what the engine compiles (traced with the GPU's own tensors): the same outputs bit
    for bit, and for the rope epilogues the same pool writes, on the same inputs."""
    n, k, epilogue, kwargs = GPU_CASES[case]
    gemv = CuteGemv(n, k, epilogue, device="cuda", **kwargs)
    p = gemv.plan
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    x = randn(p.rows, k)
    w = randn(p.n_rows, k, scale=0.05)
    scale = None
    if p.fp8:
        scale = torch.rand(p.n_rows, device="cuda", generator=gen) * 0.01 + 0.001
        w = (w.float() / scale[:, None]).to(p.weight_dtype)
    extra = randn(gemv._extra_numel) if epilogue in ("bias", "residual", "bias_rope_kv") else None
    norm_weight = randn(k) if p.norm else None
    rope_kv = None
    if p.rope is not None:
        r = p.rope
        pool = (r.cache_slots, r.num_kv_heads, r.head_dim)
        rope_kv = RopeKV(torch.randint(0, r.table_rows, (p.rows,), device="cuda", generator=gen),
                         torch.randn(r.table_rows, r.head_dim, device="cuda", generator=gen),
                         torch.zeros(pool, dtype=torch.bfloat16, device="cuda"),
                         torch.zeros(pool, dtype=torch.bfloat16, device="cuda"),
                         torch.arange(p.rows, device="cuda") * 3 + 1)
    results = []
    for launcher in (gemv._compile_now(rope_kv), CuteGemv.stand_in(p)._compile_now(None)):
        out = gemv.out_like()
        step = None if rope_kv is None else RopeKV(rope_kv.positions, rope_kv.cos_sin_cache,
                                                   rope_kv.k_cache.clone(), rope_kv.v_cache.clone(),
                                                   rope_kv.slot_mapping)
        launcher(*gemv._args(x, w, extra, out, norm_weight, step, scale), gemv._stream())
        torch.cuda.synchronize()
        results.append([out] + ([] if step is None else [step.k_cache, step.v_cache]))
    usual, stand_in = results
    assert all(torch.equal(a, b) for a, b in zip(usual, stand_in)), case
    assert usual[0].float().abs().sum() > 0  # the kernel wrote something
