"""The one module that reaches into Optuna's storage: the rows of its RDB storage (`optuna.storages._rdb`) that a
sweep writes itself, each in a transaction that may be the caller's own, and the few private names the sweep
needs (a study's and a trial's storage ids). Every other module goes through the functions here; the supported
Optuna versions are pinned in pyproject.toml and `tests/test_sweep_optuna_rows.py` checks these rows against the
installed Optuna's own reading of them.

What is written: a created trial (its row with its number, params, user and system attributes and first
heartbeat: `create_trial_in`, within the caller's transaction, so that the slot it fills is claimed and bound in
the same one) and a finished trial (attributes, value, state: `finish_trial_in`, within the store's transaction
that records its measurement, so that a trial is measured and told at once). Statements go straight to the
connection (SQLAlchemy Core, a multi-row insert per table), not through the ORM's unit of work: a sweep writes a
trial per measurement, and the ORM's bookkeeping cost more than the statements.

The rows are exactly those `RDBStorage.create_new_trial(template_trial=…)` + `record_heartbeat` and
`set_trial_user_attr` + `Study.tell` write (the samplers the sweep uses do nothing after a trial). A trial's number
is the count of its study's trials, read under the lock that Optuna's own creation takes (the study's row, FOR
UPDATE; SQLite's write lock), which is what Optuna's `count_past_trials` computes. Where Optuna's RDB internals
differ from what this expects (`SUPPORTED` false), or the storage is not an RDB storage, the public calls are used.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any, Callable

log = logging.getLogger("normtune.sweep")


def _internals():
    try:
        from optuna.storages._rdb import models

        names = {"StudyModel": ("study_id",), "TrialModel": ("trial_id", "number", "study_id", "state",
                                                            "datetime_start", "datetime_complete"),
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


def create_trial_in(session, study_id: int, template) -> tuple[int, int]:
    """(trial id, number) of a new RUNNING trial holding `template`'s params and attributes, with its first
    heartbeat, written within the caller's transaction `session` (needs `direct`)."""
    from optuna.distributions import distribution_to_json
    from optuna.trial import TrialState
    from sqlalchemy import func, insert, literal, select

    m, conn = _MODELS, _connection(session)
    trials = m.TrialModel.__table__
    if conn.dialect.name != "sqlite":  # numbers are per study: Optuna locks its row (SQLite: the write lock)
        conn.execute(select(m.StudyModel.__table__.c.study_id)
                     .where(m.StudyModel.__table__.c.study_id == study_id).with_for_update())
    # One statement counts the study's trials and inserts the new one with that number: on SQLite the count is
    # read under the write lock the insert takes (a count read before it, outside that lock, could be another
    # writer's too).
    row = select(func.count(), literal(study_id), literal(TrialState.RUNNING, trials.c.state.type),
                 literal(dt.datetime.now(), trials.c.datetime_start.type)).where(trials.c.study_id == study_id)
    statement = insert(trials).from_select(["number", "study_id", "state", "datetime_start"], row)
    if conn.dialect.insert_returning:
        tid, number = conn.execute(statement.returning(trials.c.trial_id, trials.c.number)).one()
    else:
        tid = conn.execute(statement).lastrowid
        number = conn.execute(select(trials.c.number).where(trials.c.trial_id == tid)).scalar_one()
    rows = {m.TrialParamModel: [dict(trial_id=tid, param_name=name,
                                     param_value=template.distributions[name].to_internal_repr(value),
                                     distribution_json=distribution_to_json(template.distributions[name]))
                                for name, value in template.params.items()],
            m.TrialUserAttributeModel: [dict(trial_id=tid, key=k, value_json=json.dumps(v))
                                        for k, v in template.user_attrs.items()],
            m.TrialSystemAttributeModel: [dict(trial_id=tid, key=k, value_json=json.dumps(v))
                                          for k, v in template.system_attrs.items()]}
    for model, values in rows.items():
        if values:
            conn.execute(insert(model.__table__), values)
    # The beat's time is the database's own clock (the column's default), as Optuna's stale-trial check reads it.
    conn.execute(insert(m.TrialHeartbeatModel.__table__).values(trial_id=tid))
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
    from sqlalchemy import insert, select, update

    m, conn = _MODELS, _connection(session)
    trials, attrs = m.TrialModel.__table__, m.TrialUserAttributeModel.__table__
    # The trial's state first: an UPDATE of a RUNNING trial, so that the write lock comes before any read.
    done = conn.execute(update(trials).where(trials.c.trial_id == trial_id, trials.c.state == TrialState.RUNNING)
                        .values(state=state, datetime_complete=dt.datetime.now())).rowcount
    if done != 1:
        return False
    existing = dict(conn.execute(select(attrs.c.key, attrs.c.trial_user_attribute_id)
                                 .where(attrs.c.trial_id == trial_id)).all())
    new = [dict(trial_id=trial_id, key=k, value_json=json.dumps(v)) for k, v in user_attrs.items() if k not in existing]
    if new:
        conn.execute(insert(attrs), new)
    for key, v in user_attrs.items():
        if key in existing:
            conn.execute(update(attrs).where(attrs.c.trial_user_attribute_id == existing[key])
                         .values(value_json=json.dumps(v)))
    if value is not None and state == TrialState.COMPLETE:
        stored, kind = m.TrialValueModel.value_to_stored_repr(value)
        conn.execute(insert(m.TrialValueModel.__table__).values(trial_id=trial_id, objective=0, value=stored,
                                                                value_type=kind))
    return True


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
