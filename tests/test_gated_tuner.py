"""The tuner's side of the gated RMSNorm: gated problems are families of their own on the command line (the gated
presets of --shapes, a hybrid model's config), the harness times the gated backward (z in, dz out) behind the
correctness gate, the byte model counts 5 passes back and 3 forward, `tune` plans them, and a sweep's results
emit a table whose gated family answers at run time."""

from __future__ import annotations

import json
import math

import pytest
from sweep_support import INTERPRETER_ONLY

from normtune.commands.common import CLIError, problems_option
from normtune.kernels.config import Problem, default_config
from normtune.tuner import gated_shapes as G
from normtune.tuner.measure.cases import gate, make_case
from normtune.tuner.measure.harness import measure_config
from normtune.tuner.measure.results import floor_bytes, forward_floor_bytes

AFTER = Problem("rms_norm", 8, 32, "fp32", gate="after")
HYBRID = {"model_type": "nemotron_h", "hidden_size": 64, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 4,
          "rms_norm_eps": 1e-5, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}


def test_byte_model_counts_five_passes_back_and_three_forward():
    p = Problem("rms_norm", 4096, 128, "bf16", gate="before")
    assert floor_bytes(p) == 5 * 4096 * 128 * 2  # dy, x, z read; dx, dz written
    assert forward_floor_bytes(p) == 3 * 4096 * 128 * 2  # x, z read; y written


def test_a_grouped_call_is_planned_as_the_problem_the_kernels_run():
    """The runtime runs each of a call's groups as M rows of group_size columns (all in one launch of each kernel):
    that is the tuned problem."""
    call = G.GatedProblem(4096, 8192, "after", 1024, "bf16")
    assert call.problem == Problem("rms_norm", 4096, 1024, "bf16", gate="after", gate_activation="silu")
    assert call.problem.family.key == "rms_norm/bf16/wbf16/nobias/save-input/gate-after-silu"
    qwen = G.preset_problems("qwen3-next")
    assert {(p.N, p.gate) for p in qwen} == {(128, "before"), (256, "before")}
    assert Problem("rms_norm", 2048, 1024, "bf16", gate="after") in G.preset_problems("mamba2")  # Nemotron-H
    with pytest.raises(ValueError, match="unknown gated preset 'seed'"):
        G.preset_problems("seed")


@pytest.mark.parametrize("problem", [AFTER, Problem("rms_norm", 6, 40, "bf16", gate="before",
                                                    gate_activation="sigmoid")], ids=lambda p: p.key)
def test_harness_times_the_gated_backward_behind_the_gate(problem, device):
    case = make_case(problem, device, seed=3)
    assert case.z is not None and case.z.shape == case.x.shape
    r = measure_config(case, default_config(problem), flusher=None, bandwidth_gbps=1000.0, warmup=0, min_reps=1,
                       max_reps=1, budget_s=0.0)
    assert r.status == "ok", r.error
    assert set(r.errors) == {"dx", "dw", "dz"}
    assert r.floor_us == pytest.approx(floor_bytes(problem) / 1e6) and math.isfinite(r.median_us)
    # The gate checks z's gradient: a wrong dz is refused.
    launch = case.launch(default_config(problem))
    dx, dw, db = launch.run()
    passed, errors, message = gate(problem, (dx, dw, db, launch.dz * 1.5), case.reference())
    assert not passed and "dz relative error" in message


def test_cli_problems_of_the_gated_presets_and_a_hybrid_config(tmp_path):
    found, _ = problems_option("gated-tiny,64x256", None, None, "rms_norm", "fp32", None, interpret=True)
    assert [p.key for p in found] == [
        "rms_norm/fp32/wfp32/nobias/save-input/64x256",
        "rms_norm/fp32/wfp32/nobias/save-input/gate-before-silu/24x64",
        "rms_norm/fp32/wfp32/nobias/save-input/gate-after-silu/16x32",
        "rms_norm/fp32/wfp32/nobias/save-input/gate-after-silu/8x128"]
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HYBRID))
    found, model = problems_option(None, config, "8", None, None, None, interpret=True, residual=True)
    # The hidden norm in the residual form; the Mamba-2 mixer's norm (width 128 in 4 groups) stays gated.
    assert [p.key for p in found] == ["rms_norm/bf16/wbf16/nobias/save-input/res-bf16/8x64",
                                      "rms_norm/bf16/wbf16/nobias/save-input/gate-after-silu/8x32"]
    only_ln, _ = problems_option(None, config, "8", "layer_norm", None, None, interpret=True)
    assert all(p.gate is None for p in only_ln)
    with pytest.raises(CLIError, match="gated RMSNorm problems; add rms_norm to --norm"):
        problems_option("mamba2", None, None, "layer_norm", None, None, interpret=True)
    with pytest.raises(CLIError, match="--save output: the gated form saves its input"):
        problems_option("qwen3-next", None, None, None, None, None, interpret=True, save="output")


