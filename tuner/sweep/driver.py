"""One sweep worker: the Optuna ask/tell loop over its problems, on one device, against the shared database.

Per problem there is one Optuna study (named deterministically, living in the results database) and the goal
is `trials` measured trials: re-running adds only the difference. A worker measures a trial only while it holds
one of the study's slots (`Store.claim_slot`), so any number of workers (processes, GPUs, hosts) end a study
with exactly `trials` measurements, each measured once:

    claim a slot ─► create its trial (seed or sampler) ─► compile ahead in a CPU worker ─┐
    tell ◄── store the measurement (committed at once) ◄── gate + time in the measuring process ┘

- The slot after a worker's last claim of a study is claimed in the transaction that creates its trial
  (`PendingTrials.start_next`); where another worker took it first, that transaction is undone and the worker
  claims the lowest free slot instead, in a transaction of its own.
- The measuring process is kept busy: a dispatcher thread sends the next ready trial as soon as a result comes
  back (`dispatch.py`), while the worker's thread stores the results and claims, proposes (TPE's proposals made
  ahead in `proposer.py`) and creates the trials after them, up to `lookahead` held (`_pipeline`). Where the wall
  clock went is kept per phase (`costs`) and stored with the run.

- A measurement is committed to the store together with its trial's tell (or before it, where Optuna's internals
  are not the expected ones), so a SIGKILL loses nothing that was measured; a trial found measured but not told
  is told from the store by the next worker that looks (no re-measure).
- Heartbeats: this worker's run and its trials beat every `heartbeat_interval`; a worker whose beats stop for
  `grace_period` is dead: its run is marked `dead`, its unmeasured trials failed as stale, its slots taken over.
- No GPU waits for another: when the slots left of a problem are held by other workers, this one moves on to
  the next problem and comes back only at the end (to take over slots of dead workers).
- SIGINT/SIGTERM finish the current trial and stop; a second signal abandons it at once. Either way no trial is
  left RUNNING, every unmeasured slot is given back, and the summary counts what remains. A worker blocked past
  its time budget is ended by `watchdog.overrun_guard`."""

from __future__ import annotations

import logging
import signal
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

from normtune.kernels.config import Problem

from ..gpu_info import DeviceInfo, command_line
from . import timeline
from .compile_ahead import CompileAhead, seeds_ahead
from .compiling import COMPILERS_PER_GPU, default_compile_workers, stop_pool
from .costs import Costs
from .dispatch import Dispatcher
from .measuring import MeasuringProcess, asynchronous, start_helpers
from .options import FIRST_ROUND, ProblemSummary, SweepOptions, SweepSummary
from .pending import Pending, PendingTrials
from .proposer import Proposer
from .trials import StudyBook, remaining
from .watchdog import overrun_guard

log = logging.getLogger("normtune.sweep")


@dataclass
class _ProblemEnd:
    """In the feed after a problem's trials of one round: summarize it once they are stored."""
    book: StudyBook
    ps: ProblemSummary


RUN_STEPS = ("first_study", "first_sent", "first_result", "first_stored")
HELPER_STEPS = ("measurer_spawned", "measurer_torch", "measurer_cuda", "measurer_ready", "compilers_ready")
_IDLE = object()  # in the feed: only slots held by other workers are left for now


