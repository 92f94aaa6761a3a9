"""`normtune compare` (the regression gate for tables) and `normtune validate` (regret against an unseeded
reference), run end to end on CPU through the Triton interpreter on tiny shapes; plus the spread arithmetic they
share with emit.

In the interpreter a backward's cost grows with the number of program instances it runs: the BAD config (one row
per program, 16 programs, kernel_2 tiles of 32x8 on one warp) takes about 4-5x the GOOD one (16-row tiles, one
128x16 kernel_2 tile) on 64x256, far beyond the timing noise, so the gate's verdicts are stable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import BackwardConfig, Kernel2Config, kernel_1_config
from normtune.kernels.device import interpret_mode
from normtune.tuner.measure.spread import Ratio, Timing, slower_beyond_spread
from normtune.tuner.store.database import Store

runner = CliRunner()
GOOD = BackwardConfig(kernel_1_config(block_row=16, block_col=256, num_warps=4, prefetch=True,
                                    eviction_policy="evict_first"), Kernel2Config(128, 16, 4))
BAD = BackwardConfig(kernel_1_config(block_row=1, block_col=256, num_warps=4, programs_per_sm=4),
                     Kernel2Config(block_m=32, block_n=8, num_warps=1))
FAMILIES = ("rms_norm/bf16/wbf16/nobias/save-input", "layer_norm/bf16/wbf16/bias/save-input")


def write_table(path, config: BackwardConfig) -> str:
    """An interpreter table with one rule per family: `config` for every shape."""
    rules = [{"n_max": None, "m_max": None, "config": config.to_dict(), "fitted_on": ["64x256"]}]
    path.write_text(json.dumps({"schema_version": 1, "interpret": True,
                                "gpu": {"name": "cpu (triton interpreter)", "key": "interpret",
                                        "compute_capability": None, "sm_count": 4},
                                "families": {key: {"rules": rules} for key in FAMILIES}}))
    return str(path)


@pytest.fixture(autouse=True)
def _interpreter():
    if not interpret_mode():
        pytest.skip("runs the kernels through --interpret: set TRITON_INTERPRET=1")


# ------------------------------------------------------------------------------------------------- spread


def test_pooled_timing_holds_the_spread_within_and_between_measurements():
    class M:
        def __init__(self, median, p10=None, p90=None, status="ok"):
            self.median_us, self.p10_us, self.p90_us, self.status = median, p10, p90, status

    t = Timing.pool([M(10.0, 9.5, 10.5), M(12.0, 11.5, 12.5), M(11.0, 10.5, 11.5), M(1.0, status="incorrect")])
    assert (t.median, t.count) == (11.0, 3)
    # within: median p10 10.5, p90 11.5; between: the medians' 10th/90th percentiles 10.2 and 11.8
    assert t.p10 == pytest.approx(10.2) and t.p90 == pytest.approx(11.8)
    assert Timing.pool([M(5.0, status="timeout")]) is None
    a, b = Timing(12.0, 11.5, 12.5), Timing(10.0, 9.5, 10.5)
    assert slower_beyond_spread(a, b) and not slower_beyond_spread(b, a)
    assert not slower_beyond_spread(a, b, threshold=0.25)  # 20 % slower is within a 25 % threshold
    assert not slower_beyond_spread(Timing(12.0, 10.0, 13.0), b)  # overlapping ranges: within the noise
    r = Ratio.of(a, b)
    assert (r.value, r.low, r.high) == pytest.approx((1.2, 11.5 / 10.5, 12.5 / 9.5)) and r.beyond_spread


# ------------------------------------------------------------------------------------------------ compare


def compare(tmp_path, old: BackwardConfig, new: BackwardConfig, *more: str):
    # Files named by their config: kernels.tables caches a loaded table by its path.
    args = ["compare", write_table(tmp_path / f"old-{old.to_json().__hash__()}.json", old),
            write_table(tmp_path / f"new-{new.to_json().__hash__()}.json", new),
            "--interpret", "--norm", "rms_norm", "--shapes", "64x256", "--rounds", "2", *more]
    return runner.invoke(app, args)


def test_compare_passes_identical_tables_without_timing(tmp_path):
    result = compare(tmp_path, GOOD, GOOD)
    assert result.exit_code == 0, result.output
    assert "| rms_norm 64×256 bf16 | – | – | – | same config |" in result.stdout
    assert "0 of 1 shapes slower" in result.stdout and "PASS" in result.stdout
    assert "Triton interpreter" in result.stderr  # the banner
    # a saved compare file says where it ran: the GPU's name and key, the timing method
    first = result.stdout.splitlines()[0]
    assert first.startswith("Measured on ") and "(`interpret`)" in first
    assert "host wall-clock" in first and "2 rounds" in first


def test_compare_fails_when_new_is_slower(tmp_path):
    worse = compare(tmp_path, GOOD, BAD, "--threshold", "0.5")
    assert worse.exit_code == 1, worse.output
    assert "SLOWER" in worse.stdout and "1 of 1 shapes slower" in worse.stdout and "FAIL" in worse.stdout
    assert "interpreter µs (host wall-clock, not GPU time)" in worse.stdout


def test_compare_passes_when_new_is_faster_timing_through_one_measure_session(tmp_path, monkeypatch):
    """The gate passes the other way round (BAD to GOOD); the device setup and timing of its head-to-head are
    measure.MeasureSession's (one place for bandwidth, L2 flush, spin and repetitions), built once per command
    with the command's preset."""
    from normtune.tuner.measure import harness as measure

    made, measured = [], []
    for_device = measure.MeasureSession.for_device.__func__
    measure_problem = measure.MeasureSession.measure_problem

    def spy_for_device(cls, info, *args, **kwargs):
        made.append(kwargs.get("timing"))
        return for_device(cls, info, *args, **kwargs)

    def spy_measure_problem(self, problem, config):
        measured.append((problem.key, config))
        return measure_problem(self, problem, config)

    monkeypatch.setattr(measure.MeasureSession, "for_device", classmethod(spy_for_device))
    monkeypatch.setattr(measure.MeasureSession, "measure_problem", spy_measure_problem)
    result = compare(tmp_path, BAD, GOOD, "--threshold", "0.5")
    assert result.exit_code == 0, result.output
    assert "| ok |" in result.stdout and "PASS" in result.stdout
    assert made == [measure.TIMING["compare"]]
    assert len(measured) == 4 and len({config for _, config in measured}) == 2  # 2 rounds x OLD and NEW


