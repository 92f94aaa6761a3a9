"""The measuring process fed from a thread of its own (`Dispatcher`).

The worker's main thread claims slots, proposes, creates trials and stores measurements; each of those takes
milliseconds, and a measuring process that finishes while one runs would wait for it to end. The dispatcher
thread waits on the measuring process instead: as soon as a result comes back it hands it over and sends the next
trial that is ready, whatever the main thread is doing. Waiting (on the measuring process, on compiles) releases
the GIL, and the worker's thread switch interval is short while the dispatcher runs, so it gets its turn at once.

Which trial goes next: the first one in line whose compile is done, so that a slow compile does not hold up the
trials behind it; where none is done, the worker's first trial goes at once to a measuring process that is ready
(compiled there), else the first one done within `PICK_WAIT_S` (else the first in line, whose compile `send`
waits for). Compile-ahead refills stay with the main thread: the dispatcher never submits to the pool.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Callable

PICK_WAIT_S = 1.0  # longest wait for any compile in line to end before the first in line goes
SWITCH_INTERVAL_S = 0.001  # the worker's GIL switch interval while a dispatcher runs


class Dispatcher:
    """Sends `add`ed trials (`Pending`) to the measuring process through `pending` (`PendingTrials`), one at a
    time, and keeps their results for `results()`. `first_goes_now()` says whether a first trial may go before
    its compile ends. `stop_sending()` sends nothing more (the trial in flight finishes); `close()` ends the
    thread, interrupting a measurement still in flight only when asked."""

    def __init__(self, pending, summary, costs, first_goes_now: Callable[[], bool]):
        self.pending, self.summary, self.costs = pending, summary, costs
        self._first_goes_now = first_goes_now
        self._cond = threading.Condition()
        self._line: deque = deque()  # trials to send, in feed order
        self._results: deque = deque()  # (trial, result): measured (or failed at once), not handed over yet
        self._inflight = None
        self._sent = 0
        self._stop = False
        self.error: BaseException | None = None  # raised by the thread: the main thread re-raises it
        self._thread = threading.Thread(target=self._run, name="normtune-dispatch", daemon=True)
        self._switch = sys.getswitchinterval()

    def start(self) -> "Dispatcher":
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread.start()
        return self

    def add(self, item) -> None:
        with self._cond:
            self._line.append(item)
            self._cond.notify_all()

    def results(self) -> list:
        """The results come back since the last call, in the order they came; once the thread failed and they
        are all handed over, its error is raised."""
        with self._cond:
            out = list(self._results)
            self._results.clear()
        if not out and self.error is not None:
            raise self.error
        return out

    @property
    def sent(self) -> int:
        """Trials handed to the measuring process (or failed before it) so far."""
        return self._sent

    def wait(self, timeout: float) -> None:
        """Until a result comes back or the line runs empty (the thread wants trials), at most `timeout`."""
        with self._cond:
            if not self._results and (self._line or self._inflight is not None):
                self._cond.wait(timeout)

    def wait_sent(self, count: int, timeout: float) -> None:
        """Until `count` trials went to the measuring process, at most `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._sent < count and self.error is None and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def stop_sending(self) -> list:
        """Send nothing more; returns the trials that were waiting to go (not sent)."""
        with self._cond:
            self._stop = True
            unsent = list(self._line)
            self._line.clear()
            self._cond.notify_all()
        return unsent

    def close(self, interrupt: Callable[[], None] | None = None, timeout: float = 600.0) -> None:
        """End the thread after the trial in flight (`interrupt` it first, where given) and restore the switch
        interval."""
        self.stop_sending()
        if interrupt is not None and self._inflight is not None:
            interrupt()
        if self._thread.is_alive():
            self._thread.join(timeout)
        sys.setswitchinterval(self._switch)

    # ----------------------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            while True:
                item = self._next()
                if item is None:
                    return
                result = self.pending.send(item, self.summary, tick=lambda: None)
                with self._cond:
                    self._sent += 1
                    self._cond.notify_all()
                if result is None:
                    result = self.pending.collect(item, self.summary)
                with self._cond:
                    self._inflight = None
                    self._results.append((item, result))
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread, which re-raises it
            with self._cond:
                self.error, self._inflight = err, None
                self._cond.notify_all()

    def _next(self):
        """The next trial to send (taken off the line and marked in flight); None once stopped."""
        waited_since = None
        with self._cond:
            while True:
                if self._stop:
                    return None
                item = self._pick(waited_since)
                if item is not None:
                    if waited_since is not None:
                        waited = time.perf_counter() - waited_since
                        self.summary.compile_wait_s += waited
                        self.costs.add("compile_wait", waited)
                    self._line.remove(item)
                    self._inflight = item
                    return item
                if self._line and waited_since is None:
                    waited_since = time.perf_counter()
                elif not self._line:
                    waited_since = None
                self._cond.wait(0.02 if self._line else 0.5)

    def _pick(self, waited_since: float | None):
        if not self._line:
            return None
        ready = next((x for x in self._line if x.compiled is None or x.compiled.done()), None)
        if ready is not None:
            return ready
        if self._sent == 0 and self._inflight is None and self._first_goes_now():
            return self._line[0]
        if waited_since is not None and time.perf_counter() - waited_since >= PICK_WAIT_S:
            return self._line[0]
        return None
