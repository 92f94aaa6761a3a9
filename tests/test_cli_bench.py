"""`normtune bench` end to end through typer's CliRunner in `--interpret` mode (CPU, Triton interpreter), its
one-line error paths, and the `--shapes` parser of `normtune.tuner.shapes`."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import MAX_N
from normtune.kernels.device import interpret_mode
from normtune.tuner.measure import bench_output
from normtune.tuner.measure.bench import OURS
from normtune.tuner.measure.peers import PEERS
from normtune.tuner.shapes import HELDOUT, PRESETS, SEED, TINY, parse_shape, parse_shapes
from normtune.tuner.store.database import Store

runner = CliRunner()
# `--interpret` must be in effect before the kernels are first imported: on a GPU host (no TRITON_INTERPRET) the
# kernels are already compiled for the GPU in this process, and the CLI refuses --interpret.
needs_interpreter = pytest.mark.skipif(not interpret_mode(), reason="the CLI tests run `--interpret`: set "
                                                                    "TRITON_INTERPRET=1")

SHAPES = "24x200,8x96"


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def error_lines(result) -> list[str]:
    text = result.stderr if result.stderr is not None else result.output
    return [line for line in text.splitlines() if line.strip()]


def assert_one_line_error(result, *needles: str) -> str:
    """Exit code 1, exactly one non-empty output line, 'error: …' naming every needle, no traceback."""
    assert result.exit_code == 1, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    lines = error_lines(result)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def read_csv(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


# ---------------------------------------------------------------------------------------------- happy paths


# The tests of `torch_bench` run on one xdist worker (`--dist loadgroup`), which benches once.
TORCH_BENCH = pytest.mark.xdist_group("cli-bench-torch")


@pytest.fixture(scope="module")
def torch_bench(tmp_path_factory):
    """One interpreter bench of two shapes x both norms against torch eager, stored in a database too."""
    if not interpret_mode():
        pytest.skip("the CLI tests run `--interpret`: set TRITON_INTERPRET=1")
    tmp = tmp_path_factory.mktemp("bench")
    out, db = tmp / "out", f"sqlite:///{tmp / 'bench.db'}"
    result = invoke("bench", "--interpret", "--shapes", SHAPES, "--peers", "torch", "--out", out, "--db", db)
    return result, out, db


@TORCH_BENCH
def test_bench_writes_every_output(torch_bench):
    result, out, _ = torch_bench
    assert result.exit_code == 0, result.output
    for name in ("bench.csv", "bench.json", "bench.md", "bench_layer_norm.png", "bench_rms_norm.png",
                 "kernels_layer_norm.png", "kernels_rms_norm.png"):
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
        if name.endswith(".png"):
            assert path.read_bytes()[:4] == b"\x89PNG"


@TORCH_BENCH
def test_bench_csv_rows(torch_bench):
    _, out, _ = torch_bench
    columns, rows = read_csv(out / "bench.csv")
    assert tuple(columns) == bench_output.CSV_COLUMNS
    shapes = {(24, 200), (8, 96)}
    assert {(r["norm"], int(r["M"]), int(r["N"]), r["impl"]) for r in rows} == \
        {(n, M, N, impl) for n in ("layer_norm", "rms_norm") for M, N in shapes for impl in (OURS, "torch")}
    assert len(rows) == 8
    for r in rows:
        assert r["status"] == "ok", r
        assert r["dtype"] == "bf16" and r["weight_dtype"] == "bf16"
        median = float(r["median_us"])
        assert math.isfinite(median) and median > 0
        assert float(r["p10_us"]) <= median <= float(r["p90_us"])
        assert float(r["rel_err_dx"]) < 3e-2  # both compute the right gradient
        if r["impl"] == OURS:
            assert float(r["kernel_1_us"]) > 0 and float(r["kernel_2_us"]) > 0
            assert r["config_source"] == "table"
            assert set(json.loads(r["config"])) == {"kernel_1", "kernel_2"}


@TORCH_BENCH
def test_bench_json_provenance(torch_bench):
    _, out, _ = torch_bench
    data = json.loads((out / "bench.json").read_text())
    prov = data["provenance"]
    assert prov["interpret"] is True
    assert prov["device"]["name"] == "cpu (triton interpreter)" and prov["device"]["interpret"] is True
    assert {"torch", "triton", "normtune", "sm_count"} <= set(prov["device"])
    assert set(prov["peers"]) >= {"liger_kernel", "quack"}
    assert prov["timing"]["min_reps"] >= 1 and prov["timing"]["max_reps"] >= prov["timing"]["min_reps"]
    assert prov["dtype"] == "bf16" and prov["config"] == "table"
    assert prov["flush_bytes"] == 0  # nothing to flush on CPU
    assert len(data["rows"]) == 8 and len(data["summary"]) == 4
    md = (out / "bench.md").read_text()
    assert "Triton interpreter on CPU" in md and "| 24×200 |" in md and "| 8×96 |" in md


@TORCH_BENCH
def test_bench_is_stored_in_the_database(torch_bench):
    _, _, db = torch_bench
    store = Store(db)
    try:
        runs = store.runs(kind="bench")
        assert len(runs) == 1 and runs[0].interpret and runs[0].status == "finished"
        peers = store.peer_results(run_id=runs[0].id)
        assert sorted((p.problem.norm, p.problem.M, p.problem.N) for p in peers) == \
            sorted((n, M, N) for n in ("layer_norm", "rms_norm") for M, N in ((24, 200), (8, 96)))
        assert {p.peer for p in peers} == {"torch"} and all(p.status == "ok" and p.median_us > 0 for p in peers)
        ours = store.measurements(run_id=runs[0].id)
        assert len(ours) == 4
        assert all(m.source.startswith("bench-") and m.status == "ok" and m.median_us > 0 and m.interpret
                   for m in ours)
        assert {m.problem.has_bias for m in ours if m.problem.norm == "layer_norm"} == {True}
    finally:
        store.close()


@needs_interpreter
def test_bench_all_peers_in_the_interpreter(tmp_path):
    result = invoke("bench", "--interpret", "--norm", "rms_norm", "--shapes", "5x33", "--peers", "all", "--out",
                    tmp_path, "--config", "default")
    assert result.exit_code == 0, result.output
    _, rows = read_csv(tmp_path / "bench.csv")
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == {OURS, *PEERS}
    assert by_impl[OURS]["status"] == "ok" and by_impl[OURS]["config_source"] == "default"
    assert by_impl["torch"]["status"] == "ok"
    for peer in ("compile", "liger", "quack"):
        assert by_impl[peer]["status"] == "unavailable", by_impl[peer]
        assert by_impl[peer]["error"] and by_impl[peer]["median_us"] == ""


@needs_interpreter
def test_bench_explicit_config(tmp_path):
    config = ('{"kernel_1": {"block_row": 2, "block_col": 64, "num_warps": 1, "programs_per_sm": 1}, '
              '"kernel_2": {"block_m": 32, "block_n": 16, "num_warps": 1}}')
    result = invoke("bench", "--interpret", "--norm", "layer_norm", "--shapes", "7x50", "--peers", "none",
                    "--out", tmp_path, "--config", config)
    assert result.exit_code == 0, result.output
    _, rows = read_csv(tmp_path / "bench.csv")
    assert [r["impl"] for r in rows] == [OURS]
    assert rows[0]["status"] == "ok" and rows[0]["config_source"] == "explicit"
    cfg = json.loads(rows[0]["config"])
    assert cfg["kernel_1"]["block_row"] == 2 and cfg["kernel_2"]["block_m"] == 32


# ------------------------------------------------------------------------------------------------ error paths


@needs_interpreter
@pytest.mark.parametrize("shapes, needles", [
    ("4096x", ["bad shape", "'4096x'"]),
    ("axb", ["bad shape", "'axb'", "integers"]),
    ("0x0", ["bad shape", "'0x0'", "N >= 1"]),
    ("0x64", ["bad shape", "'0x64'", "M >= 1"]),
    ("16x1,8x-3", ["bad shape", "'8x-3'"]),
    (f"4x{MAX_N * 2}", ["bad shape", str(MAX_N)]),
    ("everything", ["neither a preset", "seed"]),
])
def test_bad_shapes(tmp_path, shapes, needles):
    assert_one_line_error(invoke("bench", "--interpret", "--shapes", shapes, "--out", tmp_path), *needles)
    assert not (tmp_path / "bench.csv").exists()
    assert_one_line_error(invoke("bench", "--residual", "--interpret", "--shapes", shapes, "--out", tmp_path),
                          *needles)
    assert not list(tmp_path.iterdir())


@needs_interpreter
def test_a_negative_device_is_one_line(tmp_path):
    assert_one_line_error(invoke("bench", "--interpret", "--shapes", "8x64", "--device", "-3", "--out", tmp_path),
                          "--device -3", "0 or more")
    assert not list(tmp_path.iterdir())


@needs_interpreter
@pytest.mark.parametrize("peers, needles", [("foo", ["unknown peer(s) foo", "allowed", "torch", "quack"]),
                                            ("torch,bar,baz", ["bar, baz"])])
def test_unknown_peers(tmp_path, peers, needles):
    assert_one_line_error(invoke("bench", "--interpret", "--shapes", "8x96", "--peers", peers, "--out", tmp_path),
                          *needles)


@needs_interpreter
@pytest.mark.parametrize("norm", ["group_norm", "layer_norm,foo", ""])
def test_unknown_norm(tmp_path, norm):
    assert_one_line_error(invoke("bench", "--interpret", "--shapes", "8x96", "--norm", norm, "--out", tmp_path),
                          "--norm", "layer_norm, rms_norm")


@needs_interpreter
def test_unknown_dtype(tmp_path):
    assert_one_line_error(invoke("bench", "--interpret", "--shapes", "8x96", "--dtype", "int8", "--out", tmp_path),
                          "int8", "bf16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a CUDA GPU")
def test_gpu_without_a_gpu(tmp_path):
    line = assert_one_line_error(invoke("bench", "--gpu", "h100", "--shapes", "8x96", "--out", tmp_path), "--interpret")
    assert "GPU" in line
    assert not (tmp_path / "bench.csv").exists()


@needs_interpreter
@pytest.mark.parametrize("config, needles", [
    ("{bad", ["not valid JSON"]),
    ('{"kernel_1": {"block_size": 4}}', ["unknown", "block_size", "block_row"]),
    ('{"kernel_1": {"block_col": 32}}', ["block_col=32", "N=96"]),  # single pass narrower than the row
])
def test_bad_config(tmp_path, config, needles):
    result = invoke("bench", "--interpret", "--shapes", "8x96", "--peers", "none", "--config", config,
                    "--out", tmp_path)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in error_lines(result) if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    for needle in needles:
        assert needle in errors[0]


@needs_interpreter
def test_config_file_that_does_not_exist_is_no_such_file(tmp_path):
    missing = tmp_path / "nosuchfile.json"
    line = assert_one_line_error(invoke("bench", "--interpret", "--shapes", "8x96", "--peers", "none", "--config",
                                        missing, "--out", tmp_path / "out"), "--config", str(missing), "no such file")
    assert "JSON" not in line.split("no such file")[0]
    assert not (tmp_path / "out").exists()  # refused before anything else


@needs_interpreter
def test_config_from_a_json_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text('{"kernel_1": {"block_row": 2, "block_col": 128, "num_warps": 1, "programs_per_sm": 1}, '
                    '"kernel_2": {"block_m": 16, "block_n": 32, "num_warps": 1}}')
    result = invoke("bench", "--interpret", "--norm", "rms_norm", "--shapes", "6x70", "--peers", "none", "--config",
                    path, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    _, rows = read_csv(tmp_path / "out" / "bench.csv")
    assert rows[0]["config_source"] == "explicit" and json.loads(rows[0]["config"])["kernel_2"]["block_n"] == 32


# --------------------------------------------------------------------- bench: fail before measuring, store first


def _no_measuring(monkeypatch):
    """Make any measurement fail the test: the error paths below must stop before measuring."""
    from normtune.tuner.measure import bench as bench_module

    def refuse(*args, **kwargs):
        raise AssertionError("measured although the command should have failed first")

    monkeypatch.setattr(bench_module, "run_bench", refuse)


@needs_interpreter
def test_unwritable_out_fails_before_measuring(tmp_path, monkeypatch):
    _no_measuring(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert_one_line_error(invoke("bench", "--interpret", "--shapes", "8x96", "--peers", "none", "--out",
                                 blocker / "out"), "--out", str(blocker / "out"), "cannot write")


@needs_interpreter
@pytest.mark.parametrize("budget", ["-1", "0", "nan", "inf"])
def test_bad_budget_is_refused(tmp_path, monkeypatch, budget):
    _no_measuring(monkeypatch)
    assert_one_line_error(invoke("bench", "--interpret", "--shapes", "8x96", "--budget", budget, "--out", tmp_path),
                          "--budget", "positive number of seconds")


@needs_interpreter
def test_unusable_database_fails_before_measuring(tmp_path, monkeypatch):
    _no_measuring(monkeypatch)
    url = f"sqlite:///{tmp_path / 'no-such-folder' / 'x.db'}"
    line = assert_one_line_error(invoke("bench", "--interpret", "--shapes", "8x96", "--peers", "none", "--out",
                                        tmp_path / "out", "--db", url))
    assert "x.db" in line


@needs_interpreter
def test_store_error_is_one_line(tmp_path, monkeypatch):
    from normtune.tuner.store import database as store_module

    def broken(url, *args, **kwargs):
        raise store_module.StoreError(f"unknown database scheme in {url!r}: use sqlite:/// or postgresql://")

    monkeypatch.setattr(store_module, "Store", broken)
    _no_measuring(monkeypatch)
    assert_one_line_error(invoke("bench", "--interpret", "--shapes", "8x96", "--out", tmp_path, "--db", "foo://bar"),
                          "foo://bar", "unknown database scheme")


@needs_interpreter
def test_results_are_stored_before_files_are_written(tmp_path, monkeypatch):
    def cannot_write(report, out_dir):
        raise PermissionError(13, "Permission denied", str(out_dir))

    monkeypatch.setattr(bench_output, "write_all", cannot_write)
    db = f"sqlite:///{tmp_path / 'bench.db'}"
    result = invoke("bench", "--interpret", "--norm", "rms_norm", "--shapes", "8x96", "--peers", "none", "--out",
                    tmp_path / "out", "--db", db)
    assert result.exit_code == 1, result.output
    errors = [line for line in error_lines(result) if line.startswith("error: ")]
    assert len(errors) == 1 and "Permission denied" in errors[0] and "stored as run" in errors[0], result.output
    assert "Traceback" not in result.output
    store = Store(db)
    try:
        (run,) = store.runs(kind="bench")
        assert [m.status for m in store.measurements(run_id=run.id)] == ["ok"]
    finally:
        store.close()


@needs_interpreter
def test_a_bench_stopped_part_way_keeps_the_shapes_it_finished(tmp_path, monkeypatch):
    """bench.csv, bench.json and bench.md are written after every shape, each replaced whole: stopped during the
    second shape, they hold the first one's rows ("finished" null in the provenance); the plots come at the end."""
    from normtune.tuner.measure import bench as B

    real = B.problem_for

    def stopped_at_the_second(norm, M, N, *args):
        if M == 9:
            raise KeyboardInterrupt
        return real(norm, M, N, *args)

    monkeypatch.setattr(B, "problem_for", stopped_at_the_second)
    out = tmp_path / "out"
    result = invoke("bench", "--interpret", "--norm", "rms_norm", "--shapes", "8x96,9x96", "--peers", "torch",
                    "--out", out)
    assert result.exit_code != 0
    data = json.loads((out / "bench.json").read_text())
    assert data["provenance"]["finished"] is None
    assert [(r["impl"], r["M"]) for r in data["rows"]] == [(OURS, 8), ("torch", 8)]
    with open(out / "bench.csv", newline="") as fh:
        assert [(r["impl"], r["M"]) for r in csv.DictReader(fh)] == [(OURS, "8"), ("torch", "8")]
    assert (out / "bench.md").exists() and not list(out.glob("*.png")) and not list(out.glob(".*"))


