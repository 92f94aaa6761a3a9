"""The strategy registry: each strategy declares its knobs once, in its module (a `knob` field of its config type),
closed to the others. A strategy registered with a knob of its own leaves every other strategy's space, seeds,
canonical JSON and store columns as they were; it samples, stores, emits and launches with no change anywhere
else; and it works when registered after the tuner was imported (nothing copies the registry)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import sqlite3
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import BackwardConfig, ConfigError, Problem, kernel_1_config
from normtune.kernels.strategies import STRATEGIES, Strategy, knob, register
from normtune.kernels.strategies.dual import Dual, DualConfig
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.results import MeasureResult
from normtune.tuner.space import Space
from normtune.tuner.store.database import Store
from normtune.tuner.store.models import knob_values
from normtune.tuner.sweep.sampling import Sampling, inapplicable

ROOT = Path(__file__).resolve().parents[1]
FEW = Problem("rms_norm", 64, 1024, "bf16")
BUILT_IN = ("rows", "columns", "dual")


@dataclass(frozen=True)
class MirrorConfig(DualConfig):
    """The dual strategy's knobs and one of its own."""

    mknob: int = knob(0, (0, 1, 2))

    strategy: ClassVar[str] = "mirror"


class Mirror(Dual):
    """A strategy registered under a new name, launching the dual strategy's kernel through a launch module of its
    own name (`mirror_launch`), with a knob of its own (`mknob`, which its plan records)."""

    name = "mirror"
    config_type = MirrorConfig


@pytest.fixture
def registered():
    """Register strategies for one test; the registry is as it was afterwards."""
    before = dict(STRATEGIES)
    yield register
    STRATEGIES.clear()
    STRATEGIES.update(before)


@pytest.fixture
def mirror(monkeypatch):
    """The mirror strategy, not registered yet, with its launch module in place (recording the knob it plans)."""
    planned = []

    def mirror_plan(problem, config, target, int64, hint):
        from normtune.kernels.strategies import dual_launch

        planned.append(config.kernel_1.mknob)
        return dual_launch.plan(problem, config, target, int64, hint)

    monkeypatch.setitem(sys.modules, "normtune.kernels.strategies.mirror_launch",
                        types.SimpleNamespace(plan=mirror_plan))
    strategy = Mirror()
    strategy.planned = planned
    return strategy


H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", key="h100", compute_capability="9.0", sm_count=132,
                  l2_bytes=50 * 2**20, memory_bytes=85_520_809_984, driver="560.35.03", cuda="12.6", torch="2.6.0",
                  triton="3.2.0", normtune="0.1.0", git_revision=None, host="gpu-7", python="3.11.9",
                  interpret=False)


def _ok(us: float) -> MeasureResult:
    return MeasureResult(status="ok", median_us=us, p10_us=us * 0.99, p90_us=us * 1.01, reps=10)


@dataclass(frozen=True)
class _Only(Space):
    """The space of one strategy's configs only."""

    only: str = "rows"

    def offered(self) -> tuple[str, ...]:
        return (self.only,)

    def domains(self, strategy: str | None = None) -> dict:
        return {**super().domains(strategy or self.only), "k1.strategy": (self.only,)}


def _stored_columns(path: Path, configs: list[BackwardConfig]) -> tuple:
    """The measurements' columns of a fresh database and each stored config's row (but its id and time)."""
    with Store(f"sqlite:///{path}") as store:
        run = store.start_run(H100, kind="sweep", command_line="x")
        for config in configs:
            store.add_measurement(run, FEW, config, _ok(5.0), source="sweep")
    con = sqlite3.connect(path)
    try:
        cursor = con.execute("SELECT * FROM normtune_measurements ORDER BY id")
        names = [d[0] for d in cursor.description]
        rows = [{n: v for n, v in zip(names, row) if n not in ("id", "created_at")} for row in cursor]
    finally:
        con.close()
    return names, rows


def _snapshot(tmp_path: Path, tag: str) -> dict:
    """What the built-in strategies' configs are: their part of the space (domains, size, the first configs
    enumerated), their seeds and params, their canonical JSON, their knob columns, and their stored rows."""
    space = Space(FEW, 132)
    tiny = Problem("rms_norm", 3, 64, "bf16")
    out = {}
    seeds = space.seeds()
    for name in BUILT_IN:
        mine = [c for c in seeds if c.kernel_1.strategy == name]
        enumerated = itertools.islice(_Only(tiny, 4, only=name), 200)
        out[name] = {
            "domains": {k: repr(v) for k, v in space.domains(name).items() if k != "k1.strategy"},
            "raw_size": _Only(tiny, 4, only=name).raw_size(),
            "enumerated": [c.to_json() for c in enumerated],
            "seeds": [c.to_json() for c in mine],
            "params": [repr(space.params(c)) for c in mine],
            "described": [str(c) for c in mine],
            "columns": [repr(knob_values(c)) for c in mine],
        }
        assert mine, f"no {name} seed on {FEW.key}: the snapshot would hold nothing"
    out["stored"] = _stored_columns(tmp_path / f"{tag}.db", [c for c in seeds if c.kernel_1.strategy in BUILT_IN])
    return out


