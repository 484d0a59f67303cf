"""The CuTe GEMVs' compiled launchers, kept on disk from one process to the next.

`cute.compile` caches nothing: the DSL turns its own caches off for a compile-only call. So every
process traced and compiled each of the fused decode path's GEMVs again, 17-18 s of a 27 s warm
engine start on an H100 (FUSED_NOTES.md, "Session 50"). The DSL can write a compiled launcher to
an object file (`export_to_c`'s .o, the host launcher with its cubin inside) and load it back
(`cutlass.cute.runtime.load_module(path, enable_tvm_ffi=False)`), which this module uses: a GEMV
compiled once on a machine loads in a fraction of a second in every later process (the 0.5B's
30: 0.06 s, and a warm start 5.9 s against 16.0 compiling them; H100, 5a13ebc).

A file's name is a hash of all that its kernel was compiled from (`kernel_key`): the plan
(shapes, epilogue, knobs), the GPU's compute capability and SM count, the DSL's version, the
kernel's source (cute_gemv.py) and the DSL's settings in the environment (CUTE_DSL_*). Nothing
else that flashlet varies changes the code, so a stale file is never read.

FLASHLET_CUTE_CACHE names the folder (default `$XDG_CACHE_HOME/flashlet/cute`, else
`~/.cache/flashlet/cute`); `off` turns the cache off. A DSL release without that loader (4.3.5
loads object files through TVM-FFI only) compiles in every process, as before. A file that fails to
load is compiled again and replaced; a folder that cannot be written only costs the next start.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "FLASHLET_CUTE_CACHE"
_SOURCE = Path(__file__).with_name("cute_gemv.py")  # the kernels: their code is part of every key
_MODULES: list = []  # the loaded object files' modules: their engines hold the launchers' code
_WARNED: list = []  # a store failed in this process (warned once; later ones are debug lines)


def cache_dir() -> Path | None:
    """The folder of compiled launchers, or None when FLASHLET_CUTE_CACHE is `off`."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flashlet" / "cute"


@functools.cache
def _source_digest() -> str:
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()


def kernel_key(plan, arch: str, dsl_version: str) -> str:
    """The file name's hash: the plan (a frozen dataclass: its repr lists every field), the GPU
    (arch: compute capability and SM count), the DSL's version, the kernel source, and the DSL's
    own settings from the environment (CUTE_DSL_ARCH, an opt level...: any CUTE_DSL_* variable)."""
    dsl_env = sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_"))
    text = "\n".join((repr(plan), arch, dsl_version, _source_digest(), repr(dsl_env)))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@functools.cache
def loader_available() -> bool:
    """Whether this DSL loads an exported object file without TVM-FFI (4.8.1 does, 4.3.5 not)."""
    import importlib.util
    try:
        return importlib.util.find_spec("cutlass.base_dsl.export.external_binary_module") is not None
    except ModuleNotFoundError:
        return False


def usable_dir() -> Path | None:
    """The folder when this process reads and writes it: the cache on and a DSL that loads."""
    folder = cache_dir()
    return folder if folder is not None and loader_available() else None


def file_of(folder: Path, key: str) -> Path:
    """Where the launcher stored under `key` lies in `folder` (the export's own name for it)."""
    return folder / f"{key}.o"


def _prefix(key: str) -> str:
    return f"flashlet_gemv_{key}"  # the object file's symbols: a C identifier


def load(key: str, loader=None):
    """The launcher stored under `key`, or None (no folder, no file, or a file that does not
    load: that one is removed, to be written again)."""
    folder = cache_dir()
    if folder is None:
        return None
    path = file_of(folder, key)
    if not path.is_file():
        return None
    try:
        if loader is None:
            from cutlass.cute.runtime import load_module
            loader = functools.partial(load_module, enable_tvm_ffi=False)
        module = loader(str(path))
        launcher = getattr(module, _prefix(key))
    except Exception as e:  # a truncated or foreign file: compile again
        log.warning("the compiled CuTe GEMV %s did not load (%s: %s); compiling it again",
                    path, type(e).__name__, e)
        path.unlink(missing_ok=True)
        return None
    _MODULES.append(module)
    return launcher


STALE_EXPORT_S = 3600  # an export folder this old belongs to a process that died mid-export


def _remove_stale_exports(folder: Path) -> None:
    """Export folders left by processes killed mid-export (a live export takes under a second)."""
    for stale in folder.glob(".export-*"):
        try:
            if time.time() - stale.stat().st_mtime > STALE_EXPORT_S:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:  # removed by another process meanwhile
            pass


def store(key: str, compiled) -> bool:
    """Write `compiled` (what `cute.compile` returned) under `key`: exported into a temporary
    folder beside the file, then renamed into place, so that a reader never sees half a file.
    Returns whether it was written; a failure is logged, never raised (the kernel is compiled)."""
    folder = cache_dir()
    if folder is None:
        return False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale_exports(folder)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as tmp:
            compiled.export_to_c(tmp, key, function_prefix=_prefix(key))
            os.replace(file_of(Path(tmp), key), file_of(folder, key))
    except Exception as e:  # said once a process (a full disk would fail every GEMV's store)
        log.log(logging.DEBUG if _WARNED else logging.WARNING,
                "could not keep the compiled CuTe GEMV in %s (%s: %s); the next process compiles "
                "it again (%s=off stops trying)", folder, type(e).__name__, e, ENV)
        _WARNED.append(True)
        return False
    return True
