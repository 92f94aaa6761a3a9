"""One sweep worker: the Optuna ask/tell loop over its problems, on one device, against the shared database.

Per problem there is one Optuna study (named deterministically, living in the results database) and the goal
is `trials` measured trials: re-running adds only the difference. A worker measures a trial only while it holds
one of the study's slots (`Store.claim_slot`), so any number of workers (processes, GPUs, hosts) end a study
with exactly `trials` measurements, each measured once:

    claim a slot ─► create its trial (seed or sampler) ─► compile ahead in a CPU worker ─┐
    tell ◄── store the measurement (committed at once) ◄── gate + time in the measuring process ┘

- A measurement is committed to the store before the trial is told, so a SIGKILL loses nothing that was measured;
  a trial found measured but not told is told from the store by the next worker that looks (no re-measure).
- Heartbeats: this worker's run and its trials beat every `heartbeat_interval`; a worker whose beats stop for
  `grace_period` is dead: its run is marked `dead`, its unmeasured trials failed as stale, its slots taken over.
- No GPU waits for another: when the slots left of a problem are held by other workers, this one moves on to
  the next problem and comes back only at the end (to take over slots of dead workers).
- SIGINT/SIGTERM finish the current trial and stop; a second signal abandons it at once. Either way no trial is
  left RUNNING, every unmeasured slot is given back, and the summary counts what remains.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable

from normtune.kernels.config import Problem

from ..device import DeviceInfo, command_line
from ..measure import MeasureResult
from .compiling import _compile_one, compile_pool, wait_compiled
from .measuring import MeasuringProcess
from .options import FIRST_ROUND, ProblemSummary, SweepOptions, SweepSummary, study_name
from .trials import NewTrial, StudyBook

log = logging.getLogger("normtune.sweep")


@dataclass
class _Pending:
    slot: int
    trial: NewTrial
    compiled: object  # Future | None


class Sweep:
    """One sweep worker: a device, a store, the problems. `run()` returns a `SweepSummary`."""

    def __init__(self, opts: SweepOptions, store, info: DeviceInfo,
                 on_event: Callable[[str, dict], None] | None = None):
        import optuna

        self.opts, self.store, self.info = opts, store, info
        self.emit = on_event or (lambda kind, data: None)
        self.stop_requested = 0  # signals received
        self._signal: str | None = None
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # e.g. independent-sampling notes of conditional knobs
        # Heartbeats are recorded by this driver's own thread (ask/tell, not Study.optimize): expected.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self.storage = store.optuna_storage(heartbeat_interval=opts.heartbeat_interval,
                                            grace_period=opts.grace_period)
        self._running: dict[int, int] = {}  # trial_id -> number, for heartbeats
        self._lock = threading.Lock()
        self._books: dict[str, StudyBook] = {}
        self._measurer: MeasuringProcess | None = None

    # ------------------------------------------------------------------------------------------- signals

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested += 1
        self._signal = self._signal or signal.Signals(signum).name
        if self.stop_requested == 1:
            self.emit("signal", {"message": f"{signal.Signals(signum).name}: finishing the current trial, then "
                                            "stopping (again to abandon it)"})
        else:
            self.emit("signal", {"message": f"{signal.Signals(signum).name}: abandoning the current trial"})
            if self._measurer is not None:
                self._measurer.interrupt()

    def _stopping(self, t0: float) -> str | None:
        if self.stop_requested:
            return "interrupted"
        if self.opts.time_budget_s is not None and time.perf_counter() - t0 >= self.opts.time_budget_s:
            return "time budget"
        return None

    # ---------------------------------------------------------------------------------------- heartbeats

    def _heartbeat_loop(self, run_id: int, stop: threading.Event) -> None:
        while not stop.wait(self.opts.heartbeat_interval):
            with self._lock:
                ids = list(self._running)
            try:
                for tid in ids:
                    self.storage.record_heartbeat(tid)
                self.store.beat(run_id, grace_s=self.opts.grace_period, device=self._device())
            except Exception as err:  # noqa: BLE001 - a missed heartbeat only risks a takeover
                log.debug("heartbeat failed: %s", err)

    def _device(self) -> int | None:
        return None if self.info.interpret else self.opts.device

    # ------------------------------------------------------------------------------------------ main loop

    def run(self) -> SweepSummary:
        opts, summary, t0 = self.opts, SweepSummary(), time.perf_counter()
        old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._measurer = MeasuringProcess(opts.device, opts.interpret, self.info.l2_bytes, opts.timing)
        self._measurer.start()
        pool = None if opts.interpret else compile_pool(opts.compile_workers, opts.device)
        run_id = self.store.start_run(self.info, kind="sweep", command_line=command_line())
        self.store.beat(run_id, grace_s=opts.grace_period, device=self._device())
        self.store.mark_dead_runs()
        stop_hb = threading.Event()
        threading.Thread(target=self._heartbeat_loop, args=(run_id, stop_hb), daemon=True).start()
        status = "failed"
        self.emit("start", {"problems": len(opts.problems), "trials": opts.trials, "run_id": run_id})
        try:
            self._rounds(run_id, pool, t0, summary)
            status = "interrupted" if summary.stopped == "interrupted" else "finished"
        finally:
            stop_hb.set()
            self._measurer.close()
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            summary.signal = self._signal
            summary.remaining = self._remaining()
            self.store.end_run(run_id, status=status)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            summary.wall_s = time.perf_counter() - t0
            self.emit("finish", {"summary": summary})
        return summary

    def _rounds(self, run_id: int, pool, t0: float, summary: SweepSummary) -> None:
        """Every problem first gets a few trials (the default and its neighbours), then all are deepened to
        `trials`, so that a time-budgeted sweep covers every problem before it refines any. Each worker starts
        at its own place in the problem list, so that workers spread over problems instead of sharing one."""
        problems = self.opts.problems
        start = self.opts.worker_index * len(problems) // max(1, self.opts.workers)
        order = problems[start:] + problems[:start]
        by_key: dict[str, ProblemSummary] = {}
        for target in sorted({min(self.opts.trials, FIRST_ROUND), self.opts.trials}):
            busy = list(order)
            while busy and not summary.stopped:
                waiting = []
                for problem in busy:
                    summary.stopped = self._stopping(t0)
                    if summary.stopped:
                        break
                    book = self._book(problem)
                    ps = by_key.setdefault(problem.key, ProblemSummary(problem, book.name))
                    if not self._sweep_problem(book, ps, target, run_id, pool, t0, summary):
                        waiting.append(problem)
                busy = waiting
                if busy and not summary.stopped:
                    self._wait_for_others(busy)
            if summary.stopped:
                break
        summary.problems = [by_key[p.key] for p in problems if p.key in by_key]
        # Leave the studies clean for whoever looks next: trials of workers that died after storing their
        # measurement are told, and dead runs recorded.
        self.store.mark_dead_runs()
        for book in self._books.values():
            book.repair(self.store)

    def _book(self, problem: Problem) -> StudyBook:
        if problem.key not in self._books:
            book = StudyBook(self.opts, problem, self.info.sm_count, self.info.interpret, self.storage,
                             claimed_slots=lambda name: max(self.store.slots(name), default=-1) + 1)
            self.store.adopt_measured_trials(book.name)
            book.repair(self.store)
            self._books[problem.key] = book
        return self._books[problem.key]

    def _wait_for_others(self, problems: list[Problem]) -> None:
        """Only slots held by other workers are left: look again shortly, taking over those of dead workers."""
        time.sleep(min(1.0, self.opts.heartbeat_interval / 2))
        self.store.mark_dead_runs()
        for problem in problems:
            self._book(problem).repair(self.store)

    def _sweep_problem(self, book: StudyBook, ps: ProblemSummary, trials: int, run_id: int, pool, t0: float,
                       summary: SweepSummary) -> bool:
        """Measure trials of one problem while this worker can claim slots below `trials`. True when the problem
        is done (every slot measured, or its space exhausted); False when other workers hold what is left."""
        target, pending = book.target(trials), []
        lookahead = max(1, self.opts.lookahead if pool is not None else 1)
        self.emit("problem", {"problem": book.problem, "study": book.name, "target": target})
        exhausted = False
        while True:
            while len(pending) < lookahead and not self._stopping(t0) and not exhausted:
                claim = self.store.claim_slot(book.name, target, run_id)
                if claim is None:
                    break
                slot, dead_trial = claim
                if dead_trial is not None:
                    book.fail_orphan(dead_trial)
                item = self._start_trial(book, slot, run_id, pool)
                if item is None:
                    exhausted = True
                    break
                pending.append(item)
            if not pending:
                break
            item = pending.pop(0)
            self._measure(book, item, run_id, ps, summary)
            summary.stopped = self._stopping(t0)
            if summary.stopped:
                for rest in pending:
                    self._abandon(book, rest, run_id)
                self._summarize(book, ps, sum(s.measured for s in self.store.slots(book.name).values()))
                return True
        done = sum(s.measured for s in self.store.slots(book.name).values())
        self._summarize(book, ps, done)
        return exhausted or done >= target

    def _start_trial(self, book: StudyBook, slot: int, run_id: int, pool) -> _Pending | None:
        trial = book.new_trial(slot)
        if trial is None:
            self.store.release_slot(book.name, slot, run_id)
            return None
        with self._lock:
            self._running[trial.trial_id] = trial.number
        self.store.bind_slot(book.name, slot, run_id, trial.number)
        future = (pool.submit(_compile_one, book.problem.to_dict(), trial.config.to_json(), self.info.sm_count)
                  if pool is not None else None)
        return _Pending(slot, trial, future)

    def _abandon(self, book: StudyBook, item: _Pending, run_id: int) -> None:
        if item.compiled is not None:
            item.compiled.cancel()
        book.abandon(item.trial)
        self.store.release_slot(book.name, item.slot, run_id)
        with self._lock:
            self._running.pop(item.trial.trial_id, None)

    def _measure(self, book: StudyBook, item: _Pending, run_id: int, ps: ProblemSummary,
                 summary: SweepSummary) -> None:
        result = self._compile_then_measure(book.problem, item, summary)
        if result is None or self.stop_requested >= 2:  # a second signal abandoned it mid-measurement
            self._abandon(book, item, run_id)
            return
        trial = item.trial
        # Commit the measurement first: a kill after this line loses nothing (the next worker tells the trial).
        stored = self.store.add_measurement(run_id, book.problem, trial.config, result, source=trial.source,
                                            study_name=book.name, trial_number=trial.number, slot=item.slot)
        if stored is None:  # this worker stalled past its grace period and another one took the slot over
            log.warning("slot %s of %s was taken over while trial %s was measured: not stored", item.slot,
                        book.name, trial.number)
            book.abandon(trial)
            with self._lock:
                self._running.pop(trial.trial_id, None)
            return
        book.tell(trial, result.status, result.median_us if result.status == "ok" else None, result.error)
        with self._lock:
            self._running.pop(trial.trial_id, None)
        ps.measured_now += 1
        if result.status != "ok":
            ps.failures[result.status] = ps.failures.get(result.status, 0) + 1
        elif ps.best_us is None or result.median_us < ps.best_us:
            ps.best_us, ps.best_config = result.median_us, trial.config
        if trial.config == book.default and result.status == "ok":
            ps.default_us = result.median_us
        self.emit("trial", {"problem": book.problem, "config": trial.config, "result": result,
                            "best_us": ps.best_us, "default_us": ps.default_us, "number": trial.number})

    def _compile_then_measure(self, problem: Problem, item: _Pending, summary: SweepSummary) -> MeasureResult | None:
        compile_s = None
        if item.compiled is not None:
            t_wait = time.perf_counter()
            compiled = wait_compiled(item.compiled, self.opts.trial_timeout_s, lambda: self.stop_requested >= 2)
            summary.compile_wait_s += time.perf_counter() - t_wait
            if compiled is None:
                return None
            cstatus, compile_s, cerr = compiled
            summary.compile_s += compile_s or 0.0
            if cstatus in ("compile_error", "out_of_resources"):
                return MeasureResult(status=cstatus, error=cerr, compile_s=compile_s, interpret=self.info.interpret)
        t = time.perf_counter()
        result = self._measurer.measure(problem, item.trial.config, self.opts.trial_timeout_s)
        summary.measure_s += time.perf_counter() - t
        if compile_s is not None:
            result.compile_s = compile_s
        return result

    # --------------------------------------------------------------------------------------------- ending

    def _summarize(self, book: StudyBook, ps: ProblemSummary, done: int) -> None:
        ps.trials = done
        best = self.store.best(book.problem, gpu_key=self.opts.gpu_key, interpret=self.info.interpret)
        if best is not None:
            ps.best_us, ps.best_config = best.median_us, best.config
        default = self.store.measurements(study_name=book.name, config=book.default, status="ok")
        if default:
            ps.default_us = default[0].median_us
        self.emit("problem_done", {"summary": ps})

    def _remaining(self) -> list[str]:
        """'problem: N trials' for every problem with fewer measured trials than asked, from the database."""
        out = []
        for problem in self.opts.problems:
            book = self._books.get(problem.key)
            name = book.name if book else study_name(self.opts.gpu_key, problem, self.info.interpret,
                                                      self.opts.study_prefix)
            done = sum(s.measured for s in self.store.slots(name).values())
            left = (book.target(self.opts.trials) if book else self.opts.trials) - done
            if left > 0:
                out.append(f"{problem.key}: {left} trials")
        return out
