"""Neighbour re-measurement for `normtune emit --remeasure`: each problem's top configs timed on the other problems
of its N bucket, and the nearby buckets' top configs adapted to its N, so that emission compares rules on a
complete config × problem matrix rather than on whatever the sweeps happened to measure everywhere; and each
problem's analytic default where no run timed it (a rule gives way to the default where it is not faster, so a
default changed since the sweeps must be timed again before the table can be re-emitted against it)."""

from __future__ import annotations

from collections import defaultdict

from normtune.kernels.config import BackwardConfig, ConfigError, Problem, default_config
from normtune.kernels.limits import DeviceLimits
from normtune.kernels.select.tables import adapt

from .emit import TOP_K, Selection, collect, select_inputs
from .fit import Data, default_in
from .incumbent import configs_for
from ..measure.spread import Timing


# How many fitted widths on each side of a bucket lend it their top configs: a config that wins at one width often
# wins two widths away, while the width between had its search end elsewhere, and with one width on each side that
# config never reached the far one.
NEIGHBOUR_REACH = 2


def top_configs(cfgs: dict[BackwardConfig, Timing], k: int = TOP_K) -> list[BackwardConfig]:
    return [c for c, _ in sorted(cfgs.items(), key=lambda kv: (kv[1].median, kv[0].to_json()))[:k]]


def neighbour_plan(data: Data, incumbents: dict[Problem, BackwardConfig] | None = None,
                   sm_count: int | None = None,
                   limits: DeviceLimits | None = None) -> list[tuple[Problem, BackwardConfig]]:
    """(problem, config) pairs worth measuring to complete the matrix: each problem's top configs on the other
    problems of its N bucket, and the top two configs of each problem of the NEIGHBOUR_REACH nearest buckets on
    either side, adapted to this N; with `incumbents` (problem → the incumbent table's config), each problem's
    incumbent config on every problem of its bucket, so that emission can weigh the incumbent against the new
    winner; each problem's analytic default where it is not measured in either of its forms (see `fit.default_in`;
    sized by `limits`, the device's that measures the plan). Already measured pairs are skipped."""
    incumbents = incumbents or {}
    by_n: dict[int, list[Problem]] = defaultdict(list)
    for p in data:
        by_n[p.N].append(p)
    ns = sorted(by_n)
    plan = []
    for i, n in enumerate(ns):
        cands: list[BackwardConfig] = []
        for p in by_n[n]:
            cands += top_configs(data[p]) + ([incumbents[p]] if p in incumbents else [])
        for j in range(i - NEIGHBOUR_REACH, i + NEIGHBOUR_REACH + 1):
            if 0 <= j < len(ns) and j != i:
                for p in by_n[ns[j]]:
                    cands += [adapt(c, by_n[n][0]) for c in top_configs(data[p], 2)]
        for p in sorted(by_n[n], key=lambda q: q.M):
            for c in dict.fromkeys(cands):
                c = adapt(c, p)
                if c not in data[p]:
                    plan.append((p, c))
    measured_defaults = default_in(data, sm_count, limits)
    for p in sorted(data, key=lambda q: (q.N, q.M)):
        if p not in measured_defaults:
            try:
                plan.append((p, default_config(p, limits)))
            except ConfigError:
                continue
    return list(dict.fromkeys(plan))


def remeasure_neighbours(store, gpu_key: str, info, *, selection: Selection = Selection(), command_line: str,
                         progress=None, incumbent=None) -> tuple[int, int]:
    """Measure each family's neighbour plan (see `neighbour_plan`; with the `incumbent` table's configs) in a new
    "emit" run, as source "neighbor"; the run records the command and the copy bandwidth behind its floors.
    Returns (run id, pairs measured)."""
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
            plan = neighbour_plan(data, configs_for(incumbent, data) if incumbent is not None else None,
                                  info.sm_count, limits)
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
