"""What a sweep is asked to do (`SweepOptions`), how its studies are named, and what it reports back."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command builds its options before it imports torch (the kernels, the harness)
    from normtune.kernels.config import BackwardConfig, Problem

    from ..measure.harness import Timing

SAMPLERS = ("tpe", "random", "grid", "local")  # local: TPE after a pattern search around the best (`sampling`)
# Trials every problem gets before any is searched deeper (the default config and its first neighbours).
FIRST_ROUND = 12
# Version of the seeds (`tuner/seeds.py`), stored on every study: a study seeded under an older version gets
# the seeds it lacks (`trials.py`). Raise it whenever what the seeds return changes; what each version changed
# is in docs/history/seed-versions.md.
SEED_VERSION = 17
MEASURED = ("ok", "incorrect", "compile_error", "out_of_resources", "timeout", "error")
# The objective as optuna-dashboard labels it.
METRIC_NAME = "backward µs"

def space_tag(problem: Problem) -> str:
    """A digest of the problem's search space (its knobs and their values). An Optuna study cannot change a
    parameter's choices, so a space that grew (a new knob or value) opens a new study; the measurements of the
    old one stay in the normtune tables, where emission finds them."""
    from ..space import Space  # the space imports the kernels' heuristics; options stay light to import

    domains = {k: [str(v) for v in values] for k, values in sorted(Space(problem, 0).domains().items())}
    return hashlib.sha1(json.dumps(domains, sort_keys=True).encode()).hexdigest()[:8]


def study_name(gpu_key: str, problem: Problem, interpret: bool = False, prefix: str = "normtune") -> str:
    """One study per (GPU, problem, search space), named so that any worker on any host finds the same one."""
    return f"{prefix}:{'interpret' if interpret else gpu_key}:{problem.key}:space-{space_tag(problem)}"


def check_problems(problems) -> None:
    """A sweep's problems must each have rows and columns to time (a 0-row problem would store trials that
    measured nothing), and there must be one."""
    if not problems:
        raise ValueError("--shapes: no problems to sweep; give at least one MxN shape")
    for p in problems:
        if p.M < 1 or p.N < 1:
            raise ValueError(f"--shapes {p.M}x{p.N}: a sweep times rows of columns; give M >= 1 and N >= 1")


@dataclass
class SweepOptions:
    """What a sweep is asked to do: the whole sweep as `run` takes it, and each worker's share of it.

    `gpu_key` is the key results are labelled with, or "auto" (the detected device's; `run` resolves it).
    `problems` may be a function returning them: `run` calls it once its helper processes have started, so that
    whatever it imports (torch, the kernels) overlaps their start-up. `storage` is the database's SQLAlchemy URL
    and `devices` the GPUs of this host to run one worker each on (`run`'s; a worker's own is `device`)."""
    gpu_key: str
    problems: list[Problem]
    trials: int = 40
    time_budget_s: float | None = None
    sampler: str = "tpe"
    device: int = 0  # CUDA index of this worker's GPU
    worker_index: int = 0  # this worker's place among `workers` on the host: where it starts in the problem list
    workers: int = 1
    interpret: bool = False
    compile_workers: int | None = None  # compile-ahead processes; None: `compiling.default_compile_workers`
    lookahead: int | None = None  # trials proposed (and compiling) ahead of the one measuring; None: `held_ahead`
    trial_timeout_s: float = 180.0
    seed: int = 0
    timing: Timing | None = None  # repetitions per trial on a GPU; None: TIMING["sweep"] (the interpreter's own)
    heartbeat_interval: int = 20
    grace_period: int = 60
    study_prefix: str = "normtune"  # validation sweeps use their own studies
    source: str = "sweep"  # measurement source recorded in the store
    extra_seeds: dict = field(default_factory=dict)  # problem key -> [config dict] enqueued with the seeds
    # problem key -> (first slot, [config dict]): those configs in those slots of its study, ahead of its seeds
    # and its sampler (a tune's transfers)
    slot_seeds: dict = field(default_factory=dict)
    # problem key -> the trials its study ends with, where it differs from `trials` (at most `trials`): one sweep
    # takes a tune's round, whose problems end at different counts
    targets: dict = field(default_factory=dict)
    seeded: bool = True  # False: only the sampler proposes configs (validate's independent reference)
    seed_limit: int | None = None  # at most this many seeds per study (the sampler proposes the rest); None: all
    propose_ahead: bool | None = None  # TPE's proposals made ahead in a process of their own; None: on a GPU
    storage: str | None = None  # SQLAlchemy URL of the results database (`run` opens it)
    devices: list[int] | None = None  # one worker per GPU of this host; None: `device` alone

    def target_of(self, key: str) -> int:
        """The trials the study of the problem `key` ends with."""
        return min(self.trials, self.targets.get(key, self.trials))

    @property
    def proposes_ahead(self) -> bool:
        """Whether the worker's TPE proposals come from a `proposer.Proposer` (on a GPU, where proposing in the
        worker's thread would keep the GPU waiting; the interpreter's measurements take far longer)."""
        on = (not self.interpret) if self.propose_ahead is None else self.propose_ahead
        return on and self.sampler in ("tpe", "local")

    def held_ahead(self, processes: int) -> int:
        """Trials a worker holds ahead of the one measuring (claimed, created, compiling): `lookahead` when
        given, else two per process of its compile pool (`processes`, 0 without one: one compiling and one
        queued, since a sampled trial's compile starts only at its claim and takes many measurements' time),
        within an eighth of the worker's share of the sweep's slots, so that it never holds what the other
        workers would claim; at least 2."""
        if self.lookahead is not None:
            return max(2, self.lookahead)
        share = len(self.problems) * self.trials // max(1, self.workers)
        return max(2, min(2 * processes, share // 8))

    def __post_init__(self):
        if not callable(self.problems):
            check_problems(self.problems)
        if not 0 <= self.seed < 2**32:  # what numpy's generators (Optuna's samplers) accept
            raise ValueError(f"--seed {self.seed}: give an integer from 0 to {2**32 - 1}")
        if self.device < 0:
            raise ValueError(f"--device {self.device}: give a CUDA device index, 0 or more")
        if self.devices is not None:
            if not self.devices or len(set(self.devices)) != len(self.devices) or min(self.devices) < 0:
                raise ValueError(f"--devices {','.join(map(str, self.devices))}: use distinct non-negative "
                                 "indices, e.g. 0,1")
            if self.interpret:
                raise ValueError("--devices needs GPUs; --interpret runs one worker on CPU")
        if self.compile_workers is not None and self.compile_workers < 0:
            raise ValueError(f"--compile-workers {self.compile_workers}: give 0 (compile in the measuring process) "
                             "or more")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"--sampler {self.sampler!r}: use one of {', '.join(SAMPLERS)}")
        if self.trials < 1:
            raise ValueError(f"--trials {self.trials}: need at least 1 trial per problem")
        if self.time_budget_s is not None and not 0 < self.time_budget_s < float("inf"):  # NaN too
            raise ValueError(f"--time-budget {self.time_budget_s}: give a positive number of seconds (or leave it "
                             "out for no budget)")
        for option, value in (("--trial-timeout", self.trial_timeout_s), ("--heartbeat-interval",
                                                                         self.heartbeat_interval),
                              ("--grace-period", self.grace_period)):
            if not value > 0:
                raise ValueError(f"{option} {value}: give a positive number of seconds")
        if self.grace_period <= self.heartbeat_interval:
            raise ValueError(f"--grace-period {self.grace_period} must exceed --heartbeat-interval "
                             f"{self.heartbeat_interval}: a live worker's trial would be failed as stale")


@dataclass
class ProblemSummary:
    problem: Problem
    study: str
    trials: int = 0
    measured_now: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    best_us: float | None = None
    best_config: BackwardConfig | None = None
    default_us: float | None = None


@dataclass
class SweepSummary:
    problems: list[ProblemSummary] = field(default_factory=list)
    wall_s: float = 0.0
    measure_s: float = 0.0
    compile_s: float = 0.0
    compile_wait_s: float = 0.0
    stopped: str | None = None  # "time budget", "interrupted", or None when everything finished
    signal: str | None = None  # "SIGINT" / "SIGTERM" when a signal stopped it
    remaining: list[str] = field(default_factory=list)  # "problem key: N trials" still to measure
    costs: dict = field(default_factory=dict)  # where the wall clock went (`costs.Costs.to_dict`)

    @property
    def exit_code(self) -> int:
        """128 + the signal that stopped the sweep (130 SIGINT, 143 SIGTERM), else 0."""
        return {"SIGINT": 130, "SIGTERM": 143}.get(self.signal or "", 0)



def summary_json(summary: SweepSummary) -> str:
    return json.dumps({
        "wall_s": summary.wall_s, "measure_s": summary.measure_s, "compile_s": summary.compile_s,
        "compile_wait_s": summary.compile_wait_s, "stopped": summary.stopped, "signal": summary.signal,
        "remaining": summary.remaining, "costs": summary.costs,
        "problems": [{"problem": ps.problem.key, "study": ps.study, "trials": ps.trials,
                      "measured_now": ps.measured_now, "failures": ps.failures, "best_us": ps.best_us,
                      "default_us": ps.default_us,
                      "best_config": ps.best_config.to_dict() if ps.best_config else None}
                     for ps in summary.problems]}, indent=1)
