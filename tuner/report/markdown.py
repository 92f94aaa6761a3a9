"""The report's sections, in order: header, provenance, best config per problem, launch-knob heatmaps, the
heuristic table, validation, peers. Each reads `data`/the store and becomes one sentence when its data is
missing; pictures are saved through `plots.Pictures` and linked where they belong.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.tables import TableError, parse_table

from ..bench import OURS, summary
from ..emit import build_table
from ..fit import single_pass_threshold
from ..render import MISSING, geomean, markdown_table, num, ratio, validation_summary, validation_table
from ..validate import summarize
from . import plots
from .data import ReportData, ProblemSummary, heatmap_cells

HEATMAP_PAIRS = (("k1_block_row", "k1_num_warps"), ("k2_block_m", "k2_block_n"), ("k1_programs_per_sm", "k2_block_m"))
REGRET_LIMIT = 1.10  # regret worth a second look: the table loses more than 10 % to the fastest candidate


def _label(problem: Problem, *, norm: bool = False, family: bool = False) -> str:
    """M×N, after the norm for plots that mix norms, above dtypes and save mode for plots that mix families."""
    shape = f"{'LN' if problem.norm == 'layer_norm' else 'RMS'} " * norm + f"{problem.M}×{problem.N}"
    return shape + f"\n{problem.dtype}/w{problem.weight_dtype}/save-{problem.save}" * family


def _command(text: str) -> str:
    """A run's command as typed: the program without its folder, '|' kept out of the table."""
    words = text.split(" ", 1)
    return (Path(words[0]).name + (" " + words[1] if len(words) > 1 else "")).replace("|", "/")


def header_section(data: ReportData) -> list[str]:
    name = data.runs[-1].gpu_name
    timing = ("**These are Triton-interpreter timings** (host wall-clock on CPU): they exercise the pipeline and "
              "say nothing about GPU speed." if data.interpret else
              "Times are medians of cold-L2 repetitions of the backward (device time, µs; lower is better).")
    return [f"# normtune report — {name} (`{data.gpu_key}`)", "", timing, ""]


def provenance_section(data: ReportData) -> list[str]:
    runs = data.runs

    def distinct(field):
        values = list(dict.fromkeys(str(getattr(r.device, field)) for r in runs if getattr(r.device, field) is not None))
        return ", ".join(values) if values else "unrecorded"

    rows = [[str(r.id), r.kind, f"{r.started_at:%Y-%m-%d %H:%M}",
             num((r.ended_at - r.started_at).total_seconds() / 60) if r.ended_at else MISSING, r.status,
             r.device.git_revision or "unrecorded", num(r.copy_bandwidth_gbps, 0) if r.copy_bandwidth_gbps else "not stored",
             f"`{_command(r.command_line)}`"] for r in runs]
    return (["## Provenance", "",
             f"- GPU: {distinct('name')}, compute capability {distinct('compute_capability')}, "
             f"{distinct('sm_count')} SMs, L2 {runs[-1].device.l2_bytes / 2**20:.0f} MiB; driver {distinct('driver')}, "
             f"CUDA {distinct('cuda')}",
             f"- torch {distinct('torch')}; triton {distinct('triton')}; normtune {distinct('normtune')}; "
             f"git revisions {distinct('git_revision')}",
             f"- copy bandwidth behind the memory floor, as stored with each run: {_bandwidths(data)}",
             f"- runs: {len(runs)}; measurements: {len(data.measurements)}", ""]
            + markdown_table(["run", "kind", "started (UTC)", "minutes", "status", "git", "GB/s", "command"], rows)
            + [""])


def _bandwidths(data: ReportData) -> str:
    recorded = [f"{r.copy_bandwidth_gbps:.0f} GB/s (run {r.id})" for r in data.runs if r.copy_bandwidth_gbps]
    return ", ".join(recorded) if recorded else "not recorded by any run (% floor is n/a)"


