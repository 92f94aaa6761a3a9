"""`normtune emit`: turn stored measurements into a frozen launch-heuristic table (configs/<gpu>.json).

Inputs (`Selection`): by default the correct measurements of this GPU's sweep runs and of emit's own neighbour
re-measurements. Validation and bench measurements are never fitted on, whatever is selected (a table fitted on
its held-out shapes would validate itself); runs can be narrowed by id, kind or git revision. The table records
the runs it was fitted on and a fingerprint of every input measurement, so anyone can re-emit it from the same
database and get the same bytes (`emit_inputs` + `dumps`, with the provenance taken from the database, never
from the clock).

Fitting (N buckets, M groups, never slower than the analytic default, the incumbent kept): `fit.py`.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from normtune.kernels.config import BackwardConfig, Problem, ProblemFamily
from normtune.kernels.select.tables import SCHEMA_VERSION, Table, parse_table

from ..files import mode_for, write_atomic
from ..gpu_info import run_limits
from .fit import DEFAULT_TIE, MAX_GROUPS, SPLIT_GAIN, Data, default_in, fit_family, single_pass_threshold
from .heldout import HELDOUT_SHAPES
from .incumbent import configs_for, record as record_incumbent
from ..measure.spread import Timing

TOP_K = 3  # configs per problem carried into the matrix and re-measured on neighbours
FIT_KINDS = ("sweep", "emit")  # run kinds fitted on by default (emit's runs hold the neighbour re-measurements)
NEVER_FIT = ("validate", "bench")  # run kinds, and measurement-source prefixes, that a table never learns from
HELD_OUT = frozenset(HELDOUT_SHAPES)  # shapes a table is never fitted on, whichever run measured them


@dataclass(frozen=True)
class Selection:
    """Which runs a table is fitted on: `run_ids` (exactly these), else every run of `kinds`; either narrowed to
    `git_revisions` (prefixes) when given."""

    kinds: tuple[str, ...] = FIT_KINDS
    run_ids: tuple[int, ...] | None = None
    git_revisions: tuple[str, ...] | None = None

    def __post_init__(self):
        bad = [k for k in self.kinds if k in NEVER_FIT]
        if bad:
            raise ValueError(f"--kind {','.join(bad)}: a table is never fitted on {' or '.join(NEVER_FIT)} runs "
                             f"(held-out and bench shapes must stay unseen); use {', '.join(FIT_KINDS)}")
        if not self.kinds:
            raise ValueError(f"--kind is empty: use a comma list of run kinds, e.g. {','.join(FIT_KINDS)}")


@dataclass
class Inputs:
    """The measurements a table is fitted on, and where they come from."""

    runs: list  # RunRecord of every run that contributed a measurement, oldest first
    measurements: list  # MeasurementRecord, by id
    held_out: list = field(default_factory=list)  # "MxN" of held-out shapes the selected runs measured (left out)
    without_rows: list = field(default_factory=list)  # problem keys of stored 0-row problems (left out)
    fingerprint: str = ""

    def __post_init__(self):
        digest = hashlib.sha256()
        for m in self.measurements:
            digest.update(f"{m.id}|{m.run_id}|{m.problem.key}|{m.config_hash}|{m.median_us!r}|{m.p10_us!r}|"
                          f"{m.p90_us!r}\n".encode())
        self.fingerprint = "sha256:" + digest.hexdigest()


def select_inputs(store, gpu_key: str, *, interpret: bool = False, selection: Selection = Selection()) -> Inputs:
    """The selected runs' correct measurements of `gpu_key`: never validate or bench ones, and never one of a
    held-out shape (`heldout.HELDOUT_SHAPES`), even when a sweep measured it — validation must stay blind to the
    table. Raises ValueError for run ids that are not this GPU's, or that are validate/bench runs."""
    runs = [r for r in store.runs(gpu_key=None if interpret else gpu_key)
            if r.interpret == interpret and (interpret or r.gpu_key == gpu_key)]
    if selection.run_ids is not None:
        known = {r.id: r for r in runs}
        missing = sorted(set(selection.run_ids) - set(known))
        if missing:
            raise ValueError(f"--runs {','.join(map(str, missing))}: no such {gpu_key} run in {store.display_url} "
                             f"(its runs: {','.join(map(str, sorted(known))) or 'none'})")
        refused = sorted(i for i in selection.run_ids if known[i].kind in NEVER_FIT)
        if refused:
            raise ValueError(f"--runs {','.join(map(str, refused))}: {known[refused[0]].kind} runs are never "
                             "fitted on (held-out and bench shapes must stay unseen)")
        runs = [r for r in runs if r.id in set(selection.run_ids)]
    else:
        runs = [r for r in runs if r.kind in selection.kinds]
    if selection.git_revisions is not None:
        prefixes = tuple(selection.git_revisions)
        runs = [r for r in runs if r.device.git_revision and r.device.git_revision.startswith(prefixes)]
    run_ids = {r.id for r in runs}
    measurements = [m for m in store.measurements(gpu_key=gpu_key, status="ok", interpret=interpret)
                    if m.run_id in run_ids and m.median_us and m.median_us > 0
                    and not m.source.startswith(NEVER_FIT)]
    held_out = sorted({(m.problem.M, m.problem.N) for m in measurements if (m.problem.M, m.problem.N) in HELD_OUT})
    measurements = [m for m in measurements if (m.problem.M, m.problem.N) not in HELD_OUT]
    # A problem without rows (an older sweep stored some) timed nothing worth fitting: no rule bounds M = 0.
    without_rows = sorted({m.problem.key for m in measurements if m.problem.M < 1})
    measurements = [m for m in measurements if m.problem.M >= 1]
    used = {m.run_id for m in measurements}
    return Inputs([r for r in runs if r.id in used], measurements, [f"{M}x{N}" for M, N in held_out],
                  without_rows)


