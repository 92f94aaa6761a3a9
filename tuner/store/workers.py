"""What sweep workers coordinate through, beside Optuna's studies: run liveness and trial claims.

`Store.workers` (a `Workers`) holds them.

- Liveness: a sweep worker's run records a heartbeat (`beat`) every few seconds. A `running` run whose last beat
  is older than its grace period is dead; any worker (or `normtune status`) sees it so, and `mark_dead_runs`
  records it, so a killed run never stays `running`.
- Claims: a study's budget of `--trials` is `--trials` numbered slots. A worker measures a trial only while it
  holds a slot: a new slot is taken by INSERT (the primary key makes it atomic on every backend), a slot of a
  dead run that was never measured is taken over by a compare-and-swap UPDATE. So however many workers share a
  study, it ends with exactly `--trials` measured trials, each measured once.
- Costs: where a worker's wall clock went (start-up, measuring, sampler, database, compile wait, heartbeats),
  saved with each heartbeat and at its end in `normtune_run_costs`, for `normtune status`. A table of its own,
  created beside the others when missing: databases written before it simply show no costs.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
from dataclasses import dataclass

from sqlalchemy import DateTime, ForeignKey, Text, bindparam, case, delete, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Mapped, mapped_column

from normtune.kernels.config import Problem

from . import prepared
from .models import (Base, MeasurementModel, ProblemModel, RunHeartbeatModel, RunModel, StoreIntegrityError,
                           TrialClaimModel, utc_now, problem_from_row, as_utc)

# Grace of a run that recorded no heartbeat yet (the seconds between its start and its first beat).
FIRST_BEAT_GRACE_S = 60.0


class RunCostsModel(Base):
    """Where a sweep worker's wall clock went, as JSON seconds per phase (`tuner.sweep.costs`)."""

    __tablename__ = "normtune_run_costs"
    run_id: Mapped[int] = mapped_column(ForeignKey("normtune_runs.id"), primary_key=True)
    costs_json: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime)


@dataclass(frozen=True)
class SlotState:
    slot: int
    run_id: int
    trial_number: int | None
    measured: bool
    alive: bool  # its run is running and beats

    @property
    def free(self) -> bool:
        return not self.measured and not self.alive


@dataclass(frozen=True)
class StudyProgress:
    """A study's state from the database alone."""
    study_name: str
    problem: Problem | None
    finished: int  # measured trials (any status)
    failed: int  # measured trials whose status is not ok
    running: int  # slots held by live workers, not measured yet
    best_us: float | None
    best_run_id: int | None


@dataclass(frozen=True)
class WorkerState:
    """A run that records heartbeats (a sweep worker), with what it measured."""
    run_id: int
    host: str
    pid: int
    device: int | None
    gpu_name: str
    status: str  # as stored: running, finished, interrupted, failed, dead
    alive: bool
    beat_age_s: float
    started_at: dt.datetime
    measured: int
    first_measured_at: dt.datetime | None
    last_measured_at: dt.datetime | None
    costs: dict | None = None  # where its wall clock went, as last saved

    @property
    def trials_per_s(self) -> float | None:
        if self.measured < 2 or self.first_measured_at is None or self.last_measured_at is None:
            return None
        span = (self.last_measured_at - self.first_measured_at).total_seconds()
        return (self.measured - 1) / span if span > 0 else None


# The claims' statements of every trial, built once (executed with their parameters).
_CLAIMS = TrialClaimModel.__table__
_HELD = (_CLAIMS.c.study_name == bindparam("study"), _CLAIMS.c.slot == bindparam("the_slot"),
         _CLAIMS.c.run_id == bindparam("run"))
_INSERT_CLAIM = insert(_CLAIMS).values(study_name=bindparam("study"), slot=bindparam("the_slot"),
                                       run_id=bindparam("run"), trial_number=bindparam("number"), measured=False,
                                       claimed_at=bindparam("at"))
_BIND = update(_CLAIMS).where(*_HELD).values(trial_number=bindparam("number"))
_MARK_MEASURED = update(_CLAIMS).where(*_HELD, _CLAIMS.c.trial_number == bindparam("number"),
                                       _CLAIMS.c.measured.is_(False)).values(measured=True)


def _connection(session):
    """Statements of the hot path go to the connection (SQLAlchemy Core), not through the ORM session."""
    from sqlalchemy.orm import Session

    return session.connection() if isinstance(session, Session) else session


def _alive(status: str, beat_at: dt.datetime | None, grace_s: float | None, started_at: dt.datetime,
           now: dt.datetime) -> bool:
    if status != "running":
        return False
    last, grace = (beat_at, grace_s) if beat_at is not None else (started_at, FIRST_BEAT_GRACE_S)
    return (now - last).total_seconds() <= grace


