"""Progress of a sweep from the database alone, whoever runs it: per problem the measured, failed and running
trials and the best time against the default config's; per worker whether it is alive and its trials per second;
and an ETA. `normtune status` prints it once; `normtune sweep` shows it live (across all its workers, since
every figure comes from the shared database, not from one process's events)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from dataclasses import dataclass, field

from normtune.kernels.config import Problem, default_config

from .costs import line as costs_line

# Seconds between two reads of the database by the live view (a few cheap queries; nothing per trial).
POLL_S = 1.0


@dataclass(frozen=True)
class ProblemProgress:
    study: str
    problem: Problem | None
    finished: int
    failed: int
    running: int
    best_us: float | None
    default_us: float | None
    target: int | None = None

    @property
    def speedup(self) -> float | None:
        return self.default_us / self.best_us if self.best_us and self.default_us else None


@dataclass
class Snapshot:
    problems: list[ProblemProgress]
    workers: list = field(default_factory=list)  # store.workers.WorkerState

    @property
    def finished(self) -> int:
        return sum(p.finished for p in self.problems)

    @property
    def remaining(self) -> int:
        return sum(max(0, p.target - p.finished) for p in self.problems if p.target is not None)


def snapshot(store, prefix: str = "normtune:", targets: dict[str, int] | None = None,
             defaults: dict[str, float] | None = None) -> Snapshot:
    """The state of every study named `prefix…` (or only those in `targets`, with their trial targets).
    `defaults` caches default-config times between calls (they do not change once measured)."""
    defaults = {} if defaults is None else defaults
    runs = None
    rows = []
    for study in store.workers.study_progress(prefix):
        if targets is not None and study.study_name not in targets:
            continue
        default_us = defaults.get(study.study_name)
        if default_us is None and study.problem is not None and study.best_run_id is not None:
            runs = runs or {r.id: r for r in store.runs(kind="sweep")}
            default_us = _default_us(store, study, runs)
            if default_us is not None:
                defaults[study.study_name] = default_us
        rows.append(ProblemProgress(study.study_name, study.problem, study.finished, study.failed, study.running,
                                    study.best_us, default_us, (targets or {}).get(study.study_name)))
    for name in sorted(set(targets or {}) - {r.study for r in rows}):
        rows.append(ProblemProgress(name, None, 0, 0, 0, None, None, targets[name]))
    return Snapshot(rows, store.workers.states())


def _default_us(store, study, runs) -> float | None:
    from ..gpu_info import run_limits
    from ..space import Space

    run = runs.get(study.best_run_id)
    if run is None:
        return None
    limits = run_limits(run.device)  # the sweep's GPU, as its run recorded it
    config = Space(study.problem, run.device.sm_count, limits).canonical(default_config(study.problem, limits))
    found = store.measurements(study_name=study.study_name, config=config, status="ok")
    return found[0].median_us if found else None


def render_table(snap: Snapshot, title: str):
    """A rich Table of the problems, then one line per worker."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("problem", "trials", "failed", "running", "best µs", "default µs", "speedup"):
        t.add_column(col, justify="left" if col == "problem" else "right")
    for p in snap.problems:
        name = (f"{p.problem.norm} {p.problem.M}x{p.problem.N} {p.problem.dtype}" if p.problem is not None
                else p.study.split(":", 2)[-1])
        t.add_row(name, f"{p.finished}" + (f"/{p.target}" if p.target is not None else ""), str(p.failed),
                  str(p.running), _f(p.best_us), _f(p.default_us), _f(p.speedup, 2, "×"))
    return t


def worker_lines(snap: Snapshot, since=None, costs: bool = False) -> list[str]:
    """One line per worker (alive first), `since` limiting it to runs started after a moment; with `costs`, a
    second line per worker: where its wall clock went (as it last saved it)."""
    lines = []
    for w in sorted(snap.workers, key=lambda w: (not w.alive, w.run_id)):
        if since is not None and w.started_at < since:
            continue
        state = ("alive" if w.alive else ("dead" if w.status in ("running", "dead") else w.status))
        where = f"{w.host} " + (f"GPU {w.device}" if w.device is not None else "interpreter")
        rate = f"{w.trials_per_s:.2f} trials/s" if w.trials_per_s else "– trials/s"
        beat = f", last heartbeat {w.beat_age_s:.0f} s ago" if w.status in ("running", "dead") else ""
        lines.append(f"run {w.run_id} ({where}, pid {w.pid}): {state}, {w.measured} measured, {rate}{beat}")
        if costs and w.costs:
            lines.append(f"  where its time went: {costs_line(w.costs)}")
    return lines


