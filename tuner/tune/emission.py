"""A tune's tables, through `normtune emit`'s machinery (`tuner/tables`): the runs they are fitted on (`fit_runs`),
the neighbour re-measurement that completes each family's config × problem matrix (`remeasure`, within a time
share, defaults first), and the fit (`emit`): never slower than the analytic default beyond the spread on a fitted
shape, keeping the incumbent's config wherever the new one is not faster beyond the spread (`emit --keep`).

A tune fits only its own measurements: its studies' trials and its re-measurements. Validation measurements are
never fitted on (`tables.emit.NEVER_FIT`), nor are the held-out preset's shapes."""

from __future__ import annotations

import time

from normtune.kernels.config import default_config

from ..measure.spread import Timing
from ..tables.emit import Selection, build_table, collect, select_inputs
from ..tables.remeasure import incumbent_plan
from . import journal as J


def study_measurements(ctx, problems) -> dict[str, list]:
    """Problem key → its tune study's measurements, in trial order."""
    out = {}
    for p in problems:
        records = ctx.store.measurements(study_name=ctx.plan.study(p))
        out[p.key] = sorted(records, key=lambda m: (m.trial_number if m.trial_number is not None else -1, m.id))
    return out


def fit_runs(ctx) -> tuple[int, ...]:
    """The runs holding the tune's trials, and its re-measurement runs."""
    runs = {m.run_id for records in study_measurements(ctx, ctx.fit_problems()).values() for m in records}
    return tuple(sorted(runs | set(ctx.journal.get(J.REMEASURE_RUNS, []))))


def inputs(ctx):
    """The measurements a table of the tune is fitted on (`tables.emit.Inputs`), or None before any."""
    runs = fit_runs(ctx)
    if not runs:
        return None
    found = select_inputs(ctx.store, ctx.plan.gpu_key, interpret=ctx.plan.interpret, selection=Selection(run_ids=runs))
    return found if found.measurements else None


def evidence(ctx) -> dict[tuple[str, str], Timing]:
    """(problem key, config JSON) → its pooled time, over everything a tune's tables are fitted on."""
    found = inputs(ctx)
    if found is None:
        return {}
    return {(p.key, c.to_json()): t for data in collect(found).values() for p, cfgs in data.items()
            for c, t in cfgs.items()}


def _priority(pair, incumbents, limits, joined) -> int:
    """Defaults first (a rule gives way to the default where it is not faster), with the incumbent's config on
    a `joined` problem (an incumbent's fitted shape nothing measured: its default alone would let the fit replace
    the incumbent there unweighed), then the incumbent's configs."""
    problem, config = pair
    if config == default_config(problem, limits) or (problem in joined and incumbents.get(problem) == config):
        return 0
    return 1 if incumbents.get(problem) == config else 2


def remeasure(ctx, incumbent, seconds: float | None) -> int:
    """Time each family's neighbour plan (`tables.remeasure.incumbent_plan`: with the `incumbent` table's configs
    and fitted shapes) that no earlier re-measurement timed, in a new "emit" run recorded in the journal before
    anything is measured, until `seconds` have passed. Returns the pairs measured."""
    found = inputs(ctx)
    if found is None or (seconds is not None and seconds <= 0):
        return 0
    session, limits = ctx.session(), ctx.limits()
    pairs, incumbents, joined = [], {}, set()
    for _, data in sorted(collect(found).items(), key=lambda kv: kv[0].key):
        plan, mine = incumbent_plan(data, incumbent, ctx.info.sm_count, limits)
        incumbents.update(mine)
        joined |= {p for p, _ in plan if p not in data}
        pairs += plan
    if not pairs:
        return 0
    pairs.sort(key=lambda pc: (_priority(pc, incumbents, limits, joined), pc[0].key, pc[1].to_json()))
    deadline = ctx.clock.deadline(seconds)
    run_id = ctx.store.start_run(ctx.info, kind="emit", command_line=ctx.command_line,
                                 copy_bandwidth_gbps=session.recorded_bandwidth_gbps)
    ctx.journal.append(J.REMEASURE_RUNS, run_id)
    count, status = 0, "finished"
    try:
        for problem, config in pairs:
            if deadline is not None and time.monotonic() >= deadline:
                status = "interrupted"
                break
            ctx.store.add_measurement(run_id, problem, config, session.measure_problem(problem, config),
                                      source="neighbor")
            count += 1
    except BaseException:
        status = "interrupted"
        raise
    finally:
        ctx.store.end_run(run_id, status=status)
    return count


def emit(ctx, incumbent) -> dict | None:
    """The table fitted on the tune's measurements now, keeping `incumbent`'s configs where the new ones do not
    pay (an incumbent of another GPU is not kept); None before anything was measured."""
    found = inputs(ctx)
    if found is None:
        return None
    keep = incumbent if incumbent is not None and incumbent.gpu_key == ctx.plan.gpu_key else None
    return build_table(ctx.store, ctx.plan.gpu_key, interpret=ctx.plan.interpret,
                       selection=Selection(run_ids=tuple(r.id for r in found.runs)), incumbent=keep)
