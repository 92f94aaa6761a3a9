"""Triton's interpreter without its repeated language patching (not a test module itself).

To run a kernel, the interpreter replaces the builtins of the `triton.language` modules the kernel sees (`tl`,
`tl.core`) and of `tl.tensor` and `tl.math` with host implementations, runs every program of the grid, then
restores them. Every call of a `@triton.jit` helper from inside the kernel (the kernels' own helpers, and
`tl.sum`, `tl.max`, ... which are helpers too) patches the modules that helper sees again: `inspect.getmembers`
over each, closures rebuilt, for every helper call of every program. A module already patched in this kernel has
no builtin left to replace, and its methods are set again to closures that do the same, so that patch changes
nothing the kernel computes. `install()` makes a helper call skip it when every module the helper sees was
patched earlier in the running kernel (by the kernel itself, or by an earlier helper call: the interpreter never
restores a helper's patch), and keeps the interpreter's own path everywhere else (a helper called outside a
kernel, the first helper call that sees a module the kernel did not). Kernels give the same bits with it
(test_interpreter_cache.py checks).
"""

from __future__ import annotations

import functools
import inspect
import threading

_LOCAL = threading.local()  # .patched: a stack of the language modules patched so far in each running kernel


@functools.cache
def _languages(fn) -> frozenset[int]:
    """The language modules `fn` sees (the ones the interpreter's `_patch_lang(fn)` would patch), by id: those a
    module imported, so one look per function."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))


def _patched_stack() -> list:
    if not hasattr(_LOCAL, "patched"):
        _LOCAL.patched = []
    return _LOCAL.patched


def install() -> bool:
    """Patch the interpreter's kernel and helper calls as described above; returns False, leaving the interpreter
    as it is, where its helper call is not the one this replaces (another Triton version)."""
    from triton.runtime import interpreter

    executor, helper = interpreter.GridExecutor, interpreter.InterpretedFunction
    if getattr(helper.__call__, "_patches_once", False):
        return True
    expected = ["_patch_lang(self.fn)", "fn = self.rewrite()", "return fn(*args, **kwargs)",
                "raise InterpreterError(repr(e)) from e"]
    source = inspect.getsource(helper.__call__)
    if not all(line in source for line in expected) or "patch_scope = _patch_lang(self.fn)" not in inspect.getsource(
            executor.__call__):
        return False
    run_grid = executor.__call__

    def grid_call(self, *args, **kwargs):
        # The executor patches the languages `self.fn` sees before its first program and restores them after
        # the last: helper calls in between find those patched.
        stack = _patched_stack()
        stack.append(set(_languages(self.fn)))
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            stack.pop()

    def helper_call(self, *args, **kwargs):
        stack = _patched_stack()
        languages = _languages(self.fn)
        if not stack or not languages <= stack[-1]:
            interpreter._patch_lang(self.fn)  # never restored: it holds for the rest of this kernel
            if stack:
                stack[-1] |= languages
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    helper_call._patches_once = True
    grid_call.__wrapped__, helper_call.__wrapped__ = run_grid, helper.__call__  # the interpreter's own calls
    executor.__call__, helper.__call__ = grid_call, helper_call
    return True
