"""A tune's report (`write`): report.md, time-to-table.png (held-out regret against the tune's elapsed time),
heldout.png (each held-out shape's regret, the table's and the analytic default's) and time-to-table.json (the
points of the plot), all from the journal, so that a later run redraws them with every validation so far."""

from __future__ import annotations

import json
from pathlib import Path

from ..render import markdown_table, num, validation_summary, validation_table
from ..report.plots import Pictures
from . import journal as J
from .checking import rows_of


def points(ctx) -> list[dict]:
    """One point per validation: the tune's elapsed time and the held-out regrets (geometric mean, worst, the
    analytic default's)."""
    return [{"validation": i + 1, "table": v["emission"] + 1, "elapsed_s": round(v["elapsed_s"], 1),
             "geomean_regret": v["summary"]["geomean_regret"], "worst_regret": v["summary"]["worst_regret"],
             "default_regret": v["default_regret"], "shapes": v["summary"]["shapes"]}
            for i, v in enumerate(ctx.journal.get(J.VALIDATIONS, []))]


def _time_to_table(pictures: Pictures, pts: list[dict], interpret: bool, gpu: str) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    xs = [p["elapsed_s"] for p in pts]
    ax.plot(xs, [p["geomean_regret"] for p in pts], "o-", label="table: geometric mean")
    ax.plot(xs, [p["worst_regret"] for p in pts], "s--", label="table: worst shape")
    ax.plot(xs, [p["default_regret"] for p in pts], "^:", label="analytic default: geometric mean")
    for p in pts:
        ax.annotate(f"table {p['table']}", (p["elapsed_s"], p["geomean_regret"]), textcoords="offset points",
                    xytext=(4, -12), fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("elapsed tune time, s" + (" (interpreter)" if interpret else ""))
    ax.set_ylabel("held-out regret (1.0 = fastest known)")
    ax.set_title(f"Time to table — {gpu}")
    ax.legend(fontsize=8)
    return pictures.save(fig, "time-to-table.png")


def _heldout(pictures: Pictures, rows) -> str:
    from matplotlib.figure import Figure

    labels = [f"{r.problem.norm[:3]}{' res' if r.problem.residual else ''}{' gate' if r.problem.gate else ''} "
              f"{r.problem.M}×{r.problem.N}" for r in rows]
    table = [r.regret.value if r.regret else float("nan") for r in rows]
    default = [r.times["default"].median / r.fastest().median if r.times.get("default") and r.fastest()
               else float("nan") for r in rows]
    fig = Figure(figsize=(max(6, 0.5 * len(rows) + 2), 4), layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], table, 0.4, label="table")
    ax.bar([x + 0.2 for x in xs], default, 0.4, label="analytic default")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("time ÷ fastest of table, reference, default")
    ax.set_title("Held-out shapes")
    ax.legend(fontsize=8)
    return pictures.save(fig, "heldout.png")


def _rounds(ctx) -> list[str]:
    body = [[str(i + 1), str(len(r["raised"])), str(len(r["stalled"])), str(len(r["given"])),
             str(sum(r["targets"].values()))] for i, r in enumerate(ctx.journal.get(J.ROUNDS, []))]
    lines = markdown_table(["round", "problems given trials", "stalled", "given the stalled ones' trials",
                            "trials planned"], body)
    for r in ctx.journal.get(J.RESWEEPS, []):
        worst = ", ".join(f"{w['problem']} ({w['regret']:.3f})" for w in r["worst"])
        lines += ["", f"After validation {r['validation'] + 1}, swept again where the held-out regret was highest "
                      f"({worst}): {len(r['added'])} fitted shapes added, {len(r['targets'])} problems given trials."]
    return lines


