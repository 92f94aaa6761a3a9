"""Gated RMSNorm problems, shape sets and the gated norms read from hybrid models' config.json."""

from __future__ import annotations

import json

import pytest

from normtune.tuner import gated_shapes as gs
from normtune.tuner.gated_shapes import GatedModel, GatedProblem


def test_problem_rejects_bad_input_naming_the_argument():
    for kwargs, word in (({"group_size": 48}, "group_size"), ({"gate_position": "middle"}, "gate_position"),
                         ({"activation": "gelu"}, "activation"), ({"dtype": "fp8"}, "dtype")):
        with pytest.raises(ValueError, match=word):
            GatedProblem(16, 128, **kwargs)
    with pytest.raises(ValueError, match="M >= 1"):
        GatedProblem(0, 128)
    assert GatedProblem(16, 128).group == 128 and GatedProblem(16, 128, "after", 32).group == 32


def test_issue_set_is_the_issues_eight_shapes():
    shapes = gs.issue_set()
    assert len(shapes) == 8
    assert shapes[0] == GatedProblem(32768, 128, "before")
    assert GatedProblem(4096, 8192, "after", 1024) in shapes
    assert all(p.dtype == "bf16" for p in shapes)


def test_model_sets_are_rows_times_heads_and_d_inner_groups_without_repeats():
    qwen = gs.model_set(gs.QWEN3_NEXT_MODELS, tokens=(2048,))
    # Qwen3-Next-80B and Qwen3.5-9B share 32 heads of 128: one problem
    assert [(p.M, p.N) for p in qwen] == [(2048 * 32, 128), (2048 * 48, 128), (2048 * 64, 128), (2048 * 32, 256)]
    assert all(p.gate_position == "before" and p.group == p.N for p in qwen)
    mamba = gs.model_set(gs.MAMBA2_MODELS, tokens=(2048, 32768))
    assert GatedProblem(32768, 8192, "after", 1024) in mamba and GatedProblem(2048, 5120, "after") in mamba
    assert all(p.gate_position == "after" for p in mamba) and len(mamba) == 8
    both = gs.gated_set(["issue", "qwen3-next", "mamba2", "issue"])
    assert len(both) == len(set(both))
    with pytest.raises(ValueError, match="allowed: issue"):
        gs.gated_set(["nope"])


QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 2048, "linear_num_value_heads": 32,
              "linear_value_head_dim": 128, "linear_num_key_heads": 16, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("config, expected", [
    (QWEN3_NEXT, [GatedModel("qwen3_next", 128, 32, 128, "before")]),
    ({"model_type": "qwen3_5", "text_config": {**QWEN3_NEXT, "model_type": "qwen3_5_text",
                                               "linear_num_value_heads": 48}},
     [GatedModel("qwen3_5_text", 128, 48, 128, "before")]),
    ({"model_type": "mamba2", "hidden_size": 2560, "expand": 2, "n_groups": 1, "num_heads": 80, "head_dim": 64},
     [GatedModel("mamba2", 5120, 1, 5120, "after")]),
    ({"model_type": "bamba", "hidden_size": 4096, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 128,
      "mamba_d_head": "auto"}, [GatedModel("bamba", 8192, 1, 8192, "after")]),
    ({"model_type": "nemotron_h", "hidden_size": 4096, "expand": 2, "n_groups": 8, "mamba_num_heads": 128,
      "mamba_head_dim": 64}, [GatedModel("nemotron_h", 8192, 1, 1024, "after")]),
    ({"model_type": "granitemoehybrid", "hidden_size": 1536, "mamba_expand": 2, "mamba_n_groups": 1,
      "mamba_n_heads": 48, "mamba_d_head": 64}, [GatedModel("granitemoehybrid", 3072, 1, 3072, "after")]),
    ({"model_type": "falcon_h1", "hidden_size": 1024, "mamba_d_ssm": 1536, "mamba_n_groups": 1,
      "mamba_rms_norm": True, "mamba_norm_before_gate": False}, [GatedModel("falcon_h1", 1536, 1, 1536, "after")]),
    ({"model_type": "falcon_h1", "hidden_size": 1024, "mamba_expand": 2, "mamba_rms_norm": False}, []),
    ({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32}, []),
])
def test_gated_norms_from_configs(config, expected):
    assert gs.gated_norms(config) == expected


def test_gated_problems_from_a_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_NEXT))
    assert gs.gated_problems_from_config(tmp_path, tokens=(1024, 4096)) == [
        GatedProblem(32768, 128, "before"), GatedProblem(131072, 128, "before")]
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="no gated RMSNorm"):
        gs.gated_problems_from_config(path)
    path.write_text(json.dumps({"model_type": "mamba2", "hidden_size": 64, "expand": 2, "n_groups": 3}))
    with pytest.raises(ValueError, match="n_groups 3 does not divide"):
        gs.gated_problems_from_config(path)