def problems_section(summaries: list[ProblemSummary], data: ReportData, pictures: plots.Pictures) -> list[str]:
    lines = ["## Best config per problem", ""]
    if not summaries:
        return lines + ["No measurements are stored for this GPU yet: run `normtune sweep` first.", ""]
    lines += ["Best = the fastest correct measurement of any run; GB/s counts every byte both kernels move; "
              "% floor = time of the memory floor (3·M·N·itemsize at the copy bandwidth stored with the best's "
              "run; n/a where that run stored none) ÷ best time; default = today's analytic default config timed "
              "in the same run as the best (– where that run did not time it); trials = every stored measurement "
              "of the problem (sweeps, neighbours, validation, bench).", ""]
    for family in dict.fromkeys(s.problem.family.key for s in summaries):
        body = []
        for s in (s for s in summaries if s.problem.family.key == family):
            b = s.best
            body.append([f"{s.problem.M}×{s.problem.N}", f"`{b.config}`" if b else "no correct run",
                         num(b and b.median_us), num(b and b.kernel_1_us), num(b and b.kernel_2_us), num(s.gbps, 0),
                         num(100 * s.floor_fraction, 0) if s.floor_fraction else ("n/a" if b else MISSING),
                         str(b.run_id) if b else MISSING, num(s.default_us), ratio(s.default_us, b and b.median_us),
                         str(s.trials), ", ".join(f"{k} {n}" for k, n in s.failures.items()) or MISSING])
        lines += [f"### {family}", ""] + markdown_table(
            ["M×N", "best config", "µs", "kernel_1 µs", "kernel_2 µs", "GB/s", "% floor", "run", "default µs",
             "default ÷ best", "trials", "failed"], body) + [""]
    gains = [s.default_us / s.best.median_us for s in summaries if s.default_us and s.best]
    if gains:
        lines += [f"Geometric-mean speedup of the best config over the analytic default (same run): "
                  f"{geomean(gains):.3f}× ({len(gains)} problems where the best's run timed the default).", ""]
    unit = plots.time_label(data.interpret)
    gpu = data.runs[-1].gpu_name
    for family in dict.fromkeys(s.problem.family for s in summaries):
        group = [s for s in summaries if s.problem.family == family and s.best]
        what = f"{family.norm} {family.dtype}"
        if not group:
            lines += [f"No {what} problem ran correctly: nothing to plot.", ""]
            continue
        labels = [_label(s.problem) for s in group]
        fig = plots.kernel_split_bars(labels, [s.best.median_us for s in group], [s.best.kernel_1_us for s in group],
                                      [s.best.kernel_2_us for s in group], ylabel=unit,
                                      markers={"memory floor (run's bandwidth)": [s.floor_us for s in group]},
                                      title=f"{what}: best config's time, kernel_1 + kernel_2 — {gpu}")
        short = f"{family.norm}_{family.dtype}"
        unique = sum(f"{f.norm}_{f.dtype}" == short for f in dict.fromkeys(s.problem.family for s in summaries)) == 1
        slug = short if unique else family.key.replace("/", "_")
        lines.append(pictures.save(fig, f"kernels_{slug}.png"))
        with_default = [s for s in group if s.default_us]
        if with_default:
            fig = plots.ratio_bars([_label(s.problem) for s in with_default],
                                   [s.default_us / s.best.median_us for s in with_default],
                                   ylabel="default ÷ best (same run)", lines={"1.0 = the default is the best": 1.0},
                                   title=f"{what}: what tuning gains over the analytic default — {gpu}"
                                   + (" (interpreter)" if data.interpret else ""))
            lines.append(pictures.save(fig, f"best_vs_default_{slug}.png"))
        else:
            lines.append(f"The analytic default was not timed in the best's run for any {what} problem.")
        lines.append("")
    return lines


def heatmap_section(data: ReportData, focus: ProblemSummary | None, pictures: plots.Pictures) -> list[str]:
    lines = ["## Launch knobs", ""]
    if focus is None or focus.best is None:
        return lines + ["No correct measurement to draw heatmaps from.", ""]
    p = focus.problem
    rows = [m for m in data.measurements if m.problem == p]
    lines += [f"{p.norm} {p.M}×{p.N} (`{p.key}`, {focus.trials} measurements): each cell is the best µs among the "
              "configs with those two values; blank cells were never measured (or never ran correctly).", ""]
    unit = plots.time_label(data.interpret)
    for x, y in HEATMAP_PAIRS:
        fig = plots.heatmap(heatmap_cells(rows, x, y), x, y, unit=unit,
                            title=f"{p.norm} {p.M}×{p.N} {p.dtype}: best {unit}")
        lines.append(pictures.save(fig, f"heatmap_{x}_{y}.png"))
    return lines + [""]


