"""`normtune.tuner.report` without a GPU: a hand-made database (runs, measurements, peers) rendered to Markdown and
PNGs, checked for its sections and numbers; plus one rendering of the committed results.db.

Expected figures are worked out by hand in the comments beside the values that produce them.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, default_config, kernel_1_config
from normtune.tuner.tables import emit
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.report import heatmap_cells, load_report_data, write_report
from normtune.tuner.store.database import Store

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO_DB = Path(__file__).resolve().parents[1] / "results.db"

GPU = DeviceInfo(name="NVIDIA Test GPU", key="testgpu", compute_capability="9.0", sm_count=8, l2_bytes=50 * 2**20,
                 memory_bytes=80 * 2**30, driver="560.35.03", cuda="12.6", torch="2.6.0", triton="3.2.0",
                 normtune="0.1.0", git_revision="abc1234", host="node-1", python="3.11.9", interpret=False)
INTERPRETER = dataclasses.replace(GPU, name="cpu (triton interpreter)", key="interpret", compute_capability=None,
                                  sm_count=4, driver=None, cuda=None, interpret=True)

LN = Problem("layer_norm", 256, 1024, "bf16")
RMS = Problem("rms_norm", 512, 2048, "bf16")
LN_HELDOUT = Problem("layer_norm", 300, 1536, "bf16")
RMS_HELDOUT = Problem("rms_norm", 700, 3000, "bf16")


def config(problem: Problem, block_row: int = 1, num_warps: int = 4, block_m: int = 64,
           block_n: int = 64) -> BackwardConfig:
    n_pow2 = 1 << (problem.N - 1).bit_length()
    return BackwardConfig(kernel_1_config(block_row=block_row, block_col=n_pow2, num_warps=num_warps),
                          Kernel2Config(block_m=block_m, block_n=block_n)).validate(problem)


def ok(median: float, floor: float | None = None, **more) -> MeasureResult:
    return MeasureResult(status="ok", median_us=median, reps=20, kernel_1_us=0.8 * median, kernel_2_us=0.2 * median,
                         floor_us=floor, floor_fraction=floor / median if floor else None, **more)


def failed(status: str) -> MeasureResult:
    return MeasureResult(status=status, error=f"made-up {status}")


def add_sweep(store: Store, info: DeviceInfo = GPU) -> int:
    run = store.start_run(info, kind="sweep", command_line=f"normtune sweep --gpu {info.key}")
    add = lambda problem, cfg, result, source: store.add_measurement(  # noqa: E731
        run, problem, cfg, dataclasses.replace(result, interpret=info.interpret), source=source)
    # LN's heatmap grid (block_row x num_warps): (1, 4) twice, the cell keeps the faster 10.0; (2, 8) only failed,
    # so its cell stays blank; the analytic default (block_row 8, 8 warps for N=1024) adds its own cell.
    for block_row, num_warps, result in ((1, 4, ok(12.0)), (1, 4, ok(10.0)), (1, 8, ok(9.37, floor=4.685)),
                                         (2, 4, ok(11.0)), (2, 8, failed("incorrect"))):
        add(LN, config(LN, block_row, num_warps), result, "sweep")
    add(LN, default_config(LN), ok(15.0), "seed")
    add(RMS, config(RMS, 1, 8), ok(18.3), "sweep")
    add(RMS, config(RMS, 2, 8), ok(19.0), "sweep")
    add(RMS, config(RMS, 4, 16), failed("out_of_resources"), "sweep")
    store.end_run(run)
    return run


def add_validation(store: Store) -> None:
    run = store.start_run(GPU, kind="validate", command_line="validate head-to-head")
    # Medians of the rounds: LN 300x1536 table 11.5, best 10.0, default 13.0 -> regret 1.15, speedup 1.1304;
    # RMS 700x3000 table 20, best 16, default 25 -> regret 1.25, speedup 1.25.
    # Geometric means: regret sqrt(1.15 * 1.25) = 1.199, speedup sqrt(1.1304 * 1.25) = 1.189.
    rounds = {LN_HELDOUT: {"table": (10.5, 11.5, 12.0), "best": (10.0, 10.0, 10.5), "default": (13.0, 13.0, 14.0)},
              RMS_HELDOUT: {"table": (20.0,) * 3, "best": (16.0,) * 3, "default": (25.0,) * 3}}
    for problem, by_name in rounds.items():
        configs = {"table": config(problem, 1, 8), "best": config(problem, 1, 4), "default": default_config(problem)}
        for i in range(3):
            for name, times in by_name.items():
                store.add_measurement(run, problem, configs[name], ok(times[i]), source=f"validate-{name}")
    store.end_run(run)


def add_bench(store: Store) -> None:
    run = store.start_run(GPU, kind="bench", command_line="normtune bench --peers torch,quack",
                          copy_bandwidth_gbps=2900.0)
    # LN: normtune 12.5, torch 20, quack 15 -> best peer quack, speedup 1.2; RMS: normtune 20, torch 30, quack
    # unavailable -> speedup 1.5. Wins 2/2, geometric-mean speedup sqrt(1.2 * 1.5) = 1.342.
    store.add_measurement(run, LN, config(LN, 1, 8), ok(12.5, floor=5.0), source="bench-table")
    store.add_measurement(run, RMS, config(RMS, 1, 8), ok(20.0, floor=10.0), source="bench-table")
    store.add_peer_result(run, LN, "torch", status="ok", median_us=20.0, reps=20)
    store.add_peer_result(run, LN, "quack", status="ok", median_us=15.0, reps=20)
    store.add_peer_result(run, RMS, "torch", status="ok", median_us=30.0, reps=20)
    store.add_peer_result(run, RMS, "quack", status="unavailable", error="quack-kernels is not installed")
    store.end_run(run)


# The tests of `full_store` and `full_report` run on one xdist worker (`--dist loadgroup`), which builds them once.
FULL = pytest.mark.xdist_group("report-full-store")


@pytest.fixture(scope="module")
def full_store(tmp_path_factory):
    """Sweep, validate and bench runs on the made-up GPU."""
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('full') / 'results.db'}")
    add_sweep(store)
    add_validation(store)
    add_bench(store)
    yield store
    store.close()


@pytest.fixture(scope="module")
def full_report(full_store, tmp_path_factory):
    """The full store's report, written once: (its paths, the figures saved as (name, figure), the figures drawn)."""
    from matplotlib.figure import Figure

    from normtune.tuner.report import plots

    draws, figures = [], []
    draw, save = Figure.draw, plots.Pictures.save
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "draw", lambda self, renderer: draws.append(self) or draw(self, renderer))
        patch.setattr(plots.Pictures, "save", lambda self, fig, name: figures.append((name, fig)) or
                      save(self, fig, name))
        paths = write_report(full_store, "testgpu", tmp_path_factory.mktemp("report"))
    return paths, figures, draws


