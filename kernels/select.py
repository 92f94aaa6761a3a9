"""Which backward config runs: an explicit `config=` → a heuristic table → the analytic default."""

from __future__ import annotations

import functools

from .config import BackwardConfig, Problem, default_config


@functools.lru_cache(maxsize=4096)
def select_config(problem: Problem, device_name: str | None = None) -> BackwardConfig:
    """The config the runtime uses for `problem` on the named device (None: no device-specific table).

    Cached: a problem is looked up once per process.
    """
    return default_config(problem)


def resolve_config(problem: Problem, config: BackwardConfig | str | None, device_name: str | None) -> BackwardConfig:
    """An explicit config (value or JSON text) wins, after validation against the problem."""
    if config is None or config == "":
        return select_config(problem, device_name)
    if isinstance(config, str):
        config = BackwardConfig.from_json(config)
    return config.validate(problem)
