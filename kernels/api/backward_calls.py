"""A backward call resolved once per signature: its problem, the config that runs it (selected, or an explicit one
validated) and its launch plans, and `backward_impl`, which runs a backward on checked rows (the Triton kernels, or
the reference backward off the Triton path) for every form (`forms.py`; the residual form adds its stream's
gradient dh)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch import Tensor

from .. import backward_launch as _backward
from . import reference
from ..config import BackwardConfig, Problem
from ..device import compute_capability, device_limits, device_name, use_triton
from ..select.select import on_clear, resolve_config


@functools.lru_cache(maxsize=4096)
def _problem(M, N, dtype, weight_dtype, has_weight, has_bias, is_rms, zero_centered, save_output,
             residual_dtype=None, gate=None) -> Problem:
    """Built (and validated) once per shape and flags (`resolved`); `residual_dtype`: dh's dtype in the residual
    form (None: no residual); `gate`: (gate, gate_activation) of the gated form (None: no gate)."""
    return Problem(norm="rms_norm" if is_rms else "layer_norm", M=M, N=N, dtype=dtype, weight_dtype=weight_dtype,
                   has_weight=has_weight, has_bias=has_bias, zero_centered=zero_centered,
                   save="output" if save_output else "input", residual=residual_dtype is not None,
                   residual_dtype=residual_dtype, gate=gate[0] if gate else None,
                   gate_activation=gate[1] if gate else None)


@dataclasses.dataclass(frozen=True, eq=False)
class BackwardCall:
    """A backward call resolved: its problem, the config that runs it (validated for the problem on the device;
    None off the Triton path, where the reference backward runs) and the launch plans made for it (by row
    strides, `BackwardLaunch`'s memo). One per signature (`resolved`); an eager call with an explicit config
    carries its own from the forward to the backward, where the custom ops carry the config's JSON text."""

    problem: Problem
    config: Optional[BackwardConfig]
    plans: dict


# (rows, width, dtypes, flags, config (JSON text, "" to select, or a BackwardConfig), device) of a backward call
# → its `BackwardCall`. A call's config is resolved (selected or validated) once per key: the per-call host path
# is then a dict lookup.
_RESOLVED: dict[tuple, BackwardCall] = {}
MAX_RESOLVED = 4096


def resolved(rows: Tensor, M: int, N: int, weight, bias, is_rms, zero_centered, save_output, config,
             residual_dtype=None, gate=None) -> BackwardCall:
    """The `BackwardCall` of a backward on M x N gradient rows with `rows`' dtype and device (the gradient, or
    the forward's input rows, which have its dtype): `config` is JSON text ("" selects one) or a
    `BackwardConfig`. An explicit config that does not fit raises `ConfigError` naming the field. `gate`: the
    gated form's (gate, gate_activation), None without one."""
    index = rows.get_device()  # -1 on CPU, where the interpreter setting decides the path
    key = (M, N, rows.dtype, weight.dtype if weight is not None else None, bias is not None, is_rms,
           zero_centered, save_output, config, index if index >= 0 else use_triton(rows), residual_dtype, gate)
    hit = _RESOLVED.get(key)
    if hit is None:
        problem = _problem(M, N, rows.dtype, weight.dtype if weight is not None else None, weight is not None,
                           bias is not None, is_rms, zero_centered, save_output, residual_dtype, gate)
        if use_triton(rows):
            cfg = resolve_config(problem, config, device_name(rows.device), compute_capability(rows.device),
                                 device_limits(rows.device) if rows.is_cuda else None)
        else:
            cfg = None
            if config:
                resolve_config(problem, config, None)  # an explicit config is checked on every path
        if len(_RESOLVED) >= MAX_RESOLVED:  # e.g. a new row count every step: start over rather than grow
            _RESOLVED.clear()
        hit = _RESOLVED[key] = BackwardCall(problem, cfg, {})
    return hit


def clear_resolved() -> None:
    """Forget resolved calls (`select.clear_caches` calls this when tables or settings change)."""
    _RESOLVED.clear()


on_clear(clear_resolved)


def backward_impl(grad, saved, weight, bias, rstd, mean, is_rms, zero_centered, save_output, config, dh=None,
                  gate=None):
    """(dx, dw, db), dw/db None where there is no weight/bias. `config`: JSON text ("" selects one), or the
    `BackwardCall` an explicit config resolved to for these rows (`call_checks.explicit_backward`). `dh`: the
    residual stream's gradient rows (the residual form), added into dx, which then has dh's dtype. `gate`: the
    gated form's (z rows, gate after, sigmoid, group size); then (dx, dw, db, dz). Groups narrower than the row run
    every group's backward in one launch of each kernel (`_groups`), with the group's rstd (`rstd` holds them
    group by group, each M long)."""
    if grad.stride(-1) != 1:  # e.g. the expanded gradient of a sum(): give the kernels contiguous columns
        grad = grad.contiguous()
    if dh is not None and dh.stride(-1) != 1:
        dh = dh.contiguous()
    z, M, N = None, *grad.shape
    group = N
    if gate is not None:
        z, after, sigmoid, group = gate
        z = z if z.stride(-1) == 1 else z.contiguous()
        gate = ("after" if after else "before"), ("sigmoid" if sigmoid else "silu")
    if type(config) is BackwardCall:
        call = config
    else:
        call = resolved(grad, M, group, weight, bias, is_rms, zero_centered, save_output, config,
                        None if dh is None else dh.dtype, gate)
    if group != N:
        return _groups(call, grad, saved, weight, rstd, z, group, zero_centered, gate)
    if call.config is not None:
        launch = _backward.BackwardLaunch(call.problem, call.config, grad, saved, weight, bias, rstd, mean,
                                          plans=call.plans, dh=dh, z=z)
        return launch.run() if z is None else (*launch.run(), launch.dz)
    if z is not None:
        return reference.backward_gated(grad, saved, z, weight, rstd, gate_after=gate[0] == "after",
                                        sigmoid=gate[1] == "sigmoid", zero_centered=zero_centered)
    return reference.backward(grad, saved, weight, bias, rstd, mean, is_rms=is_rms, zero_centered=zero_centered,
                              from_output=save_output, dh=dh)


def _groups(call: BackwardCall, grad, saved, weight, rstd, z, group: int, zero_centered: bool, gate: tuple):
    """(dx, dw, None, dz) of the gated form with statistics per group of `group` columns: each group's columns are
    a problem of their own (`call.problem`, `group` wide). The kernels run every group in one launch each
    (`BackwardLaunch`'s column_groups); the reference backward (no config), and a config whose waiting programs
    cannot all be resident for every group at once, run group by group."""
    M, N = grad.shape
    if call.config is not None:
        try:
            launch = _backward.BackwardLaunch(call.problem, call.config, grad, saved, weight, None, rstd, None,
                                              plans=call.plans, z=z, column_groups=N // group)
        except _backward.GroupsNotResident:
            launch = None  # its waiting programs do not fit at once for every group: group by group below
        if launch is not None:
            dx, dw, _ = launch.run()
            return dx, dw, None, launch.dz
    dx = torch.empty(M, N, dtype=grad.dtype, device=grad.device)
    dz = torch.empty(M, N, dtype=z.dtype, device=grad.device)
    dw = torch.empty(N, dtype=weight.dtype, device=grad.device) if weight is not None else None
    stats = rstd.view(N // group, M)
    for g, start in enumerate(range(0, N, group)):
        cols = slice(start, start + group)
        w = weight[cols] if weight is not None else None
        if call.config is not None:
            launch = _backward.BackwardLaunch(call.problem, call.config, grad[:, cols], saved[:, cols], w, None,
                                              stats[g], None, plans=call.plans, z=z[:, cols], dx=dx[:, cols],
                                              dz=dz[:, cols])
            _, dw_g, _ = launch.run()
        else:
            dx_g, dw_g, _, dz_g = reference.backward_gated(grad[:, cols], saved[:, cols], z[:, cols], w, stats[g],
                                                           gate_after=gate[0] == "after",
                                                           sigmoid=gate[1] == "sigmoid", zero_centered=zero_centered)
            dx[:, cols], dz[:, cols] = dx_g, dz_g
        if dw is not None:
            dw[cols] = dw_g
    return dx, dw, None, dz
