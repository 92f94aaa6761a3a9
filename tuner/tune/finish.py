"""The end of every run of `normtune tune`: the best table so far (`candidate`: of the validated ones with the most
families, the one of lowest held-out regret; else the latest), gated (`gate.py`) with the times of everything the
tune measured and, while time allows, head-to-head timings of what nobody timed, then stamped with the tune's
provenance and written."""

from __future__ import annotations

import time
from pathlib import Path

from normtune.kernels.select.tables import parse_table

from ..measure.spread import Timing
from ..space import Space
from ..tables.compare import head_to_head
from ..tables.emit import dumps, write_table
from . import journal as J
from .checking import ROUNDS, incumbent_times, rows_of
from .emission import emit, evidence
from .gate import FAILED, gate


def candidate(ctx) -> int | None:
    """The emission to ship: of the validated ones, those with the most families (a family left out runs the
    analytic default, which the gate would otherwise have kept wherever it is faster), the one of lowest held-out
    regret among them (the later on a tie); else the latest; with none yet, one fitted now on what was measured
    (no re-measurement: the final steps' time is short)."""
    emissions = ctx.journal.get(J.EMISSIONS, [])
    validated = [v for v in ctx.journal.get(J.VALIDATIONS, []) if v["summary"]["geomean_regret"] is not None]
    if validated:
        best = min(validated, key=lambda v: (-len(emissions[v["emission"]]["table"]["families"]),
                                             v["summary"]["geomean_regret"], -v["emission"]))
        return best["emission"]
    if emissions:
        return len(emissions) - 1
    raw = emit(ctx, ctx.incumbent)
    if raw is None:
        return None
    return ctx.journal.append(J.EMISSIONS, {"inputs": raw["provenance"]["fingerprint"], "table": raw,
                                            "remeasured": False, "elapsed_s": ctx.journal.elapsed_s()})


def _lookup(ctx):
    """(problem, config) → its time: pooled over the tune's fitted measurements, or from a validation's head to
    head (the latest that timed it); a config is also looked up in the canonical form a sweep stores."""
    times: dict[tuple[str, str], Timing] = dict(evidence(ctx))
    for record in ctx.journal.get(J.VALIDATIONS, []):  # timed head to head: None there is a config that failed
        for row in rows_of(record):
            for name, config in row.configs.items():
                if config is not None:
                    times[(row.problem.key, config.to_json())] = row.times.get(name) or FAILED
        for key, (config, t) in incumbent_times(record).items():
            times[(key, config.to_json())] = t or FAILED
    limits = ctx.limits()

    def lookup(problem, config):
        found = times.get((problem.key, config.to_json()))
        if found is None:
            canonical = Space(problem, ctx.info.sm_count, limits).canonical(config)
            found = times.get((problem.key, canonical.to_json()))
        return found

    return lookup


def _timer(ctx, until: float | None):
    """Head-to-head timing of a gate's configs (stored in a "validate" run), until the monotonic time `until`."""
    run: list[int] = []

    def timer(problem, configs: dict) -> dict:
        if until is not None and time.monotonic() >= until:
            return {}
        session = ctx.session()
        if not run:
            run.append(ctx.store.start_run(ctx.info, kind="validate", command_line=ctx.command_line,
                                           copy_bandwidth_gbps=session.recorded_bandwidth_gbps))
        unique = {}
        for name, config in configs.items():
            unique.setdefault(config, name)

        def store(name, config, result):
            ctx.store.add_measurement(run[0], problem, config, result, source=f"validate-gate-{name}")

        times = head_to_head(session, problem, {name: c for c, name in unique.items()}, rounds=ROUNDS,
                             on_result=store)
        return {name: times.get(unique[config]) for name, config in configs.items()}

    def close():
        if run:
            ctx.store.end_run(run[0])

    return timer, close


def gated(ctx, index: int, until: float | None) -> tuple[dict | None, dict]:
    """Emission `index` through the gate (once per emission: a later run reuses the verdict)."""
    done = ctx.journal.get(J.GATES, {})
    if str(index) in done:
        return done[str(index)]["table"], done[str(index)]["record"]
    raw = ctx.journal.get(J.EMISSIONS)[index]["table"]
    problems = ctx.fit_problems() + list(ctx.heldout)
    timer, close = _timer(ctx, until)
    try:
        table, record = gate(raw, problems, ctx.incumbent, ctx.limits(), _lookup(ctx), timer)
    finally:
        close()
    if not record["untimed"]:  # a verdict with every shape timed stands; else the next run times the rest
        ctx.journal.put(J.GATES, {**done, str(index): {"table": table, "record": record}})
    return table, record


def stamped(ctx, raw: dict, index: int, record: dict) -> dict:
    """The table with what the tune did in its provenance ("tune")."""
    validation = next((v for v in ctx.journal.get(J.VALIDATIONS, []) if v["emission"] == index), None)
    out = dict(raw)
    out["provenance"] = {**raw["provenance"], "tune": {
        "id": ctx.plan.tune_id, "command": ctx.command_line, "table": index + 1,
        "elapsed_s": round(ctx.journal.get(J.EMISSIONS)[index]["elapsed_s"], 1), "from": ctx.plan.warm_start,
        "as_new_gpu": ctx.plan.as_new_gpu,
        "incumbent": ctx.incumbent_label,
        "held_out": None if validation is None else {k: validation["summary"][k] for k in
                                                     ("shapes", "geomean_regret", "worst_regret")},
        "gate": {"verdicts": record["verdicts"], "fall_backs": len(record["fall_backs"]),
                 "still_slower": [c["problem"] for c in record["still_slower"]]}}}
    parse_table(out, "<tune table>")  # the runtime must accept what is written
    return out


def write(path: Path, table: dict) -> Path | None:
    """Write the table as `emit` does (atomically, with its sha256 record; a table emit or tune did not write, or
    one changed since, is not replaced). Returns the backup of the table it replaced, if any."""
    return write_table(path, dumps(table))

