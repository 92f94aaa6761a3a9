"""Helper processes end with the process that started them.

A sweep's measuring process and compile processes, and the multi-GPU launcher's workers, are children that must
not outlive their parent: a SIGKILLed worker would otherwise leave a measuring process holding its GPU (a hung
kernel for ever), and with it multiprocessing's resource tracker, which lives while any process holds its pipe.

Two lines of defence, armed first thing in the child:
- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`): the kernel signals the child the moment its parent
  dies. It fires when the *thread* that started the child ends, so children are started from the thread that
  runs the sweep for its whole life (the main thread, or a worker process's main thread).
- A watchdog thread that looks at the parent's PID twice a second, on any POSIX system: once the child has been
  re-parented, it signals itself. It also covers the window before the signal is armed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Make this process receive `sig` when `parent_pid` (its parent when it was started) exits. SIGKILL for
    processes with nothing to save; SIGTERM for sweep workers, which then finish their trial and stop."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: the watchdog alone
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
        return
    threading.Thread(target=_watch, args=(parent_pid, sig), daemon=True, name="normtune-lifeline").start()


def _watch(parent_pid: int, sig: int) -> None:
    event = threading.Event()
    while not event.wait(WATCH_INTERVAL_S):
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)
            return


def ignore_stop_signals() -> None:
    """Helper processes leave Ctrl-C / SIGTERM to the sweep that owns them: a terminal's Ctrl-C reaches the whole
    process group, and the sweep decides whether the trial in flight finishes (first signal) or is abandoned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
