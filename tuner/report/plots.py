"""The report's pictures, drawn on matplotlib's object API (`Figure`, never pyplot): saving a PNG needs no
display and switches no global backend, so a caller's interactive session is left as it was.

Every figure is a column of panels of at most `MAX_PER_AXIS` problems each (`facets`), so that no axis carries
more labels than can be read. Each panel has its own y range, chosen from its values, so nothing is clipped.
Ratios are drawn on a log axis around a labelled 1.0 line (1.05 and 1/1.05 look alike); the per-kernel
breakdown is drawn as shares of the total (0 to 1), with the total in each label, because totals span orders of
magnitude between problems.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

MAX_PER_AXIS = 20  # problems on one panel's x axis


class Pictures:
    """Saves figures into the report's folder, in order, and gives the Markdown line that shows each."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.paths = out_dir, []

    def save(self, fig, name: str) -> str:
        """Save `fig` as a PNG of at most 256 colours (a quarter of the bytes of full colour, alike to the eye:
        the plots use a few flat colours), and return its Markdown line.

        The figure is drawn once, on an Agg canvas, and its pixels go to Pillow as they are. Every figure here has
        a constrained layout, which keeps titles, tick labels and the legend inside the figure, so the image is the
        figure at its own size. (`savefig` would draw it twice, once to lay it out and once to render it, and
        encode a full-colour PNG only to decode it again.)"""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from PIL import Image  # matplotlib's own dependency

        path = self.out_dir / name
        fig.set_dpi(100)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
        self.paths.append(path)
        return f"![{name.removesuffix('.png')}]({name})"


def time_label(interpret: bool) -> str:
    return "interpreter wall-clock µs (not GPU time)" if interpret else "µs (cold L2, device time)"


def chunks(items: Sequence, size: int = MAX_PER_AXIS) -> list[list]:
    """`items` cut into consecutive runs of at most `size`, as even as possible (41 → 14, 14, 13)."""
    count = max(1, math.ceil(len(items) / size))
    base, extra = divmod(len(items), count)
    out, start = [], 0
    for i in range(count):
        end = start + base + (i < extra)
        out.append(list(items[start:end]))
        start = end
    return [c for c in out if c]


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def wrapped(text: str, inches: float, fontsize: float) -> str:
    """`text` broken into lines that fit `inches` at `fontsize` points (a character taken as 0.62 em, wider than
    the font's average), so that a title longer than its figure is not cut at the figure's edges."""
    import textwrap

    return textwrap.fill(text, max(20, int(inches * 72 / (0.62 * fontsize))), break_on_hyphens=False)


def panels(count: int, widest: int, *, title: str):
    """A figure with `count` panels stacked vertically, wide enough for `widest` labels."""
    from matplotlib.figure import Figure  # lazy: only writing a report needs matplotlib

    width = max(7.0, 0.5 * widest + 2.5)
    fig = Figure(figsize=(width, 3.6 * count + 0.6), layout="constrained")
    axes = fig.subplots(count, 1, squeeze=False)[:, 0]
    fig.suptitle(wrapped(title, width, 11), fontsize=11)
    return fig, list(axes)


def _xlabels(ax, labels: list[str], xlabel: str) -> None:
    ax.set_xticks(range(len(labels)), labels, rotation=40 if max(map(len, labels), default=0) > 9 else 0,
                  ha="right" if max(map(len, labels), default=0) > 9 else "center", fontsize=8)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_xlabel(xlabel, fontsize=9)


