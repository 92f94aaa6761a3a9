"""Writers for `normtune bench`: CSV, JSON (with provenance), Markdown and PNG plots in one folder."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from ..files import write_atomic
from .bench import OURS, BenchReport, geomean, summary, to_json

CSV_COLUMNS = ("norm", "M", "N", "dtype", "weight_dtype", "impl", "status", "median_us", "p10_us", "p90_us",
               "reps", "kernel_1_us", "kernel_2_us", "kernel_sum_us", "host_us", "forward_host_us", "host_direct_us",
               "forward_host_direct_us", "autograd", "pdl",
               "floor_us", "floor_fraction", "rel_err_dx", "config_source", "config", "kernels", "note", "error")


def _fmt(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}f}"


def write_csv(report: BenchReport, path: Path) -> None:
    fh = io.StringIO(newline="")
    w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for row in report.rows:
        out = dict(row)
        out["config"] = json.dumps(row.get("config"), sort_keys=True) if row.get("config") else ""
        out["kernels"] = json.dumps(row.get("kernels") or {}, sort_keys=True)
        w.writerow(out)
    write_atomic(path, fh.getvalue())


def _cells(row: dict | None, metric: str) -> str:
    if row is None:
        return "–"
    return _fmt(row.get(metric)) if row["status"] == "ok" else row["status"]


def _view_table(report: BenchReport, norm: str, impls: list[str], metric: str, cell=None) -> list[str]:
    """One row per shape, one column per implementation, for one view's metric."""
    rows = [r for r in report.rows if r["norm"] == norm]
    lines = ["| M×N | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for shape in dict.fromkeys((r["M"], r["N"]) for r in rows):
        by_impl = {r["impl"]: r for r in rows if (r["M"], r["N"]) == shape}
        lines.append(f"| {shape[0]}×{shape[1]} | " + " | ".join((cell or _cells)(by_impl.get(i), metric)
                                                                for i in impls) + " |")
    return lines


def _host_cell(row: dict | None, _metric: str) -> str:
    if row is None or row["status"] != "ok":
        return "–" if row is None else row["status"]
    cell = f"{_fmt(row.get('host_us'))} / {_fmt(row.get('forward_host_us'))}"
    if row.get("host_direct_us") is not None:
        cell += f" (direct {_fmt(row['host_direct_us'])} / {_fmt(row.get('forward_host_direct_us'))})"
    return cell + (" (no autograd)" if row.get("autograd") is False else "")


HOST_PEERS = ("liger", "quack")  # the host target: no slower than the lower of these, per call


def host_target_line(rows: list[dict]) -> str:
    """How many calls of normtune cost no more host time than the lower of Liger's and quack's, like for like:
    against a peer called without autograd, normtune's direct functions; against the others, its autograd path."""
    counts = {"backward": [0, 0], "forward": [0, 0]}
    for (norm, M, N) in dict.fromkeys((r["norm"], r["M"], r["N"]) for r in rows):
        at = {r["impl"]: r for r in rows if (r["norm"], r["M"], r["N"]) == (norm, M, N) and r["status"] == "ok"}
        ours = at.get(OURS)
        peers = [at[p] for p in HOST_PEERS if p in at]
        if ours is None or not peers:
            continue
        for view, key in (("backward", "host_us"), ("forward", "forward_host_us")):
            direct = "host_direct_us" if view == "backward" else "forward_host_direct_us"
            pairs = [(ours.get(direct if p.get("autograd") is False else key), p.get(key)) for p in peers]
            pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
            if pairs:
                counts[view][1] += 1
                counts[view][0] += all(a <= b for a, b in pairs)
    if not counts["backward"][1]:
        return ""
    return (f"Host µs per call no more than the lower of {' and '.join(HOST_PEERS)} (like for like: normtune's "
            f"direct functions beside a peer called without autograd): backward {counts['backward'][0]}/"
            f"{counts['backward'][1]}, forward {counts['forward'][0]}/{counts['forward'][1]}.")


PEER_LIBRARIES = ("liger_kernel", "quack")  # what a bench run's provenance may list as peers' versions
VIEWS_NOTE = (
    "Three views of each backward: **GPU time** (host hidden: events around the whole backward after a spin, "
    "cold L2; the view every speedup and win count rests on unless marked kernel-sum), **kernel sum** (the "
    "kernels' device times from torch.profiler, summed: how peers usually report; launch gaps are not in it), "
    "and **host µs** per call (CPU time of one backward / forward call through the public API, issued while the "
    "GPU is busy; every implementation of a shape timed in the same interleaved rounds, the median kept; for "
    "normtune also through its functions without autograd, \"direct\", the like-for-like call beside a peer that "
    "has no autograd wrapper). With programmatic dependent launch (pdl), kernel_2 starts before kernel_1 ends and "
    "waits inside its own kernel; the kernel sum counts the time both kernels run at once only once.")


def markdown(report: BenchReport) -> str:
    p = report.provenance
    dev = p["device"]
    impls = [OURS] + [i for i in dict.fromkeys(r["impl"] for r in report.rows) if i != OURS]
    timing_kind = "Triton interpreter on CPU (host wall-clock, not GPU timings)" if p["interpret"] else \
        f"cold L2 (flush {p['flush_bytes'] / 2**20:.0f} MiB before every repetition), device time"
    summ = summary(report.rows)
    lines = [
        f"# normtune bench — {dev['name']}",
        "",
        f"- GPU: {dev['name']} (key `{dev['key']}`, compute capability {dev['compute_capability']}, "
        f"{dev['sm_count']} SMs, L2 {dev['l2_bytes'] / 2**20:.0f} MiB), driver {dev['driver']}, CUDA {dev['cuda']}",
        f"- torch {dev['torch']}, triton {dev['triton']}, normtune {dev['normtune']} ({dev['git_revision']}); "
        "peers: " + (", ".join(f"{k} {v}" for k, v in p["peers"].items() if v and k in PEER_LIBRARIES)
                     or "none installed")
        + (f"; tuner: {', '.join(f'{k} {v}' for k, v in p.get('tools', {}).items() if v)}" if p.get("tools") else ""),
        f"- timing: {timing_kind}; median of ≥{p['timing']['min_reps']} repetitions; backward only "
        f"(forward once, untimed); dtype {p['dtype']}, weights {p['weight_dtype']}; normtune config: {p['config']}",
        f"- memory floor: 3·M·N·itemsize bytes at the measured copy bandwidth "
        f"({_fmt(p['copy_bandwidth_gbps'], 0)} GB/s, read + write)",
        "",
        VIEWS_NOTE,
        "",
    ]
    notes = sorted({f"{r['impl']}: {r['note']}" for r in report.rows if r.get("note")})
    for norm in dict.fromkeys(r["norm"] for r in report.rows):
        rows = [r for r in report.rows if r["norm"] == norm]
        lines += [f"## {norm}", "", f"{_view(p['interpret'], heading=True)} (µs, lower is better):", ""]
        head = ["M×N", "floor", "normtune", "k1", "k2"] + [i for i in impls if i != OURS] + \
            ["best peer", "speedup", "% floor"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in (x for x in summ if x["norm"] == norm):
            by_impl = {r["impl"]: r for r in rows if (r["M"], r["N"]) == (s["M"], s["N"])}
            cells = [f"{s['M']}×{s['N']}", _fmt(s["floor_us"]),
                     _fmt(s["normtune_us"]) if s["status"] == "ok" else s["status"],
                     _fmt(s["kernel_1_us"]), _fmt(s["kernel_2_us"])]
            cells += [_cells(by_impl.get(impl), "median_us") for impl in impls[1:]]
            cells += [s["best_peer"] or "–", (_fmt(s["speedup"], 2) + "×") if s["speedup"] else "–",
                      _fmt(100 * s["floor_fraction"], 0) if s["floor_fraction"] else "–"]
            lines.append("| " + " | ".join(cells) + " |")
        norm_summ = [s for s in summ if s["norm"] == norm]
        g = geomean([s["speedup"] for s in norm_summ])
        g_ks = geomean([s["kernel_sum_speedup"] for s in norm_summ])
        lines += ["", f"Geometric-mean speedup over the best peer: {_fmt(g, 3)}× ({_view(p['interpret'])})"
                  + (f", {_fmt(g_ks, 3)}× (kernel sum)" if g_ks else "") if g else "", ""]
        lines += ["Kernel sum (µs, torch.profiler):", ""] + _view_table(report, norm, impls, "kernel_sum_us") + [""]
        lines += ["Host µs per call (backward / forward):", ""] + _view_table(report, norm, impls, "host_us",
                                                                              _host_cell) + [""]
        target = host_target_line(rows)
        lines += [target, ""] if target else []
    allg = geomean([s["speedup"] for s in summ if s["speedup"]])
    wins = sum(1 for s in summ if s["speedup"] and s["speedup"] > 1)
    total = sum(1 for s in summ if s["speedup"])
    if total:
        ks = [s["kernel_sum_speedup"] for s in summ if s["kernel_sum_speedup"]]
        ks_text = (f" Kernel-sum view: beats the best peer on {sum(1 for v in ks if v > 1)}/{len(ks)}; "
                   f"geometric mean {_fmt(geomean(ks), 3)}×.") if ks else ""
        lines += [f"**All cases ({_view(p['interpret'])}): normtune beats the best peer on {wins}/{total}; "
                  "geometric-mean "
                  f"speedup {_fmt(allg, 3)}×.**{ks_text}", ""]
    failures = [r for r in report.rows if r["status"] not in ("ok",)]
    if notes or failures:
        lines += ["## Notes", ""]
        lines += [f"- {n}" for n in notes]
        seen = set()
        for r in failures:
            key = (r["impl"], r["status"], r.get("error"))
            if key not in seen:
                seen.add(key)
                lines.append(f"- {r['impl']} {r['status']}: {str(r.get('error'))[:300]}")
        lines.append("")
    return "\n".join(lines)


def summary_table(report: BenchReport):
    """The console summary (a rich Table, at most 80 columns wide): per problem normtune's GPU time, the best
    peer's, the speedup in the GPU-time and kernel-sum views, normtune's host µs per backward call, % of floor."""
    from rich import box
    from rich.table import Table

    interp = report.provenance["interpret"]
    table = Table(title=f"normtune vs best peer — {report.provenance['device']['name']}"
                  + (" (interpreter: not GPU times)" if interp else ""), box=box.SIMPLE_HEAD, padding=(0, 1),
                  pad_edge=False, title_justify="left")
    for col in ("problem", "µs", "best peer", "µs", "×", "ksum ×", "host", "%flr"):
        table.add_column(col, justify="left" if col in ("problem", "best peer") else "right", no_wrap=True)
    abbrev = {"layer_norm": "LN", "rms_norm": "RMS"}
    for s in summary(report.rows):
        table.add_row(f"{abbrev.get(s['norm'], s['norm'])} {s['M']}×{s['N']}",
                      _fmt(s["normtune_us"]) if s["status"] == "ok" else s["status"], s["best_peer"] or "–",
                      _fmt(s["best_peer_us"]), _fmt(s["speedup"], 2), _fmt(s["kernel_sum_speedup"], 2),
                      _fmt(s["host_us"], 0), _fmt(100 * s["floor_fraction"], 0) if s["floor_fraction"] else "–")
    return table


def summary_footer(report: BenchReport) -> str:
    """The line under the console table: geometric means and what the columns are."""
    summ = summary(report.rows)
    interp = report.provenance["interpret"]
    g, g_ks = geomean([s["speedup"] for s in summ]), geomean([s["kernel_sum_speedup"] for s in summ])
    parts = [f"geomean × {_fmt(g, 3)} ({_view(interp)})" if g else "", f"{_fmt(g_ks, 3)} (kernel sum)" if g_ks else ""]
    return ", ".join(p for p in parts if p) + ("\n" if g else "") + \
        f"µs: {_view(interp, heading=True)}; ksum ×: kernel-sum view; host: normtune CPU µs/backward"


def _view(interpret: bool, heading: bool = False) -> str:
    """What a bench time is: GPU time, or the interpreter's wall-clock on CPU (never called GPU time)."""
    if interpret:
        return "interpreter wall-clock on CPU (no GPU)"
    return "GPU time, host hidden" if heading else "GPU time"


def plot(report: BenchReport, out_dir: Path) -> list[Path]:
    """Per norm: normtune vs peers (grouped bars, floor marked) and normtune's kernel_1/kernel_2 stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    impls = [OURS] + [i for i in dict.fromkeys(r["impl"] for r in report.rows) if i != OURS]
    gpu = report.provenance["device"]["name"]
    time_label = "host wall-clock µs (Triton interpreter, not GPU time)" if report.provenance["interpret"] else \
        "backward µs (GPU time, host hidden, cold L2)"
    for norm in dict.fromkeys(r["norm"] for r in report.rows):
        rows = [r for r in report.rows if r["norm"] == norm]
        shapes = list(dict.fromkeys((r["M"], r["N"]) for r in rows))
        labels = [f"{m}×{n}" for m, n in shapes]
        fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(shapes) + 3), 4.8))
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            vals = []
            for shape in shapes:
                r = next((x for x in rows if (x["M"], x["N"]) == shape and x["impl"] == impl), None)
                vals.append(r["median_us"] if r and r["status"] == "ok" and r["median_us"] else 0.0)
            ax.bar([j + (i - (len(impls) - 1) / 2) * width for j in range(len(shapes))], vals, width, label=impl)
        floors = [next((x["floor_us"] for x in rows if (x["M"], x["N"]) == s and x["floor_us"]), None)
                  for s in shapes]
        if any(floors):
            ax.scatter(range(len(shapes)), [f or 0 for f in floors], marker="_", s=400, color="black",
                       zorder=5, label="memory floor")
        ax.set_xticks(range(len(shapes)), labels, rotation=45, ha="right")
        ax.set_ylabel(time_label)
        ax.set_title(f"{norm} backward, {report.provenance['dtype']} — {gpu}")
        ax.legend(fontsize=8, ncols=2)
        fig.tight_layout()
        path = out_dir / f"bench_{norm}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

        fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(shapes) + 3), 4.5))
        ours = [next((x for x in rows if (x["M"], x["N"]) == s and x["impl"] == OURS), None) for s in shapes]
        # kernel_1 and the rest of the backward after it (kernel_2 and its launch gap), so that the stack is
        # the measured total, never more.
        total = [(r["median_us"] or 0) if r and r["status"] == "ok" else 0 for r in ours]
        k1 = [min(t, (r["kernel_1_us"] or 0) if r else 0) for r, t in zip(ours, total)]
        ax.bar(labels, k1, label="kernel_1")
        ax.bar(labels, [t - a for t, a in zip(total, k1)], bottom=k1, label="rest: kernel_2 + launch gap")
        bp = summary(report.rows)
        best = [next((s["best_peer_us"] for s in bp if s["norm"] == norm and (s["M"], s["N"]) == sh), None)
                for sh in shapes]
        if any(best):
            ax.scatter(labels, [b or 0 for b in best], marker="D", color="red", zorder=5, label="best peer")
        ax.set_ylabel(time_label)
        ax.set_title(f"normtune {norm}: kernel_1 + kernel_2 — {gpu}")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"kernels_{norm}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def check_out_dir(out_dir: str | Path) -> Path:
    """Create `out_dir` if needed and prove it writable (a probe file), before anything is measured. Raises
    OSError with a message naming the folder and the fix."""
    import tempfile

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".normtune-probe-"):
            pass
    except OSError as err:
        raise OSError(f"--out {out}: cannot write there ({err.strerror or err}): pick a writable folder") from None
    return out


def write_tables(report: BenchReport, out_dir: str | Path) -> list[Path]:
    """bench.csv, bench.json and bench.md, each replaced whole (what the command writes after every shape)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.csv", out / "bench.json", out / "bench.md"]
    write_csv(report, paths[0])
    write_atomic(paths[1], to_json(report))
    write_atomic(paths[2], markdown(report))
    return paths


def write_all(report: BenchReport, out_dir: str | Path) -> list[Path]:
    """The tables and the plots."""
    return write_tables(report, out_dir) + plot(report, Path(out_dir))
