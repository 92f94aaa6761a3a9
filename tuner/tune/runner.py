"""One run of `normtune tune` (`tune`): the tune's context built from the command's options, its phases
(`driver.run`) under the live display, then the final steps that every run ends with, whatever stopped the
phases: the best table so far gated, written, and the report."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

from normtune.kernels.config import Problem


@dataclass
class Options:
    key: str  # the results' label: the device's GPU key, or "interpret"
    info: object  # gpu_info.DeviceInfo
    problems: list[Problem]
    trials: int
    heldout: int
    reference_trials: int
    budget_s: float | None
    started: float  # monotonic time the command started (the budget counts from it)
    warm: object  # kernels.tables.Table of --from, or None
    as_new_gpu: bool
    db: str
    device: int
    devices: list[int] | None
    compile_workers: int
    out: Path
    report: Path
    incumbent: object  # the table the runtime would use now (None: none, or hidden)
    notes: list[str] = field(default_factory=list)
    heartbeat_interval: int = 20  # the sweeps' heartbeats and grace period (`SweepOptions`)
    grace_period: int = 60


class _Terminated(BaseException):
    """SIGTERM outside a sweep (a sweep handles its own): every write so far is committed; stop."""


def _on_term(signum, frame):
    raise _Terminated()


def _context(console, o: Options):
    from ..gpu_info import command_line
    from ..store.database import Store
    from .clock import Clock
    from .context import TuneContext
    from .journal import Journal
    from .plan import Plan
    from .unseen import unseen_problems
    from .warm import fingerprint

    plan = Plan(gpu_key=o.key, interpret=o.info.interpret, problems=tuple(o.problems), trials=o.trials,
                heldout_per_family=o.heldout, reference_trials=o.reference_trials,
                warm_start=fingerprint(o.warm) if o.warm is not None else None, as_new_gpu=o.as_new_gpu)
    store = Store(o.db)

    def say(line: str) -> None:
        console.print(line, markup=False, soft_wrap=True)

    def on_sweep_event(kind: str, data: dict) -> None:
        if kind == "signal":
            say(data["message"])

    ctx = TuneContext(plan=plan, heldout=unseen_problems(list(plan.problems), plan.heldout_per_family, plan.tune_id),
                      store=store, info=o.info, journal=Journal(store, plan.journal_name),
                      clock=Clock(o.budget_s, o.started), command_line=command_line(), device=o.device,
                      devices=o.devices, compile_workers=o.compile_workers, incumbent=o.incumbent, say=say,
                      on_sweep_event=on_sweep_event, heartbeats=(o.heartbeat_interval, o.grace_period))
    ctx.warm_table = o.warm
    return ctx


def _finish(ctx, o: Options, stopped: str | None) -> tuple[dict | None, dict | None]:
    """The final steps: the best table so far through the gate, written; the report."""
    from . import finish, report

    index = finish.candidate(ctx)
    table = record = None
    if index is not None:
        ctx.progress.phase(f"gate table {index + 1}")
        left = ctx.clock.left_s()
        until = None if left is None else ctx.clock.started + ctx.clock.budget_s - ctx.clock.reserve_s / 2
        raw, record = finish.gated(ctx, index, until)
        if raw is not None:
            table = finish.stamped(ctx, raw, index, record)
            backup = finish.write(o.out, table)
            if backup is not None:
                ctx.say(f"the table it replaced is kept as {backup}")
    ctx.progress.phase("report")
    path = report.write(ctx, o.report, o.out, table, record, stopped)
    ctx.journal.touch()
    return table, {"record": record, "report": path, "index": index}


def tune(console, o: Options) -> int:
    """Run the tune; returns the command's exit code (0, or 130/143 after a signal)."""
    from . import journal as J
    from .checking import Stopped
    from .display import Progress
    from .driver import run

    for note in o.notes:
        console.print(note, markup=False, soft_wrap=True)
    if o.info.interpret:
        console.print("[yellow]--interpret: kernels run on CPU in the Triton interpreter; times are host wall-clock, "
                      "not GPU timings[/]")
    ctx = _context(console, o)
    plan = ctx.plan
    if not ctx.devices or len(ctx.devices) == 1:  # one measuring process and compile pool for all its sweeps
        from ..sweep.compiling import default_compile_workers
        from ..sweep.engine import KeptHelpers

        workers = ctx.compile_workers if ctx.compile_workers is not None else default_compile_workers(1)
        ctx.helpers = KeptHelpers(ctx.device, plan.interpret, workers)
    ctx.say(f"tune {plan.tune_id} on {o.info.name}: {len(plan.problems)} problems in {len(plan.families())} "
            f"families, {len(ctx.heldout)} generated held-out shapes; database {ctx.store.display_url}"
            + (f"; time budget {o.budget_s:g} s" if o.budget_s else ""))
    old = signal.signal(signal.SIGTERM, _on_term)
    code, stopped, table, done = 0, None, None, None
    try:
        ctx.journal.start_run()
        with Progress(console, ctx) as progress:
            ctx.progress = progress
            earlier = ctx.journal.get(J.VALIDATIONS, [])
            if earlier:  # a tune continued: the regret it reached so far
                progress.regret(earlier[-1]["summary"]["geomean_regret"])
            try:
                stopped = run(ctx).stopped
            except Stopped as stop:
                ctx.say(str(stop))
                return stop.exit_code
            table, done = _finish(ctx, o, stopped)
    except KeyboardInterrupt:
        console.print("interrupted: everything measured is stored; run the same command again to continue")
        return 130
    except _Terminated:
        console.print("SIGTERM: everything measured is stored; run the same command again to continue")
        return 143
    finally:
        signal.signal(signal.SIGTERM, old)
        if ctx.helpers is not None:
            ctx.helpers.close()
        ctx.store.close()
    _summary(ctx, o, table, done, stopped)
    return 0


def _summary(ctx, o: Options, table: dict | None, done: dict, stopped: str | None) -> None:
    from ..render import num

    if table is None:
        ctx.say("no table written: " + ("nothing measured yet" if done["index"] is None else
                                        "no rule passed the gate (the analytic default stays)"))
    else:
        tune = table["provenance"]["tune"]
        held = tune["held_out"]
        gate = tune["gate"]
        ctx.say(f"wrote {o.out}: table {tune['table']} of the tune, {len(table['families'])} families; held-out regret "
                + (f"{num(held['geomean_regret'], 3)} (worst {num(held['worst_regret'], 3)}) on "
                   f"{held['shapes']} shapes" if held else "not validated (time)")
                + f"; gate: {gate['fall_backs']} rules fell back"
                + (f", still slower on {len(gate['still_slower'])} shapes" if gate["still_slower"] else ""))
    ctx.say(f"report: {done['report']}")
    elapsed = ctx.clock.elapsed_s()
    ctx.say(f"done in {elapsed:.0f} s" + (f" of the {o.budget_s:g} s budget" if o.budget_s else "")
            + (f"; stopped early ({stopped}): run the same command again to continue" if stopped else ""))