@needs_interpreter
def test_a_stored_bench_run_spans_the_bench(tmp_path, monkeypatch):
    """The run row of a bench starts when the bench began (not when its results were stored) and ends after its
    last measurement was stored."""
    import datetime as dt

    from normtune.tuner.measure import bench as B

    window = {}
    run_bench = B.run_bench

    def timed(*args, **kwargs):
        window["start"] = dt.datetime.now(dt.timezone.utc)
        report = run_bench(*args, **kwargs)
        window["end"] = dt.datetime.now(dt.timezone.utc)
        return report

    monkeypatch.setattr(B, "run_bench", timed)
    db = f"sqlite:///{tmp_path / 'bench.db'}"
    result = invoke("bench", "--interpret", "--norm", "rms_norm", "--shapes", "8x96", "--peers", "torch", "--out",
                    tmp_path / "out", "--db", db)
    assert result.exit_code == 0, result.output
    with Store(db, read_only=True) as store:
        (run,) = store.runs(kind="bench")
        stored = [m.created_at for m in store.measurements(run_id=run.id)]
        stored += [p.created_at for p in store.peer_results(run_id=run.id)]
    assert window["start"] <= run.started_at < window["end"], (window, run.started_at)
    assert run.status == "finished" and run.ended_at >= max(stored) >= window["end"]


