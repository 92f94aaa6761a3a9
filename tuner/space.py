"""The search space: declared domains for every launch knob of both kernels, and declared constraints that prune
configs before anything is compiled.

The knobs are the fields of `Kernel1Config` / `Kernel2Config` (the single definition): a test checks that every
field has a domain here. Constraints are `BackwardConfig.validate` (what cannot run) plus redundancy pruning
(what would time the same kernels as another config: e.g. grids that collapse to the same program count), so
that enumeration yields each distinct launch once. Where a sweep starts (the seeds) is `seeds.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from normtune.kernels.capabilities import fallbacks, portable
from normtune.kernels.config import BackwardConfig, Kernel1Config, Kernel2Config, Problem
from normtune.kernels.limits import REFERENCE, DeviceLimits
from normtune.kernels.problem import is_power_of_two
from normtune.kernels.heuristics import (
    MAX_COLUMNS_ROWS,
    MAX_SINGLE_PASS,
    MIN_ELEMENTS_PER_THREAD,
    ROW_SWEEPING,
    max_warps,
    next_power_of_two,
    num_programs,
    row_block_col,
    slice_width,
)


# Domains (ordered: neighbours in a domain are "one step" apart when seeding the search).
K1_DOMAINS: dict[str, tuple] = {
    "strategy": ("rows", "columns", "dual"),
    "two_pass": (False, True),
    # 3, 5, 6, 7: offered only where they cut the row into power-of-two slices (`fitting_split`)
    "row_split": (1, 2, 3, 4, 5, 6, 7, 8),
    "block_row": (1, 2, 4, 8, 16, 32, 64),
    # two-pass chunk (>= 512) or the columns strategy's slice (<= 1024); single pass derives it from N/row_split
    "block_col": (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    "num_warps": (1, 2, 4, 8, 16, 32),
    "num_stages": (1, 2, 3),
    "programs_per_sm": (0.5, 1, 2, 3, 4),
    "eviction_policy": ("", "evict_first"),
    "prefetch": (False, True),
    "recompute": (False, True),
    "column_accumulators": (False, True),
    "pipelined_split": (False, True),  # offered where rows split (decided after row_split and num_stages)
}
K2_DOMAINS: dict[str, tuple] = {
    "block_m": (32, 64, 128, 256),
    "block_n": (8, 16, 32, 64, 128),
    "num_warps": (1, 2, 4, 8),
    "num_stages": (1, 2),
    "pdl": (False, True),
    "fused": (False, True),
}
# Largest tile (elements) the space offers: past it, registers spill on every Hopper config we measured.
MAX_SPACE_TILE = 16384
# ... except with dw/db per column (column_accumulators), which hold block_row times fewer registers: H100 RMSNorm
# 1024x65536, split 8 on 4x8192 tiles (16 warps): 199.0 µs against 233.6 for the best config of the smaller tiles.
MAX_COLUMN_ACC_TILE = 32768
# Narrowest two-pass chunk worth measuring (narrower chunks are the columns strategy's slices).
MIN_TWO_PASS_CHUNK = 512


def fitting_split(N: int, row_split: int) -> bool:
    """The row's slices are exactly one power of two wide: no lane of their tiles is masked. A split of 2, 4 or 8
    does that only for power-of-two rows; 3, 5, 6 and 7 for rows such as 3072, 5120, 12288 and 14336."""
    return N % row_split == 0 and is_power_of_two(N // row_split)


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
    def domains(self) -> dict[str, tuple]:
        p = self.problem
        n_pow2 = next_power_of_two(p.N)
        d: dict[str, tuple] = {f"k1.{k}": v for k, v in K1_DOMAINS.items()}
        d.update({f"k2.{k}": v for k, v in K2_DOMAINS.items()})
        d["k1.strategy"] = tuple(s for s in K1_DOMAINS["strategy"] if s == "rows" or (
            p.M <= MAX_COLUMNS_ROWS and (s == "columns" or n_pow2 <= MAX_SINGLE_PASS)))
        splits = tuple(s for s in K1_DOMAINS["row_split"]
                       if slice_width(p.N, s) <= MAX_SINGLE_PASS and (s == 1 or slice_width(p.N, s) >= 256)
                       and (is_power_of_two(s) or fitting_split(p.N, s)))
        d["k1.row_split"] = splits or (1,)
        if len(d["k1.row_split"]) == 1:
            d["k1.pipelined_split"] = (False,)
        modes = tuple(m for m in K1_DOMAINS["two_pass"] if (m or splits) and (not m or n_pow2 > 1024))
        d["k1.two_pass"] = modes
        d["k1.block_col"] = tuple(c for c in K1_DOMAINS["block_col"] if c < n_pow2) or (min(n_pow2, 32),)
        rows_needed = next_power_of_two(max(1, p.M))
        d["k1.block_row"] = tuple(r for r in K1_DOMAINS["block_row"] if r <= rows_needed) or (1,)
        d["k2.block_n"] = tuple(b for b in K2_DOMAINS["block_n"] if b <= n_pow2) or (n_pow2,)
        lim = self.device  # only what the device has (`capabilities`)
        d["k1.num_warps"] = tuple(w for w in d["k1.num_warps"] if w <= lim.max_warps)
        d["k2.num_warps"] = tuple(w for w in d["k2.num_warps"] if w <= lim.max_warps)
        if not lim.eviction_hints:
            d["k1.eviction_policy"] = ("",)
        if not lim.pdl:
            d["k2.pdl"] = (False,)
        if not lim.inline_ptx:
            d["k1.pipelined_split"] = (False,)
        return d

    def columns_kernel_2(self) -> Kernel2Config:
        """The columns strategy runs no kernel_2: its configs all carry this one (each domain's first value)."""
        return Kernel2Config(**{k[3:]: v[0] for k, v in self.domains().items() if k.startswith("k2.")})

    def config(self, params: Mapping[str, Any]) -> BackwardConfig:
        """Params (as sampled: 'k1.block_row', …) → a config. Single pass derives block_col from N and
        row_split; the columns strategy ignores the rows strategy's knobs and kernel_2 (first domain values)."""
        p = self.problem
        strategy = params.get("k1.strategy", "rows")
        columns, dual = strategy == "columns", strategy == "dual"
        two_pass = bool(params["k1.two_pass"]) and not (columns or dual)
        row_split = 1 if (two_pass or columns or dual) else params.get("k1.row_split", 1)
        single = not (two_pass or columns)
        k1 = Kernel1Config(
            block_row=params["k1.block_row"],
            block_col=params["k1.block_col"] if (two_pass or columns) else row_block_col(p.N, row_split),
            num_warps=params["k1.num_warps"], num_stages=params["k1.num_stages"],
            programs_per_sm=1 if columns else params["k1.programs_per_sm"], two_pass=two_pass,
            eviction_policy=params["k1.eviction_policy"], prefetch=bool(params["k1.prefetch"]),
            recompute=bool(params.get("k1.recompute", False)) and single and not dual,
            column_accumulators=bool(params.get("k1.column_accumulators", False)) and single and not dual,
            row_split=row_split, strategy=strategy,
            pipelined_split=bool(params.get("k1.pipelined_split", False)) and row_split > 1,
        )
        if columns:
            return BackwardConfig(k1, self.columns_kernel_2())
        if dual:  # kernel_2's tile is the column programs'; its launch knobs do not apply
            return BackwardConfig(k1, dataclasses.replace(self.columns_kernel_2(), block_m=params["k2.block_m"],
                                                          block_n=params["k2.block_n"]))
        fused = bool(params.get("k2.fused", False))
        k2 = Kernel2Config(block_m=params["k2.block_m"], block_n=params["k2.block_n"],
                           num_warps=K2_DOMAINS["num_warps"][0] if fused else params["k2.num_warps"],
                           num_stages=params["k2.num_stages"], pdl=bool(params["k2.pdl"]) and not fused,
                           fused=fused)
        return BackwardConfig(k1, k2)

    def params(self, config: BackwardConfig) -> dict[str, Any]:
        """The inverse of `config` (what to enqueue in a study to measure a given config). Knobs a config
        ignores take the first value of their domains."""
        out = {f"k1.{f.name}": getattr(config.kernel_1, f.name) for f in dataclasses.fields(Kernel1Config)}
        out.update({f"k2.{f.name}": getattr(config.kernel_2, f.name) for f in dataclasses.fields(Kernel2Config)})
        d = self.domains()
        k1 = config.kernel_1
        if k1.strategy in ("rows", "dual") and not k1.two_pass:
            out["k1.block_col"] = d["k1.block_col"][0]
        if k1.strategy == "columns":
            out["k1.two_pass"] = d["k1.two_pass"][0]
            out["k1.programs_per_sm"] = d["k1.programs_per_sm"][0]
            out.update({k: v[0] for k, v in d.items() if k.startswith("k2.")})
        if k1.strategy == "columns" or k1.two_pass:
            out["k1.row_split"] = d["k1.row_split"][0]
        if k1.strategy == "dual":
            out["k1.two_pass"] = d["k1.two_pass"][0]
            out["k1.row_split"] = d["k1.row_split"][0]
            out.update({k: v[0] for k, v in d.items() if k.startswith("k2.") and k not in ("k2.block_m", "k2.block_n")})
        return out

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
        largest = MAX_COLUMN_ACC_TILE if k1.column_accumulators else MAX_SPACE_TILE
        if k1.tile() > largest:
            return f"tile {k1.block_row}x{k1.block_col} exceeds the space's {largest} elements"
        if k1.num_warps > max_warps(k1.tile(), self.limits):
            return (f"num_warps={k1.num_warps} gives fewer than {MIN_ELEMENTS_PER_THREAD} elements per thread on a "
                    f"{k1.tile()}-element tile")
        if k1.prefetch and k1.num_stages > 1:
            return "prefetch and num_stages > 1 both pipeline the tile loop: use one"
        if k1.pipelined_split and k1.num_stages == 1:
            return ("pipelined_split with num_stages = 1 issues the same loads as the plain exchange: use "
                    "num_stages > 1")
        if k1.two_pass and k1.block_col < MIN_TWO_PASS_CHUNK:
            return f"two-pass chunks narrower than {MIN_TWO_PASS_CHUNK} columns are the columns strategy's job"
        if k1.strategy in ROW_SWEEPING and self.problem.M > MAX_COLUMNS_ROWS:
            return f"the {k1.strategy} strategy sweeps every row of a column slice: offered up to M={MAX_COLUMNS_ROWS}"
        return None

    def canonical(self, config: BackwardConfig) -> BackwardConfig:
        """Collapse knobs that do not change the launch: row tiles taller than the problem (kept within the
        block_row domain), programs_per_sm values giving the same grid, and features the device lacks (its
        portable form runs)."""
        config = portable(config, self.device)
        rows = self.domains()["k1.block_row"][-1]
        if config.kernel_1.block_row > rows:
            k1 = dataclasses.replace(config.kernel_1, block_row=rows)
            k1 = dataclasses.replace(k1, num_warps=min(k1.num_warps, max_warps(k1.tile(), self.limits)))
            config = dataclasses.replace(config, kernel_1=k1)
        if config.kernel_1.strategy == "columns":  # no grid knob, no kernel_2: one spelling of each
            return BackwardConfig(dataclasses.replace(config.kernel_1, programs_per_sm=1), self.columns_kernel_2())
        if config.kernel_1.strategy == "dual":  # kernel_2's launch knobs do not apply
            config = dataclasses.replace(config, kernel_2=dataclasses.replace(
                self.columns_kernel_2(), block_m=config.kernel_2.block_m, block_n=config.kernel_2.block_n))
        if config.kernel_2.fused:  # kernel_1's warps run the fused reduction; nothing to overlap
            config = dataclasses.replace(config, kernel_2=dataclasses.replace(
                config.kernel_2, num_warps=K2_DOMAINS["num_warps"][0], pdl=False))
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
        """Each distinct launch once: knobs a strategy ignores are fixed to their first value before the product
        (the columns strategy has no kernel_2 and no grid knobs, dual only kernel_2's tile; single pass and dual
        derive block_col)."""
        d = self.domains()
        seen: set[BackwardConfig] = set()
        for strategy in d["k1.strategy"]:
            for two_pass in (d["k1.two_pass"] if strategy == "rows" else d["k1.two_pass"][:1]):
                sub = dict(d, **{"k1.strategy": (strategy,), "k1.two_pass": (two_pass,)})
                if strategy != "rows" or two_pass:
                    sub["k1.row_split"] = d["k1.row_split"][:1]
                    sub["k1.recompute"] = (False,)
                    sub["k1.column_accumulators"] = (False,)
                    sub["k1.pipelined_split"] = (False,)
                if strategy != "columns" and not two_pass:
                    sub["k1.block_col"] = d["k1.block_col"][:1]
                if strategy == "columns":
                    sub["k1.programs_per_sm"] = d["k1.programs_per_sm"][:1]
                    sub.update({k: v[:1] for k, v in d.items() if k.startswith("k2.")})
                if strategy == "dual":
                    sub.update({k: v[:1] for k, v in d.items()
                                if k.startswith("k2.") and k not in ("k2.block_m", "k2.block_n")})
                keys = list(sub)
                for values in itertools.product(*(sub[k] for k in keys)):
                    params = dict(zip(keys, values))
                    if params["k2.fused"] and (params["k2.pdl"] or params["k2.num_warps"] != K2_DOMAINS["num_warps"][0]):
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
        """Size of the cartesian product before constraints."""
        n = 1
        for v in self.domains().values():
            n *= len(v)
        return n

    # ---- seeding (`seeds.py`)
    def strategies(self) -> list[BackwardConfig]:
        """Structurally different configs a local search around the default would not reach."""
        from .seeds import strategies  # seeds.py builds on this module

        return strategies(self)

    def seeds(self) -> list[BackwardConfig]:
        """The analytic default, `strategies` and the default's one-step neighbours, in the order to time them."""
        from .seeds import seeds

        return seeds(self)

    def worth_measuring(self, configs: list[BackwardConfig]) -> list[BackwardConfig]:
        """Canonical forms of the configs that pass the constraints (before and after canonicalization: a
        smaller canonical row tile also gets fewer warps)."""
        out = []
        for cfg in configs:
            if self.why_not(cfg) is None and self.why_not(self.canonical(cfg)) is None:
                out.append(self.canonical(cfg))
        return out
