"""The "local" sampler (`tuner/sweep/sampling.py`): while the study's best config has a one-step neighbour
(`seeds.neighbours`) that no trial holds, that neighbour is the next proposal, recorded as TPE's own proposals are;
once the best's neighbourhood is measured, or after a rejected proposal, TPE proposes."""

from __future__ import annotations

import optuna

from normtune.kernels.config import Problem, default_config
from normtune.tuner.seeds import neighbours
from normtune.tuner.space import Space
from normtune.tuner.sweep.options import SweepOptions
from normtune.tuner.sweep.sampling import Sampling, kernel_2_moves_first, trial_config

PROBLEM = Problem("rms_norm", 4096, 4096, "bf16")


def _study(space, sampling):
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.create_study(sampler=sampling.sampler)


def _tell(study, sampling, config, value, kernel_2_us=None):
    record = sampling._template(config)
    attrs = {} if kernel_2_us is None else {"kernel_2_us": kernel_2_us}
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=value,
                                              params=record["params"], distributions=record["distributions"],
                                              user_attrs=attrs))


def _around_the_default():
    """(space, the local sampler, its study, the default config, its one-step neighbours in knob order)."""
    space = Space(PROBLEM, 132)
    sampling = Sampling("local", space, seed=0)
    base = space.canonical(default_config(PROBLEM, space.limits))
    return space, sampling, _study(space, sampling), base, neighbours(space, base)


def test_the_best_configs_unmeasured_neighbours_come_first_in_knob_order():
    space, sampling, study, base, around = _around_the_default()
    assert len(around) >= 4
    _tell(study, sampling, base, 10.0)
    _tell(study, sampling, around[0], 12.0)  # measured, worse: the best stays the default
    params, record = sampling.propose(study)
    assert space.config(params) == around[1]
    assert trial_config(space, record["params"]) == around[1]  # the recorded params rebuild the same config
    # a better neighbour moves the search: the next proposal is one of its own neighbours, never a measured one
    _tell(study, sampling, around[1], 8.0)
    params, _ = sampling.propose(study)
    proposed = space.config(params)
    assert proposed in neighbours(space, around[1])
    assert proposed not in (base, around[0], around[1])


def test_a_best_config_spending_a_tenth_of_its_time_in_kernel_2_tries_kernel_2_moves_first_then_alternates():
    space, sampling, study, base, around = _around_the_default()
    reductions = [c for c in around if c.kernel_1 == base.kernel_1 and c != base]
    others = [c for c in around if c.kernel_1 != base.kernel_1]
    assert len(reductions) >= 2 and len(others) >= 2 and around[0] in others  # knob order: kernel_1's first
    assert kernel_2_moves_first(base, around)[:4] == [reductions[0], others[0], reductions[1], others[1]]
    assert sorted(map(str, kernel_2_moves_first(base, around))) == sorted(str(c) for c in around if c != base)
    _tell(study, sampling, base, 10.0, kernel_2_us=1.0)  # kernel_2 is a tenth of the time
    assert space.config(sampling.propose(study)[0]) == reductions[0]
    _tell(study, sampling, reductions[0], 11.0, kernel_2_us=2.0)
    assert space.config(sampling.propose(study)[0]) == others[0]


def test_below_a_tenth_in_kernel_2_or_without_its_time_the_moves_keep_knob_order():
    for kernel_2_us in (0.9, None):
        space, sampling, study, base, around = _around_the_default()
        _tell(study, sampling, base, 10.0, kernel_2_us=kernel_2_us)
        assert space.config(sampling.propose(study)[0]) == around[0]


def test_proposals_made_ahead_count_as_held():
    space, sampling, study, base, around = _around_the_default()
    _tell(study, sampling, base, 10.0)
    record = sampling._template(around[0])
    liar = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=record["params"],
                                     distributions=record["distributions"])
    params, _ = sampling.propose(study, liars=(liar,))
    assert space.config(params) == around[1]


def test_a_measured_neighbourhood_or_a_retry_goes_to_tpe():
    space = Space(PROBLEM, 132)
    sampling = Sampling("local", space, seed=0)
    study = _study(space, sampling)
    base = space.canonical(default_config(PROBLEM, space.limits))
    _tell(study, sampling, base, 1.0)
    for i, config in enumerate(neighbours(space, base)):
        _tell(study, sampling, config, 2.0 + i)
    assert sampling._unmeasured_neighbour(_read(study)) is None
    params, record = sampling.propose(study)  # TPE's proposal: a config of the space's domains
    assert set(record["params"]) <= set(space.domains())
    retried, _ = sampling.propose(study, retry=True)  # a retry never repeats the local proposal
    assert set(retried) == set(space.params(space.config(retried)))


def _read(study):
    from normtune.tuner.sweep.sampling import _OneRead

    return _OneRead(study)


def test_local_is_a_sampler_the_options_accept_and_it_proposes_ahead():
    import pytest

    assert SweepOptions(gpu_key="h100", problems=[PROBLEM], trials=4, sampler="local", interpret=False).proposes_ahead
    with pytest.raises(ValueError, match="--sampler 'nearby'"):
        SweepOptions(gpu_key="h100", problems=[PROBLEM], trials=4, sampler="nearby")


def _tune_sweeps(monkeypatch, **kwargs) -> SweepOptions:
    """The options a tune's `sweeping.sweep` hands the sweep engine (its `run` stood in for)."""
    from types import SimpleNamespace

    import normtune.tuner.sweep as engine
    from normtune.tuner.tune import sweeping

    handed = []
    monkeypatch.setattr(engine, "run", lambda opts, **kw: handed.append(opts) or SimpleNamespace(
        exit_code=0, stopped=None, signal=None))
    ctx = SimpleNamespace(plan=SimpleNamespace(gpu_key="h200", interpret=False), compile_workers=0, device=0,
                          devices=None, store=SimpleNamespace(url="sqlite:///tune.db"), heartbeats=(20, 60),
                          on_sweep_event=None, helpers=None)
    sweeping.sweep(ctx, [PROBLEM], 22, seconds=None, prefix="normtune-tune-x", **kwargs)
    return handed[0]


def test_the_tunes_fitting_sweeps_search_locally_past_the_first_rounds_seeds(monkeypatch):
    from normtune.tuner.sweep.options import FIRST_ROUND
    from normtune.tuner.sweep.trials import seed_configs

    space = Space(PROBLEM, 132)
    fit = _tune_sweeps(monkeypatch)
    assert fit.sampler == "local" and len(space.seeds()) > FIRST_ROUND
    assert seed_configs(fit, PROBLEM, space) == space.seeds()[:FIRST_ROUND]  # the local sampler takes the rest
    warm = neighbours(space, space.seeds()[-1])[-1]
    warmed = _tune_sweeps(monkeypatch, extra_seeds={PROBLEM.key: [warm.to_dict()]})
    assert seed_configs(warmed, PROBLEM, space) == [space.canonical(warm)] + space.seeds()[:FIRST_ROUND - 1]
    reference = _tune_sweeps(monkeypatch, seeded=False)
    assert reference.sampler == "tpe" and seed_configs(reference, PROBLEM, space) == []
    plain_sweep = SweepOptions(gpu_key="h200", problems=[PROBLEM], trials=40, sampler="local")
    assert seed_configs(plain_sweep, PROBLEM, space) == space.seeds()  # `normtune sweep` keeps every seed
