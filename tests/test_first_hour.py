"""What a new user meets in the first hour: the CLI without the [tune] extra, `where` without --shape, the end of a
redirected sweep, `compare --help`, interpreter bench labels, an interpreter table emitted outside the repository,
the toolchain versions DEVELOPERS.md states, and the pandas snippet of docs/results-db.md."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import sqlite3
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_report import INTERPRETER, LN, add_sweep
from typer.testing import CliRunner

from normtune.cli import app
from normtune.tuner.store.database import Store

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_cli_without_the_tune_extra_names_it_in_one_line(tmp_path):
    # typer stands for any missing dependency of the [tune] extra (a plain `pip install normtune`).
    out = _python("import sys; sys.modules['typer'] = None\nfrom normtune.cli import app", tmp_path)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "normtune[tune]"' in lines[0] and "typer" in lines[0], out.stderr


def test_where_without_shape_fails_before_importing_torch(tmp_path):
    code = ("import sys\nfrom normtune.cli import app\ntry:\n    app(['where', '--gpu', 'h100'])\n"
            "except SystemExit as exit:\n    print('torch imported:', 'torch' in sys.modules)\n    sys.exit(exit.code)")
    out = _python(code, tmp_path)
    assert out.returncode == 1 and "--shape" in out.stderr, out.stderr
    assert out.stdout.strip() == "torch imported: False"


def test_a_redirected_live_view_ends_its_last_line(tmp_path):
    from rich.console import Console

    from normtune.tuner.sweep.progress import LiveView

    url = f"sqlite:///{tmp_path / 'results.db'}"
    Store(url).close()
    buffer = io.StringIO()
    console = Console(file=buffer, width=100)
    assert not console.is_terminal
    with LiveView(console, url, {}):
        pass
    console.print("sweep: 13 s wall")
    assert "\nsweep: 13 s wall\n" in buffer.getvalue(), repr(buffer.getvalue())


def test_compare_help_shows_one_default_per_option():
    result = CliRunner().invoke(app, ["compare", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0, result.output
    for option in ("--norm", "--dtype"):
        # The option's help: its line and the continuation lines up to the next option.
        block = re.search(rf"^\s+{option} .*?(?=^\s+--)", result.output, re.M | re.S).group(0)
        assert block.count("[default") == 1, block


def _interpreter_bench_report():
    from normtune.tuner.measure.bench import OURS, BenchReport
    from normtune.tuner.gpu_info import detect

    provenance = {"device": detect(interpret=True).to_dict(), "peers": {"liger_kernel": None, "quack": None},
                  "tools": {"optuna": "4.1", "sqlalchemy": "2.0"}, "copy_bandwidth_gbps": None, "cold_l2": False,
                  "flush_bytes": 0, "dtype": "bf16", "weight_dtype": "bf16", "config": "table",
                  "timing": {"min_reps": 3}, "interpret": True, "peer_descriptions": {}}
    rows = [{"norm": "rms_norm", "M": 64, "N": 256, "impl": impl, "status": "ok", "median_us": us, "floor_us": None,
             "kernel_1_us": None, "kernel_2_us": None, "floor_fraction": None, "note": ""}
            for impl, us in ((OURS, 900.0), ("torch", 1200.0))]
    return BenchReport(provenance, rows)


def test_interpreter_bench_output_never_says_gpu_time_and_lists_no_tools_as_peers():
    from normtune.tuner.measure import bench_output

    report = _interpreter_bench_report()
    footer = bench_output.summary_footer(report)
    markdown = bench_output.markdown(report)
    assert "GPU time" not in footer and "interpreter wall-clock" in footer
    body = markdown.split(bench_output.VIEWS_NOTE)[1]  # the note defines the views; the tables name theirs
    assert "GPU time" not in body and "interpreter wall-clock" in body
    peers_line = next(line for line in markdown.splitlines() if "peers:" in line)
    assert "optuna" not in peers_line.split("; tuner:")[0] and "peers: none installed" in peers_line
    from normtune.tuner.gpu_info import peer_versions

    assert set(peer_versions()) == {"liger_kernel", "quack"}


def test_report_finds_the_interpreter_table_emit_wrote_outside_the_repository(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with Store(url) as store:
        add_sweep(store, INTERPRETER)
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    emitted = CliRunner().invoke(app, ["emit", "--gpu", "interpret", "--interpret", "--db", url])
    assert emitted.exit_code == 0, emitted.output
    assert (work / "configs" / "interpret.json").is_file()
    reported = CliRunner().invoke(app, ["report", "--gpu", "interpret", "--db", url, "--out", "report"])
    assert reported.exit_code == 0, reported.output
    text = (work / "report" / "report.md").read_text()
    assert "`configs/interpret.json` (in this folder, where `emit` writes by default)" in text
    assert "rules fitted now" not in text


def test_developers_md_states_the_triton_versions_pyproject_and_the_interpreter_need():
    from normtune.commands.common import CLIError, INTERPRET_MIN_TRITON, check_interpreter_triton

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (triton_req,) = [d for d in deps if d.startswith("triton")]
    low = re.search(r">=\s*([\d.]+)", triton_req).group(1)
    need = ".".join(map(str, INTERPRET_MIN_TRITON))
    developers = " ".join((ROOT / "DEVELOPERS.md").read_text().split())
    assert f"Triton {low} or later" in developers, f"DEVELOPERS.md must say what pyproject.toml accepts ({low})"
    assert f"`--interpret` needs Triton {need} or later" in developers
    with pytest.raises(CLIError, match=rf"--interpret needs Triton >= {need} \(installed: 3.6.0\)"):
        check_interpreter_triton("3.6.0")
    check_interpreter_triton(f"{need}.0")


def test_the_pandas_snippet_keeps_one_best_row_per_problem_and_dtype(tmp_path):
    pd = pytest.importorskip("pandas")
    from test_report import config, ok

    from normtune.tuner.gpu_info import DeviceInfo

    gpu = dataclasses.replace(INTERPRETER, key="h100", name="NVIDIA H100", interpret=False)
    assert isinstance(gpu, DeviceInfo)
    db = tmp_path / "results.db"
    with Store(f"sqlite:///{db}") as store:
        run = store.start_run(gpu, kind="sweep", command_line="sweep")
        fp16 = dataclasses.replace(LN, dtype="fp16", weight_dtype="fp16")
        store.add_measurement(run, LN, config(LN), ok(12.0), source="sweep")
        store.add_measurement(run, fp16, config(fp16), ok(10.0), source="sweep")  # faster, another dtype
        store.end_run(run)
    doc = (ROOT / "docs" / "results-db.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", doc, re.S).group(1).replace('"file:results.db', f'"file:{db}')
    scope = {}
    exec(compile(snippet, "docs/results-db.md", "exec"), scope)  # noqa: S102 - the documented snippet itself
    best = scope["best"]
    assert isinstance(best, pd.DataFrame)
    assert sorted(best["dtype"]) == ["bf16", "fp16"], best