def collect(inputs: Inputs) -> dict[ProblemFamily, Data]:
    """family → problem → config → its measurements pooled (`Timing`)."""
    grouped: dict[ProblemFamily, dict[Problem, dict[BackwardConfig, list]]] = \
        defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for m in inputs.measurements:
        grouped[m.problem.family][m.problem][m.config].append(m)
    return {fam: {p: {c: Timing.pool(v) for c, v in cfgs.items()} for p, cfgs in probs.items()}
            for fam, probs in grouped.items()}


def build_table(store, gpu_key: str, *, interpret: bool = False, selection: Selection = Selection(),
                incumbent: Table | None = None) -> dict:
    """The table for `gpu_key` from the selected inputs (see `select_inputs`); with an `incumbent` table, its
    configs stay wherever the new winner does not beat them beyond the spread (`incumbent.py`), and the new
    table records the incumbent's rules. Raises ValueError when there is nothing to fit."""
    inputs = select_inputs(store, gpu_key, interpret=interpret, selection=selection)
    if not inputs.measurements:
        what = "interpreter" if interpret else gpu_key
        raise ValueError(f"no successful measurements for {what} in the selected runs of {store.display_url}: "
                         f"run `normtune sweep --gpu {gpu_key}` first"
                         + (" (interpreter runs need --interpret)" if not interpret else ""))
    latest = max(inputs.runs, key=lambda r: (r.started_at, r.id))
    families = {}
    n_measured = 0
    for family, data in sorted(collect(inputs).items(), key=lambda kv: kv[0].key):
        fitted = fit_family(family, data, default_in(data, latest.device.sm_count, run_limits(latest.device)),
                            configs_for(incumbent, data) if incumbent is not None else None)
        n_measured += sum(len(v) for v in data.values())
        families[family.key] = {
            "rules": fitted.rules,
            "single_pass_max_n": single_pass_threshold(fitted.rules),
            "expected_us": dict(sorted(fitted.expected_us.items())),
            "fit_regret": dict(sorted(fitted.regret.items())),
            "dropped": fitted.dropped,
            "default_unmeasured": fitted.default_unmeasured,
        }
    runs = inputs.runs
    table = {
        "schema_version": SCHEMA_VERSION,
        "interpret": interpret,
        "gpu": {"name": latest.gpu_name, "key": gpu_key, "compute_capability": latest.device.compute_capability,
                "sm_count": latest.device.sm_count},
        "provenance": {
            "runs": [r.id for r in runs], "measurements": len(inputs.measurements),
            "fingerprint": inputs.fingerprint, "torch": sorted({r.device.torch for r in runs}),
            "triton": sorted({r.device.triton for r in runs}), "normtune": sorted({r.device.normtune for r in runs}),
            "git_revision": sorted({r.device.git_revision for r in runs if r.device.git_revision}),
            "driver": sorted({r.device.driver for r in runs if r.device.driver}),
            "date": max(r.ended_at or r.started_at for r in runs).strftime("%Y-%m-%d"),
            "configs_measured": n_measured,
            "held_out_left_out": inputs.held_out,
            "fit": {"top_k": TOP_K, "split_gain": SPLIT_GAIN, "max_m_groups": MAX_GROUPS,
                    "never_slower_than_default": "beyond the p10-p90 spread", "default_tie": DEFAULT_TIE},
        },
        "families": families,
    }
    if inputs.without_rows:  # only then: the tables of databases without such problems keep their bytes
        table["provenance"]["without_rows_left_out"] = inputs.without_rows
    if incumbent is not None:
        table["provenance"]["incumbent"] = record_incumbent(incumbent)
    parse_table(json.loads(json.dumps(table)), "<emitted table>")  # the runtime must accept what we write
    return table


