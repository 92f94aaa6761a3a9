"""The strategy registry is the one place a kernel_1 knob is declared: a throwaway knob added to one strategy, in
that strategy's terms only (a subclass of its module's class, registered under its name), reaches the search
space, the sampler, the seeds, the results store (JSON, lookups, the upgrade of a database written before it) and
`normtune where`, with no change anywhere else."""

from __future__ import annotations

import json
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import BackwardConfig, ConfigError, Problem
from normtune.kernels.strategies import STRATEGIES, Knob
from normtune.kernels.strategies.dual import Dual, DualConfig
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.results import MeasureResult
from normtune.tuner.space import Space
from normtune.tuner.store.database import Store
from normtune.tuner.sweep.sampling import inapplicable

ROOT = Path(__file__).resolve().parents[1]
FEW = Problem("rms_norm", 64, 1024, "bf16")


@dataclass(frozen=True)
class SpinConfig(DualConfig):
    spin: int = 0


class SpinningDual(Dual):
    config_type = SpinConfig
    extra = (Knob("spin", (0, 1, 2), 0),)


@pytest.fixture
def spin(monkeypatch):
    """The dual strategy with a knob of its own, `spin` (0, 1 or 2)."""
    monkeypatch.setitem(STRATEGIES, "dual", SpinningDual())
    return STRATEGIES["dual"]


def _dual(space: Space, value: int) -> BackwardConfig:
    seed = next(c for c in space.seeds() if c.kernel_1.strategy == "dual")
    return space.config({**space.params(seed), "k1.spin": value})


def test_the_space_and_the_sampler_take_the_knob(spin):
    space = Space(FEW, 132)
    assert space.domains()["k1.spin"] == (0, 1, 2)
    cfg = _dual(space, 2)
    assert isinstance(cfg.kernel_1, SpinConfig) and cfg.kernel_1.spin == 2 and space.why_not(cfg) is None
    assert space.params(cfg)["k1.spin"] == 2 and space.config(space.params(cfg)) == cfg
    assert inapplicable("k1.spin", {"k1.strategy": "dual", "k1.two_pass": False}) is None
    assert inapplicable("k1.spin", {"k1.strategy": "rows", "k1.two_pass": False}) is not None
    assert not hasattr(space.config({**space.params(cfg), "k1.strategy": "rows"}).kernel_1, "spin")
    with pytest.raises(ConfigError, match="kernel_1.spin=5 is not allowed"):
        BackwardConfig(SpinConfig(**{**cfg.kernel_1.__dict__, "spin": 5}), cfg.kernel_2).validate(FEW)
    # The enumeration walks the knob: the dual strategy's part of the space (the other strategies' parts are walked
    # by the same loop, in tests/test_space.py).
    walked = {c.kernel_1.spin for c in _DualOnly(Problem("rms_norm", 3, 64, "bf16"), 4)}
    assert walked == {0, 1, 2}


class _DualOnly(Space):
    """The space with the dual strategy only."""

    def domains(self) -> dict:
        return {**super().domains(), "k1.strategy": ("dual",)}


def test_the_seeds_carry_the_knob(spin):
    duals = [c for c in Space(FEW, 132).seeds() if c.kernel_1.strategy == "dual"]
    assert duals and all(type(c.kernel_1) is SpinConfig and c.kernel_1.spin == 0 for c in duals)


H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", key="h100", compute_capability="9.0", sm_count=132,
                  l2_bytes=50 * 2**20, memory_bytes=85_520_809_984, driver="560.35.03", cuda="12.6", torch="2.6.0",
                  triton="3.2.0", normtune="0.1.0", git_revision=None, host="gpu-7", python="3.11.9",
                  interpret=False)


def _ok(us: float) -> MeasureResult:
    return MeasureResult(status="ok", median_us=us, p10_us=us, p90_us=us, reps=10)


def test_the_store_keeps_the_knob_and_upgrades_older_configs(tmp_path, monkeypatch):
    """Configs stored before the knob existed are rewritten with it at its default on the first writing open (one
    transaction, no schema version); a reading open leaves that file as it was."""
    space = Space(FEW, 132)
    plain = next(c for c in space.seeds() if c.kernel_1.strategy == "dual")
    path = tmp_path / "results.db"
    url = f"sqlite:///{path}"
    with Store(url) as s:
        run = s.start_run(H100, kind="sweep", command_line="x")
        s.add_measurement(run, FEW, plain, _ok(5.0), source="sweep")
    monkeypatch.setitem(STRATEGIES, "dual", SpinningDual())
    before = path.read_bytes()
    with pytest.raises(Exception, match="upgrades it in place"):
        Store(url, read_only=True)
    assert path.read_bytes() == before
    reader = Store.for_reading(url)
    try:
        found = reader.measurements()
        assert [m.config.kernel_1.spin for m in found] == [0]
    finally:
        reader.close()
    assert path.read_bytes() == before
    spun = _dual(space, 2)
    with Store(url) as s:
        assert [m.config.kernel_1.spin for m in s.measurements(config=_dual(space, 0))] == [0]
        s.add_measurement(run, FEW, spun, _ok(4.0), source="sweep")
        assert [m.config for m in s.measurements(config=spun)] == [spun]
    con = sqlite3.connect(path)
    stored = sorted(json.loads(j)["kernel_1"]["spin"] for (j,) in con.execute(
        "SELECT config_json FROM normtune_measurements"))
    con.close()
    assert stored == [0, 2]


