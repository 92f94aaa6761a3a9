"""Validation of a tune's table on its generated held-out problems (`unseen.py`), as `normtune validate` does it:
the best config of an unseeded sweep of each shape (`--reference-trials` trials, in `validate`'s own studies, never
fitted on) is a reference that owes the table nothing; the table's config, the reference and the analytic default
(and the incumbent table's config, which the gate needs) are then timed head to head in interleaved rounds.
Regret = the table's time ÷ the fastest of table, reference and default.

Each finished validation is recorded in the journal with the tune's elapsed time (over every run of the command):
the points of the time-to-table plot. One cut short (time, a kill) records nothing and is done again."""

from __future__ import annotations

import time

from normtune.kernels.config import BackwardConfig, Problem, default_config
from normtune.kernels.select.tables import parse_table

from ..measure.spread import Timing
from ..render import geomean
from ..sweep.options import study_name
from ..tables.compare import config_for, head_to_head
from ..tables.validate import CANDIDATES, REFERENCE_PREFIX, REFERENCE_SOURCE, ValidationRow, summarize
from . import journal as J
from .sweeping import Outcome, sweep

ROUNDS = 3  # interleaved head-to-head rounds per held-out problem


class Stopped(Exception):
    """A signal stopped a sweep of the tune: what it measured is stored; the command ends with `exit_code`."""

    def __init__(self, outcome: Outcome):
        super().__init__(f"{outcome.signal}: stopped; its trials are stored. Run the same command again to continue")
        self.exit_code = outcome.exit_code


def reference_bests(ctx) -> dict[str, tuple[BackwardConfig | None, int]]:
    """Held-out problem key → (the best config of its reference sweep, or None; trials measured)."""
    out = {}
    for p in ctx.heldout:
        measured = ctx.store.measurements(study_name=study_name(ctx.plan.gpu_key, p, ctx.plan.interpret,
                                                                REFERENCE_PREFIX))
        ok = [m for m in measured if m.status == "ok" and m.median_us]
        best = min(ok, key=lambda m: (m.median_us, m.id), default=None)
        out[p.key] = (best.config if best else None, len(measured))
    return out


def references(ctx, seconds: float | None) -> dict | None:
    """The reference sweeps, run (or continued) to `--reference-trials` within `seconds`; their bests, or None
    while one is short of its trials."""
    outcome = sweep(ctx, ctx.heldout, ctx.plan.reference_trials, seconds=seconds, prefix=REFERENCE_PREFIX,
                    source=REFERENCE_SOURCE, seeded=False)
    if outcome.signal:
        raise Stopped(outcome)
    bests = reference_bests(ctx)
    return bests if all(n >= ctx.plan.reference_trials for _, n in bests.values()) else None


def _timing(data: dict | None) -> Timing | None:
    return None if data is None else Timing(data["median"], data["p10"], data["p90"], data.get("rounds", 1))


def _timing_dict(t: Timing | None) -> dict | None:
    return None if t is None else {"median": t.median, "p10": t.p10, "p90": t.p90, "rounds": t.count}


def validate(ctx, index: int, raw: dict, seconds: float | None) -> dict | None:
    """Validate emission `index` (its table `raw`) within `seconds`; the journal's record, or None when cut short."""
    deadline = ctx.clock.deadline(seconds)

    def left() -> float | None:
        return None if deadline is None else deadline - time.monotonic()

    bests = references(ctx, left())
    if bests is None or (deadline is not None and left() <= 0):
        return None
    table = parse_table(raw, f"<tune table {index + 1}>")
    session, limits = ctx.session(), ctx.limits()
    run_id = ctx.store.start_run(ctx.info, kind="validate", command_line=ctx.command_line,
                                 copy_bandwidth_gbps=session.recorded_bandwidth_gbps)
    rows, incumbent, status = [], {}, "interrupted"
    try:
        for p in ctx.heldout:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            best, trials = bests[p.key]
            configs = {"table": config_for(table, p, limits), "reference": best, "default": default_config(p, limits)}
            if ctx.incumbent is not None:
                configs["incumbent"] = config_for(ctx.incumbent, p, limits)
            timed = {k: c for k, c in configs.items() if c is not None}

            def store_result(name, config, result, p=p):
                ctx.store.add_measurement(run_id, p, config, result, source=f"validate-{name}")

            times = head_to_head(session, p, timed, rounds=ROUNDS, on_result=store_result)
            rows.append(ValidationRow(p, {k: configs.get(k) for k in CANDIDATES},
                                      {k: times.get(k) for k in CANDIDATES}, trials))
            if "incumbent" in configs:
                incumbent[p.key] = {"config": configs["incumbent"].to_dict(), "us": _timing_dict(times["incumbent"])}
            ctx.journal.touch()
        status = "finished"
    finally:
        ctx.store.end_run(run_id, status=status)
    record = {"emission": index, "elapsed_s": ctx.journal.elapsed_s(), "run": run_id, "summary": summarize(rows),
              "default_regret": geomean(row.times["default"].median / row.fastest().median for row in rows
                                        if row.times.get("default") and row.fastest()),
              "rows": [{"problem_dict": r.problem.to_dict(), **r.to_dict()} for r in rows], "incumbent": incumbent}
    ctx.journal.append(J.VALIDATIONS, record)
    return record


def rows_of(record: dict) -> list[ValidationRow]:
    """A journal validation's rows, as `tables.validate.ValidationRow`s."""
    rows = []
    for r in record["rows"]:
        configs = {k: None if c is None else BackwardConfig.from_dict(c) for k, c in r["configs"].items()}
        rows.append(ValidationRow(Problem.from_dict(r["problem_dict"]), configs,
                                  {k: _timing(t) for k, t in r["times_us"].items()}, r.get("reference_trials")))
    return rows


def incumbent_times(record: dict) -> dict[str, tuple[BackwardConfig, Timing | None]]:
    """Held-out problem key → (the incumbent's config, its time) of a journal validation."""
    return {k: (BackwardConfig.from_dict(v["config"]), _timing(v["us"])) for k, v in record.get("incumbent", {}).items()}
