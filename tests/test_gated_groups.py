"""The gated RMSNorm with statistics per group of columns (group_size < width, Mamba-2's n_groups > 1): the backward
runs every group in one launch of kernel_1 and one of kernel_2 (`BackwardLaunch`'s column_groups, a second level
of the grid: `backward/common.column_group`), for every strategy and code path the space offers a group's problem,
against float64 with outputs poisoned first, and reruns bitwise. The API is tests/test_gated.py's.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from normtune.kernels import BackwardConfig, Kernel2Config, Problem, kernel_1_config, rms_norm_backward, rms_norm_forward
from normtune.kernels import launcher
from normtune.kernels.api import reference
from normtune.kernels.backward.reduce import kernel_2
from normtune.kernels.backward.rows import kernel_1_single_pass
from normtune.kernels.backward_launch import BackwardLaunch
from normtune.tuner.space import Space

BF16, FP32 = torch.bfloat16, torch.float32
EPS = 1e-6
TOL = {BF16: 2e-2, FP32: 1e-5}
# Knobs that choose which kernel code runs (the others size tiles and grids).
CODE_KNOBS = ("k1.two_pass", "k1.row_split", "k1.recompute", "k1.column_accumulators", "k1.prefetch", "k2.fused")


def _inputs(M, N, device, dtype=BF16):
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return (cast(torch.randn(M, N) + 0.5), cast(2 * torch.randn(M, N)), cast(1.0 + 0.1 * torch.randn(N)),
            cast(torch.randn(M, N)))


def _close(out, ref, tol, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: not every element written (poisoned NaN left) or not finite"
    err = ((out.double() - ref.double()).norm() / max(ref.double().norm().item(), 1e-8)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _grouped(x, z, w, dy, gate, act, group, config):
    """The kernels' backward of every group in one launch each, dx and dz poisoned first: (dx, dw, dz)."""
    M, N = x.shape
    kw = dict(gate=z, gate_position=gate, gate_activation=act, group_size=group)
    _, rstd = rms_norm_forward(x, w, EPS, **kw)
    problem = Problem("rms_norm", M, group, x.dtype, w.dtype, gate=gate, gate_activation=act)
    nan = lambda: torch.full((M, N), float("nan"), dtype=x.dtype, device=x.device)  # noqa: E731
    launch = BackwardLaunch(problem, config, dy, x, w, None, rstd, None, z=z, dx=nan(), dz=nan(),
                            column_groups=N // group)
    dx, dw, _ = launch.run()
    return dx, dw, launch.dz


def _count_launches(monkeypatch) -> list:
    """The kernels launched from now on, in order (every `Launcher` call recorded, then made)."""
    launched = []
    real = launcher.Launcher.__call__

    def counted(self, grid, args, key=None):
        launched.append(self.kernel)
        return real(self, grid, args, key)

    monkeypatch.setattr(launcher.Launcher, "__call__", counted)
    return launched


def _space_configs(space: Space) -> dict[tuple, BackwardConfig]:
    """One config per (strategy, code knob, value) the space offers: the other knobs at the first value its
    constraints accept, column tiles from the widest (the interpreter runs programs one by one)."""
    found = {}
    for strategy in space.offered():
        domains = space.domains(strategy)
        code = [k for k in CODE_KNOBS if k in domains]
        for trial in [{}] + [{key: value} for key in code for value in domains[key]]:
            base = {k: v[0] for k, v in domains.items()}
            base.update(trial, **{"k1.strategy": strategy})
            for warps, col, block_n in itertools.product(domains["k1.num_warps"], reversed(domains["k1.block_col"]),
                                                         reversed(domains["k2.block_n"])):
                config = space.config(dict(base, **{"k1.num_warps": warps, "k1.block_col": col, "k2.block_n": block_n}))
                if space.why_not(config) is None:
                    config = space.canonical(config)
                    path = (strategy,) + tuple(getattr(config.kernel_1, k[3:], None) if k.startswith("k1.")
                                               else getattr(config.kernel_2, k[3:]) for k in code)
                    found.setdefault(path, config)
                    break
    return found


@pytest.mark.parametrize("gate,act,group,groups", [("before", "silu", 40, 3), ("after", "sigmoid", 24, 2),
                                                   ("after", "silu", 1100, 2)])
def test_every_code_path_the_space_offers_runs_all_groups_at_once(gate, act, group, groups, device):
    """Each strategy and code knob value the space offers a group's problem (M rows, group columns), on rows of
    `groups` groups: against float64 per group, every element written, a rerun bitwise the same. A group of 1100
    columns reaches two-pass and split rows (there only those and each strategy's first config run)."""
    M = 3
    problem = Problem("rms_norm", M, group, "bf16", gate=gate, gate_activation=act)
    configs = _space_configs(Space(problem, 2))
    assert {c.kernel_1.strategy for c in configs.values()} == {"rows", "columns", "dual"}
    if group > 1024:
        first = {}
        for path, c in configs.items():
            first.setdefault(c.kernel_1.strategy, (path, c))
        wide = {path: c for path, c in configs.items()
                if getattr(c.kernel_1, "two_pass", False) or getattr(c.kernel_1, "row_split", 1) > 1}
        assert any(getattr(c.kernel_1, "two_pass", False) for c in wide.values())
        assert any(getattr(c.kernel_1, "row_split", 1) > 1 for c in wide.values())
        configs = {**dict(first.values()), **wide}
    else:
        assert any(getattr(c.kernel_2, "fused", False) for c in configs.values())
    x, z, w, dy = _inputs(M, group * groups, device)
    ref = reference.gated_float64(x, z, w, dy, EPS, gate_after=gate == "after", sigmoid=act == "sigmoid",
                                  zero_centered=False, group=group)
    for path, config in configs.items():
        first = _grouped(x, z, w, dy, gate, act, group, config)
        for out, name in zip(first, ("dx", "dw", "dz")):
            _close(out, ref[name], TOL[BF16], f"{path} {config} {name}")
        again = _grouped(x, z, w, dy, gate, act, group, config)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), f"{path}: a rerun must be bitwise the same"


