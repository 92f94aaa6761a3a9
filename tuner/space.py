"""The search space: declared domains for every launch knob of both kernels, and declared constraints that prune
configs before anything is compiled.

The knobs are the fields of the strategies' config types and `Kernel2Config` (the single definition): the shared
knobs' domains are here (`K1_DOMAINS`, `K2_DOMAINS`), each strategy's own knobs' domains in its module, and each
strategy narrows its own knobs' domains to the problem. A strategy's part of the space holds the shared knobs and
its own only, and the registry is read each time, so a strategy registered later is offered from then on.
Constraints are `BackwardConfig.validate` (what cannot run) plus redundancy pruning (what would time the same
kernels as another config: e.g. grids that collapse to the same program count), so that enumeration yields each
distinct launch once. Where a sweep starts (the seeds) is `seeds.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from normtune.kernels.strategies.capabilities import fallbacks, portable
from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem
from normtune.kernels.limits import REFERENCE, DeviceLimits
from normtune.kernels.heuristics import (MAX_COLUMNS_ROWS, MAX_SINGLE_PASS, MIN_ELEMENTS_PER_THREAD, max_warps,
                                        next_power_of_two)
from normtune.kernels.strategies import KERNEL_1_DOMAINS, KERNEL_2_DOMAINS, STRATEGIES, lookup, num_programs
from normtune.kernels.strategies.base import MAX_SPACE_TILE
from normtune.kernels.strategies.rows import MAX_COLUMN_ACC_TILE, MIN_TWO_PASS_CHUNK, fitting_split

from . import seeds as seeding

# Domains of the knobs every strategy shares (ordered: neighbours in a domain are "one step" apart when seeding the
# search); the strategy's domain is the registry's names, each strategy's own knobs' domains are its `knob`s'.
K1_DOMAINS: dict[str, tuple] = dict(KERNEL_1_DOMAINS)
K2_DOMAINS: dict[str, tuple] = dict(KERNEL_2_DOMAINS)

__all__ = ["K1_DOMAINS", "K2_DOMAINS", "MAX_COLUMN_ACC_TILE", "MAX_SINGLE_PASS", "MAX_SPACE_TILE",
           "MIN_TWO_PASS_CHUNK", "Space", "fitting_split"]


@dataclass(frozen=True)
class Space:
    """The configs worth measuring for one problem on a device with `sm_count` SMs and the given `limits`
    (None: the reference device's): only the warps, shared memory and features that device has."""

    problem: Problem
    sm_count: int
    limits: DeviceLimits | None = None

    @property
    def device(self) -> DeviceLimits:
        return self.limits or REFERENCE

    # ---- domains, as they apply to this problem
    def offered(self) -> tuple[str, ...]:
        """The registered strategies the space offers for the problem (`Strategy.offered`), in registry order."""
        return tuple(name for name, strategy in STRATEGIES.items() if strategy.offered(self.problem))

    def domains(self, strategy: str | None = None) -> dict[str, tuple]:
        """Each knob's domain as it applies to the problem and the device, in the order the sampler draws them: the
        strategy, the strategy's leading knobs, the shared knobs, its other knobs, then kernel_2's. Of `strategy`'s
        configs (its knobs only), or of every offered strategy's together (None)."""
        p, lim = self.problem, self.device
        offered = self.offered()
        strategies = [lookup(name) for name in (offered if strategy is None else (strategy,))]
        n_pow2 = next_power_of_two(p.N)
        leading = {f"k1.{k.name}": k.domain for s in strategies for k in s.knobs if k.leading}
        rest = {f"k1.{k.name}": k.domain for s in strategies for k in s.knobs if not k.leading}
        d: dict[str, tuple] = {"k1.strategy": offered, **leading, **{f"k1.{k}": v for k, v in K1_DOMAINS.items()},
                               **rest}
        d["k1.block_col"] = tuple(c for c in K1_DOMAINS["block_col"] if c < n_pow2) or (min(n_pow2, 32),)
        rows_needed = next_power_of_two(max(1, p.M))
        d["k1.block_row"] = tuple(r for r in K1_DOMAINS["block_row"] if r <= rows_needed) or (1,)
        d.update({f"k2.{k}": v for k, v in K2_DOMAINS.items()})
        d["k2.block_n"] = tuple(b for b in K2_DOMAINS["block_n"] if b <= n_pow2) or (n_pow2,)
        # only what the device has (`capabilities`)
        d["k1.num_warps"] = tuple(w for w in d["k1.num_warps"] if w <= lim.max_warps)
        d["k2.num_warps"] = tuple(w for w in d["k2.num_warps"] if w <= lim.max_warps)
        if not lim.eviction_hints:
            d["k1.eviction_policy"] = ("",)
        if not lim.pdl:
            d["k2.pdl"] = (False,)
        for s in strategies:  # their own knobs (`Strategy.narrow_domains`)
            s.narrow_domains(d, p, lim)
        return d

    def kernel_2_domains(self) -> Mapping[str, tuple]:
        return K2_DOMAINS

    def unused_kernel_2(self) -> Kernel2Config:
        """The kernel_2 config a strategy carries where it does not launch kernel_2 (each domain's first value)."""
        return Kernel2Config(**{k[3:]: v[0] for k, v in self.domains().items() if k.startswith("k2.")})

    def config(self, params: Mapping[str, Any]) -> BackwardConfig:
        """Params (as sampled: 'k1.block_row', …) → a config of the strategy they name (`Strategy.config`; knobs
        the strategy does not use are ignored)."""
        return lookup(params.get("k1.strategy", "rows")).config(self.problem, params, self)

    def params(self, config: BackwardConfig) -> dict[str, Any]:
        """The inverse of `config` (what to enqueue in a study to measure a given config): the knobs of its
        strategy's part of the space. Knobs a config ignores take the first value of their domains."""
        k1 = config.kernel_1
        out = {"k1.strategy": k1.strategy, **{f"k1.{f.name}": getattr(k1, f.name) for f in dataclasses.fields(k1)}}
        out.update({f"k2.{f.name}": getattr(config.kernel_2, f.name) for f in dataclasses.fields(Kernel2Config)})
        config.strategy.params(config, out, self.domains(k1.strategy))
        return out

    def applies(self, key: str, params: Mapping[str, Any]) -> bool:
        """Whether knob `key` changes the launch given the knobs decided before it (`Strategy.sampled`)."""
        strategy = lookup(params.get("k1.strategy", "rows"))
        return strategy.knows(key) and strategy.sampled(key, params)

    # ---- constraints
    def why_not(self, config: BackwardConfig) -> str | None:
        """None when `config` is worth measuring; else the constraint it breaks."""
        err = None
        try:
            config.validate(self.problem, self.limits)
        except ValueError as e:
            err = str(e)
        if err:
            return err
        lacking = fallbacks(config, self.device)
        if lacking:
            return lacking[0]
        k1 = config.kernel_1
        tile = self._tile_why_not(k1)
        if tile is not None:
            return tile
        own = config.strategy.why_not(config, self)
        if own is not None:
            return own
        if config.strategy.sweeps_rows and self.problem.M > MAX_COLUMNS_ROWS:
            return f"the {k1.strategy} strategy sweeps every row of a column slice: offered up to M={MAX_COLUMNS_ROWS}"
        return None

    def _tile_why_not(self, k1) -> str | None:
        """The constraints of `why_not` that kernel_1 alone decides (kernel_2's knobs cannot lift them)."""
        largest = lookup(k1.strategy).largest_tile(k1)
        if k1.tile() > largest:
            return f"tile {k1.block_row}x{k1.block_col} exceeds the space's {largest} elements"
        if k1.num_warps > max_warps(k1.tile(), self.limits):
            return (f"num_warps={k1.num_warps} gives fewer than {MIN_ELEMENTS_PER_THREAD} elements per thread on a "
                    f"{k1.tile()}-element tile")
        if k1.prefetch and k1.num_stages > 1:
            return "prefetch and num_stages > 1 both pipeline the tile loop: use one"
        return None

    def canonical(self, config: BackwardConfig) -> BackwardConfig:
        """Collapse knobs that do not change the launch: row tiles taller than the problem (kept within the
        block_row domain), knobs the strategy does not use (`Strategy.canonical`), programs_per_sm values giving
        the same grid, and features the device lacks (its portable form runs)."""
        config = portable(config, self.device)
        rows = self.domains()["k1.block_row"][-1]
        if config.kernel_1.block_row > rows:
            k1 = dataclasses.replace(config.kernel_1, block_row=rows)
            k1 = dataclasses.replace(k1, num_warps=min(k1.num_warps, max_warps(k1.tile(), self.limits)))
            config = dataclasses.replace(config, kernel_1=k1)
        config, grid = config.strategy.canonical(config, self)
        if not grid:
            return config
        M, N = self.problem.M, self.problem.N
        progs = num_programs(M, N, config, self.sm_count)
        pps = progs / self.sm_count
        for value in K1_DOMAINS["programs_per_sm"]:
            if num_programs(M, N, dataclasses.replace(
                    config, kernel_1=dataclasses.replace(config.kernel_1, programs_per_sm=value)),
                    self.sm_count) == progs:
                pps = value
                break
        return dataclasses.replace(config, kernel_1=dataclasses.replace(config.kernel_1, programs_per_sm=pps))

    # ---- enumeration
    def __iter__(self) -> Iterator[BackwardConfig]:
        """Each distinct launch once: per strategy and variant (`Strategy.variants`: the rows strategy's single
        pass and two-pass), knobs it does not walk (`Strategy.enumerated`) are fixed to their first value before
        the product."""
        seen: set[BackwardConfig] = set()
        for name in self.domains()["k1.strategy"]:
            strategy = lookup(name)
            d = self.domains(name)
            for variant in strategy.variants(d):
                sub = {k: (v if strategy.enumerated(k, variant) else v[:1]) for k, v in d.items()}
                sub["k1.strategy"] = (name,)
                sub.update({k: (value,) for k, value in variant.items()})
                # kernel_2's knobs (the trailing keys) vary fastest; a kernel_1 that `_tile_why_not` rules out is
                # skipped with all of them at once (a strategy builds kernel_1 from the 'k1.' params alone).
                keys = list(sub)
                inner = len(keys)
                while inner > 0 and keys[inner - 1].startswith("k2."):
                    inner -= 1
                outer_keys, inner_keys = keys[:inner], keys[inner:]
                inner_values = list(itertools.product(*(sub[k] for k in inner_keys)))
                for outer in itertools.product(*(sub[k] for k in outer_keys)):
                    first = dict(zip(outer_keys, outer), **dict(zip(inner_keys, inner_values[0])))
                    if self._tile_why_not(self.config(first).kernel_1) is not None:
                        continue
                    for values in inner_values:
                        params = dict(zip(keys, outer + values))
                        fused = params["k2.fused"]
                        if fused and (params["k2.pdl"] or params["k2.num_warps"] != K2_DOMAINS["num_warps"][0]):
                            continue  # fused: kernel_2's warps and PDL do not apply
                        cfg = self.config(params)
                        if self.why_not(cfg) is not None:
                            continue
                        cfg = self.canonical(cfg)
                        if cfg not in seen:
                            seen.add(cfg)
                            yield cfg

    def size(self) -> int:
        return sum(1 for _ in self)

    def raw_size(self) -> int:
        """Size of the cartesian products (one per offered strategy, of its knobs) before constraints."""
        total = 0
        for name in self.offered():
            n = 1
            for key, v in self.domains(name).items():
                n *= 1 if key == "k1.strategy" else len(v)
            total += n
        return total

    # ---- seeding (`seeds.py`)
    def strategies(self) -> list[BackwardConfig]:
        """Structurally different configs a local search around the default would not reach."""
        return seeding.strategies(self)

    def seeds(self) -> list[BackwardConfig]:
        """The analytic default, `strategies` and the default's one-step neighbours, in the order to time them."""
        return seeding.seeds(self)

    def worth_measuring(self, configs: list[BackwardConfig]) -> list[BackwardConfig]:
        """Canonical forms of the configs that pass the constraints (before and after canonicalization: a
        smaller canonical row tile also gets fewer warps)."""
        out = []
        for cfg in configs:
            if self.why_not(cfg) is None and self.why_not(self.canonical(cfg)) is None:
                out.append(self.canonical(cfg))
        return out
