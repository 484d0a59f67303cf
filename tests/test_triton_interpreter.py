"""tests/triton_interpreter.py: a @triton.jit helper called inside an interpreted kernel no longer
re-patches triton.language, and the kernel computes what it did (against torch); the language is
back to its own builtins after the launch."""

import pytest
import torch

from tests.triton_interpreter import PATCHED_VERSION, _patched, skip_redundant_patching

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

interpreting = pytest.mark.skipif(
    not (skip_redundant_patching() and triton.__version__ == PATCHED_VERSION),
    reason=f"only Triton {PATCHED_VERSION}'s CPU interpreter is patched")


@triton.jit
def _scaled_square(x, scale):
    return x * x * scale


@triton.jit
def _sum_of_scaled_squares(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        acc += _scaled_square(tl.load(x_ptr + offsets, mask=offsets < n, other=0.0), scale)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@interpreting
def test_helper_calls_reuse_the_launchs_patching_and_compute_the_same(monkeypatch):
    from triton.runtime import interpreter

    patches = []
    real = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patches.append(fn) or real(fn))
    x = torch.randn(40, generator=torch.Generator().manual_seed(0))
    out = torch.empty(2)
    _sum_of_scaled_squares[(2,)](x, out, x.numel(), 0.5, BLOCK=8)  # 5 helper calls a program
    assert out.tolist() == pytest.approx([float((x * x * 0.5).sum())] * 2, rel=1e-5)
    names = [fn.__name__ for fn in patches]
    assert names[0] == "_sum_of_scaled_squares"  # the launch's own patching
    assert "_scaled_square" not in names  # none for the 10 helper calls
    assert tl.core.is_builtin(tl.arange) and not _patched(_sum_of_scaled_squares.fn)  # restored


@triton.jit
def _store_then_load(x_ptr, out_ptr, n, SHIFT: tl.constexpr):
    """Each program stores x[pid], then loads x[(pid + SHIFT) % n] (SHIFT 0: its own)."""
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, pid * 1.0)
    tl.store(out_ptr + pid, tl.load(x_ptr + (pid + SHIFT) % n))


needs_interpreter = pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                                       reason="the access log reads the CPU interpreter's loads and stores")


@needs_interpreter
@pytest.mark.parametrize("shift,expected", [
    (1, ["launch 0, x: program (1, 0, 0) stores [1] that program (0, 0, 0) loads",
         "launch 0, x: program (2, 0, 0) stores [2] that program (1, 0, 0) loads",
         "launch 0, x: program (2, 0, 0) loads [0] that program (0, 0, 0) stores"]),
    (0, ["launch 0, x: program (0, 0, 0) loads [0] after storing them",
         "launch 0, x: program (1, 0, 0) loads [1] after storing them",
         "launch 0, x: program (2, 0, 0) loads [2] after storing them"]),
], ids=["another-programs-store", "its-own-store"])
def test_the_access_log_names_what_a_program_reads_of_a_launchs_stores(shift, expected):
    """Programs that run in turn here and at once on a GPU: a load of an element another program
    of the launch stores is a race, and so is a load of an element the program stored itself
    (its other threads may not see the store); out, written once per element, is not watched."""
    from tests.triton_interpreter import record_accesses

    x, out = torch.zeros(3), torch.zeros(3)
    with record_accesses(x=x) as log:
        _store_then_load[(3,)](x, out, 3, SHIFT=shift)
    assert sorted(log.hazards()) == sorted(expected)
    assert sorted(log.hazards(own_reads=False)) == (sorted(expected) if shift else [])
    with record_accesses(out=out) as log:  # each element stored once, never loaded
        _store_then_load[(3,)](x, out, 3, SHIFT=shift)
    assert log.hazards() == [] and len(log.launches) == 1


