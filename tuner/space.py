"""The search space: declared domains for every launch knob of both kernels, and declared constraints that prune
configs before anything is compiled.

The knobs are the fields of `Kernel1Config` / `Kernel2Config` (the single definition): a test checks that every
field has a domain here. Constraints are `BackwardConfig.validate` (what cannot run) plus redundancy pruning
(what would time the same kernels as another config: e.g. grids that collapse to the same program count), so
that enumeration yields each distinct launch once.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from normtune.kernels.backward import num_programs
from normtune.kernels.config import (
    BackwardConfig,
    Kernel1Config,
    Kernel2Config,
    Problem,
    default_config,
    next_power_of_two,
)

# Domains (ordered: neighbours in a domain are "one step" apart when seeding the search).
K1_DOMAINS: dict[str, tuple] = {
    "two_pass": (False, True),
    "block_row": (1, 2, 4, 8, 16),
    "block_col": (512, 1024, 2048, 4096, 8192),  # two-pass chunk; single pass always uses next_pow2(N)
    "num_warps": (1, 2, 4, 8, 16, 32),
    "num_stages": (1, 2, 3),
    "programs_per_sm": (0.5, 1, 2, 3, 4),
    "eviction_policy": ("", "evict_first"),
    "prefetch": (False, True),
    "recompute": (False, True),
}
K2_DOMAINS: dict[str, tuple] = {
    "block_m": (32, 64, 128, 256),
    "block_n": (8, 16, 32, 64, 128),
    "num_warps": (1, 2, 4, 8),
    "num_stages": (1, 2),
    "pdl": (False, True),
}
# Largest tile (elements) the space offers: past it, registers spill on every Hopper config we measured.
MAX_SPACE_TILE = 16384
# Widest single-pass row: 16384 fits one Hopper SM's registers (a 1x16384 tile on 16 warps); wider rows spill.
MAX_SINGLE_PASS = 16384


@dataclass(frozen=True)
class Space:
    """The configs worth measuring for one problem on a device with `sm_count` SMs."""

    problem: Problem
    sm_count: int

    # ---- domains, as they apply to this problem
    def domains(self) -> dict[str, tuple]:
        p = self.problem
        n_pow2 = next_power_of_two(p.N)
        d: dict[str, tuple] = {f"k1.{k}": v for k, v in K1_DOMAINS.items()}
        d.update({f"k2.{k}": v for k, v in K2_DOMAINS.items()})
        modes = tuple(m for m in (False, True) if (m or n_pow2 <= MAX_SINGLE_PASS) and (not m or n_pow2 > 1024))
        d["k1.two_pass"] = modes
        d["k1.block_col"] = tuple(c for c in K1_DOMAINS["block_col"] if c < n_pow2) or (min(n_pow2, 512),)
        rows_needed = next_power_of_two(max(1, p.M))
        d["k1.block_row"] = tuple(r for r in K1_DOMAINS["block_row"] if r <= rows_needed) or (1,)
        d["k2.block_n"] = tuple(b for b in K2_DOMAINS["block_n"] if b <= n_pow2) or (n_pow2,)
        return d

    def config(self, params: Mapping[str, Any]) -> BackwardConfig:
        """Params (as sampled: 'k1.block_row', …) → a config. Single pass uses block_col = next_pow2(N)."""
        p = self.problem
        two_pass = bool(params["k1.two_pass"])
        k1 = Kernel1Config(
            block_row=params["k1.block_row"],
            block_col=params["k1.block_col"] if two_pass else next_power_of_two(p.N),
            num_warps=params["k1.num_warps"], num_stages=params["k1.num_stages"],
            programs_per_sm=params["k1.programs_per_sm"], two_pass=two_pass,
            eviction_policy=params["k1.eviction_policy"], prefetch=bool(params["k1.prefetch"]),
            recompute=bool(params.get("k1.recompute", False)) and not two_pass,
        )
        k2 = Kernel2Config(block_m=params["k2.block_m"], block_n=params["k2.block_n"],
                           num_warps=params["k2.num_warps"], num_stages=params["k2.num_stages"],
                           pdl=bool(params["k2.pdl"]))
        return BackwardConfig(k1, k2)

    def params(self, config: BackwardConfig) -> dict[str, Any]:
        """The inverse of `config` (what to enqueue in a study to measure a given config). Single pass and
        two-pass recompute take the first value of the domains they ignore."""
        out = {f"k1.{f.name}": getattr(config.kernel_1, f.name) for f in dataclasses.fields(Kernel1Config)}
        out.update({f"k2.{f.name}": getattr(config.kernel_2, f.name) for f in dataclasses.fields(Kernel2Config)})
        if not config.kernel_1.two_pass:
            out["k1.block_col"] = self.domains()["k1.block_col"][0]
        return out

    # ---- constraints
    def why_not(self, config: BackwardConfig) -> str | None:
        """None when `config` is worth measuring; else the constraint it breaks."""
        err = None
        try:
            config.validate(self.problem)
        except ValueError as e:
            err = str(e)
        if err:
            return err
        k1 = config.kernel_1
        if k1.tile() > MAX_SPACE_TILE:
            return f"tile {k1.block_row}x{k1.block_col} exceeds the space's {MAX_SPACE_TILE} elements"
        if k1.num_warps > 1 and k1.num_warps * 32 * 4 > k1.tile():
            return f"num_warps={k1.num_warps} gives fewer than 4 elements per thread on a {k1.tile()}-element tile"
        if k1.prefetch and k1.num_stages > 1:
            return "prefetch and num_stages > 1 both pipeline the tile loop: use one"
        return None

    def canonical(self, config: BackwardConfig) -> BackwardConfig:
        """Collapse knobs that do not change the launch: row tiles taller than the problem (kept within the
        block_row domain), and programs_per_sm values giving the same grid."""
        rows = self.domains()["k1.block_row"][-1]
        if config.kernel_1.block_row > rows:
            k1 = dataclasses.replace(config.kernel_1, block_row=rows)
            while k1.num_warps > 1 and k1.num_warps * 32 * 4 > k1.tile():  # the smaller tile's warps
                k1 = dataclasses.replace(k1, num_warps=k1.num_warps // 2)
            config = dataclasses.replace(config, kernel_1=k1)
        progs = num_programs(self.problem.M, config, self.sm_count)
        pps = progs / self.sm_count
        for value in K1_DOMAINS["programs_per_sm"]:
            if num_programs(self.problem.M, dataclasses.replace(
                    config, kernel_1=dataclasses.replace(config.kernel_1, programs_per_sm=value)),
                    self.sm_count) == progs:
                pps = value
                break
        return dataclasses.replace(config, kernel_1=dataclasses.replace(config.kernel_1, programs_per_sm=pps))

    # ---- enumeration
    def __iter__(self) -> Iterator[BackwardConfig]:
        d = self.domains()
        keys = list(d)
        seen: set[BackwardConfig] = set()
        for values in itertools.product(*(d[k] for k in keys)):
            params = dict(zip(keys, values))
            if params["k1.two_pass"] and params["k1.recompute"]:
                continue
            if not params["k1.two_pass"] and params["k1.block_col"] != d["k1.block_col"][0]:
                continue  # single pass ignores block_col: keep one representative
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
        """Size of the cartesian product before constraints."""
        n = 1
        for v in self.domains().values():
            n *= len(v)
        return n

    # ---- seeding
    def strategies(self) -> list[BackwardConfig]:
        """Structurally different configs a local search around the default would not reach: for wide rows,
        single pass keeping the raw tile (recompute) or pipelining through shared memory, and two-pass on
        multi-row tiles (H100 exploration: a 4x2048 two-pass tile ran LayerNorm 512x16384 in 33 µs where the
        single-pass default took 52)."""
        p, base = self.problem, default_config(self.problem)
        if next_power_of_two(p.N) < 4096:
            return []
        k1 = base.kernel_1
        alts = []
        if not k1.two_pass:
            alts += [dataclasses.replace(k1, recompute=True, prefetch=False),
                     dataclasses.replace(k1, prefetch=False, num_stages=3)]
        for block_row, block_col, warps in ((4, 2048, 8), (2, 4096, 8), (1, 4096, 8)):
            if block_col < next_power_of_two(p.N):
                alts.append(Kernel1Config(block_row=block_row, block_col=block_col, num_warps=warps,
                                          programs_per_sm=1, two_pass=True, eviction_policy="evict_first",
                                          prefetch=True))
        out = []
        for k in alts:
            cfg = BackwardConfig(k, base.kernel_2)
            if self.why_not(cfg) is None:
                out.append(self.canonical(cfg))
        return out

    def seeds(self) -> list[BackwardConfig]:
        """The analytic default, structural alternatives (`strategies`) and the default's one-step neighbours
        (each knob moved to the adjacent domain value)."""
        base = self.canonical(default_config(self.problem))
        out = [base] + self.strategies()
        d = self.domains()
        params = self.params(base)
        for key, dom in d.items():
            if key == "k1.block_col" and not base.kernel_1.two_pass:
                continue
            cur = params.get(key)
            if cur not in dom:
                continue
            i = dom.index(cur)
            for j in (i - 1, i + 1):
                if 0 <= j < len(dom):
                    cand = self.config({**params, key: dom[j]})
                    if self.why_not(cand) is None and cand not in out:
                        out.append(self.canonical(cand))
        return list(dict.fromkeys(out))
