"""Triton's CPU interpreter, without its redundant re-patching on every device-function call.

Triton 3.7.1's interpreter points triton.language's builtins at numpy implementations when a
kernel launch starts, and points them back when it ends. It also does so again on every call
of a @triton.jit helper inside the kernel (`InterpretedFunction.__call__`), although the
launch has already done it: that walks every member of triton.language with `inspect` each
time, and a kernel calling helpers in a loop (the sampler's k-th largest search) spends about a
third of its time there. `skip_redundant_patching()` makes a helper call patch only when
something it needs is not patched yet: the same language objects, one walk per launch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os

PATCHED_VERSION = "3.7.1"  # the interpreter whose device-function call this replaces


@functools.cache
def _langs(fn) -> tuple:
    """The triton.language modules `fn` sees, as the interpreter's own _patch_lang finds them."""
    import triton.language as tl

    return tuple(v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def _patched(fn) -> bool:
    """Whether everything _patch_lang(fn) would patch is patched now (a patched builtin is a
    plain wrapper, no longer marked as a builtin)."""
    import triton.language as tl

    is_builtin = tl.core.is_builtin
    langs = _langs(fn)
    if any(is_builtin(lang.arange) for lang in langs):
        return False
    if tl in langs and is_builtin(tl.math.exp):
        return False
    return not (is_builtin(tl.core.tensor.__add__)
                or is_builtin(tl.core.tensor_descriptor_base.load))


def skip_redundant_patching() -> bool:
    """Install the device-function call that skips re-patching (interpreter mode, Triton
    PATCHED_VERSION only; another version keeps its own). Returns whether it was installed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton

    if triton.__version__ != PATCHED_VERSION:
        return False
    from triton.runtime import interpreter

    def call(self, *args, **kwargs):
        # Triton 3.7.1's InterpretedFunction.__call__, with the patch made only when needed.
        if not _patched(self.fn):
            interpreter._patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.InterpretedFunction.__call__ = call
    return True


class AccessLog:
    """What every program of each interpreted launch loads and stores inside chosen tensors
    (`record_accesses`): the interpreter runs a launch's programs one after another, so a
    program reading what another program of the same launch writes reads it in grid order
    here and in any order on a GPU, where they run at once. `hazards()` names those pairs."""

    def __init__(self, tensors: dict):
        # name -> (first byte, end byte, element size) of each watched tensor's storage
        self.ranges = {name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size())
                       for name, t in tensors.items()}
        self.launches: list[list[tuple]] = []  # each launch's (program, op, name, element offsets)

    def _record(self, builder, op: str, ptrs, mask) -> None:
        import numpy as np

        addrs = np.asarray(ptrs.data).astype(np.uint64).ravel()
        if mask is not None:
            addrs = addrs[np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).ravel()]
        for name, (lo, hi, size) in self.ranges.items():
            inside = addrs[(addrs >= lo) & (addrs < hi)]
            if inside.size:
                self.launches[-1].append((builder.grid_idx, op, name, (inside - lo) // size))

    def hazards(self, own_reads: bool = True) -> list[str]:
        """Per launch and watched tensor: an element one program stores that another program of
        the same launch loads or stores, and (own_reads) an element a program loads after storing
        it itself (its other threads may read it before the store lands: only a barrier orders
        them, so the kernel must not depend on the value it loads)."""
        import numpy as np

        found = []
        for n, launch in enumerate(self.launches):
            for name in self.ranges:
                records = [(i, program, op, elems) for i, (program, op, tname, elems) in enumerate(launch)
                           if tname == name]
                writers: dict[int, list[tuple]] = {}  # element -> [(program, record index)]
                for i, program, op, elems in records:
                    if op == "store":
                        for e in np.unique(elems).tolist():
                            writers.setdefault(e, []).append((program, i))
                if not writers:
                    continue
                pairs: dict[tuple, set] = {}  # (what, reader or first writer, writer) -> elements
                for e, ws in writers.items():
                    for p, _ in ws[1:]:
                        if p != ws[0][0]:
                            pairs.setdefault(("both store", ws[0][0], p), set()).add(e)
                written = np.fromiter(writers, dtype=np.uint64)
                for i, q, op, elems in records:
                    if op != "load":
                        continue
                    for e in np.unique(elems[np.isin(elems, written)]).tolist():
                        for p, j in writers[e]:
                            if p != q:
                                pairs.setdefault(("loads", q, p), set()).add(e)
                            elif j < i and own_reads:
                                pairs.setdefault(("own", q, q), set()).add(e)
                for (what, a, b), elems in sorted(pairs.items()):
                    some = sorted(elems)[:4]
                    found.append(f"launch {n}, {name}: " + (
                        f"programs {a} and {b} both store {some}" if what == "both store" else
                        f"program {a} loads {some} that program {b} stores" if what == "loads" else
                        f"program {a} loads {some} after storing them"))
        return found


@contextlib.contextmanager
def record_accesses(**tensors):
    """Interpreter mode only: an AccessLog of every launch made inside the block, watching the
    given tensors (name=tensor). Loads, masked or not, count their active lanes; atomics count
    as stores (their ordering is the kernel's own protocol, not a data read)."""
    from triton.runtime import interpreter

    log = AccessLog(tensors)
    builder = interpreter.interpreter_builder
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
    saved = {name: getattr(builder, name) for name in names}
    launch = interpreter.GridExecutor.__call__

    def load(ptrs, mask, *args):
        log._record(builder, "load", ptrs, mask)
        return saved["create_masked_load"](ptrs, mask, *args)

    def store(ptrs, value, mask, *args):
        log._record(builder, "store", ptrs, mask)
        return saved["create_masked_store"](ptrs, value, mask, *args)

    def rmw(op, ptr, val, mask, *args):
        log._record(builder, "store", ptr, mask)
        return saved["create_atomic_rmw"](op, ptr, val, mask, *args)

    def cas(ptr, *args):
        log._record(builder, "store", ptr, None)
        return saved["create_atomic_cas"](ptr, *args)

    def launched(self, *args, **kwargs):
        log.launches.append([])
        return launch(self, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = load, store
    builder.create_atomic_rmw, builder.create_atomic_cas = rmw, cas
    interpreter.GridExecutor.__call__ = launched
    try:
        yield log
    finally:
        for name in names:  # the class's methods again
            del builder.__dict__[name]
        interpreter.GridExecutor.__call__ = launch