def test_a_new_strategys_knob_leaves_every_other_strategy_as_it_was(tmp_path, mirror, registered):
    """A strategy registered with a knob of its own: the built-in strategies' space, seeds, JSON and store columns
    are byte-identical to before it, and none of their configs may name its knob."""
    before = _snapshot(tmp_path, "before")
    registered(mirror)
    after = _snapshot(tmp_path, "after")
    assert after == before
    for name in BUILT_IN:
        with pytest.raises(ConfigError, match="kernel_1.mknob=0 is a knob of strategy='mirror'"):
            kernel_1_config(strategy=name, mknob=0)


def test_a_new_strategy_samples_its_knob(mirror, registered):
    """Its part of the space walks the knob; the sampler draws it for its trials only."""
    import optuna

    registered(mirror)
    space = Space(FEW, 132)
    assert space.domains("mirror")["k1.mknob"] == (0, 1, 2) and "mirror" in space.offered()
    assert {c.kernel_1.mknob for c in itertools.islice(_Only(Problem("rms_norm", 3, 64, "bf16"), 4, only="mirror"),
                                                      300)} == {0, 1, 2}
    sampling = Sampling("random", space, seed=0)
    study = optuna.create_study(sampler=sampling.sampler)
    drawn = {name: [] for name in space.offered()}
    for _ in range(60):
        values, _ = sampling.propose(study)
        drawn[values["k1.strategy"]].append(values)
    assert drawn["mirror"] and all("k1.mknob" in v for v in drawn["mirror"])
    assert all("k1.mknob" not in v for name in BUILT_IN for v in drawn[name])
    assert {space.config(v).kernel_1.mknob for v in drawn["mirror"]} == {0, 1, 2}
    seed = next(c for c in space.seeds() if c.kernel_1.strategy == "mirror")
    spun = space.config({**space.params(seed), "k1.mknob": 2})
    assert space.why_not(spun) is None and space.config(space.params(spun)) == spun
    assert BackwardConfig.from_json(spun.to_json()) == spun and '"mknob":2' in spun.to_json()
    assert '"mknob"' not in seed.to_json()  # at its default: configs written before it keep their bytes


def test_a_new_strategy_stores_and_emits(tmp_path, mirror, registered):
    """Its configs are stored (its knob in the JSON where not at its default, in no column) and found again, a
    compacted copy rebuilds the one its columns describe, and a table fitted on them names it and its knob."""
    from normtune.tuner.tables import emit
    from normtune.tuner.upkeep.kept_subset import blank_described_configs

    registered(mirror)
    space = Space(FEW, 132)
    seed = next(c for c in space.seeds() if c.kernel_1.strategy == "mirror")
    spun = space.config({**space.params(seed), "k1.mknob": 2})
    path = tmp_path / "mirror.db"
    names, rows = _stored_columns(path, [seed, spun])
    assert not any("mknob" in n for n in names)
    assert [r["k1_strategy"] for r in rows] == ["mirror", "mirror"]
    assert [json.loads(r["config_json"])["kernel_1"].get("mknob") for r in rows] == [None, 2]
    with Store(f"sqlite:///{path}") as store:
        assert [m.config for m in store.measurements(config=spun)] == [spun]
    con = sqlite3.connect(path)
    try:
        assert blank_described_configs(con) == 1  # the seed's columns describe it; spun's knob is in its JSON only
    finally:
        con.close()
    with Store(f"sqlite:///{path}", read_only=True) as store:
        assert [m.config for m in store.measurements()] == [seed, spun]

    with Store(f"sqlite:///{tmp_path / 'emit.db'}") as store:
        run = store.start_run(H100, kind="sweep", command_line="normtune sweep")
        for M in (32, 64):
            problem = FEW.with_shape(M, FEW.N)
            fast = space.config({**Space(problem, 132).params(seed), "k1.mknob": 1})
            store.add_measurement(run, problem, fast, _ok(4.0), source="sweep")
            store.add_measurement(run, problem, Space(problem, 132).seeds()[0], _ok(9.0), source="sweep")
        store.end_run(run)
        table = emit.build_table(store, "h100")
    (rule,) = table["families"][FEW.family.key]["rules"]
    assert rule["config"]["kernel_1"]["strategy"] == "mirror" and rule["config"]["kernel_1"]["mknob"] == 1
    assert BackwardConfig.from_dict(rule["config"]).kernel_1.mknob == 1