def ratio_panel(ax, labels: list[str], values: list, *, ylabel: str, lines: dict[str, float], subtitle: str,
                xlabel: str = "problem (M×N)") -> None:
    """One bar per label for a ratio on a log axis, with labelled reference lines (legend text → y)."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullLocator

    ok = [v for v in values if _finite(v) and v > 0]
    ax.bar(range(len(labels)), [v if _finite(v) and v > 0 else 1.0 for v in values], 0.7,
           color=["tab:green" if _finite(v) and v >= 1 else "tab:red" for v in values], label=ylabel)
    ax.set_yscale("log")
    low, high = min(ok + list(lines.values()) + [1.0]), max(ok + list(lines.values()) + [1.0])
    ax.set_ylim(low / 1.04, high * 1.06)
    for (name, y), style in zip(lines.items(), ("--", ":", "-.")):
        ax.axhline(y, color="black", linestyle=style, linewidth=1, label=name)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 0.8, 0.9)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(subtitle, fontsize=9)
    _xlabels(ax, labels, xlabel)


def share_panel(ax, labels: list[str], totals: list, kernel_1: list, kernel_2: list, floors: list, *,
                subtitle: str, unit: str) -> None:
    """kernel_1, kernel_2 and the rest as shares of each problem's total (bars of height 1), the memory floor as a
    tick at floor ÷ total, the total in the label. The split comes from separate repetitions with an event
    between the kernels: where it exceeds the total both parts are scaled down to it; where it falls short the
    rest is drawn as 'not in either kernel' (launch gap, event overhead)."""
    k1s, k2s, gaps = [], [], []
    for total, k1, k2 in zip(totals, kernel_1, kernel_2):
        k1, k2 = (k1 if _finite(k1) else 0.0), (k2 if _finite(k2) else 0.0)
        scale = min(1.0, total / (k1 + k2)) if k1 + k2 > 0 else 0.0
        k1s.append(k1 * scale / total)
        k2s.append(k2 * scale / total)
        gaps.append(max(0.0, 1.0 - (k1 + k2) * scale / total))
    xs = range(len(labels))
    ax.bar(xs, k1s, 0.8, label="kernel_1 (dx + partials)")
    ax.bar(xs, k2s, 0.8, bottom=k1s, label="kernel_2 (reduce partials)")
    ax.bar(xs, gaps, 0.8, bottom=[a + b for a, b in zip(k1s, k2s)], color="lightgrey", hatch="//",
           label="rest of the total (in neither kernel's split)")
    points = [(j, f / t) for j, (f, t) in enumerate(zip(floors, totals)) if _finite(f) and t]
    if points:
        ax.scatter(*zip(*points), marker="_", s=300, color="black", zorder=5, label="memory floor ÷ total")
    # A total faster than the floor puts its tick above the bars (the floor is an estimate, not a bound): keep it
    # in view.
    ax.set_ylim(0, max([1.0] + [y * 1.02 for _, y in points if y > 1.0]))
    ax.set_ylabel("share of the total", fontsize=9)
    ax.set_title(subtitle, fontsize=9)
    _xlabels(ax, [f"{label}\n{total:.0f} {unit}" for label, total in zip(labels, totals)], "problem (M×N), total")


def grouped_ratio_panel(ax, labels: list[str], series: dict[str, list], *, ylabel: str, subtitle: str) -> None:
    """Side-by-side ratio bars (one per series) per label on a log axis around 1.0; missing values draw no bar."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullLocator

    width = 0.8 / max(1, len(series))
    values = [v for vs in series.values() for v in vs if _finite(v) and v > 0]
    for i, (name, vs) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        points = [(j + offset, v) for j, v in enumerate(vs) if _finite(v) and v > 0]
        if points:
            ax.bar(*zip(*points), width, label=name)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="1.0 = as fast as normtune")
    ax.set_ylim(min(values + [1.0]) / 1.08, max(values + [1.0]) * 1.08)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 0.8)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(subtitle, fontsize=9)
    _xlabels(ax, labels, "problem (M×N)")


def faceted(groups: list[tuple[str, list]], draw: Callable, *, title: str):
    """One panel per (subtitle, items) group; `draw(ax, subtitle, items)` fills each. The panels share one
    legend, below them, so that none covers a bar."""
    fig, axes = panels(len(groups), max(len(items) for _, items in groups), title=title)
    for ax, (subtitle, items) in zip(axes, groups):  # a panel's title spans its axes, about 1 inch short of the figure
        draw(ax, wrapped(subtitle, fig.get_figwidth() - 1.0, 9), items)
    handles: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(5, len(handles)),
                   fontsize=8, frameon=False)
    return fig


def heatmap(cells: dict[tuple, float], x_param: str, y_param: str, *, title: str, unit: str):
    import matplotlib
    import numpy
    from matplotlib.figure import Figure

    xs, ys = sorted({x for x, _ in cells}), sorted({y for _, y in cells})
    grid = numpy.ma.masked_invalid([[cells.get((x, y), math.nan) for x in xs] for y in ys])
    width = max(5.0, 0.8 * len(xs) + 2.5)
    fig = Figure(figsize=(width, max(3.5, 0.5 * len(ys) + 2)), layout="constrained")
    ax = fig.subplots()
    from matplotlib.colors import LogNorm

    # Colours on a log scale: the slowest configs are often ten times the fastest, and a linear scale would give
    # every fast cell the same colour.
    image = ax.imshow(grid, cmap=matplotlib.colormaps["viridis_r"].with_extremes(bad="white"), aspect="auto",
                      origin="lower", norm=LogNorm() if grid.count() and grid.min() > 0 else None)
    for (i, j), value in numpy.ndenumerate(grid.filled(math.nan)):
        if math.isfinite(value):  # dark text on the light (fast) cells, light text on the dark (slow) ones
            ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=7,
                    color="black" if image.norm(value) < 0.5 else "white")
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [str(y) for y in ys])
    ax.set_xlabel(x_param.replace("_", ".", 1))
    ax.set_ylabel(y_param.replace("_", ".", 1))
    ax.set_title(wrapped(title, width - 1.0, 10), fontsize=10)
    from matplotlib.ticker import FormatStrFormatter

    bar = fig.colorbar(image, ax=ax, label=f"best {unit}")
    bar.ax.yaxis.set_major_formatter(FormatStrFormatter("%.0f"))
    bar.ax.yaxis.set_minor_formatter(FormatStrFormatter("%.0f"))
    return fig
