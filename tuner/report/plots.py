"""The report's pictures, drawn on matplotlib's object API (`Figure`, never pyplot): saving a PNG needs no
display and switches no global backend, so a caller's interactive session is left as it was.

Every plot names its axes, its dtype and what its times are (cold-L2 GPU time, or interpreter wall-clock);
ratios are drawn as ratios around a labelled 1.0 line; stacked kernel bars never exceed the total they explain.
"""

from __future__ import annotations

import math
from pathlib import Path


class Pictures:
    """Saves figures into the report's folder, in order, and gives the Markdown line that shows each."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.paths = out_dir, []

    def save(self, fig, name: str) -> str:
        path = self.out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        self.paths.append(path)
        return f"![{name.removesuffix('.png')}]({name})"


def time_label(interpret: bool) -> str:
    return "interpreter wall-clock µs (not GPU time)" if interpret else "µs (cold L2, device time)"


def _axes(n_labels: int, per_label: float = 0.45):
    from matplotlib.figure import Figure  # lazy: only writing a report needs matplotlib

    fig = Figure(figsize=(min(20.0, max(7.0, n_labels * per_label + 2)), 4.6))
    return fig, fig.subplots()


def _finish(ax, labels: list[str], *, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def grouped_bars(labels: list[str], series: dict[str, list], *, title: str, ylabel: str,
                 markers: dict[str, list] | None = None, xlabel: str = "problem (M×N)"):
    """Side-by-side bars, one group per label (missing values draw no bar); `markers` as ticks over each group
    (the memory floor)."""
    fig, ax = _axes(len(labels), 0.3 + 0.15 * max(1, len(series)))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar([j + offset for j in range(len(labels))], [v if _finite(v) else 0.0 for v in values], width,
               label=name)
    _markers(ax, markers)
    _finish(ax, labels, title=title, xlabel=xlabel, ylabel=ylabel)
    return fig


def _markers(ax, markers: dict[str, list] | None) -> None:
    for name, values in (markers or {}).items():
        points = [(j, v) for j, v in enumerate(values) if _finite(v)]
        if points:
            ax.scatter(*zip(*points), marker="_", s=500, color="black", zorder=5, label=name)


def ratio_bars(labels: list[str], values: list[float | None], *, title: str, ylabel: str,
               lines: dict[str, float], xlabel: str = "problem (M×N)"):
    """One bar per label for a ratio, on a log axis (1.05 and 1/1.05 look alike), with labelled reference
    lines (`lines`: legend text → y)."""
    fig, ax = _axes(len(labels), 0.35)
    ok = [v for v in values if _finite(v) and v > 0]
    ax.bar(range(len(labels)), [v if _finite(v) and v > 0 else 1.0 for v in values], 0.7, bottom=0,
           color=["tab:green" if _finite(v) and v >= 1 else "tab:red" for v in values], label=ylabel)
    ax.set_yscale("log")
    low, high = min(ok + list(lines.values()) + [1.0]), max(ok + list(lines.values()) + [1.0])
    ax.set_ylim(low / 1.05, high * 1.05)
    for (name, y), style in zip(lines.items(), ("--", ":", "-.")):
        ax.axhline(y, color="black", linestyle=style, linewidth=1, label=name)
    from matplotlib.ticker import FormatStrFormatter

    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2f"))
    _finish(ax, labels, title=title, xlabel=xlabel, ylabel=ylabel)
    return fig


def kernel_split_bars(labels: list[str], totals: list[float], kernel_1: list, kernel_2: list, *, title: str,
                      ylabel: str, markers: dict[str, list] | None = None):
    """The total time per problem as a stacked bar of kernel_1 and kernel_2. The split comes from separate
    repetitions with an event between the kernels, so it need not add up to the total: where it exceeds the
    total both parts are scaled down to it; where it falls short the rest is drawn as 'not in either kernel'
    (launch gap, event overhead). A bar is never taller than its total."""
    fig, ax = _axes(len(labels), 0.45)
    k1s, k2s, gaps = [], [], []
    for total, k1, k2 in zip(totals, kernel_1, kernel_2):
        k1, k2 = (k1 if _finite(k1) else 0.0), (k2 if _finite(k2) else 0.0)
        scale = min(1.0, total / (k1 + k2)) if k1 + k2 > 0 else 0.0
        k1s.append(k1 * scale)
        k2s.append(k2 * scale)
        gaps.append(max(0.0, total - k1 * scale - k2 * scale))
    xs = range(len(labels))
    ax.bar(xs, k1s, 0.8, label="kernel_1 (dx + partials)")
    ax.bar(xs, k2s, 0.8, bottom=k1s, label="kernel_2 (reduce partials)")
    ax.bar(xs, gaps, 0.8, bottom=[a + b for a, b in zip(k1s, k2s)], color="lightgrey", hatch="//",
           label="rest of the total (not in either kernel's split)")
    _markers(ax, markers)
    _finish(ax, labels, title=title, xlabel="problem (M×N)", ylabel=ylabel)
    return fig


def heatmap(cells: dict[tuple, float], x_param: str, y_param: str, *, title: str, unit: str):
    import matplotlib
    import numpy
    from matplotlib.figure import Figure

    xs, ys = sorted({x for x, _ in cells}), sorted({y for _, y in cells})
    grid = numpy.ma.masked_invalid([[cells.get((x, y), math.nan) for x in xs] for y in ys])
    fig = Figure(figsize=(max(5.0, 0.8 * len(xs) + 2.5), max(3.5, 0.5 * len(ys) + 2)))
    ax = fig.subplots()
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
    fig.colorbar(image, ax=ax, label=f"best {unit}")
    return fig
