"""`normtune`: the command line of the tuning service.

    normtune bench    --gpu h100 --shapes seed --peers all --out docs/bench
    normtune sweep    --gpu h100 --shapes seed --trials 60 --time-budget 1800
    normtune emit     --gpu h100 --db results.db --out configs/h100.json
    normtune validate --gpu h100 --shapes heldout
    normtune report   --gpu h100 --db results.db --out docs/report-h100

Commands are thin: they parse options and call library functions in `normtune.tuner`. Known errors print one
line and exit with status 1. GPU work needs a CUDA device; `--interpret` runs the same pipeline on CPU through
the Triton interpreter (tests, demos; its timings are host wall-clock and are labelled as such). Its results are
labelled `interpret`, so `--gpu` takes only `auto` or `interpret` with it; `--gpu interpret` needs `--interpret`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

# Plain help (rich_markup_mode=None): "[default: …]" written in a help text stays (rich markup would take it for
# a style tag and drop it), and flags show as --flag / --no-flag without a type placeholder.
app = typer.Typer(help="Autotuning and benchmarking of LayerNorm/RMSNorm backward kernels.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False, rich_markup_mode=None)


def _fail(message: str):
    """Print one error line and exit 1 (for option callbacks, which run outside `_run`)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


def _check_gpu(ctx: typer.Context, value: str) -> str:
    """--gpu against --interpret (an eager option, so already parsed): the interpreter's results are labelled
    'interpret', never a GPU's."""
    key = value.strip().lower()
    interpret = bool(ctx.params.get("interpret"))
    if interpret and key not in ("auto", "interpret"):
        _fail(f"--gpu {value} cannot be combined with --interpret: interpreter results are labelled 'interpret'; "
              "drop --gpu (or pass --gpu auto)")
    if not interpret and key == "interpret":
        _fail("--gpu interpret names the Triton interpreter's results: add --interpret, or name a GPU key such as "
              "h100")
    return value


# ------------------------------------------------------------------------------------------ shared options

Gpu = Annotated[str, typer.Option("--gpu", callback=_check_gpu,
                                  help="GPU key the results are for (h100, h200, …) or 'auto'. Must match the "
                                       "detected device; with --interpret only auto or interpret.")]
Norms = Annotated[str, typer.Option("--norm", help="Comma list: layer_norm, rms_norm.")]
Dtype = Annotated[str, typer.Option("--dtype", help="Activation dtype: bf16, fp16 or fp32.")]
Shapes = Annotated[Optional[str], typer.Option(
    "--shapes", help="seed | llm | heldout | tiny | FILE (one MxN per line) | 4096x8192,... "
                     "[default: seed on a GPU, tiny with --interpret]")]
Interpret = Annotated[bool, typer.Option("--interpret", is_eager=True,
                                         help="Run on CPU through the Triton interpreter (no GPU; timings are not "
                                              "GPU timings).")]
WeightDtype = Annotated[Optional[str], typer.Option("--weight-dtype", help="Weight dtype: bf16, fp16 or fp32 "
                                                                           "[default: the activation dtype]")]
Storage = Annotated[str, typer.Option("--db", "--storage", help="SQLAlchemy URL of the results database.")]
Device = Annotated[int, typer.Option("--device", help="CUDA device index.")]

DEFAULT_DB = "sqlite:///results.db"


class CLIError(Exception):
    """An error worth one line, not a traceback."""


def _known_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [CLIError, ValueError, OSError]
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
        _fail(one_line(err))


def one_line(err: BaseException) -> str:
    """An error's message on one line (SQLAlchemy appends a 'Background on this error' link line)."""
    lines = [line.strip() for line in str(err).splitlines()]
    return " ".join(line for line in lines if line and not line.startswith("(Background on this error"))


def _use_interpreter(interpret: bool) -> None:
    """--interpret must take effect before Triton decorates the kernels (at import)."""
    if not interpret:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    mod = sys.modules.get("normtune.kernels.backward.reduce")
    if mod is not None:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(mod.kernel_2, InterpretedFunction):
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


def _positive_seconds(value: float, option: str) -> float:
    """A time budget: a positive finite number of seconds."""
    if not (value > 0 and value != float("inf")):  # also refuses NaN
        raise CLIError(f"{option} {value}: give a positive number of seconds, e.g. {option} 0.5")
    return value


def normtune_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("normtune")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"normtune {normtune_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print normtune's version and exit.")] = False,
):
    """Autotuning and benchmarking of LayerNorm/RMSNorm backward kernels."""


# ------------------------------------------------------------------------------------------------- bench