# ------------------------------------------------------------------------------------------ CLI global options


def test_version_prints_the_version():
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"normtune {version('normtune')}"


@pytest.mark.parametrize("command", [[], ["bench"], ["sweep"], ["emit"], ["validate"], ["report"]])
def test_help_keeps_written_defaults_and_has_no_bool_placeholder(command):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the help is wrapped to the terminal's width
    assert "<bool>" not in text and "BOOLEAN" not in text
    if command == ["bench"]:
        assert "[default: seed on a GPU, tiny with --interpret]" in text  # written in the help text
        assert "[default: the activation dtype]" in text
        assert "--cold / --warm" in text and "[default: cold]" in text  # typer's own default
        assert "[default: 0.5]" in text


@needs_interpreter
@pytest.mark.parametrize("command", ["bench", "sweep", "validate", "emit"])
def test_gpu_with_interpret_is_an_error(tmp_path, command):
    assert_one_line_error(invoke(command, "--gpu", "h100", "--interpret", "--db", f"sqlite:///{tmp_path / 'x.db'}"),
                          "--gpu h100", "--interpret")
    assert not (tmp_path / "x.db").exists()


@pytest.mark.parametrize("command", ["emit", "bench"])
def test_gpu_interpret_without_interpret_names_the_flag(tmp_path, command):
    line = assert_one_line_error(invoke(command, "--gpu", "interpret", "--db", f"sqlite:///{tmp_path / 'x.db'}"),
                                 "--gpu interpret", "add --interpret")
    assert "no measurements" not in line


