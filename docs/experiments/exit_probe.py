"""Where a `normtune` command spends the time after its work is done: runs the command line given, dumps every
thread's stack to stderr every 0.4 s from the moment the sweep prints its closing steps, and prints when the
command returned, which threads and child processes were left, and when the exit handlers ran.

    python3 docs/experiments/exit_probe.py sweep --gpu auto --shapes 4096x4096 --norm rms_norm --trials 14

Compare the last line's time with the process's wall clock (e.g. `time`): the rest is the interpreter's own exit.
"""

from __future__ import annotations

import atexit
import faulthandler
import sys
import threading
import time


def main() -> None:
    t0 = time.time()

    def say(what: str) -> None:
        sys.stderr.write(f"exit probe: {what} at {time.time() - t0:.2f} s\n")
        sys.stderr.flush()

    atexit.register(lambda: say("exit handlers done"))  # registered first: runs last
    threading._register_atexit(lambda: say("threads' exit started"))
    from normtune.cli import app
    from normtune.tuner.sweep import timeline

    line = timeline.line

    def traced(names):  # the closing steps are being printed: the command's own work is over
        faulthandler.dump_traceback_later(0.4, repeat=True, file=sys.stderr)
        return line(names)

    timeline.line = traced
    try:
        app()
    finally:
        faulthandler.cancel_dump_traceback_later()
        import multiprocessing as mp

        say("the command returned")
        say("threads left: " + ", ".join(f"{t.name}{'' if t.daemon else ' (non-daemon)'}"
                                         for t in threading.enumerate()))
        say("child processes left: " + (", ".join(f"{p.name} ({p.pid})" for p in mp.active_children()) or "none"))


if __name__ == "__main__":  # spawned processes import this file as their main module: they must not run it
    main()