def assert_valid_pngs(paths: list[Path]) -> None:
    for path in paths:
        if path.suffix == ".png":
            data = path.read_bytes()
            assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
            assert len(data) > 1024, f"{path.name} is only {len(data)} bytes"


@FULL
def test_report_writes_every_section_and_plot(full_report):
    paths = full_report[0]
    tmp_path = paths[0].parent
    names = [p.name for p in paths]
    assert names[0] == "report.md"
    assert set(names) == {"report.md", "runs.csv", "kernels_layer_norm_bf16.png", "kernels_rms_norm_bf16.png",
                          "best_vs_default_layer_norm.png", "best_vs_default_rms_norm.png",
                          "heatmap_k1_block_row_k1_num_warps.png",
                          "heatmap_k2_block_m_k2_block_n.png", "heatmap_k1_programs_per_sm_k2_block_m.png",
                          "validation_layer_norm.png", "validation_rms_norm.png", "peers.png"}
    assert all(p.parent == tmp_path and p.is_file() for p in paths)
    assert_valid_pngs(paths)
    text = (tmp_path / "report.md").read_text()
    headings = ["## Summary", "## normtune vs peers", "## Best config per problem", "## Where the time goes",
                "## Launch knobs", "## Heuristic table", "## Validation on held-out shapes", "## Provenance"]
    positions = [text.index(h) for h in headings]
    assert positions == sorted(positions), "results come first, provenance last"
    for png in names[2:]:
        assert f"]({png})" in text, f"report.md does not link {png}"
    # A result within the first 30 lines: the summary's peer comparison, labelled with GPU and dtype.
    head = text.splitlines()[:30]
    assert ("- **normtune vs the fastest peer** (NVIDIA Test GPU, bf16, 2 shapes, bench run 3): faster on 2 of 2 "
            "shapes, geometric-mean speedup **1.342×**.") in head
    assert "### layer_norm bf16 (weights bf16, with bias, saves the input) — NVIDIA Test GPU" in text
    # Provenance: counts and ranges, every run in runs.csv.
    assert "- Runs: 3 (1 sweep, 1 validate, 1 bench), run ids 1–3" in text and "[runs.csv](runs.csv)" in text
    assert "compute capability 9.0; 8 SMs" in text and "driver 560.35.03" in text and "torch 2.6.0" in text
    assert "Git revisions: 1 distinct, from abc1234 (run 1) to abc1234 (run 3)." in text
    assert "as stored with each run: 2900 GB/s over 1 of the runs; runs storing none" in text
    rows = (tmp_path / "runs.csv").read_text().splitlines()
    assert rows[0].startswith("run,kind,status") and [r.split(",")[1] for r in rows[1:]] == ["sweep", "validate",
                                                                                               "bench"]
    # Best LN: 9.37 µs of sweep run 1 (7 measurements: 6 of the sweep, 1 of the bench), kernel split 80/20; the
    # sweep run stored no copy bandwidth, so % floor is n/a (the measurement's own floor_us is not used); the
    # default timed in the same run at 15.0 -> 1.60x. GB/s, derived as no bytes were stored: 16 programs (2 per
    # SM x 8 SMs) move 1572864 (floor) + 2048 (mean, rstd) + 2048 (weight) + 262144 (fp32 partials of dw and db,
    # written and read) + 4096 (dw, db) = 1843200 B in 9.37 µs = 197 GB/s.
    best_ln = config(LN, 1, 8)
    assert f"| 256×1024 | `{best_ln}` | 9.4 | 7.5 | 1.9 | 197 | n/a | 1 | 15.0 | 1.60× | 7 | incorrect 1 |" in text
    # RMS: the default was never timed in the best's run: no default figure, no best-vs-default plot.
    assert f"| 512×2048 | `{config(RMS, 1, 8)}` | 18.3 | 14.6 | 3.7 | 359 | n/a | 1 | – | – | 4 |" in text
    assert "out_of_resources 1" in text
    # RMS 700x3000's best is the validation run's reference (16.0), where that run timed the default (25.0).
    assert "| 700×3000 |" in text and "| 2 | 25.0 | 1.56× |" in text
    # Heatmaps: the problem with most measurements, 9 validation rounds each for both held-out problems; the tie
    # goes to the first key.
    assert f"layer_norm bf16 300×1536 on NVIDIA Test GPU (`{LN_HELDOUT.key}`, 9 measurements)" in text
    # No table file for this GPU: fitted from the store.
    assert "rules fitted now from the stored results" in text and "Learned single-pass threshold" in text
    # Validation and peers, as worked out beside the fixture.
    assert "| layer_norm 300×1536 bf16 | 11.5 | 10.0 | 13.0 | 1.150 [" in text
    assert "Geometric-mean regret 1.199, worst 1.250 over 2 shapes" in text
    assert "analytic default 1.189×" in text and "2 of 2 shapes exceed a regret of 1.10" in text
    assert "not an independent reference" in text  # the fixture's run stored validate-best (an older validate)
    # Floors at the bench run's stored 2900 GB/s (not the made-up floor_us of its measurements): LN 3 * 256 *
    # 1024 * 2 B = 0.54 µs, RMS 3 * 512 * 2048 * 2 B = 2.17 µs.
    assert "| layer_norm 256×1024 | 0.5 | 12.5 | 20.0 | 15.0 | quack | 1.20× |" in text
    assert "| rms_norm 512×2048 | 2.2 | 20.0 | 30.0 | unavailable | torch | 1.50× |" in text
    assert "normtune beats the best peer on 2/2 shapes; geometric-mean speedup 1.342×" in text
    assert "bench run 3" in text and "(2900 GB/s)" in text


