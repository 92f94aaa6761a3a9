"""`normtune tune` refuses bad input in one `error:` line naming the option, with exit code 1, before it opens a
database or measures anything."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.select.select import clear_caches
from normtune.kernels.select.table_chain import ENV_VAR, HIDE_VAR, HOME_VAR


@pytest.fixture(autouse=True)
def _home(monkeypatch, tmp_path):
    monkeypatch.setenv(HOME_VAR, str(tmp_path / "home"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(HIDE_VAR, raising=False)
    yield
    os.environ.pop(HIDE_VAR, None)  # --as-new-gpu sets it for the process it runs in
    clear_caches()


def _tune(tmp_path, *args: str, out: bool = True):
    more = ["--out", str(tmp_path / "t.json")] if out else []
    return CliRunner().invoke(app, ["tune", "--interpret", "--shapes", "4x64", "--db",
                                    f"sqlite:///{tmp_path / 'tune.db'}", *more, *args])


def _one_error(result, tmp_path) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert not (tmp_path / "tune.db").exists() and not (tmp_path / "home" / "results.db").exists()
    return lines[0]


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "inf"])
def test_a_time_budget_must_be_a_positive_number(tmp_path, budget):
    assert _one_error(_tune(tmp_path, "--time-budget", budget), tmp_path).startswith(f"error: --time-budget {budget}")


@pytest.mark.parametrize("option", ["--trials", "--heldout", "--reference-trials"])
def test_counts_must_be_at_least_one(tmp_path, option):
    assert _one_error(_tune(tmp_path, option, "0"), tmp_path).startswith(f"error: {option} 0")


@pytest.mark.parametrize("spec", ["h800", "no-such-table.json"])
def test_an_unknown_warm_start_names_the_shipped_keys(tmp_path, spec):
    line = _one_error(_tune(tmp_path, "--from", spec), tmp_path)
    assert line.startswith(f"error: --from {spec}: neither the GPU key of a shipped table (h100, h200)"), line


def test_a_warm_start_file_that_is_no_table_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    line = _one_error(_tune(tmp_path, "--from", str(bad)), tmp_path)
    assert line.startswith(f"error: --from heuristic table {bad}: not valid JSON"), line


@pytest.mark.parametrize("args, needle", [
    (["--from", "DEEP"], "error: --from heuristic table DEEP: its JSON nests too deeply"),
    (["--compile-workers", "-1"], "error: --compile-workers -1"),
])
def test_a_refused_warm_start_or_option_leaves_no_report_folder(tmp_path, args, needle):
    """The report folder beside --out is made only once every option and table read has been checked (a deeply
    nested --from file left an empty t-tune folder behind)."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    args = [str(deep) if a == "DEEP" else a for a in args]
    line = _one_error(_tune(tmp_path, *args), tmp_path)
    assert line.startswith(needle.replace("DEEP", str(deep))), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.json"]


@pytest.mark.parametrize("shapes", ["heldout", "4x64,heldout"])
def test_the_heldout_preset_is_never_tuned(tmp_path, shapes):
    result = CliRunner().invoke(app, ["tune", "--interpret", "--shapes", shapes, "--out", str(tmp_path / "t.json"),
                                      "--db", f"sqlite:///{tmp_path / 'tune.db'}"])
    assert _one_error(result, tmp_path).startswith("error: --shapes heldout: the held-out preset is kept")


def test_an_unwritable_out_or_report_is_refused_first(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = _one_error(CliRunner().invoke(app, ["tune", "--interpret", "--shapes", "4x64", "--out",
                                               str(blocker / "t.json"), "--db",
                                               f"sqlite:///{tmp_path / 'tune.db'}"]), tmp_path)
    assert line.startswith(f"error: --out {blocker / 't.json'}: cannot be written"), line
    line = _one_error(_tune(tmp_path, "--report", str(blocker)), tmp_path)
    assert line.startswith(f"error: --report {blocker}: cannot write there"), line
    assert blocker.read_text() == ""


def test_an_interpreter_table_is_never_written_as_the_user_table(tmp_path):
    line = _one_error(_tune(tmp_path, out=False), tmp_path)
    assert line.startswith("error: --interpret: an interpreter table never tunes a GPU") and "--out FILE" in line


@pytest.mark.parametrize("args, needle", [
    (["--forms", "fused"], "error: --forms 'fused': use a comma list of plain, residual"),
    (["--devices", "0,1"], "error: --devices needs GPUs"),
    (["--devices", "0,x"], "error: --devices '0,x'"),
    (["--norm", "batch_norm"], "error: --norm 'batch_norm'"),
    (["--dtype", "int8"], "error: --dtype 'int8'"),
    (["--compile-workers", "-1"], "error: --compile-workers -1"),
    (["--shapes", " "], "error: --shapes: no shapes given"),
    (["--heartbeat-interval", "5", "--grace-period", "5"], "error: --grace-period 5 must exceed"),
])
def test_other_options(tmp_path, args, needle):
    line = _one_error(_tune(tmp_path, *args), tmp_path)
    assert line.startswith(needle), line


def test_as_new_gpu_refuses_an_explicit_table_that_would_stand_in(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "mine.json"))
    line = _one_error(_tune(tmp_path, "--as-new-gpu"), tmp_path)
    assert line.startswith(f"error: --as-new-gpu: ${ENV_VAR} names a table"), line


def test_as_new_gpu_refuses_to_warm_start_from_the_gpus_own_table():
    import dataclasses

    from test_store import H100

    from normtune.commands.common import CLIError
    from normtune.commands.tune import _incumbent, _warm_start

    with pytest.raises(CLIError, match=r"--from h100: a table of this GPU \(h100\), which --as-new-gpu hides.*h200"):
        _warm_start("h100", H100, True)
    assert _warm_start("h200", H100, True).gpu_key == "h200"
    assert _warm_start("h100", H100, False).gpu_key == "h100"
    assert _incumbent(H100, False).gpu_key == "h100"  # the shipped table: what the tune must not lose to
    assert _incumbent(H100, True) is None
    assert _incumbent(dataclasses.replace(H100, name="NVIDIA B200", key="b200", compute_capability="10.0"),
                      False) is None
