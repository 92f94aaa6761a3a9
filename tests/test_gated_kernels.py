"""The gated RMSNorm's kernels (`Problem.gate`): y = w·norm(x)·act(z) (gate before) or y = w·norm(x·act(z)) (gate
after), act = silu or sigmoid. The forward kernel, kernel_1 of every strategy (dx and dz written in one pass, dw
reduced by kernel_2 or by the strategy itself) and the code paths the search space offers a gated problem, against
float64 (torch's autograd of the forward's formula), with outputs poisoned first; the gate in the problem and its
keys. The API is tests/test_gated.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from normtune.kernels import BackwardConfig, Kernel2Config, Problem, ProblemFamily, kernel_1_config
from normtune.kernels.backward_launch import BackwardLaunch
from normtune.kernels.config import ConfigError
from normtune.kernels.forward import forward_gated
from normtune.tuner.space import Space
from normtune.tuner.store.models import problem_from_row

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
EPS = 1e-6
TOL = {BF16: 2e-2, FP32: 1e-5, FP16: 5e-3}
GATES = [("before", "silu"), ("after", "silu"), ("before", "sigmoid"), ("after", "sigmoid")]
K2 = Kernel2Config(block_m=4, block_n=64, num_warps=2)


def _k1(**kw):
    return kernel_1_config(**{"block_row": 2, "num_warps": 2, "programs_per_sm": 0.125, **kw})


# (label, N, config): every kernel_1 strategy and the knobs that change where dx and dz are written.
STRATEGY_CASES = [
    ("rows", 37, BackwardConfig(_k1(block_col=64), K2)),
    ("rows-prefetch", 37, BackwardConfig(_k1(block_col=64, prefetch=True, eviction_policy="evict_first"), K2)),
    ("rows-fused", 37, BackwardConfig(_k1(block_col=64, num_stages=2), dataclasses.replace(K2, fused=True))),
    ("rows-recompute", 37, BackwardConfig(_k1(block_col=64, block_row=1, recompute=True), K2)),
    ("rows-column-accumulators", 37, BackwardConfig(_k1(block_col=64, column_accumulators=True), K2)),
    ("two-pass", 37, BackwardConfig(_k1(block_col=16, two_pass=True, num_warps=1), K2)),
    ("two-pass-prefetch", 37, BackwardConfig(_k1(block_col=16, two_pass=True, prefetch=True, num_warps=1), K2)),
    ("row-split-2", 600, BackwardConfig(_k1(block_col=512, block_row=1, row_split=2, num_warps=4), K2)),
    ("columns", 37, BackwardConfig(_k1(block_col=16, strategy="columns", num_warps=1), K2)),
    ("columns-prefetch", 37, BackwardConfig(_k1(block_col=16, strategy="columns", prefetch=True, num_warps=1), K2)),
    ("dual", 37, BackwardConfig(_k1(block_col=64, strategy="dual"), Kernel2Config(block_m=4, block_n=16,
                                                                                   num_warps=2))),
]


def _inputs(M, N, device, dtype=BF16):
    """x, z, w, dy: drawn in fp32 on the CPU from the test's seed, then cast."""
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return (cast(torch.randn(M, N) + 0.5), cast(2 * torch.randn(M, N)), cast(1.0 + 0.1 * torch.randn(N)),
            cast(torch.randn(M, N)))


def _ref(x, z, w, dy, gate, act):
    """float64 y and the gradients of x, z and w (autograd of y·dy)."""
    x64, z64, w64 = (t.detach().double().requires_grad_() for t in (x, z, w))
    a = torch.sigmoid(z64) if act == "sigmoid" else torch.nn.functional.silu(z64)
    s = x64 * a if gate == "after" else x64
    y = s * torch.rsqrt((s * s).mean(-1, keepdim=True) + EPS) * w64 * (1.0 if gate == "after" else a)
    (y * dy.double()).sum().backward()
    return {"y": y.detach(), "dx": x64.grad, "dz": z64.grad, "dw": w64.grad}


