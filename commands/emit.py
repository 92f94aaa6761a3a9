"""`normtune emit`: a frozen heuristic table fitted from the stored measurements of selected runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    DEFAULT_DB, INTERPRETER_BANNER, CLIError, Gpu, Interpret, device_info, read_only_store, refuse,
    run_checked, run_ids_option, use_interpreter,
)


def _names(text: str | None, option: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise CLIError(f"{option} {text!r}: give a comma list")
    return values


def _read_runs_of(runs: str | None, runs_of: Path | None) -> dict | None:
    """The JSON of the table --runs-of names (read once: its runs and its incumbent both come from it)."""
    from normtune.kernels.select.tables import TableError, read_json

    if runs is not None and runs_of is not None:
        raise CLIError("--runs and --runs-of both name the runs to fit on: give one of them")
    if runs_of is None:
        return None
    try:
        data = read_json(str(runs_of))
    except TableError as err:
        reason = str(err).removeprefix(f"heuristic table {runs_of}: ")
        raise CLIError(f"--runs-of {runs_of}: {reason}") from None
    if not isinstance(data, dict):
        raise CLIError(f"--runs-of {runs_of}: not a heuristic table (a JSON object): name a table normtune emitted")
    return data


def _selection(runs: str | None, runs_of: Path | None, recorded: dict | None, kind: str, git_revision: str | None):
    from normtune.tuner.tables import emit as E

    run_ids = run_ids_option(runs, "--runs")
    if recorded is not None:
        try:
            run_ids = E.recorded_runs(recorded)
        except ValueError as err:
            raise CLIError(f"--runs-of {runs_of}: {err}") from None
    return E.Selection(kinds=_names(kind, "--kind"), run_ids=run_ids,
                       git_revisions=_names(git_revision, "--git-revision"))


def _incumbent(keep: list[Path] | None, runs_of: Path | None, recorded: dict | None):
    """The incumbent table: --keep's files (their families combined), else the one the --runs-of table recorded
    (re-emission), else None."""
    from normtune.kernels.select.tables import TableError, read_table
    from normtune.tuner.tables import incumbent

    try:
        if keep:
            return incumbent.combined([read_table(str(path)) for path in keep])
        return incumbent.recorded(recorded, str(runs_of)) if recorded is not None else None
    except TableError as err:
        raise CLIError(f"{'--keep' if keep else '--runs-of'} {err}") from None


def emit(
    gpu: Gpu = "auto",
    db: Annotated[Optional[str], typer.Option("--db", "--storage", help=(
        "SQLAlchemy URL of the results database [default: results.db; --remeasure, which writes, needs it named]"))]
    = None,
    out: Annotated[Optional[Path], typer.Option(help="Output file [default: configs/<gpu>.json]")] = None,
    user: Annotated[bool, typer.Option("--user", help="Write the user table <user dir>/<gpu>.json instead of --out: "
                                                      "the runtime prefers it to the shipped table (user dir: "
                                                      "$NORMTUNE_HOME, else $XDG_CONFIG_HOME/normtune, else "
                                                      "~/.config/normtune)")] = False,
    runs: Annotated[Optional[str], typer.Option(help="Fit on exactly these run ids (comma list) [default: every "
                                                     "run of --kind]")] = None,
    runs_of: Annotated[Optional[Path], typer.Option(help="Fit on the runs a table records (re-emit it)")] = None,
    kind: Annotated[str, typer.Option(help="Run kinds to fit on; validate and bench runs never are")]
    = "sweep,emit",
    keep: Annotated[Optional[list[Path]], typer.Option(help="Incumbent table: its config stays on every fitted "
                                                            "shape where the new winner is not faster beyond the "
                                                            "spread (with --runs-of, the incumbent that table "
                                                            "recorded). Repeatable: tables of one GPU whose families "
                                                            "differ, each family kept from its own table")] = None,
    git_revision: Annotated[Optional[str], typer.Option(help="Only runs of these git revisions (prefixes, comma "
                                                             "list)")] = None,
    check: Annotated[bool, typer.Option("--check", help="Write nothing: exit 1 unless the file at --out has "
                                                        "exactly the bytes this emission gives")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace the table at the output path even when emit did "
                                                        "not write it or it was changed since (the old one is kept "
                                                        "as <name>.json.bak)")] = False,
    remeasure: Annotated[bool, typer.Option(help="First time each problem's top configs on its neighbours "
                                                 "(needs the GPU) to complete the config x shape matrix")] = False,
    interpret: Interpret = False,
):
    """Fit a frozen launch-heuristic table from the selected runs' measurements and write configs/<gpu>.json (with
    --user: the user table the runtime uses on this GPU). The same command on the same database writes the same
    bytes."""
    run_checked(use_interpreter, interpret)
    from rich.console import Console

    from normtune.tuner.tables import emit as E
    from normtune.tuner.gpu_info import command_line
    from normtune.tuner.tables.emit_notes import dropped_summary, kept_summary
    from normtune.tuner.tables.remeasure import remeasure_neighbours
    from normtune.tuner.store.database import Store

    console = Console(stderr=True)
    if gpu.strip().lower() == "interpret" and not interpret:
        run_checked(refuse, "--gpu interpret names the Triton interpreter's results: add --interpret")
    if remeasure and check:
        run_checked(refuse, "--check re-emits from the database as it is: it cannot be combined with --remeasure")
    if remeasure and db is None:
        run_checked(refuse, "--remeasure stores its measurements in the database: name it with --db (the "
                            "repository's results.db is written only when named; e.g. --db a copy of it)")
    db = db or DEFAULT_DB
    if user and out is not None:
        run_checked(refuse, f"--user and --out {out} both name the output file: give one of them")
    if user and interpret:
        run_checked(refuse, "--user writes the table the runtime uses on a GPU, and an interpreter table never "
                            "tunes a GPU: drop --user (pass --out FILE)")
    recorded = run_checked(_read_runs_of, runs, runs_of)
    selection = run_checked(_selection, runs, runs_of, recorded, kind, git_revision)
    incumbent = run_checked(_incumbent, keep, runs_of, recorded)
    if interpret:
        key = "interpret"
    elif gpu == "auto" or remeasure:
        key = run_checked(device_info, gpu, False).key
    else:
        key = gpu.strip().lower()
    if incumbent is not None and incumbent.gpu_key != key:
        named = " ".join(map(str, keep)) if keep else runs_of
        run_checked(refuse, f"--keep {named}: its incumbent was tuned on {incumbent.gpu_key}, this table is "
                            f"for {key}: keep a {key} table (or emit without --keep)")
    if user:
        from normtune.kernels.select.table_chain import user_table_path

        path = user_table_path(key)
    else:
        path = out or Path("configs") / f"{key}.json"
    store = run_checked(Store, db) if remeasure else run_checked(read_only_store, db)
    try:
        if remeasure:
            info = run_checked(device_info, gpu, interpret)
            if interpret:
                console.print(INTERPRETER_BANNER)
            run_id, n = run_checked(remeasure_neighbours, store, key, info, selection=selection,
                                    command_line=command_line(), incumbent=incumbent)
            if selection.run_ids is not None:
                selection = E.Selection(selection.kinds, selection.run_ids + (run_id,), selection.git_revisions)
            console.print(f"re-measured {n} (problem, config) pairs on neighbouring shapes (run {run_id})")
        table = run_checked(E.build_table, store, key, interpret=interpret, selection=selection,
                            incumbent=incumbent)
    finally:
        store.close()
    text = E.dumps(table)
    for line in dropped_summary(table):
        console.print(line, style="yellow", markup=False)
    for line in kept_summary(table):
        console.print(line, markup=False)
    prov = table["provenance"]
    if prov["held_out_left_out"]:
        console.print(f"left out the held-out shapes {', '.join(prov['held_out_left_out'])}: the selected runs "
                      "measured them, but validation must stay blind to the table", markup=False)
    if prov.get("without_rows_left_out"):
        console.print(f"left out {len(prov['without_rows_left_out'])} stored problems without rows (M = 0: "
                      f"{', '.join(prov['without_rows_left_out'])}): they time nothing a rule could fit",
                      markup=False, soft_wrap=True)
    if check:
        same = path.is_file() and path.read_text() == text
        console.print(f"{path} {'is' if same else 'is NOT'} what runs {_span(prov['runs'])} of {db} give "
                      f"(inputs {prov['fingerprint'][:19]}…)")
        raise typer.Exit(0 if same else 1)
    backup = run_checked(E.write_table, path, text, force=force)
    fams = table["families"]
    console.print(f"wrote {path}: {len(fams)} families, {sum(len(f['rules']) for f in fams.values())} rules, "
                  f"from {prov['configs_measured']} measured configs of runs {_span(prov['runs'])} "
                  f"(GPU {table['gpu']['name']}; inputs {prov['fingerprint'][:19]}…)")
    if backup is not None:
        console.print(f"the table it replaced is kept as {backup}", markup=False)
    if user:
        console.print(f"the runtime uses it on {key} GPUs ahead of the shipped table unless $NORMTUNE_CONFIG names "
                      f"another; `normtune where --gpu {key} --shape MxN` shows the lookup", markup=False)


def _span(ids) -> str:
    return ",".join(map(str, ids))