def test_a_new_strategy_launches_through_its_own_module(mirror, registered, device):
    """Its plan is its own launch module's (imported by name on its first launch, `backward_launch.py` lists no
    strategy), with its knob; the result passes the gate against the float64 reference."""
    import torch

    from normtune.kernels.device import sm_count
    from normtune.tuner.measure.harness import make_case, measure_config

    registered(mirror)
    problem = Problem("rms_norm", 8, 96, "fp32")
    small = Space(problem, sm_count(torch.device(device)))
    config = small.config({**small.params(next(c for c in small.seeds() if c.kernel_1.strategy == "mirror")),
                           "k1.mknob": 2})
    case = make_case(problem, device, seed=1)
    result = measure_config(case, config, flusher=None, bandwidth_gbps=1000.0, reference_grads=case.reference(),
                            warmup=0, min_reps=1, max_reps=1, budget_s=0.0)
    assert result.status == "ok", result.error
    assert mirror.planned and set(mirror.planned) == {2}


def test_a_strategy_registered_after_the_tuner_was_imported_works(registered):
    """The space, the sampler, the store's columns and the JSON read the registry when used: a strategy registered
    now (the tuner's modules were imported with this file) is offered, drawn, parsed and stored."""
    import optuna

    import normtune.tuner.space as space_module
    import normtune.tuner.store.models as models

    assert "mirror" not in space_module.Space(FEW, 132).offered()
    registered(Mirror())
    space = space_module.Space(FEW, 132)
    assert "mirror" in space.offered() and "k1.mknob" in space.domains()
    assert inapplicable("k1.mknob", {"k1.strategy": "mirror"}) is None
    assert inapplicable("k1.mknob", {"k1.strategy": "rows", "k1.two_pass": False}) is not None
    sampling = Sampling("random", space, seed=1)
    study = optuna.create_study(sampler=sampling.sampler)
    strategies = {sampling.propose(study)[0]["k1.strategy"] for _ in range(40)}
    assert "mirror" in strategies
    config = BackwardConfig.from_json(BackwardConfig(kernel_1_config(strategy="mirror", mknob=1,
                                                                     block_col=1024)).to_json())
    assert type(config.kernel_1) is MirrorConfig and config.kernel_1.mknob == 1
    assert models.knob_values(config)["k1_strategy"] == "mirror"
    assert models.config_from_columns(models.knob_values(BackwardConfig(MirrorConfig(block_col=1024)))) \
        == BackwardConfig(MirrorConfig(block_col=1024))


def test_registering_checks_the_declaration(registered):
    @dataclass(frozen=True)
    class Undeclared(DualConfig):
        loose: int = 0
        strategy: ClassVar[str] = "loose"

    class Loose(Dual):
        name, config_type = "loose", Undeclared

    with pytest.raises(ConfigError, match="Undeclared.loose has no search domain"):
        registered(Loose())

    @dataclass(frozen=True)
    class Clash(DualConfig):
        row_split: int = knob(1, (1, 2))
        strategy: ClassVar[str] = "clash"

    class Clashing(Dual):
        name, config_type = "clash", Clash

    with pytest.raises(ConfigError, match="knob row_split is already a knob of strategy 'rows'"):
        registered(Clashing())

    class Misnamed(Dual):
        name = "misnamed"

    with pytest.raises(ConfigError, match="strategy: ClassVar\\[str\\] = 'misnamed'"):
        registered(Misnamed())
    assert set(STRATEGIES) == set(BUILT_IN)


