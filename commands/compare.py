"""`normtune compare OLD.json NEW.json`: the regression gate for tables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import (
    INTERPRETER_BANNER, Gpu, Interpret, Residual, ResidualDtype, Shapes, device_info, problems_option, refuse,
    run_checked, use_interpreter,
)


DEFAULT = "default"  # in place of a table file: the analytic default config of every shape (no table)


def compare(
    old: Annotated[Path, typer.Argument(help="The table in use (JSON), or 'default': the analytic default configs")],
    new: Annotated[Path, typer.Argument(help="The candidate table (JSON), or 'default'")],
    gpu: Gpu = "auto",
    shapes: Shapes = None,
    norm: Annotated[str, typer.Option("--norm", help="Comma list: layer_norm, rms_norm")] = "layer_norm,rms_norm",
    dtype: Annotated[str, typer.Option("--dtype", help="Activation dtype: bf16, fp16 or fp32")] = "bf16",
    residual: Residual = False,
    residual_dtype: ResidualDtype = None,
    threshold: Annotated[float, typer.Option(help="Fail where NEW is slower than OLD by more than this fraction "
                                                  "(and beyond the spread)")] = 0.03,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds per shape")] = 5,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Time nothing (no GPU needed): list the shapes whose "
                                                            "config changes, with both configs")] = False,
    interpret: Interpret = False,
):
    """Time two tables' configs head to head (cold L2, interleaved) and exit 1 if NEW is slower on any shape.
    'default' in place of either file stands for the analytic default configs (what runs without a table)."""
    run_checked(use_interpreter, interpret)
    from rich.console import Console

    from normtune.kernels.select.tables import load_table
    from normtune.tuner.tables import compare as C
    from normtune.tuner.measure.harness import TIMING, MeasureSession

    console = Console(stderr=True)
    if not 0 <= threshold < 1:
        run_checked(refuse, f"--threshold {threshold}: give a fraction in [0, 1), e.g. 0.03 for 3 %")
    if rounds < 1:
        run_checked(refuse, f"--rounds {rounds}: need at least 1 round")
    tables = [None if str(path) == DEFAULT else run_checked(load_table, str(path)) for path in (old, new)]
    if tables == [None, None]:
        run_checked(refuse, "OLD and NEW are both 'default': give a table file for at least one of them")
    for path, table in zip((old, new), tables):
        if table is not None and table.interpret and not interpret:
            run_checked(refuse, f"{path} holds Triton-interpreter timings: it never tunes a GPU, so comparing it "
                                f"for --gpu {gpu} means nothing; compare it with --interpret, or pass a GPU's table")
    problems, _ = run_checked(problems_option, shapes, None, None, norm, dtype, None, interpret=interpret,
                              zero_centered=False, residual=residual, residual_dtype=residual_dtype)
    if dry_run:  # no GPU needed: the configs as they run on the GPU NEW was tuned on
        from normtune.tuner.gpu_info import stored_limits

        t = tables[1] or tables[0]
        limits = stored_limits(t.gpu_key, t.gpu_name, t.compute_capability, t.sm_count, t.interpret or interpret)
        typer.echo("\n".join(C.changes_markdown(C.config_changes(*tables, problems, limits), len(problems))))
        return
    info = run_checked(device_info, gpu, interpret)
    if interpret:
        console.print(INTERPRETER_BANNER)

    def progress(i, row):
        console.print(f"{i + 1}/{len(problems)} {row.problem.key}: {row.verdict(threshold)}")

    session = run_checked(MeasureSession.for_device, info, timing=TIMING["compare"])
    rows = run_checked(C.compare_tables, *tables, problems, session, rounds=rounds, progress=progress)
    where = C.where_line(info.name, info.key, interpret=info.interpret, rounds=rounds)
    typer.echo("\n".join(C.comparison_markdown(rows, threshold, interpret=info.interpret, where=where)))
    if any(r.fails(threshold) for r in rows):
        raise typer.Exit(1)
