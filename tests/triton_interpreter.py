"""Triton's CPU interpreter, without its redundant re-patching on every device-function call.

Triton 3.7.1's interpreter points triton.language's builtins at numpy implementations when a
kernel launch starts, and points them back when it ends. It also does so again on every call
of a @triton.jit helper inside the kernel (`InterpretedFunction.__call__`), although the
launch has already done it: that walks every member of triton.language with `inspect` each
time, and a kernel calling helpers in a loop (the sampler's k-th largest search) spends about a
third of its time there. `skip_redundant_patching()` makes a helper call patch only when
something it needs is not patched yet: the same language objects, one walk per launch. It also
keeps the interpreter's numpy dtype per Triton dtype (`_cache_np_dtypes`) and skips building
the integer overflow checks that its `device_assert` drops unasserted
(`_skip_unasserted_overflow_checks`): with the three, interpreted kernels take about half the time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os

import numpy as np

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
    _cache_np_dtypes(interpreter)
    _skip_unasserted_overflow_checks(interpreter)
    return True


def _skip_unasserted_overflow_checks(interpreter) -> None:
    """The interpreter's integer +, - and * first build their overflow check (both sides cast to
    int64, the op again, two compares and an and: about half of an interpreted kernel's time)
    and hand it to `device_assert`, which drops it unless the interpreter's options have debug
    on, and they never do (InterpreterOptions(): debug=False). Built only where it would be
    asserted: the same kernels, the same checks, the same results."""
    semantic = interpreter.interpreter_semantic
    build_check = semantic.binary_op_sanitize_overflow_impl
    if getattr(build_check, "only_asserted", False):
        return

    def sanitize_overflow(lhs, rhs, binary_op):
        if semantic.builder.options.debug:
            return build_check(lhs, rhs, binary_op)
        return None

    sanitize_overflow.only_asserted = True
    semantic.binary_op_sanitize_overflow_impl = sanitize_overflow


def _cache_np_dtypes(interpreter) -> None:
    """The interpreter's `_get_np_dtype` (Triton PATCHED_VERSION), which builds its dict of 18
    numpy dtypes on every call (several times an interpreted op), with each answer kept: the
    same answers, by the same lookup, once per element type."""
    import triton.language as tl

    original = interpreter._get_np_dtype
    if getattr(original, "cached", False):
        return
    pointer = np.dtype(np.uint64)
    known: dict = {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        try:
            return known[tt_dtype]
        except KeyError:
            known[tt_dtype] = got = original(tt_dtype)
            return got

    get_np_dtype.cached, get_np_dtype.original = True, original
    interpreter._get_np_dtype = get_np_dtype


class AccessLog:
    """What every program of each interpreted launch loads and stores inside chosen tensors
    (`record_accesses`). The interpreter runs a launch's programs one after another, so a
    program that reads what another program of the same launch writes reads it in grid order
    here, and in any order on a GPU, where they run at once, unless the two are ordered through
    a counter: the writer's release (after a barrier) on it, the reader's acquire on it later
    (`sync`, the kernel's own protocol, e.g. "the last program to arrive merges"), directly or
    through other programs. `hazards()` names the pairs left unordered."""

    def __init__(self, tensors: dict, sync=None, args: tuple = ()):
        self.tensors, self.sync, self.args = dict(tensors), sync, tuple(args)
        self.ranges: dict[str, tuple] = {}  # the launch being recorded's watched storages
        self.launches: list[list[tuple]] = []  # each launch's (program, op, name, element offsets, sem)
        self.launch_ranges: list[dict] = []  # each launch's watched storages

    def _begin(self, named: dict) -> None:
        """A launch starts; named: its arguments by name (`args` and a named `sync` come from it).
        Each watched tensor's whole storage, as (first byte, end byte, element size), under the
        first name that watches it."""
        watched = {**self.tensors, **{a: named[a] for a in self.args if hasattr(named.get(a), "data_ptr")}}
        sync = named.get(self.sync) if isinstance(self.sync, str) else self.sync
        self.ranges = {}
        seen = set()
        for name, t in [*watched.items(), *([("sync", sync)] if sync is not None else [])]:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen and name != "sync":
                continue
            seen.add(storage.data_ptr())
            self.ranges[name] = (storage.data_ptr(), storage.data_ptr() + storage.nbytes(), t.element_size())
        self.launches.append([])
        self.launch_ranges.append(self.ranges)

    def _record(self, builder, op: str, ptrs, mask, sem=None) -> None:
        if op == "barrier":
            self.launches[-1].append((builder.grid_idx, op, None, None, None))
            return
        addrs = np.asarray(ptrs.data).astype(np.uint64).ravel()
        if mask is not None:
            addrs = addrs[np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).ravel()]
        for name, (lo, hi, size) in self.ranges.items():
            inside = addrs[(addrs >= lo) & (addrs < hi)]
            if inside.size:
                kind = "sync" if name == "sync" and op == "atomic" else "store" if op == "atomic" else op
                self.launches[-1].append((builder.grid_idx, kind, name, np.unique((inside - lo) // size), sem))

    def hazards(self, own_reads: bool = True) -> list[str]:
        """Per launch and watched tensor, the pairs of programs that touch one element, one of
        them storing it, with no counter ordering the first before the second (a load of an
        element another program stores, a store of one it loads, two stores); and (own_reads) a
        program's load of an element it stored itself (its other threads may read it before
        the store lands: only a barrier orders them, so the kernel must not use that value)."""
        found = []
        for n, launch in enumerate(self.launches):
            found += self._launch_hazards(n, launch, own_reads)
        return found

    def _launch_hazards(self, n: int, launch: list, own_reads: bool) -> list[str]:
        from triton.runtime.interpreter import _ir

        acquire = (_ir.MEM_SEMANTIC.ACQUIRE, _ir.MEM_SEMANTIC.ACQUIRE_RELEASE)
        release = (_ir.MEM_SEMANTIC.RELEASE, _ir.MEM_SEMANTIC.ACQUIRE_RELEASE)
        ids: dict[tuple, int] = {}  # program -> its index
        names: list[tuple] = []
        clocks: dict[int, dict[int, int]] = {}  # vector clocks: what each program has seen of each
        counters: dict[int, dict[int, int]] = {}  # each sync element's clock (what its releases carried)
        fenced: dict[int, int] = {}  # each program's data accesses since its last barrier
        barrier_at: dict[int, int] = {}  # each program's clock at its last barrier
        data = {name: dict(writer=np.full((hi - lo) // size, -1), wrote=np.zeros((hi - lo) // size, np.int64),
                           reads={}) for name, (lo, hi, size) in self.launch_ranges[n].items() if name != "sync"}
        pairs: dict[tuple, set] = {}  # (what, program, other program, tensor) -> elements

        def join(into: dict, other: dict) -> None:
            for k, v in other.items():
                into[k] = max(into.get(k, 0), v)

        for program, op, name, elems, sem in launch:
            if program not in ids:
                ids[program] = len(names)
                names.append(program)
            p = ids[program]
            vc = clocks.setdefault(p, {p: 0})
            vc[p] += 1
            if op == "barrier":
                fenced[p], barrier_at[p] = 0, vc[p]
                continue
            if op == "sync":
                for e in elems.tolist():
                    if sem in acquire:
                        join(vc, counters.get(e, {}))
                    if sem in release:
                        if fenced.get(p, 0):
                            pairs.setdefault(("unfenced", p, p, name), set()).add(e)
                        join(counters.setdefault(e, {}), vc)
                continue
            if name == "sync":  # a counter read or written plainly: the protocol's own business
                continue
            fenced[p] = fenced.get(p, 0) + 1
            d = data[name]
            writer, wrote = d["writer"][elems], d["wrote"][elems]
            for q in np.unique(writer[writer >= 0]).tolist():
                seen = vc.get(q, 0) if q != p else barrier_at.get(p, 0)  # its own: ordered by a barrier
                hit = elems[(writer == q) & (wrote > seen)]
                if hit.size and (q != p or (op == "load" and own_reads)):
                    what = "own" if q == p else "loads" if op == "load" else "both store"
                    pairs.setdefault((what, p, q, name), set()).update(hit.tolist())
            if op == "load":
                d["reads"].setdefault(p, np.zeros(len(d["writer"]), np.int64))[elems] = vc[p]
                continue
            for q, read in d["reads"].items():
                if q != p:
                    hit = elems[read[elems] > vc.get(q, 0)]
                    if hit.size:
                        pairs.setdefault(("stores", p, q, name), set()).update(hit.tolist())
            d["writer"][elems], d["wrote"][elems] = p, vc[p]
        texts = {"loads": "program {a} loads {e} that program {b} stores",
                 "stores": "program {a} stores {e} that program {b} loads",
                 "both store": "programs {b} and {a} both store {e}",
                 "own": "program {a} loads {e} after storing them",
                 "unfenced": "program {a} releases counter {e} with no barrier after its last access"}
        found = []
        for (what, a, b, name), elems in sorted(pairs.items(), key=lambda kv: (kv[0][3], kv[0][0], names[kv[0][1]],
                                                                               names[kv[0][2]])):
            found.append(f"launch {n}, {name}: " + texts[what].format(a=names[a], b=names[b], e=sorted(elems)[:4]))
        return found


@contextlib.contextmanager
def record_accesses(sync=None, args: tuple = (), **tensors):
    """Interpreter mode only: an AccessLog of every launch made inside the block, watching the
    given tensors (name=tensor) and, in each launch, its arguments named in `args` (tensors a
    function allocates and passes on); a tensor's whole storage is watched. Loads, masked or
    not, count their active lanes; atomics count as stores, except those on `sync` (the kernel's
    counters: a tensor, or the name of the kernel argument that holds them), which order what
    they carry."""
    from triton.runtime import interpreter

    log = AccessLog(tensors, sync, args)
    builder = interpreter.interpreter_builder
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas", "create_barrier")
    saved = {name: getattr(builder, name) for name in names}
    launch = interpreter.GridExecutor.__call__

    def load(ptrs, mask, *args):
        log._record(builder, "load", ptrs, mask)
        return saved["create_masked_load"](ptrs, mask, *args)

    def store(ptrs, value, mask, *args):
        log._record(builder, "store", ptrs, mask)
        return saved["create_masked_store"](ptrs, value, mask, *args)

    def rmw(op, ptr, val, mask, sem, scope):
        log._record(builder, "atomic", ptr, mask, sem)
        return saved["create_atomic_rmw"](op, ptr, val, mask, sem, scope)

    def cas(ptr, cmp, val, sem, scope):
        log._record(builder, "atomic", ptr, None, sem)
        return saved["create_atomic_cas"](ptr, cmp, val, sem, scope)

    def barrier():
        log._record(builder, "barrier", None, None)
        return saved["create_barrier"]()

    def launched(self, *args, **kwargs):
        log._begin(inspect.getcallargs(self.fn, *args, **{k: v for k, v in kwargs.items() if k in self.arg_names}))
        return launch(self, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = load, store
    builder.create_atomic_rmw, builder.create_atomic_cas, builder.create_barrier = rmw, cas, barrier
    interpreter.GridExecutor.__call__ = launched
    try:
        yield log
    finally:
        for name in names:  # the class's methods again
            del builder.__dict__[name]
        interpreter.GridExecutor.__call__ = launch


@contextlib.contextmanager
def interpreted_accesses(sync=None, args: tuple = (), **tensors):
    """`record_accesses` where the kernels run in the interpreter; None where they run on a GPU
    (there the programs do run at once, and the tests' other checks see a race's effects)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield None
        return
    with record_accesses(sync, args, **tensors) as log:
        yield log
