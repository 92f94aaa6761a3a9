"""Warm start (`--from`): another table's rules as each problem's first seeds, measured like every seed, never trusted.
A problem takes the config of the rule whose bounds hold its shape (inside the table's fitted box or not: a seed only
has to be worth timing), adapted to the shape and the dtype as the runtime would (`kernels/select/adapt.py`), then to
this device (its portable form, checked against its limits: `select.on_device`); the sweep puts it in the study's
first slots, ahead of the analytic default and the structural seeds (`tuner/seeds.py`). `for_problem` is that
adaptation of any config found elsewhere: the rounds' transfers (`transfer.py`) use it too."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from normtune.kernels.config import BackwardConfig, ConfigError, Problem, ProblemFamily
from normtune.kernels.select.tables import (Table, TableError, adapt, carried_over, holds_rows, read_table,
                                            shipped_tables)


def shipped_keys() -> list[str]:
    return sorted({t.gpu_key for t in shipped_tables() if not t.interpret})


def resolve(spec: str) -> Table:
    """The table `--from` names: the shipped table of a GPU key (h100, h200), else a table file."""
    key = spec.strip().lower()
    for table in shipped_tables():
        if not table.interpret and table.gpu_key == key:
            return table
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"--from {spec}: neither the GPU key of a shipped table ({', '.join(shipped_keys())}) nor a "
                         "table file")
    try:
        return read_table(str(path))
    except TableError as err:
        raise ValueError(f"--from {err}") from None


def fingerprint(table: Table) -> str:
    """The table as a tune's identity records it: its label and the digest of its bytes."""
    return f"{table.label} sha256:{hashlib.sha256(Path(table.path).read_bytes()).hexdigest()[:16]}"


def rule_config(table: Table, problem: Problem) -> BackwardConfig | None:
    """The config of the table's rule for `problem`'s shape, ignoring the fitted box, carried over to its dtype
    where the table tuned another (None: no family of this norm, or nothing carries); `for_problem` adapts it."""
    key = table.family_key(problem.family)
    if key is None:
        return None
    rules = table.families[key]
    rule = next((r for r in rules if r.matches(problem.M, problem.N)), None)
    if rule is None:  # past every bound: the widest rule, largest M range
        widest = max((r.n_max or 0) for r in rules)
        rule = [r for r in rules if (r.n_max or 0) == widest][-1]
    config = rule.config
    stand_in = ProblemFamily.from_key(key).dtype
    if stand_in != problem.dtype and holds_rows(config):
        config, _ = carried_over(config, stand_in, problem)
        if config is None:
            return None
    return config


def worth_measuring(config: BackwardConfig, space) -> BackwardConfig | None:
    """`config` as the sweep's search space measures it (`Space.canonical`), with kernel_1's warps halved until
    the space takes it (a tile shrunk to a narrower row than the rule's leaves too few elements per thread for
    its warps); None when no warp count does."""
    config = space.canonical(config)
    warps = config.kernel_1.num_warps
    while warps >= 1:
        candidate = dataclasses.replace(config, kernel_1=dataclasses.replace(config.kernel_1, num_warps=warps))
        if space.why_not(candidate) is None:
            return candidate
        warps //= 2
    return None


def for_problem(config: BackwardConfig, problem: Problem, space, limits, sm_count: int | None
                ) -> BackwardConfig | None:
    """A config found on another shape (a table's rule, another problem's best) as `problem`'s search space
    `space` measures it: adapted to the shape as the runtime would, then to this device (`limits`: its portable
    form, checked against its limits), validated, `worth_measuring`; None where it does not run there."""
    from normtune.kernels.select.select import on_device

    config, _ = on_device(adapt(config, problem, sm_count), problem, limits)
    try:
        config.validate(problem)
    except ConfigError:
        return None
    return worth_measuring(config, space)


def seeds(table: Table, problems: list[Problem], limits, sm_count: int | None) -> dict[str, list[dict]]:
    """Problem key → [the table's config for it, on this device, as the search space measures it] (problems it
    gives nothing the space takes are left out)."""
    from ..space import Space

    out = {}
    for p in problems:
        config = rule_config(table, p)
        if config is not None:
            config = for_problem(config, p, Space(p, sm_count, limits), limits, sm_count)
        if config is not None:
            out[p.key] = [config.to_dict()]
    return out
