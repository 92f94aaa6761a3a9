"""A sweep trial's Optuna rows written in one transaction each: created (params, attributes, first heartbeat,
and the claimed slot it fills, through `after`) and finished (attributes, value, state), the latter also within
the caller's own transaction on the same database (`finish_trial_in`: the store's, which records the
measurement, so that a trial is measured and told at once).

Optuna's public calls write a created trial's params one by one, each with two queries (the trial, and the
study's earlier distribution of that param to check compatibility), and a told trial's attributes in a
transaction each: most of a sweep worker's time outside measuring. The sweep's distributions come from one
search space per study (its name carries the space's digest), so the compatibility check can never fail; the
rows written here are exactly those `RDBStorage.create_new_trial(template_trial=…)` + `record_heartbeat` and
`set_trial_user_attr` + `Study.tell` write (the samplers the sweep uses do nothing after a trial). Where Optuna's
RDB internals differ from what this expects, the public calls are used instead.
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
        from optuna.storages._rdb.storage import _create_scoped_session

        for name in ("StudyModel", "TrialModel", "TrialParamModel", "TrialUserAttributeModel",
                     "TrialSystemAttributeModel", "TrialHeartbeatModel"):
            getattr(models, name)
        from optuna.storages import RDBStorage

        for cls, name in ((models.TrialModel, "count_past_trials"), (RDBStorage, "_set_trial_value_without_commit"),
                          (RDBStorage, "check_trial_is_updatable")):
            getattr(cls, name)
        columns = models.TrialUserAttributeModel.__table__.c
        for name in ("trial_user_attribute_id", "trial_id", "key", "value_json"):
            getattr(columns, name)
        return models, _create_scoped_session
    except (ImportError, AttributeError):  # another Optuna layout: the public calls
        return None


_INTERNALS = _internals()


def _rdb(storage):
    from optuna.storages import RDBStorage

    return storage if isinstance(storage, RDBStorage) and _INTERNALS is not None else None


def create_running_trial(storage, study_id: int, template,
                         after: Callable[[Any, int], None] | None = None) -> tuple[int, int, bool]:
    """(trial id, number, whether `after` ran) of a new RUNNING trial holding `template`'s params and attributes,
    with its first heartbeat, in one transaction; `after(session, number)` writes more in that transaction (it
    does not run where Optuna's public calls are used)."""
    rdb = _rdb(storage)
    if rdb is None:
        trial_id = storage.create_new_trial(study_id, template_trial=template)
        storage.record_heartbeat(trial_id)
        return trial_id, storage.get_trial_number_from_id(trial_id), False
    from optuna.distributions import distribution_to_json
    from optuna.trial import TrialState
    from sqlalchemy import insert

    models, scoped = _INTERNALS
    with scoped(rdb.scoped_session) as session:
        models.StudyModel.find_or_raise_by_id(study_id, session, for_update=True)  # numbers are per study
        trial = models.TrialModel(study_id=study_id, number=None, state=TrialState.RUNNING,
                                  datetime_start=dt.datetime.now())
        session.add(trial)
        session.flush()
        tid = trial.trial_id
        # The trial's own rows as one multi-row insert per table (the ORM would send one statement per row).
        rows = {models.TrialParamModel: [
                    dict(trial_id=tid, param_name=name,
                         param_value=template.distributions[name].to_internal_repr(value),
                         distribution_json=distribution_to_json(template.distributions[name]))
                    for name, value in template.params.items()],
                models.TrialUserAttributeModel: [dict(trial_id=tid, key=k, value_json=json.dumps(v))
                                                 for k, v in template.user_attrs.items()],
                models.TrialSystemAttributeModel: [dict(trial_id=tid, key=k, value_json=json.dumps(v))
                                                   for k, v in template.system_attrs.items()]}
        for model, values in rows.items():
            if values:
                session.execute(insert(model.__table__), values)
        session.execute(insert(models.TrialHeartbeatModel.__table__).values(trial_id=tid))
        trial.number = trial.count_past_trials(session)
        session.flush()
        if after is not None:
            after(session, trial.number)
        return tid, trial.number, after is not None


def finish_trial(storage, study, trial_id: int, number: int, state, value: float | None,
                 user_attrs: dict[str, Any]) -> None:
    """Set `user_attrs` and finish the trial (COMPLETE with `value`, or FAIL/PRUNED) in one transaction. Raises
    Optuna's UpdateFinishedTrialError when the trial was finished meanwhile (e.g. failed as stale)."""
    rdb = _rdb(storage)
    if rdb is None:
        for key, v in user_attrs.items():
            storage.set_trial_user_attr(trial_id, key, v)
        study.tell(number, value, state=state) if value is not None else study.tell(number, state=state)
        return
    models, scoped = _INTERNALS
    with scoped(rdb.scoped_session) as session:
        trial = models.TrialModel.find_or_raise_by_id(trial_id, session, for_update=True)
        rdb.check_trial_is_updatable(trial_id, trial.state)
        _finish(rdb, session, trial, state, value, user_attrs)


def finish_trial_in(session, storage, trial_id: int, state, value: float | None,
                    user_attrs: dict[str, Any]) -> bool | None:
    """`finish_trial` within the caller's transaction `session` (any session on the study's database): True when
    finished, False when it was finished already (left as it is), None where Optuna's internals are not the
    expected ones (nothing written: the caller finishes it with `finish_trial`)."""
    rdb = _rdb(storage)
    if rdb is None:
        return None
    models, _ = _INTERNALS
    trial = models.TrialModel.find_or_raise_by_id(trial_id, session, for_update=True)
    if trial.state.is_finished():
        return False
    _finish(rdb, session, trial, state, value, user_attrs)
    return True


def _finish(rdb, session, trial, state, value: float | None, user_attrs: dict[str, Any]) -> None:
    from optuna.trial import TrialState

    from sqlalchemy import insert, select, update

    models, _ = _INTERNALS
    table = models.TrialUserAttributeModel.__table__
    # One read of the trial's attribute keys, then one multi-row insert (Optuna reads the trial once per key).
    existing = dict(session.execute(select(table.c.key, table.c.trial_user_attribute_id)
                                    .where(table.c.trial_id == trial.trial_id)).all())
    new = [dict(trial_id=trial.trial_id, key=k, value_json=json.dumps(v)) for k, v in user_attrs.items()
           if k not in existing]
    if new:
        session.execute(insert(table), new)
    for key, v in user_attrs.items():
        if key in existing:
            session.execute(update(table).where(table.c.trial_user_attribute_id == existing[key])
                            .values(value_json=json.dumps(v)))
    if value is not None and state == TrialState.COMPLETE:
        rdb._set_trial_value_without_commit(session, trial, 0, value)
    trial.state = state
    trial.datetime_complete = dt.datetime.now()
