"""TPE's proposals made ahead in a process of their own (`Proposer`).

A sampled trial's proposal (reading the study, building TPE's estimators, drawing until the space accepts a
config) is pure Python and most of a sweep worker's own work per sampled trial. The worker's one thread also
claims slots, creates trials and stores measurements while the GPU measures, so when proposing is added the
worker falls behind the GPU. The proposer process keeps up to `AHEAD` proposals ready for each study the worker
is filling; the worker takes one when it creates a trial, and the process proposes the next meanwhile.

- The process only reads: it opens the studies on its own connection and writes nothing. Slots are claimed and
  trials created by the worker as without it, so the claims' guarantees (exact counts, nothing lost under a
  kill) do not depend on it.
- A proposal made and not yet created counts, for the proposals after it, as a running trial with its params
  (TPE's constant liar), as it will once created; a proposal reads the study afresh, so it learns from every
  measurement stored before it.
- The worker's first proposal of each study is its own (the process starts on it then); after that, a
  proposal the process has not delivered within `WAIT_S`, or a process that is gone, is proposed by the worker
  itself, as without a proposer.
- Neither side ever waits on the other's reading: the process sends from a thread of its own (`_Outbox`), so it
  keeps reading the worker's requests while its proposals fill the pipe, and the worker takes in what the process
  sent before each request. (A process blocked in a send stops reading; a worker whose requests then filled the
  pipe the other way, as when hundreds of studies reach their first sampled trial at once, would block in its
  own send, and both would wait for ever.)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

AHEAD = 2  # proposals kept ready per study
WAIT_S = 1.0  # longest wait for a proposal the process is making before the worker proposes itself
BUSY_S = 10.0  # longest wait for the process to take a request before it counts as gone


@dataclass
class Proposal:
    """A config the space accepts, proposed ahead: its knob values, the trial template's params, distributions
    and the sampler's system attributes (`Sampling.propose`), and the proposals the space rejected on the way."""
    pid: int
    values: dict
    record: dict
    rejected: int


class Proposer:
    """The worker's side: `take(book)` a ready proposal of the book's study (None: propose it yourself),
    `took(book, proposal)` once its trial exists, `done(book)` when the worker stops filling the study. The
    process starts with the first `take`, so sweeps whose slots all get seeds never start it."""

    def __init__(self, url: str, costs=None, on_proposal: Callable[[str, dict], None] | None = None):
        self.url, self.costs, self.on_proposal = url, costs, on_proposal  # on_proposal(study, values) on receipt
        self._proc = self._conn = None
        self._gone = False
        self._ready: dict[str, deque] = {}  # study -> proposals received, not taken
        self._wanted: set[str] = set()  # studies the process proposes for
        self._own: set[str] = set()  # studies the process could not propose for: the worker's own again
        self._answering = False  # the process has started (imports done, study tables open)

    def take(self, book) -> Proposal | None:
        if self._gone:
            return None
        if self._proc is None:
            self._start()
        if book.name in self._own:
            return None
        if book.name not in self._wanted:
            self._wanted.add(book.name)
            self._ready[book.name] = deque()
            self._receive(0.0)
            self._send(("want", book.name, _spec(book), AHEAD))
            return None
        self._receive(0.0)
        ready = self._ready[book.name]
        # While the process starts, nothing is waited for; once it answers, its proposal in the making is.
        deadline = time.perf_counter() + WAIT_S
        while not ready and self._answering and book.name not in self._own and not self._gone:
            left = deadline - time.perf_counter()
            if left <= 0 or not self._receive(left):
                break
        return ready.popleft() if ready else None

    def took(self, book, proposal: Proposal) -> None:
        """The proposal's trial is created: the process reads it from the study from now on."""
        self._receive(0.0)
        self._send(("took", book.name, proposal.pid))

    def done(self, book) -> None:
        """The worker stops filling the study (its slots are claimed): the proposals not taken are dropped."""
        if book.name in self._wanted:
            self._wanted.discard(book.name)
            self._ready.pop(book.name, None)
            self._send(("drop", book.name))

    def close(self) -> None:
        """End the process at once: it holds nothing to save (it only reads)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)
            self._conn.close()
        self._proc, self._gone = None, True

    # ------------------------------------------------------------------------------------------ the pipe

    def _pipe(self, ctx):
        """(the worker's end, the process's end) of the pipe between them."""
        return ctx.Pipe(duplex=True)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, theirs = self._pipe(ctx)
        self._proc = ctx.Process(target=_serve, args=(theirs, self.url, os.getpid()), daemon=True,
                                 name="normtune-proposer")
        self._proc.start()
        theirs.close()

    def _send(self, message) -> None:
        if self._gone or self._conn is None:
            return
        try:
            self._conn.send(message)
        except (OSError, BrokenPipeError):
            self._gone = True

    def _receive(self, timeout: float) -> bool:
        """Take in what the process sent, waiting up to `timeout` for the first message; False when nothing
        came."""
        got = False
        try:
            while self._conn.poll(timeout):
                kind, name, pid, values, record, rejected, busy_s = self._conn.recv()
                got, timeout = True, 0.0
                if self.costs is not None:
                    self.costs.add("proposer", busy_s)
                if kind == "ready":
                    self._answering = True
                elif kind == "proposal" and name in self._wanted:
                    self._ready[name].append(Proposal(pid, values, record, rejected))
                    if self.on_proposal is not None:
                        self.on_proposal(name, values)
                elif kind == "own" and name in self._wanted:  # the process could not propose for it
                    self._own.add(name)
        except (EOFError, OSError):
            self._gone = True
        return got


def _spec(book) -> dict:
    """What the process needs to open the book's study and propose as its sampler does."""
    return {"problem": book.problem.to_dict(), "sm_count": book.space.sm_count, "limits": book.space.limits,
            "sampler": book.opts.sampler, "seed": book.opts.seed}