@needs_interpreter
@pytest.mark.parametrize("shapes", ["everything", "4096x", "seeds"])
def test_shapes_errors_name_the_option_once(tmp_path, shapes):
    line = assert_one_line_error(invoke("bench", "--interpret", "--shapes", shapes, "--out", tmp_path), "--shapes")
    assert line.count("--shapes") == 1, line


# ------------------------------------------------------------------------------------------- three views


@needs_interpreter
@TORCH_BENCH
def test_bench_reports_the_three_views(torch_bench):
    _, out, _ = torch_bench
    _, rows = read_csv(out / "bench.csv")
    for r in rows:
        # host µs per backward and per forward call, for every implementation
        assert float(r["host_us"]) > 0 and float(r["forward_host_us"]) > 0, r
        assert r["kernel_sum_us"] == ""  # no profiler kernels in the interpreter: no made-up figure
        assert r["pdl"] in ("False", "")
    data = json.loads((out / "bench.json").read_text())
    assert {"host_us", "forward_host_us", "kernel_sum_speedup", "normtune_kernel_sum_us"} <= set(data["summary"][0])
    assert data["provenance"]["timing"]["host_calls"] >= 1
    md = (out / "bench.md").read_text()
    # An interpreter bench names its times for what they are, never GPU time (outside the note defining views).
    assert "GPU time" not in md.split("only once.")[-1]
    for needle in ("interpreter wall-clock on CPU (no GPU) (µs, lower is better)", "Kernel sum (µs, torch.profiler)",
                   "Host µs per call (backward / forward)", "counts the time both kernels run at once only once"):
        assert needle in md, needle
    # normtune's calls without autograd are timed too, and shown beside its autograd calls
    ours = [r for r in rows if r["impl"] == "normtune"]
    assert ours and all(float(r["host_direct_us"]) > 0 and float(r["forward_host_direct_us"]) > 0 for r in ours)
    assert all(r["autograd"] == "True" for r in rows if r["impl"] != "normtune")
    assert "(direct " in md


