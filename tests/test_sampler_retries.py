"""A proposal the space rejects is retried cheaply (`tuner/sweep/retries.py`): a retry draws again from the
estimators the proposal built (the same draws rebuilding gives), and past DRAWS_BEFORE_RANKED draws it moves one
knob group at a time to the next best candidate of its last draw; a fresh proposal builds afresh."""

from __future__ import annotations

import optuna
import pytest

from normtune.kernels.config import Problem
from normtune.tuner.space import Space
from normtune.tuner.sweep import retries as R
from normtune.tuner.sweep.sampling import Sampling

PROBLEM = Problem("rms_norm", 4096, 4096, "bf16")


def _filled(seed: int = 3, plain: bool = False):
    """A TPE study past its random start-up: 12 trials of valid configs, told with a stand-in objective; `plain`:
    its sampler retries as Optuna alone would."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    space = Space(PROBLEM, 132)
    attach = R.Retries.attach
    if plain:
        R.Retries.attach = classmethod(lambda cls, sampler: None)
    try:
        sampling = Sampling("tpe", space, seed=seed)
    finally:
        R.Retries.attach = attach
    study = optuna.create_study(sampler=sampling.sampler)
    retry = False
    while len(study.trials) < 12:
        params, record = sampling.propose(study, retry=retry)
        retry = space.why_not(space.config(params)) is not None
        if not retry:
            value = 10.0 + sum(len(repr(v)) % 7 for v in record["params"].values())
            study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=value,
                                                      params=record["params"],
                                                      distributions=record["distributions"]))
    return space, sampling, study


@pytest.fixture
def counted(monkeypatch):
    def count(sampling) -> list:
        builds = []
        retries = sampling._retries
        inner = retries._build
        monkeypatch.setattr(retries, "_build", lambda *a, **k: builds.append(1) or inner(*a, **k))
        return builds
    return count


def test_retries_draw_what_rebuilding_draws_and_build_nothing(counted):
    space, sampling, study = _filled()
    _, plain, plain_study = _filled(plain=True)
    assert isinstance(sampling._retries, R.Retries) and plain._retries is None
    builds = counted(sampling)
    assert sampling.propose(study)[0] == plain.propose(plain_study)[0]
    fresh = len(builds)
    assert fresh >= 4  # a fresh proposal builds TPE's estimators, two per knob group
    for _ in range(R.DRAWS_BEFORE_RANKED):
        assert sampling.propose(study, retry=True)[0] == plain.propose(plain_study, retry=True)[0]
    # Each estimator was built once: a retry builds only for knobs its own draws newly reach (another strategy's)
    assert len(builds) == len(sampling._retries._built) < fresh * (1 + R.DRAWS_BEFORE_RANKED) / 4
    builds.clear()
    sampling.propose(study)  # a fresh proposal reads the trials again and builds afresh
    assert len(builds) >= 4


def test_past_the_draws_a_retry_moves_one_group_to_its_next_candidate(counted):
    space, sampling, study = _filled()
    retries = sampling._retries
    builds = counted(sampling)
    sampling.propose(study)
    for _ in range(R.DRAWS_BEFORE_RANKED):
        last, _ = sampling.propose(study, retry=True)
    seen = [tuple(sorted(last.items()))]  # the last draw, whose candidates the next retries take
    for _ in range(6):
        before = dict(retries._chosen)
        builds.clear()
        again, _ = sampling.propose(study, retry=True)
        assert retries.ranked
        moved = [key for key in before if retries._chosen[key] != before[key]]
        assert len(moved) <= 1 and len(builds) <= 2  # one group moved; built only if it drew afresh
        seen.append(tuple(sorted(again.items())))
        assert space.config(again) is not None
    # Moves to candidates that differ only in knobs the config does not use give the same config again; the
    # retries still move through the candidates.
    assert len(set(seen)) >= 4


def test_past_the_draws_a_proposal_whose_candidates_are_used_up_draws_afresh():
    space, sampling, study = _filled()
    sampling.propose(study)
    for _ in range(R.DRAWS_BEFORE_RANKED):
        sampling.propose(study, retry=True)
    retries = sampling._retries
    for key in list(retries._draws):
        retries._queue(key).clear()  # every group's candidates given
    again, _ = sampling.propose(study, retry=True)
    assert sampling._retries.ranked and space.config(again) is not None
    assert retries._queue(retries._target)  # the group in turn drew afresh: it has candidates again


def test_only_tpe_samplers_get_these_retries():
    assert Sampling("random", Space(PROBLEM, 132), seed=0)._retries is None
    assert R.Retries.attach(optuna.samplers.RandomSampler()) is None
