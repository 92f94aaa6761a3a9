"""The gate a tune's table passes before it is written: on every shape the tune knows (the fitted ones and the
generated held-out ones) the table's config must not be slower than the analytic default's, nor than the incumbent
table's, by more than `compare`'s threshold and beyond the measured spread (`spread.slower_beyond_spread`, the
rule `normtune compare` fails a table by). Times come from what the tune measured (its sweeps, re-measurements
and validations); a pair nobody timed is timed head to head while time allows, else the shape is listed untimed.
So is a pair whose stored medians say the table is slower, however slightly (`Check.slower_in_median`): a sweep
times each config on its own, often cut short by its race, and a table config measured within the spread of the
default there can be clearly slower than it head to head, which is how `compare` times them. A config timed that
did not run correctly counts as slower than any (`FAILED`).

A rule that loses only on shapes it was not fitted on keeps its config where it was fitted: a rule carved out of
it just before it takes the shapes it lost on, with the incumbent's config (or the default's) for them, bounded
between the lost shapes and the fitted ones in rows or in width, whichever separates them more (`carve`). A rule
that cannot be carved, or that loses on a shape it was fitted on, falls back as a whole: to the incumbent table's
config where the incumbent runs every shape the rule was fitted on and every shape it lost on with one config;
else to the analytic default where those shapes share one; else the rule goes (its shapes fall to the next rule; a
family's last rule takes the family with it, whose shapes then run the default). The shapes are checked again, at
most MAX_PASSES times; what still loses is listed."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

from normtune.kernels.config import BackwardConfig, Problem, ProblemFamily, default_config
from normtune.kernels.select.tables import TableError, parse_table

from ..measure.spread import Ratio, Timing, slower_beyond_spread
from ..tables.compare import THRESHOLD, config_for
from ..tables.fit import single_pass_threshold

MAX_PASSES = 3
# The time of a config that was timed and did not run correctly (a compile error, a wrong result): slower than any.
FAILED = Timing(math.inf, math.inf, math.inf, 0)

Lookup = Callable[[Problem, BackwardConfig], "Timing | None"]
Timer = Callable[[Problem, dict], dict]  # (problem, {name: config}) -> {name: Timing | None}


@dataclass
class Check:
    problem: Problem
    config: BackwardConfig  # the table's, as it runs on this device
    against: dict[str, BackwardConfig]  # "default", and "incumbent" where there is one
    times: dict[str, Timing | None]  # by name, "table" included
    retimed: bool = False  # timed head to head because the stored medians had the table slower inside the spread
    unconfirmed: bool = False  # such a check not timed head to head (no timer, or out of time)

    @property
    def verdict(self) -> str:
        differing = [k for k, c in self.against.items() if c != self.config]
        if not differing:
            return "same config"
        table = self.times.get("table")
        for name in differing:
            other = self.times.get(name)
            if table is not None and other is not None and slower_beyond_spread(table, other, THRESHOLD):
                return f"slower than {name}"
        if table is None or any(self.times.get(k) is None for k in differing):
            return "untimed"
        return "ok"

    @property
    def fails(self) -> bool:
        return self.verdict.startswith("slower")

    @property
    def slower_in_median(self) -> bool:
        """The table's time is known and a differing config's median is below it (inside the spread or not)."""
        table = self.times.get("table")
        return table is not None and any(
            c != self.config and (t := self.times.get(k)) is not None and t.median < table.median
            for k, c in self.against.items())

    def to_dict(self) -> dict:
        def ratio(name):
            r = Ratio.of(self.times.get("table"), self.times.get(name))
            return None if r is None else round(r.value, 4)

        return {"problem": self.problem.key, "verdict": self.verdict, "config": self.config.to_dict(),
                "table_vs": {k: ratio(k) for k in self.against}}


def check(table, problems: list[Problem], incumbent, limits, lookup: Lookup, timer: Timer | None) -> list[Check]:
    """One `Check` per problem: `table` (None: no table) against the default and `incumbent`, from `lookup`'s
    times; a check left untimed, or whose times have the table slower in median (`Check.slower_in_median`), is
    timed head to head by `timer` (None: never)."""
    out = []
    for p in problems:
        config = config_for(table, p, limits)
        against = {"default": default_config(p, limits)}
        if incumbent is not None:
            against["incumbent"] = config_for(incumbent, p, limits)
        named = {"table": config, **against}
        times = {k: lookup(p, c) for k, c in named.items()}
        row = Check(p, config, against, times)
        doubted = row.verdict == "ok" and row.slower_in_median
        if (row.verdict == "untimed" or doubted) and timer is not None:  # all of them head to head
            timed = timer(p, named)
            if timed:
                row.times = {k: timed.get(k) or FAILED for k in named}
                row.retimed = doubted
        row.unconfirmed = doubted and not row.retimed
        out.append(row)
    return out


def timed_once(timer: Timer | None) -> Timer | None:
    """`timer`, timing a problem's configs head to head once: the gate checks its shapes again after each
    pass of fall-backs, and a shape whose configs did not change keeps the times it got."""
    if timer is None:
        return None
    done: dict[tuple, dict] = {}

    def timed(problem: Problem, named: dict) -> dict:
        key = (problem.key, tuple(sorted((k, c.to_json()) for k, c in named.items())))
        if key not in done:
            got = timer(problem, named)
            if not got:  # out of time: nothing to keep
                return got
            done[key] = got
        return done[key]

    return timed


def _fitted(family_key: str, rule: dict) -> list[Problem]:
    family = ProblemFamily.from_key(family_key)
    return [family.problem(*map(int, s.split("x"))) for s in rule.get("fitted_on", [])]


def _one(configs) -> BackwardConfig | None:
    found = set(configs)
    return found.pop() if len(found) == 1 and None not in found else None


def _replacement(current: BackwardConfig, incumbent_shapes: list[Problem], default_shapes: list[Problem], incumbent,
                 limits) -> tuple[BackwardConfig | None, str]:
    """(the config a losing rule's shapes take instead of `current`, from what): the incumbent's where it runs
    `incumbent_shapes` with one config, else the analytic default where `default_shapes` share one; (None,
    "removed") where neither differs from `current`."""
    if incumbent is not None:
        kept = _one(incumbent.lookup(p) for p in incumbent_shapes)
        if kept is not None and kept != current:
            return kept, "incumbent"
    default = _one(default_config(p, limits) for p in default_shapes)
    if default is not None and default != current:
        return default, "default"
    return None, "removed"


def _carve_bounds(rule: dict, lost: list[Problem]) -> list[tuple[int | None, int | None]]:
    """(n_max, m_max) of a rule inserted before `rule` that takes every `lost` shape and none of the shapes `rule`
    was fitted on: split at the geometric middle of the gap between them, in rows or in width, the wider gap (in
    ratio) first. Empty where the fitted shapes are not all past the lost ones in either dimension."""
    fitted = [tuple(map(int, s.split("x"))) for s in rule.get("fitted_on", [])]
    options = []
    for axis in (0, 1):  # rows (m_max), then width (n_max)
        top = max((p.M, p.N)[axis] for p in lost)
        above = [f[axis] for f in fitted if f[axis] > top]
        if fitted and len(above) == len(fitted):
            cut = max(top, int(math.sqrt(top * min(above))))
            bounds = (rule.get("n_max"), cut) if axis == 0 else (cut, rule.get("m_max"))
            options.append((min(above) / top, bounds))
    return [b for _, b in sorted(options, reverse=True)]


def carve(raw: dict, family_key: str, index: int, lost: list[Problem], incumbent, limits) -> tuple[dict, dict] | None:
    """`raw` with a rule inserted before rule `index` of `family_key` that gives the `lost` shapes the incumbent's
    config for them (or the analytic default's), and the inserted rule; None where no single config serves them,
    a lost shape is one the rule was fitted on, or no carve-out keeps the table valid."""
    rule = raw["families"][family_key]["rules"][index]
    if {f"{p.M}x{p.N}" for p in lost} & set(rule.get("fitted_on", [])):
        return None
    config, _ = _replacement(BackwardConfig.from_dict(rule["config"]), lost, lost, incumbent, limits)
    if config is None:
        return None
    for n_max, m_max in _carve_bounds(rule, lost):
        new_rule = {"config": config.to_dict(), "fitted_on": sorted(f"{p.M}x{p.N}" for p in lost),
                    "m_max": m_max, "n_max": n_max, "carved_from": index + 1}
        trial = copy.deepcopy(raw)
        trial["families"][family_key]["rules"].insert(index, new_rule)
        try:
            parse_table(trial, "<gated table>")
        except TableError:
            continue
        return trial, new_rule
    return None


def _fallback(family_key: str, rule: dict, lost: list[Problem], incumbent, limits) -> tuple[BackwardConfig | None, str]:
    """(the config the losing rule falls back to, to what) or (None, "removed")."""
    fitted = _fitted(family_key, rule)
    return _replacement(BackwardConfig.from_dict(rule["config"]), fitted + lost, fitted or lost, incumbent, limits)


def fall_back(raw: dict, failing: list[Check], incumbent, limits) -> tuple[dict | None, list[dict]]:
    """`raw` with each rule that answered a failing check fallen back (see the module docstring); None when no
    family is left. Returns (the new table, one record per rule changed)."""
    table = parse_table(raw, "<gated table>")
    lost: dict[tuple[str, int], list[Problem]] = {}
    for c in failing:
        match = table.match(c.problem)
        if match.rule is not None and match.exact_family:
            lost.setdefault((match.family_key, match.index), []).append(c.problem)
    new = copy.deepcopy(raw)
    edits = []
    for (key, index), problems in sorted(lost.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        rules = new["families"][key]["rules"]
        rule = rules[index]
        edit = {"family": key, "rule": index + 1, "fitted_on": rule.get("fitted_on", []),
                "lost_on": [f"{p.M}x{p.N}" for p in problems], "config": rule["config"]}
        carved = carve(new, key, index, problems, incumbent, limits)
        if carved is not None:
            new, inserted = carved
            bounds = ", ".join(f"{k} {inserted[k]}" for k in ("n_max", "m_max") if inserted[k] is not None)
            edits.append({**edit, "to": f"carved out ({bounds})", "new_config": inserted["config"]})
            continue
        config, to = _fallback(key, rule, problems, incumbent, limits)
        edit["to"] = to
        if config is not None:
            trial = copy.deepcopy(new)
            trial["families"][key]["rules"][index]["config"] = config.to_dict()
            try:
                parse_table(trial, "<gated table>")
                new = trial
                edits.append({**edit, "new_config": config.to_dict()})
                continue
            except TableError:
                edit["to"] = "removed"
        del rules[index]
        edits.append(edit)
    for key in sorted({e["family"] for e in edits}):
        family = new["families"][key]
        if not family["rules"]:
            del new["families"][key]
        else:
            family["single_pass_max_n"] = single_pass_threshold(family["rules"])
    return (new if new["families"] else None), edits


def gate(raw: dict, problems: list[Problem], incumbent, limits, lookup: Lookup,
         timer: Timer | None = None) -> tuple[dict | None, dict]:
    """The table that passes (None: no rule does), and the gate's record: the final checks, the fall-backs."""
    table = parse_table(raw, "<gated table>")
    timer = timed_once(timer)
    checks = check(table, problems, incumbent, limits, lookup, timer)
    retimed = {c.problem.key for c in checks if c.retimed}
    edits: list[dict] = []
    for _ in range(MAX_PASSES):
        failing = [c for c in checks if c.fails]
        if not failing or raw is None:
            break
        raw, changed = fall_back(raw, failing, incumbent, limits)
        if not changed:
            break
        edits += changed
        checks = check(parse_table(raw, "<gated table>") if raw else None, problems, incumbent, limits, lookup, timer)
        retimed |= {c.problem.key for c in checks if c.retimed}
    verdicts: dict[str, int] = {}
    for c in checks:
        verdicts[c.verdict] = verdicts.get(c.verdict, 0) + 1
    record = {"shapes": len(checks), "verdicts": verdicts, "fall_backs": edits,
              "retimed": sorted(retimed),  # timed head to head in any pass for `Check.slower_in_median`
              "still_slower": [c.to_dict() for c in checks if c.fails],
              "untimed": [c.problem.key for c in checks if c.verdict == "untimed" or c.unconfirmed]}
    return raw, record