def _host_row(impl, norm, host, forward, *, direct=None, autograd=True):
    return {"impl": impl, "norm": norm, "M": 8, "N": 64, "status": "ok", "host_us": host, "forward_host_us": forward,
            "host_direct_us": direct[0] if direct else None,
            "forward_host_direct_us": direct[1] if direct else None, "autograd": autograd}


def test_host_target_sets_like_beside_like():
    from normtune.tuner.measure.bench_output import host_target_line

    rows = [  # LayerNorm: quack without autograd, so normtune's direct calls (50 / 20) face it; Liger its autograd
        _host_row("normtune", "layer_norm", 200.0, 60.0, direct=(50.0, 20.0)),
        _host_row("quack", "layer_norm", 70.0, 25.0, autograd=False),
        _host_row("liger", "layer_norm", 300.0, 50.0),
        # RMSNorm: both peers with autograd; normtune's backward is slower than quack's, its forward is not
        _host_row("normtune", "rms_norm", 250.0, 40.0, direct=(30.0, 10.0)),
        _host_row("quack", "rms_norm", 240.0, 45.0),
        _host_row("liger", "rms_norm", 400.0, 90.0),
        _host_row("torch", "rms_norm", 1.0, 1.0),  # not a host-target peer
    ]
    line = host_target_line(rows)
    assert "backward 1/2, forward 1/2" in line and "liger and quack" in line
    assert host_target_line([r for r in rows if r["impl"] in ("normtune", "torch")]) == ""


