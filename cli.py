"""`normtune`: the command line of the tuning service.

    normtune bench    --gpu h100 --shapes seed --peers all --out docs/bench
    normtune sweep    --gpu h100 --shapes seed --trials 60 --time-budget 1800
    normtune emit     --gpu h100 --db results.db --out configs/h100.json
    normtune validate --gpu h100 --shapes heldout
    normtune report   --gpu h100 --db results.db --out docs/report-h100

Commands are thin: they parse options and call library functions in `normtune.tuner`. Known errors print one
line and exit with status 1. GPU work needs a CUDA device; `--interpret` runs the same pipeline on CPU through
the Triton interpreter (tests, demos; its timings are host wall-clock and are labelled as such).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="Autotuning and benchmarking of LayerNorm/RMSNorm backward kernels.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)

# ------------------------------------------------------------------------------------------ shared options

Gpu = Annotated[str, typer.Option("--gpu", help="GPU key the results are for (h100, h200, …) or 'auto'. Must "
                                                "match the detected device.")]
Norms = Annotated[str, typer.Option("--norm", help="Comma list: layer_norm, rms_norm.")]
Dtype = Annotated[str, typer.Option("--dtype", help="Activation dtype: bf16, fp16 or fp32.")]
Shapes = Annotated[Optional[str], typer.Option(
    "--shapes", help="seed | llm | heldout | tiny | FILE (one MxN per line) | 4096x8192,... "
                     "[default: seed on a GPU, tiny with --interpret]")]
Interpret = Annotated[bool, typer.Option("--interpret", help="Run on CPU through the Triton interpreter "
                                                             "(no GPU; timings are not GPU timings).")]
Storage = Annotated[str, typer.Option("--db", "--storage", help="SQLAlchemy URL of the results database.")]
Device = Annotated[int, typer.Option("--device", help="CUDA device index.")]

DEFAULT_DB = "sqlite:///results.db"


class CLIError(Exception):
    """An error worth one line, not a traceback."""


def _known_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [CLIError, ValueError, FileNotFoundError, PermissionError]
    try:
        from normtune.tuner.store import StoreError

        errors.append(StoreError)
    except Exception:  # noqa: BLE001 - the store's optional dependencies may be missing
        pass
    try:
        from normtune.tuner.device import NoGPUError

        errors.append(NoGPUError)
    except Exception:  # noqa: BLE001
        pass
    return tuple(errors)


def _run(fn, *args, **kwargs):
    """Call a library function; known errors become 'error: …' and exit code 1."""
    try:
        return fn(*args, **kwargs)
    except _known_errors() as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def _use_interpreter(interpret: bool) -> None:
    """--interpret must take effect before Triton decorates the kernels (at import)."""
    if not interpret:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    mod = sys.modules.get("normtune.kernels.backward")
    if mod is not None:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(mod._kernel_2, InterpretedFunction):
            raise CLIError("--interpret was given after the kernels were compiled for a GPU in this process: "
                           "set TRITON_INTERPRET=1 before starting Python")


def _dtype(text: str, option: str = "--dtype") -> str:
    from normtune.kernels.config import DTYPES, canonical_dtype

    try:
        return canonical_dtype(text)
    except TypeError:
        raise CLIError(f"{option} {text!r}: use one of {', '.join(DTYPES)}") from None


def _split(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise CLIError(f"{option} {text!r}: use a comma list of {', '.join(allowed)}")
    return items


def _device_info(gpu: str, interpret: bool, device: int = 0):
    from normtune.tuner.device import check_gpu_key, detect

    info = detect(device, interpret=interpret)
    check_gpu_key(gpu, info)
    return info


def _shapes(spec: str | None, interpret: bool):
    from normtune.tuner.shapes import parse_shapes

    try:
        return parse_shapes(spec or ("tiny" if interpret else "seed"))
    except ValueError as err:
        raise CLIError(f"--shapes: {err}") from None


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print normtune's version and exit.")] = False,
):
    """Autotuning and benchmarking of LayerNorm/RMSNorm backward kernels."""
    if version:
        from importlib.metadata import version as _v

        typer.echo(f"normtune {_v('normtune')}")
        raise typer.Exit()


# ------------------------------------------------------------------------------------------------- bench


@app.command()
def bench(
    gpu: Gpu = "auto",
    norm: Norms = "layer_norm,rms_norm",
    dtype: Dtype = "bf16",
    shapes: Shapes = None,
    peers: Annotated[str, typer.Option(help="all | none | comma list of torch, compile, liger, quack")] = "all",
    config: Annotated[str, typer.Option(help="normtune's config: default | table | JSON text or file")] = "table",
    weight_dtype: Annotated[Optional[str], typer.Option(help="Weight dtype (default: the activation dtype)")] = None,
    cold: Annotated[bool, typer.Option("--cold/--warm", help="Flush L2 before every repetition")] = True,
    out: Annotated[Path, typer.Option(help="Folder for bench.csv/.json/.md and PNG plots")] = Path("bench-out"),
    db: Annotated[Optional[str], typer.Option("--db", help="Also store the results in this database")] = None,
    budget: Annotated[float, typer.Option(help="Seconds of timing per implementation and shape")] = 0.5,
    interpret: Interpret = False,
    device: Device = 0,
):
    """Time normtune's backward and its peers side by side (cold L2) and write a report."""
    _run(_use_interpreter, interpret)
    from rich.console import Console

    from normtune.kernels.config import NORMS
    from normtune.tuner import bench as B
    from normtune.tuner import bench_output
    from normtune.tuner.peers import parse_peers

    console = Console(stderr=True)
    norms = _run(_split, norm, NORMS, "--norm")
    dt = _run(_dtype, dtype)
    wdt = _run(_dtype, weight_dtype, "--weight-dtype") if weight_dtype else None
    shape_list = _run(_shapes, shapes, interpret)
    peer_names = _run(parse_peers, peers)
    info = _run(_device_info, gpu, interpret, device)
    if interpret:
        console.print("[yellow]--interpret: kernels run on CPU in the Triton interpreter; times are host "
                      "wall-clock, not GPU timings[/]")
    opts = B.BenchOptions(norms=norms, dtype=dt, shapes=shape_list, peers=peer_names, config=config,
                          weight_dtype=wdt, cold=cold, budget_s=budget,
                          min_reps=2 if interpret else 20, max_reps=3 if interpret else 200,
                          profile_reps=0 if interpret else 5)
    total = len(norms) * len(shape_list) * (1 + len(peer_names))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("bench", total=total)

        def on_row(msg, row):
            t = row.get("median_us") if row else None
            status = f"{t:.1f} µs" if (row and row["status"] == "ok" and t) else (row["status"] if row else "")
            progress.update(task, advance=1, description=f"{msg}: {status}")

        report = _run(B.run_bench, opts, info, progress=on_row)
    paths = bench_output.write_all(report, out)
    if db:
        from normtune.tuner.bench import store_report
        from normtune.tuner.store import Store

        _run(store_report, _run(Store, db), report, info)
    _print_summary(console, report)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")


