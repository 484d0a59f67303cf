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
