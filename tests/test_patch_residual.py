"""`normtune.patch(model, fuse_residual=True)`: the residual adds of transformers' decoder layers fused into their
norms (Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma2, Gemma3), layer ends handed over to the next layer's input norm,
the same Parameter objects, logits and every gradient as the unpatched model; layers whose forward is not exactly
a pre-norm or sandwich layer left alone and reported; the hand-over refused for any other input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normtune
from normtune.kernels import RMSNorm
from normtune.kernels.api import forward_calls
from normtune.kernels.patching import patch_residual
from normtune.kernels.api.forms import RESIDUAL

from patch_support import TINY, check_same as _check_same, logits_and_grads as _logits_and_grads, \
    tiny_model as _model, token_ids as _ids

transformers = pytest.importorskip("transformers")

# model_type -> its decoder layer class
LAYERS = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer",
          "mistral": "MistralDecoderLayer", "gemma": "GemmaDecoderLayer", "gemma2": "Gemma2DecoderLayer",
          "gemma3_text": "Gemma3DecoderLayer"}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Counts:
    """How often the fused form and each norm module's own forward run."""

    def __init__(self, monkeypatch):
        self.fused, self.norms = 0, []
        fused, forward = patch_residual.fused_add_norm, RMSNorm.forward

        def counting_fused(*args):
            self.fused += 1
            return fused(*args)

        def counting_forward(norm, x):
            self.norms.append(norm)
            return forward(norm, x)

        monkeypatch.setattr(patch_residual, "fused_add_norm", counting_fused)
        monkeypatch.setattr(RMSNorm, "forward", counting_forward)


@pytest.mark.parametrize("model_type", list(LAYERS))
def test_decoder_layers_are_fused_exactly(model_type, device, tolerance, assert_close, monkeypatch):
    model = _model(model_type, device)
    reference = copy.deepcopy(model)
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    report = normtune.patch(model, fuse_residual=True)
    assert report.fused == {LAYERS[model_type]: 2} and report.chained == 2 and report.unfused == {}, str(report)
    assert {name: p for name, p in model.named_parameters()} == params  # the very Parameter objects
    assert all(p is params[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    layers = model.model.layers
    assert all(type(layer).__name__ == LAYERS[model_type] for layer in layers)
    assert isinstance(layers[0], type(reference.model.layers[0]))  # a subclass: isinstance checks still hold
    counts = _Counts(monkeypatch)
    _check_same(model, reference, _ids(model), tolerance(torch.float32), assert_close)
    # Per layer one fused add + norm, plus each layer's end fused with the next norm (layer 1's input norm, the
    # final norm), whose forward then does not normalize again.
    assert counts.fused == 4
    assert layers[0].input_layernorm in counts.norms and layers[1].input_layernorm not in counts.norms
    assert model.model.norm not in counts.norms
    fused_norm = "pre_feedforward_layernorm" if model_type in ("gemma2", "gemma3_text") else "post_attention_layernorm"
    assert all(getattr(layer, fused_norm) not in counts.norms for layer in layers)


def test_fused_model_trains_like_the_original_in_bf16(device, tolerance, relative_error):
    """bf16: no further from the fp32 model than transformers' own bf16 model is, plus the kernels' bf16 tolerance."""
    model = _model("llama", device, torch.bfloat16)
    unpatched, fp32 = copy.deepcopy(model), copy.deepcopy(model).float()
    normtune.patch(model, fuse_residual=True)
    ids = _ids(model)
    (ours, our_grads), (theirs, their_grads), (exact, exact_grads) = (
        _logits_and_grads(m, ids) for m in (model, unpatched, fp32))
    tol = tolerance(torch.bfloat16)
    assert relative_error(ours, exact) <= tol + relative_error(theirs, exact)
    for name, grad in exact_grads.items():
        assert relative_error(our_grads[name], grad) <= tol + relative_error(their_grads[name], grad), name


@pytest.mark.parametrize("plans", ["cold", "warm"])
def test_gradient_checkpointing_turns_the_handover_off(plans, device, tolerance, assert_close, monkeypatch):
    model = _model("llama", device)
    reference = copy.deepcopy(model)
    normtune.patch(model, fuse_residual=True)
    ids = _ids(model)
    forward_calls.clear()  # cold: the checkpointed forward holds the norms' first calls, the recompute planned ones
    if plans == "warm":  # warm: both are planned calls
        _logits_and_grads(model, ids)
        assert any(len(sig) > 10 and sig[10] == RESIDUAL.name for sig in forward_calls._PLANS)
    for m in (model, reference):
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        m.train()
    counts = _Counts(monkeypatch)
    _check_same(model, reference, ids, tolerance(torch.float32), assert_close)
    assert counts.fused >= 2 and model.model.layers[1].input_layernorm in counts.norms


def test_an_input_changed_in_place_is_normalized_again(device, tolerance, assert_close):
    """Layer 1 gets layer 0's output scaled in place (a pre-hook): the handed-over norm no longer applies."""
    model = _model("llama", device)
    reference = copy.deepcopy(model)
    normtune.patch(model, fuse_residual=True)
    for m in (model, reference):
        m.model.layers[1].register_forward_pre_hook(lambda mod, args: args[0].mul_(1.5))
    with torch.no_grad():
        logits, ref = (m(input_ids=_ids(model)).logits for m in (model, reference))
    assert_close(logits, ref, tolerance(torch.float32), "logits")


class _ScaledResidual(nn.Module):
    """A decoder layer whose forward scales the attention branch: no longer the pre-norm form."""

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                          position_embeddings=position_embeddings, **kwargs)
        hidden_states = residual + 0.5 * hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class _DropsAnArgument(nn.Module):
    """A decoder layer whose forward keeps the attention mask from its attention."""

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                          position_embeddings=position_embeddings, **kwargs)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


