"""What a table is fitted on, and what it refuses to learn: `normtune emit` fits only the selected runs (sweep and
emit runs by default, never validate or bench ones), records them with a fingerprint of its inputs, reproduces
itself byte for byte from the same database (the committed results.db included, no re-measurement), and never
ships a rule slower than the analytic default beyond the measured spread.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import BackwardConfig, Kernel2Config, ProblemFamily, default_config, kernel_1_config
from normtune.tuner.tables import emit, emit_notes, fit, incumbent
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.measure.spread import Timing
from normtune.tuner.store.database import Store

REPO_DB = Path(__file__).resolve().parents[1] / "results.db"
CONFIGS = Path(str(resources.files("normtune.configs")))
GPU = DeviceInfo(name="NVIDIA Test GPU", key="testgpu", compute_capability="9.0", sm_count=8, l2_bytes=50 * 2**20,
                 memory_bytes=80 * 2**30, driver="560.35.03", cuda="12.6", torch="2.6.0", triton="3.2.0",
                 normtune="0.1.0", git_revision="aaaa111", host="node-1", python="3.11.9", interpret=False)
RMS = ProblemFamily("rms_norm", "bf16", "bf16", True, False, False, "input")
runner = CliRunner()


def cfg(N: int, warps: int = 4, block_m: int = 64) -> BackwardConfig:
    return BackwardConfig(kernel_1_config(block_row=1, block_col=N, num_warps=warps),
                          Kernel2Config(block_m=block_m, block_n=16))


def ok(median: float, spread: float = 0.01) -> MeasureResult:
    return MeasureResult(status="ok", median_us=median, p10_us=median * (1 - spread), p90_us=median * (1 + spread),
                         reps=20)


def sweep_store(path: Path) -> Store:
    """Two sweep runs (revisions aaaa111, bbbb222) on RMS 256x1024 and 2048x1024: config A best everywhere."""
    store = Store(f"sqlite:///{path}")
    for revision, scale in (("aaaa111", 1.0), ("bbbb222", 1.0)):
        run = store.start_run(dataclasses.replace(GPU, git_revision=revision), kind="sweep", command_line="sweep")
        for M in (256, 2048):
            p = RMS.problem(M, 1024)
            store.add_measurement(run, p, cfg(1024, 4), ok(10.0 * scale * M / 256), source="sweep")
            store.add_measurement(run, p, cfg(1024, 8), ok(12.0 * scale * M / 256), source="sweep")
        store.end_run(run)
    return store


def add_fast_run(store: Store, kind: str, source: str) -> int:
    """A run whose config is 100x faster than anything swept: a table that saw it would pick it."""
    run = store.start_run(GPU, kind=kind, command_line=f"normtune {kind}")
    for M in (256, 2048):
        store.add_measurement(run, RMS.problem(M, 1024), cfg(1024, 2, 32), ok(0.1), source=source)
    store.end_run(run)
    return run


def test_validate_and_bench_runs_never_change_the_table(tmp_path):
    store = sweep_store(tmp_path / "r.db")
    try:
        before = emit.dumps(emit.build_table(store, GPU.key))
        # validate's head-to-head, validate's own sweep (a "sweep" run of source validate-sweep), a bench run
        for kind, source in (("validate", "validate-table"), ("sweep", "validate-sweep"), ("bench", "bench-table")):
            add_fast_run(store, kind, source)
            assert emit.dumps(emit.build_table(store, GPU.key)) == before, (kind, source)
        table = json.loads(before)
        assert table["provenance"]["runs"] == [1, 2] and table["provenance"]["measurements"] == 8
        rule = table["families"][RMS.key]["rules"][0]
        assert BackwardConfig.from_dict(rule["config"]) == cfg(1024, 4)
    finally:
        store.close()


def test_a_held_out_shape_is_never_fitted_on_even_when_a_sweep_measured_it(tmp_path):
    from normtune.tuner.tables.heldout import HELDOUT_SHAPES

    M, N = HELDOUT_SHAPES[0]
    store = sweep_store(tmp_path / "r.db")
    try:
        before = emit.build_table(store, GPU.key)
        assert before["provenance"]["held_out_left_out"] == []
        run = store.start_run(GPU, kind="sweep", command_line="normtune sweep --shapes heldout")
        store.add_measurement(run, RMS.problem(M, N), cfg(N, 2, 32), ok(0.1), source="sweep")
        store.end_run(run)
        after = emit.build_table(store, GPU.key)
        assert after["provenance"]["held_out_left_out"] == [f"{M}x{N}"]
        assert after["families"] == before["families"] and after["provenance"]["runs"] == [1, 2]
        assert after["provenance"]["fingerprint"] == before["provenance"]["fingerprint"]
    finally:
        store.close()


def test_a_stored_problem_without_rows_is_not_fitted(tmp_path):
    """An older sweep could store a 0-row problem; emit leaves it out and says so in one line (the emission failed
    with 'm_max=0 must be a positive integer' before)."""
    store = sweep_store(tmp_path / "r.db")
    try:
        before = emit.build_table(store, GPU.key)
        run = store.start_run(GPU, kind="sweep", command_line="normtune sweep --shapes 0x1024")
        store.add_measurement(run, RMS.problem(0, 1024), cfg(1024, 2, 32), ok(0.1), source="sweep")
        store.end_run(run)
        after = emit.build_table(store, GPU.key)
        assert after["families"] == before["families"] and after["provenance"]["runs"] == [1, 2]
        assert after["provenance"]["without_rows_left_out"] == [RMS.problem(0, 1024).key]
        assert "without_rows_left_out" not in before["provenance"]  # other tables keep their bytes
    finally:
        store.close()
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", f"sqlite:///{tmp_path / 'r.db'}", "--out",
                                 str(out)])
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if "without rows" in line]
    assert said == [f"left out 1 stored problems without rows (M = 0: {RMS.problem(0, 1024).key}): they time "
                    "nothing a rule could fit"], result.output
    assert json.loads(out.read_text())["families"] == before["families"]


def test_selection_by_run_kind_and_revision(tmp_path):
    store = sweep_store(tmp_path / "r.db")
    try:
        def runs(**kw):
            return emit.build_table(store, GPU.key, selection=emit.Selection(**kw))["provenance"]["runs"]

        assert runs(run_ids=(2,)) == [2]
        assert runs(git_revisions=("bbbb",)) == [2] and runs(git_revisions=("aaaa", "bbbb")) == [1, 2]
        with pytest.raises(ValueError, match="no successful measurements"):
            emit.build_table(store, GPU.key, selection=emit.Selection(kinds=("emit",)))
        validate_run = add_fast_run(store, "validate", "validate-table")
        with pytest.raises(ValueError, match=f"--runs {validate_run}: validate runs are never fitted on"):
            emit.build_table(store, GPU.key, selection=emit.Selection(run_ids=(1, validate_run)))
        with pytest.raises(ValueError, match="--runs 99: no such testgpu run"):
            emit.build_table(store, GPU.key, selection=emit.Selection(run_ids=(99,)))
    finally:
        store.close()
    with pytest.raises(ValueError, match="--kind bench: a table is never fitted on validate or bench runs"):
        emit.Selection(kinds=("sweep", "bench"))


def test_fingerprint_changes_with_the_inputs_only(tmp_path):
    store = sweep_store(tmp_path / "r.db")
    try:
        first = emit.build_table(store, GPU.key)["provenance"]["fingerprint"]
        add_fast_run(store, "validate", "validate-default")
        assert emit.build_table(store, GPU.key)["provenance"]["fingerprint"] == first
        run = store.start_run(GPU, kind="sweep", command_line="sweep")
        store.add_measurement(run, RMS.problem(256, 1024), cfg(1024, 8), ok(11.0), source="sweep")
        store.end_run(run)
        assert emit.build_table(store, GPU.key)["provenance"]["fingerprint"] != first
    finally:
        store.close()


# ------------------------------------------------------------------------------ never slower than the default


def T(median: float, spread: float = 0.01) -> Timing:
    return Timing(median, median * (1 - spread), median * (1 + spread))


def test_a_rule_slower_than_the_default_beyond_the_spread_is_dropped():
    """X has the best geometric-mean regret over the bucket (1.0083) but is 2.5 % slower than the default on the
    small problem, beyond the ±1 % spread; Y (1.0093) never loses to the default, and splitting the bucket on M
    gains less than SPLIT_GAIN: Y is the rule, X is reported as dropped."""
    small, mid, large = (RMS.problem(M, 1024) for M in (256, 1024, 4096))
    default = default_config(small)
    x, y = cfg(1024, 4, 32), cfg(1024, 8, 32)
    data = {small: {default: T(10.0), x: T(10.25), y: T(10.0)},
            mid: {default: T(20.0), x: T(10.0), y: T(10.14)},
            large: {default: T(40.0), x: T(20.0), y: T(20.28)}}
    defaults = {p: default for p in data}
    fitted = fit.fit_family(RMS, data, defaults)
    assert [BackwardConfig.from_dict(r["config"]) for r in fitted.rules] == [y]
    (dropped,) = fitted.dropped
    assert BackwardConfig.from_dict(dropped["config"]) == x
    assert dropped["slower_than_default"] == {"256x1024": {"us": 10.25, "default_us": 10.0}}
    assert dropped["fitted_on"] == ["256x1024", "1024x1024", "4096x1024"] and fitted.default_unmeasured == []
    # Within the spread (±5 %: 10.25 and 10.0 overlap), X is kept: noise is no reason to drop a rule.
    noisy = {p: {c: T(t.median, 0.05) for c, t in cfgs.items()} for p, cfgs in data.items()}
    kept = fit.fit_family(RMS, noisy, defaults)
    assert [BackwardConfig.from_dict(r["config"]) for r in kept.rules] == [x] and kept.dropped == []
    # Without the default measured there is nothing to check against: said so, not silently passed.
    unchecked = fit.fit_family(RMS, data, {})
    assert unchecked.default_unmeasured == ["256x1024", "1024x1024", "4096x1024"]


def test_when_no_config_is_safe_on_the_whole_bucket_each_problem_gets_its_own_best():
    small, large = RMS.problem(256, 1024), RMS.problem(4096, 1024)
    default = default_config(small)
    x = cfg(1024, 4, 32)
    # The default itself was measured only on the small problem, so it cannot be the bucket's rule.
    data = {small: {default: T(10.0), x: T(14.0)}, large: {x: T(50.0)}}
    fitted = fit.fit_family(RMS, data, {small: default})
    assert [(r["m_max"], BackwardConfig.from_dict(r["config"])) for r in fitted.rules] == [(1024, default),
                                                                                         (None, x)]
    assert len(fitted.dropped) == 1 and fitted.default_unmeasured == ["4096x1024"]
    table = {"families": {RMS.key: {"dropped": fitted.dropped}}}
    (line,) = emit_notes.dropped_summary(table)
    assert "256x1024 14.0 vs 10.0 µs" in line and "slower than the analytic default" in line


# ------------------------------------------------------------------------------------- committed results.db


@pytest.fixture(scope="module")
def repo_db(tmp_path_factory):
    if not REPO_DB.is_file():
        pytest.skip("no committed results.db")
    # A copy: until the store opens read-only, opening a SQLite file may switch its journal mode.
    path = tmp_path_factory.mktemp("repo") / "results.db"
    shutil.copy(REPO_DB, path)
    return path


def test_committed_results_db_emits_the_same_bytes_twice(repo_db, tmp_path):
    """An emission from every run of a GPU, then `--check` of its file: the second emission gives exactly the
    bytes of the first (what `--check` compares), and `--check` accepts an unchanged table. (Each shipped table's
    own `--check`, one emission per GPU, is the next test.)"""
    out = tmp_path / "a.json"
    result = runner.invoke(app, ["emit", "--gpu", "h200", "--db", str(repo_db), "--out", str(out)])
    assert result.exit_code == 0, result.output
    first = out.read_bytes()
    result = runner.invoke(app, ["emit", "--gpu", "h200", "--db", str(repo_db), "--out", str(out), "--check"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == first  # --check wrote nothing


@pytest.mark.parametrize("name", ["h100.json", "h200.json"])
def test_committed_table_reproduces_from_its_recorded_runs(repo_db, name, tmp_path):
    """A shipped table re-emitted from the runs it records: with the fingerprint of its inputs recorded,
    `emit --runs-of configs/NAME --check` accepts a copy of it byte for byte (the CLI's re-emission is the one
    emission: the same runs and incumbent as the library call); without one, its rules and expected times
    come out exactly. It was fitted on sweep (or emit) runs only."""
    shipped = json.loads((CONFIGS / name).read_text())
    runs = emit.recorded_runs(shipped)
    with Store(f"sqlite:///{repo_db}") as store:
        kinds = {r.id: r.kind for r in store.runs()}
        refused = [r for r in runs if kinds.get(r) in emit.NEVER_FIT]
        if refused:
            pytest.skip(f"configs/{name} was fitted on run(s) {refused} of kind validate/bench, before emit "
                        "excluded them: re-emit it (`normtune emit --gpu ...`) to make it reproducible")
        if "fingerprint" not in shipped["provenance"]:
            again = emit.build_table(store, shipped["gpu"]["key"], selection=emit.Selection(run_ids=runs),
                                     incumbent=incumbent.recorded(shipped, name))  # a table emitted with --keep
    assert runs and {kinds[r] for r in runs} <= {"sweep", "emit"}
    if "fingerprint" in shipped["provenance"]:
        out = tmp_path / name
        shutil.copy(CONFIGS / name, out)
        result = runner.invoke(app, ["emit", "--gpu", shipped["gpu"]["key"], "--db", str(repo_db),
                                     "--runs-of", str(CONFIGS / name), "--out", str(out), "--check"])
        assert result.exit_code == 0, result.output
        assert out.read_bytes() == (CONFIGS / name).read_bytes()
        return
    for key, fam in shipped["families"].items():
        for field in ("rules", "expected_us", "fit_regret"):
            assert again["families"][key][field] == fam[field], (key, field)


# ------------------------------------------------------------------------------------------------- the CLI


def test_cli_emit_refusals_are_one_line_and_write_nothing(tmp_path):
    store = sweep_store(tmp_path / "r.db")
    add_fast_run(store, "bench", "bench-table")
    store.close()
    db = str(tmp_path / "r.db")
    out = tmp_path / "t.json"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    cases = [(["--runs", "3"], "--runs 3: bench runs are never fitted on"),
             (["--keep", str(tmp_path / "missing.json")], "missing.json"),
             (["--keep", str(bad)], "not valid JSON"),
             (["--keep", str(CONFIGS / "h200.json")], "its incumbent was tuned on h200, this table is for testgpu"),
             (["--runs-of", str(bad)], f"--runs-of {bad}"),
             (["--kind", "validate"], "--kind validate: a table is never fitted on"),
             (["--runs", "x"], "--runs 'x': use a comma list of run ids"),
             (["--runs", "1", "--runs-of", str(out)], "--runs and --runs-of"),
             (["--db", str(tmp_path / "missing.db")], "no such database file")]
    for args, needle in cases:
        result = runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", db, "--out", str(out)] + args)
        assert result.exit_code == 1, (args, result.output)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (args, lines)
        assert not out.exists()
    assert not (tmp_path / "missing.db").exists()
    # --check against a file that differs: exit 1, the file untouched.
    out.write_text("{}\n")
    result = runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", db, "--out", str(out), "--check"])
    assert result.exit_code == 1 and out.read_text() == "{}\n"
