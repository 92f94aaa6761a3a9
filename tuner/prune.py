"""Drop the Optuna studies no sweep can open any more, keeping every measurement.

A study is named after its problem's search space (`space_tag`): once the space grows (a new knob or value), a
sweep opens a new study and the old one is never resumed. Its trials (Optuna's params, attributes and values:
most of a long-lived results.db) then only duplicate what the normtune tables keep — each measured config with its
timings and provenance, which is all that emission, validation and reports read. Studies with a running trial or
an unmeasured slot held by a run are kept (a worker of an older normtune may still be using them).
"""

from __future__ import annotations

from dataclasses import dataclass

from normtune.kernels.config import Problem

from .store_models import MeasurementModel, ProblemModel, TrialClaimModel, _problem
from .sweep.options import space_tag


@dataclass(frozen=True)
class Superseded:
    name: str
    trials: int


def superseded_studies(store) -> list[Superseded]:
    """The studies of a search space that is no longer its problem's, with nothing running in them."""
    import optuna
    from sqlalchemy import select

    storage = store.optuna_storage()
    with store.session_scope() as session:
        problems = {row.id: _problem(row) for row in session.scalars(select(ProblemModel))}
        by_study = dict(session.execute(select(MeasurementModel.study_name, MeasurementModel.problem_id)
                                        .where(MeasurementModel.study_name.is_not(None)).distinct()).all())
        held = {name for (name,) in session.execute(select(TrialClaimModel.study_name)
                                                    .where(TrialClaimModel.measured.is_(False)).distinct())}
    out = []
    tags: dict[Problem, str] = {}
    for summary in storage.get_all_studies():
        name = summary.study_name
        problem = problems.get(by_study.get(name))
        if problem is None and isinstance(summary.user_attrs.get("problem"), dict):
            problem = Problem.from_dict(summary.user_attrs["problem"])
        if problem is None or name in held or ":space-" not in name:
            continue
        tag = tags.setdefault(problem, space_tag(problem))
        if name.rsplit(":space-", 1)[1] == tag:
            continue
        trials = storage.get_all_trials(summary._study_id, deepcopy=False)
        if any(t.state == optuna.trial.TrialState.RUNNING for t in trials):
            continue
        out.append(Superseded(name, len(trials)))
    return out


def prune(store, studies: list[Superseded]) -> None:
    """Delete `studies` from Optuna's tables with their slot claims, then give the space back (SQLite)."""
    import optuna
    from sqlalchemy import delete

    storage = store.optuna_storage()
    for study in studies:
        optuna.delete_study(study_name=study.name, storage=storage)
        with store.session_scope() as session:
            session.execute(delete(TrialClaimModel).where(TrialClaimModel.study_name == study.name))
    if studies:
        store.vacuum()
