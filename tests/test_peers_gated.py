"""The gated RMSNorm peers and their float64 reference, on tiny CPU problems (Triton's interpreter for fla)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from normtune.tuner.gated_shapes import GatedProblem
from normtune.tuner.measure import peers_gated as pg

HAS_FLA = importlib.util.find_spec("fla") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def test_reference_matches_the_two_gate_positions_written_out():
    x, z, w = torch.randn(6, 32, dtype=torch.float64), torch.randn(6, 32, dtype=torch.float64), \
        torch.randn(32, dtype=torch.float64)
    before = pg.gated_rms_norm_reference(x, z, w, GatedProblem(6, 32, "before", eps=1e-5))
    torch.testing.assert_close(before, F.rms_norm(x, (32,), w, 1e-5) * F.silu(z))
    after = pg.gated_rms_norm_reference(x, z, w, GatedProblem(6, 32, "after", 8, eps=1e-5))
    h = (x * F.silu(z)).view(6, 4, 8)
    torch.testing.assert_close(after, F.rms_norm(h, (8,), None, 1e-5).view(6, 32) * w)
    zc = pg.gated_rms_norm_reference(x, z, w, GatedProblem(6, 32, "before", zero_centered=True,
                                                           activation="sigmoid", eps=1e-5))
    torch.testing.assert_close(zc, F.rms_norm(x, (32,), 1 + w, 1e-5) * torch.sigmoid(z))


def test_floor_is_three_passes_forward_and_five_backward_plus_the_weight():
    fwd, bwd = pg.floor_bytes(GatedProblem(4, 8, dtype="bf16"))
    assert (fwd, bwd) == (3 * 32 * 2 + 8 * 2, 5 * 32 * 2 + 2 * 8 * 2)
    assert pg.floor_us(2000, 2.0) == 1.0 and pg.floor_us(2000, float("nan")) != pg.floor_us(2000, float("nan"))


def test_supports_and_parse():
    assert "after" in pg.FlaGated().supports(GatedProblem(4, 8, "after"))
    assert "silu" in pg.FlaFn().supports(GatedProblem(4, 8, activation="sigmoid"))
    assert "whole width" in pg.TransformersEager().supports(GatedProblem(4, 8, "before", 4))
    assert pg.FlaFn().supports(GatedProblem(4, 8, "before", 4)) is None
    assert "zero-centred" in pg.TransformersEager().supports(GatedProblem(4, 8, zero_centered=True))
    assert "silu only" in pg.TransformersEager().supports(GatedProblem(4, 8, "after", activation="sigmoid"))
    assert pg.parse_gated_peers("all") == list(pg.GATED_PEERS)
    with pytest.raises(ValueError, match="allowed: all, hf-eager"):
        pg.parse_gated_peers("hf-eager,nope")


def test_missing_library_is_unavailable_not_an_import_error(monkeypatch):
    monkeypatch.setattr(pg.MambaSsm, "module", "normtune_no_such_module.layernorm_gated")
    problem = GatedProblem(4, 8, "after", dtype="fp32")
    with pytest.raises(pg.PeerUnavailable, match="pip install mamba-ssm"):
        pg.MambaSsm().prepare(problem, pg.make_inputs(problem, "cpu"))


def _check(peer, problem):
    inputs = pg.make_inputs(problem, "cpu")
    prepared = peer.prepare(problem, inputs)
    errors = pg.check(problem, prepared, pg.reference(problem, inputs))
    assert pg.within_tolerance(problem, errors), errors
    # the backward alone gives the block's gradients
    for a, b in zip(prepared.backward(), prepared.block()):
        torch.testing.assert_close(a, b)
    return errors


PROBLEMS = [GatedProblem(12, 64, "before", dtype="fp32"), GatedProblem(12, 96, "after", 32, dtype="fp32"),
            GatedProblem(12, 64, "before", dtype="fp32", activation="sigmoid"),
            GatedProblem(8, 64, "after", dtype="bf16"), GatedProblem(8, 64, "before", dtype="bf16")]


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"{p.label()} {p.activation}")
def test_transformers_eager_modules_match_the_reference(problem):
    errors = _check(pg.TransformersEager(), problem)
    if problem.dtype == "fp32":
        assert max(errors.values()) < 1e-5


@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention is not installed")
@pytest.mark.parametrize("peer, problem", [
    (pg.FlaGated(), GatedProblem(8, 64, "before", dtype="fp32")),
    (pg.FlaGated(), GatedProblem(8, 64, "before", dtype="fp32", activation="sigmoid")),
    (pg.FlaFn(), GatedProblem(8, 64, "after", 16, dtype="fp32")),
    (pg.FlaFn(), GatedProblem(8, 64, "before", 32, dtype="bf16")),
], ids=lambda v: v.name if isinstance(v, pg.GatedPeer) else v.label() + " " + v.activation)
def test_fla_kernels_match_the_reference_in_the_interpreter(peer, problem, monkeypatch):
    from triton.runtime import autotuner

    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", autotuner.Autotuner.prune_configs)  # undone after
    pg.first_config_autotune()
    _check(peer, problem)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_compiled_module_with_dynamic_rows_compiles_once_per_width_and_matches_the_reference():
    import torch._dynamo

    torch._dynamo.reset()
    peer = pg.TransformersCompile(dynamic_rows=True)
    for rows in (8, 24):
        _check(peer, GatedProblem(rows, 64, "after", 32, dtype="fp32"))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _check(peer, GatedProblem(40, 64, "after", 32, dtype="fp32"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # no recompile for new rows


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_prepare_peer_on_given_tensors():
    x, z, dy = (torch.randn(6, 32) for _ in range(3))
    w = torch.rand(32) + 0.5
    prepared = pg.prepare_peer("hf-eager", x, z, w, dy, gate_position="after", group_size=8, eps=1e-6)
    problem = GatedProblem(6, 32, "after", 8, "fp32", 1e-6)
    ref = pg.reference(problem, pg.GatedInputs(x, z, w, dy))
    assert max(pg.check(problem, prepared, ref).values()) < 1e-5
    with pytest.raises(pg.PeerUnavailable, match="whole width"):
        pg.prepare_peer("hf-eager", x, z, w, dy, gate_position="before", group_size=8)
    with pytest.raises(ValueError, match="rows × width"):
        pg.prepare_peer("hf-eager", x, z, w[:4], dy, gate_position="after")
    with pytest.raises(ValueError, match="allowed: hf-eager"):
        pg.prepare_peer("nope", x, z, w, dy, gate_position="after")
