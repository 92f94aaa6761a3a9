"""The one module that reaches into Optuna's storage: the rows of its RDB storage (`optuna.storages._rdb`) that a
sweep writes itself, each in a transaction that may be the caller's own, and the few private names the sweep
needs (a study's and a trial's storage ids). Every other module goes through the functions here; the supported
Optuna versions are pinned in pyproject.toml and `tests/test_sweep_optuna_rows.py` checks these rows against the
installed Optuna's own reading of them.

What is written: a created trial (its row with its number, params, user and system attributes and first
heartbeat: `create_trial_in`, within the caller's transaction, so that the slot it fills is claimed and bound in
the same one), a finished trial (attributes, value, state: `finish_trial_in`, within the store's transaction
that records its measurement, so that a trial is measured and told at once) and a study's description
(`describe_study`, one transaction). What is read: the unfinished trials' rows alone (`trials_in_states`, for
repairs) and which trials have beaten (`trials_with_heartbeats`). The per-trial statements are prebuilt Core
statements run on the connection's DBAPI cursor (`store/prepared.py`; a multi-row insert per table), not through
the ORM's unit of work: a sweep writes a trial per measurement, and the ORM's bookkeeping, then Core's per-call
execution, cost more than the statements.

The rows are exactly those `RDBStorage.create_new_trial(template_trial=…)` + `record_heartbeat` and
`set_trial_user_attr` + `Study.tell` write (the samplers the sweep uses do nothing after a trial). A trial's number
is the count of its study's trials, read under the lock that Optuna's own creation takes (the study's row, FOR
UPDATE; SQLite's write lock), which is what Optuna's `count_past_trials` computes. Where Optuna's RDB internals
differ from what this expects (`SUPPORTED` false), or the storage is not an RDB storage, the public calls are used.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from ..store import prepared

log = logging.getLogger("normtune.sweep")


def _internals():
    try:
        from optuna.storages._rdb import models

        names = {"StudyModel": ("study_id",), "StudyUserAttributeModel": ("study_id", "key", "value_json"),
                 "StudySystemAttributeModel": ("study_id", "key", "value_json"),
                 "TrialModel": ("trial_id", "number", "study_id", "state", "datetime_start", "datetime_complete"),
                 "TrialParamModel": ("trial_id", "param_name", "param_value", "distribution_json"),
                 "TrialUserAttributeModel": ("trial_user_attribute_id", "trial_id", "key", "value_json"),
                 "TrialSystemAttributeModel": ("trial_id", "key", "value_json"),
                 "TrialHeartbeatModel": ("trial_id", "heartbeat"),
                 "TrialValueModel": ("trial_id", "objective", "value", "value_type")}
        for model, columns in names.items():
            table = getattr(models, model).__table__.c
            for column in columns:
                getattr(table, column)
        models.TrialValueModel.value_to_stored_repr  # noqa: B018 - present, or another layout
        return models
    except (ImportError, AttributeError):  # another Optuna layout: the public calls
        return None


_MODELS = _internals()
SUPPORTED = _MODELS is not None  # this Optuna's RDB rows are the ones written here


def study_id(study) -> int:
    """The storage id of an Optuna `Study`."""
    return study._study_id


def trial_id(trial) -> int:
    """The storage id of an Optuna trial (`Trial` or `FrozenTrial`)."""
    return trial._trial_id


def direct(storage) -> bool:
    """True when the rows of `storage` are written here (an RDB storage of a supported Optuna)."""
    from optuna.storages import RDBStorage

    return SUPPORTED and isinstance(storage, RDBStorage)


def _connection(session):
    """The Core connection of an ORM `session` (statements skip the ORM's unit of work), or `session` itself."""
    from sqlalchemy.orm import Session

    return session.connection() if isinstance(session, Session) else session


@functools.cache
def _statements() -> SimpleNamespace:
    """The statements of the rows written here, built once: executed with their parameters, each is compiled once
    per connection's dialect (a statement built anew per trial costs more to build than to run)."""
    from optuna.trial import TrialState
    from sqlalchemy import bindparam, func, insert, select, update

    m = _MODELS
    trials, studies = m.TrialModel.__table__, m.StudyModel.__table__
    attrs, values = m.TrialUserAttributeModel.__table__, m.TrialValueModel.__table__
    sid = bindparam("sid")
    counted = select(func.count(), sid, bindparam("new_state", type_=trials.c.state.type),
                     bindparam("started", type_=trials.c.datetime_start.type)).where(trials.c.study_id == sid)
    insert_trial = insert(trials).from_select(["number", "study_id", "state", "datetime_start"], counted)
    return SimpleNamespace(
        lock_study=select(studies.c.study_id).where(studies.c.study_id == sid).with_for_update(),
        insert_trial=insert_trial,
        insert_trial_returning=insert_trial.returning(trials.c.trial_id, trials.c.number),
        number=select(trials.c.number).where(trials.c.trial_id == bindparam("tid")),
        params=insert(m.TrialParamModel.__table__), user_attrs=insert(attrs),
        system_attrs=insert(m.TrialSystemAttributeModel.__table__),
        # The beat's time is the database's own clock (the column's default), as Optuna's stale-trial check reads it.
        heartbeat=insert(m.TrialHeartbeatModel.__table__),
        finish=update(trials).where(trials.c.trial_id == bindparam("tid"),
                                    trials.c.state == bindparam("running", value=TrialState.RUNNING,
                                                                type_=trials.c.state.type))
        .values(state=bindparam("new_state", type_=trials.c.state.type),
                datetime_complete=bindparam("completed", type_=trials.c.datetime_complete.type)),
        value=insert(values))


@functools.cache
def _upsert(dialect: str, model: str, owner: str):
    """INSERT … ON CONFLICT (owner, key) DO UPDATE of an attribute table, where the dialect has it (SQLite,
    PostgreSQL; None elsewhere): one statement, however many of the attributes exist already."""
    from sqlalchemy.dialects import postgresql, sqlite

    insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}.get(dialect)
    if insert is None:
        return None
    statement = insert(getattr(_MODELS, model).__table__)
    return statement.on_conflict_do_update(index_elements=[owner, "key"],
                                           set_={"value_json": statement.excluded.value_json})


