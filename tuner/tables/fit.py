"""The fitting step of `normtune emit`: rules from the measured times of a config x problem matrix.

Fitting, per problem family (norm, dtypes, flags):
1. N buckets: each measured N closes a bucket (previous N, N]; the last bucket is unbounded above.
2. A config x problem matrix of measured times within each bucket: every config measured on a problem (the
   sweep's trials, plus "neighbor" re-measurements: `remeasure.py` times each problem's top configs on the other
   problems of its bucket, and the adjacent buckets' top configs adapted to this N).
3. Rules: for a group of problems, the config minimizing the geometric-mean regret (time / that problem's
   best) over the group, among configs measured on all of them and *never slower than the analytic default*
   beyond the measured spread on any of them (`spread.slower_beyond_spread`). A config that would have won but
   loses to the default is recorded under the family's "dropped". A config that beats the default by no more
   than DEFAULT_TIE on every problem gives way to the default itself (where the group shares one): a knob
   leaves its analytic value only where that was measured to pay, since a win inside the spread on the fitted
   problems can turn into a loss on the unseen ones (docs/perf-notes.md, "Why the tuner fits as it does"). A bucket is
   split on M (at most into three M ranges) only when a split lowers the mean regret by more than SPLIT_GAIN:
   rules that generalize beat rules that memorize. An M range ends at the geometric midpoint between its largest
   fitted M and the next range's smallest (`m_boundary`), or where the two ranges' configs' measured times cross
   between those two problems when both were timed on both (`m_crossover`). A width fitted on few rows only
   leaves taller rows to the next wider width's rules (`top_boundary`).
4. With an incumbent table (`emit --keep`, `incumbent.py`), a group keeps its config unless the new winner is
   faster beyond the spread somewhere in it; no config is chosen that is slower beyond the spread than the
   incumbent's on a problem where both were timed (what `normtune compare` fails a table for); and an M split
   that leaves a group with its incumbent's config pays no SPLIT_GAIN for it: the new winner takes only the rows
   where it pays, rather than the whole group on a win in some rows and a loss inside the spread in others.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from normtune.kernels.config import BackwardConfig, ConfigError, Problem, ProblemFamily, default_config
from normtune.kernels.heuristics import MAX_COLUMNS_ROWS, next_power_of_two
from normtune.kernels.limits import DeviceLimits

from ..render import geomean
from ..measure.spread import Timing, slower_beyond_spread

SPLIT_GAIN = 0.01  # a split on M must lower the group's mean regret by more than this fraction
MAX_GROUPS = 3
DEFAULT_TIE = 0.01  # a rule keeps the analytic default unless a config beats it by more than this fraction somewhere

Data = dict[Problem, dict[BackwardConfig, Timing]]


@dataclass
class Fitted:
    family: ProblemFamily
    rules: list[dict]
    expected_us: dict[str, float]
    regret: dict[str, float]
    dropped: list[dict] = field(default_factory=list)
    default_unmeasured: list[str] = field(default_factory=list)



def default_in(data: Data, sm_count: int | None, limits: DeviceLimits | None = None) -> dict[Problem, BackwardConfig]:
    """Problem → the measured config that is today's analytic default on the device of `limits` (the reference
    device without; as `default_config` returns it, or in the canonical form the sweep seeds it), for the
    problems where it was measured."""
    from ..space import Space

    out = {}
    for p, cfgs in data.items():
        try:
            default = default_config(p, limits)
        except ConfigError:
            continue
        forms = [default] + ([Space(p, sm_count, limits).canonical(default)] if sm_count else [])
        found = [c for c in forms if c in cfgs]
        if found:
            out[p] = found[0]
    return out


class _Fit:
    """Rule choice for one family: `data`, each problem's best median, its measured default and the config the
    incumbent table runs it with (`emit --keep`)."""

    def __init__(self, data: Data, defaults: dict[Problem, BackwardConfig],
                 incumbents: dict[Problem, BackwardConfig] | None = None):
        self.data, self.defaults, self.incumbents = data, defaults, incumbents or {}
        self.best = {p: min(t.median for t in cfgs.values()) for p, cfgs in data.items()}
        self.kept: dict[tuple[Problem, ...], BackwardConfig] = {}  # group -> the winner its incumbent outlived

    def losses_to_default(self, group: list[Problem], cfg: BackwardConfig) -> dict[str, dict]:
        """Problems of `group` where `cfg` is slower than the measured default beyond the spread."""
        out = {}
        for p in group:
            d = self.defaults.get(p)
            if d is not None and d != cfg and slower_beyond_spread(self.data[p][cfg], self.data[p][d]):
                out[f"{p.M}x{p.N}"] = {"us": round(self.data[p][cfg].median, 2),
                                       "default_us": round(self.data[p][d].median, 2)}
        return out

    def loses_to_incumbent(self, group: list[Problem], cfg: BackwardConfig) -> bool:
        """`cfg` is slower beyond the spread than the incumbent table's config on some problem of `group` where
        that config was measured: what `normtune compare` would fail the new table for."""
        for p in group:
            inc = self.incumbents.get(p)
            if inc is not None and inc != cfg and inc in self.data[p] \
                    and slower_beyond_spread(self.data[p][cfg], self.data[p][inc]):
                return True
        return False

    def shared_default(self, group: list[Problem]) -> BackwardConfig | None:
        """The measured analytic default when every problem of `group` has the same one, else None."""
        defaults = {self.defaults.get(p) for p in group}
        return defaults.pop() if len(defaults) == 1 else None

    def gains_on_default(self, group: list[Problem], cfg: BackwardConfig) -> bool:
        """`cfg`'s median beats the measured default's by more than DEFAULT_TIE on some problem of `group`."""
        return any(self.data[p][self.defaults[p]].median > self.data[p][cfg].median * (1 + DEFAULT_TIE)
                   for p in group)

    def regret(self, group: list[Problem], cfg: BackwardConfig) -> float:
        return geomean(self.data[p][cfg].median / self.best[p] for p in group)

    def is_incumbent(self, group: list[Problem], cfg: BackwardConfig) -> bool:
        """Whether the incumbent table runs every problem of `group` with `cfg`."""
        return all(self.incumbents.get(p) == cfg for p in group)

    def incumbent_over(self, group: list[Problem], cfg: BackwardConfig) -> BackwardConfig | None:
        """The incumbent config that stays instead of `cfg`: one the incumbent table runs on some problem of
        `group`, measured on all of them, never slower than the default beyond the spread, and that `cfg` beats
        beyond the spread on none (the best-scoring such one); None when `cfg` is an incumbent or none stays."""
        anchors = {self.incumbents[p] for p in group if p in self.incumbents}
        if cfg in anchors:
            return None
        usable = sorted((self.regret(group, a), a.to_json(), a) for a in anchors
                        if all(a in self.data[p] for p in group) and not self.losses_to_default(group, a))
        for _, _, a in usable:
            if not any(slower_beyond_spread(self.data[p][a], self.data[p][cfg]) for p in group):
                return a
        return None

    def config_for(self, group: list[Problem]) -> tuple[BackwardConfig | None, float, dict | None]:
        """(config, geometric-mean regret, the better-scoring config dropped for losing to the default): the
        best-scoring safe config (`choice_for`), unless an incumbent stays (`incumbent_over`)."""
        cfg, regret, dropped = self.choice_for(group)
        kept = self.incumbent_over(group, cfg) if cfg is not None else None
        if kept is None:
            return cfg, regret, dropped
        self.kept[tuple(group)] = cfg
        return kept, self.regret(group, kept), dropped

    def choice_for(self, group: list[Problem]) -> tuple[BackwardConfig | None, float, dict | None]:
        """`config_for` without an incumbent."""
        common = set(self.data[group[0]])
        for p in group[1:]:
            common &= set(self.data[p])
        scored = sorted((geomean(self.data[p][c].median / self.best[p] for p in group), c.to_json(), c)
                        for c in common)
        dropped = None
        for regret, _, cfg in scored:
            if self.loses_to_incumbent(group, cfg):
                continue
            losses = self.losses_to_default(group, cfg)
            if not losses:
                default = self.shared_default(group)
                if default is not None and default in common and not self.gains_on_default(group, cfg):
                    return default, geomean(self.data[p][default].median / self.best[p] for p in group), dropped
                return cfg, regret, dropped
            if dropped is None:
                dropped = {"config": cfg.to_dict(), "fit_regret": round(regret, 4), "slower_than_default": losses,
                           "fitted_on": [f"{p.M}x{p.N}" for p in group]}
        return None, math.inf, dropped

    def bucket(self, problems: list[Problem]) -> tuple[list[tuple[list[Problem], BackwardConfig]], list[dict]]:
        """Groups of problems (contiguous in M) with their configs, and what was dropped on the way."""
        problems = sorted(problems, key=lambda p: p.M)
        whole, cost, dropped = self.config_for(problems)  # cost: mean regret weighed by split_cost
        whole_dropped = [dropped] if dropped else []
        choice = ([(problems, whole)], whole_dropped) if whole is not None else None
        for groups in _partitions(problems, MAX_GROUPS):
            fitted = [(g, self.config_for(g)) for g in groups]
            if any(cfg is None for _, (cfg, _r, _d) in fitted):
                continue
            regret = geomean(self.data[p][cfg].median / self.best[p] for g, (cfg, _r, _d) in fitted for p in g)
            # A group that keeps its incumbent's config changes nothing there: only new rules pay SPLIT_GAIN.
            new_rules = len(groups) - sum(self.is_incumbent(g, cfg) for g, (cfg, _r, _d) in fitted)
            if regret * split_cost(new_rules) < cost:
                cost = regret * split_cost(new_rules)
                choice = ([(g, cfg) for g, (cfg, _r, _d) in fitted], [d for _, (_c, _r, d) in fitted if d])
        if choice is None:  # no config fits any M range of up to MAX_GROUPS problems: one rule per problem
            return [([p], self.own_config(p)) for p in problems], whole_dropped
        rules, split_dropped = choice
        if whole is None:  # why the bucket has no single rule
            split_dropped = whole_dropped + [d for d in split_dropped if d not in whole_dropped]
        return rules, split_dropped

    def own_config(self, p: Problem) -> BackwardConfig:
        """A problem's rule fitted on it alone: `config_for`, else (nothing safe) its fastest config."""
        cfg = self.config_for([p])[0]
        return cfg if cfg is not None else min(self.data[p], key=lambda c: (self.data[p][c].median, c.to_json()))


