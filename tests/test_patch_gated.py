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


def test_a_bf16_mamba2_model_whose_scan_hands_its_norm_fp32_trains_patched():
    """Mamba-2's torch path calls its gated norm with the scan's fp32 output, a bf16 gate and bf16 weights:
    transformers' norm promotes to fp32 and so must the patched one (it raised a dtype TypeError). Its gradients
    are as close to the fp32 model's as the unpatched bf16 model's are."""
    import copy

    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=8, expand=2, head_dim=8,
                          num_heads=4, n_groups=2, conv_kernel=4, chunk_size=8)
    reference = Mamba2ForCausalLM(config).float()
    ids = torch.randint(0, 64, (2, 8))
    seen = []

    def grads(model):
        loss = model(ids, labels=ids).loss
        loss.backward()
        out = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        assert all(p.grad.dtype == p.dtype for p in model.parameters())
        return loss.item(), out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss32, g32 = grads(reference)
        unpatched = copy.deepcopy(reference).to(torch.bfloat16)
        hooks = [m.register_forward_hook(lambda _m, args, out: seen.append((args[0].dtype, out.dtype)))
                 for m in unpatched.modules() if type(m).__name__ == "MambaRMSNormGated"]
        loss_b, g_b = grads(unpatched)
        for hook in hooks:
            hook.remove()
        patched = copy.deepcopy(unpatched)
        patched.zero_grad()
        report = patch(patched)
        loss_p, g_p = grads(patched)
    assert seen and all(s == (torch.float32, torch.float32) for s in seen)  # what the case is about
    assert report.replaced == {"Mamba2RMSNorm": 3, "MambaRMSNormGated": 2}
    assert abs(loss_p - loss32) <= 2 * abs(loss_b - loss32) + 2e-3

    def err(g):
        return {n: ((g[n] - r).norm() / r.norm().clamp_min(1e-30)).item() for n, r in g32.items()}

    e_b, e_p = err(g_b), err(g_p)
    assert max(e_p.values()) < 0.1, e_p
    assert sum(e_p.values()) <= 1.5 * sum(e_b.values()) + 0.005 * len(e_p), (e_p, e_b)


@pytest.mark.parametrize("make", [lambda: GatedRMSNorm(32, 1e-6, gate_position="after", group_size=16),
                                  lambda: GatedRMSNorm(32, 1e-6, gate_position="before")])
def test_a_gated_module_promotes_a_narrower_weight_and_gate_to_its_fp32_input(make):
    torch.manual_seed(0)
    norm = make().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(32).bfloat16())
    x = torch.randn(5, 32, requires_grad=True)
    z = torch.randn(5, 32).bfloat16().requires_grad_(True)
    y = norm(x, z)
    x64, z64, w64 = (t.detach().double().requires_grad_(True) for t in (x, z, norm.weight))
    a = torch.nn.functional.silu(z64)
    h = x64 * a if norm.gate_position == "after" else x64
    g = norm.group_size or 32
    hg = h.view(5, 32 // g, g)
    ref = (hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + 1e-6)).view(5, 32) * w64
    ref = ref * a if norm.gate_position == "before" else ref
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn(5, 32)
    y.backward(dy)
    ref.backward(dy.double())
    assert norm.weight.grad.dtype == z.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(norm.weight.grad.double(), w64.grad, rtol=1e-2, atol=1e-2)


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


@pytest.mark.parametrize("cls", ["RMSNorm", "LayerNorm"])
def test_plain_modules_promote_a_narrower_weight_to_their_fp32_input(cls):
    import normtune.kernels as k

    torch.manual_seed(0)
    norm = getattr(k, cls)(24, eps=1e-5).to(torch.bfloat16)
    twin = getattr(nn, cls)(24, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.1 * torch.randn(p.shape).bfloat16())
        twin.load_state_dict(norm.state_dict())
    x = torch.randn(3, 24)
    expected = getattr(torch.nn.functional, cls.replace("Norm", "_norm").lower())(
        x, (24,), *(p.float() for p in twin.parameters()), eps=1e-5)
    y = norm(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in norm.parameters())


@pytest.mark.parametrize("setup", ["checkpointing reentrant", "checkpointing non-reentrant", "layer 0 under no_grad"])
def test_a_tiny_mamba2_model_in_a_training_setup_gives_the_unpatched_gradients(setup):
    """transformers' gradient checkpointing (both kinds) and a layer run under no_grad: the patched model's loss
    and gradients are the unpatched model's in the same setup."""
    import copy
    import functools

    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=8, expand=2, head_dim=8,
                          num_heads=4, n_groups=2, conv_kernel=4, chunk_size=8)
    reference = Mamba2ForCausalLM(config).float()
    patched = copy.deepcopy(reference)
    patch(patched)
    ids = torch.randint(0, 64, (2, 8))

    def prepared(model):
        if setup.startswith("checkpointing"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": setup.endswith(" reentrant")})
            model.train()
        else:
            layer = model.backbone.layers[0]
            forward = layer.forward

            def without_grad(*args, **kwargs):
                with torch.no_grad():
                    return forward(*args, **kwargs)

            layer.forward = functools.wraps(forward)(without_grad)
        return model

    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model in (prepared(reference), prepared(patched)):
            loss = model(ids, labels=ids).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for n, g in grads_a.items():
        if g is None:
            assert grads_b[n] is None, n
        else:
            torch.testing.assert_close(grads_b[n], g, rtol=1e-4, atol=1e-6, msg=n)
