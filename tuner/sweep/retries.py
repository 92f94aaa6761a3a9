"""How TPE retries a proposal the search space rejected, cheaply (`Sampling.propose` says when a proposal is a
retry)."""

from __future__ import annotations

# Retries of one proposal that draw again before the rest take the last draw's candidates in turn (`Retries`).
DRAWS_BEFORE_RANKED = 16


class Retries:
    """How TPE retries a proposal the space rejected (most sampled configs break a joint limit of tile, warps,
    stages and prefetch).

    - A retry draws again from the same estimators: they depend only on the trials read, which a retry reuses,
      so each is built once per proposal (`_build_parzen_estimator` memoized until the next fresh proposal). The
      draws are the ones rebuilding would give; only the building is saved.
    - Past DRAWS_BEFORE_RANKED draws -- a study converged on configs the space rejects drew the same rejected
      config hundreds of times -- a retry moves one knob group to the next best distinct candidate of its last
      draw, ranked by TPE's own acquisition, the groups in turn (skipping those with none left), keeping the
      others' choices. When no group has candidates left, the one in turn draws afresh.
    """

    def __init__(self, sampler):
        self._draws: dict[tuple, tuple] = {}  # per group: its last draw (candidates, acquisition, space, choice)
        self._candidates: dict[tuple, list[dict]] = {}  # per group: those not given yet, best first (ranked mode)
        self._chosen: dict[tuple, dict] = {}  # per group: its choice in the proposal's last config
        self._order: list[tuple] = []  # the groups in the order the fresh proposal drew them
        self._built: dict = {}  # the proposal's estimators, by (group, good or bad trials, their numbers)
        self._retries, self._target = 0, None
        self._drawn = None
        self._sample, self._acquisition = sampler._sample, sampler._compute_acquisition_func
        self._build = sampler._build_parzen_estimator
        sampler._sample, sampler._compute_acquisition_func = self.sample, self.acquisition
        sampler._build_parzen_estimator = self.build

    @classmethod
    def attach(cls, sampler) -> "Retries | None":
        """Retries for a TPE `sampler` of the form this Optuna has; None for other samplers or layouts."""
        import optuna

        names = ("_sample", "_compute_acquisition_func", "_build_parzen_estimator")
        if not isinstance(sampler, optuna.samplers.TPESampler) or not all(
                callable(getattr(sampler, name, None)) for name in names):
            return None
        return cls(sampler)

    @property
    def ranked(self) -> bool:
        """Whether this retry takes ranked candidates (past DRAWS_BEFORE_RANKED draws)."""
        return self._retries > DRAWS_BEFORE_RANKED

    def begin(self, retrying: bool) -> None:
        """A proposal starts: a retry of the last one, or a fresh one (everything forgotten)."""
        if not retrying:
            self._draws.clear()
            self._candidates.clear()
            self._chosen.clear()
            self._built.clear()
            self._order, self._retries, self._target = [], 0, None
            return
        self._retries += 1
        if self.ranked:  # the group that moves: the next in turn with candidates left, else the one in turn
            order = self._order or [None]
            start = self._retries - DRAWS_BEFORE_RANKED - 1
            turns = [order[(start + i) % len(order)] for i in range(len(order))]
            self._target = next((key for key in turns if self._queue(key)), turns[0])

    def _queue(self, key) -> list[dict]:
        """The group's candidates not given yet, ranked from its last draw on first use: only a proposal rejected
        past DRAWS_BEFORE_RANKED draws pays for ranking."""
        if key not in self._candidates and key in self._draws:
            self._candidates[key] = _ranked(*self._draws[key])
        return self._candidates.get(key, [])

    def build(self, study, search_space, trials, handle_below, *args, **kwargs):
        try:
            key = (tuple(search_space), bool(handle_below), tuple(t.number for t in trials), args,
                   tuple(sorted(kwargs.items())))
            hash(key)
        except (TypeError, AttributeError):  # not the form this memo knows: build as Optuna would
            return self._build(study, search_space, trials, handle_below, *args, **kwargs)
        if key not in self._built:
            self._built[key] = self._build(study, search_space, trials, handle_below, *args, **kwargs)
        return self._built[key]

    def acquisition(self, samples, below, above):
        values = self._acquisition(samples, below, above)
        self._drawn = (samples, values)
        return values

    def sample(self, study, trial, search_space):
        key = tuple(search_space)
        if self.ranked and key in self._chosen:
            if key != self._target:
                return dict(self._chosen[key])
            queue = self._queue(key)
            if queue:
                self._chosen[key] = queue.pop(0)
                return dict(self._chosen[key])
        elif not self._retries:
            self._order.append(key)
        self._drawn = None
        best = self._sample(study, trial, search_space)
        self._candidates.pop(key, None)
        if self._drawn is not None:
            self._draws[key] = (self._drawn, search_space, best)
        self._chosen[key] = best
        return best


def _ranked(drawn, search_space: dict, best: dict) -> list[dict]:
    """The drawn candidates (internal representation) best first by acquisition, in their external form, each
    once, without `best` (the one proposed)."""
    import numpy as np

    samples, values = drawn
    seen = {tuple(sorted((k, repr(v)) for k, v in best.items()))}
    out = []
    for i in np.argsort(-np.asarray(values), kind="stable"):
        candidate = {name: dist.to_external_repr(samples[name][i]) for name, dist in search_space.items()}
        mark = tuple(sorted((k, repr(v)) for k, v in candidate.items()))
        if mark not in seen:
            seen.add(mark)
            out.append(candidate)
    return out
