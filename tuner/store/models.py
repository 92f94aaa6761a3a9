"""What the results store holds: one model class per table (constraints declared in the class, Enum columns for
states), and the frozen records callers get back instead of ORM objects.

Our tables carry the `normtune_` prefix, so Optuna's study tables live beside them in the same database.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (BigInteger, Boolean, DateTime, Enum, Float, ForeignKey, Index, Integer, MetaData, String,
                        Text, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from normtune.kernels.config import (BackwardConfig, Kernel1Config, Kernel2Config, Problem, ProblemFamily,
                                     kernel_1_layout)
from normtune.kernels.strategies.configs import FLAT_LAYOUT
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.results import STATUSES, MeasureResult

# The layout of the tables. The shared knobs' columns are generated from the config types (`KNOB_COLUMNS`), and a
# database missing some gains them on a writing open (`upgrades.upgrade_knobs`).
SCHEMA_VERSION = 5
# Versions this normtune opens; opening an older one for writing upgrades it to SCHEMA_VERSION.
READABLE_VERSIONS = ("1", "2", "3", "4", "5")
RUN_STATUSES = ("running", "finished", "interrupted", "failed", "dead")
PEER_STATUSES = ("ok", "error", "unavailable")
_SQL_TYPES = {bool: Boolean(), int: Integer(), float: Float(), str: String(32)}


def knob_columns() -> dict[tuple[str, str], tuple[str, Any, Any]]:
    """(kernel, field) -> (column, SQL type, default) of the measurements' knob columns. The indexed ones
    (`SHARED_COLUMNS`) hold the knobs every config has: `Kernel1Config`'s fields and the strategy, and
    `Kernel2Config`'s. The others, unindexed, hold the knobs of the frozen flat layout (`FLAT_LAYOUT`: the rows
    strategy's, which the configs of the rows, columns and dual strategies state), as every database has since
    they were written, so that a compacted file (`normtune slim`) rebuilds those configs without their JSON. A
    knob a strategy declares lives in the stored config JSON only: it adds no column and rewrites no row."""
    k1 = {f.name: f.default for f in dataclasses.fields(Kernel1Config)}
    k2 = {f.name: f.default for f in dataclasses.fields(Kernel2Config)}
    layouts = (("kernel_1", "k1", {**k1, "strategy": "rows"}), ("kernel_2", "k2", k2),
               ("kernel_1", "k1", FLAT_LAYOUT))
    return {(kernel, name): (f"{prefix}_{name}", _SQL_TYPES[type(default)], default)
            for kernel, prefix, layout in layouts for name, default in layout.items()}


KNOB_COLUMNS = knob_columns()
# The indexed knob columns: those of the knobs every config has.
SHARED_COLUMNS = tuple(column for (kernel, name), (column, _, _) in KNOB_COLUMNS.items()
                       if kernel == "kernel_2" or name not in FLAT_LAYOUT)
# Config field -> column, for both kernels (each config's knobs are stored there as well as in its JSON).
CONFIG_COLUMNS = {key: column for key, (column, _, _) in KNOB_COLUMNS.items()}


def knob_values(config: BackwardConfig) -> dict[str, Any]:
    """Column -> value of `config`'s knob columns (a flat-layout knob its strategy lacks at its default)."""
    knobs = config.to_dict()
    return {column: knobs[kernel].get(name, default) for (kernel, name), (column, _, default) in KNOB_COLUMNS.items()}


class StoreError(Exception):
    """A database operation failed; the message says which database and why."""


class StoreIntegrityError(StoreError):
    """A constraint (unique key, foreign key, enum check) rejected a write."""


class SchemaVersionError(StoreError):
    """The database was written by a normtune with another `SCHEMA_VERSION`."""


class OlderSchemaError(SchemaVersionError):
    """A database of an older schema this normtune upgrades, opened read-only (so not upgraded); `found` is its
    schema version."""

    def __init__(self, message: str, found: str):
        super().__init__(message)
        self.found = found


# ---------------------------------------------------------------------------------------------------- models


