"""Launching a Triton kernel without `JITFunction.run`'s per-call work.

`kernel[grid](*args, **constexprs)` binds every argument, specializes each one (integer values, pointer
alignment), hashes the result into a cache key and looks the compiled kernel up, on every call: CPU time per
launch on a GPU host (docs/kernel-figures.md), paid on every layer of every step. A `Launcher` does that once per
*specialization key* — a cheap tuple the caller derives from what the specialization depends on (the integer
arguments, the alignment of pointers it did not allocate itself), per current device — and afterwards calls the
compiled kernel's own launcher directly (a fraction of that time): same binary, same stream (the current stream of the current
device, as `JITFunction.run` uses), same launch options (warps, PDL), profiler launch hooks honoured. Where the
compiled kernel's launcher object is Triton's CUDA launcher in a form this module knows (no scratch memory, no
sanitizer) and no hook is set, its C function is called straight, skipping the Python wrapper around it
(`raw_launch`).

The first launch of a key, the interpreter, a kernel whose compile-time arguments are not all at the end of its
signature, and a Triton whose compiled kernels lack the launcher interface all go through `JITFunction.run`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Hashable

import torch

from .device import interpret_mode

try:  # Triton >= 3.3: launch hooks live in knobs
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: every launch goes through JITFunction.run
    _knobs = None


# Specializations remembered per launcher before the table starts over.
MAX_KEYS = 4096


# Call Triton's C launch function straight where `raw_launch` knows the launcher (experiments turn it off to
# compare; keys remembered before a change keep their route).
RAW_LAUNCH = True


# The unbound method: no bound method is made per argument (the forward's call path uses it too).
data_ptr = torch._C.TensorBase.data_ptr


def _current_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


def current_device_index() -> int:
    """The device Triton launches on (the current CUDA device, not the tensors')."""
    return torch._C._cuda_getDevice()


def constexpr_tail(kernel: Any, constexprs: dict[str, Any]) -> tuple | None:
    """The values of `kernel`'s compile-time parameters in signature order (given, else their defaults), or None
    when a runtime parameter follows a compile-time one (the launcher then needs the generic path)."""
    params = getattr(kernel, "params", None)
    if params is None:
        return None
    tail: list[Any] = []
    for p in params:
        if p.is_constexpr:
            if p.name in constexprs:
                tail.append(constexprs[p.name])
            else:
                default = kernel.signature.parameters[p.name].default
                if default is kernel.signature.empty:
                    return None  # a missing constexpr: let JITFunction.run raise its own error
                tail.append(default)
        elif tail:
            return None
    return tuple(tail)


# The parameters of the CUDA launcher object's `__call__` in the two forms `raw_launch` knows. "flat" (e.g. Triton
# 3.6): its C function takes the scratch pointers, then the metadata, hooks and kernel arguments as they came.
# "packed" (e.g. Triton 3.9): one generic C function taking the metadata and hooks first, then the argument
# annotations and the kernel arguments as one tuple.
_CALL_FORMS = {
    ("self", "gridX", "gridY", "gridZ", "stream", "function", "args"): "flat",
    ("self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
     "launch_enter_hook", "launch_exit_hook", "args"): "packed",
}


@functools.lru_cache(maxsize=None)
def _call_form(cls: type) -> str | None:
    try:
        names = tuple(inspect.signature(cls.__call__).parameters)
    except (TypeError, ValueError):
        return None
    return _CALL_FORMS.get(names)


def raw_launch(run: Any) -> tuple | None:
    """(C launch function, flat, cooperative, pdl, annotations, signature) where Triton's CUDA launcher object
    `run` would do nothing but call its C launch function with those and the call's own values (no scratch to
    allocate, no sanitizer, no other launch route, a `__call__` of a known form); else None.
    `tests/test_launcher.py` checks, against the installed Triton's own `__call__`, that both routes pass the C
    function the same arguments."""
    form = _call_form(type(run)) if type(run).__name__ == "CudaLauncher" else None
    names = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size",
             "num_ctas") + (("arg_annotations", "kernel_signature") if form == "packed" else ())
    if form is None or not all(hasattr(run, n) for n in names):
        return None
    if run.global_scratch_size or run.profile_scratch_size or run.num_ctas != 1:
        return None
    if getattr(run, "gsan_enabled", False) or any(n.startswith("_tvmffi") for n in vars(run)):
        return None
    if form == "flat":
        return run.launch, True, run.launch_cooperative_grid, run.launch_pdl, None, None
    return run.launch, False, run.launch_cooperative_grid, run.launch_pdl, run.arg_annotations, run.kernel_signature


