"""The report's sections, results first: a summary, normtune against the peers, the best config per problem
against the analytic default, the per-kernel breakdown, then the launch-knob heatmaps, the heuristic table,
validation, and provenance last (`provenance.py`). Every table and plot names its GPU and dtype. A section whose
data is missing becomes one sentence; pictures are saved through `plots.Pictures` and linked where they belong.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.problem import ProblemFamily
from normtune.kernels.select.tables import parse_table, read_json

from ..measure.bench import OURS, summary
from ..tables.emit import build_table
from ..tables.fit import single_pass_threshold
from ..render import MISSING, geomean, markdown_table, num, ratio, validation_summary, validation_table
from ..tables.validate import summarize
from . import plots
from .data import BenchRun, ProblemSummary, ReportData, heatmap_cells
from .notes import split_and_floor_notes
from .provenance import command_text

HEATMAP_PAIRS = (("k1_block_row", "k1_num_warps"), ("k2_block_m", "k2_block_n"), ("k1_programs_per_sm", "k2_block_m"))
REGRET_LIMIT = 1.10  # regret worth a second look: the table's time exceeds the fastest candidate's by more than this ratio


def family_title(family) -> str:
    """'layer_norm bf16 (weights bf16, with bias, saves the input)': what a table or plot covers."""
    extras = [f"weights {family.weight_dtype}" if family.has_weight else "no weight",
              "with bias" if family.has_bias else "no bias"]
    if family.zero_centered:
        extras.append("zero-centered")
    if getattr(family, "residual", False):
        extras.append(f"fused residual add, {family.residual_dtype} stream")
    if getattr(family, "gate", None) is not None:
        extras.append(f"the norm {family.gate} a {family.gate_activation} gate")
    extras.append(f"saves the {family.save}")
    return f"{family.norm} {family.dtype} ({', '.join(extras)})"


def size_facets(items: list, problem_of, family_of=lambda p: p.family) -> list[tuple[str, list]]:
    """Panels of at most `plots.MAX_PER_AXIS` items: one set per family (norm, dtype, …), each sorted by N then M
    and cut into size classes named by their N range."""
    groups = []
    for family in dict.fromkeys(family_of(problem_of(i)) for i in items):
        mine = sorted((i for i in items if family_of(problem_of(i)) == family),
                      key=lambda i: (problem_of(i).N, problem_of(i).M))
        for chunk in plots.chunks(mine):
            low, high = problem_of(chunk[0]).N, problem_of(chunk[-1]).N
            name = family_title(family) if hasattr(family, "weight_dtype") else str(family)
            groups.append((f"{name}, N {low}" + (f"–{high}" if high != low else ""), chunk))
    return groups


def _shape(problem: Problem) -> str:
    return f"{problem.M}×{problem.N}"


def header_section(data: ReportData) -> list[str]:
    name = data.runs[-1].gpu_name
    timing = ("**These are Triton-interpreter timings** (host wall-clock on CPU): they exercise the pipeline and "
              "say nothing about GPU speed." if data.interpret else
              "Times are medians of repeated runs of the whole backward with the L2 cache flushed before each "
              "(\"cold L2\"), in µs of GPU time; lower is better.")
    return [f"# normtune report — {name} (`{data.gpu_key}`)", "", timing, ""]


def summary_section(data: ReportData, summaries: list[ProblemSummary], bench: BenchRun | None, bench_rows,
                    validation) -> list[str]:
    gpu = data.runs[-1].gpu_name
    lines = ["## Summary", ""]
    per_shape = summary(bench_rows) if bench else []
    speedups = [s["speedup"] for s in per_shape if s["speedup"]]
    if speedups:
        lines.append(f"- **normtune vs the fastest peer** ({gpu}, {bench.dtype}, {bench.shapes} shapes, bench run "
                     f"{bench.run.id}): faster on {sum(x > 1 for x in speedups)} of {len(speedups)} shapes, "
                     f"geometric-mean speedup **{geomean(speedups):.3f}×**.")
    else:
        lines.append("- normtune vs the peers: no bench run with peers for this GPU.")
    gains = []
    families = list(dict.fromkeys(s.problem.family for s in summaries))
    short = {f: f"{f.norm} {f.dtype}" + (" + residual add" if getattr(f, "residual", False) else "") for f in families}
    for family in families:
        mine = [s.default_us / s.best.median_us for s in summaries
                if s.problem.family == family and s.default_us and s.best]
        if mine:  # the short name where it tells the family apart from the others, else the full title
            name = short[family] if list(short.values()).count(short[family]) == 1 else family_title(family)
            gains.append(f"{name} {geomean(mine):.3f}× ({len(mine)})")
    if gains:
        lines.append(f"- **Best measured config vs the analytic default** (what runs without a table), {gpu}, "
                     f"geometric mean (problems): {'; '.join(gains)}.")
    for form, run, rows in validation:
        rated = [r for r in rows if r.regret]
        if rated:
            s = summarize(rated)
            what = "Held-out validation" + (", fused residual add" if form else "")
            lines.append(f"- **{what}** (run {run.id}, {gpu}, {len(rated)} shapes): the table's regret is "
                         f"{s['geomean_regret']:.3f} (geometric mean; worst {s['worst_regret']:.3f}), where 1.000 "
                         "means its config was the fastest of those timed.")
    return lines + [""]


def peers_section(data: ReportData, bench: BenchRun | None, rows: list[dict], others: list[tuple[BenchRun, list]],
                  pictures: plots.Pictures) -> list[str]:
    gpu = data.runs[-1].gpu_name
    lines = ["## normtune vs peers", ""]
    if bench is None:
        return lines + ["No bench run for this GPU: run `normtune bench --peers all` to compare with the peers.", ""]
    run = bench.run
    peers = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != OURS]
    lines += [f"{gpu}, **{bench.dtype}**, bench run {run.id} ({run.started_at:%Y-%m-%d}, git "
              f"{run.device.git_revision or 'unrecorded'}): `{command_text(run.command_line)}`. Each column is the "
              "backward's time in µs; speedup = the fastest peer's time ÷ normtune's. The floor is the time to "
              "move the bytes the backward must read and write at the copy bandwidth stored with the run ("
              f"{num(run.copy_bandwidth_gbps, 0) + ' GB/s' if run.copy_bandwidth_gbps else 'n/a'}).", ""]
    if not peers or not any(r["impl"] == OURS for r in rows):
        return lines + [f"Bench run {run.id} holds no {'peer results' if not peers else 'normtune times'} to "
                        "compare.", ""]
    by_impl = {(r["norm"], r["M"], r["N"], r["impl"]): r for r in rows}
    per_shape = summary(rows)
    body = []
    for s in per_shape:
        cells = [f"{s['norm']} {s['M']}×{s['N']}", num(s["floor_us"]), num(s["normtune_us"])]
        for peer in peers:
            r = by_impl.get((s["norm"], s["M"], s["N"], peer))
            cells.append(num(r["median_us"]) if r and r["status"] == "ok" else (r["status"] if r else MISSING))
        body.append(cells + [s["best_peer"] or MISSING, num(s["speedup"], 2) + "×" if s["speedup"] else MISSING])
    lines += markdown_table(["problem", "floor", "normtune", *peers, "best peer", "speedup"], body) + [""]
    for norm in [None] + list(dict.fromkeys(s["norm"] for s in per_shape)):
        speedups = [s["speedup"] for s in per_shape if s["speedup"] and norm in (None, s["norm"])]
        if speedups:
            lines.append(f"- {norm or '**all**'}: normtune beats the best peer on {sum(x > 1 for x in speedups)}/"
                         f"{len(speedups)} shapes; geometric-mean speedup {geomean(speedups):.3f}×")
    lines.append("")
    items = [(s["norm"], s["M"], s["N"]) for s in per_shape if s["normtune_us"]]

    def draw(ax, subtitle, chunk):
        series = {}
        for impl in peers:
            series[impl] = [(r["median_us"] / by_impl[(n, m, k, OURS)]["median_us"]
                             if (r := by_impl.get((n, m, k, impl))) and r["status"] == "ok" else None)
                            for n, m, k in chunk]
        plots.grouped_ratio_panel(ax, [f"{m}×{k}" for _, m, k in chunk], series,
                                  ylabel="peer time ÷ normtune time", subtitle=subtitle)

    groups = size_facets(items, lambda i: _Shape(*i), family_of=lambda p: f"{p.norm} {bench.dtype}")
    fig = plots.faceted(groups, draw, title=f"normtune vs peers — {gpu}, {bench.dtype}, bench run {run.id} "
                                            "(above 1: the peer is slower)")
    lines += [pictures.save(fig, "peers.png"), ""]
    if others:
        lines += ["Other bench runs of this GPU (the latest of each dtype and shape set):", ""]
        for other, other_rows in others:
            speedups = [s["speedup"] for s in summary(other_rows) if s["speedup"]]
            result = (f"faster than the fastest peer on {sum(x > 1 for x in speedups)} of {len(speedups)}, "
                      f"geometric-mean speedup {geomean(speedups):.3f}×" if speedups else "no peer to compare")
            lines.append(f"- run {other.run.id}, **{other.dtype}**, {other.shapes} shapes: {result} "
                         f"(`{command_text(other.run.command_line)}`)")
        lines.append("")
    return lines


class _Shape:
    """A bench row's (norm, M, N) where `size_facets` expects a problem."""

    def __init__(self, norm: str, M: int, N: int):
        self.norm, self.M, self.N = norm, M, N


