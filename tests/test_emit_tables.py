"""Emitting heuristic tables (`normtune.tuner.tables.emit`) from stored measurements, and the runtime side that reads them
(`normtune.kernels.select.tables`, `normtune.kernels.select.select`): determinism, rule fitting, lookup for any
shape, the table-for-this-GPU chain with its one-time warnings, refusal of malformed tables, the `emit` CLI, and the
committed tables.

Fitting is tested on hand-made measurements replayed from a SQLite store (no kernel runs); the CLI test runs a
tiny interpreter sweep first.
"""

from __future__ import annotations

import dataclasses
import re
import json
import math
import warnings
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.select import table_chain, tables
from normtune.kernels.config import (MAX_N, BackwardConfig, Kernel1Config, Kernel2Config, Problem, ProblemFamily,
                                     default_config, kernel_1_config)
from normtune.kernels.device import gpu_key, interpret_mode
from normtune.kernels.select.select import clear_caches, select_config
from normtune.kernels.select.table_chain import ENV_VAR, HOME_VAR, table_for
from normtune.kernels.select.tables import SCHEMA_VERSION, TableError, adapt, load_table, parse_table
from normtune.tuner.tables import emit, fit
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.measure.spread import Timing
from normtune.tuner.store.database import Store

CONFIGS = Path(str(resources.files("normtune.configs")))
H100_NAME = "NVIDIA H100 80GB HBM3"

# A made-up GPU (its key is a slug of the name), with few SMs so that lookups never shrink the fitted row tiles.
GPU = DeviceInfo(name="NVIDIA Test GPU X1", key=gpu_key("NVIDIA Test GPU X1"), compute_capability="9.0",
                 sm_count=8, l2_bytes=50 * 2**20, memory_bytes=80 * 2**30, driver="560.35.03", cuda="12.6",
                 torch="2.6.0", triton="3.2.0", normtune="0.1.0", git_revision="0123abcd", host="gpu-7",
                 python="3.11.9", interpret=False)
OTHER_GPU = dataclasses.replace(GPU, name="NVIDIA H200", key="h200")
INTERP = dataclasses.replace(GPU, name="cpu (triton interpreter)", key="interpret", compute_capability=None,
                             sm_count=4, driver=None, cuda=None, interpret=True)

LN = ProblemFamily("layer_norm", "bf16", "bf16", True, True, False, "input")
RMS = ProblemFamily("rms_norm", "bf16", "bf16", True, False, False, "input")
NS = (256, 1024, 4096)
MS = (64, 512, 4096)


def k1(N: int, **knobs) -> Kernel1Config:
    return kernel_1_config(**({"block_row": 1, "block_col": N, "num_warps": 4, "programs_per_sm": 1,
                             "eviction_policy": "evict_first"} | knobs))


def candidates(N: int) -> dict[str, BackwardConfig]:
    """Three configs per N, all valid for rows of N."""
    return {"A": BackwardConfig(k1(N), Kernel2Config(128, 16, 4)),
            "B": BackwardConfig(k1(N, num_warps=8, programs_per_sm=2), Kernel2Config(64, 32, 4)),
            "C": BackwardConfig(k1(N, prefetch=True), Kernel2Config(32, 64, 2))}


def factor(name: str, N: int, M: int) -> float:
    """Relative speed: N=256, A best everywhere; N=1024, A best up to M=512 and B beyond by 2x; N=4096, C best."""
    if N == 256:
        return {"A": 1.0, "B": 1.2, "C": 1.5}[name]
    if N == 1024:
        return {"A": 1.0 if M <= 512 else 2.0, "B": 2.0 if M <= 512 else 1.0, "C": 3.0}[name]
    return {"A": 1.3, "B": 1.4, "C": 1.0}[name]


def base_us(M: int, N: int) -> float:
    return 5.0 + M * N * 6 / 3e6


def ok(median: float) -> MeasureResult:
    return MeasureResult(status="ok", median_us=median, p10_us=median * 0.98, p90_us=median * 1.02, reps=20,
                         kernel_1_us=median * 0.8, kernel_2_us=median * 0.2, programs=8)


def fill(store: Store) -> dict:
    """The replayed sweep, plus measurements that must never reach the table."""
    run = store.start_run(GPU, kind="sweep", command_line="normtune sweep --gpu test-gpu-x1")
    expected = {}
    for family in (LN, RMS):
        for N in NS:
            for M in MS:
                problem = family.problem(M, N)
                for name, cfg in candidates(N).items():
                    t = round(base_us(M, N) * factor(name, N, M), 3)
                    store.add_measurement(run, problem, cfg, ok(t), source="sweep")
                    expected[(family.key, M, N, name)] = t
                # Repeats of A are reduced by their median: 1.1x and 0.9x around the first.
                a = expected[(family.key, M, N, "A")]
                for f in (1.1, 0.9):
                    store.add_measurement(run, problem, candidates(N)["A"], ok(round(a * f, 3)), source="sweep")
                # A wrong result timed very fast must be ignored.
                fast_but_wrong = BackwardConfig(k1(N, num_warps=2), Kernel2Config(128, 8, 1))
                store.add_measurement(run, problem, fast_but_wrong,
                                      MeasureResult(status="incorrect", median_us=0.01, error="dx relative error"),
                                      source="sweep")
    store.end_run(run)
    # Another GPU and the interpreter measured a config that would win everything.
    winner = lambda N: BackwardConfig(k1(N, num_stages=2), Kernel2Config(32, 8, 1))  # noqa: E731
    for info in (OTHER_GPU, INTERP):
        other = store.start_run(info, kind="sweep", command_line="other")
        for N in NS:
            store.add_measurement(other, LN.problem(64, N), winner(N),
                                  dataclasses.replace(ok(0.001), interpret=info.interpret), source="sweep")
        store.end_run(other)
    return expected


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("emit") / "results.db"
    store = Store(f"sqlite:///{path}")
    expected = fill(store)
    store.close()
    return f"sqlite:///{path}", expected


