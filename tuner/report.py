"""`normtune report`: what the database knows about one GPU, as Markdown with PNG plots, made without a GPU.

report.md holds, in order: provenance of the GPU's runs; per problem the best config, its time, bandwidth and
kernel_1/kernel_2 split against the memory floor, the analytic default's time and the trial counts; the heuristic
table's rules; the latest validation's regret on held-out shapes; the latest bench against the peers. Each section
reads the store (never SQL) and becomes one sentence when its data is missing. The PNGs it links lie beside it.

Figures are drawn on matplotlib's object API (`Figure`, never pyplot): saving a PNG needs no display and switches
no global backend, so a caller's interactive session is left as it was.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from normtune.kernels.backward import num_programs
from normtune.kernels.config import BackwardConfig, ConfigError, Problem, default_config
from normtune.kernels.tables import parse_table

from .bench import OURS, geomean, summary
from .emit import build_table, single_pass_threshold
from .measure import bytes_moved, floor_bytes
from .space import Space
from .store import MeasurementRecord, RunRecord
from .validate import ValidationRow, summarize

# Pairs of launch knobs drawn as heatmaps of the best time; names are the store's config columns. The third pair
# shows the partial buffer's trade-off: more programs fill kernel_1 but give kernel_2 more rows to reduce.
HEATMAP_PAIRS = (("k1_block_row", "k1_num_warps"), ("k2_block_m", "k2_block_n"), ("k1_programs_per_sm", "k2_block_m"))
VALIDATE_SOURCES = ("table", "best", "default")  # stored as validate-<name> by validate.head_to_head
REGRET_LIMIT = 1.10  # regret worth a second look: the table loses more than 10% to a short fresh sweep


@dataclass(frozen=True)
class ReportData:
    gpu_key: str
    runs: list[RunRecord]
    interpret: bool  # only Triton-interpreter runs: host wall-clock on CPU, not GPU timings
    measurements: list[MeasurementRecord]  # of the runs that match `interpret`


@dataclass(frozen=True)
class ProblemSummary:
    problem: Problem
    best: MeasurementRecord | None  # the fastest ok measurement (lowest median, then oldest)
    gbps: float | None  # of the best measurement
    floor_fraction: float | None  # of the best measurement: floor µs / best µs
    default_us: float | None  # the analytic default config's best median, where it was measured
    trials: int
    failures: dict[str, int]  # status -> count, statuses other than ok


def write_report(store, gpu_key: str, out_dir, *, heatmap_problem: str | None = None,
                 table_path: str | None = None) -> list[Path]:
    """Write report.md and its PNGs for `gpu_key` into `out_dir`; return their paths, report.md first.

    `heatmap_problem` is a problem key (default: the problem with most measurements); `table_path` a heuristic
    table (default: the shipped configs/<gpu_key>.json, else one fitted now from the store). Raises ValueError for
    a GPU key without runs (naming the keys present) or a heatmap problem that was never measured, and
    `kernels.tables.TableError` (a ValueError) or OSError for a `table_path` that cannot be used."""
    data = load_report_data(store, gpu_key)
    summaries = summarize_problems(data)
    focus = choose_heatmap_problem(summaries, heatmap_problem)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pictures = _Pictures(out)
    validate_run, bench_run = _latest_run(data, "validate"), _latest_run(data, "bench")
    lines = (header_section(data) + provenance_section(data) + problems_section(summaries, data, pictures)
             + heatmap_section(data, focus, pictures) + rules_section(store, data, table_path)
             + validation_section(validate_run, validation_rows(store, validate_run), pictures)
             + peers_section(bench_run, bench_rows(store, bench_run), pictures))
    report = out / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    return [report] + pictures.paths


# ---------------------------------------------------------------------------------------------------- data


def load_report_data(store, gpu_key: str) -> ReportData:
    runs = store.runs(gpu_key=gpu_key)
    if not runs:
        keys = sorted({r.gpu_key for r in store.runs()})
        raise ValueError(f"no runs for GPU key {gpu_key!r} in {store.display_url}; GPU keys present: "
                         f"{', '.join(keys) if keys else 'none (the database is empty)'}")
    # Interpreter figures never mix with GPU ones: they are reported only when there is nothing else.
    interpret = all(r.interpret for r in runs)
    runs = [r for r in runs if r.interpret == interpret]
    return ReportData(gpu_key, runs, interpret, store.measurements(gpu_key=gpu_key, interpret=interpret))


def summarize_problems(data: ReportData) -> list[ProblemSummary]:
    """One summary per problem, by family, then N, then M."""
    sm_counts = {r.id: r.sm_count for r in data.runs}
    by_problem: dict[Problem, list[MeasurementRecord]] = defaultdict(list)
    for m in data.measurements:
        by_problem[m.problem].append(m)
    out = []
    for problem in sorted(by_problem, key=lambda p: (p.family.key, p.N, p.M)):
        rows = by_problem[problem]
        ok = [m for m in rows if m.status == "ok" and m.median_us]
        defaults = [m.median_us for m in ok if _is_default(m, sm_counts.get(m.run_id))]
        best = min(ok, key=lambda m: (m.median_us, m.id), default=None)
        gbps = _gbps(best, sm_counts.get(best.run_id)) if best else None
        floor_fraction = (best.floor_fraction or _ratio_of(best.floor_us, best.median_us)) if best else None
        failures = dict(sorted(Counter(m.status for m in rows if m.status != "ok").items()))
        out.append(ProblemSummary(problem, best, gbps, floor_fraction, min(defaults, default=None), len(rows),
                                  failures))
    return out


def _gbps(m: MeasurementRecord, sm_count: int | None) -> float | None:
    """The measurement's bandwidth over every byte both kernels move. Bench rows store no byte count: it is
    derived as `measure.measure_config` derives it, from the grid the config launches on the run's SMs."""
    if m.gbps is not None:
        return m.gbps
    moved = m.bytes_moved or (sm_count and bytes_moved(m.problem, num_programs(m.problem.M, m.config, sm_count)))
    return moved / (m.median_us * 1e3) if moved else None  # B / µs / 1e3 = GB/s


