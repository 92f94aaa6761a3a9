"""Neighbour re-measurement for `normtune emit --remeasure`: each problem's top configs timed on the other problems
of its N bucket, and the nearby buckets' top configs adapted to its N, so that emission compares rules on a
complete config × problem matrix rather than on whatever the sweeps happened to measure everywhere; and each
problem's analytic default where no run timed it (a rule gives way to the default where it is not faster, so a
default changed since the sweeps must be timed again before the table can be re-emitted against it). With an
incumbent table, its configs are timed on every problem of their bucket, and the shapes its rules were fitted on
join their width's bucket where no run measured them."""

from __future__ import annotations

from collections import defaultdict

from normtune.kernels.config import BackwardConfig, ConfigError, Problem, default_config
from normtune.kernels.limits import DeviceLimits
from normtune.kernels.select.tables import Table, adapt

from .emit import HELD_OUT, TOP_K, Selection, collect, select_inputs
from .fit import Data, default_in
from .incumbent import configs_for
from ..measure.spread import Timing


# How many fitted widths on each side of a bucket lend it their top configs: a config that wins at one width often
# wins two widths away, while the width between had its search end elsewhere, and with one width on each side that
# config never reached the far one.
NEIGHBOUR_REACH = 2


def top_configs(cfgs: dict[BackwardConfig, Timing], k: int = TOP_K) -> list[BackwardConfig]:
    return [c for c, _ in sorted(cfgs.items(), key=lambda kv: (kv[1].median, kv[0].to_json()))[:k]]


def incumbent_shapes(table: Table, data: Data) -> list[Problem]:
    """Problems of `data`'s family at the shapes the incumbent `table`'s rules for it were fitted on (its own
    family's rules, or those the runtime borrows for it from the closest tuned family), at the widths `data` fits,
    where `data` measured nothing; never a held-out shape. The incumbent was shown to win there, and a new family
    that measured nothing near them would take them on the strength of its fitted neighbours alone."""
    if not data:
        return []
    some = next(iter(data))
    key = table.family_key(some.family)
    if key is None:
        return []
    widths = {p.N for p in data}
    found = set()
    for rule in table.families[key]:
        for text in rule.fitted_on:
            M, _, N = text.partition("x")
            shape = (int(M), int(N))
            if shape[1] in widths and shape not in HELD_OUT:
                found.add(some.with_shape(*shape))
    return sorted(found - set(data), key=lambda q: (q.N, q.M))


def incumbent_plan(data: Data, incumbent: Table | None, sm_count: int | None = None,
                   limits: DeviceLimits | None = None) -> tuple[list[tuple[Problem, BackwardConfig]],
                                                               dict[Problem, BackwardConfig]]:
    """The neighbour plan of `data` with the `incumbent` table (None: none): its configs on the problems, and its
    fitted shapes joined to their widths (`incumbent_shapes`). Returns (the plan, problem → incumbent config)."""
    if incumbent is None:
        return neighbour_plan(data, None, sm_count, limits), {}
    shapes = incumbent_shapes(incumbent, data)
    mine = configs_for(incumbent, list(data) + shapes)
    joined = [p for p in shapes if p in mine]  # where the incumbent runs nothing, there is nothing to weigh
    return neighbour_plan(data, mine, sm_count, limits, joined), mine


def neighbour_plan(data: Data, incumbents: dict[Problem, BackwardConfig] | None = None,
                   sm_count: int | None = None, limits: DeviceLimits | None = None,
                   joined: list[Problem] = ()) -> list[tuple[Problem, BackwardConfig]]:
    """(problem, config) pairs worth measuring to complete the matrix: each problem's top configs on the other
    problems of its N bucket, and the top two configs of each problem of the NEIGHBOUR_REACH nearest buckets on
    either side, adapted to this N; with `incumbents` (problem → the incumbent table's config), each problem's
    incumbent config on every problem of its bucket, so that emission can weigh the incumbent against the new
    winner; each problem's analytic default where it is not measured in either of its forms (see `fit.default_in`;
    sized by `limits`, the device's that measures the plan). `joined`: problems nothing measured yet (see
    `incumbent_shapes`), each timed with its incumbent config, the best config of each problem of its width, and
    its default. Already measured pairs are skipped."""
    incumbents = incumbents or {}
    by_n: dict[int, list[Problem]] = defaultdict(list)
    for p in data:
        by_n[p.N].append(p)
    ns = sorted(by_n)
    new_at: dict[int, list[Problem]] = defaultdict(list)
    for p in joined:
        if p.N in by_n and p not in data:
            new_at[p.N].append(p)
    plan = []
    for i, n in enumerate(ns):
        cands: list[BackwardConfig] = []
        for p in by_n[n]:
            cands += top_configs(data[p]) + ([incumbents[p]] if p in incumbents else [])
        for j in range(i - NEIGHBOUR_REACH, i + NEIGHBOUR_REACH + 1):
            if 0 <= j < len(ns) and j != i:
                for p in by_n[ns[j]]:
                    cands += [adapt(c, by_n[n][0]) for c in top_configs(data[p], 2)]
        winners = [c for p in by_n[n] for c in top_configs(data[p], 1)]
        for p in sorted(by_n[n] + new_at[n], key=lambda q: q.M):
            # A joined problem takes its incumbent config and its bucket's winners: enough for the fit to weigh
            # the incumbent there against what the new family would run.
            mine = cands if p in data else ([incumbents[p]] if p in incumbents else []) + winners
            for c in dict.fromkeys(mine):
                c = adapt(c, p)
                if c not in data.get(p, {}):
                    plan.append((p, c))
    measured_defaults = default_in(data, sm_count, limits)
    for p in sorted([*data, *(q for qs in new_at.values() for q in qs)], key=lambda q: (q.N, q.M)):
        if p not in measured_defaults:
            try:
                plan.append((p, default_config(p, limits)))
            except ConfigError:
                continue
    return list(dict.fromkeys(plan))


def remeasure_neighbours(store, gpu_key: str, info, *, selection: Selection = Selection(), command_line: str,
                         progress=None, incumbent=None) -> tuple[int, int]:
    """Measure each family's neighbour plan (see `incumbent_plan`: with the `incumbent` table's configs and fitted
    shapes) in a new "emit" run, as source "neighbor"; the run records the command and the copy bandwidth behind
    its floors. Returns (run id, pairs measured)."""
    from ..gpu_info import measured_limits
    from ..measure.harness import TIMING, MeasureSession

    families = collect(select_inputs(store, gpu_key, interpret=info.interpret, selection=selection))
    session = MeasureSession.for_device(info, timing=TIMING["remeasure"])
    run_id = store.start_run(info, kind="emit", command_line=command_line,
                             copy_bandwidth_gbps=session.recorded_bandwidth_gbps)
    limits = measured_limits(session.device)
    count = 0
    try:
        for family, data in sorted(families.items(), key=lambda kv: kv[0].key):
            plan, _ = incumbent_plan(data, incumbent, info.sm_count, limits)
            for p, c in sorted(plan, key=lambda pc: (pc[0].key, pc[1].to_json())):
                r = session.measure_problem(p, c)
                store.add_measurement(run_id, p, c, r, source="neighbor")
                count += 1
                if progress:
                    progress(p, c, r)
        store.end_run(run_id)
    except BaseException:
        store.end_run(run_id, status="interrupted")
        raise
    return run_id, count
