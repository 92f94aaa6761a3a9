"""A sweep worker's trials between their slot's claim and their stored measurement (`PendingTrials`): each
claimed slot's trial is created (a seed or the sampler's) and its compile-ahead job submitted, handed to the
measuring process once compiled, collected, and its measurement committed to the store with its trial's tell;
a trial abandoned on the way gives its slot back. The trials held (created, not yet stored nor given back) are
listed for the heartbeat thread, which beats them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from normtune.kernels.config import Problem

from ..gpu_info import DeviceInfo
from ..measure.harness import MeasureResult
from .compile_ahead import CompileAhead
from .compiling import wait_compiled
from . import timeline
from .costs import Costs
from .options import ProblemSummary, SweepOptions, SweepSummary
from .trials import NewTrial, StudyBook

log = logging.getLogger("normtune.sweep")

ABANDONED = MeasureResult(status="abandoned")  # a trial a second signal abandoned before it was measured


@dataclass
class Pending:
    """A claimed slot's trial on its way to the store."""
    slot: int
    trial: NewTrial
    compiled: object  # Future | None
    book: StudyBook
    ps: ProblemSummary
    compile_s: float | None = None  # of its compile-ahead job
    sent_at: float = 0.0  # when it went to the measuring process


class PendingTrials:
    """The worker's trials from creation to storage. `abandoning()` is true once a second signal asked to abandon
    the trial being measured."""

    def __init__(self, opts: SweepOptions, store, info: DeviceInfo, measurer, ahead: CompileAhead, costs: Costs,
                 emit: Callable[[str, dict], None], abandoning: Callable[[], bool]):
        self.opts, self.store, self.info, self.measurer, self.costs = opts, store, info, measurer, costs
        self.ahead = ahead
        self.emit, self.abandoning = emit, abandoning
        self.running: dict[int, int] = {}  # trial_id -> number of the trials held, for heartbeats
        self._lock = threading.Lock()
        # Each problem's best time measured by this worker (sent and collected by the dispatcher's thread): every
        # trial races it, or the problem's best in the store where that is better (`ProblemSummary.best_us`, read
        # once a round ends).
        self._best_us: dict[Problem, float] = {}

    def held(self) -> list[int]:
        """The trial ids held now (from any thread)."""
        with self._lock:
            return list(self.running)

    def start(self, book: StudyBook, ps: ProblemSummary, slot: int, run_id: int) -> Pending | None:
        """The claimed slot's trial, created and its compile submitted; None (the slot given back) where the
        problem's space has nothing left to propose."""
        workers = self.store.workers
        trial = book.new_trial(slot, self.costs, bind=lambda session, number: workers.bind_slot_in(
            session, book.name, slot, run_id, number))
        if trial is None:
            workers.release_slot(book.name, slot, run_id)
            return None
        with self._lock:
            self.running[trial.trial_id] = trial.number
        if not trial.bound:
            with self.costs.timed("database"):
                workers.bind_slot(book.name, slot, run_id, trial.number)
        return Pending(slot, trial, self.ahead.job(book.problem, trial.config), book, ps)

    def start_next(self, book: StudyBook, ps: ProblemSummary, goal: int, run_id: int) -> Pending | None:
        """The trial of the slot after this run's last claim of the study, created in the transaction that claims
        the slot (one transaction instead of two), its compile submitted. None where that cannot be done: no such
        slot below `goal`, the slot taken meanwhile (a sampler's proposal made for it is kept for the next
        slot), the grid sampler, Optuna's public calls, or nothing left to propose; the caller then claims as
        usual (`Workers.claim_slot`, `start`)."""
        from sqlalchemy.exc import IntegrityError

        from .optuna_rows import direct

        workers = self.store.workers
        slot = workers.next_guess(book.name, run_id)
        if slot is None or slot >= goal or not book.sampling.proposes or not direct(book.storage):
            return None
        prepared = book.prepare(slot, self.costs)
        if prepared is None:
            return None
        try:
            trial = book.create(prepared, self.costs, bind=lambda session, number: workers.claim_in(
                session, book.name, slot, run_id, number))
        except IntegrityError:  # another worker has the slot: nothing was written
            workers.claimed(book.name, slot, run_id, taken=False)
            book.keep_spare(prepared)
            return None
        workers.claimed(book.name, slot, run_id)
        with self._lock:
            self.running[trial.trial_id] = trial.number
        return Pending(slot, trial, self.ahead.job(book.problem, trial.config), book, ps)

    def abandon(self, item: Pending, run_id: int) -> None:
        """The trial told abandoned and its slot given back."""
        if item.compiled is not None:
            item.compiled.cancel()
        with self.costs.timed("database"):
            item.book.abandon(item.trial)
            self.store.workers.release_slot(item.book.name, item.slot, run_id)
        with self._lock:
            self.running.pop(item.trial.trial_id, None)

    def send(self, item: Pending, summary: SweepSummary, tick: Callable[[], None] | None = None
             ) -> MeasureResult | None:
        """Wait for the trial's compile-ahead job, then hand it to the measuring process. A result at once when
        there is nothing to measure (it failed to compile, or a second signal abandoned it). `tick` is called
        while it waits (by default the compile-ahead's refill; a thread other than the worker's passes its own)."""
        if item.compiled is not None:
            t_wait = time.perf_counter()
            # The worker's first trial goes to the measuring process once that is ready, compiled there if its job
            # has not finished: the compile processes start as many drivers at once, which the first measurement
            # need not wait for.
            answering = getattr(self.measurer, "answering", None) if self.costs.startup_s is None else None
            compiled = wait_compiled(item.compiled, self.opts.trial_timeout_s, self.abandoning,
                                     self.ahead.refill if tick is None else tick,
                                     enough=answering or (lambda: False))
            summary.compile_wait_s += time.perf_counter() - t_wait
            self.costs.add("compile_wait", time.perf_counter() - t_wait)
            if compiled is None:
                return ABANDONED
            cstatus, item.compile_s, cerr = compiled
            summary.compile_s += item.compile_s or 0.0
            self.costs.add("compile_jobs", item.compile_s or 0.0)
            if cstatus in ("compile_error", "out_of_resources"):
                return MeasureResult(status=cstatus, error=cerr, compile_s=item.compile_s,
                                     interpret=self.info.interpret)
        problem = item.book.problem
        best = min((b for b in (self._best_us.get(problem), item.ps.best_us) if b is not None), default=None)
        self.measurer.submit(problem, item.trial.config, best)  # the first one waits for the process to start
        item.sent_at = time.perf_counter()
        self.costs.sent()
        return None

    def collect(self, item: Pending, summary: SweepSummary) -> MeasureResult:
        """The result of the trial sent last."""
        result = self.measurer.collect(self.opts.trial_timeout_s)
        summary.measure_s += time.perf_counter() - item.sent_at
        self.costs.measured(self.measurer.phases)
        if item.compile_s is not None:
            result.compile_s = item.compile_s
        problem = item.book.problem
        if result.status == "ok" and result.median_us and result.median_us < self._best_us.get(problem, math.inf):
            self._best_us[problem] = result.median_us
        return result

    def commit(self, item: Pending, result: MeasureResult, run_id: int, summary: SweepSummary) -> None:
        """Commit a trial's measurement, then tell its trial; an abandoned one gives its slot back."""
        book, trial, ps = item.book, item.trial, item.ps
        if result is ABANDONED or self.abandoning():  # a second signal abandoned it mid-measurement
            self.abandon(item, run_id)
            return
        # The measurement and the trial's tell are committed together where Optuna's internals allow, else the
        # measurement first: a kill after it loses nothing (the next worker tells the trial from the store).
        value = result.median_us if result.status == "ok" else None
        told: list = []
        with self.costs.timed("database"):
            stored = self.store.add_measurement(
                run_id, book.problem, trial.config, result, source=trial.source, study_name=book.name,
                trial_number=trial.number, slot=item.slot,
                also=lambda session: told.append(book.tell_in(session, trial, result.status, value, result.error,
                                                             kernel_2_us=result.kernel_2_us)))
            if stored is None:  # this worker stalled past its grace period and another one took the slot over
                log.warning("slot %s of %s was taken over while trial %s was measured: not stored", item.slot,
                            book.name, trial.number)
                book.abandon(trial)
            elif not told or told[0] is None:
                book.tell(trial, result.status, value, result.error, kernel_2_us=result.kernel_2_us)
        with self._lock:
            self.running.pop(trial.trial_id, None)
        if stored is None:
            return
        timeline.mark("first_stored")
        ps.measured_now += 1
        if result.status != "ok":
            ps.failures[result.status] = ps.failures.get(result.status, 0) + 1
        elif ps.best_us is None or result.median_us < ps.best_us:
            ps.best_us, ps.best_config = result.median_us, trial.config
        if trial.config == book.default and result.status == "ok":
            ps.default_us = result.median_us
        self.emit("trial", {"problem": book.problem, "config": trial.config, "result": result,
                            "best_us": ps.best_us, "default_us": ps.default_us, "number": trial.number})