def _f(x: float | None, digits: int = 1, unit: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{unit}"


class LiveView:
    """Polls the database in a thread and shows the sweep's problems, workers and ETA in a rich Live display.
    The ETA divides the trials still to measure by the rate measured since the view started (all workers)."""

    def __init__(self, console, url: str, targets: dict[str, int]):
        self.console, self.url, self.targets = console, url, targets
        self._snap: Snapshot | None = None
        self._first: tuple[float, int] | None = None
        self._stop = threading.Event()
        self._defaults: dict[str, float] = {}
        self._since = dt.datetime.now(dt.timezone.utc)  # workers started before the view are not this sweep's

    def _poll(self) -> None:
        from ..store.database import Store, StoreError

        while not self._stop.is_set():
            try:
                with Store(self.url, read_only=True) as store:
                    while not self._stop.is_set():
                        self._snap = snapshot(store, prefix="", targets=self.targets, defaults=self._defaults)
                        if self._first is None:
                            self._first = (time.monotonic(), self._snap.finished)
                        self._stop.wait(POLL_S)
            except StoreError:  # the sweep has not created its tables yet
                self._stop.wait(POLL_S)

    def eta_line(self) -> str:
        snap = self._snap
        if snap is None or self._first is None:
            return "waiting for the first measurements…"
        elapsed, done = time.monotonic() - self._first[0], snap.finished - self._first[1]
        rate = done / elapsed if elapsed > 0 and done > 0 else None
        eta = f"{snap.remaining / rate / 60:.1f} min" if rate else "–"
        return (f"{snap.finished} trials measured, {snap.remaining} to go; "
                f"{_f(rate, 2)} trials/s since start; ETA {eta}")

    def renderable(self):
        from rich.console import Group

        if self._snap is None:
            return Group(self.eta_line())
        since = self._since - dt.timedelta(seconds=60)
        return Group(render_table(self._snap, "sweep"), *worker_lines(self._snap, since), self.eta_line())

    def __enter__(self):
        from rich.live import Live

        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        self._live = Live(get_renderable=self.renderable, console=self.console, refresh_per_second=2)
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from ..store.database import Store, StoreError

        self._stop.set()
        self._thread.join(5)
        try:  # the final state, not the last poll's
            with Store(self.url, read_only=True) as store:
                self._snap = snapshot(store, prefix="", targets=self.targets, defaults=self._defaults)
        except StoreError:
            pass
        self._live.__exit__(*exc)
        if not self.console.is_terminal:  # redirected: the last frame ends without a newline of its own
            self.console.line()


# ------------------------------------------------------------------------------------------ a command's lines

INTERPRET_NOTE = ("--interpret: kernels run on CPU in the Triton interpreter; these timings are interpreter timings "
                  "and are never emitted as a GPU table")


def event_line(kind: str, data: dict, interpret: bool = False) -> str | None:
    """The line a command prints for one of `run`'s events (None: nothing to print): the interpreter's note and
    the devices once the database is open, each problem's result, what a signal does."""
    if kind == "opened":
        lines = [INTERPRET_NOTE] if interpret else []
        if data.get("default_store"):
            lines.append(f"sweep: no --db: results go to {data['store']} (the user directory; --db names another)")
        if len(data["devices"]) > 1:
            lines.append(f"sweeping {len(data['problems'])} problems on devices {data['devices']} ({data['store']})")
        return "\n".join(lines) or None
    if kind == "problem_done":
        ps = data["summary"]
        return (f"{ps.problem.key}: {ps.trials} trials, best {ps.best_us and f'{ps.best_us:.1f} µs'}"
                + (f" (default {ps.default_us:.1f} µs)" if ps.default_us else "")
                + (f", failures {ps.failures}" if ps.failures else ""))
    if kind == "signal":
        return data["message"]
    return None


def result_lines(result) -> list[str]:
    """The lines a command ends with (`run`'s `SweepResult`): the wall and where the time went (per worker with
    several devices), when the closing steps happened, and what remains after a stop."""
    if len(result.devices) > 1:
        lines = ["sweep: " + line.strip() for line in result.worker_lines]
    else:
        lines = [f"sweep: {result.wall_s:.0f} s wall, {result.measure_s:.0f} s measuring, {result.compile_s:.0f} s "
                 f"compiling in workers ({result.compile_wait_s:.0f} s waited on them)",
                 f"sweep: where the time went: {costs_line(result.costs)}"]
    lines.append(f"sweep: results in {result.store}")
    lines.append(f"sweep: closing steps since the command started: {result.closing_steps}")
    if result.stopped:
        lines.append(f"stopped ({result.stopped}); remaining: {'; '.join(result.remaining) or 'none'}. Re-run the "
                     "same command to continue.")
    return lines