@app.command()
def bench(
    gpu: Gpu = "auto",
    norm: Norms = "layer_norm,rms_norm",
    dtype: Dtype = "bf16",
    shapes: Shapes = None,
    peers: Annotated[str, typer.Option(help="all | none | comma list of torch, compile, liger, quack")] = "all",
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
):
    """Time normtune's backward and its peers side by side (cold L2) and write a report: GPU time with the host
    hidden, the kernels' summed device time (profiler), and host µs per backward and forward call."""
    _run(_use_interpreter, interpret)
    import dataclasses

    from rich.console import Console

    from normtune.kernels.config import NORMS
    from normtune.tuner import bench as B
    from normtune.tuner import bench_output
    from normtune.tuner.measure import TIMING
    from normtune.tuner.peers import parse_peers

    console = Console(stderr=True)
    norms = _run(_split, norm, NORMS, "--norm")
    dt = _run(_dtype, dtype)
    wdt = _run(_dtype, weight_dtype, "--weight-dtype") if weight_dtype else None
    shape_list = _run(_shapes, shapes, interpret)
    peer_names = _run(parse_peers, peers)
    _run(_positive_seconds, budget, "--budget")
    _run(B.parse_config_option, config)  # refused now rather than after the first shape's peers
    # Everything that can fail without measuring fails first: the device, the output folder, the database.
    info = _run(_device_info, gpu, interpret, device)
    _run(bench_output.check_out_dir, out)
    store = _open_store(db) if db else None
    if interpret:
        console.print("[yellow]--interpret: kernels run on CPU in the Triton interpreter; times are host "
                      "wall-clock, not GPU timings[/]")
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

        report = _run(B.run_bench, opts, info, progress=on_row)
    stored = ""
    if store is not None:
        run_id = _run(B.store_report, store, report, info)
        store.close()
        stored = f"stored as run {run_id} in {db}"
    try:
        paths = bench_output.write_all(report, out)
    except OSError as err:
        _run(_raise, f"writing {out} failed ({err}); " + (f"the results are {stored}" if stored else
                                                         "pass --db to keep results when files cannot be written"))
    console.print(bench_output.summary_table(report))
    console.print(bench_output.summary_footer(report))
    console.print(f"wrote {', '.join(str(p) for p in paths)}" + (f"; {stored}" if stored else ""))


def _open_store(url: str):
    """The results database, opened (and checked) before any work that would be lost if it cannot be."""
    from normtune.tuner.store import Store

    return _run(Store, url)


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


def _read_only_store(db: str):
    """The results database for a command that only reads it (`emit` without --remeasure, `report`)."""
    import inspect

    from normtune.tuner.store import Store

    if "read_only" in inspect.signature(Store).parameters:
        return Store(db, read_only=True)
    # TEMPORARY (remove when Store(url, read_only=True) is merged): this branch's Store has no read-only mode;
    # refuse at least a missing SQLite file here, before opening it would create one.
    from sqlalchemy.engine import make_url

    from normtune.tuner.store import normalize_url

    url = make_url(normalize_url(db))
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") \
            and not Path(url.database).is_file():
        raise CLIError(f"--db {db}: no such database file; pass the path of an existing results database "
                       "(e.g. --db results.db)")
    return Store(db)