@pytest.fixture(scope="module")
def table(db):
    store = Store(db[0])
    try:
        return emit.build_table(store, GPU.key)
    finally:
        store.close()


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch, tmp_path):
    """Every test starts with no $NORMTUNE_CONFIG, an empty user dir, no loaded tables and no warnings given."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv(HOME_VAR, str(tmp_path / "normtune-home"))
    clear_caches()
    yield
    clear_caches()


# ------------------------------------------------------------------------------------------ emitted table


def test_emitted_table_is_deterministic(db, table):
    url, _ = db
    first = emit.dumps(table)
    store = Store(url)
    try:
        assert emit.dumps(emit.build_table(store, GPU.key)) == first
    finally:
        store.close()
    again = Store(url)  # a fresh process would open it like this
    try:
        assert emit.dumps(emit.build_table(again, GPU.key)) == first
    finally:
        again.close()
    assert first.endswith("\n") and json.loads(first) == table
    assert first == json.dumps(json.loads(first), indent=1, sort_keys=True) + "\n"


def test_emitted_table_parses_with_schema_gpu_and_provenance(db, table):
    _, expected = db
    assert table["schema_version"] == SCHEMA_VERSION
    assert table["interpret"] is False
    assert table["gpu"] == {"name": GPU.name, "key": GPU.key, "compute_capability": "9.0", "sm_count": 8}
    prov = table["provenance"]
    assert prov["runs"] == [1]  # the other GPU's and the interpreter's runs are not its provenance
    assert prov["torch"] == ["2.6.0"] and prov["triton"] == ["3.2.0"] and prov["normtune"] == ["0.1.0"]
    assert prov["git_revision"] == ["0123abcd"] and prov["driver"] == ["560.35.03"]
    assert len(prov["date"]) == 10 and prov["date"][4] == "-"
    # distinct (problem, config) pairs that measured ok: 3 candidates x 9 shapes x 2 families
    assert prov["configs_measured"] == 3 * 9 * 2
    # ok measurements fitted on: 5 per (family, shape) (A three times, B, C), never the incorrect one
    assert prov["measurements"] == 5 * 9 * 2 and prov["fingerprint"].startswith("sha256:")
    parsed = parse_table(json.loads(emit.dumps(table)), "emitted.json")
    assert parsed.gpu_name == GPU.name and parsed.gpu_key == GPU.key and parsed.sm_count == 8
    assert set(parsed.families) == {LN.key, RMS.key}
    for family in (LN, RMS):
        fam = table["families"][family.key]
        assert set(fam["expected_us"]) == {f"{M}x{N}" for M in MS for N in NS}
        assert set(fam["fit_regret"]) == set(fam["expected_us"])
        assert all(r >= 1.0 for r in fam["fit_regret"].values())
        assert fam["single_pass_max_n"] == max(NS)
        # expected_us is the measured time of the config the rule chose (A's median of its three repeats).
        assert fam["expected_us"]["64x256"] == pytest.approx(expected[(family.key, 64, 256, "A")], abs=0.01)
        assert fam["expected_us"]["4096x4096"] == pytest.approx(expected[(family.key, 4096, 4096, "C")], abs=0.01)


def _rules(table, family, n_max):
    return [r for r in table["families"][family.key]["rules"] if r["n_max"] == n_max]


@pytest.mark.parametrize("family", [LN, RMS], ids=lambda f: f.norm)
def test_one_rule_where_one_config_wins_every_m(table, family):
    (rule,) = _rules(table, family, 256)
    assert rule["m_max"] is None
    assert BackwardConfig.from_dict(rule["config"]) == candidates(256)["A"]
    assert rule["fitted_on"] == ["64x256", "512x256", "4096x256"]
    (last,) = _rules(table, family, None)  # the widest bucket is open above
    assert BackwardConfig.from_dict(last["config"]) == candidates(4096)["C"]
    assert all(table["families"][family.key]["fit_regret"][f"{M}x{N}"] == 1.0 for M in MS for N in (256, 4096))


@pytest.mark.parametrize("family", [LN, RMS], ids=lambda f: f.norm)
def test_two_rules_where_m_splits_clearly(table, family):
    small, large = _rules(table, family, 1024)
    assert small["m_max"] == 1448 and large["m_max"] is None  # isqrt(512 * 4096): halfway on a log scale
    assert BackwardConfig.from_dict(small["config"]) == candidates(1024)["A"]
    assert BackwardConfig.from_dict(large["config"]) == candidates(1024)["B"]
    assert small["fitted_on"] == ["64x1024", "512x1024"] and large["fitted_on"] == ["4096x1024"]
    parsed = parse_table(table)
    assert parsed.lookup(family.problem(100, 1008)) == candidates(1024)["A"]
    assert parsed.lookup(family.problem(1448, 1024)) == candidates(1024)["A"]
    assert parsed.lookup(family.problem(1449, 1024)) == candidates(1024)["B"]
    assert parsed.lookup(family.problem(4096, 608)) == candidates(1024)["B"]
    # Fitted on widths that are multiples of 16 only, the rules do not answer for other widths: the default.
    for N in (1000, 600):
        match = parsed.match(family.problem(100, N))
        assert match.config is None and "not a multiple of 16" in match.reason(family.problem(100, N))
    # Outside the box of fitted shapes (M 64..4096, N 256..4096) the table does not extrapolate: the default.
    assert parsed.fitted[family.key] == (64, 4096, 256, 4096)
    assert parsed.lookup(family.problem(2**20, 600)) is None and parsed.lookup(family.problem(64, 200)) is None
    # A rule's config adapted to narrower rows keeps its tile shape, at the row width.
    got = adapt(candidates(256)["A"], family.problem(64, 200))
    assert got.kernel_1 == dataclasses.replace(candidates(256)["A"].kernel_1, block_col=256)


def test_a_split_rule_keeps_its_tile_on_other_widths():
    """A split rule on another width keeps its split while the slices fit the rule's tile, else takes the next
    split that does (3 slices of 4096 at 12288 columns → 4 at 12800), rather than doubling the tile."""
    rule = BackwardConfig(kernel_1_config(block_row=2, block_col=4096, num_warps=16, recompute=True, row_split=3,
                                        column_accumulators=True), Kernel2Config(block_m=128, block_n=32, pdl=True))
    same = adapt(rule, Problem("layer_norm", 4096, 10240, "bf16", has_bias=True))
    assert same.kernel_1 == rule.kernel_1 and same.kernel_2 == rule.kernel_2
    wider = adapt(rule, Problem("layer_norm", 4096, 12800, "bf16", has_bias=True))
    assert wider.kernel_1 == dataclasses.replace(rule.kernel_1, row_split=4)


def test_a_pipelined_split_rule_on_rows_too_narrow_to_split_runs_them_whole():
    """A rule whose split row's exchange is pipelined keeps it wherever the row still splits; on a row whose
    slices would be under 256 columns it runs the whole row in one program, unpipelined (nothing to exchange),
    rather than the analytic default."""
    rule = BackwardConfig(kernel_1_config(block_row=1, block_col=8192, num_warps=16, num_stages=3, row_split=2,
                                        eviction_policy="evict_first", pipelined_split=True),
                          Kernel2Config(block_m=128, block_n=16))
    wide = Problem("layer_norm", 2048, 12288, "bf16", has_bias=True)
    assert adapt(rule, wide).kernel_1 == dataclasses.replace(rule.kernel_1, block_col=8192)
    narrow = Problem("layer_norm", 2048, 400, "bf16", has_bias=True)
    got = adapt(rule, narrow)
    assert got != default_config(narrow)
    assert (got.kernel_1.row_split, got.kernel_1.pipelined_split, got.kernel_1.num_stages) == (1, False, 3)
    got.validate(narrow)


def test_a_split_rule_is_checked_on_its_fitted_shapes_not_its_bounds():
    """A 3-slice rule fitted at 12288 columns whose range reaches 14188 (halfway to the next fitted width) loads:
    it runs the shapes it was fitted on, and a lookup at 14080 adapts it (4 slices of 4096). A config that cannot
    run its own fitted shape is refused."""
    data = _valid()
    rule = BackwardConfig(kernel_1_config(block_row=4, block_col=4096, num_warps=16, recompute=True, row_split=3,
                                        column_accumulators=True), Kernel2Config(block_m=128, block_n=32, pdl=True))
    family = data["families"]["layer_norm/bf16/wbf16/bias/save-input"]
    at = next(i for i, r in enumerate(family["rules"]) if r["n_max"] == 13272 and r["m_max"] is None)
    family["rules"][at] = {"n_max": 14188, "m_max": None, "config": rule.to_dict(), "fitted_on": ["4096x12288"]}
    parsed = parse_table(data)
    got = parsed.lookup(Problem("layer_norm", 4096, 14080, "bf16", has_bias=True))
    assert got.kernel_1 == dataclasses.replace(rule.kernel_1, row_split=4)
    got.validate(Problem("layer_norm", 4096, 14080, "bf16", has_bias=True))
    family["rules"][at]["fitted_on"] = ["4096x14188"]
    with pytest.raises(TableError, match=rf"rule {at}: kernel_1.block_col=4096 does not cover a 1/3 slice"):
        parse_table(data)


def test_a_dual_rule_adapts_like_single_pass_and_stops_where_dual_does():
    """A dual rule (row programs hold whole rows) re-tiles its rows to the width and keeps its column tile; past
    one pass or past MAX_COLUMNS_ROWS rows (the column programs sweep every row) it gives way to the default."""
    dual = BackwardConfig(kernel_1_config(block_row=2, block_col=4096, num_warps=16, prefetch=True, strategy="dual"),
                          Kernel2Config(block_m=32, block_n=64, num_warps=1))
    got = adapt(dual, Problem("rms_norm", 100, 3000, "bf16"))
    assert got.kernel_1 == dataclasses.replace(dual.kernel_1, block_col=4096) and got.kernel_2 == dual.kernel_2
    narrow = adapt(dual, Problem("rms_norm", 100, 40, "bf16"))
    assert narrow.kernel_1.strategy == "dual" and narrow.kernel_1.block_col == 64 and narrow.kernel_2.block_n == 64
    for problem in (Problem("rms_norm", 100, 20000, "bf16"), Problem("rms_norm", 4096, 3000, "bf16")):
        assert adapt(dual, problem) == default_config(problem)


def T(median: float, spread: float = 0.01) -> Timing:
    """A pooled time with a ±`spread` (relative) p10-p90 range."""
    return Timing(median, median * (1 - spread), median * (1 + spread))


def test_split_needs_a_real_gain():
    """A split that gains less than SPLIT_GAIN keeps one rule: rules that generalize beat rules that memorize."""
    probs = [RMS.problem(M, 1024) for M in MS]
    a, b = candidates(1024)["A"], candidates(1024)["B"]
    close = {p: {a: T(10.0), b: T(10.0 + (0.04 if p.M < 4096 else -0.04))} for p in probs}
    assert len(fit.fit_family(RMS, close).rules) == 1
    far = {p: {a: T(10.0), b: T(15.0 if p.M < 4096 else 5.0)} for p in probs}
    rules = fit.fit_family(RMS, far).rules
    # the lower rule ends where a's and b's times cross between the two neighbouring rows, on a log-log line
    lo, hi = max(M for M in MS if M < 4096), min(M for M in MS if M >= 4096)
    cross = lo * (hi / lo) ** (math.log(10 / 15) / (math.log(10 / 15) - math.log(10 / 5)))
    assert [r["m_max"] for r in rules] == [int(cross), None]


def test_a_config_that_only_ties_with_the_default_gives_way_to_it():
    """A knob leaves its analytic value only where that pays more than DEFAULT_TIE on some fitted problem."""
    probs = [RMS.problem(M, 1024) for M in MS]
    default = default_config(probs[0])
    assert all(default_config(p) == default for p in probs)
    a = candidates(1024)["A"]
    assert a != default
    defaults = {p: default for p in probs}
    tie = {p: {a: T(10.0), default: T(10.0 * (1 + fit.DEFAULT_TIE / 2))} for p in probs}
    assert [BackwardConfig.from_dict(r["config"]) for r in fit.fit_family(RMS, tie, defaults).rules] == [default]
    gain = {p: {a: T(10.0), default: T(10.05 if p.M < 4096 else 10.5)} for p in probs}
    assert [BackwardConfig.from_dict(r["config"]) for r in fit.fit_family(RMS, gain, defaults).rules] == [a]


def test_neighbour_plan_completes_each_bucket_and_borrows_from_the_next():
    """Each problem's measured configs are planned on the other problems of its N bucket, and the top two of the
    two nearest buckets on each side adapted to this N; measured pairs are never planned again."""
    from normtune.tuner.tables.remeasure import neighbour_plan

    a, b, c = (candidates(1024)[k] for k in "ABC")
    small, large, wide = RMS.problem(64, 1024), RMS.problem(4096, 1024), RMS.problem(64, 4096)
    wide_a, wide_c = candidates(4096)["A"], candidates(4096)["C"]
    data = {small: {a: T(1.0)}, large: {b: T(2.0), c: T(3.0)}, wide: {wide_c: T(1.0), wide_a: T(2.0)}}
    plan = set(neighbour_plan(data))
    assert {(large, a), (small, b), (small, c)} <= plan
    assert all(cfg not in data[p] for p, cfg in plan)
    assert (wide, adapt(b, wide)) in plan and (small, adapt(wide_c, small)) in plan
    # two buckets away too: the narrowest bucket's best reaches the widest past the one between
    widest = RMS.problem(64, 16384)
    far = BackwardConfig(candidates(1024)["A"].kernel_1, Kernel2Config(64, 32, 2))  # its reduction measured there alone
    data[widest] = {far: T(1.0)}
    assert not any(cfg.kernel_2 == far.kernel_2 for p, cfg in plan)
    plan = set(neighbour_plan(data))
    assert (large, adapt(far, large)) in plan and adapt(far, large).kernel_2 == far.kernel_2


def test_no_config_measured_everywhere_gives_each_problem_its_own_rule():
    a, b = candidates(512)["A"], candidates(512)["B"]
    data = {RMS.problem(64, 512): {a: T(3.0)}, RMS.problem(4096, 512): {b: T(9.0)}}
    fitted = fit.fit_family(RMS, data)
    assert [(r["m_max"], BackwardConfig.from_dict(r["config"])) for r in fitted.rules] == [(512, a), (None, b)]


def test_build_table_without_measurements_says_what_to_run(db):
    store = Store(db[0])
    try:
        with pytest.raises(ValueError, match="no successful measurements for h100 in the selected runs.*normtune sweep "
                                             "--gpu h100"):
            emit.build_table(store, "h100")
        interp = emit.build_table(store, "interpret", interpret=True)  # only the interpreter's measurements
        assert interp["interpret"] is True and set(interp["families"]) == {LN.key}
        assert parse_table(interp).interpret
    finally:
        store.close()


# --------------------------------------------------------------------------------- lookup for every shape


def _shipped(name: str) -> tables.Table:
    return load_table(str(CONFIGS / name))


ABSENT = [
    ProblemFamily("layer_norm", "bf16", "fp32", True, False, False, "output"),  # closest: LayerNorm bf16
    ProblemFamily("rms_norm", "bf16", "bf16", True, False, True, "output"),  # zero-centered, saving y
    ProblemFamily("rms_norm", "bf16", "bf16", False, False, False, "input"),  # no weight at all
    ProblemFamily("rms_norm", "fp16", "fp16", True, False, False, "input"),  # stand-in: RMSNorm bf16
    ProblemFamily("layer_norm", "fp32", "fp32", True, True, False, "input"),  # stand-in, other element size
]


@settings(derandomize=True, database=None, max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(M=st.integers(0, 2**20), N=st.integers(1, MAX_N), family=st.sampled_from([LN, RMS, *ABSENT]),
       which=st.sampled_from(["emitted", "h100.json", "h200.json"]))
def test_lookup_always_returns_a_valid_config(table, M, N, family, which):
    tab = parse_table(table, "emitted") if which == "emitted" else _shipped(which)
    problem = family.problem(M, N)
    match = tab.match(problem)
    config = tab.lookup(problem)
    assert (config is not None) == (tab.covers(problem) and match.refused is None), \
        "the closest family answers inside its fitted box unless its rule does not carry over to the dtype"
    (config or default_config(problem)).validate(problem)
    for rule in tab.rules(family):
        adapt(rule.config, problem, tab.sm_count).validate(problem)
        adapt(rule.config, problem).validate(problem)


@settings(derandomize=True, database=None, max_examples=60, deadline=None)
@given(M=st.integers(1, 2**20), N=st.integers(1, MAX_N), norm=st.sampled_from(["layer_norm", "rms_norm"]),
       which=st.sampled_from(["h100.json", "h200.json"]))
def test_fp16_takes_the_bf16_rules(M, N, norm, which):
    """The shipped tables hold bf16 only: fp16 (the same element size) reads the bf16 family's rule for the
    shape, adapted and validated for fp16, and gets the same launch as bf16, recompute included (it widens the
    packed fp16 tile again as it does bf16's)."""
    tab = _shipped(which)
    p16 = Problem(norm, M, N, "fp16", has_bias=norm == "layer_norm")
    p16_bf16 = dataclasses.replace(p16, dtype="bf16", weight_dtype="bf16")
    match = tab.match(p16)
    assert match.family_key == p16_bf16.family.key and not match.exact_family
    assert match.refused is None and tab.lookup(p16) == tab.lookup(p16_bf16)
    if match.config is not None:
        match.config.validate(p16)
        assert "closest tuned family" in match.reason(p16)


def test_fp32_splits_bf16_rows_in_twice_the_slices():
    """fp32 rows are twice the bytes: a bf16 rule that splits the row runs fp32 in twice the slices of the same
    bytes; one already split in 8 keeps 8 slices on tiles of half the rows, and one split in 8 on single-row tiles
    cannot carry over, nor one holding the whole row in registers (recompute), nor any at 8193-16384 columns from
    512 rows, which the analytic default splits in its own slices: the analytic default runs instead (no
    warning). Other rules carry over as they are."""
    tab = _shipped("h200.json")
    short = Problem("layer_norm", 384, 16384, "fp32")  # the bf16 rule: 4 slices of 4096, pipelined
    match = tab.match(short)
    bf16 = match.rule.config.kernel_1
    assert tables.holds_rows(match.rule.config) and (bf16.row_split, bf16.block_col) == (4, 4096)
    k1 = match.config.kernel_1
    assert (k1.row_split, k1.block_col, k1.recompute) == (8, 2048, False) and match.refused is None
    assert k1.pipelined_split == bf16.pipelined_split and k1.num_stages == bf16.num_stages
    match.config.validate(short)
    wide = Problem("layer_norm", 2048, 12288, "fp32")  # the same rule, but rows the default splits itself
    split = tab.match(wide)
    assert tables.holds_rows(split.rule.config) and split.config is None
    assert "split in the analytic default's slices" in split.reason(wide)
    own = default_config(wide).kernel_1
    assert (own.row_split, own.block_row, own.block_col, own.prefetch) == (3, 2, 4096, True)
    widest = Problem("rms_norm", 256, 65536, "fp32")  # the bf16 rule already splits in 8, on 2-row tiles
    halved = tab.match(widest)
    rule_k1 = halved.rule.config.kernel_1
    assert (rule_k1.row_split, rule_k1.block_row, rule_k1.block_col) == (8, 2, 8192) and halved.refused is None
    k1 = halved.config.kernel_1
    assert (k1.row_split, k1.block_row, k1.block_col, k1.recompute) == (8, 1, 8192, False)
    halved.config.validate(widest)
    single = BackwardConfig(dataclasses.replace(rule_k1, block_row=1), halved.rule.config.kernel_2)
    config, why = tables.carried_over(single, "bf16", widest)
    assert config is None and "more than 8" in why and "one row" in why
    whole = Problem("rms_norm", 384, 16384, "fp32")  # the bf16 rule holds the whole row (recompute, no split)
    kept = tab.match(whole)
    assert kept.rule.config.kernel_1.recompute and kept.rule.config.kernel_1.row_split == 1
    assert kept.config is None and "holds whole bf16 rows" in kept.reason(whole)
    few = Problem("rms_norm", 96, 4096, "fp32")  # few rows: the dual strategy, carried as it is
    assert not tables.holds_rows(tab.match(few).rule.config)
    assert tab.lookup(few) == tab.lookup(dataclasses.replace(few, dtype="bf16", weight_dtype="bf16")).validate(few)
    clear_caches()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_config(whole, "NVIDIA H200", (9, 0)) == default_config(whole)
        assert select_config(widest, "NVIDIA H200", (9, 0)) == halved.config
        assert select_config(short, "NVIDIA H200", (9, 0)) == match.config
        assert select_config(wide, "NVIDIA H200", (9, 0)) == default_config(wide)
        assert select_config(few, "NVIDIA H200", (9, 0)) == tab.lookup(few)


def test_closest_family_prefers_its_own_dtype_then_most_matching_flags(table):
    parsed = parse_table(table)
    # LayerNorm with fp32 weights differs from the tuned LayerNorm in one flag: it takes its rules.
    fam = dataclasses.replace(LN, weight_dtype="fp32")
    assert parsed.rules(fam) == parsed.families[LN.key]
    # fp32 activations borrow bf16's rules (the stand-in) while the table has no fp32 family ...
    fp32 = ProblemFamily("layer_norm", "fp32", "fp32", True, True, False, "input")
    assert parsed.family_key(fp32) == LN.key
    # ... and take a family of their own dtype first, even one with fewer flags in common.
    own = ProblemFamily("layer_norm", "fp32", "fp32", True, False, True, "output")
    with_fp32 = parse_table({**table, "families": {**table["families"], own.key: table["families"][LN.key]}})
    assert with_fp32.family_key(fp32) == own.key
    assert parsed.family_key(ProblemFamily("layer_norm", "fp16", "fp16", True, True, False, "input")) == LN.key


# ---------------------------------------------------------------------------------------- the lookup chain


PROBLEM = Problem("rms_norm", 4096, 4096, "bf16")


def _normtune_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("normtune")]