def _is_default(m: MeasurementRecord, sm_count: int | None) -> bool:
    """Whether `m` timed the analytic default: what validate timed as the default then, or today's
    `default_config` as the sweep seeds it (canonical: programs_per_sm values giving the same grid are one)."""
    if m.source == "validate-default":
        return True
    try:
        default = default_config(m.problem)
    except ConfigError:  # no analytic config runs this problem: there is nothing to compare with
        return False
    return m.config == default or bool(sm_count) and m.config == Space(m.problem, sm_count).canonical(default)


def choose_heatmap_problem(summaries: list[ProblemSummary], key: str | None) -> ProblemSummary | None:
    """The summary of problem `key`, or of the problem with most measurements among those that ran correctly
    (ties: the first by key)."""
    if key is None:
        return min((s for s in summaries if s.best), key=lambda s: (-s.trials, s.problem.key), default=None)
    found = [s for s in summaries if s.problem.key == key]
    if not found:
        raise ValueError(f"heatmap problem {key!r} has no measurements on this GPU; measured problems: "
                         + ", ".join(sorted(s.problem.key for s in summaries)))
    return found[0]


def config_value(config: BackwardConfig, param: str):
    """A knob by its column name: 'k1_block_row' → config.kernel_1.block_row."""
    kernel = {"k1": config.kernel_1, "k2": config.kernel_2}[param[:2]]
    return getattr(kernel, param[3:])