def _print_summary(console, report) -> None:
    from rich.table import Table

    from normtune.tuner.bench import geomean, summary

    table = Table(title=f"normtune vs best peer — {report.provenance['device']['name']}"
                  + (" (interpreter: not GPU times)" if report.provenance["interpret"] else ""))
    for col in ("norm", "M×N", "floor µs", "normtune µs", "k1", "k2", "best peer", "µs", "speedup", "% floor"):
        table.add_column(col, justify="right" if col not in ("norm", "best peer") else "left")

    def f(x, d=1):
        return "–" if x is None else f"{x:.{d}f}"

    rows = summary(report.rows)
    for s in rows:
        table.add_row(s["norm"], f"{s['M']}×{s['N']}", f(s["floor_us"]),
                      f(s["normtune_us"]) if s["status"] == "ok" else s["status"], f(s["kernel_1_us"]),
                      f(s["kernel_2_us"]), s["best_peer"] or "–", f(s["best_peer_us"]),
                      (f(s["speedup"], 2) + "×") if s["speedup"] else "–",
                      f(100 * s["floor_fraction"], 0) if s["floor_fraction"] else "–")
    console.print(table)
    g = geomean([s["speedup"] for s in rows if s["speedup"]])
    if g:
        console.print(f"geometric-mean speedup over the best peer: {g:.3f}×")