@FULL
def test_each_plot_is_drawn_once_and_holds_everything_it_draws(full_report):
    """Saving draws a figure once (its constrained layout places everything inside it, so no second, measuring
    draw is needed), and every artist it drew lies within the saved image: nothing is clipped at its edges."""
    _, figures, draws = full_report
    assert len(figures) == 10 and len(draws) == len(figures), [name for name, _ in figures]
    assert_drawn_inside(figures)


def assert_drawn_inside(figures) -> None:
    """Every artist of each saved figure lies within the figure (the PNG is the figure at its own size)."""
    for name, fig in figures:
        extent = fig.get_tightbbox(fig.canvas.get_renderer())  # inches, as fig.bbox_inches
        inside = fig.bbox_inches
        assert (extent.x0 >= inside.x0 - 0.01 and extent.y0 >= inside.y0 - 0.01 and extent.x1 <= inside.x1 + 0.01
                and extent.y1 <= inside.y1 + 0.01), (name, extent.bounds, inside.bounds)


@FULL
def test_heatmap_cells_keep_the_best_time_of_each_pair(full_store):
    data = load_report_data(full_store, "testgpu")
    ln = [m for m in data.measurements if m.problem == LN]
    default = default_config(LN).kernel_1
    assert heatmap_cells(ln, "k1_block_row", "k1_num_warps") == {
        (1, 4): 10.0, (1, 8): 9.37, (2, 4): 11.0, (default.block_row, default.num_warps): 15.0}
    assert heatmap_cells(ln, "k2_block_m", "k2_block_n") == {(64, 64): 9.37, (128, 16): 15.0}