def test_the_contract_is_narrow_and_no_strategy_restates_anothers_knobs():
    """Few methods every strategy must define (the rest are hooks with defaults); the strategies' modules name no
    knob of another strategy (as a string or an attribute), and a strategy missing a required method is refused
    when built."""
    required = Strategy.__abstractmethods__
    assert len(required) < 10, sorted(required)
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (Strategy,), {"name": "half", "validate": lambda *a: None})()
    owned = {name: {k.name for k in STRATEGIES[name].knobs} for name in BUILT_IN}
    for name in BUILT_IN:
        others = set().union(*(owned[o] for o in BUILT_IN if o != name))
        tree = ast.parse((ROOT / "kernels" / "strategies" / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= {k for k in others if node.value in (k, f"k1.{k}")}
            elif isinstance(node, ast.Attribute):
                found |= {node.attr} & others
            elif isinstance(node, ast.keyword):
                found |= {node.arg} & others
        assert not found, f"{name}.py restates knobs of another strategy: {sorted(found)}"


@dataclass(frozen=True)
class SpinConfig(DualConfig):
    spin: int = knob(0, (0, 1, 2))


class SpinningDual(Dual):
    config_type = SpinConfig


def test_a_knob_added_to_a_strategy_rewrites_no_stored_row(tmp_path, registered):
    """A knob declared on the dual strategy after its configs were stored: the stored rows keep their bytes (their
    JSON is the canonical JSON of the knob at its default), read and look up as the knob's default, and a reading
    open works without an upgrade."""
    space = Space(FEW, 132)
    plain = next(c for c in space.seeds() if c.kernel_1.strategy == "dual")
    path = tmp_path / "results.db"
    url = f"sqlite:///{path}"
    with Store(url) as s:
        run = s.start_run(H100, kind="sweep", command_line="x")
        s.add_measurement(run, FEW, plain, _ok(5.0), source="sweep")
    con = sqlite3.connect(path)
    stored = con.execute("SELECT * FROM normtune_measurements").fetchall()
    con.close()
    registered(SpinningDual())
    reader = Store(url, read_only=True)
    try:
        assert [m.config.kernel_1.spin for m in reader.measurements()] == [0]
    finally:
        reader.close()
    spun = space.config({**space.params(next(c for c in space.seeds() if c.kernel_1.strategy == "dual")),
                         "k1.spin": 2})
    with Store(url) as s:
        assert [m.config.kernel_1.spin for m in s.measurements(config=dataclasses.replace(
            spun, kernel_1=dataclasses.replace(spun.kernel_1, spin=0)))] == [0]
        s.add_measurement(run, FEW, spun, _ok(4.0), source="sweep")
        assert [m.config for m in s.measurements(config=spun)] == [spun]
    con = sqlite3.connect(path)
    rows = con.execute("SELECT * FROM normtune_measurements ORDER BY id").fetchall()
    texts = [t for (t,) in con.execute("SELECT config_json FROM normtune_measurements ORDER BY id")]
    con.close()
    assert rows[0] == stored[0]
    assert texts[0] == plain.to_json() and [json.loads(t)["kernel_1"].get("spin") for t in texts] == [None, 2]


def test_where_shows_the_knob(registered, tmp_path):
    registered(SpinningDual())
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


def test_no_module_outside_the_strategies_reads_a_strategys_own_knob():
    """A config's strategy-specific knobs are read by its strategy's modules only (kernels/strategies/), as
    attributes or as keys of a config's mapping: every other module asks the strategy. The Triton kernels
    (kernels/backward/, but for the host side) take them as compile-time arguments."""
    own = {k.name for s in STRATEGIES.values() for k in s.knobs}
    kernels = {"rows.py", "columns.py", "dual.py", "common.py", "reduce.py"}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "docs", "build") or rel.parts[:2] == ("kernels", "strategies"):
            continue
        if any(part.startswith(".") for part in rel.parts):  # a local virtualenv or scratch copy, not the package
            continue
        if rel.parts[:2] == ("kernels", "backward") and rel.name in kernels:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in own and isinstance(node.ctx, ast.Load):
                found.append(f"{rel}:{node.lineno} .{node.attr}")
            if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                    and node.slice.value in own and isinstance(node.ctx, ast.Load)):
                found.append(f"{rel}:{node.lineno} [{node.slice.value!r}]")
    assert not found, "strategy-specific knobs read outside kernels/strategies/: " + ", ".join(found)


def test_the_built_in_strategies_keep_the_flat_layout_the_shipped_tables_hold():
    """The rows, columns and dual configs state the rows strategy's knobs of the flat layout (frozen: the rows
    strategy's own, at their defaults where the strategy lacks them): every shipped rule reads back to its bytes."""
    from normtune.kernels.strategies.configs import FLAT_LAYOUT

    assert FLAT_LAYOUT == {k.name: k.default for k in STRATEGIES["rows"].knobs}
    seen = set()
    for name in ("h100", "h200"):
        table = json.loads((ROOT / "configs" / f"{name}.json").read_text())
        for family in table["families"].values():
            for rule in family["rules"]:
                config = BackwardConfig.from_dict(rule["config"])
                assert config.to_dict() == rule["config"]
                assert config.to_json() == json.dumps(rule["config"], sort_keys=True, separators=(",", ":"))
                seen.add(config.kernel_1.strategy)
    assert seen == set(BUILT_IN)