def problems_section(summaries: list[ProblemSummary], data: ReportData, pictures: plots.Pictures) -> list[str]:
    gpu = data.runs[-1].gpu_name
    lines = ["## Best config per problem, against the analytic default", ""]
    if not summaries:
        return lines + ["No measurements are stored for this GPU yet: run `normtune sweep` first.", ""]
    lines += ["Best = the fastest correct measurement of any run. Default = the analytic default config (what runs "
              "without a table) timed in the same run as the best (– where that run did not time it). GB/s counts "
              "every byte both kernels move. % floor = the memory floor (the bytes the backward must move, 3·M·N·"
              "itemsize, 4 passes with the fused residual add, at the copy bandwidth stored with the best's run; "
              "n/a where that run stored none) ÷ the best time. Trials = every stored measurement of the problem. "
              "† and ‡ are explained below the tables.", ""]
    for family in dict.fromkeys(s.problem.family for s in summaries):
        body = []
        for s in (s for s in summaries if s.problem.family == family):
            b = s.best
            body.append([_shape(s.problem), f"`{b.config}`" if b else "no correct run",
                         num(b and b.median_us), num(b and b.kernel_1_us) + ("†" if s.split_above_total else ""),
                         num(b and b.kernel_2_us), num(s.gbps, 0),
                         num(100 * s.floor_fraction, 0) + ("‡" if s.floor_fraction > 1 else "") if s.floor_fraction
                         else ("n/a" if b else MISSING),
                         str(b.run_id) if b else MISSING, num(s.default_us), ratio(s.default_us, b and b.median_us),
                         str(s.trials), ", ".join(f"{k} {n}" for k, n in s.failures.items()) or MISSING])
        lines += [f"### {family_title(family)} — {gpu}", ""] + markdown_table(
            ["M×N", "best config", "µs", "kernel_1 µs", "kernel_2 µs", "GB/s", "% floor", "run", "default µs",
             "default ÷ best", "trials", "failed"], body) + [""]
    lines += split_and_floor_notes(summaries)
    with_default = [s for s in summaries if s.default_us and s.best]
    if with_default:
        def draw(ax, subtitle, chunk):
            plots.ratio_panel(ax, [_shape(s.problem) for s in chunk], [s.default_us / s.best.median_us for s in chunk],
                              ylabel="default ÷ best", lines={"1.0 = the default is the best": 1.0},
                              subtitle=subtitle)

        for norm in dict.fromkeys(s.problem.norm for s in with_default):
            fig = plots.faceted(size_facets([s for s in with_default if s.problem.norm == norm], lambda s: s.problem),
                                draw, title=f"{norm}: what tuning gains over the analytic default — {gpu}"
                                + (" (interpreter)" if data.interpret else ""))
            lines.append(pictures.save(fig, f"best_vs_default_{norm}.png"))
        lines.append("")
    else:
        lines += ["The analytic default was not timed in the best's run of any problem.", ""]
    return lines


