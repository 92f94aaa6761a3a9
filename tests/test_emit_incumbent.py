"""`normtune emit --keep`: an incumbent table's config stays wherever the new winner is not faster beyond the
spread, the new table records the incumbent, and re-emitting it from its recorded runs gives the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import BackwardConfig, Kernel2Config, ProblemFamily, default_config, kernel_1_config
from normtune.kernels.select.tables import parse_table
from normtune.tuner.tables import emit, emit_notes, fit, incumbent
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.tables import remeasure
from normtune.tuner.tables.remeasure import neighbour_plan
from normtune.tuner.measure.spread import Timing
from normtune.tuner.store.database import Store

GPU = DeviceInfo(name="NVIDIA Test GPU", key="testgpu", compute_capability="9.0", sm_count=8, l2_bytes=50 * 2**20,
                 memory_bytes=80 * 2**30, driver="560.35.03", cuda="12.6", torch="2.6.0", triton="3.2.0",
                 normtune="0.1.0", git_revision="aaaa111", host="node-1", python="3.11.9", interpret=False)
RMS = ProblemFamily("rms_norm", "bf16", "bf16", True, False, False, "input")
SMALL, LARGE = RMS.problem(256, 1024), RMS.problem(2048, 1024)
runner = CliRunner()


def cfg(warps: int, block_m: int = 64) -> BackwardConfig:
    return BackwardConfig(kernel_1_config(block_row=1, block_col=1024, num_warps=warps),
                          Kernel2Config(block_m=block_m, block_n=16))


A, B = cfg(4), cfg(8)  # A: the incumbent's config; B: the new measurements' winner


def T(median: float, spread: float = 0.01) -> Timing:
    return Timing(median, median * (1 - spread), median * (1 + spread))


def rules(fitted) -> list[BackwardConfig]:
    return [BackwardConfig.from_dict(r["config"]) for r in fitted.rules]


def test_the_incumbent_stays_unless_the_winner_beats_it_beyond_the_spread():
    incumbents = {SMALL: A, LARGE: A}
    # B wins by 1 % on both problems, inside the ±1 % spreads: the incumbent stays, and says what it outlived.
    close = {SMALL: {A: T(10.0), B: T(9.9)}, LARGE: {A: T(40.0), B: T(39.6)}}
    assert rules(fit.fit_family(RMS, close)) == [B]
    fitted = fit.fit_family(RMS, close, incumbents=incumbents)
    assert rules(fitted) == [A] and BackwardConfig.from_dict(fitted.rules[0]["kept_over"]) == B
    assert fitted.expected_us == {"256x1024": 10.0, "2048x1024": 40.0}
    (line,) = emit_notes.kept_summary({"families": {RMS.key: {"rules": fitted.rules}}})
    assert "256x1024+2048x1024: kept the incumbent" in line and f"`{B}`" in line
    # B beats A by 10 % on the large problem, beyond the spread: B replaces it.
    far = {SMALL: {A: T(10.0), B: T(9.9)}, LARGE: {A: T(40.0), B: T(36.0)}}
    replaced = fit.fit_family(RMS, far, incumbents=incumbents)
    assert rules(replaced) == [B] and "kept_over" not in replaced.rules[0]
    # An incumbent not measured on every problem of the group cannot be weighed: the winner takes the rule.
    unmeasured = {SMALL: {A: T(10.0), B: T(9.9)}, LARGE: {B: T(39.6)}}
    assert rules(fit.fit_family(RMS, unmeasured, incumbents=incumbents)) == [B]


def test_the_new_winner_takes_only_the_rows_where_it_pays():
    """H100 RMSNorm 65536 columns, measured: X beats the incumbent A beyond the spread on 1024 rows and loses
    2.5 % (inside the spread) on 256. Splitting off 256 rows lowers the mean regret by 0.8 %, less than SPLIT_GAIN,
    so a fit without an incumbent gives X to every row; with A as the incumbent, the 256-row group keeps A at no
    split cost and X takes 512 rows and more (from 469: where A's and X's measured times cross between 256 and
    512 rows)."""
    rows = [RMS.problem(M, 65536) for M in (256, 512, 1024)]
    a = BackwardConfig(kernel_1_config(block_row=4, block_col=8192, num_warps=16, row_split=8),
                       Kernel2Config(block_m=128, block_n=32, pdl=True))
    x = BackwardConfig(kernel_1_config(block_row=4, block_col=8192, num_warps=16, row_split=8),
                       Kernel2Config(block_m=128, block_n=16))
    best = BackwardConfig(kernel_1_config(block_row=2, block_col=8192, num_warps=16, row_split=8),
                          Kernel2Config(block_m=128, block_n=16))
    data = {rows[0]: {a: Timing(64.9, 63.6, 65.7), x: Timing(66.5, 65.5, 67.2)},
            rows[1]: {a: Timing(111.7, 109.5, 113.9), x: Timing(111.3, 109.4, 113.3),
                      best: Timing(110.3, 108.3, 112.9)},
            rows[2]: {a: Timing(198.6, 194.6, 206.0), x: Timing(190.0, 186.4, 193.8)}}
    assert [(r["m_max"], BackwardConfig.from_dict(r["config"])) for r in fit.fit_family(RMS, data).rules] \
        == [(None, x)]
    fitted = fit.fit_family(RMS, data, incumbents={p: a for p in rows})
    assert [(r["m_max"], r["fitted_on"], BackwardConfig.from_dict(r["config"])) for r in fitted.rules] == [
        (468, ["256x65536"], a), (None, ["512x65536", "1024x65536"], x)]


def test_no_rule_is_slower_than_the_incumbent_beyond_the_spread_on_a_problem_it_was_fitted_on():
    """H200 LayerNorm 14336 columns, measured: a columns config won 512 and 1024 rows and ran 2048 rows 88.9 µs
    against the incumbent's 87.2, beyond the spread; `normtune compare` fails such a table. With dual taking 128
    rows, giving 2048 rows back to the incumbent lowers the mean regret by less than SPLIT_GAIN, so the split is
    chosen only because no rule may lose to the incumbent on a problem it was fitted on."""
    rows = [RMS.problem(M, 14336) for M in (128, 512, 1024, 2048)]
    inc = BackwardConfig(kernel_1_config(block_row=2, block_col=8192, num_warps=16, row_split=2),
                         Kernel2Config(block_m=128, block_n=32, pdl=True))
    cols = BackwardConfig(kernel_1_config(block_row=64, block_col=64, strategy="columns"), Kernel2Config(fused=False))
    dual = BackwardConfig(kernel_1_config(block_row=1, block_col=16384, num_warps=8, strategy="dual"),
                          Kernel2Config(block_m=32, block_n=128))
    data = {rows[0]: {inc: Timing(17.7, 16.3, 18.3), cols: Timing(19.0, 18.5, 19.5), dual: Timing(12.0, 11.5, 12.5)},
            rows[1]: {inc: Timing(32.1, 31.6, 32.9), cols: Timing(30.2, 29.9, 30.5)},
            rows[2]: {inc: Timing(51.1, 49.6, 52.3), cols: Timing(48.8, 48.0, 49.4)},
            rows[3]: {inc: Timing(87.2, 85.7, 88.8), cols: Timing(88.9, 88.9, 90.8)}}
    fitted = fit.fit_family(RMS, data, incumbents={p: inc for p in rows})
    assert [(r["fitted_on"], BackwardConfig.from_dict(r["config"])) for r in fitted.rules] == [
        (["128x14336"], dual), (["512x14336", "1024x14336"], cols), (["2048x14336"], inc)]


def test_a_bucket_no_single_config_fits_is_still_split_into_m_ranges():
    """Where the incumbent runs few rows with one config and many rows with another, no config is safe for the
    whole bucket; the fit still splits it into M ranges (each keeping its incumbent where nothing beats it)
    rather than one rule per problem."""
    few, more = [RMS.problem(M, 8192) for M in (100, 128, 256)], [RMS.problem(M, 8192) for M in (2048, 4096)]
    dual = BackwardConfig(kernel_1_config(block_row=1, block_col=8192, num_warps=16, strategy="dual"),
                          Kernel2Config(block_m=64, block_n=64))
    rows1 = BackwardConfig(kernel_1_config(block_row=1, block_col=8192, num_warps=16), Kernel2Config(block_m=32))
    noise = BackwardConfig(kernel_1_config(block_row=1, block_col=8192, num_warps=16), Kernel2Config(block_m=64))
    data = {**{p: {dual: T(p.M / 10), rows1: T(p.M / 8), noise: T(p.M / 8 * 0.995)} for p in few},
            **{p: {dual: T(p.M / 5), rows1: T(p.M / 40), noise: T(p.M / 40 * 0.995)} for p in more}}
    fitted = fit.fit_family(RMS, data, incumbents={**{p: dual for p in few}, **{p: rows1 for p in more}})
    assert [(r["fitted_on"], BackwardConfig.from_dict(r["config"])) for r in fitted.rules] == [
        (["100x8192", "128x8192", "256x8192"], dual), (["2048x8192", "4096x8192"], rows1)]


def test_an_incumbent_slower_than_the_default_beyond_the_spread_does_not_stay():
    default = default_config(SMALL)
    data = {SMALL: {A: T(10.5), B: T(10.0), default: T(10.0)}, LARGE: {A: T(40.0), B: T(39.8), default: T(44.0)}}
    defaults = {SMALL: default, LARGE: default}
    fitted = fit.fit_family(RMS, data, defaults, incumbents={SMALL: A, LARGE: A})
    assert rules(fitted) == [B] and "kept_over" not in fitted.rules[0]


def test_an_incumbent_is_recorded_and_rebuilt_with_the_same_lookups():
    table = parse_table(_table_json([(None, None, A, ["256x1024", "2048x1024"])]), "old.json")
    data = incumbent.record(table)
    assert set(data["families"]) == {RMS.key} and data["gpu"]["key"] == GPU.key
    again = incumbent.recorded({"provenance": {"incumbent": json.loads(json.dumps(data))}}, "new.json")
    assert again.lookup(SMALL) == table.lookup(SMALL) == A
    assert incumbent.configs_for(again, [SMALL, LARGE, RMS.problem(8192, 65536)]) == {SMALL: A, LARGE: A}
    assert incumbent.recorded({"provenance": {}}, "new.json") is None
    with pytest.raises(ValueError, match="new.json: provenance.incumbent has no families"):
        incumbent.recorded({"provenance": {"incumbent": {"gpu": {}}}}, "new.json")


def test_a_family_the_incumbent_lacks_has_the_borrowed_rule_as_its_incumbent():
    # The incumbent table has the plain family only: its problems of the fused residual form run the plain rule
    # today, so that rule is what a new residual family must beat beyond the spread to replace.
    table = parse_table(_table_json([(None, None, A, ["256x1024", "2048x1024"])]), "old.json")
    res = ProblemFamily("rms_norm", "bf16", "bf16", True, False, False, "input", residual=True)
    small, large = res.problem(256, 1024), res.problem(2048, 1024)
    found = incumbent.configs_for(table, [small, large])
    assert found == {small: A, large: A} and table.match(small).exact_family is False
    close = {small: {A: T(10.0), B: T(9.9)}, large: {A: T(40.0), B: T(39.6)}}
    fitted = fit.fit_family(res, close, incumbents=found)
    assert rules(fitted) == [A] and BackwardConfig.from_dict(fitted.rules[0]["kept_over"]) == B


def test_neighbour_remeasurement_times_the_incumbent_on_every_problem_of_its_bucket():
    data = {p: {B: T(t), default_config(p): T(2 * t)} for p, t in ((SMALL, 9.9), (LARGE, 39.6))}
    assert neighbour_plan(data) == []
    assert sorted(neighbour_plan(data, {SMALL: A}), key=lambda pc: pc[0].M) == [(SMALL, A), (LARGE, A)]


def test_the_incumbents_fitted_shapes_join_the_plan_where_no_run_measured_them():
    # The incumbent's plain rules were fitted at 128, 512 and 1024 rows of 3584 columns (and 1000 rows, a held-out
    # shape no table is fitted on); the residual runs measured 256 and 4096 rows. The shapes nothing measured join
    # the 3584 bucket with their incumbent config, the bucket's winners and their default; 8192 columns are not
    # fitted.
    wide_a, wide_b = (BackwardConfig(kernel_1_config(block_row=1, block_col=4096, num_warps=w), Kernel2Config())
                      for w in (4, 8))
    table = parse_table(_table_json([(4096, 1024, wide_a, ["128x3584", "512x3584", "1000x3584", "1024x3584"]),
                                     (4096, None, wide_b, ["4096x3584"]),
                                     (None, None, BackwardConfig(kernel_1_config(block_row=1, block_col=8192),
                                                                 Kernel2Config()), ["256x8192"])]), "old.json")
    res = ProblemFamily("rms_norm", "bf16", "bf16", True, False, False, "input", residual=True)
    low, high = res.problem(256, 3584), res.problem(4096, 3584)
    data = {low: {wide_b: T(9.9), default_config(low): T(10.0)},
            high: {wide_b: T(40.0), default_config(high): T(41.0)}}
    joined = remeasure.incumbent_shapes(table, data)
    assert [f"{p.M}x{p.N}" for p in joined] == ["128x3584", "512x3584", "1024x3584"]
    plan, mine = remeasure.incumbent_plan(data, table)
    assert mine[joined[2]] == wide_a and mine[low] == wide_a and mine[high] == wide_b
    for p in joined:
        planned = {c for q, c in plan if q == p}
        assert {wide_a, wide_b, default_config(p)} <= planned, p
    assert (low, wide_a) in plan and (high, wide_a) in plan
    assert remeasure.incumbent_plan(data, None) == (neighbour_plan(data), {})


def test_a_tune_times_a_joined_shapes_incumbent_config_with_the_defaults_first():
    # Cut short, the tune's re-measurement must not leave a joined shape with its default alone: the fit would
    # then replace the incumbent there without weighing it.
    from normtune.tuner.tune.emission import _priority

    joined, fitted = RMS.problem(512, 1024), SMALL
    incumbents = {joined: A, fitted: A}
    ranks = {(p.M, c): _priority((p, c), incumbents, None, {joined}) for p in (joined, fitted)
             for c in (A, B, default_config(p))}
    assert ranks[(512, A)] == ranks[(512, default_config(joined))] == ranks[(256, default_config(fitted))] == 0
    assert (ranks[(256, A)], ranks[(512, B)], ranks[(256, B)]) == (1, 2, 2)


def test_neighbour_remeasurement_times_the_default_where_no_run_did():
    """Emission weighs every rule against the analytic default: a default changed since the sweeps (never timed
    on a fitted problem) is planned there, once, in the form default_config gives; the canonical form the sweep
    seeds counts as measured."""
    from normtune.tuner.space import Space

    few = RMS.problem(8, 1024)  # the canonical form differs: 8 rows fill half the programs of an 8-SM GPU
    canonical = Space(few, GPU.sm_count).canonical(default_config(few))
    assert canonical != default_config(few)
    data = {SMALL: {B: T(9.9)}, few: {B: T(3.0), canonical: T(4.0)}}
    plan = neighbour_plan(data, sm_count=GPU.sm_count)
    assert plan.count((SMALL, default_config(SMALL))) == 1 and (few, default_config(few)) not in plan
    assert all(cfg not in data[p] for p, cfg in plan)
    assert (few, default_config(few)) in neighbour_plan(data)  # without the SM count only the plain form counts


# ------------------------------------------------------------------------------------------------- the CLI


def _table_json(rule_list) -> dict:
    return {"schema_version": emit.SCHEMA_VERSION,
            "gpu": {"name": GPU.name, "key": GPU.key, "compute_capability": GPU.compute_capability,
                    "sm_count": GPU.sm_count},
            "families": {RMS.key: {"rules": [{"n_max": n, "m_max": m, "config": c.to_dict(), "fitted_on": f}
                                             for n, m, c, f in rule_list]}}}


def _store(path: Path) -> str:
    """A sweep run where B is 1 % faster than A on both problems, inside A's ±1 % spread."""
    store = Store(f"sqlite:///{path}")
    run = store.start_run(GPU, kind="sweep", command_line="sweep")
    for p, a_us in ((SMALL, 10.0), (LARGE, 40.0)):
        for c, us in ((A, a_us), (B, a_us * 0.99)):
            store.add_measurement(run, p, c, MeasureResult(status="ok", median_us=us, p10_us=us * 0.99,
                                                           p90_us=us * 1.01, reps=20), source="sweep")
    store.end_run(run)
    store.close()
    return str(path)


