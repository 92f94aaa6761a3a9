"""Where commands write when --db is not given (the user directory, never the repository's results.db), and what
`normtune status` says about a database: its workers, a database without open studies, the prefixes its help
names."""

from __future__ import annotations

import hashlib
import inspect

import pytest
from sweep_support import INTERPRETER_ONLY
from test_store import H100, RMS, ok
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import default_config
from normtune.tuner.store.database import Store
from normtune.tuner.sweep.costs import Costs


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    """A working folder holding a results.db (the repository's committed file) and a user directory of its own."""
    folder = tmp_path / "repo"
    folder.mkdir()
    with Store(f"sqlite:///{folder / 'results.db'}") as store:
        run_id = store.start_run(H100, kind="sweep", command_line="normtune sweep")
        store.add_measurement(run_id, RMS, default_config(RMS), ok(80.0), source="sweep")
        store.end_run(run_id)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("NORMTUNE_HOME", str(tmp_path / "home"))
    return folder


@INTERPRETER_ONLY
def test_a_sweep_without_db_writes_the_user_directory_and_says_where(repo, tmp_path):
    committed = _digest(repo / "results.db")
    result = CliRunner().invoke(app, ["sweep", "--interpret", "--norm", "rms_norm", "--shapes", "40x96", "--trials",
                                      "1", "--sampler", "random", "--compile-workers", "0"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    home = tmp_path / "home" / "results.db"
    assert _digest(repo / "results.db") == committed and sorted(p.name for p in repo.iterdir()) == ["results.db"]
    assert f"results go to sqlite:///{home}" in result.output and f"results in sqlite:///{home}" in result.output
    with Store(f"sqlite:///{home}") as store:
        assert [r.kind for r in store.runs()] == ["sweep"] and len(store.measurements()) == 1


def test_writing_commands_default_to_the_user_database_and_reading_ones_to_results_db():
    from normtune.commands import emit, prune, report, slim, status, sweep, validate

    def default(command, name="db"):
        return inspect.signature(command).parameters[name].default

    assert default(sweep.sweep, "storage") is None and default(validate.validate) is None
    assert default(prune.prune) is None and default(status.status) is None
    assert default(report.report) == default(slim.slim) == "sqlite:///results.db"
    assert default(emit.emit) is None  # results.db, unless --remeasure (which writes) is given


def test_emit_remeasure_without_db_is_refused_and_prune_leaves_results_db_alone(repo, tmp_path):
    committed = _digest(repo / "results.db")
    result = CliRunner().invoke(app, ["emit", "--gpu", "h100", "--remeasure"])
    assert result.exit_code == 1 and result.output.startswith("error: --remeasure") and "--db" in result.output
    result = CliRunner().invoke(app, ["prune"])  # the user database, which no sweep has written here
    assert result.exit_code == 1 and "home" in result.output, result.output
    assert _digest(repo / "results.db") == committed


def test_status_counts_workers_not_lines_and_lists_the_runs_of_a_database_without_studies(repo):
    url = f"sqlite:///{repo / 'results.db'}"
    result = CliRunner().invoke(app, ["status", "--db", url], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("no sweep studies named normtune:")
    assert any("1 runs" in line and "normtune report" in line for line in lines), result.output
    assert any(line.strip().startswith("run 1: sweep on h100, finished") for line in lines), result.output
    # A finished worker, with the costs it saved: one worker, not two lines' worth.
    with Store(url) as store:
        run_id = store.start_run(H100, kind="sweep", command_line="normtune sweep")
        store.workers.beat(run_id, grace_s=60.0, costs=Costs().to_dict())
        store.add_measurement(run_id, RMS, default_config(RMS), ok(70.0), source="sweep",
                              study_name="normtune:h100:x", trial_number=0)
        store.end_run(run_id)
    result = CliRunner().invoke(app, ["status", "--db", url], env={"COLUMNS": "300"})
    assert result.exit_code == 0 and "workers: 0 alive of 1" in result.output, result.output
    assert "where its time went" in result.output


def test_each_prefix_the_status_help_names_finds_its_studies(tmp_path):
    from normtune.commands.status import PREFIXES
    from normtune.tuner.tables.validate import REFERENCE_PREFIX

    assert f"{REFERENCE_PREFIX}:" in PREFIXES
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with Store(url) as store:
        run_id = store.start_run(H100, kind="sweep", command_line="normtune sweep")
        for i, prefix in enumerate(PREFIXES):
            store.add_measurement(run_id, RMS, default_config(RMS), ok(70.0), source="sweep",
                                  study_name=f"{prefix}h100:x", trial_number=i)
        store.end_run(run_id)
    import typer

    (option,) = [p for p in typer.main.get_command(app).commands["status"].params if p.name == "prefix"]
    named = [word for word in option.help.replace(",", " ").split() if word.startswith("normtune")]
    assert sorted(named) == sorted(PREFIXES), help_text
    for prefix in named:
        result = CliRunner().invoke(app, ["status", "--db", url, "--prefix", prefix], env={"COLUMNS": "300"})
        assert result.exit_code == 0 and "no sweep studies" not in result.output, (prefix, result.output)
    result = CliRunner().invoke(app, ["status", "--db", url, "--prefix", "normtune-validate:"],
                                env={"COLUMNS": "300"})
    assert "pass --prefix" in result.output and "normtune-validate-unseeded:" in result.output, result.output