class Sweep:
    """One sweep worker: a device, a store, the problems. `run()` returns a `SweepSummary`."""

    def __init__(self, opts: SweepOptions, store, info: DeviceInfo, on_event: Callable[[str, dict], None] | None = None,
                 helpers: tuple | None = None, keep_helpers: bool = False):
        import optuna

        self.opts, self.store, self.info = opts, store, info
        self.emit = on_event or (lambda kind, data: None)
        self.stop_requested = 0  # signals received
        self._signal: str | None = None
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # e.g. independent-sampling notes of conditional knobs
        # Heartbeats are recorded by this driver's own thread (ask/tell, not Study.optimize): expected.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self.storage = store.optuna_storage(heartbeat_interval=opts.heartbeat_interval, grace_period=opts.grace_period)
        self._books: dict[str, StudyBook] = {}
        self._exhausted: dict[str, bool] = {}  # problem key -> its space gave nothing but rejected configs
        self._measurer, self.costs, self._fed_stop = None, Costs(), None
        self.proposer: Proposer | None = None  # TPE's proposals made ahead, while `run()` runs (`proposer.py`)
        self.pending: PendingTrials | None = None  # the trials on their way to the store, while `run()` runs
        self._helpers = helpers  # (measurer, pool) started ahead by `start_helpers`, else started by `run`
        self._keep_helpers = keep_helpers  # lent (`engine.KeptHelpers`): left running at the end

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
        """Beats of this worker's run (with its costs so far, for `normtune status`) and of its trials."""
        while not stop.wait(self.opts.heartbeat_interval):
            t = time.perf_counter()
            try:
                for tid in self.pending.held():
                    self.storage.record_heartbeat(tid)
                self.store.workers.beat(run_id, grace_s=self.opts.grace_period, device=self._device(),
                                costs=self.costs.to_dict())
            except Exception as err:  # noqa: BLE001 - a missed heartbeat only risks a takeover
                log.debug("heartbeat failed: %s", err)
            self.costs.add("heartbeat", time.perf_counter() - t)

    def _device(self) -> int | None:
        return None if self.info.interpret else self.opts.device

    # ------------------------------------------------------------------------------------------ main loop

    def run(self) -> SweepSummary:
        opts, summary = self.opts, SweepSummary()
        self.costs = Costs()
        t0 = self.costs.t0
        old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self._on_signal)
        # Steps of this run (and of its helpers, unless started ahead of it) are recorded afresh.
        timeline.forget(RUN_STEPS + (() if self._helpers else HELPER_STEPS))
        compile_workers = opts.compile_workers if opts.compile_workers is not None else default_compile_workers(1)
        measurer, pool = self._helpers or start_helpers(opts.device, opts.interpret, compile_workers,
                                                        timing=opts.timing, l2_bytes=self.info.l2_bytes,
                                                        measurer_class=MeasuringProcess)
        self._helpers = None
        self._measurer = asynchronous(measurer)
        processes = 0 if pool is None else compile_workers or COMPILERS_PER_GPU
        self.ahead = CompileAhead(pool, self.info.sm_count, processes, self.costs)
        self.held_ahead = opts.held_ahead(processes)
        self.pending = PendingTrials(opts, self.store, self.info, self._measurer, self.ahead, self.costs, self.emit,
                                     abandoning=lambda: self.stop_requested >= 2)
        self.proposer = (Proposer(self.store.url, self.costs, self.ahead.proposed(self._books))
                         if opts.proposes_ahead else None)
        run_id = self.store.start_run(self.info, kind="sweep", command_line=command_line())
        self.store.workers.beat(run_id, grace_s=opts.grace_period, device=self._device())
        self.store.workers.mark_dead_runs()
        stop_hb = threading.Event()
        heartbeats = threading.Thread(target=self._heartbeat_loop, args=(run_id, stop_hb), daemon=True)
        heartbeats.start()
        status = "failed"
        self.emit("start", {"problems": len(opts.problems), "trials": opts.trials, "run_id": run_id})
        try:
            with overrun_guard(opts.time_budget_s, opts.trial_timeout_s, summary):
                self._rounds(run_id, t0, summary)
            status = "interrupted" if summary.stopped == "interrupted" else "finished"
        finally:
            stop_hb.set()
            heartbeats.join(timeout=60)  # its last beat is written before the final costs, never beside them
            if self.proposer is not None:
                self.proposer.close()
            self.ahead.stop()
            if not self._keep_helpers:  # lent ones stay with their owner
                self._measurer.close()
                stop_pool(pool)  # its processes hold nothing to save: killed, not waited for
            summary.signal = self._signal
            summary.remaining = remaining(self.opts, self.info.interpret, self.store, self._books)
            summary.costs = self.costs.to_dict()
            try:
                self.store.workers.save_costs(run_id, summary.costs)
            finally:
                self.store.end_run(run_id, status=status)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            summary.wall_s = time.perf_counter() - t0
            self.emit("finish", {"summary": summary})
        return summary

    def _rounds(self, run_id: int, t0: float, summary: SweepSummary) -> None:
        """Every problem first gets a few trials (the default and its neighbours), then all are deepened to
        `trials`, so that a time-budgeted sweep covers every problem before it refines any. Each worker starts
        at its own place in the problem list, so that workers spread over problems instead of sharing one.

        The trials come from `_feed` (claims, proposals, compile-ahead) and are measured by `_pipeline`, which
        keeps the measuring process busy: while one trial measures, the previous one is stored and the next
        ones are proposed. The seeds those claims will get are compiled ahead of them (`CompileAhead.warm`)."""
        problems = self.opts.problems
        start = self.opts.worker_index * len(problems) // max(1, self.opts.workers)
        order = problems[start:] + problems[:start]
        by_key: dict[str, ProblemSummary] = {}
        targets = sorted({min(self.opts.trials, FIRST_ROUND), self.opts.trials})
        self.ahead.warm(seeds_ahead(order, targets, self.opts, self.info, self.store, self._books, self.costs))
        self._pipeline(self._feed(order, targets, run_id, t0, by_key), run_id, t0, summary)
        # A trial of ours that ended unmeasured (taken over meanwhile) leaves its problem short: once more.
        short = [] if summary.stopped else [
            p for p in order if p.key in self._books and not self._exhausted.get(p.key) and sum(
                s.measured for s in self.store.workers.slots(self._books[p.key].name).values())
            < self._books[p.key].target(self.opts.trials)]
        if short:
            self._pipeline(self._feed(short, [self.opts.trials], run_id, t0, by_key), run_id, t0, summary)
        summary.problems = [by_key[p.key] for p in problems if p.key in by_key]
        # Leave the studies clean for whoever looks next: trials of workers that died after storing their
        # measurement are told, and dead runs recorded.
        with self.costs.timed("database"):
            self.store.workers.mark_dead_runs()
            for book in self._books.values():
                book.repair(self.store)

    def _feed(self, order: list[Problem], targets: list[int], run_id: int, t0: float,
              by_key: dict[str, ProblemSummary]) -> Iterator:
        """The trials to measure, in order: a `Pending` per claimed slot (created, its compile submitted), a
        `_ProblemEnd` after each problem's trials of a round, and `_IDLE` when only slots that other workers
        hold are left (the pipeline waits, then asks again). Lazy: a problem's study is opened only when its
        turn comes, so measuring starts before the rest are loaded.

        A problem's seeds are claimed one after another; once its slots get the sampler's trials, the problems
        take turns, one sampled trial each: the trials held ahead (compiling while others measure) then spread
        over the studies, so that each proposal has the measurements of the study's earlier ones."""
        for target in targets:
            busy, announced = list(order), set()
            while busy:
                waiting, turns = [], []
                for problem in busy:
                    if self._feed_stops(t0):
                        return
                    book = self._book(problem)
                    ps = by_key.setdefault(problem.key, ProblemSummary(problem, book.name))
                    goal = book.target(target)
                    if problem.key not in announced:
                        announced.add(problem.key)
                        self.emit("problem", {"problem": book.problem, "study": book.name, "target": goal})
                    sampled = False
                    while not self._feed_stops(t0) and not self._exhausted.get(problem.key):
                        item = self.pending.start_next(book, ps, goal, run_id)  # claimed and created at once
                        if item is None:
                            with self.costs.timed("database"):
                                claim = self.store.workers.claim_slot(book.name, goal, run_id)
                            if claim is None:
                                break
                            slot, dead_trial = claim
                            if dead_trial is not None:
                                with self.costs.timed("database"):
                                    book.fail_orphan(dead_trial)
                            item = self.pending.start(book, ps, slot, run_id)
                        if item is None:
                            self._exhausted[problem.key] = True
                            break
                        yield item
                        if item.trial.sampled:  # the next problem's turn
                            sampled = True
                            break
                    if sampled:
                        turns.append(problem)
                        continue
                    if self.proposer is not None:
                        self.proposer.done(book)
                    yield _ProblemEnd(book, ps)
                    if not self._exhausted.get(problem.key) and self._held_by_others(book, goal, run_id):
                        waiting.append(problem)
                if turns:  # another turn for the problems with sampled slots left (and a look at the others)
                    busy = turns + waiting
                    continue
                busy = waiting
                if busy:
                    yield _IDLE
                    with self.costs.timed("database"):
                        self.store.workers.mark_dead_runs()
                        for problem in busy:
                            self._book(problem).repair(self.store)

    def _feed_stops(self, t0: float) -> str | None:
        self._fed_stop = self._stopping(t0)
        return self._fed_stop

    def _held_by_others(self, book: StudyBook, goal: int, run_id: int) -> bool:
        """True when slots of the problem below `goal` are unmeasured and held by another live worker."""
        with self.costs.timed("database"):
            slots = self.store.workers.slots(book.name)
        if sum(s.measured for s in slots.values()) >= goal:
            return False
        return any(not s.measured and s.alive and s.run_id != run_id for s in slots.values())

    def _pipeline(self, feed: Iterator, run_id: int, t0: float, summary: SweepSummary) -> None:
        """Measure what `feed` gives: a `Dispatcher` thread keeps the measuring process busy (the next ready trial
        goes as soon as a result comes back), while this thread stores the results and claims, proposes and
        creates the trials after them (up to `lookahead` held). A measurement is committed to the store with (or
        before) its trial's tell, so a SIGKILL loses nothing stored; a result collected but not stored yet when
        the worker is killed was never committed: its slot is taken over and measured again. A first signal or the
        time budget lets the trial in flight finish and gives the others back; a second abandons it."""
        lookahead = self.held_ahead
        order: deque = deque()  # trials not stored yet and problems' ends, in feed order
        dispatcher = Dispatcher(self.pending, summary, self.costs, self._first_goes_now).start()
        idle = ended = finished = False
        try:
            while True:
                stopping = self._stopping(t0)
                self.ahead.refill()
                for item, result in dispatcher.results():  # stored while the next trials measure
                    order.remove(item)
                    self.pending.commit(item, result, run_id, summary)
                self._summarize_ready(order)
                if stopping:
                    summary.stopped = stopping
                    for rest in dispatcher.stop_sending():  # the trial in flight finishes (a second signal abandons it)
                        order.remove(rest)
                        self.pending.abandon(rest, run_id)
                    dispatcher.close()
                    for item, result in dispatcher.results():
                        order.remove(item)
                        self.pending.commit(item, result, run_id, summary)
                    break
                held = sum(isinstance(x, Pending) for x in order)
                if not (ended or idle) and held < lookahead:
                    nxt = next(feed, None)
                    if nxt is None:
                        ended = True
                    elif nxt is _IDLE:
                        idle = True
                    else:
                        order.append(nxt)
                        if isinstance(nxt, Pending):
                            dispatcher.add(nxt)
                            if dispatcher.sent == 0:  # the first trial goes before the ones after it are proposed
                                dispatcher.wait_sent(1, 0.0 if not self._sendable_now(nxt) else 60.0)
                    continue
                if held == 0:
                    self._summarize_ready(order)
                    if ended:
                        finished = True
                        break
                    if idle:  # only slots of other workers are left: look again shortly
                        time.sleep(min(1.0, self.opts.heartbeat_interval / 2))
                        idle = False
                        continue
                dispatcher.wait(0.05)
            summary.stopped = summary.stopped or self._fed_stop  # the feed may have stopped first
        finally:
            # Past a failure, the measurement in flight is not waited for; nothing unstored is kept.
            dispatcher.close(interrupt=None if finished or summary.stopped else self._measurer.interrupt,
                             timeout=self.opts.trial_timeout_s)
            for item, result in dispatcher.results() if dispatcher.error is None else []:  # measured, not stored
                order.remove(item)
                self.pending.abandon(item, run_id)
            for rest in [x for x in order if isinstance(x, Pending)]:
                order.remove(rest)
                self.pending.abandon(rest, run_id)
            self._summarize_ready(order)
            feed.close()

    def _sendable_now(self, item: Pending) -> bool:
        """True when the dispatcher sends `item` without waiting (compiled, or the first to a ready process)."""
        return item.compiled is None or item.compiled.done() or self._first_goes_now()

    def _first_goes_now(self) -> bool:
        """Nothing was sent yet and the measuring process is ready: the first trial goes now, compiled there if
        its compile-ahead job has not ended, before the trials after it are proposed."""
        return self.costs.startup_s is None and getattr(self._measurer, "answering", lambda: False)()

    def _summarize_ready(self, order: deque) -> None:
        """Summarize the problems whose round ended (a marker in `order`) once their trials are all stored."""
        unstored = {id(x.book) for x in order if isinstance(x, Pending)}
        for x in list(order):
            if not isinstance(x, Pending) and id(x.book) not in unstored:
                order.remove(x)
                self._summarize(x)

    def _book(self, problem: Problem) -> StudyBook:
        if problem.key not in self._books:
            book = StudyBook(self.opts, problem, self.info.sm_count, self.info.interpret, self.storage,
                             claimed_slots=lambda name: max(self.store.workers.slots(name), default=-1) + 1,
                             costs=self.costs)
            with self.costs.timed("database"):
                self.store.workers.adopt_measured_trials(book.name)
                book.repair(self.store)
            book.proposer = self.proposer
            self._books[problem.key] = book
            timeline.mark("first_study")
        return self._books[problem.key]

    # --------------------------------------------------------------------------------------------- ending

    def _summarize(self, end: "_ProblemEnd") -> None:
        """A problem's trials of this round are all stored: its summary from the database."""
        with self.costs.timed("database"):
            end.book.summarize(self.store, end.ps, self.info.interpret)
        self.emit("problem_done", {"summary": end.ps})
