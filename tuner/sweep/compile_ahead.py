"""A sweep worker's compile-ahead jobs, by problem and config (`CompileAhead`).

A trial's config is compiled in the compile pool between its creation and its measurement (`PendingTrials`). The
seeds of a problem (its analytic default and that default's neighbours, `StudyBook.seeds`) are known before any
slot is claimed, so they are compiled further ahead: from the worker's start, `warm` keeps as many seed compiles
in the pool as it has processes (`warm_jobs`), in the order the worker will claim them, and a trial created for
one of them takes its job over instead of submitting another. This uses the pool's processes that the trials in
flight (at most `lookahead`) leave idle, and it claims nothing: the studies, their slots and their trials are
untouched, so a seed compiled ahead but never claimed (another worker measured it, the time budget ran out)
costs only the compile. The sampler's proposals made ahead by the proposer process are compiled as they arrive
(`proposed`), in the same way.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import Callable, Iterable, Iterator

from normtune.kernels.config import BackwardConfig, Problem

from ..gpu_info import DeviceInfo
from .compiling import compile_one
from .costs import Costs
from .options import SweepOptions, study_name
from .trials import StudyBook, problem_space, seed_configs, slot_seed_configs


class CompileAhead:
    """The compile-ahead jobs of one worker on `pool` (a `ProcessPoolExecutor` or the host's shared pool; None:
    nothing is compiled ahead) for a device of `sms` SMs, with up to `warm_jobs` seed compiles unfinished; the
    trials' jobs are counted in `costs.compiles`."""

    def __init__(self, pool, sms: int, warm_jobs: int, costs: Costs | None = None):
        self._pool, self._sms, self._warm_jobs = pool, sms, warm_jobs
        self._costs = costs or Costs()
        self._warmed: dict[tuple[str, str], Future] = {}  # seed compiles not yet taken over by a trial
        self._unfinished: list[Future] = []  # seed compiles submitted and not done yet
        self._upcoming: Iterator[tuple[Problem, BackwardConfig]] = iter(())

    def job(self, problem: Problem, config: BackwardConfig) -> Future | None:
        """The compile job of a trial of `problem` with `config`: the seed's job compiled ahead if there is one,
        else a new one."""
        if self._pool is None:
            return None
        future = self._warmed.pop((problem.key, config.to_json()), None)
        taken = future is not None and not future.cancelled()
        self._costs.compiles["ahead" if taken else "at_claim"] += 1
        if taken:
            return future
        return self._pool.submit(compile_one, problem.to_dict(), config.to_json(), self._sms)

    def warm(self, seeds: Iterable[tuple[Problem, BackwardConfig]]) -> None:
        """Compile `seeds` ((problem, config), in the order their slots will be claimed) ahead, `warm_jobs` at
        a time as `refill` is called; the seeds given before and not submitted yet come first."""
        if self._pool is not None:
            self._upcoming = itertools.chain(self._upcoming, seeds)
            self.refill()

    def refill(self) -> None:
        """Submit upcoming seeds until `warm_jobs` of the seed jobs not taken over are unfinished (called from
        the worker's loop: submitting never happens on the pool's own threads)."""
        if self._pool is None:
            return
        self._unfinished = [f for f in self._unfinished if not f.done()]
        while len(self._unfinished) < self._warm_jobs:
            problem, config = next(self._upcoming, (None, None))
            if problem is None:
                return
            future = self._warm(problem, config)
            if future is not None:
                self._unfinished.append(future)

    def proposed(self, books: dict[str, StudyBook]) -> Callable[[str, dict], None]:
        """The proposer's hook (`Proposer.on_proposal`): a proposal received for the study of one of `books` is
        compiled from then on, as a seed is ahead of its claim, and the trial the worker creates when it takes the
        proposal takes the job over. A proposal is the config its study's next sampled trial gets, received a turn
        of the worker's problems before that trial's claim."""

        def compile_proposal(name: str, values: dict) -> None:
            book = next((b for b in books.values() if b.name == name), None)
            if book is not None and self._pool is not None:
                self._warm(book.problem, book.space.canonical(book.space.config(values)))

        return compile_proposal

    def _warm(self, problem: Problem, config: BackwardConfig) -> Future | None:
        """Submit the compile of (problem, config) for its trial to take over; None when it is submitted already."""
        key = (problem.key, config.to_json())
        if key in self._warmed:
            return None
        self._warmed[key] = self._pool.submit(compile_one, problem.to_dict(), key[1], self._sms)
        return self._warmed[key]

    def stop(self) -> None:
        """Cancel the seed compiles that have not started (the pool is stopped separately)."""
        self._upcoming = iter(())
        for future in self._warmed.values():
            future.cancel()
        self._warmed.clear()
        self._unfinished.clear()


def seeds_in_claim_order(order: list[Problem], targets: list[int], seeds_of: Callable[[Problem], list],
                         claimed_of: Callable[[Problem], set[int]]) -> Iterator[tuple[Problem, BackwardConfig]]:
    """The seeds the worker's feed will claim, in its order: each round (up to each of `targets`) walks the
    problems of `order`, and slot i of a problem gets `seeds_of(problem)[i]` (computed when its turn comes; None:
    no seed); slots already claimed (`claimed_of`: measured, or held by a worker) are skipped."""
    low = 0
    for high in targets:
        for problem in order:
            seeds = seeds_of(problem)[low:high]
            if not seeds:
                continue
            claimed = claimed_of(problem)
            yield from ((problem, seed) for slot, seed in enumerate(seeds, low)
                        if seed is not None and slot not in claimed)
        low = high


def by_slot(seeds: list[BackwardConfig | None], named: dict[int, BackwardConfig]) -> list[BackwardConfig | None]:
    """The config each slot gets, in slot order (None: the sampler's): the slots `named` (`slot_seed_configs`)
    take theirs over the seeds', as `StudyBook.prepare` gives them."""
    out = list(seeds) + [None] * (max(named, default=-1) + 1 - len(seeds))
    for slot, config in named.items():
        out[slot] = config
    return out


def seeds_ahead(order: list[Problem], targets: list[int], opts: SweepOptions, info: DeviceInfo, store,
                books: dict[str, StudyBook], costs: Costs) -> Iterator[tuple[Problem, BackwardConfig]]:
    """`seeds_in_claim_order` for a sweep worker: a problem's seeds are its open study's (`books`: from its
    `seed_base` slot on), else those a fresh study gets, with the configs `slot_seeds` names in their slots; its
    claimed slots are read from the store when its turn comes (counted in `costs` as database time)."""

    def seeds_of(problem: Problem) -> list[BackwardConfig | None]:
        book = books.get(problem.key)
        if book is not None:
            return by_slot([None] * book.seed_base + book.seeds, book.slot_seeds)
        space = problem_space(problem, info.sm_count, info.interpret, opts.device)
        return by_slot(seed_configs(opts, problem, space), slot_seed_configs(opts, problem, space))

    def claimed_of(problem: Problem) -> set[int]:
        with costs.timed("database"):
            return set(store.workers.slots(study_name(opts.gpu_key, problem, info.interpret, opts.study_prefix)))

    return seeds_in_claim_order(order, targets, seeds_of, claimed_of)