def test_validate_takes_the_gated_presets():
    from normtune.commands.validate import _validation_problems

    problems, _ = _validation_problems("gated-tiny", None, None, None, "bf16", True)
    assert [p.gate for p in problems] == ["before", "after", "after"]


def test_tune_plans_the_gated_families(tmp_path):
    from normtune.commands.tune import _problems
    from normtune.tuner.tune.plan import Plan

    problems, _ = _problems("gated-tiny", None, None, None, "bf16,fp32", "plain,residual,gated", True)
    assert all(p.gate is not None for p in problems) and len(problems) == 6  # no plain shapes asked for
    plan = Plan("interpret", True, tuple(problems), trials=2)
    assert len({p.family.key for p in plan.problems}) == 4  # 2 positions x 2 dtypes
    mixed, _ = _problems("gated-tiny,64x256", None, None, "rms_norm", None, "plain,gated", True)
    assert [p.gate for p in mixed] == [None, "before", "after", "after"]
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HYBRID))
    model, notes = _problems(None, config, "8", None, None, "plain,residual,gated", True)
    assert [p.gate for p in model] == [None, None, "after"] and model[1].residual
    assert "gated RMSNorm (the norm after the gate) 32 wide" in notes[0]
    plain_only, _ = _problems("gated-tiny,64x256", None, None, "rms_norm", None, "plain,residual", True)
    assert [p.key for p in plain_only] == ["rms_norm/bf16/wbf16/nobias/save-input/64x256",
                                           "rms_norm/bf16/wbf16/nobias/save-input/res-bf16/64x256"]


@INTERPRETER_ONLY
def test_interpreted_sweep_emit_and_selection_of_a_gated_family(tmp_path, monkeypatch):
    """`sweep --shapes-from` a hybrid config stores its gated problem under its own family; `emit` writes that
    family's rules beside the plain one's, and the runtime's selection answers the gated problem from them."""
    from typer.testing import CliRunner

    from normtune.cli import app
    from normtune.kernels.select import clear_caches, explain, select_config
    from normtune.kernels.select.table_chain import ENV_VAR
    from normtune.tuner.store.database import Store

    config = tmp_path / "config.json"
    config.write_text(json.dumps(HYBRID))
    url = f"sqlite:///{tmp_path / 'r.db'}"
    runner = CliRunner()
    result = runner.invoke(app, ["sweep", "--interpret", "--shapes-from", str(config), "--tokens", "8", "--trials",
                                 "2", "--sampler", "random", "--db", url])
    assert result.exit_code == 0, result.output
    gated_key = "rms_norm/bf16/wbf16/nobias/save-input/gate-after-silu"
    with Store(url) as store:
        assert {p.family.key for p in store.problems()} == {"rms_norm/bf16/wbf16/nobias/save-input", gated_key}
        assert all(m.status == "ok" and "dz" in m.errors for m in store.measurements(family_key=gated_key))
    out = tmp_path / "t.json"
    emitted = runner.invoke(app, ["emit", "--interpret", "--db", url, "--out", str(out)])
    assert emitted.exit_code == 0, emitted.output
    assert gated_key in json.loads(out.read_text())["families"]
    problem = Problem("rms_norm", 8, 32, "bf16", gate="after")
    why = explain(problem, config_file=str(out))
    assert why.match is not None and why.match.config is not None and why.match.family_key == gated_key, why
    # The runtime reads the table named by its environment variable: the gated problem gets the rule's config.
    monkeypatch.setenv(ENV_VAR, str(out))
    clear_caches()
    try:
        assert select_config(problem) == why.config
    finally:
        monkeypatch.delenv(ENV_VAR)
        clear_caches()


def test_a_sigmoid_gated_call_reads_the_silu_gated_rules_of_its_gate_position():
    """A table tunes silu gates; a sigmoid-gated call makes the same passes over the same tensors, so it reads the
    silu-gated family of its gate position rather than the plain family's rules; a plain call never reads a gated
    family, and a gated call where the table has no gated family reads the plain rules."""
    from normtune.kernels.select.tables import shipped_tables

    tables = shipped_tables()
    gated = [t for t in tables if any("/gate-" in k for k in t.families)]
    assert gated, "a shipped table with gated families"
    for table in tables:
        plain_key = table.family_key(Problem("rms_norm", 4096, 4096, "bf16").family)
        assert "/gate-" not in plain_key
        for position in ("before", "after"):
            sigmoid = Problem("rms_norm", 4096, 128, "bf16", gate=position, gate_activation="sigmoid")
            silu_key = f"rms_norm/bf16/wbf16/nobias/save-input/gate-{position}-silu"
            expected = silu_key if silu_key in table.families else plain_key
            assert table.family_key(sigmoid.family) == expected, (table.path, position)
            assert table.match(sigmoid).family_key == expected