def _gate(record: dict | None, incumbent: str | None) -> list[str]:
    if record is None:
        return ["No table was gated (nothing measured yet)."]
    counts = ", ".join(f"{v}: {n}" for v, n in sorted(record["verdicts"].items()))
    lines = [f"{record['shapes']} shapes (fitted and held-out) checked against the analytic default"
             + (f" and the incumbent `{incumbent}`" if incumbent else "") + f": {counts}."]
    if record["fall_backs"]:
        body = [[e["family"], str(e["rule"]), ", ".join(e["lost_on"]), e["to"]] for e in record["fall_backs"]]
        lines += ["", "Rules that lost fell back:", ""] + markdown_table(["family", "rule", "lost on", "now"], body)
    if record.get("retimed"):  # records of older runs have none
        n = len(record["retimed"])
        lines += ["", f"Timed head to head at the gate, the tune's own times having the table slower in median: "
                      f"{n} shape{'' if n == 1 else 's'} (those that then lost are among the fall-backs)."]
    if record["still_slower"]:
        lines += ["", "Still slower after the fall-backs: " + ", ".join(c["problem"] for c in record["still_slower"])]
    if record["untimed"]:
        lines += ["", f"Not timed (the time ran out): {len(record['untimed'])} shapes; the next run times them."]
    return lines


def write(ctx, out: Path, table_path: Path | None, table: dict | None, gate_record: dict | None,
          stopped: str | None) -> Path:
    """Write the report into `out`; returns report.md's path. The table's path is shown as given."""
    out.mkdir(parents=True, exist_ok=True)
    pictures = Pictures(out)
    pts = points(ctx)
    (out / "time-to-table.json").write_text(json.dumps({"tune": ctx.plan.tune_id, "points": pts}, indent=1) + "\n")
    validations = ctx.journal.get(J.VALIDATIONS, [])
    shipped = None if table is None else table["provenance"]["tune"]["table"] - 1
    chosen = next((v for v in validations if v["emission"] == shipped), None)
    timing = ("Triton-interpreter timings: host wall-clock on CPU, not GPU time" if ctx.plan.interpret
              else "cold-L2 device time, medians of interleaved rounds")
    lines = [f"# normtune tune — {ctx.info.name}", "",
             (f"Table: `{table_path}` (table {shipped + 1} of the tune, {len(table['families'])} families, "
              f"{sum(len(f['rules']) for f in table['families'].values())} rules)." if table is not None
              else "No table was written: nothing passed yet."),
             f"Tune `{ctx.plan.tune_id}` on {ctx.plan.gpu_key}: {len(ctx.fit_problems())} fitted problems, "
             f"{len(ctx.heldout)} generated held-out shapes; {ctx.journal.elapsed_s():.0f} s over "
             f"{len(ctx.journal.get(J.CLOCK, []))} run(s) of the command; incumbent "
             f"{ctx.incumbent_label or 'none (the analytic default)'}"
             + (f"; warm start {ctx.plan.warm_start}" if ctx.plan.warm_start else "")
             + ("; as a new GPU (its own tables hidden)" if ctx.plan.as_new_gpu else "") + f". {timing}.",
             ""] + ([] if stopped is None else [f"**Stopped early ({stopped})**: run the same command again to "
                                                "continue.", ""]) + ["## Time to table", ""]
    if pts:
        lines += [_time_to_table(pictures, pts, ctx.plan.interpret, ctx.info.name), ""]
        lines += markdown_table(["validation", "table", "elapsed s", "held-out regret", "worst", "default's regret"],
                                [[str(p["validation"]), str(p["table"]), num(p["elapsed_s"]),
                                 num(p["geomean_regret"], 3), num(p["worst_regret"], 3), num(p["default_regret"], 3)]
                                 for p in pts])
    else:
        lines.append("No validation yet.")
    lines += ["", "## Held-out shapes", ""]
    if chosen is not None:
        rows = rows_of(chosen)
        lines += ["Regret = the table's time ÷ the fastest of the table's config, the best of an unseeded sweep of "
                  f"{ctx.plan.reference_trials} trials and the analytic default, timed head to head. The shapes "
                  "are generated between and around the fitted ones; none is fitted, none is in the held-out "
                  "preset.", "", _heldout(pictures, rows), ""]
        lines += validation_table(rows) + ["", validation_summary(chosen["summary"])]
    else:
        lines.append("The written table was not validated (the time ran out first).")
    lines += ["", "## Gate", ""] + _gate(gate_record, ctx.incumbent_label)
    lines += ["", "## Where the trials went", ""] + _rounds(ctx)
    lines += ["", "## Continue or reproduce", "", f"    {ctx.command_line}", "",
              "The same command continues this tune from its database (every measurement and decision is there)."]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