def _close(out, ref, tol, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: not every element written (poisoned NaN left) or not finite"
    err = ((out.double() - ref.double()).norm() / max(ref.double().norm().item(), 1e-8)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _check(outs: dict, ref: dict, tol: float, label: str = ""):
    for name in ("y", "dx", "dz", "dw"):
        if name in outs:
            _close(outs[name], ref[name], tol, f"{label} {name}")


def _nan(*shape, dtype=BF16, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _kernels(x, z, w, dy, gate, act, config, *, zc=False):
    """Forward and backward through the kernels (outputs poisoned first): y, dx, dz, dw."""
    M, N = x.shape
    after, sigmoid = gate == "after", act == "sigmoid"
    y, rstd = forward_gated(x, z, w, EPS, gate_after=after, sigmoid=sigmoid, zero_centered=zc,
                            y=_nan(M, N, dtype=x.dtype, device=x.device), rstd=_nan(M, dtype=FP32, device=x.device))
    problem = Problem("rms_norm", M, N, x.dtype, w.dtype, zero_centered=zc, gate=gate, gate_activation=act)
    launch = BackwardLaunch(problem, config, dy, x, w, None, rstd, None, z=z,
                            dx=_nan(M, N, dtype=x.dtype, device=x.device), dz=_nan(M, N, dtype=z.dtype, device=x.device))
    dx, dw, _ = launch.run()
    return {"y": y, "dx": dx, "dz": launch.dz, "dw": dw}


# ------------------------------------------------------------------------------------------------------ kernels

@pytest.mark.parametrize("M,N", [(0, 37), (1, 37), (6, 40), (2, 8193)])
@pytest.mark.parametrize("gate,act", GATES)
def test_forward_kernel(M, N, gate, act, device):
    x, z, w, dy = _inputs(M, N, device, FP32)
    y, rstd = forward_gated(x, z, w, EPS, gate_after=gate == "after", sigmoid=act == "sigmoid", zero_centered=False,
                            y=_nan(M, N, dtype=FP32, device=device), rstd=_nan(M, dtype=FP32, device=device))
    if M:
        _close(y, _ref(x, z, w, dy, gate, act)["y"], TOL[FP32], "y")
        s = x.double() * (torch.sigmoid(z.double()) if act == "sigmoid" else torch.nn.functional.silu(z.double())) \
            if gate == "after" else x.double()
        _close(rstd, torch.rsqrt((s * s).mean(-1) + EPS), TOL[FP32], "rstd")


@pytest.mark.parametrize("label,N,config", STRATEGY_CASES, ids=[c[0] for c in STRATEGY_CASES])
@pytest.mark.parametrize("gate,act,dtype", [("before", "silu", BF16), ("after", "sigmoid", FP32),
                                            ("after", "silu", BF16), ("before", "sigmoid", FP16)])
def test_every_strategy_matches_float64_and_reruns_bitwise(label, N, config, gate, act, dtype, device):
    x, z, w, dy = _inputs(5, N, device, dtype)
    first = _kernels(x, z, w, dy, gate, act, config)
    _check(first, _ref(x, z, w, dy, gate, act), TOL[dtype], label)
    again = _kernels(x, z, w, dy, gate, act, config)
    assert all(torch.equal(first[k], again[k]) for k in first), "a rerun must give bitwise the same results"


# The knobs that choose which kernel code runs (the others size tiles and grids).
CODE_KNOBS = ("k1.two_pass", "k1.row_split", "k1.recompute", "k1.column_accumulators", "k1.pipelined_split",
              "k1.prefetch", "k2.fused", "k1.block_row")


def _space_configs(space: Space) -> dict[tuple, BackwardConfig]:
    """One config of the space per (strategy, variant, code knob, value): each code knob's every value in its
    domain, the other code knobs at their first (and a config with every flag on, where the space has one); the
    tile and grid knobs are the first the space's constraints accept, column tiles from the widest (the fewest
    programs: the interpreter runs them one by one)."""
    found = {}
    for strategy in space.offered():
        domains = space.domains(strategy)
        code = [k for k in CODE_KNOBS if k in domains]
        trials = [{}] + [{key: value} for key in code for value in domains[key]]
        trials.append({k: domains[k][-1] for k in code if len(domains[k]) > 1})
        for trial in trials:
            base = {k: v[0] for k, v in domains.items()}
            base.update(trial, **{"k1.strategy": strategy})
            for warps, stages, col, block_n in itertools.product(
                    domains["k1.num_warps"], domains["k1.num_stages"], reversed(domains["k1.block_col"]),
                    reversed(domains["k2.block_n"])):
                params = dict(base, **{"k1.num_warps": warps, "k1.block_col": col, "k2.block_n": block_n})
                params.setdefault("k1.num_stages", stages)
                if "k1.num_stages" not in trial:
                    params["k1.num_stages"] = stages
                config = space.config(params)
                if space.why_not(config) is None:
                    config = space.canonical(config)
                    k1 = config.kernel_1
                    path = (strategy,) + tuple(getattr(k1, k[3:], None) if k.startswith("k1.") else
                                               getattr(config.kernel_2, k[3:]) for k in code)
                    found.setdefault(path, config)
                    break
    return found


@pytest.mark.parametrize("gate,act,N", [("before", "silu", 40), ("after", "sigmoid", 40), ("after", "silu", 1100)])
def test_every_code_path_the_space_offers_is_correct(gate, act, N, device):
    """The space offers every strategy for a gated problem: each code knob's every value (per strategy and
    variant) runs against float64. N = 1100 reaches two-pass and split rows: there the configs that only a wide
    row reaches run (two-pass, split rows), and each strategy's first config; the knobs' other values are the
    same kernel code as at N = 40 (checked there, on both gate positions and both activations)."""
    problem = Problem("rms_norm", 3, N, "bf16", gate=gate, gate_activation=act)
    space = Space(problem, 2)
    assert set(space.offered()) == {"rows", "columns", "dual"}
    configs = _space_configs(space)
    kinds = {(c.kernel_1.strategy, getattr(c.kernel_1, "two_pass", False), getattr(c.kernel_1, "row_split", 1) > 1)
             for c in configs.values()}
    assert {("rows", False, False), ("columns", False, False), ("dual", False, False)} <= kinds
    if N > 1024:
        assert ("rows", True, False) in kinds and ("rows", False, True) in kinds
    if N > 1024:
        wide = {path: c for path, c in configs.items()
                if getattr(c.kernel_1, "two_pass", False) or getattr(c.kernel_1, "row_split", 1) > 1}
        first = {}
        for path, c in configs.items():
            first.setdefault(c.kernel_1.strategy, (path, c))
        configs = {**dict(first.values()), **wide}
        assert {c.kernel_1.strategy for c in configs.values()} == {"rows", "columns", "dual"}
    x, z, w, dy = _inputs(3, N, device)
    ref = _ref(x, z, w, dy, gate, act)
    for path, config in configs.items():
        _check(_kernels(x, z, w, dy, gate, act, config), ref, TOL[BF16], f"{path} {config}")


def test_gate_is_part_of_the_problem_and_family():
    plain = Problem("rms_norm", 4, 8, "bf16")
    assert "gate" not in plain.to_dict() and plain.family.gate is None
    gated = Problem("rms_norm", 4, 8, "bf16", gate="after")
    assert gated.gate_activation == "silu"
    assert gated.family.key == "rms_norm/bf16/wbf16/nobias/save-input/gate-after-silu"
    assert Problem.from_dict(gated.to_dict()) == gated and ProblemFamily.from_key(gated.family.key) == gated.family
    assert gated.family.problem(4, 8) == gated
    for p in (plain, gated):  # the tuner's store keeps the form in the family key, not in columns of its own
        row = SimpleNamespace(family_key=p.family.key, **{f: getattr(p, f) for f in (
            "norm", "M", "N", "dtype", "weight_dtype", "has_weight", "has_bias", "zero_centered", "save")})
        assert problem_from_row(row) == p
    for kwargs, needle in (({"norm": "layer_norm"}, "gated form is an RMSNorm"), ({"save": "output"}, "save='input'"),
                           ({"residual": True}, "residual=False"), ({"gate_activation": "tanh"}, "gate_activation")):
        with pytest.raises(ConfigError, match=needle):
            Problem(**{"norm": "rms_norm", "M": 4, "N": 8, "gate": "before", **kwargs})
    with pytest.raises(ConfigError, match="needs a gate"):
        Problem("rms_norm", 4, 8, gate_activation="silu")