def _ints(text: str | None, option: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise CLIError(f"{option} {text!r}: use a comma list of run ids, e.g. 1,2,5")
    return values


def _names(text: str | None, option: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise CLIError(f"{option} {text!r}: give a comma list")
    return values


def _selection(runs: str | None, runs_of: Path | None, kind: str, git_revision: str | None):
    import json as _json

    from normtune.tuner import emit as E

    if runs is not None and runs_of is not None:
        raise CLIError("--runs and --runs-of both name the runs to fit on: give one of them")
    run_ids = _ints(runs, "--runs")
    if runs_of is not None:
        try:
            run_ids = E.recorded_runs(_json.loads(runs_of.read_text()))
        except (OSError, ValueError) as err:
            raise CLIError(f"--runs-of {runs_of}: {getattr(err, 'strerror', None) or err}") from None
    return E.Selection(kinds=_names(kind, "--kind"), run_ids=run_ids,
                       git_revisions=_names(git_revision, "--git-revision"))


@app.command()
def emit(
    gpu: Gpu = "auto",
    db: Storage = DEFAULT_DB,
    out: Annotated[Optional[Path], typer.Option(help="Output file [default: configs/<gpu>.json]")] = None,
    runs: Annotated[Optional[str], typer.Option(help="Fit on exactly these run ids (comma list) [default: every "
                                                     "run of --kind]")] = None,
    runs_of: Annotated[Optional[Path], typer.Option(help="Fit on the runs a table records (re-emit it)")] = None,
    kind: Annotated[str, typer.Option(help="Run kinds to fit on; validate and bench runs never are")]
    = "sweep,emit",
    git_revision: Annotated[Optional[str], typer.Option(help="Only runs of these git revisions (prefixes, comma "
                                                             "list)")] = None,
    check: Annotated[bool, typer.Option("--check", help="Write nothing: exit 1 unless the file at --out has "
                                                        "exactly the bytes this emission gives")] = False,
    remeasure: Annotated[bool, typer.Option(help="First time each problem's top configs on its neighbours "
                                                 "(needs the GPU) to complete the config x shape matrix")] = False,
    interpret: Interpret = False,
):
    """Fit a frozen launch-heuristic table from the selected runs' measurements and write configs/<gpu>.json.
    The same command on the same database writes the same bytes."""
    _run(_use_interpreter, interpret)
    from rich.console import Console

    from normtune.tuner import emit as E
    from normtune.tuner.store import Store

    console = Console(stderr=True)
    if gpu.strip().lower() == "interpret" and not interpret:
        _run(_raise, "--gpu interpret names the Triton interpreter's results: add --interpret")
    if remeasure and check:
        _run(_raise, "--check re-emits from the database as it is: it cannot be combined with --remeasure")
    selection = _run(_selection, runs, runs_of, kind, git_revision)
    if interpret:
        key = "interpret"
    elif gpu == "auto" or remeasure:
        key = _run(_device_info, gpu, False).key
    else:
        key = gpu.strip().lower()
    path = out or Path("configs") / f"{key}.json"
    store = _run(Store, db) if remeasure else _run(_read_only_store, db)
    try:
        if remeasure:
            info = _run(_device_info, gpu, interpret)
            if interpret:
                console.print(_INTERPRETER_BANNER)
            run_id, n = _run(E.remeasure_neighbours, store, key, info, selection=selection,
                             command_line=_command_line())
            if selection.run_ids is not None:
                selection = E.Selection(selection.kinds, selection.run_ids + (run_id,), selection.git_revisions)
            console.print(f"re-measured {n} (problem, config) pairs on neighbouring shapes (run {run_id})")
        table = _run(E.build_table, store, key, interpret=interpret, selection=selection)
    finally:
        store.close()
    text = E.dumps(table)
    for line in E.dropped_summary(table):
        console.print(f"[yellow]{line}[/]")
    prov = table["provenance"]
    if check:
        same = path.is_file() and path.read_text() == text
        console.print(f"{path} {'is' if same else 'is NOT'} what runs {_span(prov['runs'])} of {db} give "
                      f"(inputs {prov['fingerprint'][:19]}…)")
        raise typer.Exit(0 if same else 1)
    _run(_write_text, path, text)
    fams = table["families"]
    console.print(f"wrote {path}: {len(fams)} families, {sum(len(f['rules']) for f in fams.values())} rules, "
                  f"from {prov['configs_measured']} measured configs of runs {_span(prov['runs'])} "
                  f"(GPU {table['gpu']['name']}; inputs {prov['fingerprint'][:19]}…)")


def _span(ids) -> str:
    return ",".join(map(str, ids))


def _write_text(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as err:
        raise CLIError(f"--out {path}: cannot be written ({err.strerror or err})") from None


def _command_line() -> str:
    """The command as typed (program name without its folder), for a run's provenance."""
    return " ".join([Path(sys.argv[0]).name] + sys.argv[1:])


_INTERPRETER_BANNER = ("[yellow]--interpret: kernels run on CPU in the Triton interpreter; times are host "
                       "wall-clock, not GPU timings[/]")


# ---------------------------------------------------------------------------------------------- validate


def _validation_problems(shapes: str | None, norms: list[str], dtype: str, interpret: bool):
    """--shapes given: those shapes in --dtype; else the held-out set (tiny shapes with --interpret)."""
    if shapes is None and not interpret:
        from normtune.tuner.heldout import heldout_problems

        return heldout_problems(norms, dtype)
    return _problems(norms, dtype, None, _shapes(shapes, interpret), bias=None, zero_centered=False, save="input")


def _table_for_device(table: Path | None, info):
    from normtune.kernels.tables import load_table, table_for

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


@app.command()
def validate(
    gpu: Gpu = "auto",
    shapes: Annotated[Optional[str], typer.Option(
        "--shapes", help="Shapes in --dtype (as for sweep) [default: the held-out set of shapes and dtypes on a "
                         "GPU, tiny with --interpret]")] = None,
    norm: Norms = "layer_norm,rms_norm",
    dtype: Dtype = "bf16",
    table: Annotated[Optional[Path], typer.Option(help="Table to validate [default: the one the runtime picks]")]
    = None,
    trials: Annotated[int, typer.Option(help="Trials of the unseeded reference sweep per shape")] = 40,
    rounds: Annotated[int, typer.Option(help="Interleaved head-to-head rounds per shape")] = 5,
    db: Storage = DEFAULT_DB,
    out: Annotated[Optional[Path], typer.Option(help="Folder for validate.json and validate.md")] = None,
    compile_workers: Annotated[int, typer.Option(help="CPU processes compiling ahead")] = 8,
    interpret: Interpret = False,
):
    """Regret of a heuristic table on shapes it was not fitted on: table ÷ the fastest of the table's config, the
    best of an unseeded sweep and the analytic default, timed head to head."""
    _run(_use_interpreter, interpret)
    import json as _json

    from rich.console import Console

    from normtune.kernels.config import NORMS
    from normtune.tuner import validate as V
    from normtune.tuner.render import validation_summary, validation_table
    from normtune.tuner.store import Store

    console = Console(stderr=True)
    norms = _run(_split, norm, NORMS, "--norm")
    dt = _run(_dtype, dtype)
    if trials < 1:
        _run(_raise, f"--trials {trials}: need at least 1 trial per shape ({V.REFERENCE_TRIALS} by default)")
    if rounds < 1:
        _run(_raise, f"--rounds {rounds}: need at least 1 round")
    problems = _run(_validation_problems, shapes, norms, dt, interpret)
    info = _run(_device_info, gpu, interpret)
    tab = _run(_table_for_device, table, info)
    if out is not None:
        _run(_check_out_folder, out)
    label = tab.label if tab else None
    if interpret:
        console.print(_INTERPRETER_BANNER)
    console.print(f"validating {label or 'no table (the analytic defaults)'}")
    store = _run(Store, db)
    try:
        rows = _run(V.run_validate, store, info, info.key, problems, tab, storage_url=db, trials=trials,
                    rounds=rounds, compile_workers=compile_workers, command_line=_command_line(),
                    progress=_validate_progress(console))
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


def _check_out_folder(out: Path) -> None:
    """Before measuring: the output folder exists or can be made, and takes files."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".normtune-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise CLIError(f"--out {out}: cannot write there ({err.strerror or err}); pass a writable folder") from None


# ----------------------------------------------------------------------------------------------- compare


@app.command()
def compare(
    old: Annotated[Path, typer.Argument(help="The table in use (JSON)")],
    new: Annotated[Path, typer.Argument(help="The candidate table (JSON)")],
    gpu: Gpu = "auto",
    shapes: Shapes = None,
    norm: Norms = "layer_norm,rms_norm",
    dtype: Dtype = "bf16",
    threshold: Annotated[float, typer.Option(help="Fail where NEW is slower than OLD by more than this fraction "
                                                  "(and beyond the spread)")] = 0.03,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds per shape")] = 5,
    interpret: Interpret = False,
):
    """Time two tables' configs head to head (cold L2, interleaved) and exit 1 if NEW is slower on any shape."""
    _run(_use_interpreter, interpret)
    from rich.console import Console

    from normtune.kernels.config import NORMS
    from normtune.kernels.tables import load_table
    from normtune.tuner import compare as C
    from normtune.tuner.measure import TIMING, MeasureSession

    console = Console(stderr=True)
    if not 0 <= threshold < 1:
        _run(_raise, f"--threshold {threshold}: give a fraction in [0, 1), e.g. 0.03 for 3 %")
    if rounds < 1:
        _run(_raise, f"--rounds {rounds}: need at least 1 round")
    tables = [_run(load_table, str(path)) for path in (old, new)]
    norms = _run(_split, norm, NORMS, "--norm")
    dt = _run(_dtype, dtype)
    problems = _run(_problems, norms, dt, None, _run(_shapes, shapes, interpret), bias=None, zero_centered=False,
                    save="input")
    info = _run(_device_info, gpu, interpret)
    if interpret:
        console.print(_INTERPRETER_BANNER)

    def progress(i, row):
        console.print(f"{i + 1}/{len(problems)} {row.problem.key}: {row.verdict(threshold)}")

    session = _run(MeasureSession.for_device, info, timing=TIMING["compare"])
    rows = _run(C.compare_tables, *tables, problems, session, rounds=rounds, progress=progress)
    typer.echo("\n".join(C.comparison_markdown(rows, threshold, interpret=info.interpret)))
    if any(r.fails(threshold) for r in rows):
        raise typer.Exit(1)


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

    from normtune.tuner.report import write_report

    console = Console(stderr=True)
    if db == DEFAULT_DB and not Path("results.db").exists():
        _run(_raise, "results.db not found here: run from the repository root or pass --db sqlite:///PATH")
    store = _run(_read_only_store, db)
    try:
        paths = write_report(store, gpu.strip().lower(), out, heatmap_problem=problem,
                             table_path=str(table) if table else None)
    except _known_errors() + (OSError,) as err:  # TableError is a ValueError; StoreError for a corrupt database
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    console.print(f"wrote {paths[0]} and {len(paths) - 1} plots in {out}")


def main() -> None:  # pragma: no cover - console-script entry point alternative
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
