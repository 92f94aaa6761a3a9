"""Drop the Optuna studies no sweep can open any more, keeping every measurement.

A study is named after its problem's search space (`space_tag`): once the space grows (a new knob or value), a
sweep opens a new study and the old one is never resumed. Its trials (Optuna's params, attributes and values:
most of a long-lived results.db) then only duplicate what the normtune tables keep — each measured config with its
timings and provenance, which is all that emission, validation and reports read. Studies with a running trial or
an unmeasured slot held by a run are kept (a worker of an older normtune may still be using them).

Finding them only reads (`superseded_studies` works on a read-only store: `prune --dry-run` writes nothing, not
even Optuna's version rows); dropping them goes through Optuna's storage. Every database error, Optuna's
included, is one `StoreError` line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlalchemy import inspect, select, text

from normtune.kernels.config import ConfigError, Problem

from ..store.models import MeasurementModel, ProblemModel, StoreError, TrialClaimModel, problem_from_row
from ..sweep.options import space_tag

# Optuna's tables (and columns: `store.schema.OPTUNA_COLUMNS`) that finding the superseded studies reads.
_STUDY_TABLES = {"studies", "study_user_attributes", "trials"}


@dataclass(frozen=True)
class Superseded:
    name: str
    trials: int


def superseded_studies(store) -> list[Superseded]:
    """The studies of a search space that is no longer its problem's, with nothing running in them, by study id.
    Reads Optuna's tables straight (opening Optuna's storage would write its version rows)."""
    with store.session_scope() as session:
        if not _STUDY_TABLES <= set(inspect(session.connection()).get_table_names()):
            return []  # no sweep ever opened a study here (e.g. a database of bench runs only)
        problems = {row.id: problem_from_row(row) for row in session.scalars(select(ProblemModel))}
        by_study = dict(session.execute(select(MeasurementModel.study_name, MeasurementModel.problem_id)
                                        .where(MeasurementModel.study_name.is_not(None)).distinct()).all())
        held = {name for (name,) in session.execute(select(TrialClaimModel.study_name)
                                                    .where(TrialClaimModel.measured.is_(False)).distinct())}
        studies = session.execute(text("SELECT study_id, study_name FROM studies ORDER BY study_id")).all()
        attrs = dict(session.execute(text("SELECT study_id, value_json FROM study_user_attributes "
                                          "WHERE key = 'problem'")).all())
        # Optuna stores a trial's state as the TrialState member's name.
        trials = {sid: (n, running) for sid, n, running in session.execute(text(
            "SELECT study_id, COUNT(*), SUM(CASE WHEN state = 'RUNNING' THEN 1 ELSE 0 END) FROM trials "
            "GROUP BY study_id"))}
    out = []
    tags: dict[Problem, str] = {}
    for study_id, name in studies:
        problem = problems.get(by_study.get(name))
        if problem is None:
            problem = _recorded_problem(attrs.get(study_id))
        if problem is None or name in held or ":space-" not in name:
            continue
        tag = tags.setdefault(problem, space_tag(problem))
        if name.rsplit(":space-", 1)[1] == tag:
            continue
        n, running = trials.get(study_id, (0, 0))
        if running:
            continue
        out.append(Superseded(name, int(n)))
    return out


def _recorded_problem(value_json: str | None) -> Problem | None:
    """The problem a study's `problem` user attribute records, or None when it records none readable."""
    try:
        data = json.loads(value_json) if value_json is not None else None
        return Problem.from_dict(data) if isinstance(data, dict) else None
    except (ValueError, TypeError, KeyError, ConfigError):
        return None


def prune(store, studies: list[Superseded]) -> None:
    """Delete `studies` from Optuna's tables with their slot claims, then give the space back (SQLite)."""
    if not studies:
        return
    import optuna
    from sqlalchemy import delete
    from sqlalchemy.exc import SQLAlchemyError

    storage = store.optuna_storage()
    for study in studies:
        try:
            optuna.delete_study(study_name=study.name, storage=storage)
        except (optuna.exceptions.OptunaError, KeyError, SQLAlchemyError) as err:
            raise StoreError(f"--db {store.display_url}: cannot drop study {study.name} "
                             f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''})"
                             "; the file may be damaged: restore it from a copy") from None
        with store.session_scope() as session:
            session.execute(delete(TrialClaimModel).where(TrialClaimModel.study_name == study.name))
    store.vacuum()
