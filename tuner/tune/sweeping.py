"""The one call a tune makes into the sweep engine: `sweep(ctx, problems, targets, …)`, through its entry point
`tuner.sweep.run`, the same engine and studies as `normtune sweep` (one worker on this GPU or the interpreter;
with `--devices`, one per GPU; any host sharing the database adds its own). Each problem's study ends with exactly
its target of measured trials, whoever measures them; a killed sweep loses none it stored."""

from __future__ import annotations

from dataclasses import dataclass

from normtune.kernels.config import Problem

from ..sweep.options import FIRST_ROUND

# Seconds a sweep runs past its time budget at most, on the interpreter or a GPU: the trial in flight finishes, then
# its processes stop; a budget is cut by as much. A share shorter than MIN_SWEEP_S is not started at all: a
# sweep's processes take seconds to start before any trial is measured.
CLOSING_S = 1.0
MIN_SWEEP_S = 2.0
# The fitting sweeps' sampler: each problem's best config's one-step neighbours before TPE's own proposals (a
# problem given few trials still ends at a local optimum of its best seed). The held-out reference stays TPE alone,
# unseeded: independent of what the fit searched.
SAMPLER = "local"
# Seeds per fitting study: the seeds' round (FIRST_ROUND) and no more. A space's seed list runs to dozens of
# configs (every strategy's structural ones, then the default's neighbours); past the first round the local
# sampler moves from the best of them instead, so that the rounds judge a problem by its search.
SEED_LIMIT = FIRST_ROUND


@dataclass(frozen=True)
class Outcome:
    stopped: str | None = None  # "time budget", "interrupted"; None: the sweep ran to its end
    signal: str | None = None  # "SIGINT" / "SIGTERM" when a signal stopped it
    exit_code: int = 0  # 130/143 after a signal


def sweep(ctx, problems: list[Problem], targets: int | dict[str, int], *, seconds: float | None, prefix: str,
          source: str = "sweep", seeded: bool = True, extra_seeds: dict | None = None, slot_seeds: dict | None = None) -> Outcome:
    """Measure `problems` until each of their studies (named with `prefix`) holds its target (`targets`: one
    count for all, or problem key -> count), within `seconds` (None: no limit). `ctx` is the tune's `context.TuneContext`; `slot_seeds`: problem key -> (first
    slot, [config dict]), configs its study measures in those slots (the rounds' transfers)."""
    from ..sweep import SweepOptions, run

    if seconds is not None:
        if seconds < MIN_SWEEP_S:
            return Outcome(stopped="time budget")
        seconds -= CLOSING_S
    each = targets if isinstance(targets, dict) else {p.key: targets for p in problems}
    opts = SweepOptions(gpu_key=ctx.plan.gpu_key, problems=list(problems), trials=max(each.values()),
                        targets=each, time_budget_s=seconds,
                        interpret=ctx.plan.interpret, compile_workers=ctx.compile_workers, device=ctx.device,
                        devices=ctx.devices if ctx.devices and len(ctx.devices) > 1 else None,
                        storage=ctx.store.url, study_prefix=prefix, source=source, seeded=seeded,
                        extra_seeds=dict(extra_seeds or {}), slot_seeds=dict(slot_seeds or {}),
                        heartbeat_interval=ctx.heartbeats[0],
                        grace_period=ctx.heartbeats[1], sampler=SAMPLER if seeded else "tpe",
                        seed_limit=SEED_LIMIT if seeded else None)
    result = run(opts, on_event=ctx.on_sweep_event, helpers=ctx.helpers)
    if result.exit_code == 1:
        from .context import TuneError

        raise TuneError("a sweep worker failed (exit code 1); the trials it stored are kept: run the same command "
                        "again to continue")
    return Outcome(result.stopped, result.signal, result.exit_code)