def test_compare_dry_run_lists_the_changed_configs_and_times_nothing(tmp_path, monkeypatch):
    from normtune.tuner.measure import harness as measure

    def no_session(*args, **kwargs):
        raise AssertionError("--dry-run must not open a measurement session")

    monkeypatch.setattr(measure.MeasureSession, "for_device", classmethod(no_session))
    result = compare(tmp_path, GOOD, BAD, "--dry-run", "--shapes", "64x256,8x1000")
    assert result.exit_code == 0, result.output
    # 8x1000 lies outside the box both tables were fitted on: both run the analytic default there.
    assert "1 of 2 shapes change config (nothing timed" in result.stdout and "8×1000" not in result.stdout
    assert f"| rms_norm 64×256 bf16 | `{GOOD}` | `{BAD}` |" in result.stdout
    same = compare(tmp_path, GOOD, GOOD, "--dry-run")
    assert same.exit_code == 0 and "0 of 1 shapes change config" in same.stdout and "| problem |" not in same.stdout


def test_compare_against_the_analytic_default(tmp_path):
    """'default' in place of a file: the configs that run without a table, timed like a table's."""
    from normtune.kernels.config import default_config
    from normtune.tuner.tables.compare import config_for

    table = write_table(tmp_path / "new.json", BAD)
    args = ["--interpret", "--norm", "rms_norm", "--shapes", "64x256", "--rounds", "2"]
    dry = runner.invoke(app, ["compare", "default", table, "--dry-run", *args])
    assert dry.exit_code == 0, dry.output
    from normtune.kernels.config import Problem
    from normtune.kernels.select.tables import load_table

    problem = Problem("rms_norm", 64, 256, "bf16")
    assert f"| rms_norm 64×256 bf16 | `{default_config(problem)}` | `{config_for(load_table(table), problem)}` |" \
        in dry.stdout
    timed = runner.invoke(app, ["compare", "default", table, *args])  # BAD's many programs lose to the default
    assert timed.exit_code == 1 and "| SLOWER |" in timed.stdout, timed.output
    both = runner.invoke(app, ["compare", "default", "default", *args])
    assert both.exit_code == 1 and both.output.count("\n") == 1 and "both 'default'" in both.output


