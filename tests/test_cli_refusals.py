"""Input a command used to accept silently, or to fail on only after its work: each is now one `error:` line and
exit code 1 before anything is measured or stored."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.tuner.store.database import Store
from test_store import H100, RMS, ok

from normtune.kernels.config import default_config


def _one_error(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def _sweep(tmp_path, *more: str):
    db = tmp_path / "results.db"
    result = CliRunner().invoke(app, ["sweep", "--interpret", "--shapes", "8x64", "--trials", "1",
                                      "--db", f"sqlite:///{db}", *more])
    return result, db


@pytest.mark.parametrize("budget", ["nan", "inf", "-5", "0"])
def test_sweep_refuses_a_time_budget_that_is_not_a_positive_number(tmp_path, budget):
    """NaN compared false with every bound, so `--time-budget nan` turned the budget off."""
    result, db = _sweep(tmp_path, "--time-budget", budget)
    assert _one_error(result).startswith("error: --time-budget ")
    assert not db.exists()


@pytest.mark.parametrize("command", ["sweep", "bench"])
@pytest.mark.parametrize("shapes", ["", "  "])
def test_empty_shapes_are_refused_not_taken_for_the_default_preset(tmp_path, command, shapes):
    args = [command, "--interpret", "--shapes", shapes, "--db", f"sqlite:///{tmp_path / 'results.db'}"]
    if command == "bench":
        args += ["--out", str(tmp_path / "bench")]
    assert _one_error(CliRunner().invoke(app, args)).startswith("error: --shapes: no shapes given")
    assert not (tmp_path / "results.db").exists()


@pytest.mark.parametrize("command", ["validate", "compare", "tune"])
@pytest.mark.parametrize("shapes, bad", [("0x64", "0x64"), ("8x64,-2x64", "-2x64")])
def test_shapes_without_rows_are_refused_by_every_command(tmp_path, monkeypatch, command, shapes, bad):
    """A shape needs M >= 1 rows (the shape parsing every command shares): bench reported a speedup for 0 rows,
    and validate, compare and tune took such shapes as well."""
    monkeypatch.setenv("NORMTUNE_HOME", str(tmp_path / "home"))
    inputs = tmp_path / "in"
    inputs.mkdir()
    table = inputs / "t.json"
    table.write_text((Path(__file__).resolve().parents[1] / "configs" / "h100.json").read_text())
    db, out = tmp_path / "results.db", tmp_path / "out"
    args = {"validate": ["validate", "--db", f"sqlite:///{db}", "--out", str(out)],
            "compare": ["compare", "default", str(table)],
            "tune": ["tune", "--db", f"sqlite:///{db}", "--out", str(out / "t.json"), "--time-budget", "5"]}[command]
    line = _one_error(CliRunner().invoke(app, [*args, "--interpret", "--shapes", shapes]))
    assert line.startswith(f"error: --shapes: bad shape '{bad}'") and "M >= 1" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # nothing written


@pytest.mark.parametrize("command", [
    ["where", "--gpu", "auto", "--shape", "8x64"],
    ["tune", "--interpret", "--shapes", "8x64", "--time-budget", "5"],
])
def test_a_negative_device_is_refused_naming_device(tmp_path, monkeypatch, command):
    """--device -3 was taken (bench and tune ran; where blamed --gpu auto for finding no GPU)."""
    monkeypatch.setenv("NORMTUNE_HOME", str(tmp_path / "home"))
    more = ["--db", f"sqlite:///{tmp_path / 'results.db'}", "--out", str(tmp_path / "t.json")] \
        if command[0] == "tune" else []
    line = _one_error(CliRunner().invoke(app, [*command, *more, "--device", "-3"]))
    assert line.startswith("error: --device -3: give a CUDA device index, 0 or more"), line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", [["sweep", "--interpret", "--shapes", "8x64", "--trials", "1"],
                                     ["tune", "--interpret", "--shapes", "8x64", "--time-budget", "5"]])
@pytest.mark.parametrize("devices", ["0,x", "0,0", ","])
def test_sweep_and_tune_refuse_a_bad_devices_list_with_one_line(tmp_path, monkeypatch, command, devices):
    monkeypatch.setenv("NORMTUNE_HOME", str(tmp_path / "home"))
    more = ["--out", str(tmp_path / "t.json")] if command[0] == "tune" else []
    line = _one_error(CliRunner().invoke(app, [*command, *more, "--db", f"sqlite:///{tmp_path / 'r.db'}",
                                               "--devices", devices]))
    assert line == f"error: --devices {devices!r}: use a comma list of distinct CUDA device indices, e.g. 0,1"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("target", ["folder", "under-a-file"])
def test_an_unwritable_summary_is_refused_before_measuring(tmp_path, target):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    summary = tmp_path if target == "folder" else blocker / "summary.json"
    result, db = _sweep(tmp_path, "--summary", str(summary))
    assert _one_error(result).startswith(f"error: --summary {summary}: cannot be written")
    assert not db.exists()  # refused before the database was opened, let alone a trial measured
    assert blocker.read_text() == ""


def test_status_prefix_matches_names_literally(tmp_path):
    """`%` and `_` in --prefix are characters of a study name, not LIKE wildcards."""
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with Store(url) as store:
        run_id = store.start_run(H100, kind="sweep", command_line="x")
        for i, name in enumerate(["normtune:h100:a", "normtune_h100:b", "other:100%:c"]):
            store.add_measurement(run_id, RMS, default_config(RMS), ok(80.0 + i), source="sweep", study_name=name,
                                  trial_number=0)
        store.end_run(run_id)
        assert [p.study_name for p in store.workers.study_progress("%")] == []
        assert [p.study_name for p in store.workers.study_progress("normtune_")] == ["normtune_h100:b"]
        assert [p.study_name for p in store.workers.study_progress("other:100%")] == ["other:100%:c"]
    for prefix in ("%", "_"):
        result = CliRunner().invoke(app, ["status", "--db", url, "--prefix", prefix])
        assert result.exit_code == 0 and f"no sweep studies named {prefix}…" in result.output, result.output


@pytest.mark.parametrize("command", [
    ["bench", "--interpret", "--shapes", "8x64", "--config"],
    ["report", "--gpu", "h100", "--table"],
    ["slim", "--table"],
])
def test_a_deeply_nested_json_is_one_error_line_naming_the_file(tmp_path, command):
    """json.loads raises RecursionError on deep nesting: it must read as the file's error, not a traceback."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    out = tmp_path / "out"
    extra = ["--out", str(out)] if command[0] != "slim" else ["--out", str(tmp_path / "slim.db")]
    result = CliRunner().invoke(app, [*command, str(deep), *extra])
    line = _one_error(result)
    assert str(deep) in line and "nests too deeply" in line
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_slim_into_a_folder_it_cannot_write_is_one_error_line(tmp_path):
    """A read-only place for --out (here /proc, which refuses new files even to root) ends in one error line, not
    sqlite3's OperationalError traceback, and leaves nothing behind."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = CliRunner().invoke(app, ["slim", "--db", f"sqlite:///{root / 'results.db'}", "--table",
                                      str(root / "configs" / "h100.json"), "--out", "/proc/normtune-slim.db"])
    last = [line for line in result.output.splitlines() if line.strip()][-1]
    assert result.exit_code == 1, result.output
    assert last.startswith("error: --out /proc/normtune-slim.db: cannot write there"), result.output
    assert "Traceback" not in result.output
