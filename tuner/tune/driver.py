"""The phases of a tune, in order (`run`). Each continues from what the database holds (its studies' trials, its
runs, its journal), never from anything a killed run held in memory, so the same command continues where any run
of it stopped, and any number of hosts sharing the database may run it:

1. sweep: rounds of trials (`rounds.py`) until no problem's search pays, or every problem has `--trials`;
2. emit: neighbour re-measurement and the fit, whenever the measurements changed since the tune's last table
   (keeping that table's configs, or the incumbent's, where the new ones do not pay);
3. validate the table on the generated held-out problems;
4. sweep again where the held-out regret is highest (`resweep.py`), then emit and validate again, up to RESWEEPS
   times in a tune; with a time budget, again and again while time is left (up to EXTRA_RESWEEPS more, their
   steps past `--trials` where they pay) until the budget is used or no held-out shape's regret pays a sweep;
5. gate the validated table with the most families and, among those, the lowest regret against the default
   and the incumbent (`finish.py`).

With a time budget every phase gets a share of the time left (`clock.py`) and stops at its end; once the phases'
time is spent only the final steps run, on the best table so far. The next run of the command continues every
phase cut short."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..render import num
from ..tables.incumbent import from_record, record
from . import journal as J
from .checking import Stopped, rows_of
from .checking import validate as validate_table
from .emission import emit, inputs, remeasure, study_measurements
from .resweep import decide
from .rounds import Round, next_round, opening, round_step, stopped_after, transfers_from, with_transfers
from .sweeping import sweep
from .transfer import transfers

# Shares of the time budget, by phase: each phase takes its weight against the phases still to come.
WEIGHTS = {"sweep": 50.0, "emit": 6.0, "validate": 10.0, "resweep": 10.0, "emit again": 4.0, "validate again": 4.0,
           "gate": 4.0}
RESWEEPS = 2  # sweeps where the held-out regret was highest, in a tune without a time budget
# With a time budget, time left after RESWEEPS keeps buying quality: more resweeps (at most EXTRA_RESWEEPS more),
# whose steps may raise a problem near the worst held-out shapes up to OVER_TRIALS x --trials.
EXTRA_RESWEEPS, OVER_TRIALS = 10, 2


def resweeps_allowed(ctx) -> int:
    """The resweeps this tune may make: RESWEEPS, and EXTRA_RESWEEPS more while a time budget has time left."""
    return RESWEEPS if ctx.clock.budget_s is None else RESWEEPS + EXTRA_RESWEEPS


def ceiling(ctx, done: int) -> int:
    """The most trials a resweep (the `done`-th of the tune) may give one problem."""
    return ctx.plan.trials if done < RESWEEPS else OVER_TRIALS * ctx.plan.trials


@dataclass
class Progress:
    """What a run of the command got to: the latest emission and validation, and why it stopped early."""

    emission: int | None = None
    validation: int | None = None
    stopped: str | None = None  # "time budget" where a phase was cut short


def share(ctx, phase: str) -> float | None:
    """The seconds `phase` may use: its weight against the phases after it."""
    names = list(WEIGHTS)
    return ctx.clock.share_s(WEIGHTS[phase], *(WEIGHTS[n] for n in names[names.index(phase) + 1:]))


def validation_share(ctx, again: str) -> float | None:
    """The seconds a validation may use: its share, or all the time the phases have left while no table of the
    tune is validated yet (an unvalidated table cannot be judged, resweep or gate on its held-out shapes)."""
    if not ctx.journal.get(J.VALIDATIONS):
        return ctx.clock.free_s()
    return share(ctx, "validate" + again)


def _phase(ctx, text: str) -> None:
    ctx.journal.touch()
    if ctx.progress is not None:
        ctx.progress.phase(text)


def settle(ctx) -> None:
    """The plan and the incumbent as the tune's first run recorded them: a later run keeps the incumbent it
    started with (not, say, the table an earlier run of the tune wrote)."""
    if ctx.journal.get(J.PLAN) is None:
        ctx.journal.put(J.PLAN, {"tune": ctx.plan.tune_id, "gpu": ctx.plan.gpu_key, "trials": ctx.plan.trials,
                                 "problems": [p.key for p in ctx.plan.problems],
                                 "heldout": [p.key for p in ctx.heldout], "from": ctx.plan.warm_start,
                                 "as_new_gpu": ctx.plan.as_new_gpu})
    kept = ctx.journal.get(J.INCUMBENT)
    if kept is None:
        found = ctx.incumbent
        kept = {"label": found.label if found else None, "record": record(found) if found else None}
        ctx.journal.put(J.INCUMBENT, kept)
    ctx.incumbent = from_record(kept["record"], kept["label"]) if kept["record"] else None
    ctx.incumbent_label = kept["label"]


# ----------------------------------------------------------------------------------------------------- sweeps


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _warm(ctx, problems) -> dict:
    """The --from table's config for each problem, as its study's first seed."""
    if ctx.warm_table is None:
        return {}
    from .warm import seeds

    return seeds(ctx.warm_table, problems, ctx.limits(), ctx.info.sm_count)


def _slot_seeds(ctx) -> dict:
    """The latest round's transfers as the sweep puts them in their slots: problem key -> (slot, configs)."""
    rounds = ctx.journal.get(J.ROUNDS, [])
    placed = rounds[-1].get("transfers", {}) if rounds else {}
    return {key: (t["slot"], t["configs"]) for key, t in placed.items()}


