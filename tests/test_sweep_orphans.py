"""A SIGKILLed sweep worker takes its helper processes with it.

The sweep's measuring process (and multiprocessing's resource tracker, which lives as long as a process holds
its pipe) must not outlive the worker that owns it: on a GPU a hung kernel in an orphaned measuring process would
hold the device indefinitely. Only the worker's own PID is killed here, never its process group, as a user or a
scheduler killing one process would.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from sweep_support import INTERPRETER_ONLY, kill_group, start_sweep, sweep_args, sweep_env, wait_for

pytestmark = INTERPRETER_ONLY


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_killed_worker_takes_its_measuring_process_and_resource_tracker_with_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    faults, log = tmp_path / "faults.log", tmp_path / "sweep.log"
    env = sweep_env(tmp_path, [{"match": {}, "fault": "hang"}], NORMTUNE_TEST_HANG_S="90")
    proc = start_sweep(sweep_args(url, trials=2, extra=["--trial-timeout", "60"]), env, tmp_path, log)
    try:
        line = wait_for(lambda: faults.exists() and faults.read_text().strip(), 120, "the hung trial", proc, log)
        measurer = int(line.split()[0])
        helpers = _children(proc.pid)
        assert measurer in helpers, f"the hung trial ran in {measurer}, not a child of the sweep {proc.pid}"
        trackers = [pid for pid in helpers if "resource_tracker" in _cmdline(pid)]
        os.kill(proc.pid, signal.SIGKILL)  # the worker only
        proc.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(pid) for pid in helpers):
            time.sleep(0.1)
        left = {pid: _cmdline(pid)[:120] for pid in helpers if _alive(pid)}
        assert not left, f"helpers of the killed worker still running 5 s later: {left} (trackers {trackers})"
        time.sleep(1.0)  # anything the dying helpers print lands in the log by now
        text = log.read_text()
        assert "BrokenPipeError" not in text and "Traceback" not in text, text[-3000:]
    finally:
        kill_group(proc)
