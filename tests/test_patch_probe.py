"""The layer probe of `patch(model, fuse_residual=True)` is not fooled by patch-time values: a layer whose form
holds only for its parameters' values at patch time, or at one sequence length, or in one dtype, is left unfused
and reported with the reason; the model then trains exactly as the unpatched one, also after those values change.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normtune

from patch_support import check_same, tiny_model, token_ids

pytest.importorskip("transformers")


def _attention(layer, hidden_states, position_embeddings, kwargs):
    out, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states),
                             position_embeddings=position_embeddings, **kwargs)
    return out


class _LayerScale(nn.Module):
    """h = x + gamma * attn, with gamma a Parameter of the layer (1 at patch time)."""

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        h = hidden_states + self.gamma * _attention(self, hidden_states, position_embeddings, kwargs)
        return h + self.mlp(self.post_attention_layernorm(h))


class _ScaleModule(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.scale


class _SubmoduleScale(nn.Module):
    """h = x + scaler(attn), the scale a Parameter of another submodule (1 at patch time)."""

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        h = hidden_states + self.scaler(_attention(self, hidden_states, position_embeddings, kwargs))
        return h + self.mlp(self.post_attention_layernorm(h))


class _BranchesOnLength(nn.Module):
    """The pre-norm form for short sequences only."""

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        a = _attention(self, hidden_states, position_embeddings, kwargs)
        h = hidden_states + (a if hidden_states.shape[1] <= 4 else 0.5 * a)
        return h + self.mlp(self.post_attention_layernorm(h))


class _BranchesOnDtype(nn.Module):
    """The pre-norm form in float32 only."""

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        a = _attention(self, hidden_states, position_embeddings, kwargs)
        h = hidden_states + (a if hidden_states.dtype == torch.float32 else 0.5 * a)
        return h + self.mlp(self.post_attention_layernorm(h))


def _modified(model, cls, **attributes):
    layer = model.model.layers[0]
    layer.__class__ = type(cls.__name__, (cls, type(layer)), {})
    for name, value in attributes.items():
        setattr(layer, name, value)
    return layer


CASES = {
    "layer scale parameter": (_LayerScale, lambda n: {"gamma": nn.Parameter(torch.ones(n))}, "gamma",
                              "not the pre-norm form's"),
    "scale in another submodule": (_SubmoduleScale, lambda n: {"scaler": _ScaleModule(n)}, "scaler.scale",
                                   "not the pre-norm form's"),
    "branch on sequence length": (_BranchesOnLength, lambda n: {}, None, "not the pre-norm form's"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_layer_matching_the_form_only_at_patch_time_is_left_unfused(case, device, tolerance, assert_close):
    cls, attributes, changed, reason = CASES[case]
    model = tiny_model("llama", device)
    _modified(model, cls, **attributes(model.config.hidden_size))
    model.to(device)
    reference = copy.deepcopy(model)
    report = normtune.patch(model, fuse_residual=True)
    assert list(report.unfused) == ["model.layers.0"] and reason in report.unfused["model.layers.0"], str(report)
    if changed:
        for m in (model, reference):
            with torch.no_grad():
                m.model.layers[0].get_parameter(changed).fill_(0.25)
    check_same(model, reference, token_ids(model, tokens=6), tolerance(torch.float32), assert_close)


def test_a_layer_branching_on_dtype_is_left_unfused_in_a_float32_model(device, tolerance, assert_close):
    """The model is float32, yet autocast hands the layer bfloat16: the probe tries both."""
    model = tiny_model("llama", device)
    _modified(model, _BranchesOnDtype)
    report = normtune.patch(model, fuse_residual=True)
    assert list(report.unfused) == ["model.layers.0"], str(report)
    assert "not the pre-norm form's" in report.unfused["model.layers.0"]


def test_a_layer_owning_a_parameter_the_probe_cannot_vary_is_left_unfused(device):
    model = tiny_model("llama", device)
    layer = model.model.layers[0]
    layer.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64, device=device), requires_grad=False)
    report = normtune.patch(model, fuse_residual=True)
    assert list(report.unfused) == ["model.layers.0"], str(report)
    assert "a parameter the probe cannot vary (steps: Parameter of torch.int64" in report.unfused["model.layers.0"]


def test_the_probe_leaves_the_layers_parameters_as_they_were(device):
    model = tiny_model("llama", device)
    layer = _modified(model, _LayerScale, gamma=nn.Parameter(torch.full((model.config.hidden_size,), 1.0)))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = dict(model.named_parameters())
    normtune.patch(model, fuse_residual=True)
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert layer.gamma is params["model.layers.0.gamma"]
