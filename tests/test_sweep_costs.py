"""Where a sweep worker's wall clock goes, and the pipeline that keeps the measuring process busy.

In-process sweeps with a stand-in measuring process (no kernels run): it answers after a fixed time, like a GPU
that is busy while the worker does its own work, so the tests see whether the worker proposes the next trials
and stores the last result while a trial measures, and what it records about its time.
"""

from __future__ import annotations

import time

from sweep_support import check_studies
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import Problem
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import SweepOptions, costs_line, driver, study_name

PROBLEMS = [Problem("rms_norm", 40, 96, "bf16"), Problem("layer_norm", 24, 200, "bf16")]
INFO = DeviceInfo(name="cpu (triton interpreter)", key="interpret", compute_capability=None,
                  sm_count=INTERPRET_SM_COUNT, l2_bytes=0, memory_bytes=0, driver=None, cuda=None, torch="x",
                  triton="x", normtune="0", git_revision=None, host="test", python="3", interpret=True)
# Long enough for the worker to propose and create the next trial meanwhile, even on the two busy cores of a
# whole-suite run.
MEASURE_S = 0.15


class BusyMeasurer:
    """A measuring process that takes MEASURE_S per trial after `submit`, reporting its phases; it records, at
    each `collect`, how many trials the worker held (created, not yet stored) and whether the previous result
    had been stored by then."""

    log: list[dict] = []

    def __init__(self, *args, **kwargs):
        self.phases: dict = {}
        self._due = None

    def start(self):
        pass

    def submit(self, problem, config, best_us=None):
        self._due = time.perf_counter() + MEASURE_S
        BusyMeasurer.log.append({"event": "submit", "running": len(SWEEP[0].pending.running)})

    def ready(self):
        return time.perf_counter() >= self._due

    def collect(self, timeout_s):
        time.sleep(max(0.0, self._due - time.perf_counter()))
        BusyMeasurer.log.append({"event": "collect", "running": len(SWEEP[0].pending.running)})
        self.phases = {"inputs": 0.001, "gate": 0.01, "timing": MEASURE_S - 0.011}
        return MeasureResult(status="ok", median_us=10.0 + len(BusyMeasurer.log) % 7, reps=2, interpret=True)

    def interrupt(self):
        pass

    def close(self):
        pass


SWEEP: list = []


