"""`patch(model)` on the gated RMSNorms of transformers' hybrid models (`patching/patch_gated.py`): each class the
installed transformers has is replaced by a GatedRMSNorm of the form its probe finds (gate before or after, groups
from its own attributes), holding the same Parameter; outputs and gradients match the original's; a call without a
gate is the norm alone; a tiny Mamba-2 model built locally trains the same patched; a look-alike is reported."""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest
import torch
from torch import nn

from normtune.kernels import GatedRMSNorm, patch

N = 16
# (module, class, constructor, the form expected: (gate position, group size or None))
CLASSES = [
    ("qwen3_next", "Qwen3NextRMSNormGated", lambda c: c(N, eps=1e-6), ("before", None)),
    ("qwen3_5", "Qwen3_5RMSNormGated", lambda c: c(N, eps=1e-6), ("before", None)),
    ("mamba2", "MambaRMSNormGated", lambda c: c(N, 4, eps=1e-6), ("after", 4)),
    ("bamba", "BambaRMSNormGated", lambda c: c(N, 8), ("after", 8)),
    ("nemotron_h", "NemotronHRMSNormGated", lambda c: c(N, N), ("after", None)),
    ("falcon_h1", "FalconH1RMSNormGated", lambda c: c(N, n_groups=2, norm_before_gate=True), ("before", 8)),
    ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", lambda c: c(N, 4), ("after", 4)),
]


def _class(module: str, name: str):
    try:
        return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"the installed transformers has no {name}")


def _run(norm, x, z):
    xl, zl = x.detach().requires_grad_(), z.detach().requires_grad_()
    norm.weight.grad = None
    y = norm(xl, zl)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=torch.float32)).view(y.shape))
    return [y, xl.grad, zl.grad, norm.weight.grad.clone()]


@pytest.mark.parametrize("module,name,make,form", CLASSES, ids=[c[1] for c in CLASSES])
def test_transformers_gated_norms_are_replaced_and_match(module, name, make, form):
    original = make(_class(module, name))
    with torch.no_grad():
        original.weight.normal_()
    model = nn.Sequential(nn.Linear(N, N), original)
    x, z = torch.randn(2, 3, N), 2 * torch.randn(2, 3, N)
    want = _run(original, x, z)
    weight = original.weight
    report = patch(model)
    new = model[1]
    assert report.replaced == {name: 1} and isinstance(new, GatedRMSNorm) and new.weight is weight
    assert (new.gate_position, new.group_size) == form and new.variance_epsilon == original.variance_epsilon
    for a, b in zip(_run(new, x, z), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if inspect.signature(type(original).forward).parameters["gate"].default is None:  # a call without a gate
        torch.testing.assert_close(new(x), original(x, None), rtol=1e-5, atol=1e-5)


def test_a_tiny_mamba2_model_trains_the_same_patched():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=8, expand=2, head_dim=8,
                          num_heads=4, n_groups=2, conv_kernel=4, chunk_size=8)
    model = Mamba2ForCausalLM(config).float()
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = model(ids, labels=ids).loss
        before.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        report = patch(model)
        calls = []
        for m in model.modules():
            if isinstance(m, GatedRMSNorm):
                m.register_forward_hook(lambda *_: calls.append(1))
        after = model(ids, labels=ids).loss
        after.backward()
    assert report.replaced == {"Mamba2RMSNorm": 3, "MambaRMSNormGated": 2} and len(calls) == 2
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


class SwappedGateNorm(nn.Module):
    """A look-alike: the gate's silu applied to x's rows after a shift, which no gated form computes."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states, gate=None):
        h = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h * (1.0 if gate is None else nn.functional.silu(gate + 1.0))


def test_a_look_alike_is_left_alone_and_reported():
    model = nn.Sequential(SwappedGateNorm(N))
    with pytest.raises(ValueError, match="matches no gated RMSNorm") as info:
        patch(model)
    assert "\n" not in str(info.value)
    report = patch(model, strict=False)
    assert type(model[0]) is SwappedGateNorm and "matches no gated RMSNorm" in report.skipped["0"]
