"""`normtune bench`: normtune's backward and its peers timed side by side, written as a report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    Device, Dtype, Gpu, Interpret, Norms, Residual, ResidualDtype, Shapes, ShapesFrom, Tokens, WeightDtype,
    device_info, open_store, positive_seconds, problems_option, refuse, run_checked, use_interpreter,
)


def bench(
    gpu: Gpu = "auto",
    norm: Norms = None,
    dtype: Dtype = None,
    shapes: Shapes = None,
    shapes_from: ShapesFrom = None,
    tokens: Tokens = None,
    peers: Annotated[str, typer.Option(help="all | none | comma list of torch, compile, liger, liger-cutedsl, "
                                            "quack (with --residual: torch, compile, quack, quack-w16, liger, "
                                            "liger-cutedsl; with --gated: hf-eager, hf-compile, fla-gated, fla-fn, "
                                            "mamba)")] = "all",
    config: Annotated[str, typer.Option(help="normtune's config: default | table | a JSON file | JSON text")]
    = "table",
    weight_dtype: WeightDtype = None,
    cold: Annotated[bool, typer.Option("--cold/--warm", help="Flush L2 before every repetition")] = True,
    out: Annotated[Path, typer.Option(help="Folder for bench.csv/.json/.md and PNG plots")] = Path("bench-out"),
    db: Annotated[Optional[str], typer.Option("--db", help="Also store the results in this database (stored "
                                                           "before the files are written)")] = None,
    budget: Annotated[float, typer.Option(help="Seconds of timing per implementation and shape")] = 0.5,
    interpret: Interpret = False,
    device: Device = 0,
    residual: Residual = False,
    residual_dtype: ResidualDtype = None,
    gated: Annotated[bool, typer.Option("--gated", help=(
        "The gated RMSNorm as hybrid models call it, against fla, transformers (eager, compiled) and mamba_ssm: "
        "--shapes qwen3-next, mamba2, gated-issue, gated-tiny, or --shapes-from a hybrid model's config "
        "(gated.json/.md)"))] = False,
):
    """Time normtune's backward and its peers side by side (cold L2) and write a report: GPU time with the host
    hidden, the kernels' summed device time (profiler), and host µs per backward and forward call. With
    --residual: the residual block (h = x + r, y = norm(h)) through normtune's API and the peers with the fused
    form, forward + backward with gradients into y and h, and its backward alone (residual.json/.md). With --gated:
    the gated RMSNorm's calls, the same three views (gated.json/.md)."""
    run_checked(use_interpreter, interpret)
    import dataclasses

    from rich.console import Console

    if gated:
        from normtune.tuner.measure.harness import TIMING

        from .bench_gated import check_gated_options, gated_calls, run_gated

        if norm is not None or weight_dtype is not None or residual_dtype is not None:
            run_checked(refuse, "--gated: the gated calls are RMSNorms with the weight in the activation dtype; drop "
                                "--norm, --weight-dtype and --residual-dtype")
        calls = run_checked(gated_calls, shapes, shapes_from, tokens, dtype, interpret)
        peer_names = run_checked(check_gated_options, peers, config, residual, db)
        run_checked(positive_seconds, budget, "--budget")
        info = run_checked(device_info, gpu, interpret, device)
        return run_gated(Console(stderr=True), info, calls, peer_names, config, cold,
                         dataclasses.replace(TIMING["bench"], budget_s=budget), out)

    from normtune.tuner.measure import bench as B
    from normtune.tuner.measure import bench_output
    from normtune.tuner.measure.harness import TIMING
    from normtune.tuner.measure.peers import parse_peers

    console = Console(stderr=True)
    problems, model = run_checked(problems_option, shapes, shapes_from, tokens, norm, dtype, weight_dtype,
                                  interpret=interpret, residual=residual, residual_dtype=residual_dtype)
    # The bench times each norm on each shape: the problems' kinds x their shapes.
    norms = list(dict.fromkeys(p.norm for p in problems))
    shape_list = list(dict.fromkeys((p.M, p.N) for p in problems))
    dt, wdt = problems[0].dtype, problems[0].weight_dtype if weight_dtype else None
    if residual and db:
        run_checked(refuse, "--db with --residual: the residual bench writes its files only; drop --db")
    if residual:
        from .bench_residual import check_residual_options

        peer_names = run_checked(check_residual_options, peers, config)
    else:
        peer_names = run_checked(parse_peers, peers)
    run_checked(positive_seconds, budget, "--budget")
    run_checked(B.parse_config_option, config)  # refused now rather than after the first shape's peers
    # Everything that can fail without measuring fails first: the device, the output folder, the database.
    info = run_checked(device_info, gpu, interpret, device)
    run_checked(bench_output.check_out_dir, out)
    store = open_store(db) if db else None
    if interpret:
        console.print("[yellow]--interpret: kernels run on CPU in the Triton interpreter; times are host "
                      "wall-clock, not GPU timings[/]")
    if model is not None:
        console.print(f"--shapes-from {model.describe()}: {len(norms)} norm kinds x {len(shape_list)} shapes",
                      markup=False)
    if residual:
        from .bench_residual import run_residual

        return run_residual(console, info, norms, dt, shape_list, peer_names, problems[0].residual_dtype, wdt,
                            config, cold, dataclasses.replace(TIMING["bench"], budget_s=budget), out)
    opts = B.BenchOptions(norms=norms, dtype=dt, shapes=shape_list, peers=peer_names, config=config, weight_dtype=wdt,
                          cold=cold, timing=dataclasses.replace(TIMING["bench"], budget_s=budget))
    total = len(norms) * len(shape_list) * (1 + len(peer_names))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("bench", total=total)

        def on_row(msg, row):
            t = row.get("median_us") if row else None
            status = f"{t:.1f} µs" if (row and row["status"] == "ok" and t) else (row["status"] if row else "")
            progress.update(task, advance=1, description=f"{msg}: {status}")

        unwritable: list[OSError] = []

        def write_tables(report):  # each finished shape's rows at once: a bench stopped part way keeps them
            if unwritable:
                return
            try:
                bench_output.write_tables(report, out)
            except OSError as err:  # measuring goes on: the rows still reach --db, and the final write says why
                unwritable.append(err)
                progress.console.print(f"warning: writing {out} failed ({err}); measuring goes on", markup=False)

        report = run_checked(B.run_bench, opts, info, progress=on_row, checkpoint=write_tables)
    stored = ""
    if store is not None:
        run_id = run_checked(B.store_report, store, report, info)
        store.close()
        stored = f"stored as run {run_id} in {db}"
    try:
        paths = bench_output.write_all(report, out)
    except OSError as err:
        keep = f"the results are {stored}" if stored else "pass --db to keep results when files cannot be written"
        run_checked(refuse, f"writing {out} failed ({err}); {keep}")
    console.print(bench_output.summary_table(report))
    console.print(bench_output.summary_footer(report))
    console.print(f"wrote {', '.join(str(p) for p in paths)}" + (f"; {stored}" if stored else ""))