@FULL
def test_report_is_deterministic(full_store, full_report, tmp_path):
    write_report(full_store, "testgpu", tmp_path)
    assert (tmp_path / "report.md").read_text() == full_report[0][0].read_text()


@FULL
def test_report_uses_the_given_table_and_heatmap_problem(full_store, tmp_path):
    table_file = tmp_path / "testgpu.json"
    table_file.write_text(emit.dumps(emit.build_table(full_store, "testgpu")))
    write_report(full_store, "testgpu", tmp_path / "out", table_path=str(table_file), heatmap_problem=RMS.key)
    text = (tmp_path / "out" / "report.md").read_text()
    assert f"`{table_file}`: tuned on NVIDIA Test GPU" in text
    assert "| N ≤ | M ≤ | config | fitted on |" in text and "512x2048" in text
    assert f"rms_norm bf16 512×2048 on NVIDIA Test GPU (`{RMS.key}`, 4 measurements)" in text


def test_missing_validation_and_bench_are_sentences(tmp_path):
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as store:
        add_sweep(store)
        paths = write_report(store, "testgpu", tmp_path / "out")
    text = paths[0].read_text()
    assert "No validation run for this GPU" in text and "No bench run for this GPU" in text
    assert not {"validation.png", "peers_layer_norm.png"} & {p.name for p in paths}
    # No run stored its copy bandwidth: no floor is derived from another run's number or a measurement's floor.
    assert "as stored with each run: not recorded by any run (% floor is n/a)" in text
    assert_valid_pngs(paths)