def test_where_shows_the_knob(spin, tmp_path):
    table = json.loads((ROOT / "configs" / "h100.json").read_text())
    rules = table["families"]["rms_norm/bf16/wbf16/nobias/save-input"]["rules"]
    rule = next(r for r in rules if r["config"]["kernel_1"]["strategy"] == "dual")
    rule["config"]["kernel_1"]["spin"] = 1
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    shape = max(rule["fitted_on"], key=lambda s: int(s.split("x")[0]))
    result = CliRunner().invoke(app, ["where", "--shape", shape, "--gpu", "h100", "--norm", "rms_norm",
                                      "--config-file", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["config"]["kernel_1"]["spin"] == 1


ROWS_OWN = ("two_pass", "recompute", "row_split", "column_accumulators", "pipelined_split")


def test_no_module_outside_the_strategies_reads_a_strategys_own_knob():
    """A config's strategy-specific knobs are read by its strategy's modules only (kernels/strategies/), as
    attributes or as keys of a config's mapping: every other module asks the strategy. The Triton kernels (kernels/backward/, but for the host side) take them as
    compile-time arguments."""
    import ast

    kernels = {"rows.py", "columns.py", "dual.py", "common.py", "reduce.py"}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "docs", "build") or rel.parts[:2] == ("kernels", "strategies"):
            continue
        if rel.parts[:2] == ("kernels", "backward") and rel.name in kernels:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ROWS_OWN and isinstance(node.ctx, ast.Load):
                found.append(f"{rel}:{node.lineno} .{node.attr}")
            if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                    and node.slice.value in ROWS_OWN and isinstance(node.ctx, ast.Load)):
                found.append(f"{rel}:{node.lineno} [{node.slice.value!r}]")
    assert not found, "strategy-specific knobs read outside kernels/strategies/: " + ", ".join(found)


@dataclass(frozen=True)
class MirrorConfig(DualConfig):
    strategy: ClassVar[str] = "mirror"


class Mirror(Dual):
    """A strategy registered under a new name, launching the dual strategy's kernel through a launch module of
    its own name (`mirror_launch`)."""
    name = "mirror"
    config_type = MirrorConfig


def test_a_new_strategy_launches_through_its_own_launch_module_with_no_change_elsewhere(monkeypatch, device):
    """`backward/launch.py` lists no strategy: a strategy registered under a new name is planned by the module
    `strategies/<name>_launch.py`, imported by that name on its first launch."""
    import types

    import torch

    from normtune.kernels.backward.launch import BackwardLaunch
    from normtune.kernels.strategies import dual_launch

    planned = []

    def mirror_plan(problem, config, target, int64, hint):
        planned.append(config.kernel_1.strategy)
        return dual_launch.plan(problem, config, target, int64, hint)

    monkeypatch.setitem(STRATEGIES, "mirror", Mirror())
    monkeypatch.setitem(sys.modules, "normtune.kernels.strategies.mirror_launch",
                        types.SimpleNamespace(plan=mirror_plan))
    problem = Problem("rms_norm", 8, 96, "fp32")
    dual = next(c for c in Space(problem, 4).seeds() if c.kernel_1.strategy == "dual")
    mirror = BackwardConfig(MirrorConfig(**dual.kernel_1.__dict__), dual.kernel_2)
    torch.manual_seed(0)
    grad, saved = torch.randn(8, 96, device=device), torch.randn(8, 96, device=device)
    weight, rstd = 1 + 0.1 * torch.randn(96, device=device), torch.rand(8, device=device) + 0.5
    empty = torch.empty((0,), device=device)
    launches = [BackwardLaunch(problem, c, grad, saved, weight, None, rstd, empty) for c in (dual, mirror)]
    for launch in launches:
        launch.dx.fill_(float("nan"))
        launch.run()
    assert planned == ["mirror"]
    assert torch.equal(launches[0].dx, launches[1].dx) and torch.equal(launches[0].dw, launches[1].dw)
    assert not torch.isnan(launches[1].dx).any()