def split_cost(new_rules: int) -> float:
    """The factor a fit's mean regret is weighed with for its new rules: each rule past the first must lower the
    regret by SPLIT_GAIN. Candidates are compared by weighed regret, so a split adding no new rule to the best one
    so far (a group keeping its incumbent) wins on any gain, and each extra new rule pays once."""
    return 1 / (1 - SPLIT_GAIN * max(new_rules - 1, 0))


def _partitions(items: list, max_groups: int):
    """Contiguous partitions of `items` into 2..max_groups groups."""
    n = len(items)
    for k in range(2, min(max_groups, n) + 1):
        def rec(start, parts_left):
            if parts_left == 1:
                yield [items[start:]]
                return
            for cut in range(start + 1, n - parts_left + 2):
                for rest in rec(cut, parts_left - 1):
                    yield [items[start:cut]] + rest
        yield from rec(0, k)


def fit_family(family: ProblemFamily, data: Data, defaults: dict[Problem, BackwardConfig] | None = None,
               incumbents: dict[Problem, BackwardConfig] | None = None) -> Fitted:
    """Rules for one family; `defaults` maps a problem to its measured analytic default (see `default_in`),
    `incumbents` to the config the incumbent table runs it with (see `incumbent.configs_for`)."""
    fit = _Fit(data, defaults or {}, incumbents)
    by_n: dict[int, list[Problem]] = defaultdict(list)
    for p in data:
        by_n[p.N].append(p)
    ns = sorted(by_n)
    out = Fitted(family, [], {}, {})
    for i, n in enumerate(ns):
        n_max = n_boundary(n, ns[i + 1]) if i < len(ns) - 1 else None
        groups, dropped = fit.bucket(by_n[n])
        out.dropped += dropped
        for gi, (group, cfg) in enumerate(groups):
            m_max = (m_boundary(group, groups[gi + 1][0], cfg, groups[gi + 1][1], data)
                     if gi < len(groups) - 1 else top_boundary(by_n, ns, i))
            out.rules.append({"n_max": n_max, "m_max": m_max, "config": cfg.to_dict(),
                              "fitted_on": [f"{p.M}x{p.N}" for p in sorted(group, key=lambda p: p.M)]})
            if tuple(group) in fit.kept:
                out.rules[-1]["kept_over"] = fit.kept[tuple(group)].to_dict()
            for p in group:
                out.expected_us[f"{p.M}x{p.N}"] = round(data[p][cfg].median, 2)
                out.regret[f"{p.M}x{p.N}"] = round(data[p][cfg].median / fit.best[p], 4)
    out.default_unmeasured = [f"{p.M}x{p.N}" for p in sorted(data, key=lambda p: (p.N, p.M))
                              if p not in fit.defaults]
    return out


