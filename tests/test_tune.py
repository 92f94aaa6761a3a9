"""`normtune tune` end to end on CPU (`--interpret`, tiny shapes, two trials per problem), as a user would run it,
warm-started from the shipped H100 table and tuning as a new GPU. One tune, three runs of the same command: the
first is killed (SIGKILL) once it has stored a trial, the second has a time budget, the third goes through every
phase left (sweep rounds, emit, validate on generated held-out shapes, sweep again where the regret is highest,
emit and validate again, gate, table and report). What the database holds is then checked against what the tune
says it did: exact trial counts (none lost or measured twice over the kill), never a shape of the held-out preset,
the warm-start seeds measured.

Helpers for the other tune tests (`tune_args`, `journal_of`, `check_trial_counts`) live here too."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from sweep_support import INTERPRETER_ONLY, kill_group, run_sweep, start_sweep, sweep_env, wait_for

from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.kernels.select.tables import parse_table, read_table, shipped_tables
from normtune.tuner.measure.spread import Ratio
from normtune.tuner.shapes import HELDOUT
from normtune.tuner.store.database import Store
from normtune.tuner.sweep.options import study_name
from normtune.tuner.tables.validate import REFERENCE_PREFIX
from normtune.tuner.tune import journal as J
from normtune.tuner.tune import resweep
from normtune.tuner.tune.plan import JOURNAL_PREFIX

# One worker runs the module (`--dist loadgroup`): the `tuned` fixture's tune would run again on every worker.
pytestmark = [INTERPRETER_ONLY, pytest.mark.xdist_group("tune")]

SHAPES = "4x64,8x128"


def tune_args(tmp_path: Path, *more: str, trials: int = 2, forms: str = "plain,residual") -> list[str]:
    # A killed run's claims are taken over once its heartbeats stop for the grace period: a short one here.
    return ["tune", "--interpret", "--shapes", SHAPES, "--norm", "rms_norm", "--forms", forms, "--trials",
            str(trials), "--heldout", "1", "--reference-trials", "2", "--db", f"sqlite:///{tmp_path / 'tune.db'}",
            "--out", str(tmp_path / "table.json"), "--heartbeat-interval", "1", "--grace-period", "3", *more]


def tune_env(tmp_path: Path, **more: str) -> dict[str, str]:
    env = sweep_env(tmp_path, NORMTUNE_HOME=str(tmp_path / "home"), **more)
    env.pop("NORMTUNE_CONFIG", None)
    return env


def journal_of(tmp_path: Path, tune_id: str):
    """(store, journal) of the tune `tune_id` in tmp_path's database (close the store after use)."""
    store = Store(f"sqlite:///{tmp_path / 'tune.db'}")
    return store, J.Journal(store, f"{JOURNAL_PREFIX}:interpret:{tune_id}")


def fitted_problems(journal) -> list[Problem]:
    plan = journal.get(J.PLAN)
    keys = list(plan["problems"])
    added = [Problem.from_dict(d) for r in journal.get(J.RESWEEPS, []) for d in r["added"]]
    by_key = {p.key: p for p in added}
    problems = [_problem(k) for k in keys] + [by_key[k] for k in by_key if k not in keys]
    return problems


def _problem(key: str) -> Problem:
    from normtune.kernels.config import ProblemFamily

    family, shape = key.rsplit("/", 1)
    M, N = map(int, shape.split("x"))
    return ProblemFamily.from_key(family).problem(M, N)


def targets_of(journal) -> dict[str, int]:
    out = dict(journal.get(J.ROUNDS)[-1]["targets"])
    for r in journal.get(J.RESWEEPS, []):
        out.update(r["targets"])
    return out