def test_the_latest_validation_of_each_problem_form_is_shown(tmp_path):
    """A residual-form validation after a plain one: the report shows both, each under its own heading."""
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as store:
        add_sweep(store)
        add_validation(store)  # run 2: the plain norms
        run = store.start_run(GPU, kind="validate", command_line="validate --residual")
        residual = dataclasses.replace(RMS_HELDOUT, residual=True)
        configs = {"table": config(residual, 1, 8), "best": config(residual, 1, 4),
                   "default": default_config(residual)}
        for name, us in (("table", 12.0), ("best", 10.0), ("default", 15.0)):
            store.add_measurement(run, residual, configs[name], ok(us), source=f"validate-{name}")
        store.end_run(run)  # run 3: regret 1.2
        paths = write_report(store, "testgpu", tmp_path / "out")
    text = paths[0].read_text()
    assert "- **Held-out validation** (run 2," in text
    assert "- **Held-out validation, fused residual add** (run 3, NVIDIA Test GPU, 1 shapes): the table's regret " \
           "is 1.200" in text
    assert text.index("### The plain norms") < text.index("validation run 2 (") < \
        text.index("### The fused residual add") < text.index("validation run 3 (")
    assert {"validation_rms_norm.png", "validation_rms_norm_residual.png"} <= {p.name for p in paths}


def test_interpreter_only_database_is_labelled(tmp_path):
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as store:
        add_sweep(store, INTERPRETER)
        paths = write_report(store, "interpret", tmp_path / "out")
    text = paths[0].read_text()
    assert "Triton-interpreter timings" in text and "cpu (triton interpreter)" in text
    assert f"| 256×1024 | `{config(LN, 1, 8)}` | 9.4 |" in text
    assert "rules fitted now" in text  # build_table(interpret=True): no interpreter table is shipped


@FULL
def test_unknown_gpu_key_names_the_keys_present(full_store, tmp_path):
    with pytest.raises(ValueError, match=r"'h300'.*GPU keys present: testgpu"):
        write_report(full_store, "h300", tmp_path)
    with pytest.raises(ValueError, match="heatmap problem"):
        write_report(full_store, "testgpu", tmp_path, heatmap_problem="rms_norm/bf16/wbf16/nobias/save-input/1x1")
    with Store(f"sqlite:///{tmp_path / 'empty.db'}") as empty, pytest.raises(ValueError, match="empty"):
        write_report(empty, "testgpu", tmp_path)


@pytest.mark.skipif(not REPO_DB.is_file(), reason="no committed results.db")
def test_report_from_the_committed_results_db(tmp_path, monkeypatch):
    """The main job: read-only (no file appears beside the database), the bf16 bench run in the peers section,
    a result within the first 30 lines, and no plot axis with more than 20 problems."""
    from normtune.tuner.report import plots

    figures = []
    save = plots.Pictures.save
    monkeypatch.setattr(plots.Pictures, "save", lambda self, fig, name: figures.append((name, fig)) or
                        save(self, fig, name))
    beside = sorted(p.name for p in REPO_DB.parent.iterdir() if p.name.startswith("results.db"))
    with Store.for_reading(f"sqlite:///{REPO_DB}") as store:
        paths = write_report(store, "h100", tmp_path / "out")
    assert sorted(p.name for p in REPO_DB.parent.iterdir() if p.name.startswith("results.db")) == beside
    text = paths[0].read_text()
    head = "\n".join(text.splitlines()[:30])
    assert "normtune vs the fastest peer** (NVIDIA H100 80GB HBM3, bf16, 30 shapes" in head
    assert "## Validation on held-out shapes" in text and "NVIDIA H100 80GB HBM3, **bf16**, bench run" in text
    names = {p.name for p in paths}
    assert {"validation_rms_norm.png", "peers.png"} <= names
    # One breakdown per bf16 family: the plain one and, since the table has them, the fused residual one.
    assert {"kernels_rms_norm_bf16_wbf16_nobias_save-input.png",
            "kernels_rms_norm_bf16_wbf16_nobias_save-input_res-bf16.png"} <= names
    assert_valid_pngs(paths)
    for name, fig in figures:
        for ax in fig.axes:
            if ax.get_label() != "<colorbar>":
                assert len(ax.get_xticklabels()) <= plots.MAX_PER_AXIS, name
            low, high = sorted(ax.get_ylim())
            assert len([t for t in ax.get_yticks() if low <= t <= high]) <= 25, name
    assert_drawn_inside(figures)
    assert_tables_labelled(text, "NVIDIA H100 80GB HBM3")
    # The summary's best-vs-default figures name each family apart (the plain and the fused residual form).
    gains = next(line for line in head.splitlines() if line.startswith("- **Best measured config vs the analytic"))
    names = [part.rsplit(" ", 2)[0] for part in gains.split("geometric mean (problems): ")[1].rstrip(".").split("; ")]
    assert "layer_norm bf16 + residual add" in names and len(set(names)) == len(names), gains


