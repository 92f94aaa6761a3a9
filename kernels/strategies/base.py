"""The contract of a kernel_1 strategy, and what strategies share: the search domains of the shared knobs and
the checks every strategy's tile passes (register and shared-memory model).

A strategy is one object (an instance of a `Strategy` subclass, one module each) that the registry
(`registry.py`) lists by name. Everything that depends on which strategy a config uses goes through it:
validation, the analytic default, the search space's domains and conditional knobs, seeds, the grid and the
launch plan. Its config type (`config_type`, a frozen subclass of `Kernel1Config` in its module) holds the
shared knobs and its own, each declared there once with `knob(default, domain)`; no other strategy sees them
(their space, seeds, JSON and stored columns leave them out), and code outside this package asks the strategy
instead of reading them.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Mapping

from .capabilities import checked
from ..heuristics import estimate_registers, register_budget, staged_shared_bytes
from ..knobs import EVICTION_POLICIES, MAX_TILE, NUM_WARPS, Kernel1Config, Knob, own_knobs
from ..limits import DeviceLimits
from ..problem import ConfigError, Problem
from .configs import BackwardConfig

# Search domains of the kernel_1 knobs every strategy shares, in the order the sampler draws them (neighbours in a
# domain are one step apart when seeding). A strategy's own knobs have their domains in its module (`knob`).
KERNEL_1_DOMAINS: dict[str, tuple] = {
    "block_row": (1, 2, 4, 8, 16, 32, 64),
    # two-pass chunk (>= 512) or the columns strategy's slice (<= 1024); single pass derives it from N/row_split
    "block_col": (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    "num_warps": NUM_WARPS,
    "num_stages": (1, 2, 3),
    "programs_per_sm": (0.5, 1, 2, 3, 4),
    "eviction_policy": EVICTION_POLICIES[:2],
    "prefetch": (False, True),
}
KERNEL_2_DOMAINS: dict[str, tuple] = {
    "block_m": (32, 64, 128, 256),
    "block_n": (8, 16, 32, 64, 128),
    "num_warps": (1, 2, 4, 8),
    "num_stages": (1, 2),
    "pdl": (False, True),
    "fused": (False, True),
}


# Largest tile (elements) the search space offers: past it registers spill (`Strategy.largest_tile`).
MAX_SPACE_TILE = 16384


def check_tile(k1: Kernel1Config, problem: Problem, lim: DeviceLimits, *, two_pass: bool = False,
               recompute: bool = False, column_accumulators: bool = False, exchange: bool = False,
               weight_row: bool = False) -> None:
    """The register tile on the device of `lim`: size, idle threads, the register estimate and the staged shared
    memory (the strategy passes the knobs of its own that change them)."""
    if k1.tile() > MAX_TILE:
        raise ConfigError(f"kernel_1 tile block_row x block_col = {k1.tile()} exceeds {MAX_TILE} elements: shrink "
                          "block_row or block_col")
    if k1.num_warps > 1 and lim.warp_size * k1.num_warps > k1.tile():
        raise ConfigError(f"kernel_1.num_warps={k1.num_warps} leaves threads idle on a {k1.block_row}x{k1.block_col} "
                          f"tile: use num_warps <= {max(1, k1.tile() // lim.warp_size)}")
    regs = estimate_registers(problem, k1.block_row, k1.block_col, k1.num_warps, two_pass, k1.prefetch,
                              recompute, column_accumulators, lim.warp_size)
    budget = register_budget(k1.num_warps, lim)
    if regs > budget:
        raise ConfigError(
            f"kernel_1 register budget: a {k1.block_row}x{k1.block_col} tile on {k1.num_warps} warps keeps ~{regs} "
            f"fp32 values per thread (budget {budget} at {k1.num_warps} warps): use more warps, a smaller "
            "block_row, prefetch=false, or two_pass with a narrower block_col")
    staged = staged_shared_bytes(problem, k1.block_row, k1.block_col, k1.num_stages, two_pass, k1.prefetch,
                                 k1.num_warps, exchange, weight_row)
    if staged > lim.shared_per_block:
        raise ConfigError(f"kernel_1.num_stages={k1.num_stages} stages {staged // 1024} KB in shared memory (budget "
                          f"{lim.shared_per_block // 1024} KB on {lim.name}): use fewer stages or a smaller tile")


def fit(config: BackwardConfig, problem: Problem, lim: DeviceLimits) -> BackwardConfig | None:
    """`config` in the device's portable form (`capabilities.portable`) if that is valid there, else None
    (`capabilities.checked`: the launch plan then finds it validated)."""
    try:
        return checked(problem, config, lim)
    except ConfigError:
        return None


def describe_flags(k1: Kernel1Config, own: str = "") -> str:
    """prefetch when on, the strategy's own flags (`own`), and the cache hint, as `BackwardConfig.__str__` shows
    them."""
    return (" prefetch" if k1.prefetch else "") + own + (f" {k1.eviction_policy}" if k1.eviction_policy else "")


class Strategy(ABC):
    """One kernel_1 strategy. A subclass sets `name` and `config_type` (its knobs are that type's fields, each of
    its own declared with `knob`) and defines the five required methods: `validate` (what cannot run),
    `describe` (how a config prints), `programs` (its grid), `offered` (the problems the space offers it for) and
    `config` (sampled params to a config). Every other method is a hook whose default suits a strategy with no
    knobs beyond the shared ones; override those its own knobs need.

    Where they are called: a config's validation (`BackwardConfig.validate`) → `validate`; the launch
    (`backward_launch.py`) → `plan`, `programs`, `partial_rows`; the device's features (`capabilities`) →
    `fallbacks`, `portable`; the search space (`tuner/space.py`) → `offered`, `narrow_domains`, `variants`,
    `enumerated`, `sampled`, `config`, `params`, `canonical`, `why_not`, `largest_tile`; the seeds
    (`tuner/seeds.py`) → `default`, `seeds`, `neighbour`, `expand_seeds`; a table's rule on other problems
    (`kernels/select/adapt.py`) → `adapt`, `holds_rows`, `whole_rows`, `walks_twice`, `carry_over`.
    """

    name: str = ""
    config_type: type = Kernel1Config  # its own frozen subclass of Kernel1Config, whose `strategy` is `name`
    sweeps_rows = False  # its column programs sweep every row: offered only for few rows, time grows with M
    # The fields of BackwardConfig.kernel_2 it launches with ("all", or the names of the ones it reads).
    kernel_2_knobs: tuple[str, ...] = tuple(KERNEL_2_DOMAINS)
    # Knobs ('k1.…') the sampler draws right after the strategy: whether its other knobs apply depends on them.
    decided_first: tuple[str, ...] = ()

    # ---- the config
    @property
    def knobs(self) -> tuple[Knob, ...]:
        """The knobs of its own (its config type's fields beyond the shared ones), in declaration order."""
        return own_knobs(self.config_type)

    def make(self, **fields) -> Kernel1Config:
        """A kernel_1 config of this strategy (knobs left out at their defaults)."""
        return self.config_type(**fields)

    def knob_values(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Its own knobs' values in sampled params ('k1.<name>'), each at its default where absent."""
        return {k.name: params.get(f"k1.{k.name}", k.default) for k in self.knobs}

    @abstractmethod
    def validate(self, config: BackwardConfig, problem: Problem, lim: DeviceLimits) -> None:
        """Raise `ConfigError` naming the field if the combination cannot run `problem` on the device of `lim`
        (each field's type and range, and each own knob's domain, are checked before)."""

    @abstractmethod
    def describe(self, config: BackwardConfig) -> str:
        """The config as `str(config)` shows it (`describe_knobs` adds the own knobs it does not show itself)."""

    def describe_knobs(self, k1: Kernel1Config, shown: tuple[str, ...] = ()) -> str:
        """' name=value' for each knob of its own not at its default, but those named in `shown`."""
        return "".join(f" {k.name}={getattr(k1, k.name)}" for k in self.knobs
                       if k.name not in shown and getattr(k1, k.name) != k.default)

    # ---- the launch plan and the grid
    def plan(self, problem: Problem, config: BackwardConfig, target, int64: bool, hint: int,
             column_groups: int = 1):
        """Its launch plan (`backward_launch.py`'s `plan`): the `plan` of its module `<name>_launch` in this
        package, imported on the first plan (it imports Triton and the kernels; the strategy modules do not).
        `column_groups` > 1: that many groups of `problem.N` columns side by side, each its own problem, in one
        launch of each kernel (`backward/common.column_group`; passed on only then, so that a module's `plan` of
        five arguments runs every ungrouped problem)."""
        module = importlib.import_module(f"{__package__}.{self.name}_launch")
        if column_groups > 1:
            return module.plan(problem, config, target, int64, hint, column_groups)
        return module.plan(problem, config, target, int64, hint)

    @abstractmethod
    def programs(self, M: int, N: int, config: BackwardConfig, sms: int) -> int:
        """Programs kernel_1 launches for M > 0 rows."""

    def partial_rows(self, M: int, config: BackwardConfig, sms: int) -> int:
        """Rows of the fp32 partial dw/db buffers kernel_1 writes (none unless overridden)."""
        return 0

    # ---- the device's features (`capabilities`)
    def fallbacks(self, k1: Kernel1Config, limits: DeviceLimits) -> list[str]:
        """One line per knob of its own that asks for a feature the device of `limits` lacks (none by default)."""
        return []

    def portable(self, k1: Kernel1Config, limits: DeviceLimits) -> Kernel1Config:
        """`k1` without the features of its own knobs that the device lacks (`k1` itself by default)."""
        return k1

    # ---- what a table's config does on other problems
    def holds_rows(self, k1: Kernel1Config) -> bool:
        """Whether the config sizes its register tile for the element size it was fitted on (`adapt`)."""
        return False

    def whole_rows(self, k1: Kernel1Config) -> bool:
        """Whether one program holds whole rows in a single pass (what the dual strategy can take over)."""
        return False

    def walks_twice(self, k1: Kernel1Config) -> bool:
        """Whether the config walks each row twice, in column chunks (a table's learned single-pass threshold
        stops at the first rule that does)."""
        return False

    def carry_over(self, config: BackwardConfig, problem: Problem, stand_in: str,
                   factor: int) -> tuple[BackwardConfig | None, str]:
        """A `holds_rows` config fitted on dtype `stand_in` for `problem`'s rows, of `factor` times its element
        size (`adapt.carried_over`), or None and why it does not carry over."""
        return None, f"its config holds whole {stand_in} rows in registers"

    def adapt(self, config: BackwardConfig, problem: Problem, sm_count: int | None,
              limits: DeviceLimits | None = None) -> BackwardConfig | None:
        """A table rule's config made valid for another problem on the device of `limits` (`select/adapt.py`;
        validated through `capabilities.fits`); None: the default."""
        return None

    # ---- the search space (`tuner/space.py`)
    @abstractmethod
    def offered(self, problem: Problem) -> bool:
        """Whether the space offers this strategy for `problem`."""

    def narrow_domains(self, domains: dict[str, tuple], problem: Problem, lim: DeviceLimits) -> None:
        """Narrow the domains of its own knobs to `problem` on the device of `lim`, in place (`Space.domains`)."""

    def largest_tile(self, k1: Kernel1Config) -> int:
        """The largest register tile (elements) the space offers for `k1`."""
        return MAX_SPACE_TILE

    def why_not(self, config: BackwardConfig, space) -> str | None:
        """A constraint of its own knobs that `config` breaks in the space (`Space.why_not`), else None."""
        return None

    def variants(self, domains: Mapping[str, tuple]) -> tuple[dict, ...]:
        """The values of the knobs decided first (`decided_first`) the space enumerates, one dict per variant."""
        return ({},)

    def knows(self, key: str) -> bool:
        """Whether knob `key` ('k1.…', 'k2.…') is one of its configs' (a shared knob, or one of its own)."""
        if key.startswith("k2."):
            return True
        name = key[3:]
        return name in KERNEL_1_DOMAINS or any(k.name == name for k in self.knobs)

    def sampled(self, key: str, params: Mapping[str, Any]) -> bool:
        """Whether knob `key` changes the launch given the knobs decided before it in `params` (the sampler fixes
        the others to their domain's first value, so that it does not learn from values that changed nothing).
        Another strategy's knobs never do."""
        if key.startswith("k2."):
            return key[3:] in self.kernel_2_knobs
        return self.knows(key)

    def enumerated(self, key: str, variant: Mapping[str, Any]) -> bool:
        """Whether the space's enumeration walks knob `key`'s domain for this variant (else its first value)."""
        return self.sampled(key, variant)

    @abstractmethod
    def config(self, problem: Problem, params: Mapping[str, Any], space) -> BackwardConfig:
        """Sampled params ('k1.block_row', …; those of its knobs) → this strategy's config."""

    def params(self, config: BackwardConfig, params: dict[str, Any], domains: Mapping[str, tuple]) -> None:
        """Set the knobs `config` does not use to their domain's first value in `params` (`Space.params`)."""
        for key in domains:
            if key != "k1.strategy" and key in params and not self.sampled(key, params):
                params[key] = domains[key][0]

    def canonical(self, config: BackwardConfig, space) -> tuple[BackwardConfig, bool]:
        """One spelling of knobs that do not change this strategy's launch; True if the grid knob
        (programs_per_sm) is still to be canonicalized."""
        return config, True

    # ---- defaults and seeds (`tuner/seeds.py`)
    def default(self, problem: Problem, lim: DeviceLimits) -> BackwardConfig | None:
        """The analytic default for `problem` on the device of `lim` when this strategy should run it, else None
        (`default_config` asks the strategies in `DEFAULT_ORDER`): a config valid there that asks for no feature
        the device lacks (`fit`)."""
        return None

    def seeds(self, space, default: BackwardConfig) -> list[BackwardConfig]:
        """Configs of this strategy a local search around the default would not reach (`tuner/seeds.py`)."""
        return []

    def neighbour(self, key: str, value: Any, k1: Kernel1Config, problem: Problem) -> bool:
        """Whether the seeds take the one-step neighbour of `k1` (a default of this strategy) that moves knob `key`
        to `value`. A column tile derived from N is not moved."""
        return key != "k1.block_col"

    def expand_seeds(self, space, configs: list[BackwardConfig]) -> list[BackwardConfig]:
        """Further seeds derived from the others (after every strategy's `seeds`)."""
        return []
