"""`normtune sweep` (search launch configs with Optuna, store every measurement) and `normtune status` (a sweep's
state from the database alone)."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    DEFAULT_DB, CLIError, Device, Dtype, Gpu, Interpret, Norms, Residual, ResidualDtype, Shapes, ShapesFrom, Storage,
    Tokens, WeightDtype, check_writable_file, compile_processes, device_info, positive_seconds, problems_option,
    read_only_store, refuse, run_checked, use_interpreter, write_text,
)


# When the command's end steps happened: the sweep done (its last worker exited), the live view closed, the
# summary read; what the command's wall adds after the last is the interpreter's exit.
CLOSING_STEPS = ("sweep_returned", "workers_exited", "view_closed", "store_closed", "summary_read")


def _parse_devices(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        devices = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise CLIError(f"--devices {text!r}: use a comma list of CUDA device indices, e.g. 0,1,2,3") from None
    if not devices or len(set(devices)) != len(devices) or min(devices) < 0:
        raise CLIError(f"--devices {text!r}: use distinct non-negative indices, e.g. 0,1")
    return devices


def sweep(
    gpu: Gpu = "auto",
    norm: Norms = None,
    dtype: Dtype = None,
    shapes: Shapes = None,
    shapes_from: ShapesFrom = None,
    tokens: Tokens = None,
    weight_dtype: WeightDtype = None,
    bias: Annotated[Optional[bool], typer.Option("--bias/--no-bias", help="LayerNorm bias [default: bias]")] = None,
    zero_centered: Annotated[Optional[bool], typer.Option(
        "--zero-centered/--no-zero-centered", help="Zero-centered weights (w = 1 + w') [default: no; with "
                                                   "--shapes-from, the model's]")] = None,
    save: Annotated[str, typer.Option(help="What the forward saves: input | output")] = "input",
    residual: Residual = False,
    residual_dtype: ResidualDtype = None,
    trials: Annotated[int, typer.Option(help="Finished trials each problem should end with (re-running adds "
                                             "only the difference)")] = 40,
    time_budget: Annotated[Optional[float], typer.Option(help="Stop between trials after this many seconds")] = None,
    sampler: Annotated[str, typer.Option(help="tpe | random | grid")] = "tpe",
    storage: Storage = DEFAULT_DB,
    device: Device = 0,
    devices: Annotated[Optional[str], typer.Option(help="Comma list of CUDA devices (0,1,…): one worker per GPU, "
                                                        "sharing only the database")] = None,
    compile_workers: Annotated[Optional[int], typer.Option(
        help="CPU processes compiling upcoming configs: one pool for the host, shared by the --devices workers "
             "[default: 16 per GPU, within the host's cores]")] = None,
    trial_timeout: Annotated[float, typer.Option(help="Seconds before a trial is killed as hung")] = 180.0,
    seed: Annotated[int, typer.Option(help="Sampler seed")] = 0,
    heartbeat_interval: Annotated[int, typer.Option(help="Seconds between a worker's trial heartbeats")] = 20,
    grace_period: Annotated[int, typer.Option(help="Seconds without a heartbeat before another worker fails "
                                                   "and re-queues a trial")] = 60,
    summary: Annotated[Optional[Path], typer.Option(help="Also write a JSON summary here")] = None,
    interpret: Interpret = False,
):
    """Search kernel_1/kernel_2 launch configs with Optuna, measured cold-L2, stored in the results database.
    Any number of sweeps (GPUs of this host with --devices, other hosts on the same PostgreSQL --db) may share the
    work: together they end each problem with exactly --trials trials. Exit code 130/143 after SIGINT/SIGTERM."""
    run_checked(use_interpreter, interpret)
    from normtune.tuner.sweep import timeline

    timeline.start_command()  # the processes started below count from this command's start
    timeline.forget(CLOSING_STEPS)  # a command run before in this process recorded its own
    device_list = run_checked(_parse_devices, devices)
    if device_list and interpret:
        run_checked(refuse, "--devices needs GPUs; --interpret runs one worker on CPU")
    compile_workers = run_checked(compile_processes, compile_workers, len(device_list or ()) or 1)
    if time_budget is not None:
        run_checked(positive_seconds, time_budget, "--time-budget")
    if summary is not None:
        run_checked(check_writable_file, summary, "--summary")
    timeline.mark("options")
    # The processes that measure and compile start first, before this process imports torch, detects the GPU
    # and opens the database, so that their start-up (torch, the CUDA contexts) overlaps all of that: with
    # --devices, one worker per device (each starting its own measuring process) and the host's compile pool;
    # else this worker's measuring and compiling processes.
    helpers = workers = None
    if device_list and len(device_list) > 1:
        from normtune.tuner.sweep.device_workers import DeviceWorkers

        workers = DeviceWorkers(device_list, compile_workers, interpret)
    else:
        from normtune.tuner.sweep.measuring import start_helpers

        helpers = start_helpers(device_list[0] if device_list else device, interpret, compile_workers)
    try:
        _sweep(gpu, device_list, device, interpret, compile_workers, helpers, workers, save=save, norm=norm,
               dtype=dtype, shapes=shapes, shapes_from=shapes_from, tokens=tokens, weight_dtype=weight_dtype, bias=bias,
               zero_centered=zero_centered, residual=residual, residual_dtype=residual_dtype, trials=trials,
               time_budget=time_budget, sampler=sampler, storage=storage, trial_timeout=trial_timeout, seed=seed,
               heartbeat_interval=heartbeat_interval, grace_period=grace_period, summary=summary)
    finally:  # a refusal before the sweep took them over: nothing is left running
        if helpers is not None:
            from normtune.tuner.sweep.compiling import stop_pool

            helpers[0].close()
            stop_pool(helpers[1])
        if workers is not None:
            workers.abandon()


def _sweep(gpu, device_list, device, interpret, compile_workers, helpers, workers, *, save, norm, dtype, shapes,
           shapes_from, tokens, weight_dtype, bias, zero_centered, residual, residual_dtype, trials, time_budget,
           sampler, storage, trial_timeout, seed, heartbeat_interval, grace_period, summary):
    from rich.console import Console

    from normtune.kernels.config import SAVE_MODES
    from normtune.tuner import sweep as S
    from normtune.tuner.store.database import Store
    from normtune.tuner.sweep import timeline

    console = Console(stderr=True)
    started = time.monotonic() - (time.time() - timeline.origin())
    if save not in SAVE_MODES:
        run_checked(refuse, f"--save {save!r}: use one of {', '.join(SAVE_MODES)}")
    problems, model = run_checked(problems_option, shapes, shapes_from, tokens, norm, dtype, weight_dtype,
                                  interpret=interpret, bias=bias, zero_centered=zero_centered, save=save,
                                  residual=residual, residual_dtype=residual_dtype)
    info = run_checked(device_info, gpu, interpret, device_list[0] if device_list else device)
    timeline.mark("device_detected")
    key = info.key if interpret else gpu if gpu != "auto" else info.key
    opts = run_checked(S.SweepOptions, gpu_key=key, problems=problems, trials=trials, time_budget_s=time_budget,
                       sampler=sampler, device=device_list[0] if device_list else device, interpret=interpret,
                       compile_workers=compile_workers, trial_timeout_s=trial_timeout, seed=seed,
                       heartbeat_interval=heartbeat_interval, grace_period=grace_period)
    store = run_checked(Store, storage)
    timeline.mark("store_open")
    if interpret:
        console.print("[yellow]--interpret: kernels run on CPU in the Triton interpreter; these timings are "
                      "interpreter timings and are never emitted as a GPU table[/]")
    if model is not None:
        console.print(f"--shapes-from {model.describe()}: {len(problems)} problems", markup=False)
    targets = {S.study_name(key, p, interpret): trials for p in problems}
    if device_list and len(device_list) > 1:
        store.close()
        infos = [info] + [run_checked(device_info, gpu, interpret, d) for d in device_list[1:]]
        console.print(f"sweeping {len(problems)} problems on devices {device_list} ({store.display_url})")
        with S.LiveView(console, store.url, targets):
            code = S.run_on_devices(opts, device_list, store.url, workers=workers, infos=infos)
        timeline.mark("view_closed")
        with run_checked(read_only_store, store.url) as done:
            since = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=time.monotonic() - started)
            for line in S.worker_lines(S.snapshot(done, prefix="", targets=targets), since, costs=True):
                console.print("sweep: " + line.strip(), markup=False)
        timeline.mark("summary_read")
        _print_closing_steps(console)
        raise typer.Exit(code)
    sw = run_checked(S.Sweep, opts, store, info, helpers=helpers)
    with S.LiveView(console, store.url, targets) as view:
        sw.emit = _sweep_events(view.console)
        result = run_checked(sw.run)
        timeline.mark("sweep_returned")
    timeline.mark("view_closed")
    store.close()
    timeline.mark("store_closed")
    console.print(f"sweep: {result.wall_s:.0f} s wall, {result.measure_s:.0f} s measuring, "
                  f"{result.compile_s:.0f} s compiling in workers ({result.compile_wait_s:.0f} s waited on them)")
    console.print(f"sweep: where the time went: {S.costs_line(result.costs)}", markup=False)
    if summary:
        run_checked(write_text, summary, S.summary_json(result), "--summary")
    _print_closing_steps(console)
    if result.stopped:
        console.print(f"[yellow]stopped ({result.stopped}); remaining: {'; '.join(result.remaining) or 'none'}. "
                      "Re-run the same command to continue.[/]")
    raise typer.Exit(result.exit_code)


def _print_closing_steps(console) -> None:
    from normtune.tuner.sweep import timeline

    closing = timeline.line(CLOSING_STEPS)
    console.print(f"sweep: closing steps since the command started: {closing}", markup=False, soft_wrap=True)


def _sweep_events(console):
    """Lines worth keeping above the live view: each problem's result, and what a signal does."""
    def on_event(kind, data):
        if kind == "problem_done":
            ps = data["summary"]
            console.print(f"{ps.problem.key}: {ps.trials} trials, best {ps.best_us and f'{ps.best_us:.1f} µs'}"
                          + (f" (default {ps.default_us:.1f} µs)" if ps.default_us else "")
                          + (f", failures {ps.failures}" if ps.failures else ""))
        elif kind == "signal":
            console.print(f"[yellow]{data['message']}[/]")
    return on_event


def status(
    db: Storage = DEFAULT_DB,
    prefix: Annotated[str, typer.Option(help="Study-name prefix: normtune: for sweeps, normtune-validate: for "
                                             "validation sweeps")] = "normtune:",
):
    """State of a running or finished sweep from the database alone: per problem the finished, failed and
    running trials and the best time vs the default config's; the workers and whether they are alive."""
    from rich.console import Console

    from normtune.tuner.sweep.progress import render_table, snapshot, worker_lines

    console = Console()
    with run_checked(read_only_store, db) as store:
        snap = run_checked(snapshot, store, prefix)
        if not snap.problems:
            console.print(f"no sweep studies named {prefix}… in {store.display_url}")
            return
        console.print(render_table(snap, f"sweep status — {store.display_url}"))
        lines = worker_lines(snap, costs=True)
        alive = sum(w.alive for w in snap.workers)
        console.print(f"workers: {alive} alive of {len(lines)}" + ("" if lines else " (none recorded heartbeats)"))
        for line in lines:
            console.print("  " + line)
