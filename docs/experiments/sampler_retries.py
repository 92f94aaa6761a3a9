"""What a rejected TPE proposal costs, and whether the way it is retried changes what the search finds: the sweep's
proposal path (`Sampling.propose` until the space accepts a config, the trial created, then told) with the
sweep's retries (`tuner/sweep/retries.py`: the estimators built once per proposal, and ranked candidates past
DRAWS_BEFORE_RANKED draws) against Optuna's own (every retry rebuilds and draws again), on the same problems,
seeds and objective.

    python docs/experiments/sampler_retries.py [TRIALS] [PROBLEMS]

TRIALS per study (default 60); PROBLEMS the first N RMSNorm seed shapes, bf16, in an H100-sized space (default 8).
Each study starts as a sweep's does, with up to half its trials from the space's seeds (the default and its
neighbours), then the sampler's. The objective is a stand-in with structure to learn: a sum over the knobs of a
weight per (knob, value), drawn once per problem from a fixed seed, so that TPE's choices matter (and TPE
converges on the knobs' best values, which the space often rejects together). Per variant it prints the
proposals made per sampled trial (the rejected ones included), the sampler's milliseconds per sampled trial,
and the search's quality: the mean over the problems of the best value found and of the last 20 trials'
median, each relative to the best value either variant found on that problem (1.00 is the best).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna

from normtune.kernels.config import Problem
from normtune.tuner.shapes import SEED
from normtune.tuner.space import Space
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import retries as R
from normtune.tuner.sweep import sampling as S
from normtune.tuner.sweep.optuna_rows import create_running_trial, finish_trial


def objective(problem: Problem, params: dict) -> float:
    """A sum of one weight per (knob, value), the weights drawn from the problem's key."""
    total = 10.0
    for key, value in sorted(params.items()):
        digest = hashlib.sha256(f"{problem.key}|{key}|{value!r}".encode()).digest()
        total += random.Random(digest).uniform(0.0, 3.0)
    return total


def fill(problem: Problem, trials: int, path: Path, ours: bool) -> tuple[list[float], int, float, int]:
    """(values in trial order, proposals made, sampler seconds, sampled trials) of one study of `trials` trials:
    up to half of them the space's seeds, as a sweep's first slots, then the sampler's."""
    space = Space(problem, 132)
    attach = R.Retries.attach
    if not ours:
        R.Retries.attach = classmethod(lambda cls, sampler: None)
    try:
        sampling = S.Sampling("tpe", space, seed=0)
    finally:
        R.Retries.attach = attach
    with Store(f"sqlite:///{path}") as store:
        storage = store.optuna_storage()
        study = optuna.create_study(study_name=problem.key, storage=storage, sampler=sampling.sampler)
        values: list[float] = []
        for seed in space.seeds()[:trials // 2]:  # the sweep's first slots: the default and its neighbours
            template = sampling.seed_trial(seed)
            if template is None:
                continue
            trial_id, number, _ = create_running_trial(storage, study._study_id, template)
            values.append(objective(problem, template.params))
            finish_trial(storage, study, trial_id, number, optuna.trial.TrialState.COMPLETE, values[-1],
                         {"status": "ok"})
        seeded = len(values)
        proposals, spent, retry = 0, 0.0, False
        while len(values) < trials:
            t = time.perf_counter()
            params, record = sampling.propose(study, retry=retry)
            config = space.config(params)
            spent += time.perf_counter() - t
            proposals += 1
            retry = space.why_not(config) is not None
            if retry:
                continue
            template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=record["params"],
                                                 distributions=record["distributions"],
                                                 system_attrs=record["system_attrs"])
            trial_id, number, _ = create_running_trial(storage, study._study_id, template)
            values.append(objective(problem, record["params"]))
            finish_trial(storage, study, trial_id, number, optuna.trial.TrialState.COMPLETE, values[-1],
                         {"status": "ok"})
    return values, proposals, spent, trials - seeded


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    problems = [Problem("rms_norm", M, N, "bf16") for M, N in SEED[:count]]
    folder = Path(tempfile.mkdtemp())
    runs = {}
    for ours in (False, True):
        runs[ours] = [fill(p, trials, folder / f"{i}-{ours}.db", ours) for i, p in enumerate(problems)]
    for ours, label in ((False, "Optuna's retries"), (True, "the sweep's retries")):
        rows = runs[ours]
        kept = sum(r[3] for r in rows)
        best = [min(r[0]) / min(min(runs[False][i][0]), min(runs[True][i][0])) for i, r in enumerate(rows)]
        late = [statistics.median(r[0][-20:]) / min(min(runs[False][i][0]), min(runs[True][i][0]))
                for i, r in enumerate(rows)]
        print(f"{label}: {kept} sampled trials, {sum(r[1] for r in rows) / kept:.2f} proposals and "
              f"{1000 * sum(r[2] for r in rows) / kept:.1f} ms of sampler per sampled trial; best found "
              f"{statistics.mean(best):.3f}, last 20 trials' median {statistics.mean(late):.3f} (x the best found)")


if __name__ == "__main__":
    main()
