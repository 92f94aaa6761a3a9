"""Helpers shared by the sweep tests (not a test module itself).

They run `normtune sweep` as a real process (a fresh interpreter, as a user would), inject faults into that
process without any hook in normtune (a `sitecustomize.py` on PYTHONPATH patches `BackwardLaunch` in every
Python process of the sweep, the spawned measuring process included), and check a finished sweep's store rows
against its Optuna studies.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import pytest
from sqlalchemy import create_engine, text

from normtune.kernels.config import BackwardConfig
from normtune.tuner.store.database import normalize_url

# The CLI in a fresh interpreter: works where the `normtune` console script is not on PATH.
CLI = [sys.executable, "-c", "from normtune.cli import app; app()"]
MEASURED = ("ok", "incorrect", "compile_error", "out_of_resources", "timeout", "error")
REPO = Path(__file__).resolve().parents[1]

# Loaded at start-up of every Python process whose PYTHONPATH starts with its folder (the sweep, its spawned
# measuring process). Rules come from $NORMTUNE_TEST_FAULTS: [{"match": {"kernel_1.num_warps": 2}, "fault": ...}],
# the first rule whose every field matches a config decides its fault:
#   compile_error  kernel_1 raises triton's CompilationError (the measuring process classifies it)
#   incorrect      run() negates dx after launching (the correctness gate catches it)
#   hang           run() sleeps $NORMTUNE_TEST_HANG_S (the sweep's --trial-timeout must kill the process)
#   slow           run() sleeps $NORMTUNE_TEST_SLOW_S, then measures normally (a trial that takes a while)
# A rule with "after": n applies only from the process's (n+1)-th run() on; {"match": {}} matches every config.
# Every run() appends "pid fault config_json" to $NORMTUNE_TEST_FAULT_LOG. The patch is applied when
# normtune.kernels.backward is first imported (an import hook), so that importing it here does not run the
# kernels' @triton.jit decorators before the CLI has set TRITON_INTERPRET.
SITECUSTOMIZE = r'''
import importlib.abc
import json
import os
import sys
import time

RULES = json.loads(os.environ.get("NORMTUNE_TEST_FAULTS", "[]"))
TARGET = "normtune.kernels.backward_launch"


RUNS = [0]  # run() calls in this process


def _fault(config):
    for rule in RULES:
        if RUNS[0] > rule.get("after", 0) and all(
                getattr(getattr(config, key.split(".")[0]), key.split(".")[1]) == value
                for key, value in rule["match"].items()):
            return rule["fault"]
    return None


def _log(*words):
    path = os.environ.get("NORMTUNE_TEST_FAULT_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(" ".join(str(w) for w in words) + "\n")
            fh.flush()


def _patch(module):
    launch = module.BackwardLaunch
    kernel_1, run = launch.kernel_1, launch.run

    def faulty_kernel_1(self):
        if RUNS[0] and _fault(self.config) == "compile_error":
            from triton.compiler.errors import CompilationError

            raise CompilationError(None, None, "injected by the test: ptxas fatal: register allocation failed")
        return kernel_1(self)

    def faulty_run(self):
        RUNS[0] += 1
        fault = _fault(self.config)
        _log(os.getpid(), fault or "ok", self.config.to_json())
        if fault == "hang":
            time.sleep(float(os.environ.get("NORMTUNE_TEST_HANG_S", "120")))
        if fault == "slow":
            time.sleep(float(os.environ.get("NORMTUNE_TEST_SLOW_S", "3")))
        out = run(self)
        if fault == "incorrect":
            self.dx.neg_()  # wrong values of the right shape, every element written
        return out

    launch.kernel_1, launch.run = faulty_kernel_1, faulty_run


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def patched_exec(module, exec_module=exec_module):
                    exec_module(module)
                    _patch(module)

                spec.loader.exec_module = patched_exec
                return spec
        return None


if RULES:
    sys.meta_path.insert(0, _PatchOnImport())
'''


def sweep_args(url: str, *, shapes: str = "40x96", norm: str = "rms_norm", trials: int = 3,
               sampler: str = "random", extra: Iterable[str] = ()) -> list[str]:
    """`normtune sweep` arguments for an interpreted sweep on CPU (what follows the program name)."""
    return ["sweep", "--interpret", "--norm", norm, "--shapes", shapes, "--trials", str(trials),
            "--sampler", sampler, "--db", url, *extra]


def sweep_env(tmp_path: Path, rules: list[dict] | None = None, **more: str) -> dict[str, str]:
    """Environment of a sweep process: wide console lines (no wrapped messages), faults injected by `rules`."""
    env = dict(os.environ, COLUMNS="400", TRITON_INTERPRET="1", **more)
    if rules:
        site = tmp_path / "faults"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        env["NORMTUNE_TEST_FAULTS"] = json.dumps(rules)
        env.setdefault("NORMTUNE_TEST_FAULT_LOG", str(tmp_path / "faults.log"))
    return env


def run_sweep(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 240,
              program: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run a sweep to completion in a fresh interpreter; stdout and stderr captured as text."""
    return subprocess.run((program or CLI) + args, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def start_sweep(args: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    """Start a sweep in its own session (process group), so that it and its measuring process die together."""
    fh = open(log, "w")
    try:
        return subprocess.Popen(CLI + args, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        fh.close()


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the sweep's whole process group (the sweep, its measuring process, multiprocessing's helpers)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        proc.wait(30)


def wait_for(predicate: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None, interval: float = 0.05):
    """Poll until `predicate()` is truthy; fail (with the process's log) on timeout or when `proc` exits."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the sweep exited (code {proc.returncode}) before {what}:\n"
                                 + (log.read_text()[-4000:] if log else ""))
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}"
                                 + (":\n" + log.read_text()[-4000:] if log else ""))
        time.sleep(interval)


def measurement_rows(url: str) -> list[dict]:
    """Every row of normtune_measurements (all columns), by id; [] before the table exists."""
    engine = create_engine(normalize_url(url))
    try:
        with engine.connect() as conn:
            try:
                result = conn.execute(text("SELECT * FROM normtune_measurements ORDER BY id"))
            except Exception:  # noqa: BLE001 - the sweep has not created its tables yet
                return []
            return [dict(row._mapping) for row in result]
    finally:
        engine.dispose()


def running_trials(url: str) -> list[tuple[str, int, int]]:
    """(study name, trial number, heartbeats recorded) of every RUNNING trial, read from Optuna's tables."""
    engine = create_engine(normalize_url(url))
    try:
        with engine.connect() as conn:
            try:
                result = conn.execute(text(
                    "SELECT s.study_name, t.number, (SELECT COUNT(*) FROM trial_heartbeats h "
                    "WHERE h.trial_id = t.trial_id) FROM trials t JOIN studies s ON s.study_id = t.study_id "
                    "WHERE t.state = 'RUNNING' ORDER BY s.study_name, t.number"))
            except Exception:  # noqa: BLE001 - Optuna has not created its tables yet
                return []
            return [tuple(row) for row in result]
    finally:
        engine.dispose()


def load_study(url: str, name: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=normalize_url(url))


def check_studies(url: str, names: Iterable[str], target: int) -> dict[str, dict]:
    """Assert that every study ended with exactly `target` finished trials, each backed by one stored
    measurement (its own row, or the row of the trial it retried and reused), and that every stored row backs
    exactly one finished trial. Returns, per study, its trials and rows for further checks."""
    from optuna.trial import TrialState as TS

    rows = measurement_rows(url)
    out = {}
    for name in names:
        study = load_study(url, name)
        trials = study.get_trials(deepcopy=False)
        mine = [r for r in rows if r["study_name"] == name]
        numbers = [r["trial_number"] for r in mine]
        assert None not in numbers, f"{name}: a sweep measurement without its trial number"
        assert len(numbers) == len(set(numbers)), f"{name}: duplicate (study_name, trial_number) rows {numbers}"
        row_of = {r["trial_number"]: r for r in mine}
        running = [t.number for t in trials if t.state == TS.RUNNING]
        waiting = [t.number for t in trials if t.state == TS.WAITING]
        finished = [t for t in trials if t.state in (TS.COMPLETE, TS.FAIL) and t.user_attrs.get("status") in MEASURED]
        states = {t.number: (t.state.name, t.user_attrs.get("status")) for t in trials}
        assert not running, f"{name}: trials {running} left RUNNING after the sweep finished ({states})"
        assert len(finished) == target, (f"{name}: {len(finished)} finished trials, expected exactly {target} "
                                         f"(trial states: {states})")
        backing: dict[int, int] = {}
        for t in finished:
            reused = t.user_attrs.get("reused_from")
            source = t.number if reused is None else reused
            assert source in row_of, f"{name}: trial {t.number} ({t.state.name}) has no stored measurement"
            if reused is not None:
                assert t.number not in row_of, f"{name}: retry {t.number} of {reused} was measured again"
            assert source not in backing, (f"{name}: the measurement of trial {source} backs trials "
                                           f"{backing[source]} and {t.number}")
            backing[source] = t.number
            row = row_of[source]
            assert t.user_attrs["status"] == row["status"], (name, t.number, t.user_attrs, row["status"])
            if t.state == TS.COMPLETE:
                assert row["status"] == "ok" and math.isclose(t.value, row["median_us"], rel_tol=1e-9)
                if row["kernel_2_us"] is not None:  # kept with the trial for the local sampler's order
                    assert math.isclose(t.user_attrs["kernel_2_us"], row["kernel_2_us"], abs_tol=1e-4), (name, t)
            else:
                assert row["status"] != "ok", f"{name}: trial {t.number} FAIL but its measurement is ok"
            if "config" in t.user_attrs:
                assert BackwardConfig.from_json(t.user_attrs["config"]) == BackwardConfig.from_json(
                    row["config_json"])
        orphans = sorted(set(row_of) - set(backing))
        assert not orphans, f"{name}: stored measurements of trials {orphans} back no finished trial ({states})"
        assert len(mine) == target, f"{name}: {len(mine)} stored measurements, expected {target}"
        out[name] = {"study": study, "trials": trials, "rows": mine, "waiting": waiting}
    return out


# These end-to-end sweeps run the kernels through the Triton interpreter (--interpret): in-process that needs
# TRITON_INTERPRET=1 before the kernels are imported (tests/conftest.py sets it on machines without CUDA), and
# a Triton the CLI accepts for --interpret (Triton 3.6's interpreter, the GPU hosts' version, cannot run kernel_1).
# On a GPU host the sweep is exercised for real by `normtune sweep --gpu ...` (docs/perf-notes.md), so these skip
# there, with the CLI's own refusal as the reason.
def interpreter_cli_refusal() -> str | None:
    """Why `--interpret` would be refused in this process, or None where the CLI accepts it."""
    import triton

    from normtune.commands.common import CLIError, check_interpreter_triton

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "needs the Triton interpreter (CPU-only machines; TRITON_INTERPRET=1 at start)"
    try:
        check_interpreter_triton(triton.__version__)
    except CLIError as err:
        return str(err)
    return None


INTERPRETER_ONLY = pytest.mark.skipif(interpreter_cli_refusal() is not None,
                                      reason=interpreter_cli_refusal() or "the interpreter CLI is accepted")


def instant_measuring_process(on_submit: Callable | None = None, busy_s: float = 0.0):
    """A stand-in for the sweep's `MeasuringProcess` (monkeypatch it onto `sweep.driver`): every trial measures
    10 µs, `busy_s` after it was submitted; `on_submit(problem, config)` sees each submission."""
    from normtune.tuner.measure.harness import MeasureResult

    class InstantMeasuringProcess:
        def __init__(self, *args, **kwargs):
            self.phases = {}
            self.due = 0.0

        def start(self):
            pass

        def submit(self, problem, config, best_us=None):
            if on_submit is not None:
                on_submit(problem, config)
            self.due = time.perf_counter() + busy_s

        def ready(self):
            return time.perf_counter() >= self.due

        def collect(self, timeout_s):
            time.sleep(max(0.0, self.due - time.perf_counter()))
            return MeasureResult(status="ok", median_us=10.0, reps=2, interpret=True)

        def interrupt(self):
            pass

        def close(self):
            pass

    return InstantMeasuringProcess