def m_boundary(lower: list[Problem], upper: list[Problem], lower_config: BackwardConfig,
               upper_config: BackwardConfig | None = None, data: Data | None = None) -> int:
    """The largest M the lower group's rule serves. Where both groups' configs were timed on the two nearest
    fitted problems (the lower group's largest M and the upper group's smallest), it is the M where their times
    cross (`m_crossover`); otherwise the geometric midpoint of the two M values, so that an unseen M takes the
    rule fitted nearest to it on a log scale (a boundary at the arithmetic midpoint hands the rows just below it
    to the rule fitted farther away). A columns or dual rule stops at the rows those strategies accept, and
    never past the midpoint: a few-row config's time is tied to its tiling of the rows it was fitted on, which a
    line through two fitted problems does not see, so the crossing on that line can lie past where it still
    wins."""
    p_lo, p_hi = max(lower, key=lambda p: p.M), min(upper, key=lambda p: p.M)
    below, above = p_lo.M, p_hi.M
    cross = (m_crossover(data, p_lo, p_hi, lower_config, upper_config)
             if data is not None and upper_config is not None else None)
    midpoint = math.isqrt(below * above)
    m_max = max(below, midpoint if cross is None else min(int(cross), above - 1))
    if lower_config.strategy.sweeps_rows:
        m_max = max(below, min(m_max, midpoint, MAX_COLUMNS_ROWS))
    return m_max


