"""The CuTe GEMVs' launchers kept on disk (flashlet.kernels.cute_disk_cache): the folder, the
key, the atomic store and the load that falls back to compiling (on the CPU, with stand-ins for
the DSL's export and loader); on a GPU, a launcher loaded in a new process against the one
compiled in the first, bit for bit, and a damaged file compiled again."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from flashlet.kernels import cute_disk_cache, cute_gemv
from flashlet.kernels.cute_gemv import CuteGemv, RopeShape, plan_gemv

HAVE_CUTE, NO_CUTE_REASON = cute_gemv.cute_available()


def test_the_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(cute_disk_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cute_disk_cache.cache_dir() == tmp_path / "xdg" / "flashlet" / "cute"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cute_disk_cache.cache_dir() == tmp_path / "home" / ".cache" / "flashlet" / "cute"
    monkeypatch.setenv(cute_disk_cache.ENV, str(tmp_path / "mine"))
    assert cute_disk_cache.cache_dir() == tmp_path / "mine"
    for off in ("off", "OFF", " off "):
        monkeypatch.setenv(cute_disk_cache.ENV, off)
        assert cute_disk_cache.cache_dir() is None


def test_the_key_changes_with_everything_the_kernel_is_compiled_from():
    rope = RopeShape(64, 14, 2, 4096, 1024)
    plan = plan_gemv(1152, 896, "bias_rope_kv", norm=True, rope=rope, num_sms=132)
    key = cute_disk_cache.kernel_key(plan, "sm_90 x132", "4.8.1")
    assert key == cute_disk_cache.kernel_key(plan_gemv(1152, 896, "bias_rope_kv", norm=True, rope=rope,
                                                       num_sms=132), "sm_90 x132", "4.8.1")
    others = {
        cute_disk_cache.kernel_key(plan, "sm_90 x114", "4.8.1"),  # another GPU
        cute_disk_cache.kernel_key(plan, "sm_90 x132", "4.6.2"),  # another DSL
        cute_disk_cache.kernel_key(plan_gemv(1152, 896, "bias_rope_kv", norm=True, num_sms=132,
                                             rope=RopeShape(64, 14, 2, 4096, 2048)), "sm_90 x132", "4.8.1"),  # pool size
        cute_disk_cache.kernel_key(plan_gemv(1152, 896, "bias_rope_kv", norm=True, rope=rope, num_sms=132,
                                             pdl=True), "sm_90 x132", "4.8.1"),  # a knob
        cute_disk_cache.kernel_key(plan_gemv(1152, 896, "bias_rope_kv", norm=True, rope=rope, num_sms=132,
                                             rows=2), "sm_90 x132", "4.8.1"),  # rows
    }
    assert key not in others and len(others) == 5


def test_the_key_includes_the_dsls_settings_from_the_environment(monkeypatch):
    plan = plan_gemv(896, 896, "residual", num_sms=132)
    for name in [k for k in os.environ if k.startswith("CUTE_DSL_")]:
        monkeypatch.delenv(name)
    key = cute_disk_cache.kernel_key(plan, "sm_90 x132", "4.8.1")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90")
    assert cute_disk_cache.kernel_key(plan, "sm_90 x132", "4.8.1") != key
    monkeypatch.delenv("CUTE_DSL_ARCH")
    monkeypatch.setenv("FLASHLET_UNRELATED", "1")  # only the DSL's own variables
    assert cute_disk_cache.kernel_key(plan, "sm_90 x132", "4.8.1") == key


def test_the_key_includes_the_kernel_source(monkeypatch, tmp_path):
    plan = plan_gemv(896, 896, "residual", num_sms=132)
    key = cute_disk_cache.kernel_key(plan, "sm_90 x132", "4.8.1")
    edited = tmp_path / "cute_gemv.py"
    edited.write_bytes(cute_disk_cache._SOURCE.read_bytes() + b"\n# an edit\n")
    monkeypatch.setattr(cute_disk_cache, "_SOURCE", edited)
    cute_disk_cache._source_digest.cache_clear()
    try:
        assert cute_disk_cache.kernel_key(plan, "sm_90 x132", "4.8.1") != key
    finally:
        cute_disk_cache._source_digest.cache_clear()


class FakeCompiled:
    """What cute.compile returns, as far as the store uses it: export_to_c writes a header and
    an object file named file_name into file_path."""

    def __init__(self, payload: bytes, fail: bool = False):
        self.payload, self.fail, self.exports = payload, fail, []

    def export_to_c(self, file_path, file_name, function_prefix=""):
        self.exports.append(function_prefix)
        if self.fail:
            raise RuntimeError("no engine to dump")
        with open(os.path.join(file_path, file_name + ".h"), "w") as f:
            f.write("/* header */")
        with open(os.path.join(file_path, file_name + ".o"), "wb") as f:
            f.write(self.payload)


def fake_loader(path):
    """The DSL's load_module: a module whose attribute named by the export's prefix is the
    launcher; a file that is not ours fails as a foreign object file would."""
    data = open(path, "rb").read()
    if not data.startswith(b"OBJ:"):
        raise RuntimeError("not an object file")
    prefix = data[4:].decode()
    return types.SimpleNamespace(**{prefix: ("launcher", prefix)})


def test_a_stored_launcher_loads_back_and_leaves_only_its_object_file(monkeypatch, tmp_path):
    monkeypatch.setenv(cute_disk_cache.ENV, str(tmp_path / "cache"))
    key = "ab" * 20
    prefix = cute_disk_cache._prefix(key)
    compiled = FakeCompiled(b"OBJ:" + prefix.encode())
    assert cute_disk_cache.load(key, loader=fake_loader) is None  # nothing yet (and no folder)
    assert cute_disk_cache.store(key, compiled)
    assert compiled.exports == [prefix] and prefix.isidentifier()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f"{key}.o"]  # no header, no temp
    assert cute_disk_cache.load(key, loader=fake_loader) == ("launcher", prefix)
    assert cute_disk_cache.load("cd" * 20, loader=fake_loader) is None  # another key: its own file


def test_a_file_that_does_not_load_is_removed_and_compiled_again(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(cute_disk_cache.ENV, str(tmp_path))
    key = "12" * 20
    (tmp_path / f"{key}.o").write_bytes(b"\x7fELF truncated")
    with caplog.at_level(logging.WARNING, logger=cute_disk_cache.__name__):
        assert cute_disk_cache.load(key, loader=fake_loader) is None
    assert "did not load" in caplog.text and "compiling it again" in caplog.text
    assert not (tmp_path / f"{key}.o").exists()
    # A file of another key's launcher (renamed by hand): the prefix is missing, same outcome.
    (tmp_path / f"{key}.o").write_bytes(b"OBJ:" + cute_disk_cache._prefix("34" * 20).encode())
    assert cute_disk_cache.load(key, loader=fake_loader) is None
    assert not (tmp_path / f"{key}.o").exists()


def test_a_store_that_fails_costs_only_the_next_start(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(cute_disk_cache.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cute_disk_cache, "_WARNED", [])
    with caplog.at_level(logging.WARNING, logger=cute_disk_cache.__name__):
        assert not cute_disk_cache.store("56" * 20, FakeCompiled(b"", fail=True))
        assert not cute_disk_cache.store("57" * 20, FakeCompiled(b"", fail=True))
    assert "could not keep" in caplog.text and f"{cute_disk_cache.ENV}=off" in caplog.text
    assert caplog.text.count("could not keep") == 1  # once a process, not once a GEMV
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary folders are gone too
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(cute_disk_cache.ENV, str(blocker / "cache"))
    assert not cute_disk_cache.store("56" * 20, FakeCompiled(b"OBJ:x"))


def test_a_store_removes_exports_left_by_killed_processes(monkeypatch, tmp_path):
    monkeypatch.setenv(cute_disk_cache.ENV, str(tmp_path))
    old, live = tmp_path / ".export-old", tmp_path / ".export-live"
    for d in (old, live):
        d.mkdir()
        (d / "half.o").write_bytes(b"OBJ")
    hours_ago = time.time() - 2 * cute_disk_cache.STALE_EXPORT_S
    os.utime(old, (hours_ago, hours_ago))
    key = "9a" * 20
    assert cute_disk_cache.store(key, FakeCompiled(b"OBJ:" + cute_disk_cache._prefix(key).encode()))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export-live", f"{key}.o"]


def test_with_the_cache_off_nothing_is_read_or_written(monkeypatch, tmp_path):
    monkeypatch.setenv(cute_disk_cache.ENV, "off")
    compiled = FakeCompiled(b"OBJ:x")
    assert not cute_disk_cache.store("78" * 20, compiled) and compiled.exports == []
    assert cute_disk_cache.load("78" * 20, loader=fake_loader) is None


def test_gemv_plans_off_the_gpu_have_no_file():
    """Tracing on a CPU machine (the PTX tests) compiles for a stand-in GPU: never stored."""
    assert cute_gemv._disk_key(plan_gemv(896, 896, "none", num_sms=132), torch.device("cpu")) is None


class FakeLauncher:
    def __call__(self, *args):
        raise AssertionError("not run here")


def test_a_gemv_on_the_gpu_loads_its_file_before_compiling(monkeypatch):
    """CuteGemv.compile's wiring, on the CPU: a file found is the launcher (nothing compiled,
    from_disk); none found compiles and stores under the plan's key; the process's own cache
    then serves a second object of the plan without either."""
    gemv = CuteGemv.__new__(CuteGemv)  # the plan and device only: no tensors, no DSL
    gemv.plan, gemv.device = plan_gemv(896, 896, "residual", num_sms=132), torch.device("cuda")
    gemv._compiled, gemv.compile_seconds, gemv.from_disk = None, None, False
    calls = []
    monkeypatch.setattr(cute_gemv, "_COMPILED", {})
    monkeypatch.setattr(cute_gemv, "_disk_key", lambda plan, device: "k" * 40)
    monkeypatch.setattr(CuteGemv, "_compile_now", lambda self, rope_kv: calls.append("compile") or "compiled")
    monkeypatch.setattr(cute_disk_cache, "store", lambda key, compiled: calls.append(("store", key, compiled)))
    loaded = FakeLauncher()
    monkeypatch.setattr(cute_disk_cache, "load", lambda key: loaded)
    assert gemv.compile() >= 0 and gemv._compiled is loaded and gemv.from_disk and calls == []
    gemv._compiled = None
    monkeypatch.setattr(cute_gemv, "_COMPILED", {})
    monkeypatch.setattr(cute_disk_cache, "load", lambda key: None)
    gemv.compile()
    assert gemv._compiled == "compiled" and not gemv.from_disk
    assert calls == ["compile", ("store", "k" * 40, "compiled")]
    gemv._compiled = None  # another object of the same plan: the process's cache, 0 s
    assert gemv.compile() == 0.0 and gemv._compiled == "compiled" and len(calls) == 2


# One GEMV of each kind a step runs (bias + norm, the rope epilogue with its pool write, the
# argmax): compiled or loaded, run on fixed inputs, the outputs saved for the parent to compare.
_CHILD = textwrap.dedent("""
    import json, sys, torch
    from flashlet.kernels.cute_gemv import CuteGemv, RopeKV, RopeShape
    torch.manual_seed(0)
    dev = "cuda"
    rope = RopeShape(64, 14, 2, 256, 512)
    cases = [(1152, 896, "bias", dict(norm=True)), (1152, 896, "bias_rope_kv", dict(norm=True, rope=rope)),
             (4096, 896, "argmax", dict(norm=True))]
    report, outs = [], {}
    for n, k, epilogue, kw in cases:
        gemv = CuteGemv(n, k, epilogue, **kw)
        x = (torch.randn(1, k, device=dev) * 3).to(torch.bfloat16)
        w = (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)
        g = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
        extra = torch.randn(n, device=dev).to(torch.bfloat16) if "bias" in epilogue else None
        step = None
        if epilogue == "bias_rope_kv":
            pool = (rope.cache_slots // 16, 16, rope.num_kv_heads, rope.head_dim)
            theta = torch.arange(rope.table_rows, device=dev)[:, None] * 10000.0 ** (-torch.arange(32, device=dev) / 32)
            step = RopeKV(torch.tensor([77], device=dev), torch.cat((theta.cos(), theta.sin()), -1).float(),
                          torch.zeros(pool, dtype=torch.bfloat16, device=dev),
                          torch.zeros(pool, dtype=torch.bfloat16, device=dev), torch.tensor([130], device=dev))
        out = gemv(x, w, extra, norm_weight=g, rope_kv=step)
        torch.cuda.synchronize()
        outs[epilogue] = out.cpu()
        if step is not None:
            outs["k_pool"], outs["v_pool"] = step.k_cache.cpu(), step.v_cache.cpu()
        report.append(gemv.from_disk)
    torch.save(outs, sys.argv[1])
    print(json.dumps(report))
""")


def _child(tmp_path, name, cache):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, cute_disk_cache.ENV: str(cache),
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / name)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(tmp_path / name), done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAVE_CUTE,
                    reason="needs CUDA and the CuTe DSL: the launchers are compiled and loaded for real")
@pytest.mark.skipif(HAVE_CUTE and not cute_disk_cache.loader_available(),
                    reason="this CuTe DSL loads object files through TVM-FFI only: the cache is off")
def test_a_launcher_loaded_in_a_new_process_is_the_compiled_one(tmp_path):
    cache = tmp_path / "cache"
    loaded, first, _ = _child(tmp_path, "first.pt", cache)
    assert loaded == [False, False, False]
    files = sorted(cache.glob("*.o"))
    assert len(files) == 3
    loaded, second, _ = _child(tmp_path, "second.pt", cache)
    assert loaded == [True, True, True]
    assert first.keys() == second.keys()
    for name in first:  # bit for bit: the same code on the same inputs
        assert torch.equal(first[name], second[name]), name
    assert first["k_pool"].abs().sum() > 0  # the rope epilogue wrote its slot
    files[0].write_bytes(files[0].read_bytes()[:100])  # a damaged file: compiled again, replaced
    loaded, third, log = _child(tmp_path, "third.pt", cache)
    assert loaded.count(False) == 1 and "did not load" in log
    assert files[0].stat().st_size > 100
    for name in first:
        assert torch.equal(first[name], third[name]), name