def heatmap_cells(measurements: list[MeasurementRecord], x_param: str, y_param: str) -> dict[tuple, float]:
    """(x value, y value) → the best (lowest) median µs among the ok measurements with those values."""
    cells: dict[tuple, float] = {}
    for m in measurements:
        if m.status == "ok" and m.median_us:
            cell = (config_value(m.config, x_param), config_value(m.config, y_param))
            cells[cell] = min(m.median_us, cells.get(cell, math.inf))
    return cells


def validation_rows(store, run: RunRecord | None) -> list[ValidationRow]:
    """The run's head-to-head rounds per problem (in the order measured), each the median of its ok rounds."""
    if run is None:
        return []
    times: dict[Problem, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    configs: dict[Problem, dict[str, BackwardConfig]] = defaultdict(dict)
    for m in store.measurements(run_id=run.id):
        name = m.source.removeprefix("validate-")
        if name in VALIDATE_SOURCES:
            configs[m.problem].setdefault(name, m.config)
            if m.status == "ok" and m.median_us:
                times[m.problem][name].append(m.median_us)

    def median(problem, name):
        return statistics.median(times[problem][name]) if times[problem][name] else None

    return [ValidationRow(p, configs[p].get("table"), configs[p].get("best"), median(p, "table"),
                          median(p, "best"), median(p, "default")) for p in configs]


def bench_rows(store, run: RunRecord | None) -> list[dict]:
    """The bench run as `bench.run_bench` rows (normtune from its bench-* measurements, peers from its peer
    results), so that best peer, speedup and wins are computed by `bench.summary`, as `normtune bench` does."""
    if run is None:
        return []
    rows = [{"norm": m.problem.norm, "M": m.problem.M, "N": m.problem.N, "impl": OURS, "status": m.status,
             "median_us": m.median_us, "kernel_1_us": m.kernel_1_us, "kernel_2_us": m.kernel_2_us,
             "floor_us": m.floor_us, "floor_fraction": m.floor_fraction}
            for m in store.measurements(run_id=run.id) if m.source.startswith("bench-")]
    rows += [{"norm": p.problem.norm, "M": p.problem.M, "N": p.problem.N, "impl": p.peer, "status": p.status,
              "median_us": p.median_us, "kernel_1_us": None, "kernel_2_us": None, "floor_us": None,
              "floor_fraction": None} for p in store.peer_results(run_id=run.id)]
    return rows


def _latest_run(data: ReportData, kind: str) -> RunRecord | None:
    return max((r for r in data.runs if r.kind == kind), key=lambda r: r.id, default=None)


# ------------------------------------------------------------------------------------------------ sections


def header_section(data: ReportData) -> list[str]:
    name = data.runs[-1].gpu_name
    timing = ("**These are Triton-interpreter timings** (host wall-clock on CPU): they exercise the pipeline and "
              "say nothing about GPU speed." if data.interpret else
              "Times are medians of cold-L2 repetitions of the backward (device time, µs; lower is better).")
    return [f"# normtune report — {name} (`{data.gpu_key}`)", "", timing, ""]


def provenance_section(data: ReportData) -> list[str]:
    runs = data.runs

    def distinct(field):
        values = list(dict.fromkeys(str(getattr(r, field)) for r in runs if getattr(r, field) is not None))
        return ", ".join(values) if values else "unrecorded"

    lines = ["## Provenance", "",
             f"- GPU: {distinct('gpu_name')}, compute capability {distinct('compute_capability')}, "
             f"{distinct('sm_count')} SMs, L2 {runs[-1].l2_bytes / 2**20:.0f} MiB; driver {distinct('driver')}, "
             f"CUDA {distinct('cuda')}",
             f"- torch {distinct('torch')}; triton {distinct('triton')}; normtune {distinct('normtune_version')}; "
             f"git revisions {distinct('git_revision')}",
             f"- copy bandwidth behind the memory floor: {_copy_bandwidth(data)}",
             f"- runs: {len(runs)}; measurements: {len(data.measurements)}", "",
             "| run | kind | started (UTC) | minutes | status | git | command |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        minutes = _num((r.ended_at - r.started_at).total_seconds() / 60) if r.ended_at else "–"
        command = r.command_line if len(r.command_line) <= 90 else r.command_line[:87] + "…"
        lines.append(f"| {r.id} | {r.kind} | {r.started_at:%Y-%m-%d %H:%M} | {minutes} | {r.status} | "
                     f"{r.git_revision or '–'} | `{command.replace('|', '/')}` |")
    return lines + [""]


def _copy_bandwidth(data: ReportData) -> str:
    recorded = [f"{r.copy_bandwidth_gbps:.0f} GB/s (run {r.id})" for r in data.runs if r.copy_bandwidth_gbps]
    if recorded:
        return ", ".join(recorded)
    # Sweeps keep the bandwidth only inside each measurement's floor (floor_us = floor bytes / bandwidth).
    implied = [floor_bytes(m.problem) / (m.floor_us * 1e3) for m in data.measurements if m.floor_us]
    return f"{statistics.median(implied):.0f} GB/s (median implied by the stored floors)" if implied else \
        "not recorded"


def problems_section(summaries: list[ProblemSummary], data: ReportData, pictures: "_Pictures") -> list[str]:
    lines = ["## Best config per problem", ""]
    if not summaries:
        return lines + ["No measurements are stored for this GPU yet: run `normtune sweep` first.", ""]
    lines += ["Best = the fastest correct measurement of any run; GB/s counts every byte both kernels move; "
              "% floor = time of the memory floor (3·M·N·itemsize at the copy bandwidth) ÷ best time; "
              "default = the analytic default config, where it was measured; trials = every stored measurement of "
              "the problem (sweeps, neighbours, validation, bench).", ""]
    for family in dict.fromkeys(s.problem.family.key for s in summaries):
        lines += [f"### {family}", "", "| M×N | best config | µs | kernel_1 µs | kernel_2 µs | GB/s | % floor | "
                  "default µs | default ÷ best | trials | failed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in (s for s in summaries if s.problem.family.key == family):
            b = s.best
            failed = ", ".join(f"{status} {n}" for status, n in s.failures.items()) or "–"
            cells = [f"{s.problem.M}×{s.problem.N}", f"`{b.config}`" if b else "no correct run",
                     _num(b and b.median_us), _num(b and b.kernel_1_us), _num(b and b.kernel_2_us),
                     _num(s.gbps, 0), _num(s.floor_fraction and 100 * s.floor_fraction, 0), _num(s.default_us),
                     _ratio(s.default_us, b and b.median_us, 2), str(s.trials), failed]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    gains = [s.default_us / s.best.median_us for s in summaries if s.default_us and s.best]
    if gains:
        lines += [f"Geometric-mean speedup of the best config over the analytic default: {geomean(gains):.3f}× "
                  f"({len(gains)} problems where the default was measured).", ""]
    for norm in dict.fromkeys(s.problem.norm for s in summaries):
        group = [s for s in summaries if s.problem.norm == norm and s.best]
        if not group:
            lines += [f"No {norm} problem ran correctly: nothing to plot.", ""]
            continue
        mixed = len({s.problem.family for s in group}) > 1
        labels = [_label(s.problem, family=mixed) for s in group]
        fig = _bars(labels, {"kernel_1": [s.best.kernel_1_us for s in group],
                             "kernel_2": [s.best.kernel_2_us for s in group]}, stacked=True,
                    markers={"memory floor": [s.best.floor_us for s in group]}, ylabel="µs",
                    title=f"{norm}: best config, kernel_1 + kernel_2 — {data.runs[-1].gpu_name}")
        lines.append(pictures.save(fig, f"kernels_{norm}.png"))
        if any(s.default_us for s in group):
            fig = _bars(labels, {"best": [s.best.median_us for s in group],
                                 "analytic default": [s.default_us for s in group]},
                        ylabel="µs", title=f"{norm}: best config vs analytic default")
            lines.append(pictures.save(fig, f"best_vs_default_{norm}.png"))
        else:
            lines.append(f"The analytic default config was not measured for any {norm} problem.")
        lines.append("")
    return lines


def heatmap_section(data: ReportData, focus: ProblemSummary | None, pictures: "_Pictures") -> list[str]:
    lines = ["## Launch knobs", ""]
    if focus is None or focus.best is None:
        return lines + ["No correct measurement to draw heatmaps from.", ""]
    p = focus.problem
    rows = [m for m in data.measurements if m.problem == p]
    lines += [f"{p.norm} {p.M}×{p.N} (`{p.key}`, {focus.trials} measurements): each cell is the best µs among the "
              "configs with those two values; blank cells were never measured (or never ran correctly).", ""]
    for x, y in HEATMAP_PAIRS:
        fig = _heatmap(heatmap_cells(rows, x, y), x, y, title=f"{p.norm} {p.M}×{p.N}: best µs")
        lines.append(pictures.save(fig, f"heatmap_{x}_{y}.png"))
    return lines + [""]


def rules_section(store, data: ReportData, table_path: str | None) -> list[str]:
    lines = ["## Heuristic table", ""]
    table, origin = _table(store, data, table_path)
    if table is None:
        return lines + [origin, ""]
    prov = table.get("provenance", {})
    lines += [f"{origin}: tuned on {table['gpu']['name']}, runs {_span(prov.get('runs'))}, "
              f"{prov.get('configs_measured', '?')} measured configs, {prov.get('date', 'undated')}.", ""]
    if table["gpu"].get("key") not in (None, data.gpu_key):
        lines += [f"Note: this table was tuned for `{table['gpu']['key']}`, not `{data.gpu_key}`.", ""]
    for family, fam in sorted(table["families"].items()):
        threshold = fam.get("single_pass_max_n", single_pass_threshold(fam["rules"]))
        lines += [f"### {family}", "", "Learned single-pass threshold: "
                  + (f"single pass up to N = {threshold}." if threshold else "no rule runs single pass."), "",
                  "| N ≤ | M ≤ | config | fitted on |", "|---|---|---|---|"]
        for rule in fam["rules"]:
            lines.append(f"| {rule['n_max'] or '∞'} | {rule['m_max'] or '∞'} | "
                         f"`{BackwardConfig.from_dict(rule['config'])}` | {', '.join(rule['fitted_on'])} |")
        lines.append("")
    return lines


def _table(store, data: ReportData, table_path: str | None) -> tuple[dict | None, str]:
    """(table dict, where it came from): the given file, the shipped one, or a fit of the stored results."""
    if table_path is not None:
        # Parsed afresh (not kernels.tables.load_table's cache): a report after `emit` must see the new file.
        return parse_table(json.loads(Path(table_path).read_text()), str(table_path)).raw, f"`{table_path}`"
    shipped = resources.files("normtune.configs") / f"{data.gpu_key}.json"
    if shipped.is_file():
        path = f"configs/{data.gpu_key}.json"
        return parse_table(json.loads(shipped.read_text()), path).raw, f"`{path}` (shipped)"
    try:
        return (build_table(store, data.gpu_key, interpret=data.interpret),
                f"No table file for `{data.gpu_key}`; rules fitted now from the stored results (not saved)")
    except ValueError as err:
        return None, f"No table file for `{data.gpu_key}`, and none can be fitted: {err}"


def validation_section(run: RunRecord | None, rows: list[ValidationRow], pictures: "_Pictures") -> list[str]:
    lines = ["## Validation on held-out shapes", ""]
    if run is None:
        return lines + ["No validation run for this GPU: run `normtune validate` to measure the table's regret on "
                        "shapes it was not fitted on.", ""]
    rated = [r for r in rows if r.regret]
    if not rated:
        return lines + [f"Validation run {run.id} ({run.started_at:%Y-%m-%d}) has no correct head-to-head times "
                        "of both the table's and the best config.", ""]
    s = summarize(rows)
    worst = max(rated, key=lambda r: r.regret)
    lines += [f"Validation run {run.id} ({run.started_at:%Y-%m-%d}, git {run.git_revision or '–'}): the table's "
              "config, the best config of a short fresh sweep and the analytic default, timed head to head "
              "(median of interleaved rounds). Regret = table µs ÷ best µs (below 1: the table beat the sweep).", "",
              "| problem | table µs | best µs | default µs | regret | speedup vs default |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.problem.norm} {r.problem.M}×{r.problem.N} | {_num(r.table_us)} | {_num(r.best_us)} | "
                     f"{_num(r.default_us)} | {_num(r.regret, 3)} | {_num(r.speedup_vs_default, 3)} |")
    over = sum(r.regret > REGRET_LIMIT for r in rated)
    lines += ["", f"**Geometric-mean regret {_num(s['geomean_regret'], 3)}, worst {_num(s['worst_regret'], 3)} "
              f"({worst.problem.norm} {worst.problem.M}×{worst.problem.N}); geometric-mean speedup over the "
              f"analytic defaults {_num(s['geomean_speedup_vs_default'], 3)}×.** {over} of {len(rated)} shapes "
              f"exceed a regret of {REGRET_LIMIT:.2f}.", ""]
    fig = _bars([_label(r.problem, norm=True) for r in rated], {"regret": [r.regret for r in rated]},
                ylabel="table ÷ best", title=f"Regret of the table on held-out shapes (run {run.id})",
                hlines=(1.0, REGRET_LIMIT), ymin=min(0.9, 0.95 * min(r.regret for r in rated)))
    return lines + [pictures.save(fig, "validation.png"), ""]


def peers_section(run: RunRecord | None, rows: list[dict], pictures: "_Pictures") -> list[str]:
    lines = ["## normtune vs peers", ""]
    if run is None:
        return lines + ["No bench run for this GPU: run `normtune bench --peers all` to compare with the peers.", ""]
    peers = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != OURS]
    lines += [f"Bench run {run.id} ({run.started_at:%Y-%m-%d}, git {run.git_revision or '–'}, command "
              f"`{run.command_line}`). Speedup = best peer µs ÷ normtune µs.", ""]
    if not peers or not any(r["impl"] == OURS for r in rows):
        return lines + [f"Bench run {run.id} holds no {'peer results' if not peers else 'normtune times'} to "
                        "compare.", ""]
    lines += ["| problem | floor | normtune | " + " | ".join(peers) + " | best peer | speedup |",
              "|---|---|---|" + "---|" * len(peers) + "---|---|"]
    by_impl = {(r["norm"], r["M"], r["N"], r["impl"]): r for r in rows}
    per_shape = summary(rows)
    for s in per_shape:
        cells = [f"{s['norm']} {s['M']}×{s['N']}", _num(s["floor_us"]), _num(s["normtune_us"])]
        for peer in peers:
            r = by_impl.get((s["norm"], s["M"], s["N"], peer))
            cells.append(_num(r["median_us"]) if r and r["status"] == "ok" else (r["status"] if r else "–"))
        cells += [s["best_peer"] or "–", _num(s["speedup"], 2) + "×" if s["speedup"] else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
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
        fig = _bars([f"{m}×{n}" for m, n in shapes], series, markers={"memory floor": floors}, ylabel="µs",
                    title=f"{norm}: normtune vs peers (bench run {run.id})")
        lines.append(pictures.save(fig, f"peers_{norm}.png"))
    return lines + [""]


# -------------------------------------------------------------------------------------------- formatting


def _num(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}f}"


def _ratio_of(num, den) -> float | None:
    return num / den if num and den else None


def _ratio(num, den, digits: int) -> str:
    return _num(num / den, digits) + "×" if num and den else "–"


def _span(ids) -> str:
    ids = sorted(ids or [])
    if not ids:
        return "?"
    return f"{ids[0]}–{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1 else \
        ", ".join(map(str, ids))


def _label(problem: Problem, *, norm: bool = False, family: bool = False) -> str:
    """M×N, after the norm for plots that mix norms, above dtypes and save mode for plots that mix families."""
    shape = f"{'LN' if problem.norm == 'layer_norm' else 'RMS'} " * norm + f"{problem.M}×{problem.N}"
    return shape + f"\n{problem.dtype}/w{problem.weight_dtype}/save-{problem.save}" * family


# ------------------------------------------------------------------------------------------------- plots


class _Pictures:
    """Saves figures into the report's folder, in order, and gives the Markdown line that shows each."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.paths = out_dir, []

    def save(self, fig, name: str) -> str:
        path = self.out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        self.paths.append(path)
        return f"![{name.removesuffix('.png')}]({name})"


def _axes(width: float, height: float):
    from matplotlib.figure import Figure  # lazy: only writing a report needs matplotlib

    fig = Figure(figsize=(width, height))
    return fig, fig.subplots()


def _bars(labels: list[str], series: dict[str, list], *, title: str, ylabel: str, stacked: bool = False,
          markers: dict[str, list] | None = None, hlines: tuple[float, ...] = (), ymin: float = 0.0):
    """Grouped (or stacked) bars, one group per label; missing values draw no bar; `markers` are drawn as
    horizontal ticks over each group (the memory floor), `hlines` as dashed lines across the plot; the y axis
    starts at `ymin` (ratios near 1 are unreadable on bars that start at 0)."""
    bars_per_group = 1 if stacked else max(1, len(series))
    fig, ax = _axes(min(20.0, max(7.0, len(labels) * (0.3 + 0.15 * bars_per_group) + 2)), 4.6)
    width = 0.8 if stacked else 0.8 / max(1, len(series))
    bottom = [0.0] * len(labels)
    for i, (name, values) in enumerate(series.items()):
        heights = [v if v is not None and math.isfinite(v) else 0.0 for v in values]
        offset = 0.0 if stacked else (i - (len(series) - 1) / 2) * width
        ax.bar([j + offset for j in range(len(labels))], heights, width, bottom=bottom if stacked else None,
               label=name)
        if stacked:
            bottom = [b + h for b, h in zip(bottom, heights)]
    for name, values in (markers or {}).items():
        points = [(j, v) for j, v in enumerate(values) if v is not None and math.isfinite(v)]
        if points:
            ax.scatter(*zip(*points), marker="_", s=500, color="black", zorder=5, label=name)
    for y in hlines:
        ax.axhline(y, color="black" if y == 1.0 else "red", linestyle="--", linewidth=1, label=f"{y:g}")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylim(bottom=ymin)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def _heatmap(cells: dict[tuple, float], x_param: str, y_param: str, *, title: str):
    import matplotlib
    import numpy

    xs, ys = sorted({x for x, _ in cells}), sorted({y for _, y in cells})
    grid = numpy.ma.masked_invalid([[cells.get((x, y), math.nan) for x in xs] for y in ys])
    fig, ax = _axes(max(5.0, 0.8 * len(xs) + 2.5), max(3.5, 0.5 * len(ys) + 2))
    image = ax.imshow(grid, cmap=matplotlib.colormaps["viridis_r"].with_extremes(bad="white"), aspect="auto",
                      origin="lower")
    for (i, j), value in numpy.ndenumerate(grid.filled(math.nan)):
        if math.isfinite(value):  # dark text on the light (fast) cells, light text on the dark (slow) ones
            ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=7,
                    color="black" if image.norm(value) < 0.5 else "white")
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [str(y) for y in ys])
    ax.set_xlabel(x_param.replace("_", ".", 1))
    ax.set_ylabel(y_param.replace("_", ".", 1))
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="µs")
    return fig