def m_crossover(data: Data, p_lo: Problem, p_hi: Problem, a: BackwardConfig, b: BackwardConfig) -> float | None:
    """The M between p_lo.M and p_hi.M where config `a` (the lower rule's) stops being faster than `b` (the
    upper rule's): log(time_a / time_b) interpolated linearly in log M between the two problems. Where `a` was
    not timed at p_hi because its strategy sweeps every row (columns and dual accept at most MAX_COLUMNS_ROWS
    rows), its time there is extrapolated as growing linearly in M, what a serial sweep over the rows costs at
    least (fitted up to the geometric midpoint instead, such a rule runs rows past its crossing slower than the
    rows rule). None when either time is missing, or when `a` is not
    faster at p_lo or not slower at p_hi (the two did not cross in between)."""
    lo, hi = data.get(p_lo, {}), data.get(p_hi, {})
    if a not in lo or b not in lo or b not in hi:
        return None
    if a in hi:
        t_hi = hi[a].median
    elif a.strategy.sweeps_rows:
        t_hi = lo[a].median * p_hi.M / p_lo.M
    else:
        return None
    r_lo, r_hi = math.log(lo[a].median / lo[b].median), math.log(t_hi / hi[b].median)
    if r_lo >= 0 or r_hi <= 0:
        return None
    return p_lo.M * (p_hi.M / p_lo.M) ** (r_lo / (r_lo - r_hi))


def top_boundary(by_n: dict[int, list[Problem]], ns: list[int], i: int) -> int | None:
    """The largest M the top rule of the bucket at ns[i] serves: every M (None), unless the bucket was fitted on
    few rows only (at most MAX_COLUMNS_ROWS) and the next wider bucket on more; then the log midpoint between the
    two, and taller problems fall through to the wider bucket's rules (a rule fitted on few rows does not know
    how taller ones run, and the wider bucket's rules were fitted on them)."""
    top = max(p.M for p in by_n[ns[i]])
    if i == len(ns) - 1 or top > MAX_COLUMNS_ROWS:
        return None
    taller = [p.M for p in by_n[ns[i + 1]] if p.M > top]
    return max(top, math.isqrt(top * min(taller))) if taller else None


def n_boundary(n: int, next_n: int) -> int:
    """The widest N the rules fitted at `n` columns serve: the geometric midpoint between `n` and the next fitted
    N, so that an unseen N takes the rules fitted nearest to it on a log scale, but never past the power of two
    `n` rounds up to:
    the rules' tiles cover that many columns, and a wider N re-tiles them (past 16384 columns, out of one pass)."""
    return max(n, min(math.isqrt(n * next_n), next_power_of_two(n)))


def single_pass_threshold(rules: list[dict]) -> int | None:
    """The learned single-pass threshold: the widest measured N up to which every rule runs single pass."""
    out = None
    for r in rules:
        config = BackwardConfig.from_dict(r["config"])
        if config.strategy.walks_twice(config.kernel_1):
            break
        out = max([out or 0] + [int(s.split("x")[1]) for s in r["fitted_on"]])
    return out