def dumps(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


# ------------------------------------------------------------------------------------------------- writing


class TableWriteError(ValueError):
    """A table file emit must not replace, or cannot write; the message names the file and the way out."""


def record_path(path: Path) -> Path:
    """Where emit records the sha256 of the table it wrote at `path` (`sha256sum -c` reads it)."""
    return path.with_name(path.name + ".sha256")


def backup_path(path: Path) -> Path:
    """Where the table that a new emission replaced is kept."""
    return path.with_name(path.name + ".bak")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _emitted_form(data: bytes) -> bool:
    """Whether `data` is a table exactly as `dumps` writes it (valid, canonical bytes, with the fingerprint of its
    inputs): a table emit wrote whose record was not kept beside it (a shipped table, a copy)."""
    try:
        table = json.loads(data.decode("utf-8"))
        if not isinstance(table, dict) or dumps(table).encode() != data:
            return False
        parse_table(table, "<existing table>")
        return isinstance(table.get("provenance"), dict) and "fingerprint" in table["provenance"]
    except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError and TableError are ValueErrors
        return False


def replace_reason(path: Path, current: bytes) -> str | None:
    """Why the file at `path` (its bytes `current`) is not emit's to replace, or None when it is: emit wrote it and
    it is unchanged since (its recorded sha256 matches), or, with no record, it is a table in emit's exact form."""
    record = record_path(path)
    try:
        recorded = record.read_text().split()[0] if record.is_file() else None
    except (OSError, ValueError, IndexError):
        recorded = ""
    if recorded is not None:
        if recorded == _sha256(current):
            return None
        return f"changed since normtune emit wrote it (its sha256 no longer matches {record})"
    return None if _emitted_form(current) else "was not written by normtune emit"


def write_table(path: Path, text: str, *, force: bool = False) -> Path | None:
    """Write the emitted table `text` to `path` atomically, with its sha256 record beside it (`record_path`).
    A file already there is replaced only when emit wrote it and nobody changed it since (`replace_reason`), or
    with `force`; it is kept as `backup_path(path)` first. Returns the backup's path (None: nothing replaced)."""
    data = text.encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        current = path.read_bytes() if path.exists() else None
    except OSError as err:
        raise TableWriteError(f"{path}: cannot be written ({err.strerror or err})") from None
    backup = None
    try:
        if current is not None and current != data:
            reason = None if force else replace_reason(path, current)
            if reason is not None:
                raise TableWriteError(f"{path} {reason}; it was left as it is. Pass --force to replace it (the "
                                      f"old one is kept as {backup_path(path).name}), or write elsewhere with --out")
            backup = backup_path(path)
            write_atomic(backup, current, mode_for(path))
        mode = mode_for(path)
        if current != data:
            write_atomic(path, data, mode)
        write_atomic(record_path(path), f"{_sha256(data)}  {path.name}\n", mode)
    except OSError as err:
        raise TableWriteError(f"{path}: cannot be written ({err.strerror or err})") from None
    return backup


def recorded_runs(table: dict) -> tuple[int, ...]:
    """The runs a table says it was fitted on (to re-emit it: `Selection(run_ids=recorded_runs(table))`)."""
    runs = table.get("provenance", {}).get("runs")
    if not runs or not all(isinstance(r, int) for r in runs):
        raise ValueError("the table records no fitted runs (provenance.runs): it cannot be re-emitted")
    return tuple(runs)