def kernels_section(summaries: list[ProblemSummary], data: ReportData, pictures: plots.Pictures) -> list[str]:
    gpu = data.runs[-1].gpu_name
    lines = ["## Where the time goes: kernel_1 and kernel_2", ""]
    timed = [s for s in summaries if s.best and s.best.median_us]
    if not timed:
        return lines + ["No problem ran correctly: nothing to break down.", ""]
    lines += ["kernel_1 computes the input gradient and per-program partial sums of the weight and bias "
              "gradients; kernel_2 adds the partials up. Each bar is the best config's time split into the two "
              "kernels' shares; the tick marks how close the total is to the memory floor (1.0 = at the floor). "
              "Where the split adds up to more than the total (†, above), both shares are scaled down to it.", ""]
    unit = "µs" if not data.interpret else "µs (interpreter)"

    def draw(ax, subtitle, chunk):
        plots.share_panel(ax, [_shape(s.problem) for s in chunk], [s.best.median_us for s in chunk],
                          [s.best.kernel_1_us for s in chunk], [s.best.kernel_2_us for s in chunk],
                          [s.floor_us for s in chunk], subtitle=subtitle, unit=unit)

    families = list(dict.fromkeys(s.problem.family for s in timed))
    for family in families:
        mine = [s for s in timed if s.problem.family == family]
        fig = plots.faceted(size_facets(mine, lambda s: s.problem), draw,
                            title=f"Per-kernel breakdown of the best config — {family_title(family)}, {gpu}")
        short = f"{family.norm}_{family.dtype}"
        unique = sum(f"{f.norm}_{f.dtype}" == short for f in families) == 1
        slug = short if unique else family.key.replace("/", "_")
        lines += [pictures.save(fig, f"kernels_{slug}.png"), ""]
    return lines


