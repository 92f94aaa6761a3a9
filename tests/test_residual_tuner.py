"""The tuner's side of the residual form: residual problems are their own families in the store and on the
command line, the measurement harness times the residual backward (dh in, h's whole gradient out) behind the
correctness gate, and the byte model counts 4 passes each way."""

from __future__ import annotations

import math

import pytest
from sweep_support import INTERPRETER_ONLY

from normtune.commands.common import CLIError, problems_option, with_residual
from normtune.kernels.config import Problem, default_config
from normtune.tuner.measure.cases import gate, make_case
from normtune.tuner.measure.harness import MeasureResult, measure_config
from normtune.tuner.measure.results import floor_bytes, forward_floor_bytes
from normtune.tuner.store.database import Store
from normtune.tuner.gpu_info import DeviceInfo

RES = Problem("rms_norm", 4096, 4096, "bf16", residual=True)
RES32 = Problem("layer_norm", 4096, 4096, "bf16", residual=True, residual_dtype="fp32")


def test_byte_model_counts_four_passes_each_way():
    MN = 4096 * 4096
    assert floor_bytes(Problem("rms_norm", 4096, 4096, "bf16")) == 3 * MN * 2
    assert floor_bytes(RES) == 4 * MN * 2  # dy, h, dh read; dx written
    assert floor_bytes(RES32) == MN * (2 + 3 * 4)  # dy bf16; h, dh, dx fp32
    out = Problem("rms_norm", 4096, 4096, "bf16", save="output", residual=True, residual_dtype="fp32")
    assert floor_bytes(out) == MN * (2 + 2 + 2 * 4)  # y (bf16) saved instead of h
    assert forward_floor_bytes(RES) == 4 * MN * 2  # x, residual read; h, y written
    assert forward_floor_bytes(RES32) == MN * (2 * 2 + 2 * 4)
    assert forward_floor_bytes(Problem("rms_norm", 4096, 4096, "bf16")) == 2 * MN * 2


@pytest.mark.parametrize("problem", [Problem("rms_norm", 9, 40, "bf16", residual=True),
                                     Problem("layer_norm", 6, 33, "bf16", residual=True, residual_dtype="fp32",
                                             save="output")], ids=lambda p: p.key)
def test_harness_times_the_residual_backward_behind_the_gate(problem, device):
    case = make_case(problem, device, seed=3)
    assert case.dh is not None and case.dh.dtype == case.x.dtype  # x is h here: the saved stream
    r = measure_config(case, default_config(problem), flusher=None, bandwidth_gbps=1000.0, warmup=0, min_reps=2,
                       max_reps=2, budget_s=0.0)
    assert r.status == "ok", r.error
    assert r.floor_us == pytest.approx(floor_bytes(problem) / 1e6)
    assert math.isfinite(r.median_us) and r.median_us > 0
    # The gate checks h's whole gradient: a grad_input without dh is refused.
    dx, dw, db = case.launch(default_config(problem)).run()
    passed, _, _ = gate(problem, (dx - case.dh.to(dx.dtype), dw, db), case.reference())
    assert not passed, "the gate must see a missing dh"


def test_store_keeps_residual_problems_apart(tmp_path):
    info = DeviceInfo(name="cpu (triton interpreter)", key="interpret", compute_capability=None, sm_count=4,
                      l2_bytes=2**20, memory_bytes=2**30, driver=None, cuda=None, torch="2", triton="3",
                      normtune="0", git_revision=None, host="h", python="3", interpret=True)
    plain = Problem("rms_norm", 64, 256, "bf16")
    problems = [plain, RES.with_shape(64, 256), RES32.with_shape(64, 256)]
    result = MeasureResult(status="ok", median_us=10.0, p10_us=9.0, p90_us=11.0, reps=3)
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        run = store.start_run(info, kind="sweep", command_line="x")
        ids = {store.problem_id(p) for p in problems}
        assert len(ids) == 3
        for p in problems:
            store.add_measurement(run, p, default_config(p), result, source="sweep")
        assert sorted(store.problems(), key=lambda p: p.key) == sorted(problems, key=lambda p: p.key)
        by_family = store.measurements(family_key=RES.family.key)
        assert [m.problem for m in by_family] == [RES.with_shape(64, 256)]


def test_cli_problems_in_the_residual_form():
    problems, _ = problems_option("64x256", None, None, "rms_norm,layer_norm", "bf16", None, interpret=True,
                                  residual=True, residual_dtype="fp32")
    assert [p.residual_dtype for p in problems] == ["fp32", "fp32"]
    assert all(p.family.key.endswith("/res-fp32") for p in problems)
    plain, _ = problems_option("64x256", None, None, "rms_norm", "bf16", None, interpret=True)
    assert not plain[0].residual
    with pytest.raises(CLIError, match="add --residual"):
        with_residual(plain, False, "fp32")
    with pytest.raises(CLIError, match="--residual-dtype bf16: .*fp32 or the activation dtype"):
        with_residual([Problem("rms_norm", 4, 8, "fp32")], True, "bf16")
    with pytest.raises(CLIError, match="--residual-dtype"):
        with_residual(plain, True, "int8")


def test_where_names_the_residual_family():
    from typer.testing import CliRunner

    from normtune.cli import app

    result = CliRunner().invoke(app, ["where", "--gpu", "h100", "--shape", "4096x4096", "--residual",
                                      "--residual-dtype", "fp32", "--json"])
    assert result.exit_code == 0, result.output
    assert '"problem": "rms_norm/bf16/wbf16/nobias/save-input/res-fp32/4096x4096"' in result.output
    assert '"source": "table"' in result.output  # the plain family's rules answer until residual rules exist



@INTERPRETER_ONLY
def test_interpreted_sweep_and_emit_keep_the_residual_family(tmp_path):
    """`sweep --residual` stores residual problems under their own family, and `emit` writes that family's rules
    beside (not into) the plain family's; the emitted table answers the residual problem with its own rules."""
    import json

    from typer.testing import CliRunner

    from normtune.cli import app
    from normtune.kernels.select.tables import load_table

    url = f"sqlite:///{tmp_path / 'r.db'}"
    runner = CliRunner()
    for extra in (["--residual", "--residual-dtype", "fp32"], []):
        result = runner.invoke(app, ["sweep", "--interpret", "--norm", "rms_norm", "--shapes", "8x96", "--trials",
                                     "2", "--sampler", "random", "--db", url, *extra])
        assert result.exit_code == 0, result.output
    with Store(url) as store:
        keys = {p.family.key for p in store.problems()}
    res_key = "rms_norm/bf16/wbf16/nobias/save-input/res-fp32"
    assert keys == {"rms_norm/bf16/wbf16/nobias/save-input", res_key}
    out = tmp_path / "t.json"
    emitted = runner.invoke(app, ["emit", "--interpret", "--db", url, "--out", str(out)])
    assert emitted.exit_code == 0, emitted.output
    assert set(json.loads(out.read_text())["families"]) == keys
    table = load_table(str(out))
    problem = Problem("rms_norm", 8, 96, "bf16", residual=True, residual_dtype="fp32")
    assert table.match(problem).family_key == res_key