# ------------------------------------------------------------------------------------------------- sweep


def _problems(norms: list[str], dtype: str, weight_dtype: str | None, shapes, *, bias: bool | None,
              zero_centered: bool, save: str):
    from normtune.kernels.config import Problem

    out = []
    for norm in norms:
        has_bias = (norm == "layer_norm") if bias is None else (bias and norm == "layer_norm")
        for M, N in shapes:
            out.append(Problem(norm, M, N, dtype, weight_dtype, True, has_bias, zero_centered, save))
    return out


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


@app.command()
def sweep(
    gpu: Gpu = "auto",
    norm: Norms = "layer_norm,rms_norm",
    dtype: Dtype = "bf16",
    shapes: Shapes = None,
    weight_dtype: Annotated[Optional[str], typer.Option(help="Weight dtype (default: the activation dtype)")] = None,
    bias: Annotated[Optional[bool], typer.Option("--bias/--no-bias", help="LayerNorm bias [default: bias]")] = None,
    zero_centered: Annotated[bool, typer.Option(help="Zero-centered weights (w = 1 + w')")] = False,
    save: Annotated[str, typer.Option(help="What the forward saves: input | output")] = "input",
    trials: Annotated[int, typer.Option(help="Finished trials each problem should end with (re-running adds "
                                             "only the difference)")] = 40,
    time_budget: Annotated[Optional[float], typer.Option(help="Stop between trials after this many seconds")] = None,
    sampler: Annotated[str, typer.Option(help="tpe | random | grid")] = "tpe",
    storage: Storage = DEFAULT_DB,
    device: Device = 0,
    devices: Annotated[Optional[str], typer.Option(help="Comma list of CUDA devices (0,1,…): one worker per GPU, "
                                                        "sharing only the database")] = None,
    compile_workers: Annotated[int, typer.Option(help="CPU processes compiling upcoming configs (shared out among "
                                                      "the --devices workers)")] = 8,
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
    _run(_use_interpreter, interpret)
    from rich.console import Console

    from normtune.kernels.config import NORMS, SAVE_MODES
    from normtune.tuner import sweep as S
    from normtune.tuner.store import Store

    console = Console(stderr=True)
    norms = _run(_split, norm, NORMS, "--norm")
    if save not in SAVE_MODES:
        _run(_raise, f"--save {save!r}: use one of {', '.join(SAVE_MODES)}")
    dt = _run(_dtype, dtype)
    wdt = _run(_dtype, weight_dtype, "--weight-dtype") if weight_dtype else None
    shape_list = _run(_shapes, shapes, interpret)
    problems = _run(_problems, norms, dt, wdt, shape_list, bias=bias, zero_centered=zero_centered, save=save)
    device_list = _run(_parse_devices, devices)
    if device_list and interpret:
        _run(_raise, "--devices needs GPUs; --interpret runs one worker on CPU")
    if compile_workers < 0:
        _run(_raise, f"--compile-workers {compile_workers}: give 0 (compile in the measuring process) or more")
    info = _run(_device_info, gpu, interpret, device_list[0] if device_list else device)
    key = info.key if interpret else gpu if gpu != "auto" else info.key
    opts = _run(S.SweepOptions, gpu_key=key, problems=problems, trials=trials, time_budget_s=time_budget,
                sampler=sampler, device=device_list[0] if device_list else device, interpret=interpret,
                compile_workers=compile_workers, trial_timeout_s=trial_timeout, seed=seed,
                heartbeat_interval=heartbeat_interval, grace_period=grace_period)
    store = _run(Store, storage)
    if interpret:
        console.print("[yellow]--interpret: kernels run on CPU in the Triton interpreter; these timings are "
                      "interpreter timings and are never emitted as a GPU table[/]")
    targets = {S.study_name(key, p, interpret): trials for p in problems}
    if device_list and len(device_list) > 1:
        store.close()
        console.print(f"sweeping {len(problems)} problems on devices {device_list} ({store.display_url})")
        with S.LiveView(console, store.url, targets):
            code = S.run_on_devices(opts, device_list, store.url)
        raise typer.Exit(code)
    sw = _run(S.Sweep, opts, store, info)
    with S.LiveView(console, store.url, targets) as view:
        sw.emit = _sweep_events(view.console)
        result = _run(sw.run)
    store.close()
    console.print(f"sweep: {result.wall_s:.0f} s wall, {result.measure_s:.0f} s measuring, "
                  f"{result.compile_s:.0f} s compiling in workers ({result.compile_wait_s:.0f} s waited on them)")
    if summary:
        summary.write_text(S.summary_json(result))
    if result.stopped:
        console.print(f"[yellow]stopped ({result.stopped}); remaining: {'; '.join(result.remaining) or 'none'}. "
                      "Re-run the same command to continue.[/]")
    raise typer.Exit(result.exit_code)


def _raise(message: str):
    raise CLIError(message)


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


@app.command()
def status(
    db: Storage = DEFAULT_DB,
    prefix: Annotated[str, typer.Option(help="Study-name prefix: normtune: for sweeps, normtune-validate: for "
                                             "validation sweeps")] = "normtune:",
):
    """State of a running or finished sweep from the database alone: per problem the finished, failed and
    running trials and the best time vs the default config's; the workers and whether they are alive."""
    from rich.console import Console

    from normtune.tuner.store import Store
    from normtune.tuner.sweep.progress import render_table, snapshot, worker_lines

    console = Console()
    with _run(Store, db, read_only=True) as store:
        snap = _run(snapshot, store, prefix)
        if not snap.problems:
            console.print(f"no sweep studies named {prefix}… in {store.display_url}")
            return
        console.print(render_table(snap, f"sweep status — {store.display_url}"))
        lines = worker_lines(snap)
        alive = sum(w.alive for w in snap.workers)
        console.print(f"workers: {alive} alive of {len(lines)}" + ("" if lines else " (none recorded heartbeats)"))
        for line in lines:
            console.print("  " + line)


# -------------------------------------------------------------------------------------------------- emit


@app.command()
def emit(
    gpu: Gpu = "auto",
    db: Storage = DEFAULT_DB,
    out: Annotated[Optional[Path], typer.Option(help="Output file [default: configs/<gpu>.json]")] = None,
    remeasure: Annotated[bool, typer.Option(help="First time each problem's top configs on its neighbours "
                                                 "(needs the GPU) to complete the config x shape matrix")] = False,
    interpret: Interpret = False,
):
    """Fit a frozen launch-heuristic table from the stored measurements and write configs/<gpu>.json."""
    _run(_use_interpreter, interpret)
    from rich.console import Console

    from normtune.tuner import emit as E
    from normtune.tuner.store import Store

    console = Console(stderr=True)
    store = _run(Store, db)
    if interpret:
        key = "interpret"
    elif gpu == "auto" or remeasure:
        key = _run(_device_info, gpu, False).key
    else:
        key = gpu
    if remeasure:
        info = _run(_device_info, gpu, interpret)
        n = _run(E.remeasure_neighbours, store, key, info, interpret=interpret)
        console.print(f"re-measured {n} (problem, config) pairs on neighbouring shapes")
    table = _run(E.build_table, store, key, interpret=interpret)
    path = out or Path("configs") / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(E.dumps(table))
    fams = table["families"]
    console.print(f"wrote {path}: {len(fams)} families, {sum(len(f['rules']) for f in fams.values())} rules, "
                  f"from {table['provenance']['configs_measured']} measured configs "
                  f"(GPU {table['gpu']['name']})")


# ---------------------------------------------------------------------------------------------- validate


@app.command()
def validate(
    gpu: Gpu = "auto",
    shapes: Shapes = None,
    norm: Norms = "layer_norm,rms_norm",
    dtype: Dtype = "bf16",
    table: Annotated[Optional[Path], typer.Option(help="Table to validate [default: the one the runtime picks]")]
    = None,
    trials: Annotated[int, typer.Option(help="Trials of the short fresh sweep per shape")] = 20,
    db: Storage = DEFAULT_DB,
    out: Annotated[Optional[Path], typer.Option(help="Folder for validate.json and validate.md")] = None,
    compile_workers: Annotated[int, typer.Option(help="CPU processes compiling ahead")] = 8,
    interpret: Interpret = False,
):
    """Regret of a heuristic table on shapes it was not fitted on (table ÷ best of a short fresh sweep)."""
    _run(_use_interpreter, interpret)
    import json as _json

    from rich.console import Console
    from rich.table import Table as RTable

    from normtune.kernels.config import NORMS
    from normtune.kernels.tables import load_table, table_for
    from normtune.tuner import validate as V
    from normtune.tuner.store import Store

    console = Console(stderr=True)
    norms = _run(_split, norm, NORMS, "--norm")
    dt = _run(_dtype, dtype)
    shape_list = _run(_shapes, shapes or ("tiny" if interpret else "heldout"), interpret)
    problems = _run(_problems, norms, dt, None, shape_list, bias=None, zero_centered=False, save="input")
    info = _run(_device_info, gpu, interpret)
    if table is not None:
        tab = _run(load_table, str(table))
    else:
        cc = tuple(int(x) for x in info.compute_capability.split(".")) if info.compute_capability else None
        tab = _run(table_for, None if interpret else info.name, cc)
    store = _run(Store, db)
    rows = _run(V.run_validate, store, info, info.key, problems, tab, trials=trials, storage_url=db,
                compile_workers=compile_workers)
    summary = V.summarize(rows)
    t = RTable(title=f"validate — {info.name}" + (" (interpreter: not GPU times)" if interpret else ""))
    for col in ("problem", "table µs", "best µs", "default µs", "regret", "vs default"):
        t.add_column(col, justify="left" if col == "problem" else "right")

    def f(x, d=1):
        return "–" if x is None else f"{x:.{d}f}"

    for r in rows:
        t.add_row(f"{r.problem.norm} {r.problem.M}×{r.problem.N}", f(r.table_us), f(r.best_us), f(r.default_us),
                  f(r.regret, 3), f(r.speedup_vs_default, 3))
    console.print(t)
    console.print(f"geometric-mean regret {f(summary['geomean_regret'], 3)}, worst {f(summary['worst_regret'], 3)};"
                  f" speedup over defaults {f(summary['geomean_speedup_vs_default'], 3)}×")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validate.json").write_text(_json.dumps({"device": info.to_dict(), "table": tab.path if tab else None,
                                                        "summary": summary, "rows": [r.to_dict() for r in rows]},
                                                       indent=1, sort_keys=True))
        (out / "validate.md").write_text(V.markdown(rows, info, tab.path if tab else None))
        console.print(f"wrote {out / 'validate.json'}, {out / 'validate.md'}")
    store.close()


