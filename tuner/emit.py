"""`normtune emit`: turn stored measurements into a frozen launch-heuristic table (configs/<gpu>.json).

Fitting, per problem family (norm, dtypes, flags):
1. N buckets: each measured N closes a bucket (previous N, N]; the last bucket is unbounded above.
2. A config x problem matrix of measured times within each bucket: every config measured on a problem (the
   sweep's trials, plus "neighbor" re-measurements: `remeasure` times each problem's top configs on the other
   problems of its bucket, and the adjacent buckets' top configs adapted to this N).
3. Rules: for a group of problems, the config minimizing the geometric-mean regret (time / that problem's
   best) over the group, among configs measured on all of them. A bucket is split on M (at most into three
   M ranges) only when a split lowers the mean regret by more than SPLIT_GAIN: rules that generalize beat
   rules that memorize.
The file is deterministic (sorted keys, provenance taken from the database, never from the clock): the same
database gives the same bytes.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from normtune.kernels.config import BackwardConfig, Problem, ProblemFamily
from normtune.kernels.tables import SCHEMA_VERSION, adapt, parse_table

TOP_K = 3  # configs per problem carried into the matrix and re-measured on neighbours
SPLIT_GAIN = 0.01  # a split on M must lower the group's mean regret by more than 1%
MAX_GROUPS = 3


@dataclass
class Fitted:
    family: ProblemFamily
    rules: list[dict]
    expected_us: dict[str, float]
    regret: dict[str, float]


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.inf


def collect(store, gpu_key: str, interpret: bool) -> dict[ProblemFamily, dict[Problem, dict[BackwardConfig, float]]]:
    """family → problem → config → median µs (median over repeated measurements of the same config)."""
    times: dict[ProblemFamily, dict[Problem, dict[BackwardConfig, list[float]]]] = \
        defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for m in store.measurements(gpu_key=gpu_key, status="ok", interpret=interpret):
        if m.median_us is not None and m.median_us > 0:
            times[m.problem.family][m.problem][m.config].append(m.median_us)
    return {fam: {p: {c: statistics.median(v) for c, v in cfgs.items()} for p, cfgs in probs.items()}
            for fam, probs in times.items()}


def top_configs(cfgs: dict[BackwardConfig, float], k: int = TOP_K) -> list[BackwardConfig]:
    return [c for c, _ in sorted(cfgs.items(), key=lambda kv: (kv[1], kv[0].to_json()))[:k]]


def neighbour_plan(data: dict[Problem, dict[BackwardConfig, float]]) -> list[tuple[Problem, BackwardConfig]]:
    """(problem, config) pairs worth measuring to complete the matrix: each problem's top configs on the other
    problems of its N bucket, and the adjacent buckets' top configs adapted to this N. Already measured pairs
    are skipped."""
    by_n: dict[int, list[Problem]] = defaultdict(list)
    for p in data:
        by_n[p.N].append(p)
    ns = sorted(by_n)
    plan = []
    for i, n in enumerate(ns):
        cands: list[BackwardConfig] = []
        for p in by_n[n]:
            cands += top_configs(data[p])
        for j in (i - 1, i + 1):
            if 0 <= j < len(ns):
                for p in by_n[ns[j]]:
                    cands += [adapt(c, by_n[n][0]) for c in top_configs(data[p], 2)]
        for p in sorted(by_n[n], key=lambda q: q.M):
            for c in dict.fromkeys(cands):
                c = adapt(c, p)
                if c not in data[p]:
                    plan.append((p, c))
    return list(dict.fromkeys(plan))


def _best_config(group: list[Problem], data, best) -> tuple[BackwardConfig | None, float]:
    """The config with the lowest geometric-mean regret over `group` (measured on all of it)."""
    common = set(data[group[0]])
    for p in group[1:]:
        common &= set(data[p])
    if not common:
        return None, math.inf
    scored = sorted(((_geomean(data[p][c] / best[p] for p in group), c.to_json(), c) for c in common))
    return scored[0][2], scored[0][0]


def _fit_bucket(problems: list[Problem], data, best) -> list[tuple[list[Problem], BackwardConfig]]:
    """Groups of problems (contiguous in M) and their configs."""
    problems = sorted(problems, key=lambda p: p.M)
    whole, whole_regret = _best_config(problems, data, best)
    if whole is None:  # no config measured on all: one rule per problem (its own best)
        return [([p], min(data[p], key=lambda c: (data[p][c], c.to_json()))) for p in problems]
    best_split = ([(problems, whole)], whole_regret)
    for groups in _partitions(problems, MAX_GROUPS):
        fitted = [(g, _best_config(g, data, best)) for g in groups]
        if any(cfg is None for _, (cfg, _r) in fitted):
            continue
        regret = _geomean(data[p][cfg] / best[p] for g, (cfg, _r) in fitted for p in g)
        if regret < best_split[1] * (1 - SPLIT_GAIN * (len(groups) - 1)):
            best_split = ([(g, cfg) for g, (cfg, _r) in fitted], regret)
    return best_split[0]


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


def fit_family(family: ProblemFamily, data: dict[Problem, dict[BackwardConfig, float]]) -> Fitted:
    best = {p: min(cfgs.values()) for p, cfgs in data.items()}
    by_n: dict[int, list[Problem]] = defaultdict(list)
    for p in data:
        by_n[p.N].append(p)
    ns = sorted(by_n)
    rules, expected, regret = [], {}, {}
    for i, n in enumerate(ns):
        n_max = n if i < len(ns) - 1 else None
        groups = _fit_bucket(by_n[n], data, best)
        for gi, (group, cfg) in enumerate(groups):
            m_max = max(p.M for p in group) if gi < len(groups) - 1 else None
            rules.append({"n_max": n_max, "m_max": m_max, "config": cfg.to_dict(),
                          "fitted_on": [f"{p.M}x{p.N}" for p in sorted(group, key=lambda p: p.M)]})
            for p in group:
                expected[f"{p.M}x{p.N}"] = round(data[p][cfg], 2)
                regret[f"{p.M}x{p.N}"] = round(data[p][cfg] / best[p], 4)
    return Fitted(family, rules, expected, regret)


def single_pass_threshold(rules: list[dict]) -> int | None:
    """The learned single-pass threshold: the widest measured N up to which every rule runs single pass."""
    out = None
    for r in rules:
        if r["config"]["kernel_1"]["two_pass"]:
            break
        out = max([out or 0] + [int(s.split("x")[1]) for s in r["fitted_on"]])
    return out


def build_table(store, gpu_key: str, *, interpret: bool = False) -> dict:
    """The table for `gpu_key` from everything stored (ok measurements of non-interpreter runs unless
    `interpret`). Raises ValueError when there is nothing to fit."""
    data = collect(store, gpu_key, interpret)
    if not data:
        what = "interpreter" if interpret else gpu_key
        raise ValueError(f"no successful measurements for {what} in the database: run `normtune sweep --gpu "
                         f"{gpu_key}` first" + (" (interpreter runs need --interpret)" if not interpret else ""))
    runs = [r for r in store.runs(gpu_key=None if interpret else gpu_key) if r.interpret == interpret
            and (interpret or r.gpu_key == gpu_key)]
    latest = max(runs, key=lambda r: (r.started_at, r.id))
    families = {}
    n_measured = 0
    for family in sorted(data, key=lambda f: f.key):
        fitted = fit_family(family, data[family])
        n_measured += sum(len(v) for v in data[family].values())
        families[family.key] = {
            "rules": fitted.rules,
            "single_pass_max_n": single_pass_threshold(fitted.rules),
            "expected_us": dict(sorted(fitted.expected_us.items())),
            "fit_regret": dict(sorted(fitted.regret.items())),
        }
    table = {
        "schema_version": SCHEMA_VERSION,
        "interpret": interpret,
        "gpu": {"name": latest.gpu_name, "key": gpu_key, "compute_capability": latest.compute_capability,
                "sm_count": latest.sm_count},
        "provenance": {
            "runs": sorted(r.id for r in runs), "torch": sorted({r.torch for r in runs}),
            "triton": sorted({r.triton for r in runs}), "normtune": sorted({r.normtune_version for r in runs}),
            "git_revision": sorted({r.git_revision for r in runs if r.git_revision}),
            "driver": sorted({r.driver for r in runs if r.driver}),
            "date": max(r.ended_at or r.started_at for r in runs).strftime("%Y-%m-%d"),
            "configs_measured": n_measured,
            "fit": {"top_k": TOP_K, "split_gain": SPLIT_GAIN, "max_m_groups": MAX_GROUPS},
        },
        "families": families,
    }
    parse_table(json.loads(json.dumps(table)), "<emitted table>")  # the runtime must accept what we write
    return table


def dumps(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def remeasure_neighbours(store, gpu_key: str, info, *, interpret: bool = False, progress=None) -> int:
    """Measure each family's neighbour plan (see `neighbour_plan`) and store it as source "neighbor"."""
    import torch

    from . import measure

    device = torch.device("cpu" if interpret else "cuda")
    bandwidth = math.nan if interpret else measure.copy_bandwidth(device)
    flusher = None if interpret else measure.L2Flusher(device, info.l2_bytes)
    timing = dict(min_reps=1, max_reps=2, budget_s=0.0, warmup=0) if interpret else \
        dict(min_reps=20, max_reps=100, budget_s=0.2)
    run_id = store.start_run(info, kind="emit", command_line="remeasure neighbours")
    count = 0
    try:
        for family, data in sorted(collect(store, gpu_key, interpret).items(), key=lambda kv: kv[0].key):
            plan = neighbour_plan(data)
            by_problem: dict[Problem, list[BackwardConfig]] = defaultdict(list)
            for p, c in plan:
                by_problem[p].append(c)
            for p, cfgs in sorted(by_problem.items(), key=lambda kv: kv[0].key):
                case = measure.make_case(p, device)
                ref = case.reference()
                for c in cfgs:
                    r = measure.measure_config(case, c, flusher=flusher, bandwidth_gbps=bandwidth,
                                               reference_grads=ref, **timing)
                    store.add_measurement(run_id, p, c, r, source="neighbor")
                    count += 1
                    if progress:
                        progress(p, c, r)
                del case, ref
        store.end_run(run_id)
    except BaseException:
        store.end_run(run_id, status="interrupted")
        raise
    return count