def test_env_table_wins(tmp_path, monkeypatch, table):
    path = tmp_path / "mine.json"
    path.write_text(emit.dumps(table))
    monkeypatch.setenv(ENV_VAR, str(path))
    clear_caches()
    tab = table_for(H100_NAME, (9, 0))
    assert tab.path == str(path) and tab.gpu_name == GPU.name
    problem = RMS.problem(4096, 1024)
    assert select_config(problem, H100_NAME, (9, 0)) == candidates(1024)["B"]
    assert select_config(problem, None) == candidates(1024)["B"]  # even without a device


def test_exact_gpu_name_takes_its_table_without_warning():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tab = table_for(H100_NAME, (9, 0))
        config = select_config(PROBLEM, H100_NAME, (9, 0))
    assert not _normtune_warnings(record)
    assert tab.gpu_name == H100_NAME and Path(tab.path).name == "h100.json"
    assert config == tab.lookup(PROBLEM)
    assert table_for("NVIDIA H200", (9, 0)).gpu_name == "NVIDIA H200"


def test_same_family_warns_once():
    with pytest.warns(UserWarning, match=r"no table tuned on 'NVIDIA H100 PCIe'.*h100\.json.*same GPU family"):
        tab = table_for("NVIDIA H100 PCIe", (9, 0))
    assert tab.gpu_name == H100_NAME
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert select_config(PROBLEM, "NVIDIA H100 PCIe", (9, 0)) == tab.lookup(PROBLEM)
        table_chain.choose_table.cache_clear()  # looked up again: the warning is still not repeated
        assert table_for("NVIDIA H100 PCIe", (9, 0)).gpu_name == H100_NAME
    assert not _normtune_warnings(record)


