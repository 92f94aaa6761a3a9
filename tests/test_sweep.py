"""End-to-end tests of the sweep driver (`normtune sweep`: cli.py → tuner/sweep.py → tuner/store/database.py) on CPU.

Every sweep here runs with `--interpret`: the spawned measuring process runs the Triton kernels in the
interpreter on tiny problems (40x96, 24x200), so the timings mean nothing but every code path of the driver
runs -- ask/tell, the measuring process and its timeout, heartbeats, resume, signals, the time budget -- against
a SQLite database in tmp_path. Sweeps run both in-process through typer's CliRunner and as real processes
(fresh interpreters, killed with real signals). Failures are injected without any hook in normtune: a
`sitecustomize.py` on the sweep's PYTHONPATH patches `BackwardLaunch` in the measuring process
(tests/sweep_support.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import signal
import socket
import sqlite3
import time
from collections import Counter
from importlib import metadata

import optuna
import pytest
import torch
import triton
from optuna.trial import TrialState as TS
from sweep_support import (INTERPRETER_ONLY, check_studies, kill_group, load_study, measurement_rows, run_sweep, running_trials,
                           start_sweep, sweep_args, sweep_env, wait_for)
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import BackwardConfig, Problem, default_config
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.tuner.space import K1_DOMAINS, K2_DOMAINS, Space
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import SweepOptions, study_name
from normtune.tuner.sweep.options import space_tag

pytestmark = INTERPRETER_ONLY

RMS_A = Problem("rms_norm", 40, 96, "bf16")
RMS_B = Problem("rms_norm", 24, 200, "bf16")
# Seconds before a trial counts as hung: an interpreted measurement of these shapes takes well under a second,
# the first one after a (re)start of the measuring process about one (building the inputs and the reference); the
# clock starts once the restarted process is ready, so its start-up is not counted.
TRIAL_TIMEOUT = 5


def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'results.db'}"


def names(*problems: Problem) -> list[str]:
    return [study_name("interpret", p, interpret=True) for p in problems]


def invoke(args: list[str]):
    return CliRunner().invoke(app, args)


def knobs(config: BackwardConfig) -> dict:
    """{"kernel_1.block_row": 16, …}: every knob of both kernels, as the fault rules name them."""
    return {f"{kernel}.{f.name}": getattr(getattr(config, kernel), f.name) for kernel in ("kernel_1", "kernel_2")
            for f in dataclasses.fields(getattr(config, kernel))}


def matches(config: BackwardConfig, match: dict) -> bool:
    return all(knobs(config)[key] == value for key, value in match.items())


# ----------------------------------------------------------------------------------- CLI, provenance, names


def test_study_names_are_deterministic(monkeypatch):
    from normtune.tuner import space as space_module

    tag = space_tag(RMS_A)
    assert study_name("h100", RMS_A) == f"normtune:h100:{RMS_A.key}:space-{tag}" == study_name("h100", Problem(
        "rms_norm", 40, 96, "bfloat16", "bf16"))
    # Interpreted results get their own studies whatever --gpu says: they must never mix with GPU timings.
    assert study_name("h100", RMS_A, interpret=True) == study_name("h200", RMS_A, interpret=True) \
        == f"normtune:interpret:{RMS_A.key}:space-{tag}"
    assert study_name("h100", RMS_A, prefix="validate") == f"validate:h100:{RMS_A.key}:space-{tag}"
    assert len({study_name("h100", p) for p in (RMS_A, RMS_B, Problem("layer_norm", 40, 96))}) == 3
    # A grown search space opens a new study (Optuna cannot change a parameter's choices within one).
    monkeypatch.setattr(space_module, "K1_DOMAINS", {**K1_DOMAINS, "num_stages": (1, 2, 3, 4)})
    assert space_tag(RMS_A) != tag and study_name("h100", RMS_A) != f"normtune:h100:{RMS_A.key}:space-{tag}"


def test_worker_options_travel_to_a_spawned_worker_unchanged():
    """A multi-GPU worker gets its options as plain data: problems and the timing preset come back as values."""
    from normtune.tuner.measure.harness import Timing
    from normtune.tuner.sweep.device_workers import options_from_dict, options_to_dict, worker_options
    from normtune.tuner.sweep.options import SweepOptions

    opts = SweepOptions(gpu_key="h100", problems=[Problem("rms_norm", 64, 512)], trials=5,
                        timing=Timing(min_reps=7, max_reps=9, budget_s=0.1))
    for worker in worker_options(opts, [0, 1]):
        back = options_from_dict(options_to_dict(worker))
        assert back == worker and isinstance(back.timing, Timing) and back.timing.min_reps == 7


def test_compile_processes_grow_with_the_gpus_within_the_cores():
    """Each GPU gets its own compilers by default (a shared budget made a second GPU wait on them), never more
    than the host's cores leave after each GPU's sweep worker and measuring process."""
    from normtune.tuner.sweep.compiling import COMPILERS_PER_GPU, default_compile_workers, share_of

    assert default_compile_workers(1, cpus=64) == COMPILERS_PER_GPU
    assert default_compile_workers(2, cpus=64) == 2 * COMPILERS_PER_GPU
    assert [share_of(default_compile_workers(2, cpus=64), 2, i) for i in (0, 1)] == [COMPILERS_PER_GPU] * 2
    assert default_compile_workers(1, cpus=16) == 14  # 16 cores less 2 per GPU
    assert default_compile_workers(4, cpus=16) == 8
    assert default_compile_workers(8, cpus=8) == 1 and default_compile_workers(1, cpus=1) == 1


def test_compile_processes_count_only_the_cores_this_process_may_use(monkeypatch):
    """A sweep pinned to some of the host's cores (taskset, a cgroup cpuset) sizes its compile pool by those."""
    import os

    from normtune.tuner.sweep import compiling

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert compiling.usable_cpus() == 16
    assert compiling.default_compile_workers(1) == 14