# ---------------------------------------------------------------------------------------------- the process

class _Study:
    """One study as the process proposes for it: its sampler, space and the proposals not created yet."""

    def __init__(self, name: str, spec: dict, storage):
        import optuna

        from normtune.kernels.config import Problem

        from ..space import Space
        from .sampling import Sampling

        self.space = Space(Problem.from_dict(spec["problem"]), spec["sm_count"], spec["limits"])
        self.sampling = Sampling(spec["sampler"], self.space, spec["seed"])
        self.study = optuna.load_study(study_name=name, storage=storage, sampler=self.sampling.sampler)
        self.wanted = 0
        self.outstanding: dict[int, dict] = {}  # pid -> record of a proposal sent, not created yet

    def liars(self) -> tuple:
        import optuna

        out = []
        for i, (pid, record) in enumerate(sorted(self.outstanding.items())):
            trial = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=record["params"],
                                              distributions=record["distributions"])
            trial.number, trial._trial_id = 10**9 + i, -2 - i  # not the proposed trial's (-1), not stored ones'
            out.append(trial)
        return tuple(out)

    def propose(self):
        """(values, record, rejected): the next config the space accepts; values None when none came within the
        worker's own limit of rejections."""
        from .trials import INVALID_STREAK_LIMIT

        liars = self.liars()
        for attempt in range(INVALID_STREAK_LIMIT):
            values, record = self.sampling.propose(self.study, retry=attempt > 0, liars=liars)
            if self.space.why_not(self.space.config(values)) is None:
                return values, record, attempt
        return None, None, INVALID_STREAK_LIMIT


class _Outbox:
    """The process's messages to the worker, sent in order by a thread of their own, so that the process's main
    loop never blocks in a send (see the module docstring)."""

    def __init__(self, conn):
        self._conn, self._queue = conn, queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="normtune-proposer-outbox").start()

    def send(self, message) -> None:
        self._queue.put(message)

    def _run(self) -> None:
        while True:
            try:
                self._conn.send(self._queue.get())
            except (EOFError, OSError):  # the worker is gone: the main loop sees it too
                return


def _serve(conn, url: str, parent_pid: int) -> None:
    import logging
    import warnings

    from .lifeline import die_with_parent, ignore_stop_signals

    die_with_parent(parent_pid)
    ignore_stop_signals()
    import optuna

    from ..store import schema

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    logging.getLogger("normtune").setLevel(logging.ERROR)
    storage = schema.optuna_storage(url, url)
    outbox = _Outbox(conn)
    outbox.send(("ready", None, 0, None, None, 0, 0.0))
    studies: dict[str, _Study] = {}
    order: list[str] = []  # studies wanted, the latest last
    next_pid = 0
    try:
        while True:
            idle = not any(len(studies[n].outstanding) < studies[n].wanted for n in order)
            if conn.poll(None if idle else 0):
                message = conn.recv()
                if message[0] == "want":
                    _, name, spec, count = message
                    if name not in studies:
                        try:
                            studies[name] = _Study(name, spec, storage)
                        except Exception:  # noqa: BLE001 - the worker proposes for this study itself
                            outbox.send(("own", name, -1, None, None, 0, 0.0))
                            continue
                    studies[name].wanted = count
                    order = [n for n in order if n != name] + [name]
                elif message[0] == "took" and message[1] in studies:
                    studies[message[1]].outstanding.pop(message[2], None)
                elif message[0] == "drop" and message[1] in studies:
                    studies[message[1]].wanted = 0
                    studies[message[1]].outstanding.clear()
                    order = [n for n in order if n != message[1]]
                continue  # every request is read before the next proposal
            name = next(n for n in reversed(order) if len(studies[n].outstanding) < studies[n].wanted)
            entry = studies[name]
            t = time.perf_counter()
            try:
                values, record, rejected = entry.propose()
            except Exception:  # noqa: BLE001 - e.g. the database unreachable: the worker proposes itself
                values, rejected = None, 0
            busy = time.perf_counter() - t
            if values is None:  # nothing the space accepts came (or no proposal): the worker's own from now on
                entry.wanted = 0
                outbox.send(("own", name, -1, None, None, rejected, busy))
                continue
            next_pid += 1
            entry.outstanding[next_pid] = record
            outbox.send(("proposal", name, next_pid, values, record, rejected, busy))
    except (EOFError, OSError, KeyboardInterrupt):  # the worker is gone
        return