class Workers:
    """A `Store`'s worker coordination (`store.workers`): liveness, trial claims and status, each method one
    transaction of the store's."""

    def __init__(self, store) -> None:
        self._store = store
        self._next_slot: dict[tuple[str, int], int] = {}  # (study, run) -> the slot after the run's last claim

    # ------------------------------------------------------------------------------------------ liveness

    def beat(self, run_id: int, *, grace_s: float, device: int | None = None, costs: dict | None = None) -> None:
        """Record that `run_id` is alive (and its `costs` so far, in the same transaction). A run declared dead
        meanwhile (its worker stalled past its grace period) is running again: the slots taken over from it are
        lost to it, which the claims make harmless."""
        with self._store.session_scope() as session:
            if costs is not None:
                self._put_costs(session, run_id, costs)
            row = session.get(RunHeartbeatModel, run_id)
            if row is None:
                session.add(RunHeartbeatModel(run_id=run_id, host=socket.gethostname(), pid=os.getpid(),
                                              device=device, grace_s=grace_s, beat_at=utc_now()))
            else:
                row.beat_at = utc_now()
            session.execute(update(RunModel).where(RunModel.id == run_id, RunModel.status == "dead")
                            .values(status="running", ended_at=None))

    def save_costs(self, run_id: int, costs: dict) -> None:
        """Record where `run_id`'s wall clock went (replacing what it saved before)."""
        with self._store.session_scope() as session:
            self._put_costs(session, run_id, costs)

    @staticmethod
    def _put_costs(session, run_id: int, costs: dict) -> None:
        """One upsert, so that the heartbeat thread and the run's end may both write a run's first row."""
        values = {"run_id": run_id, "costs_json": json.dumps(costs, sort_keys=True), "updated_at": utc_now()}
        dialect = session.get_bind().dialect.name
        insert = {"postgresql": postgresql_insert, "sqlite": sqlite_insert}.get(dialect)
        if insert is None:
            raise StoreIntegrityError(f"run costs: no upsert for the {dialect!r} backend; use sqlite or postgresql")
        statement = insert(RunCostsModel).values(**values)
        session.execute(statement.on_conflict_do_update(
            index_elements=[RunCostsModel.run_id],
            set_={"costs_json": statement.excluded.costs_json, "updated_at": statement.excluded.updated_at}))

    def mark_dead_runs(self) -> list[int]:
        """Record as `dead` every running run whose heartbeat is older than its grace period; their ids."""
        now = utc_now()
        with self._store.session_scope() as session:
            rows = session.execute(select(RunModel.id, RunHeartbeatModel.beat_at, RunHeartbeatModel.grace_s)
                                   .join(RunHeartbeatModel, RunHeartbeatModel.run_id == RunModel.id)
                                   .where(RunModel.status == "running")).all()
            dead = [(run_id, beat_at) for run_id, beat_at, grace_s in rows
                    if (now - beat_at).total_seconds() > grace_s]
            for run_id, beat_at in dead:
                session.execute(update(RunModel).where(RunModel.id == run_id, RunModel.status == "running")
                                .values(status="dead", ended_at=beat_at))
        return [run_id for run_id, _ in dead]

    def states(self) -> list[WorkerState]:
        """Every run that recorded heartbeats, oldest first, with its measurement count and time span."""
        if "normtune_run_heartbeats" not in self._store.table_names():
            return []
        counts = (select(MeasurementModel.run_id, func.count(MeasurementModel.id).label("n"),
                         func.min(MeasurementModel.created_at).label("first"),
                         func.max(MeasurementModel.created_at).label("last"))
                  .group_by(MeasurementModel.run_id).subquery())
        query = (select(RunModel, RunHeartbeatModel, counts.c.n, counts.c.first, counts.c.last)
                 .join(RunHeartbeatModel, RunHeartbeatModel.run_id == RunModel.id)
                 .outerjoin(counts, counts.c.run_id == RunModel.id).order_by(RunModel.id))
        now = utc_now()
        has_costs = RunCostsModel.__tablename__ in self._store.table_names()
        with self._store.session_scope() as session:
            costs = ({run_id: json.loads(data) for run_id, data in session.execute(
                select(RunCostsModel.run_id, RunCostsModel.costs_json))} if has_costs else {})
            return [WorkerState(run.id, hb.host, hb.pid, hb.device, run.gpu_name, run.status,
                                _alive(run.status, hb.beat_at, hb.grace_s, run.started_at, now),
                                (now - hb.beat_at).total_seconds(), as_utc(run.started_at), n or 0, as_utc(first),
                                as_utc(last), costs.get(run.id))
                    for run, hb, n, first, last in session.execute(query)]

    # -------------------------------------------------------------------------------------------- claims

    def slots(self, study_name: str) -> dict[int, SlotState]:
        """The study's claimed slots."""
        query = (select(TrialClaimModel.slot, TrialClaimModel.run_id, TrialClaimModel.trial_number,
                        TrialClaimModel.measured, RunModel.status, RunModel.started_at, RunHeartbeatModel.beat_at,
                        RunHeartbeatModel.grace_s)
                 .join(RunModel, RunModel.id == TrialClaimModel.run_id)
                 .outerjoin(RunHeartbeatModel, RunHeartbeatModel.run_id == TrialClaimModel.run_id)
                 .where(TrialClaimModel.study_name == study_name))
        now = utc_now()
        with self._store.session_scope() as session:
            return {slot: SlotState(slot, run_id, number, bool(measured),
                                    _alive(status, beat_at, grace_s, started_at, now))
                    for slot, run_id, number, measured, status, started_at, beat_at, grace_s
                    in session.execute(query)}

    def claim_slot(self, study_name: str, target: int, run_id: int) -> tuple[int, int | None] | None:
        """Take a free slot below `target` for `run_id`: (slot, number of the unmeasured trial of a dead run it
        takes over, if any); None when every slot is measured or held by a live worker. Atomic against any
        number of concurrent claimers, on SQLite and PostgreSQL.

        The slot after this run's last new claim of the study is tried first, without reading the study's slots:
        a worker claiming a study's slots one after another takes each in one transaction, not two. Otherwise the
        lowest free slot: those that came free below it (given back, or held by a dead run) are taken once the
        slot after the last claim is not free."""
        guess = self._next_slot.get((study_name, run_id))
        if guess is not None and guess < target and self._insert_claim(study_name, guess, run_id):
            return guess, None
        states = self.slots(study_name)
        for slot in range(target):
            state = states.get(slot)
            if state is None:
                if self._insert_claim(study_name, slot, run_id):
                    return slot, None
                continue  # another worker took it first
            if state.free:
                same_trial = (TrialClaimModel.trial_number.is_(None) if state.trial_number is None
                              else TrialClaimModel.trial_number == state.trial_number)
                with self._store.session_scope() as session:
                    taken = session.execute(
                        update(TrialClaimModel).where(TrialClaimModel.study_name == study_name,
                                                      TrialClaimModel.slot == slot,
                                                      TrialClaimModel.run_id == state.run_id, same_trial,
                                                      TrialClaimModel.measured.is_(False))
                        .values(run_id=run_id, trial_number=None, claimed_at=utc_now())).rowcount
                if taken == 1:
                    return slot, state.trial_number
        return None

    def _insert_claim(self, study_name: str, slot: int, run_id: int) -> bool:
        """Claim a slot no run has claimed yet; False when another run has it."""
        try:
            with self._store.session_scope() as session:
                prepared.execute(_connection(session), _INSERT_CLAIM, {"study": study_name, "the_slot": slot,
                                                                       "run": run_id, "number": None, "at": utc_now()})
        except StoreIntegrityError:
            return False
        self._next_slot[(study_name, run_id)] = slot + 1
        return True

    def next_guess(self, study_name: str, run_id: int) -> int | None:
        """The slot after `run_id`'s last new claim of the study (None before its first): the one it most likely
        gets next."""
        return self._next_slot.get((study_name, run_id))

    def claim_in(self, session, study_name: str, slot: int, run_id: int, trial_number: int) -> None:
        """Claim a slot no run has claimed yet, already filled by `trial_number`, within the caller's transaction
        `session` (the one that creates the trial): it raises SQLAlchemy's IntegrityError when another run has
        the slot, and that transaction, trial included, is then rolled back. `claimed` records it once
        committed."""
        prepared.execute(_connection(session), _INSERT_CLAIM, {"study": study_name, "the_slot": slot, "run": run_id,
                                                               "number": trial_number, "at": utc_now()})

    def claimed(self, study_name: str, slot: int, run_id: int, taken: bool = True) -> None:
        """After `claim_in`'s transaction: the slot is the run's (`taken`), or another's (the guess is dropped)."""
        if taken:
            self._next_slot[(study_name, run_id)] = slot + 1
        else:
            self._next_slot.pop((study_name, run_id), None)

    def bind_slot(self, study_name: str, slot: int, run_id: int, trial_number: int) -> bool:
        """Record which trial fills a slot `run_id` holds. False when the slot is no longer this run's."""
        with self._store.session_scope() as session:
            return self.bind_slot_in(session, study_name, slot, run_id, trial_number)

    @staticmethod
    def bind_slot_in(session, study_name: str, slot: int, run_id: int, trial_number: int) -> bool:
        """`bind_slot` within the caller's transaction `session` (e.g. the one that creates the trial)."""
        return _connection(session).execute(_BIND, {"study": study_name, "the_slot": slot, "run": run_id,
                                                    "number": trial_number}).rowcount == 1

    def release_slot(self, study_name: str, slot: int, run_id: int) -> None:
        """Give a slot back (its trial was abandoned unmeasured): another worker, or a re-run, takes it."""
        with self._store.session_scope() as session:
            session.execute(delete(TrialClaimModel).where(TrialClaimModel.study_name == study_name,
                                                          TrialClaimModel.slot == slot,
                                                          TrialClaimModel.run_id == run_id,
                                                          TrialClaimModel.measured.is_(False)))

    def mark_measured(self, session, study_name: str, slot: int, run_id: int, trial_number: int) -> bool:
        """First statement of the transaction that stores a claimed trial's measurement (so that it takes the
        write lock before reading anything): True when `run_id` still holds the slot with that trial."""
        marked = prepared.execute(_connection(session), _MARK_MEASURED, {"study": study_name, "the_slot": slot,
                                                                         "run": run_id, "number": trial_number})
        return marked.rowcount == 1

    def adopt_measured_trials(self, study_name: str) -> int:
        """Give the measured trials of a study swept before claims existed (schema 1) their slots, once; how many."""
        with self._store.session_scope() as session:
            if session.execute(select(TrialClaimModel.slot).where(TrialClaimModel.study_name == study_name)
                               .limit(1)).first() is not None:
                return 0
            rows = session.execute(select(MeasurementModel.trial_number, MeasurementModel.run_id)
                                   .where(MeasurementModel.study_name == study_name,
                                          MeasurementModel.trial_number.is_not(None))
                                   .order_by(MeasurementModel.trial_number)).all()
        if not rows:
            return 0
        try:
            with self._store.session_scope() as session:
                session.add_all(TrialClaimModel(study_name=study_name, slot=slot, run_id=run_id, trial_number=number,
                                                measured=True, claimed_at=utc_now())
                                for slot, (number, run_id) in enumerate(rows))
        except StoreIntegrityError:  # a concurrent worker adopted them (or claimed) first
            return 0
        return len(rows)

    # -------------------------------------------------------------------------------------------- status

    def study_progress(self, prefix: str = "normtune:") -> list[StudyProgress]:
        """Every study whose name starts with `prefix` that has measurements or claims, by name."""
        ok = MeasurementModel.status == "ok"
        measured = (select(MeasurementModel.study_name, func.count(MeasurementModel.id),
                           func.sum(case((ok, 0), else_=1)), func.min(case((ok, MeasurementModel.median_us))),
                           func.min(MeasurementModel.problem_id))
                    .where(MeasurementModel.study_name.startswith(prefix, autoescape=True)).group_by(MeasurementModel.study_name))
        out: dict[str, dict] = {}
        with self._store.session_scope() as session:
            problems = {row.id: problem_from_row(row) for row in session.scalars(select(ProblemModel))}
            for name, n, failed, best, problem_id in session.execute(measured):
                out[name] = dict(problem=problems.get(problem_id), finished=n, failed=int(failed or 0), best_us=best)
                out[name]["best_run_id"] = session.execute(
                    select(MeasurementModel.run_id).where(MeasurementModel.study_name == name,
                                                          MeasurementModel.median_us == best,
                                                          MeasurementModel.status == "ok").limit(1)).scalar()
        running: dict[str, int] = {}
        if "normtune_trial_claims" in self._store.table_names():
            names = {r[0] for r in self._select(select(TrialClaimModel.study_name).distinct()
                                                .where(TrialClaimModel.study_name.startswith(prefix, autoescape=True)))}
            for name in names:
                running[name] = sum(not s.measured and s.alive for s in self.slots(name).values())
        return [StudyProgress(name, out.get(name, {}).get("problem"), out.get(name, {}).get("finished", 0),
                              out.get(name, {}).get("failed", 0), running.get(name, 0),
                              out.get(name, {}).get("best_us"), out.get(name, {}).get("best_run_id"))
                for name in sorted(set(out) | set(running))]

    def _select(self, query) -> list:
        with self._store.session_scope() as session:
            return list(session.execute(query))
