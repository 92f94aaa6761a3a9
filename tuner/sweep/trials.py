"""One problem's Optuna study as the sweep uses it: opened once per worker, trials created for claimed slots,
told from measurements, repaired after a dead worker.

Every trial exists because a worker holds one of the study's slots (`Store.claim_slot`): slot k below the
number of seeds gets seed k (created RUNNING with its params, never queued as WAITING; a study resumed under a
newer SEED_VERSION gets the seeds it lacks after its claimed slots), a slot the sweep names in `slot_seeds` gets
the config it names there (source "transfer"), the others get the
sampler's next config that the space accepts: TPE and random proposals are sampled before any trial exists
(`Sampling.propose`), so a config the space's constraints reject never becomes a trial (the grid sampler asks a
live trial; one it rejects is told PRUNED with `status=invalid` and the reason in `rejected`). Trials abandoned
by an interrupt are PRUNED with `status=abandoned` and their slot is given back.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from dataclasses import dataclass
from typing import Callable

from normtune.kernels.config import BackwardConfig, Problem, default_config

from ..space import Space
from .costs import Costs
from . import optuna_rows as rows
from .optuna_rows import create_running_trial, finish_trial, finish_trial_in
from .options import METRIC_NAME, SEED_VERSION, ProblemSummary, SweepOptions, study_name
from .sampling import Sampling

log = logging.getLogger("normtune.sweep")
# Invalid configs asked in a row before a problem's space counts as exhausted.
INVALID_STREAK_LIMIT = 500


def _gpu_limits(device: int):
    """The limits of GPU `device` (`kernels.limits.DeviceLimits`): the space offers only what it has."""
    import torch

    from normtune.kernels.device import device_limits

    return device_limits(torch.device("cuda", device)) if torch.cuda.is_available() else None


@dataclass
class Prepared:
    """A trial before it exists: the template it is created from, its config, source, whether the config is the
    sampler's, and the proposer's proposal it came from (told once the trial exists)."""
    template: object  # optuna.trial.FrozenTrial
    config: BackwardConfig
    source: str
    sampled: bool = False
    ahead: object = None  # proposer.Proposal


@dataclass
class NewTrial:
    trial_id: int
    number: int
    config: BackwardConfig
    source: str  # "seed" or the sweep's source
    bound: bool = False  # its slot was bound to it in the transaction that created it
    sampled: bool = False  # its config is the sampler's (not a seed's)


def seed_configs(opts: SweepOptions, problem: Problem, space: Space) -> list[BackwardConfig]:
    """The configs a fresh study of `problem` gives its first slots, in slot order: the sweep's extra seeds, then
    the space's (none for the grid sampler or an unseeded sweep), the first `seed_limit` of them where it is set."""
    if opts.sampler == "grid" or not opts.seeded:
        return []
    extra = [space.canonical(BackwardConfig.from_dict(c)) for c in opts.extra_seeds.get(problem.key, [])]
    return list(dict.fromkeys(extra + space.seeds()))[:opts.seed_limit]


def slot_seed_configs(opts: SweepOptions, problem: Problem, space: Space) -> dict[int, BackwardConfig]:
    """Slot → the config `opts.slot_seeds` puts there in `problem`'s study (none for the grid sampler or an
    unseeded sweep). Named slots come before the seeds and the sampler: a claimed slot is never asked again, so
    a resumed sweep measures each of them once."""
    if opts.sampler == "grid" or not opts.seeded or problem.key not in opts.slot_seeds:
        return {}
    first, configs = opts.slot_seeds[problem.key]
    return {int(first) + i: space.canonical(BackwardConfig.from_dict(c)) for i, c in enumerate(configs)}


def problem_space(problem: Problem, sm_count: int, interpret: bool, device: int = 0) -> Space:
    """The search space a study of `problem` samples: the limits of the sweep's GPU `device` (its CUDA index; not
    the process's current device, which a worker of `--devices` never sets), or the interpreter's."""
    return Space(problem, sm_count, None if interpret else _gpu_limits(device))


