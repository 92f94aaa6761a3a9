"""The parts of `normtune tune` that decide, one by one, without measuring: where trials go (`rounds`), the time
budget's shares (`clock`), the generated held-out shapes (`unseen`), the plan's identity and its refusal of the
held-out preset (`plan`), where to sweep again (`resweep`), the gate's fall-backs (`gate`), the journal on SQLite,
the warm start (`warm`) and the command's problems and default database."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from normtune.kernels.config import BackwardConfig, Problem, default_config
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.kernels.select.tables import parse_table, shipped_tables
from normtune.tuner.measure.spread import Ratio, Timing
from normtune.tuner.shapes import HELDOUT
from normtune.tuner.space import Space
from normtune.tuner.tune import clock, gate, journal as J, resweep, rounds, unseen, warm
from normtune.tuner.tune.plan import Plan

RMS = "rms_norm/bf16/wbf16/nobias/save-input"


# ------------------------------------------------------------------------------------------------ rounds


def test_first_round_and_steps_share_the_trials():
    assert (rounds.first_round(40), rounds.round_step(40)) == (12, 10)  # 12, 22, 32, 40
    assert (rounds.first_round(2), rounds.round_step(2)) == (1, 1)
    assert (rounds.first_round(1), rounds.round_step(1)) == (1, 1)
    # the cover, the seeds, one step of search: a problem is never judged stalled on its seeds alone
    assert rounds.opening(40) == [4, 12, 22] and rounds.opening(6) == [3, 4] and rounds.opening(2) == [1, 2]
    assert rounds.opening(1) == [1]


def test_gain_reads_the_best_over_the_last_trials():
    assert rounds.gain([10.0, 9.0, 9.0, 8.0], 2) == pytest.approx(9.0 / 8.0 - 1)
    assert rounds.gain([10.0, None, 10.0], 2) == 0.0
    assert rounds.gain([None, 5.0], 1) == math.inf  # only the last trials ran
    assert rounds.gain([None, None], 1) is None and rounds.gain([1.0], 1) is None


def test_a_stalled_problem_stops_and_its_trials_go_where_the_best_moved_most():
    values = {"a": [10.0, 10.0, 10.0, 10.0], "b": [10.0, 9.0, 9.0, 5.0], "c": [10.0, 10.0, 9.5, 9.0],
              "d": [10.0, 5.0, 5.0, 5.0]}
    targets = dict.fromkeys(values, 4)
    decision = rounds.next_round(values, targets, stopped=set(), trials=10, step=2)
    assert decision.stalled == ["a", "d"] and decision.raised == ["b", "c"]
    assert decision.given == ["b", "c"]  # two stalled: their steps go to both moving problems
    assert decision.targets == {"a": 4, "b": 8, "c": 8, "d": 4}
    again = rounds.next_round(values, decision.targets, stopped={"a", "d"}, trials=10, step=2)
    assert "a" not in again.raised and again.targets["a"] == 4  # never raised again
    capped = rounds.next_round(values, dict.fromkeys(values, 10), stopped=set(), trials=10, step=2)
    assert not capped.changed


# ------------------------------------------------------------------------------------------------- clock


def test_phases_share_what_is_left_before_the_final_reserve():
    c = clock.Clock(100.0, started=0.0)
    assert c.reserve_s == 5.0
    c.elapsed_s = lambda: 15.0
    assert c.free_s() == 80.0 and c.share_s(1, 3) == 20.0 and not c.out()
    c.elapsed_s = lambda: 96.0
    assert c.out() and c.share_s(1) == 0.0
    assert clock.Clock(None).share_s(1, 2) is None and not clock.Clock(None).out()
    assert clock.Clock(4.0).reserve_s == 2.0  # at most half of a short budget


# ---------------------------------------------------------------------------------------- held-out shapes


def _family(norm="rms_norm", residual=False):
    return [Problem(norm, M, N, "bf16", residual=residual) for M, N in
            ((4096, 1024), (4096, 2048), (16384, 2560), (4096, 5120), (512, 32768), (2048, 16384))]


def test_generated_heldout_shapes_are_unseen_deterministic_and_never_the_preset():
    fitted = _family() + _family("layer_norm") + _family(residual=True)
    one = unseen.unseen_problems(fitted, 40, "seed-1")
    assert one == unseen.unseen_problems(fitted, 40, "seed-1")
    assert one != unseen.unseen_problems(fitted, 40, "seed-2")
    assert len(one) == 120 and len(set(one)) == 120
    preset, seen = set(HELDOUT), {(p.family.key, p.M, p.N) for p in fitted}
    largest = max(p.M * p.N for p in fitted)
    for p in one:
        assert (p.M, p.N) not in preset and (p.family.key, p.M, p.N) not in seen
        # within half below and twice beyond the fitted rows (512..16384) and widths (1024..32768), and no
        # problem larger than the largest fitted one
        assert 256 <= p.M <= 2 * 16384 and 512 <= p.N <= 65536
        assert p.M * p.N <= largest, p
    inside = [p for p in one if 1024 < p.N < 32768]
    assert len(inside) > len(one) / 2  # mostly between the fitted widths, some around them


def test_a_drawn_shape_of_the_preset_or_a_fitted_one_is_drawn_again(monkeypatch):
    (M, N), fitted = HELDOUT[0], Problem("rms_norm", 64, 1024, "bf16")
    rows, widths = iter([M, fitted.M, M + 1]), iter([N, fitted.N, N])
    monkeypatch.setattr(unseen, "_rows", lambda rng, found, *where: next(rows))
    monkeypatch.setattr(unseen, "_width", lambda rng, found, *where: next(widths))
    assert unseen.unseen_problems([fitted], 1, "seed") == [Problem("rms_norm", M + 1, N, "bf16")]


def test_the_plan_refuses_a_shape_of_the_heldout_preset_and_names_itself_by_its_settings():
    M, N = HELDOUT[0]
    with pytest.raises(ValueError, match="held-out preset"):
        Plan("h100", False, (Problem("rms_norm", M, N, "bf16"),))
    plan = Plan("h100", False, (Problem("rms_norm", 4096, 4096, "bf16"),))
    assert plan.tune_id == Plan("h100", False, (Problem("rms_norm", 4096, 4096, "bf16"),)).tune_id
    assert plan.tune_id != dataclasses.replace(plan, trials=41).tune_id
    assert plan.tune_id != dataclasses.replace(plan, as_new_gpu=True).tune_id
    assert plan.study(plan.problems[0]).startswith(f"normtune-tune-{plan.tune_id}:h100:")


def test_the_command_leaves_the_presets_shapes_out_with_a_note():
    from normtune.commands.tune import _problems

    M, N = HELDOUT[0]
    problems, notes = _problems(f"4x64,{M}x{N}", None, None, "rms_norm", None, "plain,residual", True)
    assert [(p.M, p.N, p.residual) for p in problems] == [(4, 64, False), (4, 64, True)]
    assert f"{M}x{N}" in notes[0] and "held-out preset" in notes[0]


def test_a_models_norms_get_the_residual_form_on_its_hidden_size(tmp_path):
    import json

    from normtune.commands.tune import _problems

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 128, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}))
    problems, notes = _problems(None, tmp_path / "config.json", "64", None, None, "plain,residual", True)
    assert sorted((p.M, p.N, p.residual) for p in problems) == [(64, 1024, False), (64, 1024, True),
                                                                 (256, 128, False), (512, 128, False)]
    assert "qwen3" in notes[0]


def test_without_db_the_tune_uses_the_database_in_the_user_directory(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from normtune.cli import app
    from normtune.tuner.tune import runner

    seen = []
    monkeypatch.setenv("NORMTUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(runner, "tune", lambda console, options: seen.append(options) or 0)
    result = CliRunner().invoke(app, ["tune", "--interpret", "--shapes", "4x64", "--out", str(tmp_path / "t.json")])
    assert result.exit_code == 0, result.output
    assert seen[0].db == f"sqlite:///{tmp_path / 'home' / 'results.db'}" and (tmp_path / "home").is_dir()
    assert seen[0].report == tmp_path / "t-tune"  # the report beside the table


def test_as_new_gpu_hides_the_tables_before_the_tune_starts_a_process(monkeypatch, tmp_path):
    import os

    from typer.testing import CliRunner

    from normtune.cli import app
    from normtune.kernels.select.select import clear_caches
    from normtune.kernels.select.table_chain import HIDE_VAR, choose_table
    from normtune.tuner.tune import runner

    monkeypatch.setenv(HIDE_VAR, "0")  # restored after the test; the command sets it for its whole run
    monkeypatch.setenv("NORMTUNE_HOME", str(tmp_path / "home"))
    seen = []

    def tune(console, options):
        clear_caches()
        seen.append((os.environ[HIDE_VAR], options.incumbent, choose_table("NVIDIA H100 80GB HBM3", (9, 0)).table))
        return 0

    monkeypatch.setattr(runner, "tune", tune)
    result = CliRunner().invoke(app, ["tune", "--interpret", "--shapes", "4x64", "--out", str(tmp_path / "t.json"),
                                      "--as-new-gpu", "--from", "h100"])
    assert result.exit_code == 0, result.output
    assert seen == [("1", None, None)]  # inherited by every process it spawns; the runtime chain sees no table
    clear_caches()


# -------------------------------------------------------------------------------------------------- resweep


def _row(problem: Problem, regret: float):
    return SimpleNamespace(problem=problem, regret=Ratio(regret, regret * 0.98, regret * 1.02))


def test_a_resweep_adds_a_fitted_shape_at_the_worst_heldout_width_and_raises_its_neighbours():
    fitted = _family()
    worst, fine = Problem("rms_norm", 3000, 3584, "bf16"), Problem("rms_norm", 9000, 1536, "bf16")
    targets = {p.key: 12 for p in fitted}
    decision = resweep.decide([_row(worst, 1.30), _row(fine, 1.005)], fitted, [worst, fine], targets, trials=40)
    added = [Problem.from_dict(d) for d in decision["added"]]
    assert added == [Problem("rms_norm", 4096, 3584, "bf16")]  # the fitted row count nearest 3000, its width
    assert decision["targets"][added[0].key] == 22 and decision["worst"][0]["problem"] == worst.key
    raised = set(decision["targets"]) - {added[0].key}
    assert len(raised) == 2 and all(decision["targets"][k] == 22 for k in raised)
    assert resweep.decide([_row(fine, 1.005)], fitted, [fine], targets, trials=40) is None
    noisy = SimpleNamespace(problem=fine, regret=Ratio(1.40, 0.09, 36.7))  # as fast as the best within its spread
    assert resweep.decide([noisy], fitted, [fine], targets, trials=40) is None
    surer = resweep.decide([noisy, _row(worst, 1.05)], fitted, [worst, fine], targets, trials=40)
    assert [w["problem"] for w in surer["worst"]] == [worst.key]


# ----------------------------------------------------------------------------------------------------- gate


def _table(configs: list[BackwardConfig]) -> dict:
    rules = [{"n_max": 96, "m_max": None, "config": configs[0].to_dict(), "fitted_on": ["4x64"]},
             {"n_max": None, "m_max": None, "config": configs[1].to_dict(), "fitted_on": ["8x128"]}]
    return {"schema_version": 1, "interpret": True, "gpu": {"name": "cpu (triton interpreter)", "key": "interpret"},
            "provenance": {}, "families": {RMS: {"rules": rules, "single_pass_max_n": 128}}}


A, B, HELD = Problem("rms_norm", 4, 64, "bf16"), Problem("rms_norm", 8, 128, "bf16"), Problem("rms_norm", 6, 80, "bf16")


def _other(problem: Problem) -> BackwardConfig:
    d = default_config(problem)
    return dataclasses.replace(d, kernel_2=dataclasses.replace(d.kernel_2, num_warps=2 if d.kernel_2.num_warps != 2
                                                               else 4))


def _lookup(times: dict):
    return lambda p, c: times.get((p.key, c.to_json()))


def test_a_rule_that_loses_to_the_default_falls_back_to_it():
    raw = _table([_other(A), _other(B)])
    table = parse_table(raw)
    slow, fast = Timing(20.0, 19.0, 21.0), Timing(10.0, 9.5, 10.5)
    times = {(HELD.key, table.lookup(HELD).to_json()): slow, (HELD.key, default_config(HELD).to_json()): fast}
    for p in (A, B):
        times[(p.key, table.lookup(p).to_json())] = fast
        times[(p.key, default_config(p).to_json())] = fast
    gated, record = gate.gate(raw, [A, B, HELD], None, None, _lookup(times))
    assert [(e["rule"], e["to"], e["lost_on"]) for e in record["fall_backs"]] == [(1, "default", ["6x80"])]
    assert BackwardConfig.from_dict(gated["families"][RMS]["rules"][0]["config"]) == default_config(A)
    assert gated["families"][RMS]["rules"][1] == raw["families"][RMS]["rules"][1]  # the other rule stays
    assert not record["still_slower"]


def test_a_rule_that_loses_only_off_its_fitted_shapes_is_carved_not_dropped():
    raw = _table([_other(A), _other(B)])
    table = parse_table(raw)
    between = Problem("rms_norm", 6, 128, "bf16")  # answered by the second rule, fitted on 8x128 only
    slow, fast = Timing(20.0, 19.0, 21.0), Timing(10.0, 9.5, 10.5)
    times = {(between.key, table.lookup(between).to_json()): slow,
             (between.key, default_config(between).to_json()): fast,
             (B.key, table.lookup(B).to_json()): fast, (B.key, default_config(B).to_json()): Timing(15.0, 14.5, 15.5)}
    for c in (table.lookup(A), default_config(A)):
        times[(A.key, c.to_json())] = fast
    gated, record = gate.gate(raw, [A, B, between], None, None, _lookup(times))
    assert not record["still_slower"]
    (edit,) = record["fall_backs"]
    assert edit["rule"] == 2 and edit["lost_on"] == ["6x128"] and edit["to"].startswith("carved out (m_max 6)")
    rules = gated["families"][RMS]["rules"]
    assert [r.get("m_max") for r in rules] == [None, 6, None] and rules[1]["fitted_on"] == ["6x128"]
    assert rules[0] == raw["families"][RMS]["rules"][0] and rules[2] == raw["families"][RMS]["rules"][1]
    new = parse_table(gated)
    assert new.lookup(between) == default_config(between)
    assert new.lookup(B) == _other(B)  # the tuned config stays where it was fitted and won
    lost_on_own = gate.carve(raw, RMS, 1, [B], None, None)
    assert lost_on_own is None  # a rule that loses where it was fitted falls back as a whole


def test_a_table_config_that_fails_on_a_shape_loses_there():
    raw = _table([_other(A), _other(B)])
    table = parse_table(raw)
    fast = Timing(10.0, 9.5, 10.5)
    times = {(HELD.key, table.lookup(HELD).to_json()): gate.FAILED, (HELD.key, default_config(HELD).to_json()): fast}
    checks = gate.check(table, [HELD], None, None, _lookup(times), None)
    assert checks[0].verdict == "slower than default"
    timed = gate.check(table, [HELD], None, None, lambda p, c: None,
                       lambda p, configs: {"table": None, "default": fast})  # timed now: the table's failed
    assert timed[0].verdict == "slower than default"


def test_a_table_slower_in_median_inside_the_spread_is_timed_head_to_head():
    raw = _table([_other(A), _other(B)])
    table = parse_table(raw)
    fast = Timing(10.0, 9.5, 10.5)
    times = {}
    for p in (A, B):
        times[(p.key, default_config(p).to_json())] = fast
        times[(p.key, table.lookup(p).to_json())] = fast
    times[(A.key, table.lookup(A).to_json())] = Timing(10.3, 9.6, 10.9)  # slower in median, inside the spread
    calls = []

    def head_to_head(slower_by):
        def timer(problem, configs):
            calls.append(problem.key)
            return {"table": Timing(10.0 * slower_by, 9.9 * slower_by, 10.1 * slower_by), "default": fast}
        return timer

    assert gate.check(table, [A, B], None, None, _lookup(times), None)[0].verdict == "ok"
    gated, record = gate.gate(raw, [A, B], None, None, _lookup(times), head_to_head(1.08))
    assert calls == [A.key]  # only the doubtful shape, once over the gate's passes
    assert record["retimed"] == [A.key] and not record["still_slower"]
    assert [(e["rule"], e["to"], e["lost_on"]) for e in record["fall_backs"]] == [(1, "default", ["4x64"])]
    assert parse_table(gated).lookup(A) == default_config(A)
    calls.clear()
    kept, record = gate.gate(raw, [A, B], None, None, _lookup(times), head_to_head(1.0))
    assert calls == [A.key] and record["retimed"] == [A.key] and not record["fall_backs"]
    assert kept == raw and not record["untimed"]
    unsure, record = gate.gate(raw, [A, B], None, None, _lookup(times), lambda p, c: {})  # out of time
    assert unsure == raw and record["untimed"] == [A.key]  # the next run times it
    from normtune.tuner.tune import report

    assert "Timed head to head at the gate" not in "\n".join(report._gate(record, None))
    lines = "\n".join(report._gate(gate.gate(raw, [A, B], None, None, _lookup(times), head_to_head(1.0))[1], None))
    assert "Timed head to head at the gate, the tune's own times having the table slower in median: 1 shape (" in lines


def test_a_losing_rule_takes_the_incumbents_config_else_the_default_else_goes():
    held = Problem("rms_norm", 6, 64, "bf16")  # answered by the first rule, as its fitted 4x64 is
    incumbent = parse_table(_table([_other(A), _other(B)]))
    at_default = _table([default_config(A), _other(B)])
    rule = at_default["families"][RMS]["rules"][0]
    assert gate._fallback(RMS, rule, [held], incumbent, None) == (incumbent.lookup(A), "incumbent")
    tuned = _table([_other(A), _other(B)])["families"][RMS]["rules"][0]
    assert gate._fallback(RMS, tuned, [held], None, None) == (default_config(A), "default")
    assert gate._fallback(RMS, rule, [held], None, None) == (None, "removed")  # it is the default already
    failing = gate.check(parse_table(at_default), [held], None, None, lambda p, c: None, None)
    failing[0].times = {"table": Timing(20.0, 19.0, 21.0), "default": Timing(10.0, 9.5, 10.5)}
    failing[0].against = {"default": _other(held)}
    assert failing[0].fails
    new, edits = gate.fall_back(at_default, failing, None, None)
    assert [(e["rule"], e["to"]) for e in edits] == [(1, "removed")] and len(new["families"][RMS]["rules"]) == 1
    parse_table(new)
    alone = {**at_default, "families": {RMS: {"rules": [{**rule, "fitted_on": ["4x64", "8x64"]}],
                                              "single_pass_max_n": 64}}}
    assert gate.fall_back(alone, failing, None, None)[0] is None  # no family left: no table


# -------------------------------------------------------------------------------------------------- journal


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    from pg_support import backend_database

    with backend_database(request.param, tmp_path, "the tune's journal") as url:
        yield url


def test_the_journal_keeps_decisions_and_the_time_over_runs(db_url, monkeypatch):
    from normtune.tuner.store.database import Store

    now = [1000.0]
    monkeypatch.setattr(J.time, "time", lambda: now[0])
    with Store(db_url) as store:
        journal = J.Journal(store, "normtune-tune:interpret:abc")
        journal.start_run()
        now[0] = 1010.0
        journal.touch()
        assert journal.append(J.ROUNDS, {"targets": {"a": 1}}) == 0
        now[0] = 1015.0  # killed here: its last touch was at 1010
        again = J.Journal(store, "normtune-tune:interpret:abc")
        assert again.get(J.ROUNDS) == [{"targets": {"a": 1}}] and again.get(J.SWEEP_DONE) is None
        again.start_run()
        now[0] = 1020.0
        assert again.elapsed_s() == pytest.approx(10.0 + 5.0)
        assert [s.study_name for s in store.workers.study_progress("normtune")] == []  # no trials in it


# -------------------------------------------------------------------------------------------------- warm start


def test_warm_start_tables_by_key_or_file(tmp_path):
    assert warm.resolve("H100").gpu_key == "h100"
    copy = tmp_path / "mine.json"
    copy.write_text(Path(next(t for t in shipped_tables() if t.gpu_key == "h200").path).read_text())
    assert warm.resolve(str(copy)).gpu_key == "h200"
    with pytest.raises(ValueError, match=r"--from nope: neither the GPU key of a shipped table \(h100, h200\)"):
        warm.resolve("nope")


@pytest.mark.parametrize("M, N, residual", [(4, 64, False), (8, 128, True), (4096, 8192, False), (96, 65536, True)])
def test_warm_seeds_are_configs_the_search_space_measures(M, N, residual):
    h100 = warm.resolve("h100")
    p = Problem("rms_norm", M, N, "bf16", residual=residual)
    (seed,) = warm.seeds(h100, [p], None, INTERPRET_SM_COUNT)[p.key]
    config = BackwardConfig.from_dict(seed)
    space = Space(p, INTERPRET_SM_COUNT, None)
    assert space.why_not(config) is None and space.canonical(config) == config