@triton.jit
def _last_one_sums(part_ptr, count_ptr, out_ptr, n, SYNC: tl.constexpr, FENCE: tl.constexpr):
    """Each program stores its partial; the last to arrive sums them all. SYNC 0: "last" is the
    highest program id, no counter (ordered only by the interpreter's grid order); 1: the
    counter with acq_rel; 2: the counter relaxed. FENCE: a barrier between store and counter."""
    pid = tl.program_id(0)
    tl.store(part_ptr + pid, pid + 1.0)
    if FENCE:
        tl.debug_barrier()
    if SYNC == 0:
        last = pid == n - 1
    elif SYNC == 1:
        last = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == n - 1
    else:
        last = tl.atomic_add(count_ptr, 1, sem="relaxed", scope="gpu") == n - 1
    if last:
        offs = tl.arange(0, 4)
        tl.store(out_ptr, tl.sum(tl.load(part_ptr + offs, mask=offs < n, other=0.0)))


@needs_interpreter
@pytest.mark.parametrize("sync,fence,expected", [
    (1, True, []),
    (0, True, ["program (3, 0, 0) loads [0] that program (0, 0, 0) stores",
               "program (3, 0, 0) loads [1] that program (1, 0, 0) stores",
               "program (3, 0, 0) loads [2] that program (2, 0, 0) stores"]),
    (2, True, ["program (3, 0, 0) loads [0] that program (0, 0, 0) stores",
               "program (3, 0, 0) loads [1] that program (1, 0, 0) stores",
               "program (3, 0, 0) loads [2] that program (2, 0, 0) stores"]),
    (1, False, [f"program ({p}, 0, 0) releases counter [0] with no barrier after its last access" for p in range(4)]
     + ["program (3, 0, 0) loads [3] after storing them"]),
], ids=["counter", "grid-order", "relaxed", "no-barrier"])
def test_the_access_log_takes_a_counters_order_and_nothing_else(sync, fence, expected):
    """The last program to arrive at an acq_rel counter reads every partial in order; one picked
    by its id, or through a relaxed counter, reads them in grid order only; a release with no
    barrier after the stores leaves the program's other threads' stores unordered, and so does
    a load of its own partial with no barrier after the store."""
    from tests.triton_interpreter import record_accesses

    part, count, out = torch.zeros(4), torch.zeros(1, dtype=torch.int32), torch.zeros(1)
    with record_accesses(sync=count, part=part) as log:
        _last_one_sums[(4,)](part, count, out, 4, SYNC=sync, FENCE=fence)
    assert out.item() == 10.0
    assert sorted(log.hazards()) == sorted(f"launch 0, {'sync' if 'counter [' in e else 'part'}: {e}" for e in expected)


@triton.jit
def _times(x_ptr, out_ptr, k, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * k)


@interpreting
def test_integer_overflow_checks_are_built_where_the_interpreter_asserts_them(monkeypatch):
    """An int32 product that overflows wraps as it did (the interpreter's options have debug
    off, and its device_assert drops the check); with debug on, the check is built and fails."""
    from triton.runtime import interpreter

    x = torch.tensor([3, 1 << 30], dtype=torch.int32)
    out = torch.zeros(2, dtype=torch.int32)
    assert not interpreter.interpreter_builder.options.debug
    _times[(1,)](x, out, 4, BLOCK=2)
    assert out.tolist() == [12, 0]  # 2^32 wraps to 0
    monkeypatch.setattr(interpreter.interpreter_builder, "options",
                        interpreter.InterpreterOptions(debug=True))
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _times[(1,)](x, out, 4, BLOCK=2)


@interpreting
def test_the_kept_numpy_dtypes_are_the_interpreters_own():
    from triton.runtime import interpreter

    kept = interpreter._get_np_dtype
    types = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
             tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e4nv, tl.float8e5, tl.pointer_type(tl.float32)]
    types += [tl.block_type(t, [4, 2]) for t in types]
    for _ in range(2):  # computed, then kept
        assert [kept(t) for t in types] == [kept.original(t) for t in types]