# --------------------------------------------------------------------------------------------- shapes parser


def test_presets():
    assert parse_shapes("seed") == list(SEED) and len(SEED) == 15
    assert all(M * N in (2**25, 2**24, 2**23) for M, N in SEED)
    assert parse_shapes("  tiny ") == list(TINY)
    assert parse_shapes("heldout") == list(HELDOUT)
    assert set(PRESETS) == {"seed", "llm", "few", "span", "heldout", "tiny"}
    assert len(parse_shapes("llm")) == len(set(parse_shapes("llm")))
    assert not set(HELDOUT) & (set(SEED) | set(parse_shapes("llm")))  # held-out shapes are never swept
    llm = parse_shapes("llm")
    assert any(M <= 64 for M, _ in llm) and {32768, 65536} <= {N for _, N in llm}  # few rows, very wide rows


def test_explicit_lists():
    assert parse_shapes("4096x8192") == [(4096, 8192)]
    assert parse_shapes("4096x8192, 2048X4096,,1×1") == [(4096, 8192), (2048, 4096), (1, 1)]
    assert parse_shapes(f"1x{MAX_N}") == [(1, MAX_N)]
    assert parse_shape(" 7 x 9 ") == (7, 9)


def test_shape_file(tmp_path):
    path = tmp_path / "shapes.txt"
    path.write_text("# wide rows\n512x16384   # LayerNorm 16k\n\n  1000x3584, 257x14336\n4093x1536 7x9\n# end\n")
    assert parse_shapes(str(path)) == [(512, 16384), (1000, 3584), (257, 14336), (4093, 1536), (7, 9)]