def test_same_compute_capability_warns_once():
    name = "NVIDIA Future GPU 9000"
    with pytest.warns(UserWarning, match=r"no table for 'NVIDIA Future GPU 9000'.*same compute capability 9\.0"):
        tab = table_for(name, (9, 0))
    assert tab is not None and tab.compute_capability == "9.0" and not tab.interpret
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        select_config(PROBLEM, name, (9, 0))
        table_chain.choose_table.cache_clear()
        table_for(name, (9, 0))
    assert not _normtune_warnings(record)


@pytest.mark.parametrize("name, capability", [("NVIDIA Tesla T4", (7, 5)), ("Some Accelerator", None)])
def test_unknown_gpu_uses_the_default_with_one_warning(name, capability):
    with pytest.warns(UserWarning, match="no heuristic table.*analytic default"):
        assert table_for(name, capability) is None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for problem in (PROBLEM, Problem("layer_norm", 3, 5000, "fp16")):
            assert select_config(problem, name, capability) == default_config(problem)
    assert not _normtune_warnings(record)


def test_cpu_uses_the_default_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert table_for("cpu (triton interpreter)") is None
        assert table_for(None) is None
        assert select_config(PROBLEM, "cpu") == default_config(PROBLEM)


# ------------------------------------------------------------------------------------------ bad tables


