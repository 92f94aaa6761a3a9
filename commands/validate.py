"""`normtune validate`: a table's regret on shapes it was not fitted on, against an unseeded reference sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    INTERPRETER_BANNER, Dtype, Gpu, Interpret, Norms, Residual, ResidualDtype, ShapesFrom, Tokens, WritingStorage,
    check_out_folder, device_info, parse_dtype, parse_list, problems_option, refuse, run_checked,
    use_interpreter, user_db, with_residual,
)
from .devices import compile_processes


def _validation_problems(shapes: str | None, shapes_from: Path | None, tokens: str | None, norm: str | None,
                         dtype: str | None, interpret: bool, residual: bool = False, residual_dtype: str | None = None):
    """--shapes given: those shapes in --dtype; --shapes-from: the model's norms; else the held-out set (tiny
    shapes with --interpret); in the residual form with --residual."""
    if shapes is None and shapes_from is None and tokens is None and not interpret:
        from normtune.kernels.config import NORMS
        from normtune.tuner.tables.heldout import heldout_problems

        norms = parse_list(norm, NORMS, "--norm") if norm is not None else list(NORMS)
        problems = heldout_problems(norms, parse_dtype(dtype) if dtype is not None else "bf16")
        return with_residual(problems, residual, residual_dtype), None
    return problems_option(shapes, shapes_from, tokens, norm, dtype, None, interpret=interpret, residual=residual,
                           residual_dtype=residual_dtype)


def _table_for_device(table: Path | None, info):
    from normtune.kernels.select.table_chain import table_for
    from normtune.kernels.select.tables import load_table

    if table is not None:
        return load_table(str(table))
    cc = tuple(int(x) for x in info.compute_capability.split(".")) if info.compute_capability else None
    return table_for(None if info.interpret else info.name, cc)


def _validate_progress(console):
    """Prints one line per reference problem finished and per head-to-head, so a long validation shows it runs."""
    def on_event(kind, data):
        if kind == "start":
            console.print(f"reference sweep: {data['problems']} problems, {data['trials']} trials each (unseeded)")
        elif kind == "problem_done":
            ps = data["summary"]
            console.print(f"  reference {ps.problem.key}: {ps.trials} trials")
        elif kind == "signal":
            console.print(f"[yellow]{data['message']}[/]")
        elif kind == "validated":
            from normtune.tuner.render import ratio_cell

            row = data["row"]
            console.print(f"head to head {data['index'] + 1}/{data['total']} {row.problem.key}: regret "
                          f"{ratio_cell(row.regret)}, default ÷ table {ratio_cell(row.speedup_vs_default)}")

    return on_event


def validate(
    gpu: Gpu = "auto",
    shapes: Annotated[Optional[str], typer.Option(
        "--shapes", help="Shapes in --dtype (as for sweep) [default: the held-out set of shapes and dtypes on a "
                         "GPU, tiny with --interpret]")] = None,
    shapes_from: ShapesFrom = None,
    tokens: Tokens = None,
    norm: Norms = None,
    dtype: Dtype = None,
    residual: Residual = False,
    residual_dtype: ResidualDtype = None,
    table: Annotated[Optional[Path], typer.Option(help="Table to validate [default: the one the runtime picks]")]
    = None,
    trials: Annotated[int, typer.Option(help="Trials of the unseeded reference sweep per shape")] = 40,
    rounds: Annotated[int, typer.Option(help="Interleaved head-to-head rounds per shape")] = 5,
    db: WritingStorage = None,
    out: Annotated[Optional[Path], typer.Option(help="Folder for validate.json and validate.md")] = None,
    compile_workers: Annotated[Optional[int], typer.Option(
        help="CPU processes compiling ahead [default: 8, within the host's cores]")] = None,
    interpret: Interpret = False,
):
    """Regret of a heuristic table on shapes it was not fitted on: table ÷ the fastest of the table's config, the
    best of an unseeded sweep and the analytic default, timed head to head."""
    run_checked(use_interpreter, interpret)
    import json as _json

    from rich.console import Console

    from normtune.tuner.tables import validate as V
    from normtune.tuner.gpu_info import command_line
    from normtune.tuner.render import validation_summary, validation_table
    from normtune.tuner.store.database import Store

    console = Console(stderr=True)
    if trials < 1:
        run_checked(refuse, f"--trials {trials}: need at least 1 trial per shape ({V.REFERENCE_TRIALS} by default)")
    if rounds < 1:
        run_checked(refuse, f"--rounds {rounds}: need at least 1 round")
    compile_workers = run_checked(compile_processes, compile_workers, 1)
    problems, model = run_checked(_validation_problems, shapes, shapes_from, tokens, norm, dtype, interpret, residual,
                                  residual_dtype)
    info = run_checked(device_info, gpu, interpret)
    tab = run_checked(_table_for_device, table, info)
    if out is not None:
        run_checked(check_out_folder, out)
    label = tab.label if tab else None
    if interpret:
        console.print(INTERPRETER_BANNER)
    console.print(f"validating {label or 'no table (the analytic defaults)'}")
    if model is not None:
        console.print(f"--shapes-from {model.describe()}: {len(problems)} problems", markup=False)
    if db is None:
        db = run_checked(user_db, db)
        console.print(f"validate: no --db: results go to {db} (the user directory; --db names another)")
    store = run_checked(Store, db)
    try:
        try:
            rows = run_checked(V.run_validate, store, info, info.key, problems, tab, storage_url=db, trials=trials,
                               rounds=rounds, compile_workers=compile_workers, command_line=command_line(),
                               progress=_validate_progress(console))
        except V.ReferenceInterrupted as stop:
            console.print(f"validate: {stop}", markup=False, soft_wrap=True)
            raise typer.Exit(stop.exit_code) from None
    finally:
        store.close()
    summary = V.summarize(rows)
    typer.echo("\n".join(validation_table(rows) + ["", validation_summary(summary)]))
    if out:
        (out / "validate.json").write_text(_json.dumps(
            {"device": info.to_dict(), "table": label, "reference_trials": trials,
             "rounds": rounds, "summary": summary, "rows": [r.to_dict() for r in rows]}, indent=1, sort_keys=True))
        (out / "validate.md").write_text(V.markdown(rows, info, label, trials))
        console.print(f"wrote {out / 'validate.json'}, {out / 'validate.md'}")
