"""A sweep's last resort against a hang (`overrun_guard`): a sweep with a time budget stops on its own at the
budget, finishing the trial in flight within its trial timeout. Should its thread block past both (a pipe both
sides wait on, a call that never returns), the guard raises in that thread once OVERRUN_S more have passed, and
the sweep ends as a sweep at its time budget does: its stored trials kept, its unfinished ones left for a later
worker to take over, the run closed. The command that called it (`tune`, with its own time budget) goes on.

Only on the main thread of a process with SIGALRM (where a signal can reach the blocked call); elsewhere the
sweep runs without it."""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager

log = logging.getLogger("normtune.sweep")

OVERRUN_S = 10.0  # seconds past the time budget and the trial timeout before the guard ends the sweep


class Overran(Exception):
    """Raised in a sweep's thread that blocked past its time budget, its trial timeout and OVERRUN_S."""


@contextmanager
def overrun_guard(budget_s: float | None, trial_timeout_s: float, summary):
    """Run the block under the guard; on an overrun, `summary.stopped` is "time budget" and the block is left."""
    usable = (budget_s is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return
    limit = budget_s + trial_timeout_s + OVERRUN_S

    def overran(signum, frame):
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise Overran(f"the sweep ran {limit:.0f} s, past its time budget of {budget_s:.0f} s and its trial "
                      f"timeout of {trial_timeout_s:.0f} s: stopped where it was blocked")

    previous = signal.signal(signal.SIGALRM, overran)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    except Overran as err:
        log.warning("%s", err)
        summary.stopped = "time budget"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