def _valid() -> dict:
    return json.loads((CONFIGS / "h100.json").read_text())


def _first_rule(data: dict) -> dict:
    return data["families"]["rms_norm/bf16/wbf16/nobias/save-input"]["rules"][0]


def _mutate(fn):
    data = _valid()
    fn(data)
    return json.dumps(data)


BAD_TABLES = {
    "bad-json": ("{not json", ["not valid JSON"]),
    "a-list": ("[1, 2]", ["is not a JSON object"]),
    "old-schema": (_mutate(lambda d: d.update(schema_version=0)), ["schema_version is 0", "reads 1"]),
    "no-schema": (_mutate(lambda d: d.pop("schema_version")), ["schema_version is None"]),
    "no-gpu": (_mutate(lambda d: d.pop("gpu")), ["no gpu.name"]),
    "no-families": (_mutate(lambda d: d.pop("families")), ["has no families"]),
    "empty-families": (_mutate(lambda d: d.update(families={})), ["has no families"]),
    "bad-family-key": (_mutate(lambda d: d["families"].update({"layer_norm/bf16": {"rules": []}})),
                       ["family 'layer_norm/bf16'", "malformed"]),
    "no-rules": (_mutate(lambda d: d["families"]["rms_norm/bf16/wbf16/nobias/save-input"].update(rules=[])),
                 ["rms_norm/bf16/wbf16/nobias/save-input", "has no rules"]),
    "bad-block-col": (_mutate(lambda d: _first_rule(d)["config"]["kernel_1"].update(block_col=100)),
                      ["rule 0", "kernel_1.block_col=100", "power of two"]),
    "unknown-knob": (_mutate(lambda d: _first_rule(d)["config"]["kernel_2"].update(block_k=4)),
                     ["rule 0", "unknown Kernel2Config field", "block_k"]),
    "narrow-single-pass": (_mutate(lambda d: _first_rule(d).update(fitted_on=[f"64x{2 * _first_rule(d)['n_max']}"])),
                           ["rule 0", "block_col", "< N="]),
    "bad-n-max": (_mutate(lambda d: _first_rule(d).update(n_max=0)), ["rule 0", "n_max=0"]),
    "string-m-max": (_mutate(lambda d: _first_rule(d).update(m_max="4096")), ["rule 0", "m_max='4096'"]),
}


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_malformed_table_is_refused_naming_file_and_problem(tmp_path, monkeypatch, case):
    text, needles = BAD_TABLES[case]
    path = tmp_path / f"{case}.json"
    path.write_text(text)
    monkeypatch.setenv(ENV_VAR, str(path))
    clear_caches()
    with pytest.raises(TableError) as info:
        select_config(PROBLEM, H100_NAME, (9, 0))
    message = str(info.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_valid_base_of_the_malformed_tables_loads(tmp_path, monkeypatch):
    path = tmp_path / "fine.json"
    path.write_text(json.dumps(_valid()))
    monkeypatch.setenv(ENV_VAR, str(path))
    clear_caches()
    assert select_config(PROBLEM, H100_NAME, (9, 0)) == _shipped("h100.json").lookup(PROBLEM)


def test_missing_table_file(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nope.json"))
    clear_caches()
    with pytest.raises(TableError, match=r"nope\.json: cannot be read"):
        table_for(H100_NAME)


def test_interpreter_table_is_refused_for_a_gpu(tmp_path, monkeypatch):
    data = _valid()
    data["interpret"] = True
    path = tmp_path / "interp.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv(ENV_VAR, str(path))
    clear_caches()
    with pytest.raises(TableError, match=r"interp\.json: it holds Triton-interpreter timings.*NVIDIA H100"):
        select_config(PROBLEM, H100_NAME, (9, 0))
    assert table_for("cpu (triton interpreter)").interpret  # the interpreter itself may use it
    assert table_for(None).path == str(path)


# ------------------------------------------------------------------------------------------------ the CLI


runner = CliRunner()


@pytest.fixture(scope="module")
def sweep_db(tmp_path_factory):
    if not interpret_mode():
        pytest.skip("runs `normtune sweep --interpret`: set TRITON_INTERPRET=1 (the kernels are compiled for the "
                    "GPU in this process otherwise)")
    tmp = tmp_path_factory.mktemp("sweep")
    url = f"sqlite:///{tmp / 'sweep.db'}"
    result = runner.invoke(app, ["sweep", "--interpret", "--shapes", "24x200,48x200", "--trials", "3",
                                 "--storage", url])
    assert result.exit_code == 0, result.output
    return url, tmp


def test_cli_emit(sweep_db, tmp_path, monkeypatch):
    """One test (the sweep behind it takes seconds, and each xdist worker would run its own): emit twice, byte-
    identical; what it wrote; `--gpu h100` on the same database fails clearly; the table is refused on a GPU."""
    url, tmp = sweep_db
    outs = [tmp_path / "a" / "interpret.json", tmp_path / "b.json"]
    for out in outs:
        result = runner.invoke(app, ["emit", "--interpret", "--db", url, "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert out.is_file()
    first = outs[0].read_bytes()
    assert first == outs[1].read_bytes()
    data = json.loads(first)
    assert data["interpret"] is True and data["gpu"]["key"] == "interpret"
    assert data["schema_version"] == SCHEMA_VERSION
    assert set(data["families"]) == {LN.key, RMS.key}
    for fam in data["families"].values():
        assert set(fam["expected_us"]) == {"24x200", "48x200"}
        assert all(v > 0 for v in fam["expected_us"].values())
    parsed = parse_table(data, str(outs[0]))
    assert parsed.lookup(Problem("layer_norm", 24, 200)) is not None
    store = Store(url)
    try:
        assert data["provenance"]["runs"] == [r.id for r in store.runs() if r.interpret]
        # Every rule's config was measured ok on the problems it was fitted on.
        for key, fam in data["families"].items():
            for rule in fam["rules"]:
                cfg = BackwardConfig.from_dict(rule["config"])
                for shape in rule["fitted_on"]:
                    M, N = map(int, shape.split("x"))
                    problem = ProblemFamily.from_key(key).problem(M, N)
                    assert store.count_measurements(problem=problem, config=cfg, status="ok") >= 1
        assert store.count_measurements(interpret=True) == 12  # 3 trials x 2 shapes x 2 norms, all stored
    finally:
        store.close()

    # No h100 measurements in an interpreter database: one line, exit 1, nothing written.
    h100 = tmp_path / "h100.json"
    result = runner.invoke(app, ["emit", "--gpu", "h100", "--db", url, "--out", str(h100)])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: no successful measurements for h100"), lines
    assert "--interpret" in lines[0]
    assert not h100.exists()

    # The interpreter table is for the interpreter only.
    monkeypatch.setenv(ENV_VAR, str(outs[0]))
    clear_caches()
    with pytest.raises(TableError, match="interpreter"):
        select_config(Problem("rms_norm", 24, 200), H100_NAME, (9, 0))
    clear_caches()
    problem = Problem("rms_norm", 24, 200)
    assert select_config(problem, "cpu (triton interpreter)") == parsed.lookup(problem)


# ------------------------------------------------------------------------------------- committed tables


@pytest.mark.parametrize("name, gpu, key", [("h100.json", H100_NAME, "h100"), ("h200.json", "NVIDIA H200", "h200")])
def test_committed_tables(name, gpu, key):
    raw = json.loads((CONFIGS / name).read_text())
    tab = _shipped(name)
    assert tab.gpu_name == gpu and tab.gpu_key == key == gpu_key(gpu)
    assert tab.compute_capability == "9.0" and tab.sm_count == 132 and not tab.interpret
    assert raw["schema_version"] == SCHEMA_VERSION
    assert {"layer_norm/bf16/wbf16/bias/save-input", "rms_norm/bf16/wbf16/nobias/save-input"} <= set(tab.families)
    for key, fam in raw["families"].items():
        assert fam["expected_us"] and all(v > 0 for v in fam["expected_us"].values())
        rules = tab.families[key]
        for i, rule in enumerate(fam["rules"]):
            for shape in rule["fitted_on"]:
                assert shape in fam["expected_us"]
                # A shape a rule was fitted on is looked up by that rule, not an earlier one.
                M, N = map(int, shape.split("x"))
                assert next(r for r in rules if r.matches(M, N)) is rules[i], (key, shape)
    # The committed bytes are what `emit.dumps` writes (so a re-emit diffs cleanly).
    assert (CONFIGS / name).read_text() == emit.dumps(raw)
    assert Path(tab.path).name == name
    assert name in {Path(t.path).name for t in tables.shipped_tables()}


GATED_FAMILIES = ("rms_norm/bf16/wbf16/nobias/save-input/gate-after-silu",
                  "rms_norm/bf16/wbf16/nobias/save-input/gate-before-silu")


def test_the_shipped_h200_table_runs_gated_calls_with_its_gated_rules(monkeypatch, tmp_path):
    """configs/h200.json carries the gated RMSNorm's families: on an H200 a gated problem is answered by its own
    family's rule (not the plain family's, not the analytic default), for every shape a rule was fitted on and for
    the gated issue's calls (Mamba-2's grouped ones as M rows x group size), and its config fits the H200."""
    from normtune.kernels import limits as L
    from normtune.kernels.select.select import explain
    from normtune.tuner.gated_shapes import preset_problems

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv(HOME_VAR, str(tmp_path))  # no user table in the way
    clear_caches()
    raw = json.loads((CONFIGS / "h200.json").read_text())
    tab = _shipped("h200.json")
    assert set(GATED_FAMILIES) <= set(tab.families)
    problems = [(ProblemFamily.from_key(key).problem(*map(int, shape.split("x"))), key, i)
                for key in GATED_FAMILIES for i, rule in enumerate(raw["families"][key]["rules"])
                for shape in rule["fitted_on"]]
    problems += [(p, p.family.key, None) for p in preset_problems("gated-issue")]
    for problem, key, index in problems:
        why = explain(problem, "NVIDIA H200", (9, 0), limits=L.H200)
        assert why.match.family_key == key and why.match.exact_family, (problem, why.reason)
        assert index is None or why.match.index == index, (problem, why.reason)
        assert why.to_dict()["source"] == "table" and not why.fallbacks, (problem, why.reason)
        assert why.config == tab.match(problem, L.H200).config
        assert select_config(problem, "NVIDIA H200", (9, 0), L.H200) == why.config
    clear_caches()

def test_shipped_tables_are_found_as_package_data():
    names = {Path(t.path).name for t in tables.shipped_tables()}
    assert {"h100.json", "h200.json"} <= names


def test_an_m_range_ends_halfway_between_fitted_rows_on_a_log_scale():
    """An unseen M takes the rule fitted nearest to it (log scale): between rules fitted at 1024 and 4096 rows the
    boundary is 2048. A columns rule never reaches past the rows the columns strategy accepts."""
    from normtune.kernels.config import Problem
    from normtune.kernels.heuristics import MAX_COLUMNS_ROWS
    from normtune.tuner.tables.fit import m_boundary

    def probs(*ms):
        return [Problem("rms_norm", m, 32768, "bf16") for m in ms]

    rows = BackwardConfig(kernel_1_config(block_row=1, block_col=4096, num_warps=8, two_pass=True),
                          Kernel2Config(128, 16))
    columns = BackwardConfig(kernel_1_config(block_row=32, block_col=64, num_warps=4, strategy="columns"),
                             Kernel2Config(32, 8))
    assert m_boundary(probs(256, 1024), probs(4096), rows) == 2048
    assert m_boundary(probs(64), probs(256, 512), rows) == 128
    assert m_boundary(probs(1000), probs(1001), rows) == 1000  # never below the group's own rows
    assert m_boundary(probs(1024), probs(65536), columns) == MAX_COLUMNS_ROWS
    assert m_boundary(probs(4096), probs(65536), columns) == 4096


def test_a_width_fitted_on_few_rows_leaves_taller_rows_to_the_next_wider_width():
    """A bucket fitted on few rows only (at most MAX_COLUMNS_ROWS) ends its top rule halfway (log scale) to the
    next wider bucket's taller rows, so 2048 rows of 14336 columns take the 16384-column rule fitted there; a
    bucket fitted on many rows, and the widest bucket, serve every M."""
    a = BackwardConfig(kernel_1_config(block_row=1, block_col=16384, num_warps=16), Kernel2Config(128, 16))
    b = BackwardConfig(kernel_1_config(block_row=1, block_col=16384, num_warps=16), Kernel2Config(64, 32))
    few = {RMS.problem(M, 14336): {a: T(10.0), b: T(12.0)} for M in (128, 512)}
    wide = {RMS.problem(M, 16384): {a: T(30.0), b: T(20.0)} for M in (512, 4096, 16384)}
    rules = fit.fit_family(RMS, {**few, **wide}).rules
    assert [(r["n_max"], r["m_max"]) for r in rules][:1] == [(15325, math.isqrt(512 * 4096))]
    data = _valid()
    data["families"] = {RMS.key: {"rules": rules}}
    table = parse_table(data)
    assert table.lookup(RMS.problem(256, 14336)).kernel_2 == a.kernel_2
    assert table.lookup(RMS.problem(2048, 14336)).kernel_2 == b.kernel_2
    many = {RMS.problem(M, 14336): {a: T(10.0), b: T(12.0)} for M in (128, 4096)}
    assert fit.fit_family(RMS, {**many, **wide}).rules[0]["m_max"] is None


def test_an_m_range_ends_where_the_two_rules_measured_times_cross():
    """With both rules' configs timed at both neighbouring problems, the boundary is where log(time ratio),
    linear in log M, crosses zero; a dual rule not timed above (it accepts at most MAX_COLUMNS_ROWS rows) is
    extrapolated as growing linearly in M. Without a crossing in between, the geometric midpoint stays."""
    from normtune.kernels.config import Problem
    from normtune.tuner.tables.fit import m_boundary, m_crossover
    from normtune.tuner.measure.spread import Timing

    lo, hi = Problem("layer_norm", 512, 3584, "bf16"), Problem("layer_norm", 4096, 3584, "bf16")
    rows = BackwardConfig(kernel_1_config(block_row=2, block_col=4096, num_warps=16), Kernel2Config(128, 16))
    dual = BackwardConfig(kernel_1_config(block_row=2, block_col=4096, num_warps=16, strategy="dual"),
                          Kernel2Config(64, 64))
    other = BackwardConfig(kernel_1_config(block_row=1, block_col=4096, num_warps=8), Kernel2Config(64, 16))

    # both timed at both ends: time ratio 0.5 at 512 rows and 2.0 at 4096 -> equal halfway in log M (1448)
    data = {lo: {other: Timing(5.0, 4.9, 5.1), rows: Timing(10.0, 9.9, 10.1)},
            hi: {other: Timing(80.0, 79, 81), rows: Timing(40.0, 39, 41)}}
    assert m_crossover(data, lo, hi, other, rows) == pytest.approx(512 * 8 ** 0.5)
    # a ratio of 0.9 below and 3.0 above crosses nearer the lower rows
    data = {lo: {other: Timing(9.0, 8.9, 9.1), rows: Timing(10.0, 9.9, 10.1)},
            hi: {other: Timing(120.0, 119, 121), rows: Timing(40.0, 39, 41)}}
    cross = m_crossover(data, lo, hi, other, rows)
    assert 512 < cross < 1448
    assert m_boundary([lo], [hi], other, rows, data) == int(cross)
    # dual, measured below only: 12.6 against 13.6 us at 512 rows, rows 35 us at 4096 -> crosses just above 512
    data = {lo: {dual: Timing(12.6, 12.2, 13.4), rows: Timing(13.6, 13.1, 14.4)}, hi: {rows: Timing(35.0, 34, 36)}}
    assert 512 < m_boundary([lo], [hi], dual, rows, data) < 700
    # no crossing (the lower rule is also faster above, or the upper rule untimed below): the midpoint
    data = {lo: {other: Timing(9.0, 8.9, 9.1), rows: Timing(10.0, 9.9, 10.1)},
            hi: {other: Timing(30.0, 29, 31), rows: Timing(40.0, 39, 41)}}
    assert m_crossover(data, lo, hi, other, rows) is None
    assert m_boundary([lo], [hi], other, rows, data) == 1448
    assert m_crossover({lo: {other: Timing(9.0, 8.9, 9.1)}, hi: {rows: Timing(40.0, 39, 41)}}, lo, hi, other,
                       rows) is None


def test_a_row_sweeping_rule_never_reaches_past_the_log_midpoint():
    """H200 RMSNorm, 14336 columns, measured: dual 10.7 µs against the rows rule's 15.4 at 128 rows, 32.1 against
    24.8 at 512. The times cross at 288 rows on a log-log line, but that dual config ran 257 rows 6 % slower than
    the rows rule: a dual or columns range stops at the midpoint (256). A rows rule still ends where the times
    cross."""
    from normtune.kernels.config import Problem
    from normtune.tuner.tables.fit import m_boundary, m_crossover
    from normtune.tuner.measure.spread import Timing

    lo, hi = Problem("rms_norm", 128, 14336, "bf16"), Problem("rms_norm", 512, 14336, "bf16")
    upper = BackwardConfig(kernel_1_config(block_row=1, block_col=16384, num_warps=16), Kernel2Config(128, 16))
    for strategy, boundary in (("dual", 256), ("rows", 288)):
        lower = BackwardConfig(kernel_1_config(block_row=1, block_col=16384, num_warps=8, strategy=strategy),
                               Kernel2Config(32, 128))
        data = {lo: {lower: Timing(10.7, 10.2, 11.4), upper: Timing(15.4, 14.5, 15.9)},
                hi: {lower: Timing(32.1, 31.5, 33.2), upper: Timing(24.8, 24.0, 25.5)}}
        assert 287 < m_crossover(data, lo, hi, lower, upper) < 290
        assert m_boundary([lo], [hi], lower, upper, data) == boundary, strategy


def test_an_n_range_ends_halfway_between_fitted_widths_within_their_power_of_two():
    """An unseen N takes the rules fitted nearest to it on a log scale (5376 columns: the 5120 rules, not the
    6144 ones), but a rule never serves an N its tiles would have to be widened for."""
    from normtune.tuner.tables.fit import n_boundary

    assert n_boundary(5120, 6144) == 5608  # isqrt(5120 * 6144)
    assert n_boundary(4096, 5120) == 4096  # 4097.. re-tile to 8192 columns: the 5120 rules' tiles
    assert n_boundary(12288, 16384) == 14188
    assert n_boundary(16384, 32768) == 16384  # never past one pass
    assert n_boundary(1536, 1537) == 1536  # never below its own width


@pytest.mark.parametrize("rules, needle", [
    ([(1024, None), (1024, None)], "rule 1 (n_max 1024, m_max None) is never used: rule 0"),
    ([(4096, None), (1024, 512)], "rule 1 (n_max 1024, m_max 512) is never used: rule 0"),
    ([(1024, 512), (None, None), (4096, 64)], "rule 2 (n_max 4096, m_max 64) is never used: rule 1"),
    ([(1024, 512), (512, 4096)], "rule 1 (n_max 512, m_max 4096) comes after rule 0"),
])
def test_a_table_whose_rules_overlap_or_are_out_of_order_is_refused(rules, needle):
    """The first matching rule wins: a rule an earlier one covers would silently never run (`where` would show the
    earlier rule's config without a word)."""
    data = _valid()
    family = data["families"]["layer_norm/bf16/wbf16/bias/save-input"]
    config = BackwardConfig(kernel_1_config(block_row=1, block_col=256, num_warps=4, two_pass=True),
                            Kernel2Config()).to_dict()
    family["rules"] = [{"n_max": n, "m_max": m, "config": config, "fitted_on": []} for n, m in rules]
    with pytest.raises(TableError, match=re.escape(needle)):
        parse_table(data)