def test_shape_file_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("512x16384\n# fine\n12x\n")
    with pytest.raises(ValueError, match=r"bad\.txt:3: bad shape '12x'"):
        parse_shapes(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    with pytest.raises(ValueError, match="lists no shapes"):
        parse_shapes(str(empty))


@pytest.mark.parametrize("spec, match", [
    ("", "no shapes given"), ("   ", "no shapes given"), ("seeds", "neither a preset"), ("4096x8192x2", "write MxN"),
    ("1.5x8", "integers"), ("-1x8", "M >= 1"), ("0x8", "M >= 1"), ("99999999999999999999x8", "M exceeds"), ("8x0", "N >= 1"), (f"8x{MAX_N + 1}", "maximum"),
])
def test_shape_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_shapes(spec)


def test_command_line_has_no_machine_paths(tmp_path, monkeypatch):
    import os

    from normtune.tuner.gpu_info import command_line

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/someone")
    line = command_line(["/opt/env/bin/normtune", "bench", "--out", str(tmp_path / "bench"), "--db",
                         f"sqlite:///{tmp_path / 'r.db'}", "--config", "/home/someone/cfg.json"])
    assert line == f"normtune bench --out bench --db sqlite:///r.db --config ~{os.sep}cfg.json"


def test_a_disturbed_timing_is_taken_again_and_the_steadier_kept():
    """A timing whose p90 is past DISTURBED_SPREAD times its p10 is re-taken once, for every implementation
    alike, and the one with the smaller spread is kept with a note (not the faster: that would favour noise)."""
    from normtune.tuner.measure.bench import DISTURBED_SPREAD, spread, steadier

    calls = []

    def timings(*values):
        it = iter(values)

        def measure():
            calls.append(1)
            return next(it)
        return measure

    by_spread = lambda t: spread(*t)  # noqa: E731 - (p10, p90) pairs
    calls.clear()
    kept, note = steadier(timings((45.0, 47.0), (10.0, 99.0)), by_spread)
    assert kept == (45.0, 47.0) and note == "" and len(calls) == 1, "a steady timing is taken once"
    calls.clear()
    kept, note = steadier(timings((45.6, 411.6), (46.0, 48.0)), by_spread)
    assert kept == (46.0, 48.0) and len(calls) == 2 and "re-timed" in note and "9.03" in note
    kept, note = steadier(timings((40.0, 80.0), (20.0, 200.0)), by_spread)
    assert kept == (40.0, 80.0) and "re-timed" in note, "the steadier is kept even when the other is faster"
    assert spread(None, 5.0) == 1.0 and spread(45.6, 411.6) > DISTURBED_SPREAD
    calls.clear()
    kept, note = steadier(timings((1.0, 9.0)), by_spread, retake=False)
    assert kept == (1.0, 9.0) and note == "" and len(calls) == 1, "the interpreter's timings are not re-taken"
