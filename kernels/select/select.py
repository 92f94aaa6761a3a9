"""Which backward config runs: an explicit `config=` → a heuristic table (the chain in `table_chain.py`, the
rules in `tables.py`) → the analytic default. `explain` says which and why; `select_config` is its config."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import table_chain, tables
from ..strategies.capabilities import checked, clear_checked, fallbacks
from ..config import BackwardConfig, Problem
from ..limits import DeviceLimits
from ..strategies import default_config
from .table_chain import Step, choose_table, warn_once
from .tables import RuleMatch, Table


@dataclass(frozen=True)
class Explanation:
    """Why `config` runs `problem`: the chain's steps, the table they gave (None: no table), how its rules
    answered (None without a table; `match.config` None: no rule applies) and the config that runs (in the
    device's portable form: `fallbacks` says what the device lacked of the table's config)."""

    problem: Problem
    steps: tuple[Step, ...]
    table: Table | None
    match: RuleMatch | None
    config: BackwardConfig
    fallbacks: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """One line: the rule that gave the config, or why the analytic default runs."""
        if self.match is None:
            return "no table → the analytic default"
        return self.match.reason(self.problem)

    def to_dict(self) -> dict:
        m = self.match
        return {
            "problem": self.problem.key,
            "chain": [{"source": s.source, "detail": s.detail, "path": s.path, "taken": s.taken} for s in self.steps],
            "table": self.table.label if self.table else None,
            "family": m.family_key if m else None,
            "rule": m.index + 1 if m and m.index is not None else None,
            "reason": self.reason,
            "source": "table" if m and m.config is not None else "default",
            "config": self.config.to_dict(),
            "fallbacks": list(self.fallbacks),
        }


def explain(problem: Problem, device_name: str | None = None, capability: tuple[int, int] | None = None, *,
            config_file: str | None = None, warn: bool = False, limits: DeviceLimits | None = None) -> Explanation:
    """Walk the chain for `problem` on the named device (a device name or a GPU key; None: no GPU) and record
    every step. `warn`: give the runtime's one-time warnings for a fallback table. `limits`: the device's
    (`device.device_limits`), which size the analytic default and say which features it lacks; None: the
    reference device's."""
    choice = choose_table(device_name, capability, config_file)
    if warn:
        warn_once(choice.warning)
    match = choice.table.match(problem, limits) if choice.table is not None else None
    if match is not None and match.config is not None:
        config, lacking = on_device(match.config, problem, limits)
    else:
        config, lacking = default_config(problem, limits), ()
    return Explanation(problem, choice.steps, choice.table, match, config, lacking)


def on_device(config: BackwardConfig, problem: Problem,
              limits: DeviceLimits | None) -> tuple[BackwardConfig, tuple[str, ...]]:
    """(what runs, what the device lacked) for a table's `config` on the device of `limits` (None: the
    reference device, the config as it is): its portable form if that fits the device, else the analytic
    default sized for it."""
    if limits is None:
        return config, ()
    lacking = tuple(fallbacks(config, limits))
    try:
        config = checked(problem, config, limits)
    except ValueError as err:
        lacking += (f"the table's config does not fit {limits.name} ({err}): the analytic default runs",)
        config = default_config(problem, limits)
    return config, lacking


@functools.lru_cache(maxsize=4096)
def select_config(problem: Problem, device_name: str | None = None,
                  capability: tuple[int, int] | None = None, limits: DeviceLimits | None = None) -> BackwardConfig:
    """The config the runtime uses for `problem` on the named device (None: no device, no table), whose limits
    are `limits` (None: the reference device's).

    Cached: a problem is looked up once per process.
    """
    return explain(problem, device_name, capability, warn=True, limits=limits).config


def resolve_config(problem: Problem, config: BackwardConfig | str | None, device_name: str | None,
                   capability: tuple[int, int] | None = None, limits: DeviceLimits | None = None) -> BackwardConfig:
    """An explicit config (value or JSON text) wins, after validation against the problem on the device of
    `limits` (`capabilities.checked`: in its portable form there, once per problem, config and device)."""
    if config is None or config == "":
        return select_config(problem, device_name, capability, limits)
    if isinstance(config, str):
        config = parsed_config(config)
    checked(problem, config, limits)
    return config


@functools.lru_cache(maxsize=256)
def parsed_config(text: str) -> BackwardConfig:
    """`BackwardConfig.from_json`, once per text (a config passed as JSON on every call is parsed once)."""
    return BackwardConfig.from_json(text)


# What else remembers selections, forgotten with them (`on_clear`: the custom ops' resolved calls).
_CLEAR_HOOKS: list = []


def on_clear(hook) -> None:
    """Call `hook()` whenever `clear_caches` runs (a module above this one that caches what it selected)."""
    _CLEAR_HOOKS.append(hook)


def clear_caches() -> None:
    """Forget loaded tables, chain walks and selections (after changing $NORMTUNE_CONFIG or $NORMTUNE_HOME, e.g. in
    tests)."""
    for hook in _CLEAR_HOOKS:
        hook()
    select_config.cache_clear()
    clear_checked()
    table_chain.choose_table.cache_clear()
    tables.load_table.cache_clear()
    tables.shipped_tables.cache_clear()
    table_chain._warned.clear()