def test_cli_runner_sweep_stores_trials_with_provenance(tmp_path):
    url = sqlite_url(tmp_path)
    summary_path = tmp_path / "summary.json"
    result = invoke(sweep_args(url, shapes="40x96,24x200", trials=3, extra=["--summary", str(summary_path)]))
    assert result.exit_code == 0, result.output
    # The command's closing steps, in order, each at a time since the command started.
    (closing,) = [line for line in result.output.splitlines() if "closing steps" in line]
    times = re.findall(r"(sweep returned|view closed|store closed) ([0-9.]+)", closing)
    assert [name for name, _ in times] == ["sweep returned", "view closed", "store closed"], closing
    assert [float(t) for _, t in times] == sorted(float(t) for _, t in times), closing

    with Store(url) as store:
        (run,) = store.runs()
        assert (run.kind, run.status, run.gpu_key, run.interpret) == ("sweep", "finished", "interpret", True)
        assert run.gpu_name == "cpu (triton interpreter)" and run.device.sm_count == INTERPRET_SM_COUNT
        assert (run.device.torch, run.device.triton) == (torch.__version__, triton.__version__)
        assert (run.device.host, run.device.python) == (socket.gethostname(), platform.python_version())
        assert run.device.normtune == metadata.version("normtune")
        assert run.command_line and run.ended_at is not None and run.ended_at >= run.started_at
        for problem, name in zip((RMS_A, RMS_B), names(RMS_A, RMS_B)):
            rows = store.measurements(study_name=name)
            assert [m.trial_number for m in rows] == [0, 1, 2]
            assert {(m.run_id, m.problem, m.status, m.interpret, m.gpu_key) for m in rows} == {
                (run.id, problem, "ok", True, "interpret")}
            assert all(m.median_us > 0 and m.reps >= 1 and m.error is None for m in rows)
            # The study starts with its seeds: the default config first, then its neighbours.
            space = Space(problem, INTERPRET_SM_COUNT)
            assert rows[0].config == space.canonical(default_config(problem))
            assert {m.source for m in rows} == {"seed"} and len({m.config for m in rows}) == 3
            best = store.best(problem, gpu_key="interpret", interpret=True)
            assert best.median_us == min(m.median_us for m in rows)
            assert store.best(problem, gpu_key="interpret", interpret=False) is None  # never mixed with GPU data

    # Optuna's studies live in the same file as normtune's tables.
    tables = {r[0] for r in sqlite3.connect(tmp_path / "results.db").execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"normtune_runs", "normtune_measurements", "studies", "trials", "trial_heartbeats"} <= tables
    assert sorted(optuna.get_all_study_names(url)) == sorted(names(RMS_A, RMS_B))
    check_studies(url, names(RMS_A, RMS_B), 3)

    summary = json.loads(summary_path.read_text())
    assert summary["stopped"] is None and summary["remaining"] == []
    assert [(p["problem"], p["study"], p["trials"], p["measured_now"], p["failures"]) for p in summary["problems"]] \
        == [(RMS_A.key, names(RMS_A)[0], 3, 3, {}), (RMS_B.key, names(RMS_B)[0], 3, 3, {})]


