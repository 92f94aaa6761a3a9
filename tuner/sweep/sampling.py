"""How a trial gets its config: Optuna's sampler (TPE, random or grid) over the space's declared domains, or a
seed config (the default and its neighbours) given to the trial as it is created.

The "local" kind is TPE with a pattern search first: while the best config measured so far has a one-step
neighbour (`seeds.neighbours`) that no trial of the study holds, that neighbour is the next proposal; once the
best's neighbourhood is measured (or a proposal is rejected), TPE proposes. The structured space rewards moving
one knob at a time from the best (a tile, a stage count, the reduction's block), which TPE's independent draws
reach slowly."""

from __future__ import annotations

import copy
from typing import Any

from normtune.kernels.config import BackwardConfig
from normtune.kernels.strategies import lookup

from ..space import Space
from .retries import Retries

# Where kernel_2 takes at least this share of the best config's time, the local search alternates kernel_2's moves
# with kernel_1's, kernel_2's first: in knob order (kernel_1's many knobs first) a few-row, wide problem whose
# partial reduction is a fifth of its time spent its trials on kernel_1 and never tried another reduction block.
KERNEL_2_FIRST_SHARE = 0.1


class Sampling:
    """The sampler of one problem's study and the matching way to turn a trial's params into a config."""

    def __init__(self, kind: str, space: Space, seed: int):
        import optuna

        self.kind, self.space = kind, space
        self._last = None  # (study, its trials as read, the relative search space) of the last proposal
        self._grid = list(space) if kind == "grid" else None
        self._local = kind == "local"
        if kind == "random":
            self.sampler = optuna.samplers.RandomSampler(seed=seed)
        elif kind == "grid":
            self.sampler = _ask_tell_grid_sampler(optuna)({"config": list(range(len(self._grid)))}, seed=seed)
        else:
            self.sampler = optuna.samplers.TPESampler(multivariate=True, group=True, constant_liar=True, seed=seed,
                                                      n_startup_trials=8)
            _distinct_groups(self.sampler)
        self._retries = Retries.attach(self.sampler)

    @property
    def size(self) -> int | None:
        """How many configs the sampler can give (the grid's size), None when unbounded."""
        return None if self._grid is None else len(self._grid)

    @property
    def proposes(self) -> bool:
        """True when configs are proposed before a trial exists (`propose`); the grid sampler needs a live trial
        (it keeps its place in the trial's attributes), so it goes through `suggest`."""
        return self._grid is None

    def propose(self, study, retry: bool = False, liars: tuple = ()) -> tuple[dict[str, Any], dict]:
        """The next config's params and their distributions, sampled without touching the study's storage: the
        sweep rejects what the space's constraints forbid before any trial exists (a rejected config costs a
        sample, not a trial with a database write per knob), and creates the trial it keeps in one transaction.
        The same calls `Study.ask` + `suggest_categorical` make: the relative (multivariate) sample first, an
        independent one for each knob outside it; the study's trials are read once per proposal.

        `retry`: the previous proposal on this study was rejected, so no trial was created since: the trials it
        read and the relative search space inferred from them are reused (a retry costs the sampling alone).
        TPE's estimators are built once per proposal and its retries, and a proposal rejected many times
        retries from its ranked candidates (`Retries`).

        `liars`: RUNNING trials that are not in storage yet (proposals made ahead and not created yet), which the
        sampler counts as the study's own (TPE's constant liar)."""
        import optuna
        from optuna.distributions import CategoricalDistribution

        last = self._last
        retrying = retry and last is not None and last[0] is study
        if retrying:
            view, relative_space = last[1].again(), last[2]
        else:
            view, relative_space = _OneRead(study, liars), None
        if self._local and not retry:
            near = self._unmeasured_neighbour(view)
            if near is not None:
                self._last = None  # a retry after it is TPE's, on a fresh read
                return self.space.params(near), self._template(near)
        if self._retries is not None:
            self._retries.begin(retrying)
        frozen = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params={}, distributions={})
        self.sampler.before_trial(view, frozen)
        if relative_space is None:
            relative_space = self.sampler.infer_relative_search_space(view, frozen)
        self._last = (study, view, relative_space)
        relative = self.sampler.sample_relative(view, frozen, relative_space)
        d = self.space.domains()  # every offered strategy's knobs: the strategy drawn picks its own
        params: dict[str, Any] = {}
        dists: dict = {}

        def draw(key):
            dist = CategoricalDistribution(list(d[key]))
            if key in relative and key in relative_space and relative_space[key] == dist:
                value = relative[key]
            else:
                value = self.sampler.sample_independent(view, frozen, key, dist)
            params[key], dists[key] = value, dist
            frozen.params[key], frozen.distributions[key] = value, dist
            return value

        values: dict[str, Any] = {"k1.strategy": draw("k1.strategy")}
        strategy = lookup(values["k1.strategy"])
        values.update({key: draw(key) for key in strategy.decided_first})
        for key, dom in d.items():
            if key in values or not strategy.knows(key):
                continue
            fixed = inapplicable(key, values)
            values[key] = draw(key) if fixed is None else fixed(dom)
        return values, {"params": params, "distributions": dists, "system_attrs": view._storage.system_attrs}

    def _unmeasured_neighbour(self, view) -> BackwardConfig | None:
        """The first one-step neighbour of the study's best finished trial that no trial holds (finished, running
        or proposed ahead); None when there is none, or no trial has finished yet."""
        import optuna

        from ..seeds import neighbours

        every = view.every_trial()
        done = [t for t in every if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
        if not done:
            return None
        best = min(done, key=lambda t: (t.value, t.number))
        held = {trial_config(self.space, t.params) for t in every if t.params}
        config = trial_config(self.space, best.params)
        share = best.user_attrs.get("kernel_2_us", 0.0) / best.value if best.value > 0 else 0.0
        moves = neighbours(self.space, config)
        if share >= KERNEL_2_FIRST_SHARE:
            moves = kernel_2_moves_first(config, moves)
        return next((c for c in moves if c not in held), None)

    def _template(self, config: BackwardConfig) -> dict:
        """A proposal's record for `config`: the params a trial of it draws, with the distributions TPE's own
        proposals use (`propose`), so the sampler learns from it as from its own."""
        from optuna.distributions import CategoricalDistribution

        d = self.space.domains()
        params = self.space.params(config)
        first = ("k1.strategy",) + config.strategy.decided_first
        used = {k: v for k, v in params.items() if k in first or inapplicable(k, params) is None}
        return {"params": used, "distributions": {k: CategoricalDistribution(list(d[k])) for k in used},
                "system_attrs": {}}

    def suggest(self, trial) -> BackwardConfig:
        """The config of an asked trial, suggested knob by knob (conditional knobs fixed where they do not apply)."""
        if self._grid is not None:
            return self._grid[trial.suggest_categorical("config", list(range(len(self._grid))))]
        d = self.space.domains()
        params: dict[str, Any] = {"k1.strategy": trial.suggest_categorical("k1.strategy", list(d["k1.strategy"]))}
        strategy = lookup(params["k1.strategy"])
        params.update({key: trial.suggest_categorical(key, list(d[key])) for key in strategy.decided_first})
        for key, dom in d.items():
            if key in params or not strategy.knows(key):
                continue
            fixed = inapplicable(key, params)
            params[key] = trial.suggest_categorical(key, list(dom)) if fixed is None else fixed(dom)
        return self.space.config(params)

    def seed_trial(self, config: BackwardConfig, source: str = "seed"):
        """A RUNNING trial template holding a seed config's params, with the distributions `suggest` uses (so
        the sampler learns from it as from its own trials), `source` in its attributes; None when the space
        cannot express the config."""
        import optuna
        from optuna.distributions import CategoricalDistribution

        if self._grid is not None or self.space.why_not(config) is not None:
            return None
        domains = self.space.domains(config.kernel_1.strategy)
        params = self.space.params(config)
        if not all(key in domains and value in domains[key] for key, value in params.items()):
            return None
        first = ("k1.strategy",) + config.strategy.decided_first
        used = {k: v for k, v in params.items() if k in first or inapplicable(k, params) is None}
        return optuna.trial.create_trial(
            state=optuna.trial.TrialState.RUNNING, params=used,
            distributions={k: CategoricalDistribution(list(domains[k])) for k in used},
            user_attrs={"source": source})


def inapplicable(key: str, params: dict[str, Any]):
    """None when knob `key` matters given the knobs decided before it in `params` (the strategy, drawn first, then
    the knobs it decides first, `Strategy.decided_first`; then its `Strategy.sampled`: e.g. the single-pass column
    tile is derived from N); else how to fix it, a function of its domain (its first value). Fixed knobs are not
    trial params, so the sampler does not learn from values that changed nothing; another strategy's knobs are
    never drawn."""
    strategy = lookup(params.get("k1.strategy", "rows"))
    if strategy.knows(key) and strategy.sampled(key, params):
        return None
    return _first


def _first(domain: tuple):
    return domain[0]


def trial_config(space: Space, params: dict[str, Any]) -> BackwardConfig:
    """The config of a trial's params (those it drew; the knobs it fixed at their first value), canonical."""
    strategy = lookup(params.get("k1.strategy", "rows"))
    full = {"k1.strategy": strategy.name, **{k: params[k] for k in strategy.decided_first if k in params}}
    for key, dom in space.domains(strategy.name).items():
        fixed = inapplicable(key, full)
        full.setdefault(key, params.get(key, dom[0]) if fixed is None else fixed(dom))
    return space.canonical(space.config(full))


def _ask_tell_grid_sampler(optuna):
    class AskTellGridSampler(optuna.samplers.GridSampler):
        """Exhausting the grid calls study.stop(), which only works inside Study.optimize; the sweep asks and
        tells, and stops by itself once the grid's trials are finished."""

        def after_trial(self, study, trial, state, values) -> None:
            return None

    return AskTellGridSampler


# What a proposal considers once a study has more finished trials than CONSIDER: the BEST_KEPT best and the
# most recent others, and every unfinished one (constant liar). TPE's "good" group (at most 25 trials) stays
# exact, its "bad" group is the recent trials, and a proposal's cost stops growing with the study.
CONSIDER = 100
BEST_KEPT = 30


def considered(trials: list) -> list:
    """The trials a proposal reads (in their order): all of them up to CONSIDER finished ones, else the window."""
    import optuna

    TS = optuna.trial.TrialState
    finished = [t for t in trials if t.state.is_finished()]
    if len(finished) <= CONSIDER:
        return trials
    complete = sorted((t for t in finished if t.state == TS.COMPLETE and t.value is not None), key=lambda t: t.value)
    keep = {t.number for t in complete[:BEST_KEPT]}
    rest = [t for t in finished if t.number not in keep]
    keep |= {t.number for t in rest[-(CONSIDER - len(keep)):]}
    return [t for t in trials if not t.state.is_finished() or t.number in keep]


class _OneRead:
    """A study whose trials are read from storage once: a TPE proposal otherwise reloads every trial of the study
    for each knob group and each independent knob (with constant_liar the sampler bypasses the trial cache),
    which made sampling the sweep's largest cost per trial. What the sampler writes on the trial being proposed
    (TPE's relative sample, for other workers' constant liar) is kept for its template. Everything else is the
    study's."""

    def __init__(self, study, liars: tuple = ()):
        self._study = study
        self._trials = self._every = None
        self._liars = list(liars)
        self._storage = _Recording(study._storage)

    def again(self) -> "_OneRead":
        """The same trials as read, for another proposal (its own record of what the sampler writes)."""
        self._storage = _Recording(self._study._storage)
        return self

    def _read(self) -> None:
        if self._trials is None:
            self._every = self._study._get_trials(deepcopy=False, states=None, use_cache=False) + self._liars
            self._trials = considered(self._every[:len(self._every) - len(self._liars)]) + self._liars

    def every_trial(self) -> list:
        """Every trial of the study and the proposals made ahead, not copied (the window `considered` keeps is
        what the sampler reads)."""
        self._read()
        return self._every

    def _get_trials(self, deepcopy: bool = True, states=None, use_cache: bool = False):
        self._read()
        trials = self._trials if states is None else [t for t in self._trials if t.state in tuple(states)]
        return [copy.deepcopy(t) for t in trials] if deepcopy else list(trials)

    def get_trials(self, deepcopy: bool = True, states=None):
        return self._get_trials(deepcopy=deepcopy, states=states)

    @property
    def trials(self):
        return self.get_trials()

    def __getattr__(self, name):
        return getattr(self._study, name)


class _Recording:
    """The study's storage, except that attributes set on the proposed trial (not in storage yet: id -1) are kept
    in `system_attrs` to be created with it."""

    def __init__(self, storage):
        self._inner = storage
        self.system_attrs: dict[str, Any] = {}

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        if trial_id == -1:
            self.system_attrs[key] = value
        else:
            self._inner.set_trial_system_attr(trial_id, key, value)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _distinct_groups(sampler) -> None:
    """Give a TPE sampler with group=True a `DistinctGroups` in place of its group-decomposed search space, where
    this Optuna has one of the form it knows (else the sampler keeps its own)."""
    try:
        from optuna.search_space.group_decomposed import _GroupDecomposedSearchSpace, _SearchSpaceGroup
    except ImportError:  # pragma: no cover - another Optuna layout: keep the sampler's own
        return
    own = getattr(sampler, "_group_decomposed_search_space", None)
    if type(own) is _GroupDecomposedSearchSpace and hasattr(own, "_include_pruned"):
        sampler._group_decomposed_search_space = DistinctGroups(_SearchSpaceGroup, own._include_pruned)


class DistinctGroups:
    """TPE's group-decomposed search space (Optuna's `_GroupDecomposedSearchSpace`: the knobs split into groups
    that are always sampled together), computed the same way from the distinct sets of knobs of the study's
    trials only. Adding the knobs of a trial whose set was added before leaves the decomposition as it is, and
    Optuna's keeps what it added across calls too: so each call costs a set per trial, not a decomposition step
    per trial, and a proposal's cost no longer grows with the decomposition of every trial of the study."""

    def __init__(self, group_class, include_pruned: bool = False):
        self._group = group_class()
        self._seen: set[frozenset] = set()
        self._study_id: int | None = None
        self._include_pruned = include_pruned

    def calculate(self, study, use_cache: bool = False):
        import optuna

        if self._study_id is None:
            self._study_id = study._study_id
        elif self._study_id != study._study_id:
            raise ValueError("`DistinctGroups` cannot handle multiple studies.")
        TS = optuna.trial.TrialState
        states = (TS.COMPLETE, TS.PRUNED) if self._include_pruned else (TS.COMPLETE,)
        for trial in study._get_trials(deepcopy=False, states=states, use_cache=use_cache):
            names = frozenset(trial.distributions)
            if names not in self._seen:
                self._seen.add(names)
                self._group.add_distributions(trial.distributions)
        return copy.deepcopy(self._group)


def kernel_2_moves_first(config: BackwardConfig, moves: list[BackwardConfig]) -> list[BackwardConfig]:
    """`moves` (one-step neighbours of `config`) reordered: those that move kernel_2 alone alternate with the
    others, a kernel_2 move first; each group keeps its order. A move that canonicalises back to `config` is
    dropped."""
    reduction = [c for c in moves if c.kernel_1 == config.kernel_1 and c != config]
    others = [c for c in moves if c.kernel_1 != config.kernel_1]
    out: list[BackwardConfig] = []
    for i in range(max(len(reduction), len(others))):
        out += reduction[i:i + 1] + others[i:i + 1]
    return out