def _distribution_json(distribution) -> str:
    """A distribution as Optuna stores it (a study's trials share a handful of them). Each trial's template holds
    distributions of its own, so a categorical one is looked up by its choices and their types (1, 1.0 and True
    are equal keys otherwise): hashing and comparing Optuna's distribution objects took longer than writing the
    row."""
    choices = getattr(distribution, "choices", None)
    key = (type(distribution), tuple((type(c), c) for c in choices)) if choices is not None else distribution
    try:
        return _JSON[key]
    except (KeyError, TypeError):  # TypeError: unhashable choices, serialized every time
        from optuna.distributions import distribution_to_json

        text = distribution_to_json(distribution)
        if len(_JSON) < 4096:
            try:
                _JSON[key] = text
            except TypeError:
                pass
        return text


_JSON: dict = {}


def create_trial_in(session, study_id: int, template) -> tuple[int, int]:
    """(trial id, number) of a new RUNNING trial holding `template`'s params and attributes, with its first
    heartbeat, written within the caller's transaction `session` (needs `direct`)."""
    from optuna.trial import TrialState

    S, conn = _statements(), _connection(session)
    if conn.dialect.name != "sqlite":  # numbers are per study: Optuna locks its row (SQLite: the write lock)
        conn.execute(S.lock_study, {"sid": study_id})
    # One statement counts the study's trials and inserts the new one with that number: on SQLite the count is
    # read under the write lock the insert takes (a count read before it, outside that lock, could be another
    # writer's too).
    new = {"sid": study_id, "new_state": TrialState.RUNNING, "started": dt.datetime.now()}
    if conn.dialect.insert_returning:
        tid, number = prepared.execute(conn, S.insert_trial_returning, new).row
    else:
        tid = conn.execute(S.insert_trial, new).lastrowid
        number = conn.execute(S.number, {"tid": tid}).scalar_one()
    rows = ((S.params, [dict(trial_id=tid, param_name=name,
                             param_value=template.distributions[name].to_internal_repr(value),
                             distribution_json=_distribution_json(template.distributions[name]))
                        for name, value in template.params.items()]),
            (S.user_attrs, [dict(trial_id=tid, key=k, value_json=json.dumps(v))
                            for k, v in template.user_attrs.items()]),
            (S.system_attrs, [dict(trial_id=tid, key=k, value_json=json.dumps(v))
                              for k, v in template.system_attrs.items()]),
            (S.heartbeat, [dict(trial_id=tid)]))
    for statement, values in rows:
        if values:
            prepared.execute(conn, statement, values)
    return tid, number


def create_running_trial(storage, study_id: int, template,
                         after: Callable[[Any, int], None] | None = None) -> tuple[int, int, bool]:
    """(trial id, number, whether `after` ran) of a new RUNNING trial holding `template`'s params and attributes,
    with its first heartbeat, in one transaction of its own; `after(session, number)` writes more in that
    transaction (it does not run where Optuna's public calls are used)."""
    if not direct(storage):
        trial_id = storage.create_new_trial(study_id, template_trial=template)
        storage.record_heartbeat(trial_id)
        return trial_id, storage.get_trial_number_from_id(trial_id), False
    with storage.engine.begin() as conn:
        tid, number = create_trial_in(conn, study_id, template)
        if after is not None:
            after(conn, number)
    return tid, number, after is not None


def finish_trial(storage, study, trial_id: int, number: int, state, value: float | None,
                 user_attrs: dict[str, Any]) -> None:
    """Set `user_attrs` and finish the trial (COMPLETE with `value`, or FAIL/PRUNED) in one transaction. Raises
    Optuna's UpdateFinishedTrialError when the trial was finished meanwhile (e.g. failed as stale)."""
    if not direct(storage):
        for key, v in user_attrs.items():
            storage.set_trial_user_attr(trial_id, key, v)
        study.tell(number, value, state=state) if value is not None else study.tell(number, state=state)
        return
    from optuna.exceptions import UpdateFinishedTrialError

    with storage.engine.begin() as conn:
        if finish_trial_in(conn, storage, trial_id, state, value, user_attrs) is False:
            raise UpdateFinishedTrialError(f"Trial#{number} has already finished and can not be updated.")


