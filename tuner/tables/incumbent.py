"""The incumbent table of `normtune emit --keep`: the table a new emission replaces, whose rules stay where the new
measurements do not beat them beyond the spread.

Why: a re-fit on fresh measurements moves every rule whose winner changed by noise, and a switch made inside
the spread on the fitted rows can run unseen rows slower (docs/perf-notes.md, "Why the tuner fits as it does").
With an incumbent, a rule changes only where the measurements say it pays.

Reproducibility: the new table records the incumbent's rules (`record`), so re-emitting it from its recorded
runs (`emit --runs-of`) rebuilds the same incumbent (`from_record`) even after the old file is overwritten.
"""

from __future__ import annotations

from normtune.kernels.config import BackwardConfig, ConfigError, Problem
from normtune.kernels.select.tables import SCHEMA_VERSION, Table, TableError, parse_table


def record(table: Table) -> dict:
    """What a new table stores about its incumbent: the GPU it was tuned on and its rules per family (bounds,
    config, fitted shapes)."""
    families = {key: {"rules": [{"n_max": r["n_max"], "m_max": r["m_max"], "config": r["config"],
                                 "fitted_on": r.get("fitted_on", [])} for r in fam["rules"]]}
                for key, fam in sorted(table.raw["families"].items())}
    return {"gpu": {k: table.raw["gpu"].get(k) for k in ("name", "key", "compute_capability", "sm_count")},
            "families": families}


def from_record(data: dict, where: str) -> Table:
    """The incumbent a table recorded (`record`), as a table the runtime could read. Raises TableError naming
    `where` when the record is malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("families"), dict):
        raise TableError(f"{where}: provenance.incumbent has no families")
    return parse_table({"schema_version": SCHEMA_VERSION, "gpu": data.get("gpu"), "families": data["families"]},
                       f"{where} (its incumbent)")


def recorded(table: dict, where: str) -> Table | None:
    """The incumbent a table's provenance records, or None when it was emitted without one."""
    data = table.get("provenance", {}).get("incumbent")
    return None if data is None else from_record(data, where)


def combined(tables: list[Table]) -> Table:
    """Incumbent tables of one GPU as one (`emit --keep A --keep B`): each family's rules come from the one table
    that has that family, so that families tuned apart (a separate tune of one form) keep their rules when a table
    of all of them is emitted. Raises TableError for tables of two GPUs, or a family in two of the tables."""
    if len(tables) == 1:
        return tables[0]
    first, owner, families = tables[0], {}, {}
    for table in tables:
        if table.gpu_key != first.gpu_key:
            raise TableError(f"{table.path} was tuned on {table.gpu_key} and {first.path} on {first.gpu_key}: keep "
                             "tables of one GPU")
        for key, family in table.raw["families"].items():
            if key in owner:
                raise TableError(f"{owner[key]} and {table.path} both have family {key}: keep each family's "
                                 "incumbent from one table (drop one of them)")
            owner[key], families[key] = table.path, family
    return parse_table({"schema_version": SCHEMA_VERSION, "gpu": first.raw["gpu"], "families": families},
                       " + ".join(t.path for t in tables))


def configs_for(table: Table, problems) -> dict[Problem, BackwardConfig]:
    """Problem → the config `table` runs it with, for the problems a rule covers. Where the table has no family of
    the problem's own, that is the rule the runtime borrows from the closest tuned family (the plain rules on the
    fused residual form, say): what the problem runs today, which a new family's rule must beat beyond the spread
    to replace."""
    out = {}
    for p in problems:
        match = table.match(p)
        if match.config is not None:
            try:
                match.config.validate(p)
            except ConfigError:
                continue
            out[p] = match.config
    return out
