"""The sweep's proposal cost as a study grows: seconds per `Sampling.propose` (the sampler and its one read of the
study's trials) at 30, 60 and 300 trials, with a stand-in objective (no kernel, no GPU).

    python docs/experiments/sampler_cost.py [SAMPLER] [SIZES] [DB_PATH]

SAMPLER is tpe (default) or random; SIZES a comma list (default 30,60,300). One study of an H100-sized search
space (RMSNorm bf16 4096x4096) in a fresh SQLite file (default: a temporary one) is filled through the sweep's
own path (`StudyBook`'s: propose until the space accepts a config, create the trial in one transaction, tell).
At size N: the mean of the 5 kept proposals made when the study held N-5 … N-1 trials, and per trial kept over
the same 5 trials, the proposals made (the rejected ones included) and their seconds, which is what the sweep's
"sampler" phase adds up.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import optuna

from normtune.kernels.config import Problem
from normtune.tuner.space import Space
from normtune.tuner.store.database import Store
from normtune.tuner.sweep.optuna_rows import create_running_trial, finish_trial
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
        per_trial: list[tuple[int, float]] = []  # (proposals, seconds) until each kept trial
        tried, spent = 0, 0.0
        while len(times) < max(sizes):
            t = time.perf_counter()
            values, record = sampling.propose(study, retry=tried > 0)
            times.append(time.perf_counter() - t)
            tried, spent = tried + 1, spent + times[-1]
            config = space.config(values)
            if space.why_not(config) is not None:
                times.pop()  # a rejected proposal never becomes a trial: not a size step
                continue
            per_trial.append((tried, spent))
            tried, spent = 0, 0.0
            template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=record["params"],
                                                 distributions=record["distributions"],
                                                 system_attrs=record["system_attrs"])
            trial_id, number = create_running_trial(storage, study._study_id, template)
            value = 10.0 + (hash(config.to_json()) % 1000) / 100  # the stand-in objective
            finish_trial(storage, study, trial_id, number, optuna.trial.TrialState.COMPLETE, value,
                         {"status": "ok"})
    for n in sizes:
        window = times[max(0, n - WINDOW):n]
        kept = per_trial[max(0, n - WINDOW):n]
        print(f"{kind}: {1000 * sum(window) / len(window):.1f} ms per proposal at {n} trials; per trial kept: "
              f"{sum(k[0] for k in kept) / len(kept):.1f} proposals, {1000 * sum(k[1] for k in kept) / len(kept):.1f} ms")


if __name__ == "__main__":
    main()