def test_subprocess_sweep_rerun_adds_only_the_difference(tmp_path):
    """A sweep started by the `normtune` console script records its command line as typed; re-running it with more
    trials (here through `python -c`) measures only the trials the first run did not."""
    import shutil

    script = shutil.which("normtune")  # None where the package is not installed (pip install -e .)
    url = sqlite_url(tmp_path)
    env = sweep_env(tmp_path)
    first = run_sweep(sweep_args(url, shapes="40x96,24x200", trials=3), env, tmp_path,
                      program=[script] if script else None)
    assert first.returncode == 0, first.stderr
    assert "interpreter timings" in first.stderr and f"{RMS_A.key}: 3 trials" in first.stderr
    before = measurement_rows(url)
    assert len(before) == 6
    check_studies(url, names(RMS_A, RMS_B), 3)

    second = run_sweep(sweep_args(url, shapes="40x96,24x200", trials=5), env, tmp_path)
    assert second.returncode == 0, second.stderr
    after = measurement_rows(url)
    assert after[:6] == before, "a re-run changed measurements committed before it"
    with Store(url) as store:
        runs = store.runs()
    assert [(r.kind, r.status, r.interpret, r.gpu_key) for r in runs] == [("sweep", "finished", True, "interpret")] * 2
    assert "sweep --interpret" in runs[0].command_line and "--trials 3" in runs[0].command_line
    if script:
        # The program by its name, paths under the working folder (here tmp_path) relative: no machine paths.
        typed = " ".join(a.replace(f"{tmp_path}/", "") for a in sweep_args(url, shapes="40x96,24x200", trials=3))
        assert runs[0].command_line == f"normtune {typed}" and str(tmp_path) not in runs[0].command_line
    assert "--trials 5" in runs[1].command_line and runs[1].device.host == socket.gethostname()
    new = after[6:]
    assert sorted((r["study_name"], r["trial_number"]) for r in new) == sorted(
        (name, n) for name in names(RMS_A, RMS_B) for n in (3, 4)), "the re-run measured more than the difference"
    assert {r["run_id"] for r in new} == {runs[1].id}
    check_studies(url, names(RMS_A, RMS_B), 5)


