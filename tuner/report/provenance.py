"""The report's last section: where its numbers come from, as counts and ranges, with every run in runs.csv."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

from ..render import num
from .data import ReportData

RUNS_CSV = "runs.csv"
CSV_COLUMNS = ("run", "kind", "status", "started_utc", "minutes", "gpu", "compute_capability", "sm_count", "driver",
               "cuda", "torch", "triton", "normtune", "git_revision", "copy_bandwidth_gbps", "host", "command")


def command_text(text: str) -> str:
    """A run's command as typed: the program without its folder."""
    words = text.split(" ", 1)
    return Path(words[0]).name + (" " + words[1] if len(words) > 1 else "")


def write_runs_csv(data: ReportData, out: Path) -> Path:
    path = out / RUNS_CSV
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in data.runs:
            d = r.device
            minutes = (r.ended_at - r.started_at).total_seconds() / 60 if r.ended_at else None
            writer.writerow([r.id, r.kind, r.status, f"{r.started_at:%Y-%m-%d %H:%M}", num(minutes), d.name,
                             d.compute_capability or "", d.sm_count or "", d.driver or "", d.cuda or "", d.torch,
                             d.triton, d.normtune, d.git_revision or "", num(r.copy_bandwidth_gbps, 0)
                             if r.copy_bandwidth_gbps else "", d.host, command_text(r.command_line)])
    return path


def _values(data: ReportData, field: str) -> str:
    """The distinct values of a device field, most used first, with their run counts when they differ."""
    counts = Counter(str(getattr(r.device, field)) for r in data.runs if getattr(r.device, field) is not None)
    if not counts:
        return "unrecorded"
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{value} ({n} runs)" for value, n in counts.most_common())


def _span(values: list[float]) -> str:
    low, high = f"{min(values):.0f}", f"{max(values):.0f}"
    return low if low == high else f"{low}–{high}"


def provenance_section(data: ReportData) -> list[str]:
    runs = data.runs
    kinds = Counter(r.kind for r in runs)
    started = [r.started_at for r in runs]
    revisions = [r.device.git_revision for r in runs if r.device.git_revision]
    bandwidths = [r.copy_bandwidth_gbps for r in runs if r.copy_bandwidth_gbps]
    last = runs[-1].device
    return [
        "## Provenance", "",
        f"- Runs: {len(runs)} ({', '.join(f'{n} {kind}' for kind, n in kinds.most_common())}), run ids "
        f"{runs[0].id}–{runs[-1].id}, started {min(started):%Y-%m-%d} to {max(started):%Y-%m-%d}; "
        f"{len(data.measurements)} measurements. Every run, with its command line, is in [{RUNS_CSV}]({RUNS_CSV}).",
        f"- GPU: {_values(data, 'name')}; compute capability {_values(data, 'compute_capability')}; "
        f"{_values(data, 'sm_count')} SMs; L2 {last.l2_bytes / 2**20:.0f} MiB; driver {_values(data, 'driver')}; "
        f"CUDA {_values(data, 'cuda')}.",
        f"- Software: torch {_values(data, 'torch')}; triton {_values(data, 'triton')}.",
        f"- Git revisions: {len(set(revisions))} distinct"
        + (f", from {revisions[0]} (run {runs[0].id}) to {revisions[-1]} (run {runs[-1].id})" if revisions else "")
        + (f"; runs recording none: {len(runs) - len(revisions)}" if len(revisions) < len(runs) else "") + ".",
        "- Copy bandwidth behind the memory floor, as stored with each run: "
        + (f"{_span(bandwidths)} GB/s over {len(bandwidths)} of the runs"
           + (f"; runs storing none (% floor n/a for their measurements): {len(runs) - len(bandwidths)}"
              if len(bandwidths) < len(runs) else "")
           if bandwidths else "not recorded by any run (% floor is n/a)") + ".",
        "",
    ]