@pytest.mark.parametrize("args, needle", [(["--threshold", "-0.1"], "--threshold -0.1"),
                                          (["--rounds", "0"], "--rounds 0")])
def test_compare_bad_options_are_one_line(tmp_path, args, needle):
    result = compare(tmp_path, GOOD, BAD, *args)
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {needle}"), lines


def test_compare_names_a_broken_table(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    result = runner.invoke(app, ["compare", str(broken), write_table(tmp_path / "new.json", GOOD), "--interpret"])
    assert result.exit_code == 1 and str(broken) in result.stderr and "Traceback" not in result.output


# ----------------------------------------------------------------------------------------------- validate


def test_validate_uses_an_unseeded_reference_that_emit_never_fits_on(tmp_path, monkeypatch):
    import optuna

    url = f"sqlite:///{tmp_path / 'v.db'}"
    out = tmp_path / "validate"
    args = ["validate", "--interpret", "--norm", "rms_norm", "--shapes", "24x200", "--trials", "3", "--rounds", "2",
            "--table", write_table(tmp_path / "t.json", GOOD), "--db", url, "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["/any/folder/bin/normtune", *args])  # as the console script sees it
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    # progress while it runs, and the interpreter's banner
    assert "Triton interpreter" in result.stderr and "reference sweep: 1 problems, 3 trials each" in result.stderr
    assert "head to head 1/1" in result.stderr
    data = json.loads((out / "validate.json").read_text())
    (row,) = data["rows"]
    assert row["reference_trials"] == 3 and data["reference_trials"] == 3
    # the table's rule adapted to 24x200: single pass on 256 columns, the tile no larger than the rule's
    assert BackwardConfig.from_dict(row["configs"]["table"]).kernel_2 == GOOD.kernel_2
    regret = row["regret"]
    assert regret["value"] >= 1.0 and regret["low"] <= regret["value"] <= regret["high"]
    assert all(row["times_us"][k]["rounds"] == 2 for k in ("table", "reference", "default"))
    assert "| rms_norm 24×200 bf16 |" in (out / "validate.md").read_text()
    # The reference study holds no enqueued (seed) trial: neither the table's config nor the default.
    storage = optuna.storages.RDBStorage(url)
    (study,) = [s for s in optuna.get_all_study_summaries(storage) if s.study_name.startswith("normtune-validate")]
    trials = optuna.load_study(study_name=study.study_name, storage=storage).get_trials()
    assert len(trials) >= 3 and not any("fixed_params" in t.system_attrs for t in trials)
    with Store(url) as store:
        kinds = {r.kind: r for r in store.runs()}
        assert kinds["validate"].command_line == " ".join(["normtune", *args])
        sources = {m.source for m in store.measurements()}
    assert sources == {"validate-sweep", "validate-table", "validate-reference", "validate-default"}
    # Nothing of a validation is fitted on: emit finds no input at all.
    emitted = runner.invoke(app, ["emit", "--interpret", "--db", url, "--out", str(tmp_path / "e.json")])
    assert emitted.exit_code == 1 and "no successful measurements" in emitted.stderr
    assert not (tmp_path / "e.json").exists()


def test_validate_names_the_table_by_its_label(tmp_path, monkeypatch):
    """validate.json, validate.md and the console name the validated table as reports do (its label: relative to
    the working folder), never by the machine's absolute path."""
    work = tmp_path / "work"
    (work / "tables").mkdir(parents=True)
    monkeypatch.chdir(work)
    table = write_table(work / "tables" / "t.json", GOOD)
    out = work / "validate"
    result = runner.invoke(app, ["validate", "--interpret", "--norm", "rms_norm", "--shapes", "8x96", "--trials", "1",
                                 "--rounds", "1", "--table", table, "--db", f"sqlite:///{tmp_path / 'v.db'}",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "validating tables/t.json" in result.stderr
    assert json.loads((out / "validate.json").read_text())["table"] == "tables/t.json"
    md = (out / "validate.md").read_text()
    assert "Table: `tables/t.json`" in md and str(tmp_path) not in md


def test_validate_refuses_bad_options_before_measuring(tmp_path):
    for args, needle in ((["--trials", "0"], "--trials 0"), (["--rounds", "0"], "--rounds 0"),
                         (["--compile-workers", "-1"], "--compile-workers -1")):
        result = runner.invoke(app, ["validate", "--interpret", "--db", str(tmp_path / "v.db"), *args])
        assert result.exit_code == 1
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {needle}"), lines
    assert not (tmp_path / "v.db").exists()


def test_an_interrupted_reference_sweep_stops_validate_without_a_report(tmp_path, monkeypatch):
    """A signal during the reference sweep ends validate with 128 + the signal and no head-to-head: a report
    against an unfinished reference would understate regret. The sweep's trials stay stored for the re-run."""
    from normtune.tuner import sweep as S

    monkeypatch.setattr(S.Sweep, "run", lambda self: S.SweepSummary(stopped="interrupted", signal="SIGTERM"))
    url = f"sqlite:///{tmp_path / 'v.db'}"
    out = tmp_path / "validate"
    result = runner.invoke(app, ["validate", "--interpret", "--norm", "rms_norm", "--shapes", "8x96", "--trials", "2",
                                 "--table", write_table(tmp_path / "t.json", GOOD), "--db", url, "--out", str(out)])
    assert result.exit_code == 143, result.output
    assert "SIGTERM during the reference sweep" in result.stderr and "run the same command again" in result.stderr
    assert not (out / "validate.json").exists()
    with Store(url) as store:
        assert not [r for r in store.runs() if r.kind == "validate"]


def test_the_report_names_shapes_whose_reference_is_short_of_the_trials():
    from normtune.kernels.config import Problem
    from normtune.tuner.tables import validate as V
    from normtune.tuner.gpu_info import detect

    def row(M, measured):
        return V.ValidationRow(Problem("rms_norm", M, 96, "bf16"), {"table": GOOD, "reference": GOOD, "default": GOOD},
                               {k: Timing(10.0, 9.9, 10.1, 2) for k in V.CANDIDATES}, measured)

    info = detect(interpret=True)
    full = V.markdown([row(8, 40), row(16, 40)], info, "t.json", 40)
    assert "short of" not in full
    short = V.markdown([row(8, 40), row(16, 12)], info, "t.json", 40)
    assert "Reference short of 40 trials on 1 of 2 problems" in short and "rms_norm 16×96 bf16 (12)" in short


@pytest.mark.parametrize("command", ["compare", "bench", "validate"])
def test_interpret_works_without_triton_interpret_in_the_environment(tmp_path, command):
    """--interpret switches the interpreter on before Triton is imported, so a command started from a shell
    without TRITON_INTERPRET runs its kernels in this process (Triton's own tl.sum and friends were decorated for a
    GPU otherwise, and the first kernel call failed with 'Cannot call @triton.jit'd outside of the scope of a
    kernel'). `sweep` ran already: it times in helper processes started after the variable was set."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", NORMTUNE_HOME=str(tmp_path / "home"))
    # 64x256: the shape both tables were fitted on, where GOOD and BAD differ and so are timed.
    common = ["--interpret", "--norm", "rms_norm", "--shapes", "64x256" if command == "compare" else "8x64"]
    if command == "compare":
        args = ["compare", write_table(tmp_path / "old.json", GOOD), write_table(tmp_path / "new.json", BAD),
                "--rounds", "1", "--threshold", "0.99", *common]
    elif command == "bench":
        args = ["bench", "--out", str(tmp_path / "out"), *common]
    else:
        args = ["validate", "--trials", "1", "--rounds", "1", "--db", f"sqlite:///{tmp_path / 'v.db'}", "--out",
                str(tmp_path / "out"), *common]
    result = subprocess.run([sys.executable, "-c", "from normtune.cli import app; app(prog_name='normtune')", *args],
                            env=env, capture_output=True, text=True, timeout=300)
    assert "Cannot call @triton.jit" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    if command == "compare":  # exits 1 where NEW is slower; either way both tables' configs were timed
        assert result.returncode in (0, 1) and "| rms_norm 64×256 bf16 | –" not in result.stdout, result.stdout
        assert "geometric-mean NEW ÷ OLD over the timed shapes –" not in result.stdout, result.stdout
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert (tmp_path / "out" / ("bench.csv" if command == "bench" else "validate.json")).is_file()


def test_compare_takes_the_gated_presets_and_names_each_rows_form():
    """--shapes qwen3-next (a gated preset, as sweep and tune take it) gates a table's gated families: each row
    names its gate. The shipped H200 table has them; --dry-run needs no GPU."""
    from normtune.tuner.gated_shapes import preset_problems

    shipped = str(Path(__file__).resolve().parents[1] / "configs" / "h200.json")
    dry = runner.invoke(app, ["compare", "default", shipped, "--gpu", "h200", "--shapes", "qwen3-next,4096x4096",
                              "--dry-run"])
    assert dry.exit_code == 0, dry.output
    total = len(preset_problems("qwen3-next", "bf16")) + 2  # and 4096x4096 for both norms
    assert f"of {total} shapes change config" in dry.stdout
    assert "| rms_norm 65536×128 bf16 gate-before-silu |" in dry.stdout
    refused = runner.invoke(app, ["compare", "default", shipped, "--gpu", "h200", "--shapes", "qwen3-next",
                                  "--norm", "layer_norm", "--dry-run"])
    assert refused.exit_code == 1 and "add rms_norm to --norm" in refused.output


def test_a_rows_label_names_its_form():
    from normtune.kernels.config import Problem
    from normtune.tuner.render import problem_label

    assert problem_label(Problem("rms_norm", 64, 256, "bf16")) == "rms_norm 64×256 bf16"
    assert problem_label(Problem("rms_norm", 64, 256, "bf16", residual=True)) == "rms_norm 64×256 bf16 residual"
    assert problem_label(Problem("rms_norm", 64, 256, "bf16", gate="after")) == \
        "rms_norm 64×256 bf16 gate-after-silu"


def test_validate_rows_name_their_form():
    """validate.md (and the report) label a residual or gated problem's row with its form, as compare does."""
    from types import SimpleNamespace

    from normtune.kernels.config import Problem
    from normtune.tuner.render import validation_table

    rows = [SimpleNamespace(problem=Problem("rms_norm", 64, 256, "bf16", **form), times={}, regret=None,
                            speedup_vs_default=None) for form in ({"residual": True}, {"gate": "before"})]
    text = "\n".join(validation_table(rows))
    assert "| rms_norm 64×256 bf16 residual |" in text and "| rms_norm 64×256 bf16 gate-before-silu |" in text