def sweep_to_targets(ctx, seconds: float | None, only: set[str] | None = None) -> bool:
    """Sweep each fitted problem (of `only`, when given) still short of its target, in one sweep (each study to
    its own target), the latest round's transfers in their slots; True once the sweeps ran to their end (a problem whose search space
    has nothing more to offer stays short), False when the time ran out first."""
    deadline = ctx.clock.deadline(seconds)
    placed = _slot_seeds(ctx)
    for attempt in range(2):  # once more where a problem came out short (a trial taken over from another worker)
        targets = ctx.targets()
        problems = [p for p in ctx.fit_problems() if only is None or p.key in only]
        counts = {k: len(v) for k, v in study_measurements(ctx, problems).items()}
        short = [p for p in problems if counts[p.key] < targets.get(p.key, 0)]
        if not short:
            return True
        if attempt:
            ctx.say(f"sweep: {len(short)} problems ended short of their trials (their search space offers no more "
                    "configs): " + ", ".join(p.key for p in short[:5]) + (" …" if len(short) > 5 else ""))
            return True
        outcome = sweep(ctx, short, {p.key: targets[p.key] for p in short}, seconds=_left(deadline),
                        prefix=ctx.plan.study_prefix, extra_seeds=_warm(ctx, short),
                        slot_seeds={p.key: placed[p.key] for p in short if p.key in placed})
        if outcome.signal:
            raise Stopped(outcome)
        if outcome.stopped:
            return False
    return True


def sweep_rounds(ctx, seconds: float | None) -> bool:
    """The rounds (`rounds.py`); True once they are over, False when the time ran out first."""
    deadline = ctx.clock.deadline(seconds)
    trials, step = ctx.plan.trials, round_step(ctx.plan.trials)
    uniform = opening(trials)
    if not ctx.journal.get(J.ROUNDS):
        targets = {p.key: uniform[0] for p in ctx.plan.problems}
        ctx.journal.append(J.ROUNDS, {"targets": targets, "raised": sorted(targets), "stalled": [], "given": []})
    while True:
        rounds = ctx.journal.get(J.ROUNDS)
        _phase(ctx, f"sweep, round {len(rounds)}")
        if not sweep_to_targets(ctx, _left(deadline)):
            return False
        if ctx.journal.get(J.SWEEP_DONE):
            return True
        before = rounds[-1]["targets"]
        measured = study_measurements(ctx, ctx.plan.problems)
        moved = transfers(ctx, ctx.plan.problems, measured) if transfers_from(before, trials) else {}
        if len(rounds) < len(uniform):  # the opening rounds: every problem alike
            opened = {p.key: uniform[len(rounds)] for p in ctx.plan.problems}
            decision = with_transfers(Round(opened, sorted(opened)), before, moved, trials,
                                      {k: len(v) for k, v in measured.items()})
            ctx.journal.append(J.ROUNDS, {"targets": decision.targets, **decision.to_dict()})
            _say_transfers(ctx, decision)
            continue
        values = {k: [m.median_us if m.status == "ok" else None for m in records] for k, records in measured.items()}
        stopped = stopped_after(rounds)
        tried = {k: len(t["configs"]) for k, t in rounds[-1].get("transfers", {}).items()}
        decision = next_round(values, before, stopped, trials, step, moved, tried)
        if not decision.changed:
            ctx.journal.put(J.SWEEP_DONE, True)
            ctx.say(f"sweep: the rounds are over after round {len(rounds)} ({len(stopped | set(decision.stalled))} "
                    "problems stalled)")
            return True
        ctx.journal.append(J.ROUNDS, {"targets": decision.targets, **decision.to_dict()})
        ctx.say(f"sweep: round {len(rounds) + 1}: {len(decision.raised)} problems get {step} more trials"
                + (f", {len(decision.stalled)} stalled (their trials go to {len(decision.given)} others)"
                   if decision.stalled else "")
                + (f", {len(decision.revived)} revived by a transfer" if decision.revived else ""))
        _say_transfers(ctx, decision)
        if deadline is not None and time.monotonic() >= deadline:
            return False


def _say_transfers(ctx, decision: Round) -> None:
    if decision.transfers:
        count = sum(len(t["configs"]) for t in decision.transfers.values())
        ctx.say(f"sweep: round {len(ctx.journal.get(J.ROUNDS))}: {count} transfers (the best configs of the "
                f"nearest problems of their family) to {len(decision.transfers)} problems")


# ------------------------------------------------------------------------------------------ tables, validation