@pytest.mark.parametrize("modified,reason", [(_ScaledResidual, "not the pre-norm form's"),
                                             (_DropsAnArgument, "calls self_attn or mlp otherwise")])
def test_a_layer_with_a_modified_forward_is_left_alone(modified, reason, device, tolerance, assert_close):
    model = _model("llama", device)
    layer = model.model.layers[0]
    layer.__class__ = type("Modified", (modified, type(layer)), {})
    reference = copy.deepcopy(model)
    report = normtune.patch(model, fuse_residual=True)
    assert list(report.unfused) == ["model.layers.0"] and reason in report.unfused["model.layers.0"], str(report)
    assert report.fused == {"LlamaDecoderLayer": 1} and report.chained == 1  # layer 1 to the final norm
    assert type(model.model.layers[0]) is type(reference.model.layers[0])  # the class patch() found
    assert "unfused model.layers.0: Modified: its" in str(report)
    _check_same(model, reference, _ids(model), tolerance(torch.float32), assert_close)


def test_layers_whose_norms_were_not_replaced_are_reported():
    model = _model("qwen2", "cpu")
    report = normtune.patch(model, rms_norm=False, fuse_residual=True)
    assert report.fused == {} and set(report.unfused) == {"model.layers.0", "model.layers.1"}
    assert all("not one of normtune's norms" in why for why in report.unfused.values())


def test_patching_again_keeps_the_fusion(device, tolerance, assert_close):
    model = _model("gemma2", device, num_hidden_layers=1)
    reference = copy.deepcopy(model)
    normtune.patch(model, fuse_residual=True)
    cls = type(model.model.layers[0])
    again = normtune.patch(copy.deepcopy(model), fuse_residual=True)
    assert again.fused == {} and again.unfused == {} and again.total == 0
    assert type(model.model.layers[0]) is cls and cls._normtune_form == "sandwich"
    _check_same(model, reference, _ids(model, tokens=4), tolerance(torch.float32), assert_close)


def test_fuse_residual_must_be_a_bool():
    with pytest.raises(TypeError, match="fuse_residual must be True or False"):
        normtune.patch(nn.Linear(2, 2), fuse_residual="yes")