class StudyBook:
    """The study of one problem, and the seeds its first slots get."""

    def __init__(self, opts: SweepOptions, problem: Problem, sm_count: int, interpret: bool, storage,
                 claimed_slots: Callable[[str], int] = lambda name: 0, costs: Costs | None = None):
        """`costs` gets the seconds of the space and its seeds (as the sampler's) and of the study's reads and
        writes (the database's)."""
        import optuna

        costs = costs or Costs()
        self._optuna, self.storage, self.problem, self.opts = optuna, storage, problem, opts
        with costs.timed("sampler"):
            self.space = problem_space(problem, sm_count, interpret, opts.device)
            self.name = study_name(opts.gpu_key, problem, interpret, opts.study_prefix)
            self.sampling = Sampling(opts.sampler, self.space, opts.seed)
            self.seeds = seed_configs(opts, problem, self.space)
            self.slot_seeds = slot_seed_configs(opts, problem, self.space)
            self.default = self.space.canonical(default_config(problem, self.space.limits))
        self.rejected = 0  # sampled configs the space's constraints refused (never trials)
        self.proposer = None  # a `Proposer` making this study's proposals ahead, where the sweep has one
        self.spare: Prepared | None = None  # a proposal prepared for a slot taken meanwhile (`keep_spare`)
        self.seed_base = 0  # slot of the first seed
        with costs.timed("database"):
            self.study = optuna.create_study(study_name=self.name, storage=storage, sampler=self.sampling.sampler,
                                             direction="minimize", load_if_exists=True)
            attrs = self.study.user_attrs
            self._resume_seeds(claimed_slots, attrs)
            self._describe(attrs)
            self._discard_waiting()

    def target(self, trials: int) -> int:
        """The trials this study ends with in a pass of the sweep up to `trials`: within the problem's own target
        and what its sampler can give (a grid's size)."""
        trials = min(trials, self.opts.target_of(self.problem.key))
        return trials if self.sampling.size is None else min(trials, self.sampling.size)

    def summarize(self, store, ps: ProblemSummary, interpret: bool) -> None:
        """Fill `ps` from the database: the study's measured trials, the problem's best and the default's time."""
        ps.trials = sum(slot.measured for slot in store.workers.slots(self.name).values())
        best = store.best(self.problem, gpu_key=self.opts.gpu_key, interpret=interpret)
        if best is not None:
            ps.best_us, ps.best_config = best.median_us, best.config
        default = store.measurements(study_name=self.name, config=self.default, status="ok")
        if default:
            ps.default_us = default[0].median_us

    def _describe(self, attrs: dict) -> None:
        """Attributes optuna-dashboard shows: the objective's name and what the study is (set once; `attrs`: the
        study's user attributes as they were read)."""
        if attrs.get("seed_version") == SEED_VERSION and attrs.get("problem"):
            return
        rows.describe_study(self.storage, self.study, {
            "problem": self.problem.to_dict(), "gpu_key": self.opts.gpu_key, "seed_version": SEED_VERSION,
            "seeded": True, "pruned_trials": "never measured: status=abandoned (interrupted); configs the space's "
                                             "constraints reject never become trials"}, [METRIC_NAME])

    def _resume_seeds(self, claimed_slots: Callable[[str], int], attrs: dict) -> None:
        """A study seeded under an older SEED_VERSION gets the seeds it has not measured yet, in the slots after
        those already claimed: new kernel knobs' structural seeds reach resumed studies too. The list and its
        first slot are stored with the study, so that every worker gives each slot the same seed."""
        if attrs.get("seed_version") == SEED_VERSION:
            if "seed_base" in attrs:
                self.seed_base = int(attrs["seed_base"])
                self.seeds = [BackwardConfig.from_json(text) for text in attrs["resumed_seeds"]] if self.seeds else []
            return
        trials = self.study.get_trials(deepcopy=False)
        if not trials or not self.seeds:
            return
        measured = {self.space.canonical(BackwardConfig.from_json(t.user_attrs["config"]))
                    for t in trials if "config" in t.user_attrs}
        self.seeds = [seed for seed in self.seeds if seed not in measured]
        self.seed_base = claimed_slots(self.name)
        self.study.set_user_attr("seed_base", self.seed_base)
        self.study.set_user_attr("resumed_seeds", [seed.to_json() for seed in self.seeds])
        log.info("%s: seeded under an older seed version; %d seeds it has not measured go to slots from %d",
                 self.name, len(self.seeds), self.seed_base)

    def _discard_waiting(self) -> None:
        """Seeds queued as WAITING trials by normtune before schema 2 are not how trials start any more: each
        is claimed atomically and pruned (its config comes back as a seed of a slot when still unmeasured)."""
        TS = self._optuna.trial.TrialState
        for t in rows.trials_in_states(self.storage, self.study, (TS.WAITING,)):
            try:
                if self.storage.set_trial_state_values(t.trial_id, state=TS.RUNNING):
                    self.storage.set_trial_user_attr(t.trial_id, "status", "abandoned")
                    self.storage.set_trial_state_values(t.trial_id, state=TS.PRUNED)
            except self._optuna.exceptions.UpdateFinishedTrialError:
                continue

    # ------------------------------------------------------------------------------------------- trials

    def new_trial(self, slot: int, costs: Costs | None = None,
                  bind: Callable[[object, int], None] | None = None) -> NewTrial | None:
        """A RUNNING trial for `slot`: its seed when it has one, else the sampler's next valid config. None when
        the sampler gave nothing but invalid configs INVALID_STREAK_LIMIT times in a row. `costs` gets the
        seconds of the sampler and of the database writes; `bind(session, number)` records the slot's trial in
        the transaction that creates it where it can (`NewTrial.bound`)."""
        costs = costs or Costs()
        if self.sampling.proposes:
            prepared = self.prepare(slot, costs)
            return None if prepared is None else self.create(prepared, costs, bind)
        for _ in range(INVALID_STREAK_LIMIT):  # the grid sampler keeps its place in a live trial's attributes
            trial = self.study.ask()
            # A first heartbeat at once: a worker dying before its heartbeat thread's first beat would
            # otherwise leave a RUNNING trial that Optuna never considers stale.
            self.storage.record_heartbeat(rows.trial_id(trial))
            config = self.sampling.suggest(trial)
            why = self.space.why_not(config)
            if why is None:
                return NewTrial(rows.trial_id(trial), trial.number, self.space.canonical(config), self.opts.source,
                                sampled=True)
            trial.set_user_attr("status", "invalid")
            trial.set_user_attr("rejected", why[:500])
            self.study.tell(trial, state=self._optuna.trial.TrialState.PRUNED)
        return None

    def prepare(self, slot: int, costs: Costs) -> "Prepared | None":
        """What `slot`'s trial will hold, before it exists (only where the sampler `proposes`): the config the
        sweep names for it (`slot_seeds`), else its seed's config when it has one, else the sampler's next
        config the space accepts (a spare one first: prepared for a slot that was taken meanwhile). None when
        the sampler gave nothing but invalid configs."""
        named = self.slot_seeds.get(slot)
        template = None if named is None else self.sampling.seed_trial(named, "transfer")
        if template is not None:
            return Prepared(template, named, "transfer" if self.opts.source == "sweep" else self.opts.source)
        index = slot - self.seed_base
        if 0 <= index < len(self.seeds):
            template = self.sampling.seed_trial(self.seeds[index])
            if template is not None:
                source = "seed" if self.opts.source == "sweep" else self.opts.source
                return Prepared(template, self.seeds[index], source)
        if self.spare is not None:
            prepared, self.spare = self.spare, None
            return prepared
        return self._proposal(costs)

    def keep_spare(self, prepared: "Prepared") -> None:
        """A sampler's proposal whose slot was taken meanwhile: the next sampled slot gets it."""
        if prepared.sampled:
            self.spare = prepared

    def _proposal(self, costs: Costs) -> "Prepared | None":
        """The sampler's next config the space accepts; the configs it rejects on the way are counted in
        `rejected` and never become trials. The proposer's where it has one ready (checked against the same
        space there), else made here."""
        optuna = self._optuna
        if self.proposer is not None:
            with costs.timed("sampler"):
                ahead = self.proposer.take(self)
            if ahead is not None:
                self.rejected += ahead.rejected
                costs.proposals["rejected"] += ahead.rejected
                template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING,
                                                     params=ahead.record["params"],
                                                     distributions=ahead.record["distributions"],
                                                     system_attrs=ahead.record["system_attrs"])
                config = self.space.canonical(self.space.config(ahead.values))
                return Prepared(template, config, self.opts.source, sampled=True, ahead=ahead)
        for attempt in range(INVALID_STREAK_LIMIT):
            with costs.timed("sampler"):
                values, record = self.sampling.propose(self.study, retry=attempt > 0)
                config = self.space.config(values)
                why = self.space.why_not(config)
            if why is not None:
                self.rejected += 1
                costs.proposals["rejected"] += 1
                continue
            template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=record["params"],
                                                 distributions=record["distributions"],
                                                 system_attrs=record["system_attrs"])
            return Prepared(template, self.space.canonical(config), self.opts.source, sampled=True)
        return None

    def create(self, prepared: "Prepared", costs: Costs, bind=None) -> NewTrial:
        """The trial `prepared` describes, created in one transaction with a first heartbeat at once (a worker
        dying before its heartbeat thread's first beat would otherwise leave a RUNNING trial that Optuna never
        considers stale); `bind(session, number)` writes in that transaction too (its errors undo the trial)."""
        with costs.timed("database"):
            trial_id, number, bound = create_running_trial(self.storage, rows.study_id(self.study),
                                                           prepared.template, after=bind)
        if prepared.sampled:
            costs.proposals["kept"] += 1
        if prepared.ahead is not None:
            costs.proposals["ahead"] += 1
            self.proposer.took(self, prepared.ahead)
        return NewTrial(trial_id, number, prepared.config, prepared.source, bound, prepared.sampled)

    def tell(self, trial: NewTrial, status: str, value: float | None, error: str | None,
             repairing: bool = False, kernel_2_us: float | None = None) -> None:
        """Record a measured trial's outcome. A trial failed meanwhile as stale (its worker stalled past the
        grace period) keeps its measurement in the store, which is what counts. `repairing`: told for a dead
        worker (`repair`); its own worker, alive after all, may have told it first, which is no warning.
        `kernel_2_us`: the measurement's kernel_2 time, kept with the trial for the local sampler."""
        TS = self._optuna.trial.TrialState
        attrs = _told_attrs(trial, status, error, kernel_2_us)
        try:
            if value is None or not math.isfinite(value):
                finish_trial(self.storage, self.study, trial.trial_id, trial.number, TS.FAIL, None, attrs)
            else:
                finish_trial(self.storage, self.study, trial.trial_id, trial.number, TS.COMPLETE, value, attrs)
        except (self._optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError) as err:
            (log.debug if repairing else log.warning)("trial %s of %s was finished by another worker: %s",
                                                      trial.number, self.name, err)

    def tell_in(self, session, trial: NewTrial, status: str, value: float | None, error: str | None,
                kernel_2_us: float | None = None) -> bool | None:
        """`tell` within the caller's transaction `session` (the store's, recording the measurement): True when
        told, False when the trial was finished meanwhile (e.g. failed as stale: its measurement counts), None
        where it must be told afterwards with `tell`."""
        TS = self._optuna.trial.TrialState
        attrs = _told_attrs(trial, status, error, kernel_2_us)
        finite = value is not None and math.isfinite(value)
        done = finish_trial_in(session, self.storage, trial.trial_id, TS.COMPLETE if finite else TS.FAIL,
                               value if finite else None, attrs)
        if done is False:
            log.warning("trial %s of %s was finished by another worker", trial.number, self.name)
        return done

    def abandon(self, trial: NewTrial) -> None:
        """An unmeasured trial given up (interrupt, time budget): PRUNED, marked, never left RUNNING."""
        try:
            finish_trial(self.storage, self.study, trial.trial_id, trial.number,
                         self._optuna.trial.TrialState.PRUNED, None, {"status": "abandoned"})
        except (self._optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError) as err:
            log.debug("abandoning trial %s: %s", trial.number, err)

    def fail_orphan(self, number: int) -> None:
        """The unmeasured trial of a dead worker whose slot this worker took over: FAIL, not left RUNNING."""
        TS = self._optuna.trial.TrialState
        try:
            trial_id = self.storage.get_trial_id_from_study_id_trial_number(rows.study_id(self.study), number)
            if self.storage.get_trial(trial_id).state == TS.RUNNING:
                self.storage.set_trial_state_values(trial_id, state=TS.FAIL)
        except (self._optuna.exceptions.UpdateFinishedTrialError, KeyError) as err:
            log.debug("trial %s of %s already finished: %s", number, self.name, err)

    def repair(self, store) -> None:
        """Trials measured (stored) but never told -- their worker died in between -- are told from the store;
        then trials whose worker's heartbeat stopped are failed as stale (their slots are taken over)."""
        TS = self._optuna.trial.TrialState
        if not rows.trials_in_states(self.storage, self.study, (TS.RUNNING,)):  # nothing to tell, nothing stale
            return
        stored = {m.trial_number: m for m in store.measurements(study_name=self.name)}
        # The RUNNING trials read again, after the store: a live worker stores a measurement and tells its trial in
        # one transaction, so a trial still RUNNING with a measurement read before is one whose worker died in
        # between (read the other way round, a live worker's trial told meanwhile looked untold).
        for t in rows.trials_in_states(self.storage, self.study, (TS.RUNNING,)):
            m = stored.get(t.number)
            if m is not None:
                self.tell(NewTrial(t.trial_id, t.number, m.config, m.source), m.status,
                          m.median_us if m.status == "ok" else None, m.error, repairing=True,
                          kernel_2_us=m.kernel_2_us)
        self._optuna.storages.fail_stale_trials(self.study)
        self._fail_unbeaten(store)

    def _fail_unbeaten(self, store) -> None:
        """RUNNING trials that never recorded a heartbeat and started over a grace period ago: their worker died
        between creating the trial and its first beat. Optuna's fail_stale_trials only sees trials with a
        heartbeat, so without this they would stay RUNNING for ever."""
        TS = self._optuna.trial.TrialState
        cutoff = dt.datetime.now() - dt.timedelta(seconds=self.opts.grace_period)  # Optuna stores local times
        old = [t for t in rows.trials_in_states(self.storage, self.study, (TS.RUNNING,))
               if t.datetime_start is not None and t.datetime_start.replace(tzinfo=None) < cutoff]
        beaten = rows.trials_with_heartbeats(self.storage, [t.trial_id for t in old])
        for t in old:
            if t.trial_id in beaten:
                continue
            try:
                self.storage.set_trial_state_values(t.trial_id, state=TS.FAIL)
            except (self._optuna.exceptions.UpdateFinishedTrialError, RuntimeError) as err:
                log.debug("trial %s of %s already finished: %s", t.number, self.name, err)


def remaining(opts: SweepOptions, interpret: bool, store, books: dict[str, StudyBook]) -> list[str]:
    """'problem: N trials' for every problem of the sweep with fewer measured trials than asked, from the
    database (`books`: the studies the worker opened)."""
    out = []
    for problem in opts.problems:
        book = books.get(problem.key)
        name = book.name if book else study_name(opts.gpu_key, problem, interpret, opts.study_prefix)
        done = sum(slot.measured for slot in store.workers.slots(name).values())
        left = (book.target(opts.trials) if book else opts.target_of(problem.key)) - done
        if left > 0:
            out.append(f"{problem.key}: {left} trials")
    return out


def _told_attrs(trial: NewTrial, status: str, error: str | None, kernel_2_us: float | None) -> dict:
    """The user attributes a measured trial is finished with: its status, its config, its error, and the
    measurement's kernel_2 time where one was measured (the local sampler orders its next moves by it)."""
    attrs = {"status": status, "config": trial.config.to_json(), **({"error": error[:1000]} if error else {})}
    if kernel_2_us is not None and math.isfinite(kernel_2_us):
        attrs["kernel_2_us"] = round(kernel_2_us, 4)
    return attrs