def assert_tables_labelled(text: str, gpu: str) -> None:
    """Each Markdown table has, in the heading or paragraph above it, the GPU's name and a dtype."""
    lines, context = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("|") and not lines[i - 1].startswith("|"):
            above = [x for x in lines[:i] if x.strip()][-2:]  # the heading and the sentence below it, or one
            label = " ".join(above)
            assert gpu in label and re.search(r"\b(bf16|fp16|fp32)\b|each row names its dtype", label), (i, above)
            context.append(i)
    assert context, "no table in the report"


def test_stacked_kernel_bars_never_exceed_the_total():
    """The split is timed apart from the total: a split summing above the total is scaled to it, one below it
    leaves the rest as its own segment, so each stack is exactly the total."""
    from normtune.tuner.report.plots import faceted, share_panel

    totals, k1, k2 = [10.0, 10.0, 10.0], [9.0, 6.0, None], [3.0, 2.0, None]
    fig = faceted([("panel", [0])], lambda ax, subtitle, _: share_panel(
        ax, ["a", "b", "c"], totals, k1, k2, [5.0, None, None], subtitle=subtitle, unit="µs"), title="t")
    ax = fig.axes[0]
    stacks = [0.0, 0.0, 0.0]
    for container in ax.containers:
        for i, bar in enumerate(container):
            stacks[i] += bar.get_height()
    assert stacks == pytest.approx([1.0, 1.0, 1.0])  # shares of each total: the bars end at 1, never above
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"kernel_1 (dx + partials)", "kernel_2 (reduce partials)", "memory floor ÷ total",
            "rest of the total (in neither kernel's split)"} == set(labels)
    assert ax.get_ylim() == (0.0, 1.0) and [t.get_text() for t in ax.get_xticklabels()][0] == "a\n10 µs"


def test_facets_hold_at_most_twenty_problems_each():
    from normtune.tuner.report.markdown import size_facets

    problems = [Problem("rms_norm", m, n, "bf16") for n in (1024, 4096) for m in range(64, 64 + 21 * 8, 8)]
    problems += [Problem("layer_norm", 128, 2048, "fp16")]
    groups = size_facets(problems, lambda p: p)
    assert [len(items) for _, items in groups] == [14, 14, 14, 1]
    assert groups[0][0] == "rms_norm bf16 (weights bf16, no bias, saves the input), N 1024"
    assert groups[1][0] == "rms_norm bf16 (weights bf16, no bias, saves the input), N 1024–4096"
    assert groups[3][0].startswith("layer_norm fp16")