def _hooked(hook: Any) -> bool:
    """Whether a launch hook would do anything: Triton >= 3.4 always has a hook *chain*, empty unless a profiler
    (e.g. proton) added to it; building the launch metadata for an empty chain costs several µs per launch."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """One Triton kernel with fixed compile-time arguments (constexprs and launch options such as num_warps).

        launch = Launcher(kernel_2, dict(BLOCK_M=64, num_warps=4))
        launch(grid, args, key)     # args: the runtime arguments in signature order; key: see the module doc

    `key` must change whenever Triton would specialize differently: integer arguments (value 1, divisibility
    by 16, 32 vs 64 bits), pointer alignment (16 bytes) and dtypes. The current device is added here. The calls
    of one key pass tensors at the same positions (pointer arguments are tensors, the others are not).
    """

    __slots__ = ("kernel", "constexprs", "_tail", "_compiled")

    def __init__(self, kernel: Any, constexprs: dict[str, Any]):
        self.kernel = kernel
        self.constexprs = constexprs
        direct = _knobs is not None and not interpret_mode()
        self._tail = constexpr_tail(kernel, constexprs) if direct else None
        self._compiled: dict[Hashable, tuple] = {}

    @property
    def direct(self) -> bool:
        """Launches after the first of a key skip JITFunction.run."""
        return self._tail is not None

    def __call__(self, grid: int, args: tuple, key: Hashable = None) -> None:
        if self._tail is None:
            self.kernel[(grid,)](*args, **self.constexprs)
            return
        device = current_device_index()
        entry = self._compiled.get((device, key))
        if entry is None:
            self._remember((device, key), self.kernel[(grid,)](*args, **self.constexprs), device, args)
            return
        run, function, packed, compiled, tensors, raw = entry
        stream = _current_stream(device)
        # Addresses as integers: the launcher then neither calls data_ptr() nor asks the driver about each pointer
        # (cuPointerGetAttribute), which it does for every tensor argument. The positions of the tensors were
        # found once, on the key's first launch.
        args = list(args)
        for i in tensors:
            args[i] = data_ptr(args[i])
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        if not _hooked(enter) and not _hooked(leave):
            if raw is None:
                run(grid, 1, 1, stream, function, packed, None, None, None, *args, *self._tail)
            else:
                c_launch, flat, cooperative, pdl, annotations, signature = raw
                if flat:
                    c_launch(grid, 1, 1, stream, function, cooperative, pdl, None, None, packed, None, None, None,
                             *args, *self._tail)
                else:
                    c_launch(grid, 1, 1, stream, function, cooperative, pdl, packed, None, None, None, None, None,
                             annotations, signature, (*args, *self._tail))
            return
        full = (*args, *self._tail)
        run(grid, 1, 1, stream, function, packed, compiled.launch_metadata((grid, 1, 1), stream, *full), enter,
            leave, *full)

    def _remember(self, key: Hashable, compiled: Any, device: int, args: tuple) -> None:
        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        try:
            compiled._init_handles()
            run = compiled.run
            entry = (run, compiled.function, compiled.packed_metadata, compiled, tensors,
                     raw_launch(run) if RAW_LAUNCH else None)
        except Exception:  # noqa: BLE001 - a compiled-kernel layout this code does not know: stay generic
            self._tail = None
            return
        if len(self._compiled) >= MAX_KEYS:  # e.g. a new row count every step: start over rather than grow
            self._compiled.clear()
        self._compiled[key] = entry
