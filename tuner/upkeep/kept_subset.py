"""What the shipped `results.db` keeps, and a command that writes a database holding just that.

The policy (docs/results-db.md says why):

1. every run a table was fitted on (`provenance.runs` of each given table), so that
   `emit --runs-of TABLE --check` reproduces it;
2. per GPU key, the latest validate run of each problem form (plain norms, the fused residual form, the gated
   RMSNorm), and the latest bench run of each activation dtype, form and shape set (the seed shapes, the llm
   shapes, …), which `report` shows and labels by dtype;

`report` shows these runs: its best config per problem is the fastest of the kept measurements.

Everything else is dropped: other runs with their measurements, peer results and heartbeats; Optuna's studies
and the trial slots claimed in them (a sweep on the slim file opens new studies; the kept measurements no longer
name a study). Git history keeps the full file. The slim file is written in rollback-journal mode, so a
read-only open creates no `-wal`/`-shm` files beside it.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from normtune.kernels.select.tables import TableError, read_json

from ..tables.emit import recorded_runs
from ..store.models import KNOB_COLUMNS, config_from_columns
from ..store.schema import read_only_mode

# Optuna's tables (its RDB storage schema) and normtune's slot claims in them: dropped whole.
OPTUNA_TABLES = ("trial_params", "trial_user_attributes", "trial_system_attributes", "trial_values",
                 "trial_intermediate_values", "trial_heartbeats", "trials", "study_user_attributes",
                 "study_system_attributes", "study_directions", "studies")
RUN_TABLES = ("normtune_measurements", "normtune_peer_results", "normtune_run_heartbeats")


@dataclass(frozen=True)
class KeptRun:
    id: int
    kind: str
    gpu_key: str
    reasons: tuple[str, ...]


def plan(store, tables: dict[str, dict]) -> list[KeptRun]:
    """The runs the policy keeps, with why. `tables`: a name (for the reasons) → a parsed table. Raises
    ValueError for a table that records no runs, or records runs the store does not have."""
    runs = {r.id: r for r in store.runs()}
    reasons: dict[int, list[str]] = {}
    for name, table in tables.items():
        fitted = recorded_runs(table)
        missing = sorted(set(fitted) - set(runs))
        if missing:
            raise ValueError(f"{name} was fitted on runs {','.join(map(str, missing))}, which "
                             f"{store.display_url} does not have: it cannot be reproduced from this database")
        for run_id in fitted:
            reasons.setdefault(run_id, []).append(f"fitted {name}")
    for gpu_key in sorted({r.gpu_key for r in runs.values()}):
        mine = [r for r in runs.values() if r.gpu_key == gpu_key]
        for form, run_id in _latest_validations(store, [r for r in mine if r.kind == "validate"]):
            reasons.setdefault(run_id, []).append(f"latest {gpu_key} {form}validate")
        for dtype, count, run_id in _latest_benches(store, [r for r in mine if r.kind == "bench"]):
            reasons.setdefault(run_id, []).append(f"latest {gpu_key} {dtype} bench of its {count} shapes")
    return [KeptRun(i, runs[i].kind, runs[i].gpu_key, tuple(reasons[i])) for i in sorted(reasons)]


def _latest_validations(store, validations) -> list[tuple[str, int]]:
    """(form, run id) of the latest validate run of each problem form: "" for the plain norms, "residual " for
    the fused residual form, "gated " for the gated RMSNorm (a run that validated several counts for each)."""
    latest: dict[str, int] = {}
    for run in sorted(validations, key=lambda r: r.id):
        for form in {_form(record.problem) for record in store.measurements(run_id=run.id)} or {""}:
            latest[form] = run.id
    return sorted(latest.items())


def _form(problem) -> str:
    return "residual " if problem.residual else "gated " if problem.gate is not None else ""


def _latest_benches(store, benches) -> list[tuple[str, int, int]]:
    """(dtype, number of shapes, run id) of the latest bench run of each dtype and shape set."""
    latest: dict[tuple, int] = {}
    for run in sorted(benches, key=lambda r: r.id):
        for dtype, shapes in bench_shapes(store, run.id).items():
            latest[(dtype, shapes)] = run.id
    return sorted((dtype, len(shapes), run_id) for (dtype, shapes), run_id in latest.items())


def bench_shapes(store, run_id: int) -> dict[str, frozenset]:
    """dtype (followed by " residual" for the fused residual form) → the (norm, M, N) a bench run timed in it
    (normtune's rows and the peers')."""
    out: dict[str, set] = {}
    for record in [*store.measurements(run_id=run_id), *store.peer_results(run_id=run_id)]:
        p = record.problem
        out.setdefault(p.dtype + (" residual" if p.residual else ""), set()).add((p.norm, p.M, p.N))
    return {dtype: frozenset(shapes) for dtype, shapes in out.items()}


def write_slim(source: str, out: str, run_ids: list[int]) -> int:
    """Copy the SQLite file `source` to `out` keeping only `run_ids` (see the module's policy); return the new
    file's size in bytes. `out` must not exist: the result is written beside it and renamed into place."""
    target = Path(out)
    if target.exists():
        raise ValueError(f"--out {out}: already exists; name a new file (the slim copy never overwrites)")
    partial = target.with_name(target.name + ".partial")
    # Opened as the store opens it for reading: a WAL database in a folder this user cannot write is read
    # `immutable` (its write-ahead log empty) or refused in one line (`read_only_mode`).
    try:
        src = sqlite3.connect(f"file:{os.path.abspath(source)}?{read_only_mode(source, source)}", uri=True)
        src.execute("SELECT 1 FROM sqlite_master LIMIT 1")
    except sqlite3.Error as err:
        raise ValueError(f"--db {source}: cannot be read ({err}); pass a copy in a folder you can write") from None
    dst = None
    try:
        partial.unlink(missing_ok=True)
        dst = sqlite3.connect(partial)
        dst.execute("CREATE TABLE normtune_slim_probe (x)")  # the folder takes a new file
        dst.execute("DROP TABLE normtune_slim_probe")
    except (OSError, sqlite3.Error) as err:
        src.close()
        if dst is not None:
            dst.close()
            partial.unlink(missing_ok=True)
        raise ValueError(f"--out {out}: cannot write there ({err}); name a file in a writable folder") from None
    try:
        try:
            src.backup(dst)
        finally:
            src.close()
        keep = ",".join(str(int(i)) for i in run_ids) or "NULL"
        present = {name for (name,) in dst.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        with dst:
            for table in RUN_TABLES:
                if table in present:
                    dst.execute(f"DELETE FROM {table} WHERE run_id NOT IN ({keep})")  # noqa: S608 - ints only
            dst.execute(f"DELETE FROM normtune_runs WHERE id NOT IN ({keep})")  # noqa: S608
            # The studies go: the measurements stop naming them, so that a new study of the same name numbers
            # its trials afresh without colliding with a kept row.
            dst.execute("UPDATE normtune_measurements SET study_name = NULL, trial_number = NULL")
            for table in ("normtune_trial_claims",) + OPTUNA_TABLES:
                if table in present:
                    dst.execute(f"DELETE FROM {table}")  # noqa: S608 - fixed names
        blank_described_configs(dst)
        dst.execute("PRAGMA journal_mode=DELETE")
        dst.execute("VACUUM")
        dst.close()
        partial.replace(target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return target.stat().st_size


def load_tables(paths: list[Path]) -> dict[str, dict]:
    out = {}
    for path in paths:
        try:
            out[str(path)] = read_json(str(path))
        except TableError as err:
            raise ValueError(f"--table {path}: {err}") from None
    return out


def blank_described_configs(dst: sqlite3.Connection) -> int:
    """Blank the config JSON of every measurement whose knob columns describe that config exactly (the readers
    rebuild it from them, `store.models.row_config`), and drop the knob columns' indexes; a config with knobs of a
    strategy's own keeps its JSON. Most of a kept measurement's bytes were that JSON. Returns the rows blanked."""
    columns = [column for column, _, _ in KNOB_COLUMNS.values()]
    rows = dst.execute(f"SELECT id, config_json, {', '.join(columns)} FROM normtune_measurements")  # noqa: S608
    blank = [(row[0],) for row in rows
             if row[1] and config_from_columns(dict(zip(columns, row[2:]))).to_json() == row[1]]
    with dst:
        dst.executemany("UPDATE normtune_measurements SET config_json = '' WHERE id = ?", blank)
        # Reading needs no knob index; a writing open recreates them (`store.upgrades.ensure_knob_indexes`).
        for column in columns:
            dst.execute(f"DROP INDEX IF EXISTS ix_normtune_measurements_{column}")  # noqa: S608 - fixed names
    return len(blank)