def heatmap_section(data: ReportData, focus: ProblemSummary | None, pictures: plots.Pictures) -> list[str]:
    lines = ["## Launch knobs", ""]
    if focus is None or focus.best is None:
        return lines + ["No correct measurement to draw heatmaps from.", ""]
    p = focus.problem
    rows = [m for m in data.measurements if m.problem == p]
    gpu = data.runs[-1].gpu_name
    lines += [f"{p.norm} {p.dtype} {p.M}×{p.N} on {gpu} (`{p.key}`, {focus.trials} "
              "measurements): each cell is the best µs among the configs with those two values; blank cells were "
              "never measured (or never ran correctly).", ""]
    unit = plots.time_label(data.interpret)
    for x, y in HEATMAP_PAIRS:
        fig = plots.heatmap(heatmap_cells(rows, x, y), x, y, unit=unit,
                            title=f"{p.norm} {p.M}×{p.N} {p.dtype}"
                            f"{' + residual add' if p.residual else ''} on {gpu}: best {unit}")
        lines.append(pictures.save(fig, f"heatmap_{x}_{y}.png"))
    return lines + [""]


def rules_section(store, data: ReportData, table_path: str | None) -> list[str]:
    lines = ["## Heuristic table", ""]
    table, origin = _table(store, data, table_path)
    if table is None:
        return lines + [origin, ""]
    prov = table.get("provenance", {})
    runs = prov.get("runs") or []
    lines += [f"{origin}: tuned on {table['gpu']['name']}, fitted on {len(runs)} runs "
              f"({', '.join(map(str, runs)) or 'unrecorded'}), {prov.get('configs_measured', '?')} measured configs, "
              f"{prov.get('date', 'undated')}" + (f", inputs {prov['fingerprint'][:19]}…" if prov.get("fingerprint")
                                                  else "") + ". A rule answers for the shapes between the smallest "
              "and largest it was fitted on (its fitted box); other shapes run the analytic default.", ""]
    if table["gpu"].get("key") not in (None, data.gpu_key):
        lines += [f"Note: this table was tuned for `{table['gpu']['key']}`, not `{data.gpu_key}`.", ""]
    for family, fam in sorted(table["families"].items()):
        threshold = fam.get("single_pass_max_n", single_pass_threshold(fam["rules"]))
        lines += [f"### {family_title(ProblemFamily.from_key(family))} — {table['gpu']['name']}", "",
                  f"`{family}`. Learned single-pass threshold: "
                  + (f"single pass up to N = {threshold}." if threshold else "no rule runs single pass."), ""]
        lines += markdown_table(["N ≤", "M ≤", "config", "fitted on"],
                                [[str(r["n_max"] or "∞"), str(r["m_max"] or "∞"),
                                  f"`{BackwardConfig.from_dict(r['config'])}`", ", ".join(r["fitted_on"])]
                                 for r in fam["rules"]]) + [""]
        for d in fam.get("dropped", []):
            losses = ", ".join(f"{k} {v['us']} vs {v['default_us']} µs" for k, v in d["slower_than_default"].items())
            lines.append(f"- dropped `{BackwardConfig.from_dict(d['config'])}` for {', '.join(d['fitted_on'])}: "
                         f"slower than the analytic default beyond the spread ({losses})")
        if fam.get("default_unmeasured"):
            lines.append(f"- not checked against the default (never timed there): "
                         f"{', '.join(fam['default_unmeasured'])}")
        lines.append("")
    return lines


