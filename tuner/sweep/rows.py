"""A sweep trial's Optuna rows written in one transaction each: created (params, attributes, first heartbeat)
and finished (attributes, value, state).

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
from typing import Any

log = logging.getLogger("normtune.sweep")


def _internals():
    try:
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        for name in ("StudyModel", "TrialModel", "TrialParamModel", "TrialUserAttributeModel",
                     "TrialSystemAttributeModel", "TrialHeartbeatModel"):
            getattr(models, name)
        from optuna.storages import RDBStorage

        for cls, name in ((models.TrialModel, "count_past_trials"), (RDBStorage, "_set_trial_attr_without_commit"),
                          (RDBStorage, "_set_trial_value_without_commit"), (RDBStorage, "check_trial_is_updatable")):
            getattr(cls, name)
        return models, _create_scoped_session
    except (ImportError, AttributeError):  # another Optuna layout: the public calls
        return None


_INTERNALS = _internals()


def _rdb(storage):
    from optuna.storages import RDBStorage

    return storage if isinstance(storage, RDBStorage) and _INTERNALS is not None else None


def create_running_trial(storage, study_id: int, template) -> tuple[int, int]:
    """(trial id, number) of a new RUNNING trial holding `template`'s params and attributes, with its first
    heartbeat, in one transaction."""
    rdb = _rdb(storage)
    if rdb is None:
        trial_id = storage.create_new_trial(study_id, template_trial=template)
        storage.record_heartbeat(trial_id)
        return trial_id, storage.get_trial_number_from_id(trial_id)
    from optuna.distributions import distribution_to_json
    from optuna.trial import TrialState

    models, scoped = _INTERNALS
    with scoped(rdb.scoped_session) as session:
        models.StudyModel.find_or_raise_by_id(study_id, session, for_update=True)  # numbers are per study
        trial = models.TrialModel(study_id=study_id, number=None, state=TrialState.RUNNING,
                                  datetime_start=dt.datetime.now())
        session.add(trial)
        session.flush()
        tid = trial.trial_id
        rows: list[Any] = [models.TrialParamModel(trial_id=tid, param_name=name,
                                                  param_value=template.distributions[name].to_internal_repr(value),
                                                  distribution_json=distribution_to_json(template.distributions[name]))
                           for name, value in template.params.items()]
        rows += [models.TrialUserAttributeModel(trial_id=tid, key=k, value_json=json.dumps(v))
                 for k, v in template.user_attrs.items()]
        rows += [models.TrialSystemAttributeModel(trial_id=tid, key=k, value_json=json.dumps(v))
                 for k, v in template.system_attrs.items()]
        rows.append(models.TrialHeartbeatModel(trial_id=tid))
        session.add_all(rows)
        trial.number = trial.count_past_trials(session)
        session.flush()
        return tid, trial.number


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
    from optuna.trial import TrialState

    models, scoped = _INTERNALS
    with scoped(rdb.scoped_session) as session:
        trial = models.TrialModel.find_or_raise_by_id(trial_id, session, for_update=True)
        rdb.check_trial_is_updatable(trial_id, trial.state)
        for key, v in user_attrs.items():
            rdb._set_trial_attr_without_commit(session, models.TrialUserAttributeModel, trial_id, key, v)
        if value is not None and state == TrialState.COMPLETE:
            rdb._set_trial_value_without_commit(session, trial, 0, value)
        trial.state = state
        trial.datetime_complete = dt.datetime.now()
