"""`normtune sweep`: its options go to `normtune.tuner.sweep.run` (which owns every process); its result printed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

from typer import Exit, Option as Opt

from normtune.tuner import sweep as S

from .common import (Device, Dtype, Gpu, Interpret, Norms, Residual, ResidualDtype, Shapes, ShapesFrom,
                     Tokens, WeightDtype, WritingStorage, check_writable_file, problems_option, refuse, run_checked,
                     use_interpreter, write_text)
from .devices import parse_devices


def sweep(
    gpu: Gpu = "auto", norm: Norms = None, dtype: Dtype = None, shapes: Shapes = None, shapes_from: ShapesFrom = None,
    tokens: Tokens = None, weight_dtype: WeightDtype = None, residual: Residual = False,
    residual_dtype: ResidualDtype = None, storage: WritingStorage = None, device: Device = 0,
    bias: Annotated[Optional[bool], Opt("--bias/--no-bias", help="LayerNorm bias [default: bias]")] = None,
    zero_centered: Annotated[Optional[bool], Opt("--zero-centered/--no-zero-centered", help=(
        "Zero-centered weights (w = 1 + w') [default: no; with --shapes-from, the model's]"))] = None,
    save: Annotated[str, Opt(help="What the forward saves: input | output")] = "input",
    trials: Annotated[int, Opt(help="Finished trials each problem should end with (re-running adds only the "
                                    "difference)")] = 40,
    time_budget: Annotated[Optional[float], Opt(help="Stop between trials after this many seconds")] = None,
    sampler: Annotated[str, Opt(help="tpe | random | grid | local (the best's neighbours first, then tpe)")] = "tpe",
    devices: Annotated[Optional[str], Opt(help="Comma list of CUDA devices (0,1,…): one worker per GPU, sharing "
                                               "only the database")] = None,
    compile_workers: Annotated[Optional[int], Opt(help=(
        "CPU processes compiling upcoming configs: one pool for the host, shared by the --devices workers "
        "[default: 16 per GPU, within the host's cores]"))] = None,
    trial_timeout: Annotated[float, Opt(help="Seconds before a trial is killed as hung")] = 180.0,
    seed: Annotated[int, Opt(help="Sampler seed")] = 0,
    heartbeat_interval: Annotated[int, Opt(help="Seconds between a worker's trial heartbeats")] = 20,
    grace_period: Annotated[int, Opt(help="Seconds without a heartbeat before another worker fails and re-queues "
                                          "a trial")] = 60,
    summary: Annotated[Optional[Path], Opt(help="Also write a JSON summary here")] = None,
    interpret: Interpret = False,
):
    """Search kernel_1/kernel_2 launch configs with Optuna, measured cold-L2, stored in the results database.
    Any number of sweeps (GPUs of this host with --devices, other hosts on the same PostgreSQL --db) may share the
    work: together they end each problem with exactly --trials trials. Exit code 130/143 after SIGINT/SIGTERM."""
    from rich.console import Console
    run_checked(use_interpreter, interpret)
    if summary is not None:
        run_checked(check_writable_file, summary, "--summary")
    console = Console(stderr=True)

    def problems():  # called once the sweep's helper processes are starting: this imports torch
        from normtune.kernels.config import SAVE_MODES

        if save not in SAVE_MODES:
            refuse(f"--save {save!r}: use one of {', '.join(SAVE_MODES)}")
        found, model = problems_option(shapes, shapes_from, tokens, norm, dtype, weight_dtype, interpret=interpret,
                                       bias=bias, zero_centered=zero_centered, save=save, residual=residual,
                                       residual_dtype=residual_dtype)
        if model is not None:
            gated = sum(p.gate is not None for p in found)
            console.print(f"--shapes-from {model.describe()}: {len(found)} problems"
                          + (f", {gated} of them gated RMSNorms" if gated else ""), markup=False)
        return found

    opts = run_checked(S.SweepOptions, gpu_key=gpu, problems=problems, trials=trials, time_budget_s=time_budget,
                       sampler=sampler, device=device, devices=run_checked(parse_devices, devices), storage=storage,
                       interpret=interpret, compile_workers=compile_workers, trial_timeout_s=trial_timeout,
                       seed=seed, heartbeat_interval=heartbeat_interval, grace_period=grace_period)
    say = lambda line: line and console.print(line, markup=False, soft_wrap=True)  # noqa: E731
    result = run_checked(S.run, opts, on_event=lambda kind, data: say(S.event_line(kind, data, interpret)),
                         view=lambda url, targets: S.LiveView(console, url, targets))
    if summary is not None:
        run_checked(write_text, summary, S.summary_json(result), "--summary")
    say("\n".join(S.result_lines(result)))
    raise Exit(result.exit_code)