def _table(store, data: ReportData, table_path: str | None) -> tuple[dict | None, str]:
    """(table dict, where it came from): the given file, the shipped one, or a fit of the stored results."""
    if table_path is not None:
        # Parsed afresh (not kernels.tables.load_table's cache): a report after `emit` must see the new file.
        return parse_table(read_json(str(table_path)), str(table_path)).raw, f"`{table_path}`"
    shipped = resources.files("normtune.configs") / f"{data.gpu_key}.json"
    local = Path("configs") / f"{data.gpu_key}.json"  # where `emit` writes by default, from this folder
    if local.is_file():
        text = local.read_text()
        same = shipped.is_file() and shipped.read_text() == text
        return (parse_table(json.loads(text), str(local)).raw,
                f"`{local}`" + (" (shipped)" if same else " (in this folder, where `emit` writes by default)"))
    if shipped.is_file():
        path = f"configs/{data.gpu_key}.json"
        return parse_table(json.loads(shipped.read_text()), path).raw, f"`{path}` (shipped)"
    try:
        return (build_table(store, data.gpu_key, interpret=data.interpret),
                f"No table file for `{data.gpu_key}`; rules fitted now from the stored results (not saved)")
    except ValueError as err:
        return None, f"No table file for `{data.gpu_key}`, and none can be fitted: {err}"


def validation_section(data: ReportData, validation, pictures: plots.Pictures) -> list[str]:
    """The latest validation of each problem form (`ReportData.latest_validations`), plain norms first."""
    lines = ["## Validation on held-out shapes", ""]
    if not validation:
        return lines + ["No validation run for this GPU: run `normtune validate` to measure the table's regret on "
                        "shapes it was not fitted on.", ""]
    for form, run, rows in validation:
        if len(validation) > 1:
            lines += [f"### {'The fused residual add' if form else 'The plain norms'}", ""]
        lines += _validation_run(data, form, run, rows, pictures)
    return lines


def _validation_run(data: ReportData, form: str, run, rows, pictures: plots.Pictures) -> list[str]:
    rated = [r for r in rows if r.regret]
    if not rated:
        return [f"Validation run {run.id} ({run.started_at:%Y-%m-%d}) has no correct head-to-head times "
                "of the table's config.", ""]
    legacy = any(m.source == "validate-best" for m in data.measurements if m.run_id == run.id)
    reference = ("the best config of a short sweep seeded with the table's config and the default (an older "
                 "validate: not an independent reference)" if legacy else
                 "the best config of an unseeded sweep")
    over = sum(r.regret.value > REGRET_LIMIT for r in rated)
    gpu = run.gpu_name
    lines = [f"{gpu}, validation run {run.id} ({run.started_at:%Y-%m-%d}, git "
             f"{run.device.git_revision or 'unrecorded'}), on shapes the table was not fitted on (each row names "
             f"its dtype): the table's config, the reference ({reference}) and the analytic default, timed head to "
             "head in interleaved rounds (default: – where the run timed an older default than today's). "
             "Regret = table ÷ the fastest of the three, bounds from the p10–p90 spreads.", ""]
    lines += validation_table(rows)
    lines += ["", f"**{validation_summary(summarize(rows))}** {over} of {len(rated)} shapes exceed a regret of "
                  f"{REGRET_LIMIT:.2f}.", ""]

    def draw(ax, subtitle, chunk):
        plots.ratio_panel(ax, [_shape(r.problem) for r in chunk], [r.regret.value for r in chunk],
                          ylabel="regret (table ÷ fastest)",
                          lines={"1.0 = the table's config was the fastest": 1.0,
                                 f"{REGRET_LIMIT:.2f} = worth a second look": REGRET_LIMIT}, subtitle=subtitle)

    suffix = f"_{form}" if form else ""
    for norm in dict.fromkeys(r.problem.norm for r in rated):
        title = f"{norm}{' + residual add' if form else ''}: regret of the table on held-out shapes — {gpu}, run {run.id}"
        fig = plots.faceted(size_facets([r for r in rated if r.problem.norm == norm], lambda r: r.problem), draw,
                            title=title + (", interpreter wall-clock" if data.interpret else ""))
        lines.append(pictures.save(fig, f"validation_{norm}{suffix}.png"))
    return lines + [""]