class _Attention(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.proj = nn.Linear(n, n)

    def forward(self, hidden_states, mask=None, **kwargs):
        return torch.tanh(self.proj(hidden_states)) if mask is None else hidden_states * mask, None


class _ToyLayer(nn.Module):
    """A hand-written pre-norm layer with torch LayerNorms (weight and bias) and a dropout on each branch."""

    def __init__(self, n, p):
        super().__init__()
        self.self_attn, self.mlp = _Attention(n), nn.Sequential(nn.Linear(n, 2 * n), nn.GELU(), nn.Linear(2 * n, n))
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(n), nn.LayerNorm(n)
        self.dropout = nn.Dropout(p)

    def forward(self, x, mask=None):
        h = x + self.dropout(self.self_attn(hidden_states=self.input_layernorm(x), mask=mask)[0])
        return h + self.dropout(self.mlp(self.post_attention_layernorm(h)))


@pytest.mark.parametrize("p,fused", [(0.0, True), (0.1, False)])
def test_hand_written_layer_norm_layers(p, fused, device, tolerance, assert_close):
    """LayerNorm layers that are not transformers': fused where exact; a dropout on a branch is not the form."""
    torch.manual_seed(0)
    model = nn.Sequential(_ToyLayer(32, p), _ToyLayer(32, p)).to(device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.eval()  # the dropout is off in eval mode: the outputs compare either way
    reference = copy.deepcopy(model)
    report = normtune.patch(model, fuse_residual=True)
    assert report.replaced == {"LayerNorm": 4}
    if fused:
        assert report.fused == {"_ToyLayer": 2} and report.chained == 1 and report.unfused == {}
    else:
        assert report.fused == {} and set(report.unfused) == {"0", "1"}
        assert "training mode" in report.unfused["0"]
    x = torch.randn(2, 5, 32, device=device)
    grad = torch.randn_like(x)
    outs = []
    for m in (model, reference):
        xs = x.clone().requires_grad_()
        y = m(xs)
        y.backward(grad)
        outs.append([y.detach(), xs.grad] + [q.grad for q in m.parameters()])
    tol = tolerance(torch.float32)
    for i, (a, b) in enumerate(zip(*outs)):
        assert_close(a, b, tol, f"output/gradient {i}")


def test_a_final_norm_uses_a_hand_over_only_for_that_tensor_unchanged(device):
    model = _model("llama", device, num_hidden_layers=1)
    normtune.patch(model, fuse_residual=True)
    norm = model.model.norm
    x = torch.randn(2, 3, TINY["hidden_size"], device=device)
    with torch.no_grad():
        expected = norm(x.clone())
        marker = torch.full_like(expected, 7.0)
        for change, other in ((False, False), (True, False), (False, True)):
            t = x.clone()
            consumer = model.model.layers[0] if other else norm
            t.__dict__[patch_residual._HANDOVER] = patch_residual._Handover(consumer, t, norm, marker)
            if change:
                t.mul_(1.0)  # same values, new version: the hand-over no longer applies
            got = norm(t)
            assert torch.equal(got, marker) == (not change and not other)
            if change or other:
                torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_compiled_fused_model_traces_the_residual_op(device, tolerance, assert_close):
    """torch.compile traces the fused layers in one graph (the hand-over is off there: each norm runs) and matches
    the unpatched model."""
    model = _model("llama", device)
    reference = copy.deepcopy(model)
    normtune.patch(model, fuse_residual=True)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, backend=backend)
    ids = _ids(model)
    (logits, grads), (ref_logits, ref_grads) = _logits_and_grads(compiled, ids), _logits_and_grads(reference, ids)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert targets.count("normtune.norm_residual_forward.default") == 2  # one per layer
    assert targets.count("normtune.norm_forward.default") == 3  # two input norms and the final norm
    tol = tolerance(torch.float32)
    assert_close(logits, ref_logits, tol, "logits")
    for name, grad in ref_grads.items():
        assert_close(grads[name.removeprefix("_orig_mod.")] if name in grads else grads["_orig_mod." + name], grad,
                     tol, f"grad {name}")