def check_trial_counts(store, journal, tune_id: str) -> dict[str, int]:
    """Every fitted problem's study holds exactly its target's trials, each trial once; every reference study
    exactly --reference-trials. Returns problem key -> trials."""
    targets = targets_of(journal)
    counts = {}
    for p in fitted_problems(journal):
        name = study_name("interpret", p, True, f"{JOURNAL_PREFIX}-{tune_id}")
        numbers = [m.trial_number for m in store.measurements(study_name=name)]
        assert len(numbers) == len(set(numbers)), (name, numbers)  # no trial measured twice
        assert len(numbers) == targets[p.key], (p.key, len(numbers), targets[p.key])
        counts[p.key] = len(numbers)
    for key in journal.get(J.PLAN)["heldout"]:
        name = study_name("interpret", _problem(key), True, REFERENCE_PREFIX)
        assert len(store.measurements(study_name=name)) == 2, key
    return counts


def tune_measurements(db: Path) -> int:
    """How many trials of tune studies the database holds (0 before its tables exist)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            return con.execute("SELECT count(*) FROM normtune_measurements WHERE study_name LIKE "
                               "'normtune-tune-%'").fetchone()[0]
    except sqlite3.Error:
        return 0


BUDGET_S = 12.0


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One tune, as three runs of the same command: the first killed (SIGKILL, its whole process group) once it has
    stored a trial; the second under --time-budget; the third without a budget, to the end."""
    tmp_path = tmp_path_factory.mktemp("tune")
    args, env = tune_args(tmp_path, "--from", "h100", "--as-new-gpu"), tune_env(tmp_path)
    first = start_sweep(args, env, tmp_path, tmp_path / "first.log")
    wait_for(lambda: tune_measurements(tmp_path / "tune.db") > 0, 120, "a first stored trial", first,
             tmp_path / "first.log")
    kill_group(first)
    started = time.monotonic()
    budgeted = run_sweep(args + ["--time-budget", str(BUDGET_S)], env, tmp_path, timeout=120)
    budgeted_wall = time.monotonic() - started
    assert budgeted.returncode == 0, budgeted.stdout + budgeted.stderr
    best_so_far = (tmp_path / "table.json").read_text() if (tmp_path / "table.json").exists() else None
    result = run_sweep(args, env, tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    table = json.loads((tmp_path / "table.json").read_text())
    store, journal = journal_of(tmp_path, table["provenance"]["tune"]["id"])
    yield SimpleNamespace(tmp_path=tmp_path, result=result, table=table, store=store, journal=journal,
                          budgeted=budgeted, budgeted_wall=budgeted_wall, best_so_far=best_so_far)
    store.close()


def test_tune_writes_a_table_and_a_report_from_every_phase(tuned):
    tmp_path, result, table, store, journal = tuned.tmp_path, tuned.result, tuned.table, tuned.store, tuned.journal
    parse_table(table, "table.json")
    assert set(table["families"]) == {"rms_norm/bf16/wbf16/nobias/save-input",
                                      "rms_norm/bf16/wbf16/nobias/save-input/res-bf16"}
    assert len(journal.get(J.ROUNDS)) >= 2 and journal.get(J.SWEEP_DONE)
    validations, emissions = journal.get(J.VALIDATIONS), journal.get(J.EMISSIONS)
    assert len(emissions) >= 2 and validations  # the budgeted run's table, then the last run's
    # Where a held-out regret was high enough, the tune swept again, at that width, then emitted and validated again
    # (unless the table validated was superseded first: the budgeted run's table, its re-measurement cut short,
    # is emitted again from the same sweep by the next run, which validates that one instead).
    resweeps = journal.get(J.RESWEEPS, [])
    superseded = validations[0]["emission"] < len(emissions) - 1 and not emissions[validations[0]["emission"]][
        "remeasured"]
    assert resweeps or superseded or not any(r["regret"] and resweep.worth_resweeping(Ratio(**r["regret"]))
                                             for r in validations[0]["rows"])
    for r in resweeps:
        added = {f"{p['M']}x{p['N']}" for p in r["added"]}
        later = [e["table"] for e in emissions[validations[r["validation"]]["emission"] + 1:]]
        assert later and added <= {s for f in later[-1]["families"].values() for rule in f["rules"]
                                   for s in rule["fitted_on"]}
        assert any(v["emission"] > validations[r["validation"]]["emission"] for v in validations)  # validated again
    assert [v["elapsed_s"] for v in validations] == sorted(v["elapsed_s"] for v in validations)
    tune = table["provenance"]["tune"]
    assert tune["as_new_gpu"] and tune["from"].startswith("configs/h100.json sha256:")
    assert tune["incumbent"] is None and "gate" in tune and tune["held_out"]["shapes"] == 2
    report = tmp_path / "table-tune"
    text = (report / "report.md").read_text()
    for needle in ("## Time to table", "![time-to-table](time-to-table.png)", "## Held-out shapes", "## Gate",
                   "## Where the trials went", "tune --interpret --shapes 4x64,8x128"):
        assert needle in text, needle
    points = json.loads((report / "time-to-table.json").read_text())["points"]
    assert len(points) == len(validations) and all(p["geomean_regret"] >= 1.0 for p in points)
    assert (report / "time-to-table.png").stat().st_size > 0 and (report / "heldout.png").stat().st_size > 0
    assert "wrote" in result.stderr and "report:" in result.stderr and "held-out regret" in result.stderr


def test_tune_ends_every_study_with_exactly_its_target(tuned):
    counts = check_trial_counts(tuned.store, tuned.journal, tuned.table["provenance"]["tune"]["id"])
    assert all(n >= 1 for n in counts.values())
    assert len(tuned.journal.get(J.CLOCK)) == 3  # the killed run, the budgeted one, the last


def test_tune_never_sweeps_fits_or_validates_a_shape_of_the_heldout_preset(tuned):
    table, store, journal = tuned.table, tuned.store, tuned.journal
    preset = set(HELDOUT)
    measured = {(p.M, p.N) for p in store.problems()}
    assert measured and not measured & preset
    heldout = {_problem(k) for k in journal.get(J.PLAN)["heldout"]}
    fitted = {s for f in table["families"].values() for r in f["rules"] for s in r["fitted_on"]}
    assert heldout and not {(p.M, p.N) for p in heldout} & preset
    assert not {f"{p.M}x{p.N}" for p in heldout} & fitted  # generated held-out shapes are never fitted
    assert {(p.M, p.N) for p in heldout} <= measured  # but validated on


def test_warm_start_seeds_are_measured_and_as_new_gpu_hides_the_incumbent(tuned):
    table, store, journal = tuned.table, tuned.store, tuned.journal
    from normtune.tuner.tune.warm import seeds

    h100 = next(t for t in shipped_tables() if t.gpu_key == "h100")
    plan = journal.get(J.PLAN)
    assert plan["as_new_gpu"] and journal.get(J.INCUMBENT) == {"label": None, "record": None}
    tune_id = table["provenance"]["tune"]["id"]
    for key in plan["problems"]:
        p = _problem(key)
        wanted = seeds(h100, [p], None, INTERPRET_SM_COUNT)[key][0]
        name = study_name("interpret", p, True, f"{JOURNAL_PREFIX}-{tune_id}")
        measured = {m.config for m in store.measurements(study_name=name)}
        assert BackwardConfig.from_dict(wanted) in measured, key  # measured, not trusted
    assert read_table(str(tuned.tmp_path / "table.json")).gpu_key == "interpret"


def test_the_time_budget_is_a_hard_limit_and_leaves_the_best_table_so_far(tuned):
    budgeted = tuned.budgeted
    done = re.search(r"done in (\d+) s of the 12 s budget; stopped early", budgeted.stderr)
    assert done and int(done.group(1)) <= BUDGET_S, budgeted.stderr
    assert tuned.budgeted_wall < BUDGET_S + 8, tuned.budgeted_wall  # the interpreter's own start and exit besides
    assert tuned.best_so_far is not None, budgeted.stderr  # a trial was stored before: a table fitted on it
    parse_table(json.loads(tuned.best_so_far), "best so far")