# ------------------------------------------------------------------------------------------------ report


@app.command()
def report(
    gpu: Annotated[str, typer.Option("--gpu", help="GPU key whose data to report (h100, h200, interpret, …)")],
    db: Storage = DEFAULT_DB,
    out: Annotated[Path, typer.Option(help="Folder for report.md and its PNGs")] = Path("report"),
    problem: Annotated[Optional[str], typer.Option(help="Problem key for the parameter heatmaps [default: the "
                                                        "most measured]")] = None,
    table: Annotated[Optional[Path], typer.Option(help="Table whose rules to show [default: configs/<gpu>.json]")]
    = None,
):
    """Markdown + PNG report from the stored data (no GPU needed): best configs, per-kernel split, heatmaps,
    emitted rules, validation regret, normtune vs peers."""
    from rich.console import Console

    from normtune.kernels.tables import TableError
    from normtune.tuner.report import write_report
    from normtune.tuner.store import Store

    console = Console(stderr=True)
    if db == DEFAULT_DB and not Path("results.db").exists():
        _run(_raise, "results.db not found here: run from the repository root or pass --db sqlite:///PATH")
    store = _run(Store, db)
    try:
        paths = write_report(store, gpu.strip().lower(), out, heatmap_problem=problem,
                             table_path=str(table) if table else None)
    except (ValueError, TableError, OSError) as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    console.print(f"wrote {paths[0]} and {len(paths) - 1} plots in {out}")


def main() -> None:  # pragma: no cover - console-script entry point alternative
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