def test_cli_keep_writes_a_table_that_re_emits_byte_for_byte_after_the_incumbent_is_gone(tmp_path):
    db = _store(tmp_path / "r.db")
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_table_json([(None, None, A, ["256x1024", "2048x1024"])])))
    new = tmp_path / "new.json"
    result = runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", db, "--keep", str(old), "--out", str(new)])
    assert result.exit_code == 0, result.output
    assert "kept the incumbent" in result.stderr
    table = json.loads(new.read_text())
    assert [BackwardConfig.from_dict(r["config"]) for r in table["families"][RMS.key]["rules"]] == [A]
    assert table["provenance"]["incumbent"]["families"][RMS.key]["rules"][0]["config"] == A.to_dict()
    old.unlink()  # the incumbent file is gone (overwritten by the new table, say): the record is enough
    result = runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", db, "--runs-of", str(new), "--out", str(new),
                                 "--check"])
    assert result.exit_code == 0, result.output
    plain = tmp_path / "plain.json"
    assert runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", db, "--out", str(plain)]).exit_code == 0
    assert [r["config"] for r in json.loads(plain.read_text())["families"][RMS.key]["rules"]] == [B.to_dict()]


def test_cli_keep_twice_keeps_each_family_from_its_own_table(tmp_path):
    """A family tuned apart (a gated tune's table) and the shipped table's families: `--keep A --keep B` keeps
    each family's rules from the table that has it, records both, and the result re-emits from its record.
    Two tables of one family, or of two GPUs, are refused in one line."""
    gated = ProblemFamily.from_key(RMS.key + "/gate-before-silu")
    db = _store(tmp_path / "r.db")
    store = Store(f"sqlite:///{db}")
    run = store.start_run(GPU, kind="sweep", command_line="sweep --shapes gated")
    for p, a_us in ((gated.problem(256, 1024), 12.0), (gated.problem(2048, 1024), 48.0)):
        for c, us in ((A, a_us), (B, a_us * 0.99)):
            store.add_measurement(run, p, c, MeasureResult(status="ok", median_us=us, p10_us=us * 0.99,
                                                           p90_us=us * 1.01, reps=20), source="sweep")
    store.end_run(run)
    store.close()
    plain, tuned = tmp_path / "plain.json", tmp_path / "gated.json"
    plain.write_text(json.dumps(_table_json([(None, None, A, ["256x1024", "2048x1024"])])))
    data = _table_json([(None, None, A, ["256x1024", "2048x1024"])])
    data["families"] = {gated.key: data["families"][RMS.key]}
    tuned.write_text(json.dumps(data))
    new = tmp_path / "new.json"
    result = runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", db, "--keep", str(plain), "--keep", str(tuned),
                                 "--out", str(new)])
    assert result.exit_code == 0, result.output
    table = json.loads(new.read_text())
    assert {key: [BackwardConfig.from_dict(r["config"]) for r in fam["rules"]]
            for key, fam in table["families"].items()} == {RMS.key: [A], gated.key: [A]}
    assert sorted(table["provenance"]["incumbent"]["families"]) == sorted([RMS.key, gated.key])
    result = runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", db, "--runs-of", str(new), "--out", str(new),
                                 "--check"])
    assert result.exit_code == 0, result.output
    other = tmp_path / "other.json"
    data = _table_json([(None, None, A, ["256x1024"])])
    data["gpu"] = {**data["gpu"], "key": "othergpu"}
    other.write_text(json.dumps(data))
    for keep, needle in (([plain, plain], f"--keep {plain} and {plain} both have family {RMS.key}"),
                         ([plain, other], f"--keep {other} was tuned on othergpu and {plain} on testgpu")):
        args = [arg for path in keep for arg in ("--keep", str(path))]
        result = runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", db, *args, "--out", str(tmp_path / "x.json")])
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 1 and len(lines) == 1 and needle in lines[0], result.output
        assert not (tmp_path / "x.json").exists()
