"""The sweep's one entry point, `normtune.tuner.sweep.run`: in-process, with a stand-in measuring process (no
kernels run), as `normtune tune` calls it: the result it returns, the events and the view it drives, and the
helper processes it stops on every exit, a refused sweep included."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from sweep_support import check_studies, instant_measuring_process

from normtune.kernels.config import Problem
from normtune.tuner import sweep as S
from normtune.tuner.sweep import driver, measuring  # noqa: F401 - the driver bound to the real helpers first

PROBLEMS = [Problem("rms_norm", 40, 96, "bf16"), Problem("rms_norm", 24, 200, "bf16")]


class Helpers:
    """What `start_helpers` would start: a stand-in measuring process (no compile pool), recording its close."""

    def __init__(self):
        self.closed = 0
        self.started = []

    def __call__(self, device, interpret, compile_workers, **kwargs):
        helpers = self
        measurer_class = instant_measuring_process()

        class Recorded(measurer_class):
            def close(self, wait_s: float = 0.0):
                helpers.closed += 1

        self.started.append((device, interpret, compile_workers))
        return Recorded(), None


def _options(tmp_path, **more) -> S.SweepOptions:
    asked = []
    return S.SweepOptions(**{"gpu_key": "auto", "problems": lambda: asked.append(1) or PROBLEMS, "trials": 3,
                             "sampler": "random", "interpret": True, "compile_workers": 0,
                             "storage": f"sqlite:///{tmp_path / 'results.db'}", **more}), asked


def test_run_returns_the_sweeps_result_and_drives_the_callers_events_and_view(tmp_path, monkeypatch):
    helpers = Helpers()
    monkeypatch.setattr(measuring, "start_helpers", helpers)
    opts, asked = _options(tmp_path)
    events, views = [], []

    @contextmanager
    def view(url, targets):
        views.append(("entered", url, dict(targets)))
        yield
        views.append(("exited",))

    result = S.run(opts, on_event=lambda kind, data: events.append((kind, data)), view=view)
    names = [S.study_name("interpret", p, interpret=True) for p in PROBLEMS]
    check_studies(opts.storage, names, 3)
    assert asked == [1], "the problems are resolved once, after the helpers started"
    assert helpers.started == [(0, True, 0)] and helpers.closed >= 1
    assert isinstance(result, S.SweepResult) and result.exit_code == 0 and result.stopped is None
    assert result.remaining == [] and result.devices == [0] and result.workers == []
    assert [(ps.problem, ps.trials, ps.measured_now) for ps in result.problems] == [(p, 3, 3) for p in PROBLEMS]
    assert all(ps.best_us == 10.0 for ps in result.problems)
    assert result.costs["trials"] == 6 and result.wall_s > 0 and "results.db" in result.store
    assert result.closing_steps.startswith("sweep returned ") and "store closed" in result.closing_steps
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "opened" and kinds.count("problem_done") == 2 and kinds[-1] == "finish"
    assert events[0][1]["problems"] == PROBLEMS and events[0][1]["devices"] == [0]
    assert views == [("entered", opts.storage, {name: 3 for name in names}), ("exited",)]
    # The command's lines come from the result alone.
    lines = S.result_lines(result)
    assert lines[0].startswith("sweep: ") and any("where the time went" in line for line in lines)
    assert not any(line.startswith("stopped") for line in lines)


def test_a_refused_run_stops_the_helpers_it_started_and_writes_nothing(tmp_path, monkeypatch):
    helpers = Helpers()
    monkeypatch.setattr(measuring, "start_helpers", helpers)
    missing = tmp_path / "missing" / "results.db"
    opts, _ = _options(tmp_path, storage=f"sqlite:///{missing}")
    with pytest.raises(Exception, match="results.db"):
        S.run(opts)
    assert helpers.started and helpers.closed == 1 and not missing.parent.exists()
    opts, _ = _options(tmp_path, problems=lambda: (_ for _ in ()).throw(ValueError("--shapes: refused")))
    with pytest.raises(ValueError, match="--shapes"):
        S.run(opts)
    assert helpers.closed == 2 and not (tmp_path / "results.db").exists()