class Base(DeclarativeBase):
    # Explicit constraint names: the same DDL on SQLite and PostgreSQL, and migrations can name what they change.
    metadata = MetaData(naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s", "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s", "fk": "fk_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s"})


def _enum(name: str, values: tuple[str, ...]) -> Enum:
    # A VARCHAR with a CHECK constraint rather than a PostgreSQL ENUM type: same DDL everywhere, no type objects.
    return Enum(*values, name=name, native_enum=False, create_constraint=True, length=32)


class MetaModel(Base):
    __tablename__ = "normtune_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(255))


class RunModel(Base):
    __tablename__ = "normtune_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)
    gpu_name: Mapped[str] = mapped_column(String(255))
    gpu_key: Mapped[str] = mapped_column(String(64), index=True)
    compute_capability: Mapped[str | None] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    l2_bytes: Mapped[int] = mapped_column(BigInteger)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    driver: Mapped[str | None] = mapped_column(String(64))
    cuda: Mapped[str | None] = mapped_column(String(64))
    torch: Mapped[str] = mapped_column(String(64))
    triton: Mapped[str] = mapped_column(String(64))
    normtune_version: Mapped[str] = mapped_column(String(64))
    git_revision: Mapped[str | None] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(255))
    python: Mapped[str] = mapped_column(String(32))
    command_line: Mapped[str] = mapped_column(Text)
    interpret: Mapped[bool] = mapped_column(Boolean)
    copy_bandwidth_gbps: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime)
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    status: Mapped[str] = mapped_column(_enum("run_status", RUN_STATUSES))


class ProblemModel(Base):
    __tablename__ = "normtune_problems"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    family_key: Mapped[str] = mapped_column(String(255), index=True)
    norm: Mapped[str] = mapped_column(String(32))
    M: Mapped[int] = mapped_column(BigInteger)
    N: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(16))
    weight_dtype: Mapped[str] = mapped_column(String(16))
    has_weight: Mapped[bool] = mapped_column(Boolean)
    has_bias: Mapped[bool] = mapped_column(Boolean)
    zero_centered: Mapped[bool] = mapped_column(Boolean)
    save: Mapped[str] = mapped_column(String(16))


class _TimedRowColumns:
    """The columns a measurement of normtune's kernels and a peer's result share: which run timed which problem,
    the timing figures (µs), and the error of a failure. Each table adds its own status enum and details."""

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("normtune_runs.id"), index=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("normtune_problems.id"), index=True)
    error: Mapped[str | None] = mapped_column(Text)
    median_us: Mapped[float | None] = mapped_column(Float)
    p10_us: Mapped[float | None] = mapped_column(Float)
    p90_us: Mapped[float | None] = mapped_column(Float)
    reps: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime)


class MeasurementModel(_TimedRowColumns, Base):
    """One timed config. Its knob columns (`KNOB_COLUMNS`) are added below the class, generated from the config
    types."""

    __tablename__ = "normtune_measurements"
    # One Optuna trial is stored at most once; rows without a trial (NULLs) never collide.
    __table_args__ = (UniqueConstraint("study_name", "trial_number"), Index(None, "problem_id", "status"))
    config_json: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(String(40), index=True)
    status: Mapped[str] = mapped_column(_enum("measurement_status", STATUSES))
    kernel_1_us: Mapped[float | None] = mapped_column(Float)
    kernel_2_us: Mapped[float | None] = mapped_column(Float)
    compile_s: Mapped[float | None] = mapped_column(Float)
    bytes_moved: Mapped[int | None] = mapped_column(BigInteger)
    gbps: Mapped[float | None] = mapped_column(Float)
    floor_us: Mapped[float | None] = mapped_column(Float)
    floor_fraction: Mapped[float | None] = mapped_column(Float)
    programs: Mapped[int | None] = mapped_column(Integer)
    errors_json: Mapped[str] = mapped_column(Text)
    interpret: Mapped[bool] = mapped_column(Boolean, index=True)
    source: Mapped[str] = mapped_column(String(64), index=True)
    study_name: Mapped[str | None] = mapped_column(String(512))
    trial_number: Mapped[int | None] = mapped_column(Integer)


for _column, _type, _default in KNOB_COLUMNS.values():
    setattr(MeasurementModel, _column, mapped_column(_column, _type, index=_column in SHARED_COLUMNS,
                                                     default=_default))


