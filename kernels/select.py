"""Which backward config runs: an explicit `config=` → a heuristic table (see `tables.py`) → the analytic
default."""

from __future__ import annotations

import functools

from .config import BackwardConfig, Problem
from .heuristics import default_config
from .tables import table_for


@functools.lru_cache(maxsize=4096)
def select_config(problem: Problem, device_name: str | None = None,
                  capability: tuple[int, int] | None = None) -> BackwardConfig:
    """The config the runtime uses for `problem` on the named device (None: no device, no table).

    Cached: a problem is looked up once per process.
    """
    table = table_for(device_name, capability)
    if table is not None:
        config = table.lookup(problem)
        if config is not None:
            return config
    return default_config(problem)


def resolve_config(problem: Problem, config: BackwardConfig | str | None, device_name: str | None,
                   capability: tuple[int, int] | None = None) -> BackwardConfig:
    """An explicit config (value or JSON text) wins, after validation against the problem."""
    if config is None or config == "":
        return select_config(problem, device_name, capability)
    if isinstance(config, str):
        config = BackwardConfig.from_json(config)
    return config.validate(problem)


def clear_caches() -> None:
    """Forget loaded tables and selections (after changing $NORMTUNE_CONFIG, e.g. in tests)."""
    from . import tables

    select_config.cache_clear()
    tables.table_for.cache_clear()
    tables.load_table.cache_clear()
    tables.shipped_tables.cache_clear()
    tables._warned.clear()