def test_a_grouped_call_launches_each_kernel_once(device, monkeypatch):
    """rms_norm_backward with 4 groups and a rows config: one kernel_1 launch and one kernel_2 launch in all, and
    the results of the float64 reference per group (fp32, zero-centred weight)."""
    M, N, group = 6, 64, 16
    x, z, w, dy = _inputs(M, N, device, FP32)
    kw = dict(gate=z, gate_position="after", gate_activation="silu", group_size=group)
    _, rstd = rms_norm_forward(x, w, EPS, zero_centered=True, **kw)
    config = BackwardConfig(kernel_1_config(strategy="rows", block_row=2, block_col=16, num_warps=1),
                            Kernel2Config(block_m=4, block_n=16, num_warps=1))
    launched = _count_launches(monkeypatch)
    dx, dw, dz = rms_norm_backward(dy, x, w, rstd, zero_centered=True, config=config, **kw)
    assert launched == [kernel_1_single_pass, kernel_2], launched
    ref = reference.gated_float64(x, z, w, dy, EPS, gate_after=True, sigmoid=False, zero_centered=True, group=group)
    for out, name in ((dx, "dx"), (dw, "dw"), (dz, "dz")):
        _close(out, ref[name], TOL[FP32], name)



@pytest.mark.parametrize("gate", ["before", "after"])
@pytest.mark.parametrize("M,N,group", [(6, 64, 16), (1, 96, 32), (37, 3 * 8192 + 3 * 8192, 8192)])
def test_a_grouped_forward_is_one_launch_with_every_group_right(gate, M, N, group, device, monkeypatch):
    """The forward of a grouped call normalizes every group in one launch of the forward kernel (single-pass and
    chunked widths), y and rstd (groups × rows) those of the float64 reference, its outputs poisoned first."""
    from normtune.kernels.forward import _forward_kernel, forward_gated

    x, z, w, _ = _inputs(M, N, device, FP32)
    y = torch.full((M, N), float("nan"), device=device)
    rstd = torch.full((N // group * M,), float("nan"), device=device)
    launched = _count_launches(monkeypatch)
    forward_gated(x, z, w, EPS, gate_after=gate == "after", sigmoid=False, zero_centered=False, y=y, rstd=rstd,
                  groups=N // group)
    assert launched == [_forward_kernel], launched
    x64, z64, w64 = x.double(), z.double(), w.double()
    a = torch.nn.functional.silu(z64)
    h = (x64 * a if gate == "after" else x64).view(M, N // group, group)
    r = torch.rsqrt(h.pow(2).mean(-1) + EPS)
    ref = (h * r[..., None]).view(M, N) * w64
    ref = ref * a if gate == "before" else ref
    _close(y, ref, TOL[FP32], "y")
    _close(rstd, r.t().reshape(-1), TOL[FP32], "rstd")


def test_a_waiting_config_whose_groups_cannot_all_be_resident_runs_group_by_group(device, monkeypatch):
    """A fused-reduction config whose programs the GPU cannot hold at once for every group: its plan says so
    (`GroupsNotResident`, checked on a target that is not the interpreter's two-phase one), and the call then runs
    the groups' launches in turn (one fused launch per group) with the float64 reference's results."""
    import dataclasses

    from normtune.kernels import backward_launch

    M, N, group = 6, 64, 16
    config = BackwardConfig(kernel_1_config(strategy="rows", block_row=2, block_col=16, num_warps=1),
                            Kernel2Config(block_m=4, block_n=16, num_warps=1, fused=True))
    problem = Problem("rms_norm", M, group, "fp32", gate="before", gate_activation="silu")
    full_gpu = dataclasses.replace(backward_launch.target(torch.device(device)), phased=False,
                                   resident=lambda *args: 1)
    with pytest.raises(backward_launch.GroupsNotResident):
        config.strategy.plan(problem, config, full_gpu, False, 1, N // group)
    x, z, w, dy = _inputs(M, N, device, FP32)
    kw = dict(gate=z, gate_position="before", gate_activation="silu", group_size=group)
    _, rstd = rms_norm_forward(x, w, EPS, **kw)
    real_launch = backward_launch.BackwardLaunch

    def refusing(*args, column_groups=1, **kwargs):
        if column_groups > 1:
            raise backward_launch.GroupsNotResident("not resident")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(backward_launch, "BackwardLaunch", refusing)
    launched = _count_launches(monkeypatch)
    dx, dw, dz = rms_norm_backward(dy, x, w, rstd, config=config, **kw)
    assert len(launched) >= N // group, launched  # group by group
    ref = reference.gated_float64(x, z, w, dy, EPS, gate_after=False, sigmoid=False, zero_centered=False,
                                  group=group)
    for out, name in ((dx, "dx"), (dw, "dw"), (dz, "dz")):
        _close(out, ref[name], TOL[FP32], name)
