"""The `--devices` launcher spawns its device workers (and the host's compile pool) before it imports torch,
detects the GPU and opens the database: a sweep it then refuses leaves no process behind, and each worker's
stored timeline says when it was spawned (no timings asserted: only what comes before what)."""

from __future__ import annotations

import dataclasses
import json
import os
from multiprocessing import resource_tracker
import sqlite3
import time
from pathlib import Path

import pytest
from sweep_support import CLI, INTERPRETER_ONLY, run_sweep, sweep_env

from normtune.tuner.sweep import timeline

pytestmark = INTERPRETER_ONLY

# The launcher, with device detection standing in for a host with GPUs (the interpreter's description of the
# device): the database check comes after it.
LAUNCHER_WITH_GPUS = [
    CLI[0], "-c",
    "import normtune.tuner.sweep.launcher as launcher; from normtune.tuner.gpu_info import detect; "
    "launcher.device_info = lambda gpu, interpret, device=0: detect(device, interpret=True); "
    "from normtune.cli import app; app()"]


def _tagged(tag: str) -> dict[int, str]:
    """Processes (other than this one) whose environment holds NORMTUNE_TEST_TAG=`tag`, with their command."""
    found = {}
    needle = f"NORMTUNE_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
    return found


def _left(tag: str, wait_s: float = 5.0) -> dict[int, str]:
    """The tagged processes still running `wait_s` later (what was killed may take a moment to be reaped)."""
    deadline = time.monotonic() + wait_s
    left = _tagged(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _tagged(tag)
    return left


@pytest.mark.parametrize("case", ["bad value", "no such device", "database cannot be opened"])
def test_a_refused_devices_sweep_is_one_error_line_and_leaves_no_process_behind(tmp_path, case):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    devices, program, named = "0,1", None, "--devices"
    if case == "bad value":
        devices = "0,zero"
    elif case == "database cannot be opened":
        url, program, named = f"sqlite:///{tmp_path / 'missing' / 'results.db'}", LAUNCHER_WITH_GPUS, "results.db"
    else:  # this host has no CUDA device at all
        named = "GPU"
    tag = f"{os.getpid()}-{tmp_path.name}"
    args = ["sweep", "--norm", "rms_norm", "--shapes", "40x96", "--trials", "1", "--db", url, "--devices", devices]
    done = run_sweep(args, sweep_env(tmp_path, NORMTUNE_TEST_TAG=tag), tmp_path, program=program)
    left = _left(tag)
    assert not left, f"{case}: processes of the refused sweep still running: {left}"
    assert done.returncode == 1, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], lines


def test_each_devices_worker_stores_when_it_was_spawned_before_the_launcher_opened_the_database(tmp_path,
                                                                                                 monkeypatch):
    from normtune.kernels.config import Problem
    from normtune.tuner.store.database import Store
    from normtune.tuner.sweep import SweepOptions
    from normtune.tuner.gpu_info import detect
    from normtune.tuner.sweep.device_workers import DeviceWorkers, run_on_devices

    monkeypatch.setattr(timeline, "_marks", {})
    monkeypatch.setenv(timeline.ENV, "0")  # restored afterwards; the command below records its own start
    timeline.start_command()
    timeline.mark("options")
    workers = DeviceWorkers([0, 1], 0, interpret=True)  # interpreted workers stand in for two GPUs
    url = f"sqlite:///{tmp_path / 'results.db'}"
    opts = SweepOptions(gpu_key="interpret", problems=[Problem("rms_norm", 40, 96, "bf16"),
                                                       Problem("rms_norm", 24, 64, "fp32")],
                        trials=2, sampler="random", interpret=True, compile_workers=0)
    with Store(url):
        timeline.mark("store_open")  # the launcher's set-up, done while the workers start
    # Each worker records the device its launcher described (it detects nothing itself).
    infos = [dataclasses.replace(detect(interpret=True), host=f"described-{i}") for i in range(2)]
    assert run_on_devices(opts, [0, 1], url, workers=workers, infos=infos) == 0
    # The launcher records when its last worker exited (the command's closing steps count from it).
    assert timeline.marks()["workers_exited"] >= timeline.marks()["store_open"]
    assert timeline.line(("workers_exited", "no_such_step")).startswith("workers exited ")
    assert timeline.marks()["helpers_stopped"] >= timeline.marks()["workers_exited"]
    db = sqlite3.connect(tmp_path / "results.db")
    rows = [json.loads(c) for (c,) in db.execute("SELECT costs_json FROM normtune_run_costs")]
    assert sorted(h for (h,) in db.execute("SELECT host FROM normtune_runs")) == ["described-0", "described-1"]
    assert len(rows) == 2
    for costs in rows:
        steps = costs["timeline"]
        assert 0 <= steps["launcher_options"] <= steps["worker_spawned"] <= steps["launcher_workers_spawned"] \
            <= steps["launcher_store_open"], steps
        assert steps["worker_spawned"] <= steps["worker_started"] <= steps["measurer_spawned"] \
            <= steps["store_open"] <= steps["first_study"], steps


def test_workers_are_not_handed_a_sweep_timed_unlike_their_measuring_processes(tmp_path, monkeypatch):
    from normtune.kernels.config import Problem
    from normtune.tuner.measure.harness import Timing
    from normtune.tuner.sweep import SweepOptions
    from normtune.tuner.sweep.device_workers import DeviceWorkers

    tag = f"{os.getpid()}-{tmp_path.name}"
    resource_tracker.ensure_running()  # this test process's own tracker, started before the tag: not left behind
    monkeypatch.setenv("NORMTUNE_TEST_TAG", tag)
    workers = DeviceWorkers([0, 1], 0, interpret=False)  # started with the sweep's timing preset
    opts = SweepOptions(gpu_key="h100", problems=[Problem("rms_norm", 40, 96, "bf16")], trials=2,
                        timing=Timing(min_reps=3, max_reps=5, budget_s=0.1))
    try:
        with pytest.raises(ValueError, match="timing"):
            workers.hand_over(opts, f"sqlite:///{tmp_path / 'results.db'}")
    finally:
        workers.abandon()
    assert not workers.handed_over and all(not p.is_alive() for p in workers.procs)
    assert not _left(tag)