def test_cli_report_on_a_missing_database_creates_nothing(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from normtune.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["report", "--gpu", "h100", "--db", "missing.db", "--out", "out"])
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing.db" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@FULL
def test_cli_report_names_a_broken_table(full_store, tmp_path):
    from typer.testing import CliRunner

    from normtune.cli import app

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = CliRunner().invoke(app, ["report", "--gpu", "testgpu", "--db", full_store.url, "--table", str(broken),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and f"heuristic table {broken}" in result.stderr and "Traceback" not in result.output


def test_family_titles_name_what_sets_a_family_apart():
    from normtune.tuner.report.markdown import family_title

    assert family_title(LN.family) == "layer_norm bf16 (weights bf16, with bias, saves the input)"
    residual = dataclasses.replace(RMS, residual=True, residual_dtype="fp32").family
    assert family_title(residual) == ("rms_norm bf16 (weights bf16, no bias, fused residual add, fp32 stream, "
                                      "saves the input)")



@FULL
def test_heatmaps_name_the_gpu(full_report):
    _, figures, _ = full_report
    heatmaps = [(name, fig) for name, fig in figures if name.startswith("heatmap_")]
    assert len(heatmaps) == 3
    for name, fig in heatmaps:
        title = " ".join(fig.axes[0].get_title().split())
        assert "NVIDIA Test GPU" in title and "layer_norm 300×1536 bf16" in title, (name, title)


def test_a_split_above_its_total_and_a_floor_above_100_are_marked_and_explained(tmp_path):
    """kernel_1 comes from another series of repetitions than the total, and the floor is an estimate at the run's
    copy bandwidth: both can be passed. The rows say so (†, ‡), the notes name the rows beyond noise, and the
    breakdown plot keeps a floor tick above 1.0 in view."""
    store = Store(f"sqlite:///{tmp_path / 'marks.db'}")
    run = store.start_run(GPU, kind="sweep", command_line="normtune sweep", copy_bandwidth_gbps=100.0)
    # LN 256x1024 bf16: floor 3 * 256 * 1024 * 2 B at 100 GB/s = 15.73 µs; the best takes 15.0 -> 104.9 %, and its
    # kernel_1 (15.2) is 1.3 % above it: noise. RMS 512x2048: floor 62.9 µs, best 70.0 (89.9 %), kernel_1 150.0:
    # 2.1 times the total, beyond noise.
    for problem, median, k1 in ((LN, 15.0, 15.2), (RMS, 70.0, 150.0)):
        store.add_measurement(run, problem, config(problem, 1, 8),
                              MeasureResult(status="ok", median_us=median, reps=20, kernel_1_us=k1, kernel_2_us=0.0),
                              source="sweep")
    store.end_run(run)
    figures = []
    from normtune.tuner.report import plots

    save = plots.Pictures.save
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plots.Pictures, "save", lambda self, fig, name: figures.append((name, fig)) or
                      save(self, fig, name))
        text = write_report(store, "testgpu", tmp_path / "out")[0].read_text()
    store.close()
    assert f"| 256×1024 | `{config(LN, 1, 8)}` | 15.0 | 15.2† | 0.0 |" in text and "| 105‡ |" in text
    assert f"| 512×2048 | `{config(RMS, 1, 8)}` | 70.0 | 150.0† | 0.0 |" in text and "| 90 |" in text
    notes = " ".join(line for line in text.splitlines() if line.startswith(("† ", "‡ ")))
    assert "† kernel_1 above the total (2 problems)" in notes
    assert "Far beyond it" in notes and "rms_norm bf16 512×2048, kernel_1 150.0 µs against 70.0 µs (run 1)" in notes
    assert "layer_norm bf16 256×1024, kernel_1" not in notes  # within noise: marked, not listed
    assert "‡ % floor above 100 (1 problem: layer_norm bf16 256×1024 104.9 % (run 1))" in notes
    assert "not a bound" in notes
    breakdown = dict(figures)["kernels_layer_norm_bf16.png"]
    assert breakdown.axes[0].get_ylim()[1] >= 15.73 / 15.0


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_committed_reports_mark_and_explain_what_passes_a_bound(gpu):
    """docs/report-<gpu>/report.md, rendered from results.db: every kernel_1 above its total carries †, every %
    floor above 100 carries ‡, and the notes below the tables explain each mark used."""
    text = (Path(__file__).resolve().parents[1] / "docs" / f"report-{gpu}" / "report.md").read_text()
    header, daggers, double = None, 0, 0
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| M×N | best config |"):
            header = cells
        elif header and line.startswith("|") and not line.startswith("|---"):
            row = dict(zip(header, cells))
            total, k1, floor = row["µs"], row["kernel_1 µs"], row["% floor"]
            if re.fullmatch(r"[\d.]+", total) and re.match(r"[\d.]+", k1):
                above = float(k1.rstrip("†")) > float(total)
                assert not above or k1.endswith("†"), (gpu, row["M×N"], k1, total)
                daggers += k1.endswith("†")
            if re.match(r"\d", floor):
                assert float(floor.rstrip("‡")) <= 100 or floor.endswith("‡"), (gpu, row["M×N"], floor)
                double += floor.endswith("‡")
        elif not line.startswith("|"):
            header = None
    assert (daggers > 0) == ("\n† kernel_1 above the total" in text)
    assert (double > 0) == ("\n‡ % floor above 100" in text)