def emit_latest(ctx, seconds: float | None) -> int | None:
    """The index of the tune's table for the measurements as they are now: the last one when nothing changed
    since it was emitted (with its re-measurement complete), else a new one. None before anything was measured."""
    found = inputs(ctx)
    if found is None:
        return None
    emissions = ctx.journal.get(J.EMISSIONS, [])
    if emissions and emissions[-1]["inputs"] == found.fingerprint and emissions[-1]["remeasured"]:
        return len(emissions) - 1
    _phase(ctx, f"emit table {len(emissions) + 1}")
    from normtune.kernels.select.tables import parse_table

    keep = parse_table(emissions[-1]["table"], "<tune table>") if emissions else ctx.incumbent
    deadline = ctx.clock.deadline(seconds)
    measured = remeasure(ctx, keep, seconds)
    raw = emit(ctx, keep)
    complete = deadline is None or time.monotonic() < deadline
    index = ctx.journal.append(J.EMISSIONS, {"inputs": raw["provenance"]["fingerprint"], "table": raw,
                                             "remeasured": complete, "elapsed_s": ctx.journal.elapsed_s()})
    rules = sum(len(f["rules"]) for f in raw["families"].values())
    ctx.say(f"emit: table {index + 1}, {len(raw['families'])} families, {rules} rules, from "
            f"{raw['provenance']['configs_measured']} measured configs ({measured} re-measured on neighbours)")
    return index


def validate_emission(ctx, index: int, seconds: float | None) -> int | None:
    """The index of emission `index`'s validation (done now unless done before); None when cut short."""
    for i, v in enumerate(ctx.journal.get(J.VALIDATIONS, [])):
        if v["emission"] == index:
            return i
    _phase(ctx, f"validate table {index + 1} on {len(ctx.heldout)} held-out shapes")
    found = validate_table(ctx, index, ctx.journal.get(J.EMISSIONS)[index]["table"], seconds)
    if found is None:
        return None
    summary = found["summary"]
    if ctx.progress is not None:
        ctx.progress.regret(summary["geomean_regret"])
    ctx.say(f"validate: table {index + 1}: held-out regret {num(summary['geomean_regret'], 3)} (worst "
            f"{num(summary['worst_regret'], 3)}) on {summary['shapes']} shapes; the analytic default's "
            f"{num(found['default_regret'], 3)}; at {found['elapsed_s']:.0f} s")
    return len(ctx.journal.get(J.VALIDATIONS)) - 1


def resweep(ctx, validation: int, seconds: float | None) -> bool | None:
    """Sweep where validation `validation` found the highest regret (decided once, continued after a kill): True
    when swept, False when the time ran out first, None when there is nothing worth it (or the tune had its
    RESWEEPS)."""
    done = [r for r in ctx.journal.get(J.RESWEEPS, []) if r["validation"] == validation]
    if done:
        decision = done[0]
    else:
        made = len(ctx.journal.get(J.RESWEEPS, []))
        if made >= resweeps_allowed(ctx):
            return None
        rows = rows_of(ctx.journal.get(J.VALIDATIONS)[validation])
        decision = decide(rows, ctx.fit_problems(), ctx.heldout, ctx.targets(), ctx.plan.trials,
                          ceiling(ctx, made))
        if decision is None and ctx.clock.budget_s is not None and ceiling(ctx, made) < ceiling(ctx, RESWEEPS):
            # with time left, the problems near the worst shapes, already at --trials, may go past it now
            decision = decide(rows, ctx.fit_problems(), ctx.heldout, ctx.targets(), ctx.plan.trials,
                              ceiling(ctx, RESWEEPS))
        if decision is None:
            return None
        ctx.journal.append(J.RESWEEPS, {"validation": validation, **decision})
        ctx.say(f"resweep: where the held-out regret is highest ({', '.join(w['problem'] for w in decision['worst'])})"
                f": {len(decision['added'])} shapes added, {len(decision['targets'])} problems given more trials")
    _phase(ctx, f"sweep again after validation {validation + 1}")
    return sweep_to_targets(ctx, seconds, only=set(decision["targets"]))


def run(ctx) -> Progress:
    """Every phase this run of the command gets to (see the module docstring)."""
    settle(ctx)
    out = Progress()
    if not sweep_rounds(ctx, share(ctx, "sweep")):
        out.stopped = "time budget"
    for cycle in range(resweeps_allowed(ctx) + 1):
        again = " again" if cycle else ""
        if ctx.clock.out():
            out.stopped = "time budget"
            break
        index = emit_latest(ctx, share(ctx, "emit" + again))
        if index is None:
            break
        out.emission = index
        if ctx.clock.out():
            out.stopped = "time budget"
            break
        out.validation = validate_emission(ctx, index, validation_share(ctx, again))
        if out.validation is None:
            out.stopped = "time budget"
            break
        if cycle == resweeps_allowed(ctx) or ctx.clock.out():
            break
        swept = resweep(ctx, out.validation, share(ctx, "resweep"))
        if not swept:
            out.stopped = out.stopped if swept is None else "time budget"
            break
    return out