def rules_section(store, data: ReportData, table_path: str | None) -> list[str]:
    lines = ["## Heuristic table", ""]
    table, origin = _table(store, data, table_path)
    if table is None:
        return lines + [origin, ""]
    prov = table.get("provenance", {})
    runs = ", ".join(map(str, prov.get("runs") or [])) or "unrecorded"
    lines += [f"{origin}: tuned on {table['gpu']['name']}, fitted on runs {runs}, "
              f"{prov.get('configs_measured', '?')} measured configs, {prov.get('date', 'undated')}"
              + (f", inputs {prov['fingerprint'][:19]}…" if prov.get("fingerprint") else "") + ".", ""]
    if table["gpu"].get("key") not in (None, data.gpu_key):
        lines += [f"Note: this table was tuned for `{table['gpu']['key']}`, not `{data.gpu_key}`.", ""]
    for family, fam in sorted(table["families"].items()):
        threshold = fam.get("single_pass_max_n", single_pass_threshold(fam["rules"]))
        lines += [f"### {family}", "", "Learned single-pass threshold: "
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
        try:
            raw = json.loads(Path(table_path).read_text())
        except (OSError, ValueError) as err:
            raise TableError(f"heuristic table {table_path}: cannot be read "
                             f"({getattr(err, 'strerror', None) or err})") from None
        return parse_table(raw, str(table_path)).raw, f"`{table_path}`"
    shipped = resources.files("normtune.configs") / f"{data.gpu_key}.json"
    if shipped.is_file():
        path = f"configs/{data.gpu_key}.json"
        return parse_table(json.loads(shipped.read_text()), path).raw, f"`{path}` (shipped)"
    try:
        return (build_table(store, data.gpu_key, interpret=data.interpret),
                f"No table file for `{data.gpu_key}`; rules fitted now from the stored results (not saved)")
    except ValueError as err:
        return None, f"No table file for `{data.gpu_key}`, and none can be fitted: {err}"


def validation_section(data: ReportData, rows, pictures: plots.Pictures) -> list[str]:
    run = data.latest("validate")
    lines = ["## Validation on held-out shapes", ""]
    if run is None:
        return lines + ["No validation run for this GPU: run `normtune validate` to measure the table's regret on "
                        "shapes it was not fitted on.", ""]
    rated = [r for r in rows if r.regret]
    if not rated:
        return lines + [f"Validation run {run.id} ({run.started_at:%Y-%m-%d}) has no correct head-to-head times "
                        "of the table's config.", ""]
    legacy = any(m.source == "validate-best" for m in data.measurements if m.run_id == run.id)
    reference = ("the best config of a short sweep seeded with the table's config and the default (an older "
                 "validate: not an independent reference)" if legacy else
                 "the best config of an unseeded sweep")
    over = sum(r.regret.value > REGRET_LIMIT for r in rated)
    lines += [f"Validation run {run.id} ({run.started_at:%Y-%m-%d}, git {run.device.git_revision or 'unrecorded'}): the "
              f"table's config, the reference ({reference}) and the analytic default, timed head to head in "
              "interleaved rounds (default: – where the run timed an older default than today's). Regret = table ÷ the fastest of the three, bounds from the p10–p90 "
              "spreads.", ""] + validation_table(rows)
    lines += ["", f"**{validation_summary(summarize(rows))}** {over} of {len(rated)} shapes exceed a regret of "
                  f"{REGRET_LIMIT:.2f}.", ""]
    fig = plots.ratio_bars([_label(r.problem, norm=True) + f" {r.problem.dtype}" for r in rated],
                           [r.regret.value for r in rated], ylabel="regret (table ÷ fastest)",
                           lines={"1.0 = the table's config was the fastest": 1.0,
                                  f"{REGRET_LIMIT:.2f} = worth a second look": REGRET_LIMIT},
                           title=f"Regret of the table on held-out shapes (run {run.id})"
                           + (", interpreter wall-clock" if data.interpret else ""))
    return lines + [pictures.save(fig, "validation.png"), ""]


def peers_section(data: ReportData, rows: list[dict], pictures: plots.Pictures) -> list[str]:
    run = data.latest("bench")
    lines = ["## normtune vs peers", ""]
    if run is None:
        return lines + ["No bench run for this GPU: run `normtune bench --peers all` to compare with the peers.", ""]
    peers = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != OURS]
    lines += [f"Bench run {run.id} ({run.started_at:%Y-%m-%d}, git {run.device.git_revision or 'unrecorded'}, command "
              f"`{_command(run.command_line)}`). Speedup = best peer µs ÷ normtune µs; floor at the run's stored "
              f"bandwidth ({num(run.copy_bandwidth_gbps, 0) + ' GB/s' if run.copy_bandwidth_gbps else 'n/a'}).", ""]
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
    for norm in dict.fromkeys(s["norm"] for s in per_shape):
        shapes = [(s["M"], s["N"]) for s in per_shape if s["norm"] == norm]
        series = {impl: [(r["median_us"] if (r := by_impl.get((norm, m, n, impl))) and r["status"] == "ok"
                          else None) for m, n in shapes] for impl in [OURS] + peers}
        floors = [by_impl[(norm, m, n, OURS)]["floor_us"] for m, n in shapes]
        fig = plots.grouped_bars([f"{m}×{n}" for m, n in shapes], series, markers={"memory floor": floors},
                                 ylabel=plots.time_label(data.interpret),
                                 title=f"{norm}: normtune vs peers (bench run {run.id})")
        lines.append(pictures.save(fig, f"peers_{norm}.png"))
    return lines + [""]