def test_the_next_trials_are_proposed_while_one_measures_and_the_costs_are_stored(tmp_path, monkeypatch):
    monkeypatch.setattr(driver, "MeasuringProcess", BusyMeasurer)
    BusyMeasurer.log = []
    url = f"sqlite:///{tmp_path / 'results.db'}"
    trials = 6
    opts = SweepOptions(gpu_key="interpret", problems=PROBLEMS, trials=trials, sampler="tpe", interpret=True,
                        compile_workers=0, heartbeat_interval=1, grace_period=5)
    with Store(url) as store:
        sweep = driver.Sweep(opts, store, INFO)
        SWEEP[:] = [sweep]
        summary = sweep.run()
    check_studies(url, [study_name("interpret", p, interpret=True) for p in PROBLEMS], trials)
    collects = [e["running"] for e in BusyMeasurer.log if e["event"] == "collect"]
    assert len(collects) == trials * len(PROBLEMS)
    # While a trial measured, the worker held more trials than that one: the next ones were proposed meanwhile.
    assert sum(n > 1 for n in collects) >= len(collects) - 2, collects
    costs = summary.costs
    assert costs["trials"] == trials * len(PROBLEMS)
    assert abs(costs["measuring_s"] - MEASURE_S * costs["trials"]) < 1e-6
    assert costs["database_s"] > 0 and costs["sampler_s"] >= 0 and costs["startup_s"] > 0
    assert set(costs["proposals"]) == {"kept", "rejected", "ahead"} and costs["proposals"]["kept"] <= costs["trials"]
    assert abs(costs["gpu_idle_s"] - (costs["wall_s"] - costs["startup_s"] - costs["measuring_s"])) < 1e-6
    with Store(url) as store:
        (worker,) = store.workers.states()
    assert worker.costs == costs  # stored with the run
    out = CliRunner().invoke(app, ["status", "--db", url, "--prefix", "normtune:interpret:"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert f"where its time went: {costs_line(costs)}" in text
    assert f"{costs['trials']} trials" in text and "sampler" in text and "database" in text


def test_the_closing_line_counts_the_samplers_proposals_kept_and_rejected():
    costs = {"wall_s": 10.0, "startup_s": 1.0, "trials": 5, "proposals": {"kept": 5, "rejected": 12}}
    assert "sampler proposals: 5 kept, 12 rejected by the space" in costs_line(costs)
    assert "sampler proposals" not in costs_line({**costs, "proposals": {"kept": 0, "rejected": 0}})


def test_a_proposal_considers_a_bounded_window_of_a_large_study():
    """Past CONSIDER finished trials a proposal reads the best BEST_KEPT, the most recent others and every
    unfinished trial, so its cost stops growing with the study; below it, every trial."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    from normtune.tuner.sweep.sampling import BEST_KEPT, CONSIDER, considered

    TS = optuna.trial.TrialState
    dist = {"x": CategoricalDistribution([1, 2, 3])}

    def trial(number, state, value=None):
        t = optuna.trial.create_trial(state=state, value=value, params={"x": 1}, distributions=dist)
        t.number = number
        return t

    small = [trial(i, TS.COMPLETE, float(i)) for i in range(CONSIDER)]
    assert considered(small) == small
    n = 3 * CONSIDER
    values = [float((7 * i) % n) for i in range(n)]  # the best ones spread over the whole study
    big = [trial(i, TS.COMPLETE if i % 5 else TS.FAIL, None if i % 5 == 0 else values[i]) for i in range(n)]
    big += [trial(n, TS.RUNNING), trial(n + 1, TS.RUNNING)]
    seen = considered(big)
    numbers = [t.number for t in seen]
    assert numbers == sorted(numbers) and len(seen) == CONSIDER + 2
    best = sorted((t for t in big if t.state == TS.COMPLETE), key=lambda t: t.value)[:BEST_KEPT]
    assert {t.number for t in best} <= set(numbers)
    assert {n, n + 1} <= set(numbers)  # unfinished trials: the constant liar sees every one
    recent = [t.number for t in big[:n] if t.number not in {b.number for b in best}][-(CONSIDER - BEST_KEPT):]
    assert set(recent) <= set(numbers)


def test_a_retry_after_a_rejected_proposal_reuses_the_read_and_samples_the_same():
    """`StudyBook` proposes again on the same study when the space rejects a config: the retry reuses the trials
    read and the relative search space (no new read of the study), and the samples are those fresh reads give."""
    import optuna

    from normtune.tuner.space import Space
    from normtune.tuner.sweep.sampling import Sampling

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    space = Space(Problem("rms_norm", 4096, 4096, "bf16"), 132)
    filler = Sampling("tpe", space, seed=3)
    scratch = optuna.create_study(sampler=filler.sampler)
    done = []
    while len(done) < 12:  # past TPE's start-up trials: the multivariate sample runs
        values, record = filler.propose(scratch)
        done.append(optuna.trial.create_trial(params=record["params"], distributions=record["distributions"],
                                              value=float(len(done) * 7 % 12)))
        scratch.add_trial(done[-1])

    def proposals(retry: bool):
        study = optuna.create_study()
        study.add_trials(done)
        reads = []
        original = study._get_trials
        study._get_trials = lambda *a, **k: (reads.append(1), original(*a, **k))[1]
        sampling = Sampling("tpe", space, seed=11)
        got = [sampling.propose(study, retry=retry and i > 0)[0] for i in range(6)]
        return got, len(reads)

    fresh, fresh_reads = proposals(retry=False)
    reused, reused_reads = proposals(retry=True)
    assert reused == fresh
    assert fresh_reads >= 6 and reused_reads == 1


def test_distinct_groups_decompose_as_optuna_does_and_the_samples_are_the_same():
    """`DistinctGroups` (TPE's group decomposition from the distinct knob sets only) gives Optuna's groups after
    every added trial, and a sampler using it proposes what one with Optuna's own proposes."""
    import random

    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.search_space.group_decomposed import _GroupDecomposedSearchSpace, _SearchSpaceGroup

    from normtune.tuner.space import Space
    from normtune.tuner.sweep.sampling import DistinctGroups, Sampling

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rng = random.Random(0)
    names = [f"k{i}" for i in range(9)]
    study = optuna.create_study()
    ours, theirs = DistinctGroups(_SearchSpaceGroup), _GroupDecomposedSearchSpace()
    for _ in range(40):
        used = rng.sample(names, rng.randint(1, 6))  # conditional knobs: each trial has some of them
        dists = {n: CategoricalDistribution([0, 1, 2]) for n in used}
        study.add_trial(optuna.trial.create_trial(params={n: rng.randint(0, 2) for n in used}, distributions=dists,
                                                  value=rng.random()))
        assert ours.calculate(study).search_spaces == theirs.calculate(study).search_spaces

    space = Space(Problem("rms_norm", 4096, 4096, "bf16"), 132)

    def proposals(keep_optunas: bool):
        sampling = Sampling("tpe", space, seed=5)
        assert isinstance(sampling.sampler._group_decomposed_search_space, DistinctGroups)
        if keep_optunas:
            sampling.sampler._group_decomposed_search_space = _GroupDecomposedSearchSpace()
        study = optuna.create_study(sampler=sampling.sampler)
        got = []
        for i in range(16):
            values, record = sampling.propose(study)
            got.append(values)
            study.add_trial(optuna.trial.create_trial(params=record["params"], distributions=record["distributions"],
                                                      value=float(i * 5 % 16)))
        return got

    assert proposals(keep_optunas=False) == proposals(keep_optunas=True)


def test_problems_take_turns_once_their_slots_get_sampled_trials(tmp_path, monkeypatch):
    """A problem's sampled trials alternate with the other problems', one each, so that the trials held ahead
    spread over the studies."""
    import sqlite3

    from sweep_support import instant_measuring_process

    three = PROBLEMS + [Problem("rms_norm", 16, 128, "bf16")]
    monkeypatch.setattr(driver, "MeasuringProcess", instant_measuring_process())
    opts = SweepOptions(gpu_key="interpret", problems=three, trials=40, interpret=True, compile_workers=0)
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with Store(url) as store:
        driver.Sweep(opts, store, INFO).run()
    check_studies(url, [study_name("interpret", p, True) for p in three], 40)
    rows = sqlite3.connect(tmp_path / "results.db").execute(
        "SELECT study_name, source FROM normtune_measurements ORDER BY id").fetchall()
    names = [study_name("interpret", p, True) for p in three]
    # The problems' sampled trials overlap in time: none has had all of its own before another's first.
    sampled = [n for n, source in rows if source != "seed"]
    assert set(sampled) == set(names), sampled
    first = {n: sampled.index(n) for n in names}
    last = {n: len(sampled) - 1 - sampled[::-1].index(n) for n in names}
    assert all(last[a] > first[b] for a in names for b in names), (first, last)
    # Once all have started, no problem gets two in a row while another still has some left.
    for i in range(max(first.values()) + 1, len(sampled)):
        if len(set(sampled[i:])) > 1:
            assert sampled[i] != sampled[i - 1], sampled