def finish_trial_in(session, storage, trial_id: int, state, value: float | None,
                    user_attrs: dict[str, Any]) -> bool | None:
    """`finish_trial` within the caller's transaction `session` (any session or connection on the study's
    database): True when finished, False when it was finished already (left as it is), None where Optuna's
    internals are not the expected ones (nothing written: the caller finishes it with `finish_trial`)."""
    if not direct(storage):
        return None
    from optuna.trial import TrialState

    S, conn = _statements(), _connection(session)
    # The trial's state first: an UPDATE of a RUNNING trial, so that the write lock comes before any read.
    if prepared.execute(conn, S.finish, {"tid": trial_id, "new_state": state,
                                         "completed": dt.datetime.now()}).rowcount != 1:
        return False
    _set_attrs(conn, "TrialUserAttributeModel", "trial_id", trial_id, user_attrs)
    if value is not None and state == TrialState.COMPLETE:
        stored, kind = _MODELS.TrialValueModel.value_to_stored_repr(value)
        prepared.execute(conn, S.value, {"trial_id": trial_id, "objective": 0, "value": stored, "value_type": kind})
    return True


def _set_attrs(conn, model: str, owner: str, owner_id: int, attrs: dict[str, Any]) -> None:
    """Set the attributes `attrs` of trial or study `owner_id` (new ones inserted, existing ones replaced)."""
    if not attrs:
        return
    rows = [{owner: owner_id, "key": k, "value_json": json.dumps(v)} for k, v in attrs.items()]
    upsert = _upsert(conn.dialect.name, model, owner)
    if upsert is not None:
        prepared.execute(conn, upsert, rows)
        return
    from sqlalchemy import insert, select, update

    table = getattr(_MODELS, model).__table__
    existing = set(conn.execute(select(table.c.key).where(table.c[owner] == owner_id)).scalars())
    new = [row for row in rows if row["key"] not in existing]
    if new:
        conn.execute(insert(table), new)
    for row in rows:
        if row["key"] in existing:
            conn.execute(update(table).where(table.c[owner] == owner_id, table.c.key == row["key"])
                         .values(value_json=row["value_json"]))


def describe_study(storage, study, user_attrs: dict[str, Any], metric_names: list[str]) -> None:
    """Set a study's user attributes and its metric names (what `Study.set_metric_names` records) in one
    transaction; Optuna's public calls take one each."""
    key = getattr(__import__("optuna.study.study", fromlist=["_"]), "_SYSTEM_ATTR_METRIC_NAMES", None)
    if not direct(storage) or key is None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # set_metric_names is marked experimental
            study.set_metric_names(metric_names)
        for name, value in user_attrs.items():
            study.set_user_attr(name, value)
        return
    with storage.engine.begin() as conn:
        _set_attrs(conn, "StudyUserAttributeModel", "study_id", study_id(study), user_attrs)
        _set_attrs(conn, "StudySystemAttributeModel", "study_id", study_id(study), {key: metric_names})


@dataclass(frozen=True)
class TrialRow:
    """A trial as its row has it (no params, no attributes): what repairs and clean-ups need to know."""
    trial_id: int
    number: int
    state: object  # optuna.trial.TrialState
    datetime_start: dt.datetime | None


def trials_in_states(storage, study, states) -> list[TrialRow]:
    """The study's trials in `states`, by number, read from their rows alone: a study's unfinished trials are
    few, and reading every trial with its params and attributes (what `Study.get_trials` does first) would cost
    a sweep milliseconds per trial it holds."""
    if not direct(storage):
        return [TrialRow(trial_id(t), t.number, t.state, t.datetime_start)
                for t in study.get_trials(deepcopy=False, states=tuple(states))]
    from sqlalchemy import select

    trials = _MODELS.TrialModel.__table__
    query = (select(trials.c.trial_id, trials.c.number, trials.c.state, trials.c.datetime_start)
             .where(trials.c.study_id == study_id(study), trials.c.state.in_(list(states))).order_by(trials.c.number))
    with storage.engine.connect() as conn:
        return [TrialRow(*row) for row in conn.execute(query)]


def trials_with_heartbeats(storage, trial_ids: list[int]) -> set[int]:
    """Those of `trial_ids` that have recorded a heartbeat (Optuna's heartbeat table; none outside an RDB
    storage)."""
    from optuna.storages import RDBStorage
    from sqlalchemy import column, select, table

    if not trial_ids or not isinstance(storage, RDBStorage):
        return set()
    beats = _MODELS.TrialHeartbeatModel.__table__ if SUPPORTED else table("trial_heartbeats", column("trial_id"))
    with storage.engine.connect() as conn:
        return set(conn.execute(select(beats.c.trial_id).where(beats.c.trial_id.in_(list(trial_ids)))).scalars())
