"""The sweep's proposal cost as a study grows: seconds per `Sampling.propose` (the sampler and its one read of the
study's trials) at 30, 60 and 300 trials, with a stand-in objective (no kernel, no GPU).

    python docs/experiments/sampler_cost.py [SAMPLER] [SIZES] [DB_PATH]

SAMPLER is tpe (default) or random; SIZES a comma list (default 30,60,300). One study of an H100-sized search
space (RMSNorm bf16 4096x4096) in a fresh SQLite file (default: a temporary one) is filled through the sweep's
own path (propose, create the trial in one transaction, tell); the figure at size N is the mean of the 5
proposals made when the study held N-5 … N-1 trials.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import optuna

from normtune.kernels.config import Problem
from normtune.tuner.space import Space
from normtune.tuner.store import Store
from normtune.tuner.sweep.rows import create_running_trial, finish_trial
from normtune.tuner.sweep.sampling import Sampling

WINDOW = 5


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "tpe"
    sizes = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "30,60,300").split(",")]
    path = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp()) / "sampler.db"
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    problem = Problem("rms_norm", 4096, 4096, "bf16")
    space = Space(problem, 132)
    with Store(f"sqlite:///{path}") as store:
        storage = store.optuna_storage()
        sampling = Sampling(kind, space, seed=0)
        study = optuna.create_study(study_name="cost", storage=storage, sampler=sampling.sampler)
        times: list[float] = []
        while len(times) < max(sizes):
            t = time.perf_counter()
            values, record = sampling.propose(study)
            times.append(time.perf_counter() - t)
            config = space.config(values)
            if space.why_not(config) is not None:
                times.pop()  # a rejected proposal never becomes a trial: not a size step
                continue
            template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=record["params"],
                                                 distributions=record["distributions"],
                                                 system_attrs=record["system_attrs"])
            trial_id, number = create_running_trial(storage, study._study_id, template)
            value = 10.0 + (hash(config.to_json()) % 1000) / 100  # the stand-in objective
            finish_trial(storage, study, trial_id, number, optuna.trial.TrialState.COMPLETE, value,
                         {"status": "ok"})
    for n in sizes:
        window = times[max(0, n - WINDOW):n]
        print(f"{kind}: {1000 * sum(window) / len(window):.1f} ms per proposal at {n} trials")


if __name__ == "__main__":
    main()