class PeerResultModel(_TimedRowColumns, Base):
    __tablename__ = "normtune_peer_results"
    peer: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(_enum("peer_status", PEER_STATUSES))
    kernels_json: Mapped[str] = mapped_column(Text)  # per-kernel breakdown {kernel name: µs}
    note: Mapped[str | None] = mapped_column(Text)




class RunHeartbeatModel(Base):
    """Liveness of a run that records heartbeats (a sweep worker). A `running` run whose last beat is older than
    its grace period is dead: its process was killed or its host lost, and nobody will end it."""

    __tablename__ = "normtune_run_heartbeats"
    run_id: Mapped[int] = mapped_column(ForeignKey("normtune_runs.id"), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    device: Mapped[int | None] = mapped_column(Integer)  # CUDA index; NULL for the interpreter
    grace_s: Mapped[float] = mapped_column(Float)
    beat_at: Mapped[dt.datetime] = mapped_column(DateTime)


class TrialClaimModel(Base):
    """One place of a study's trial budget: slot k (0 <= k < --trials) is held by at most one run at a time,
    which is what keeps several workers from measuring more trials than asked (the primary key is the lock)."""

    __tablename__ = "normtune_trial_claims"
    study_name: Mapped[str] = mapped_column(String(512), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    run_id: Mapped[int] = mapped_column(ForeignKey("normtune_runs.id"), index=True)
    trial_number: Mapped[int | None] = mapped_column(Integer)  # NULL between the claim and the ask
    # Set in the transaction that stores the trial's measurement, and only while the run still holds the slot;
    # a takeover requires it unset: so a slot is measured once, whatever the timing of a stalled worker.
    measured: Mapped[bool] = mapped_column(Boolean, default=False)
    claimed_at: Mapped[dt.datetime] = mapped_column(DateTime)


# --------------------------------------------------------------------------------------------------- records


# Run columns named after what they hold; the other DeviceInfo fields are columns of the same name.
_DEVICE_COLUMNS = {f.name: {"name": "gpu_name", "key": "gpu_key", "normtune": "normtune_version"}.get(f.name, f.name)
                   for f in dataclasses.fields(DeviceInfo)}


def device_columns(info: DeviceInfo) -> dict:
    """A run row's device columns from the `DeviceInfo` it is recorded from."""
    return {column: getattr(info, field) for field, column in _DEVICE_COLUMNS.items()}


@dataclass(frozen=True)
class RunRecord:
    """A stored run: what it was (kind, command), on which device (as recorded), when, and how it ended."""

    id: int
    kind: str
    device: DeviceInfo
    command_line: str
    copy_bandwidth_gbps: float | None
    started_at: dt.datetime
    ended_at: dt.datetime | None
    status: str

    @property
    def gpu_key(self) -> str:
        return self.device.key

    @property
    def gpu_name(self) -> str:
        return self.device.name

    @property
    def interpret(self) -> bool:
        return self.device.interpret


@dataclass(frozen=True)
class _TimedRecord:
    """What a stored measurement and a stored peer result share (see `_TimedRowColumns`)."""

    id: int
    run_id: int
    problem: Problem
    status: str
    error: str | None
    median_us: float | None
    p10_us: float | None
    p90_us: float | None
    reps: int
    created_at: dt.datetime
    gpu_key: str  # of the run that measured it
    gpu_name: str


@dataclass(frozen=True)
class MeasurementRecord(_TimedRecord):
    config: BackwardConfig
    config_hash: str
    kernel_1_us: float | None
    kernel_2_us: float | None
    compile_s: float | None
    bytes_moved: int | None
    gbps: float | None
    floor_us: float | None
    floor_fraction: float | None
    programs: int | None
    errors: dict[str, float]
    interpret: bool
    source: str
    study_name: str | None
    trial_number: int | None

    def to_result(self) -> MeasureResult:
        return MeasureResult(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MeasureResult)})


@dataclass(frozen=True)
class PeerRecord(_TimedRecord):
    peer: str
    kernels: dict[str, float]
    note: str | None


FIGURES = ("median_us", "p10_us", "p90_us", "kernel_1_us", "kernel_2_us", "compile_s", "gbps", "floor_us",
            "floor_fraction")