def test_time_budget_stops_early_and_reports_what_remains(tmp_path):
    url = sqlite_url(tmp_path)
    env = sweep_env(tmp_path)
    summary_path = tmp_path / "summary.json"
    # The first problem's second seed takes 3 s: a 1 s budget runs out while it measures, whatever the machine's
    # speed, and the second problem is never reached.
    slow = sweep_env(tmp_path, [{"match": knobs(Space(RMS_A, INTERPRET_SM_COUNT).seeds()[1]), "fault": "slow"}],
                     NORMTUNE_TEST_SLOW_S="3")
    result = run_sweep(sweep_args(url, shapes="40x96,24x200", trials=4,
                                  extra=["--time-budget", "1", "--summary", str(summary_path)]), slow, tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["stopped"] == "time budget"
    assert any(RMS_B.key in item for item in summary["remaining"]), summary["remaining"]
    assert "stopped (time budget); remaining:" in result.stderr and RMS_B.key in result.stderr
    assert "Re-run the same command to continue" in result.stderr
    rows = measurement_rows(url)
    assert len(rows) < 8
    # Stopping left nothing RUNNING: asked-but-unmeasured trials were abandoned (pruned), not left to go stale.
    for name in optuna.get_all_study_names(url):
        study = load_study(url, name)
        assert not study.get_trials(states=(TS.RUNNING, TS.WAITING)), name
        for t in study.get_trials(states=(TS.PRUNED,)):
            assert t.user_attrs.get("status") in ("abandoned", "invalid")
    with Store(url) as store:
        assert [r.status for r in store.runs()] == ["finished"]

    again = run_sweep(sweep_args(url, shapes="40x96,24x200", trials=4), env, tmp_path)
    assert again.returncode == 0, again.stderr
    assert measurement_rows(url)[:len(rows)] == rows
    check_studies(url, names(RMS_A, RMS_B), 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given on a machine without a GPU")
def test_gpu_without_a_gpu_is_a_clear_error_and_interpret_works(tmp_path):
    db = tmp_path / "results.db"
    url = sqlite_url(tmp_path)
    result = invoke(["sweep", "--gpu", "h100", "--norm", "rms_norm", "--shapes", "40x96", "--trials", "1",
                     "--db", url])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--interpret" in lines[0], result.output
    assert "Traceback" not in result.output and not db.exists()

    result = invoke(["sweep", "--gpu", "h100", "--interpret", "--norm", "rms_norm", "--shapes", "40x96",
                     "--trials", "1", "--db", url])
    assert result.exit_code == 1 and "--gpu" in result.output and "--interpret" in result.output, result.output
    assert "Traceback" not in result.output and not db.exists()  # refused before anything is opened

    result = invoke(["sweep", "--interpret", "--norm", "rms_norm", "--shapes", "40x96", "--trials", "1",
                     "--db", url])
    assert result.exit_code == 0, result.output
    with Store(url) as store:
        (run,) = store.runs()
        assert (run.gpu_key, run.interpret) == ("interpret", True)  # never labelled as H100 data
        assert store.measurements(gpu_key="h100") == []
    check_studies(url, names(RMS_A), 1)


@pytest.mark.parametrize("option, value", [
    ("--sampler", "bogus"),
    ("--trials", "0"),
    ("--trials", "-3"),
    ("--shapes", "12by34"),
    ("--shapes", "40x"),
    ("--shapes", "40x0"),
    ("--save", "weights"),
    ("--norm", "group_norm"),
    ("--dtype", "bf17"),
    ("--weight-dtype", "int8"),
    ("--time-budget", "0"),
    ("--trial-timeout", "0"),
    ("--heartbeat-interval", "0"),
    ("--grace-period", "0"),
    ("--devices", "0,1"),
    ("--devices", "-1"),
    ("--device", "-3"),
    ("--seed", "-1"),
    ("--shapes", "0x64"),
])
def test_bad_options_are_one_line_errors_naming_the_option(tmp_path, option, value):
    url = sqlite_url(tmp_path)
    result = invoke(sweep_args(url, trials=1) + [option, value])
    assert result.exit_code == 1, f"{option} {value}: exit code {result.exit_code}\n{result.output}"
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"{option} {value} raised {result.exception!r} instead of a one-line error"
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert option in lines[0], f"the error does not name {option}: {lines[0]}"
    if (tmp_path / "results.db").exists():
        with Store(url) as store:
            assert store.runs() == [], "a rejected sweep recorded a run"


# ------------------------------------------------------------------------------------------ failure injection


def fault_rules(problem: Problem, faults: list[str], trials: int = 6) -> list[dict]:
    """One rule per fault, each on a knob value that exactly one of the first `trials` seeds has (the first
    trials measure the seeds in order, so each fault hits one early trial and the default stays correct)."""
    seeds = Space(problem, INTERPRET_SM_COUNT).seeds()[:trials]
    rules = []
    for seed in seeds[1:]:
        if len(rules) == len(faults):
            break
        only_here = [(key, value) for key, value in knobs(seed).items()
                     if sum(knobs(other)[key] == value for other in seeds) == 1]
        if only_here:
            key, value = only_here[0]
            rules.append({"match": {key: value}, "fault": faults[len(rules)]})
    assert len(rules) == len(faults), "too few distinct seeds to inject every fault"
    return rules


def test_failures_are_recorded_as_failed_trials_never_a_crash(tmp_path):
    url = sqlite_url(tmp_path)
    trials = 6
    rules = fault_rules(RMS_A, ["hang", "incorrect", "compile_error"])  # the hang early: trials follow it
    status_of = {"compile_error": "compile_error", "incorrect": "incorrect", "hang": "timeout"}

    def expected(config: BackwardConfig) -> str:
        return next((status_of[r["fault"]] for r in rules if matches(config, r["match"])), "ok")

    summary_path = tmp_path / "summary.json"
    env = sweep_env(tmp_path, rules, NORMTUNE_TEST_HANG_S="300")
    result = run_sweep(sweep_args(url, trials=trials, extra=["--trial-timeout", str(TRIAL_TIMEOUT),
                                                             "--summary", str(summary_path)]), env, tmp_path)
    assert result.returncode == 0, result.stderr

    name = names(RMS_A)[0]
    with Store(url) as store:
        rows = store.measurements(study_name=name)
        best = store.best(RMS_A, gpu_key="interpret", interpret=True)
    assert len(rows) == trials
    assert {expected(m.config) for m in rows} == {"ok", "compile_error", "incorrect", "timeout"}, \
        f"the injected properties {rules} did not all occur in the trials"
    for m in rows:
        assert m.status == expected(m.config), (m.config, m.status, m.error)
        if m.status == "ok":
            assert m.error is None and m.median_us > 0
        elif m.status == "compile_error":
            assert m.error.startswith("CompilationError:") and "injected by the test" in m.error
            assert m.median_us is None
        elif m.status == "incorrect":
            assert "dx relative error" in m.error and m.errors["dx"] > 1 and m.median_us is None
        else:
            assert m.error == f"no result within {TRIAL_TIMEOUT} s (killed)" and m.median_us is None
    ok = [m for m in rows if m.status == "ok"]
    assert best is not None and best.status == "ok" and expected(best.config) == "ok"
    assert best.median_us == min(m.median_us for m in ok)

    study = load_study(url, name)
    told = study.get_trials(states=(TS.COMPLETE, TS.FAIL))
    assert sorted(t.number for t in told) == sorted(m.trial_number for m in rows)
    for t in told:
        row = next(m for m in rows if m.trial_number == t.number)
        assert t.user_attrs["status"] == row.status
        assert t.state == (TS.COMPLETE if row.status == "ok" else TS.FAIL), (t.number, t.state, row.status)
        if row.status != "ok":
            assert t.user_attrs["error"] == row.error[:1000]
    assert expected(BackwardConfig.from_json(study.best_trial.user_attrs["config"])) == "ok"
    check_studies(url, [name], trials)

    summary = json.loads(summary_path.read_text())
    (ps,) = summary["problems"]
    assert ps["failures"] == dict(Counter(m.status for m in rows if m.status != "ok"))
    assert expected(BackwardConfig.from_dict(ps["best_config"])) == "ok" and ps["best_us"] == best.median_us

    # The hung measuring process was killed, and a fresh one measured the trials after it.
    log = [line.split(" ", 2) for line in (tmp_path / "faults.log").read_text().splitlines()]
    hung = [i for i, (_, fault, _) in enumerate(log) if fault == "hang"]
    assert len(hung) == ps["failures"]["timeout"]
    pid = int(log[hung[0]][0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    after = {int(p) for p, _, _ in log[hung[0] + 1:]}
    assert after and pid not in after, "no measuring process was restarted after the timeout"


# ----------------------------------------------------------------------------------------- kill and resume


@pytest.mark.parametrize("kill_at", ["first-heartbeat-pending", "after-heartbeats"])
def test_resume_after_sigkill_loses_nothing_and_ends_at_the_target(tmp_path, kill_at):
    """SIGKILL the sweep (and its measuring process) in the middle of its third trial, after two measurements
    were committed; re-running the same command must keep them and end with exactly `target` trials.

    The third seed config is made slow (in the killed run only), so the kill lands mid-trial for sure:
    `first-heartbeat-pending` kills as soon as that trial started (well within the first heartbeat interval, so
    usually before any heartbeat of it was stored) and re-runs at once; `after-heartbeats` waits until a heartbeat
    of it is stored and re-runs once the grace period is over."""
    url = sqlite_url(tmp_path)
    target, grace = 8, 2
    args = sweep_args(url, shapes="40x96,24x200", trials=target,
                      extra=["--heartbeat-interval", "1", "--grace-period", str(grace)])
    rules = [{"match": knobs(Space(RMS_A, INTERPRET_SM_COUNT).seeds()[2]), "fault": "slow"}]
    log, faults = tmp_path / "killed.log", tmp_path / "faults.log"
    proc = start_sweep(args, sweep_env(tmp_path, rules, NORMTUNE_TEST_SLOW_S="60"), tmp_path, log)
    name_a = names(RMS_A)[0]
    try:
        wait_for(lambda: len(measurement_rows(url)) >= 2 and faults.exists() and " slow " in faults.read_text(),
                 180, "two committed measurements and the slow trial", proc, log)
        if kill_at == "after-heartbeats":
            wait_for(lambda: any(n == name_a and beats for n, _, beats in running_trials(url)), 30,
                     "a heartbeat of the slow trial", proc, log)
        assert proc.poll() is None, "the sweep finished before it could be killed"
    finally:
        kill_group(proc)  # the sweep and its measuring process, mid-trial
    committed = measurement_rows(url)
    assert [(r["study_name"], r["trial_number"]) for r in committed] == [(name_a, 0), (name_a, 1)]
    killed = running_trials(url)
    running = [(n, number) for n, number, _ in killed]
    assert (name_a, 2) in running, running
    # A trial whose measurement was committed but not yet told to Optuna when the kill came (trial 1, when the kill
    # lands between the two) stays RUNNING: the re-run tells it from the store, without measuring it again.
    measured = {(r["study_name"], r["trial_number"]) for r in committed}
    # The others were proposed ahead while trial 2 measured: later slots, within the look-ahead, never measured.
    ahead = [t for t in running if t != (name_a, 2) and t not in measured]
    held = SweepOptions(gpu_key="interpret", problems=[RMS_A, RMS_B], trials=target).held_ahead(0)  # no pool
    assert len(ahead) <= held and all(number > 2 for n, number in ahead if n == name_a), running
    if kill_at == "after-heartbeats":
        time.sleep(grace + 1)  # its heartbeat is stale now: the re-run fails it and re-queues it

    result = run_sweep(args, sweep_env(tmp_path), tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {r["id"]: r for r in measurement_rows(url)}
    for row in committed:
        assert rows.get(row["id"]) == row, f"measurement {row['id']} changed or vanished after the re-run"
    # The killed trial ended FAIL (its run dead, never measured); its slot was taken over and its seed config
    # measured once by a new trial.
    trials = {t.number: t for t in load_study(url, name_a).get_trials()}
    assert trials[2].state == TS.FAIL, (
        f"the killed trial 2 ({killed} heartbeats stored when it was killed) is {trials[2].state.name} after "
        "the re-run: it was never failed nor its slot taken over")
    for n, number in ahead:  # failed too, never measured
        t = load_study(url, n).get_trials()[number]
        assert t.state == TS.FAIL and "status" not in t.user_attrs, (n, number, t.state, t.user_attrs)
    for n, number in measured:  # told from its committed measurement, whether or not the kill came first
        assert load_study(url, n).get_trials()[number].state in (TS.COMPLETE, TS.FAIL), (n, number)
    assert "status" not in trials[2].user_attrs
    retries = [t for t in trials.values() if t.number != 2 and t.params == trials[2].params]
    assert len(retries) == 1 and retries[0].state in (TS.COMPLETE, TS.FAIL)
    assert not load_study(url, name_a).get_trials(states=(TS.WAITING,))
    check_studies(url, names(RMS_A, RMS_B), target)
    with Store(url) as store:
        statuses = [r.status for r in store.runs()]
    assert statuses == ["dead", "finished"]  # the killed run is marked dead by the re-run; the re-run ended


def test_sigterm_finishes_the_current_trial_and_stops(tmp_path):
    url = sqlite_url(tmp_path)
    args = sweep_args(url, shapes="40x96,24x200", trials=8)
    log = tmp_path / "sweep.log"
    proc = start_sweep(args, sweep_env(tmp_path), tmp_path, log)
    try:
        wait_for(lambda: len(measurement_rows(url)) >= 1, 180, "a committed measurement", proc, log)
        os.kill(proc.pid, signal.SIGTERM)  # the sweep only: it stops its measuring process itself
        assert proc.wait(60) == 143, log.read_text()  # 128 + SIGTERM, after saving
    finally:
        kill_group(proc)
    output = log.read_text()
    assert "SIGTERM: finishing the current trial" in output and "stopped (interrupted)" in output
    rows = measurement_rows(url)
    assert 0 < len(rows) < 16
    with Store(url) as store:
        assert [r.status for r in store.runs()] == ["interrupted"]
    for name in optuna.get_all_study_names(url):
        study = load_study(url, name)
        assert not study.get_trials(states=(TS.RUNNING,)), f"{name}: a trial left RUNNING after SIGTERM"
        told = study.get_trials(states=(TS.COMPLETE, TS.FAIL))
        assert sorted(t.number for t in told) == sorted(r["trial_number"] for r in rows if r["study_name"] == name)


# ------------------------------------------------------------------------------------------------ samplers


def test_grid_sampler_covers_a_tiny_space_and_never_exceeds_it(tmp_path, monkeypatch):
    from normtune.tuner import space as space_module

    # A space of four configs (two row tiles x two kernel_2 tiles); the sweep runs in this process. The shared
    # knobs' domains are the space's; the strategy's and the rows strategy's own are narrowed where they are drawn.
    monkeypatch.setattr(space_module, "K1_DOMAINS", {**K1_DOMAINS, "block_row": (8, 16), "num_warps": (4,),
                                                     "num_stages": (1,), "programs_per_sm": (1,),
                                                     "eviction_policy": ("",), "prefetch": (False,)})
    monkeypatch.setattr(space_module, "K2_DOMAINS", {**K2_DOMAINS, "block_m": (64, 128), "block_n": (16,),
                                                     "num_warps": (4,), "num_stages": (1,), "pdl": (False,),
                                                     "fused": (False,)})
    domains = space_module.Space.domains
    rows_only = {"k1.strategy": ("rows",), "k1.recompute": (False,), "k1.row_split": (1,), "k1.two_pass": (False,),
                 "k1.column_accumulators": (False,), "k1.pipelined_split": (False,)}
    monkeypatch.setattr(space_module.Space, "offered", lambda self: ("rows",))
    monkeypatch.setattr(space_module.Space, "domains",
                        lambda self, strategy=None: {**domains(self, "rows"), **rows_only})
    grid = list(Space(RMS_A, INTERPRET_SM_COUNT))
    assert len(grid) == 4
    url = sqlite_url(tmp_path)
    name = names(RMS_A)[0]

    result = invoke(sweep_args(url, trials=3, sampler="grid"))
    assert result.exit_code == 0, result.output
    check_studies(url, [name], 3)
    result = invoke(sweep_args(url, trials=50, sampler="grid"))
    assert result.exit_code == 0, result.output
    assert f"{RMS_A.key}: 4 trials" in result.output
    check_studies(url, [name], len(grid))
    with Store(url) as store:
        configs = [m.config for m in store.measurements(study_name=name)]
    assert sorted(configs, key=str) == sorted(grid, key=str), "the grid was not covered exactly once"
    assert len(load_study(url, name).get_trials()) == len(grid), "the grid sampler asked past the space"


def test_double_interrupt_abandons_the_trial_exits_130_and_counts_what_remains(tmp_path):
    """Ctrl-C twice while a (slow) trial is measured: the trial is abandoned at once, nothing is left RUNNING,
    the exit status is 130 (128 + SIGINT) and the message counts, per problem, what the database still lacks."""
    url = sqlite_url(tmp_path)
    trials = 4
    args = sweep_args(url, shapes="40x96,24x200", trials=trials)
    rules = [{"match": knobs(Space(RMS_A, INTERPRET_SM_COUNT).seeds()[1]), "fault": "slow"}]
    log, faults = tmp_path / "sweep.log", tmp_path / "faults.log"
    proc = start_sweep(args, sweep_env(tmp_path, rules, NORMTUNE_TEST_SLOW_S="120"), tmp_path, log)
    try:
        wait_for(lambda: faults.exists() and " slow " in faults.read_text(), 180, "the slow trial", proc, log)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130, log.read_text()
    finally:
        kill_group(proc)
    output = " ".join(log.read_text().split())
    rows = measurement_rows(url)
    done = Counter(r["study_name"] for r in rows)
    expected = "; ".join(f"{p.key}: {trials - done[n]} trials" for p, n in zip((RMS_A, RMS_B), names(RMS_A, RMS_B)))
    assert f"stopped (interrupted); remaining: {expected}." in output, output
    assert "abandoning the current trial" in output
    abandoned = {}
    for name in optuna.get_all_study_names(url):
        study = load_study(url, name)
        assert not study.get_trials(states=(TS.RUNNING, TS.WAITING)), name
        abandoned[name] = [t.number for t in study.get_trials(states=(TS.PRUNED,))
                           if t.user_attrs.get("status") == "abandoned"]
    # The slow trial (slot 1 of the first problem), and the trials proposed ahead while it measured: all pruned
    # as abandoned, none measured.
    assert {1} <= set(abandoned[names(RMS_A)[0]]), abandoned
    held = SweepOptions(gpu_key="interpret", problems=[RMS_A, RMS_B], trials=trials).held_ahead(0)  # no pool
    assert sum(map(len, abandoned.values())) <= 1 + held, abandoned
    measured = {(r["study_name"], r["trial_number"]) for r in rows}
    assert not measured & {(n, k) for n, numbers in abandoned.items() for k in numbers}
    with Store(url) as store:
        assert [r.status for r in store.runs()] == ["interrupted"]
    again = run_sweep(args, sweep_env(tmp_path), tmp_path)  # the re-run measures the abandoned slot's seed
    assert again.returncode == 0, again.stderr
    check_studies(url, names(RMS_A, RMS_B), trials)


def test_a_trial_whose_worker_died_before_its_first_heartbeat_is_failed(tmp_path):
    """A worker killed between creating a trial and its first heartbeat leaves a RUNNING trial that Optuna's
    stale-trial check never sees; the next worker's repair fails it once it is older than the grace period."""
    import datetime as dt

    import optuna
    from sqlalchemy import text

    from normtune.tuner.sweep.options import SweepOptions
    from normtune.tuner.sweep.trials import StudyBook

    url = sqlite_url(tmp_path)
    opts = SweepOptions(gpu_key="interpret", problems=[RMS_A], interpret=True, heartbeat_interval=1, grace_period=2)
    with Store(url) as store:
        storage = store.optuna_storage(heartbeat_interval=1, grace_period=2)
        book = StudyBook(opts, RMS_A, INTERPRET_SM_COUNT, True, storage)
        orphan = book.study.ask()  # no heartbeat: its worker "died" at once
        alive = book.study.ask()
        storage.record_heartbeat(alive._trial_id)
        with store.session_scope() as session:  # both started long ago; only `alive` keeps beating
            session.execute(text("UPDATE trials SET datetime_start = :t"),
                            {"t": dt.datetime.now() - dt.timedelta(seconds=60)})
        book.repair(store)
        states = {t.number: t.state for t in book.study.get_trials(deepcopy=False)}
    assert states[orphan.number] == optuna.trial.TrialState.FAIL
    assert states[alive.number] == optuna.trial.TrialState.RUNNING  # its heartbeat is fresh: not stale


def test_repair_tells_a_dead_workers_trial_and_leaves_a_live_workers_alone(tmp_path, caplog):
    """`repair` (a worker opening a study) tells a trial measured but never told, its worker dead; a live
    worker's trial, stored and told in one transaction while repair reads the store, is not told again and
    logs no warning (read in the other order it looked untold: "finished by another worker")."""
    import logging

    from test_store import ok

    from normtune.tuner.gpu_info import detect
    from normtune.tuner.sweep.options import SweepOptions
    from normtune.tuner.sweep.trials import NewTrial, StudyBook

    url = sqlite_url(tmp_path)
    opts = SweepOptions(gpu_key="interpret", problems=[RMS_A], interpret=True)
    config = default_config(RMS_A)
    with Store(url) as store:
        storage = store.optuna_storage()
        book = StudyBook(opts, RMS_A, INTERPRET_SM_COUNT, True, storage)
        run_id = store.start_run(detect(interpret=True), kind="sweep", command_line="x")
        dead, live = book.study.ask(), book.study.ask()
        store.add_measurement(run_id, RMS_A, config, ok(50.0), source="sweep", study_name=book.name,
                              trial_number=dead.number)
        read = store.measurements

        def live_worker_stores_and_tells_meanwhile(**kwargs):  # just before repair reads the store
            store.add_measurement(run_id, RMS_A, config, ok(40.0), source="sweep", study_name=book.name,
                                  trial_number=live.number)
            book.tell(NewTrial(live._trial_id, live.number, config, "sweep"), "ok", 40.0, None)
            return read(**kwargs)

        store.measurements = live_worker_stores_and_tells_meanwhile
        with caplog.at_level(logging.DEBUG, logger="normtune.sweep"):
            book.repair(store)
        values = {t.number: (t.state, t.value) for t in book.study.get_trials(deepcopy=False)}
    assert values == {dead.number: (TS.COMPLETE, 50.0), live.number: (TS.COMPLETE, 40.0)}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_config_the_space_rejects_never_becomes_a_trial(tmp_path, monkeypatch, sampler):
    """TPE and random proposals are sampled before a trial exists: configs the constraints reject are counted and
    sampled again, and the one kept is created with its params (and TPE's relative sample) in one go."""
    from normtune.tuner.sweep.options import SweepOptions
    from normtune.tuner.sweep.trials import StudyBook

    opts = SweepOptions(gpu_key="interpret", problems=[RMS_A], interpret=True, sampler=sampler, seed=3)
    with Store(sqlite_url(tmp_path)) as store:
        book = StudyBook(opts, RMS_A, INTERPRET_SM_COUNT, True, store.optuna_storage())
        verdicts = iter(["rejected", "rejected", "rejected"])
        unpatched = Space.why_not
        monkeypatch.setattr(Space, "why_not", lambda self, config: next(verdicts, None) or unpatched(self, config))

        def real(config):
            return unpatched(book.space, config)

        made = [book.new_trial(slot) for slot in range(len(book.seeds), len(book.seeds) + 12)]
        assert book.rejected >= 3 and all(m.sampled for m in made)
        trials = book.study.get_trials(deepcopy=False)
        assert [t.number for t in trials] == [m.number for m in made]  # no trial but the kept ones
        for t, m in zip(trials, made):
            assert t.state == TS.RUNNING and real(m.config) is None
            assert book.space.canonical(book.space.config({**book.space.params(m.config), **t.params})) == m.config
        book.tell(made[0], "ok", 10.0, None)
        assert book.study.get_trials(deepcopy=False)[0].state == TS.COMPLETE
        if book.seeds:
            assert not book.new_trial(0).sampled  # a seed's


def test_a_study_seeded_under_an_older_seed_version_gets_the_seeds_it_lacks(tmp_path, monkeypatch):
    """A resumed study whose seeds predate today's (e.g. a new kernel knob's structural seeds) gets the seeds it
    has not measured, in the slots after those already claimed, the same seed per slot for every worker."""
    from normtune.tuner.sweep import options, trials

    url = sqlite_url(tmp_path)
    full = Space(RMS_A, INTERPRET_SM_COUNT).seeds()
    assert len(full) >= 4
    monkeypatch.setattr(options, "SEED_VERSION", options.SEED_VERSION - 1)
    monkeypatch.setattr(trials, "SEED_VERSION", options.SEED_VERSION)
    monkeypatch.setattr(Space, "seeds", lambda self: full[:1] + full[2:3])  # the older version's seeds
    result = invoke(sweep_args(url, shapes="40x96", trials=3))
    assert result.exit_code == 0, result.output
    monkeypatch.undo()
    with Store(url) as store:
        first = {m.config for m in store.measurements(study_name=names(RMS_A)[0])}
    assert full[0] in first and full[2] in first and full[1] not in first
    lacking = [seed for seed in full if seed not in first]

    result = invoke(sweep_args(url, shapes="40x96", trials=3 + len(lacking)))
    assert result.exit_code == 0, result.output
    with Store(url) as store:
        rows = store.measurements(study_name=names(RMS_A)[0])
    assert [m.config for m in rows[3:]] == lacking and {m.source for m in rows[3:]} == {"seed"}
    study = load_study(url, names(RMS_A)[0])
    assert study.user_attrs["seed_base"] == 3 and study.user_attrs["seed_version"] == options.SEED_VERSION
    assert [BackwardConfig.from_json(j) for j in study.user_attrs["resumed_seeds"]] == lacking