def utc_now(at: dt.datetime | None = None) -> dt.datetime:
    """`at` (an aware time; default: now) as stored: naive in UTC (SQLite has no time zones); records carry the
    zone again."""
    return (at or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc).replace(tzinfo=None)


def as_utc(value: dt.datetime | None) -> dt.datetime | None:
    return None if value is None else value.replace(tzinfo=dt.timezone.utc)


def figure_value(value: float | None) -> float | None:
    # NaN means "no figure": SQLite would store it as NULL anyway, so every backend does.
    return None if value is None or math.isnan(value) else float(value)


def hash_config(config_json: str) -> str:
    return hashlib.sha1(config_json.encode()).hexdigest()


def check_value(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed: use one of {', '.join(map(repr, allowed))}")


# Problem fields without a column of their own: the residual and gated forms are read from the family key (its
# '/res-…' and '/gate-…' parts), so databases written before them read as plain problems.
RESIDUAL_FIELDS = ("residual", "residual_dtype", "gate", "gate_activation")


def problem_from_row(row: ProblemModel) -> Problem:
    family = ProblemFamily.from_key(row.family_key) if "/res-" in row.family_key or "/gate-" in row.family_key \
        else ProblemFamily(row.norm, row.dtype, row.weight_dtype, row.has_weight, row.has_bias, row.zero_centered,
                           row.save)
    return family.problem(row.M, row.N)


def run_record(row: RunModel) -> RunRecord:
    device = DeviceInfo(**{field: getattr(row, column) for field, column in _DEVICE_COLUMNS.items()})
    return RunRecord(id=row.id, kind=row.kind, device=device, command_line=row.command_line,
                     copy_bandwidth_gbps=row.copy_bandwidth_gbps, started_at=as_utc(row.started_at),
                     ended_at=as_utc(row.ended_at), status=row.status)


def config_from_columns(values: Any) -> BackwardConfig:
    """The config whose knobs a measurement row's knob columns hold (`values`: the row, or a mapping from column
    name; the flat layout's columns for the strategies that have that layout). A compacted file (`normtune slim`)
    blanks the config JSON of every row these columns describe exactly."""
    get = values.get if isinstance(values, dict) else (lambda column: getattr(values, column))
    kernels: dict[str, dict] = {"kernel_1": {}, "kernel_2": {}}
    for (kernel, name), (column, _, default) in KNOB_COLUMNS.items():
        value = get(column)
        kernels[kernel][name] = type(default)(value) if isinstance(default, (bool, str)) else value
    own = kernel_1_layout(kernels["kernel_1"]["strategy"])
    kernels["kernel_1"] = {name: value for name, value in kernels["kernel_1"].items() if name in own}
    return BackwardConfig.from_dict(kernels)


def row_config(row: Any) -> BackwardConfig:
    """A measurement row's config: its JSON, or, where a compacted file left that blank, its knob columns."""
    return BackwardConfig.from_json(row.config_json) if row.config_json else config_from_columns(row)


def measurement_record(row: MeasurementModel, problem: ProblemModel, run: RunModel) -> MeasurementRecord:
    skip = {"problem", "config", "errors", "created_at", "gpu_key", "gpu_name"}
    values = {f.name: getattr(row, f.name) for f in dataclasses.fields(MeasurementRecord) if f.name not in skip}
    return MeasurementRecord(**values, problem=problem_from_row(problem), config=row_config(row),
                             errors=json.loads(row.errors_json), created_at=as_utc(row.created_at),
                             gpu_key=run.gpu_key, gpu_name=run.gpu_name)


def peer_record(row: PeerResultModel, problem: ProblemModel, run: RunModel) -> PeerRecord:
    skip = {"problem", "kernels", "created_at", "gpu_key", "gpu_name"}
    values = {f.name: getattr(row, f.name) for f in dataclasses.fields(PeerRecord) if f.name not in skip}
    return PeerRecord(**values, problem=problem_from_row(problem), kernels=json.loads(row.kernels_json),
                      created_at=as_utc(row.created_at), gpu_key=run.gpu_key, gpu_name=run.gpu_name)

