"""`normtune.patch(model)`: which modules it replaces (torch's LayerNorm/RMSNorm, and norm-like modules by their
behaviour), that the replacement keeps the very Parameter objects and state-dict keys, that outputs, gradients and
training match the unpatched model (plain torch models and tiny `transformers` Llama, Qwen2, Qwen3, Gemma), under
torch.compile too, and what it refuses.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import normtune
from normtune.kernels import BackwardConfig, Kernel2Config, LayerNorm, PatchReport, RMSNorm, kernel_1_config, patch

N = 32
SMALL = BackwardConfig(kernel_1_config(block_row=2, block_col=64, num_warps=2), Kernel2Config(block_m=4, block_n=32))


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: torch's intra-op threads only add synchronization (10-50x slower when the xdist
    workers already share the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randomize(model: nn.Module, seed: int = 1) -> None:
    """Norm weights away from their init (ones, or zeros for zero-centered ones), so that the formula matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or p.dim() == 1:
                p.add_((0.2 * torch.randn(p.shape, generator=gen)).to(p.dtype))


def _snapshot(model: nn.Module) -> dict:
    return {name: (p, p.data_ptr()) for name, p in model.named_parameters()}


def _assert_same_parameters(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    assert list(after) == list(before), "parameter names changed"
    for name, (p, ptr) in before.items():
        assert after[name][0] is p, f"{name}: a new Parameter object"
        assert after[name][1] == ptr, f"{name}: its storage moved"


def _run(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient and every parameter's gradient (fresh)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = model(x)
    y.backward(grad)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]



# ---------------------------------------------------------------------------------------------------------------
# Plain torch models
# ---------------------------------------------------------------------------------------------------------------
def _torch_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(N, N), nn.LayerNorm(N), nn.GELU(), nn.RMSNorm(N, eps=1e-6), nn.Linear(N, N),
        nn.LayerNorm(N, bias=False), nn.RMSNorm(N), nn.LayerNorm(N, elementwise_affine=False),
        nn.RMSNorm(N, elementwise_affine=False), nn.Linear(N, 2 * N))


def _check_torch_patch(model, tol, assert_close, x_shape=(3, 5, N), **options) -> PatchReport:
    _randomize(model)
    reference = copy.deepcopy(model)
    before, keys = _snapshot(model), list(model.state_dict())
    report = patch(model, **options)
    _assert_same_parameters(model, before)
    assert list(model.state_dict()) == keys
    x = torch.randn(x_shape) + 0.5
    out_shape = reference(x).shape
    grad = torch.randn(out_shape)
    names = ["y", "x.grad"] + [f"grad {n}" for n, _ in model.named_parameters()]
    for name, a, b in zip(names, _run(model, x, grad), _run(reference, x, grad)):
        assert_close(a, b, tol, name)
    return report


def test_torch_norms_are_replaced_with_the_same_parameters(tolerance, assert_close):
    model = _torch_model()
    report = _check_torch_patch(model, tolerance(torch.float32), assert_close)
    assert report.replaced == {"LayerNorm": 3, "RMSNorm": 3} and report.total == 6 and report.skipped == {}
    assert str(report) == "replaced 3 LayerNorm, 3 RMSNorm"
    norms = [m for m in model if isinstance(m, (LayerNorm, RMSNorm))]
    assert len(norms) == 6 and all(m.save == "input" and m.config is None for m in norms)
    assert norms[2].bias is None and norms[4].weight is None and norms[4].bias is None and norms[1].eps == 1e-6
    assert norms[3].eps is None  # torch.nn.RMSNorm's eps=None (the input dtype's eps) is kept
    assert patch(model).replaced == {}  # already patched: nothing left to do


def test_layer_norm_over_several_dims(tolerance, assert_close):
    model = nn.Sequential(nn.Linear(64, 64), nn.Unflatten(-1, (4, 16)), nn.LayerNorm((4, 16)), nn.Flatten(-2))
    report = _check_torch_patch(model, tolerance(torch.float32), assert_close, x_shape=(6, 64))
    assert report.replaced == {"LayerNorm": 1} and model[2].normalized_shape == (4, 16)


@pytest.mark.parametrize("kinds,expected", [({"layer_norm": False}, {"RMSNorm": 3}),
                                            ({"rms_norm": False}, {"LayerNorm": 3}),
                                            ({"layer_norm": False, "rms_norm": False}, {})])
def test_select_kinds(kinds, expected, tolerance, assert_close):
    model = _torch_model()
    report = _check_torch_patch(model, tolerance(torch.float32), assert_close, **kinds)
    assert report.replaced == expected
    left = {type(m).__module__.split(".")[0] for m in model if "Norm" in type(m).__name__}
    assert left == ({"normtune"} if len(expected) == 2 else {"normtune", "torch"} if expected else {"torch"})


def test_save_output_and_config(tolerance, assert_close):
    model = _torch_model()
    _check_torch_patch(model, tolerance(torch.float32, "output"), assert_close, save="output", config=SMALL.to_dict())
    norms = [m for m in model if isinstance(m, (LayerNorm, RMSNorm))]
    assert all(m.save == "output" and m.config == SMALL for m in norms)


def test_shared_module_is_replaced_once_everywhere():
    norm = nn.RMSNorm(N)
    model = nn.Sequential(norm, nn.Linear(N, N), norm)
    report = patch(model)
    assert report.replaced == {"RMSNorm": 1} and model[0] is model[2] and isinstance(model[0], RMSNorm)
    assert model[0].weight is norm.weight


def test_other_norms_and_lookalikes_are_left_alone():
    class Scaled(nn.Module):  # an eps and a weight, but a running buffer: not a norm normtune can stand in for
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(N)), 1e-5
            self.register_buffer("running", torch.zeros(N))

        def forward(self, x):
            return x * self.weight + self.running

    class ChannelGroupNorm(nn.GroupNorm):  # a subclass of another torch norm: its reduction, not ours
        def forward(self, x):
            return super().forward(x.transpose(1, -1)).transpose(1, -1)

    model = nn.Sequential(nn.BatchNorm1d(N), nn.GroupNorm(4, N), nn.InstanceNorm1d(N, affine=True), Scaled(),
                          ChannelGroupNorm(4, N))
    before = list(model)
    assert patch(model).replaced == {}
    assert list(model) == before


# ---------------------------------------------------------------------------------------------------------------
# Norm-like modules matched by behaviour
# ---------------------------------------------------------------------------------------------------------------
class HandRMSNorm(nn.Module):
    """An RMSNorm written by hand: `offset` adds a constant, `inner_eps` differs from the advertised eps,
    `zero_centered` scales by 1 + w (zero weights at init)."""

    def __init__(self, n, eps=1e-6, *, offset=0.0, inner_eps=None, zero_centered=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n) if zero_centered else torch.ones(n))
        self.variance_epsilon, self.offset, self.zero_centered = eps, offset, zero_centered
        self.inner_eps = eps if inner_eps is None else inner_eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.inner_eps)
        w = 1.0 + self.weight.float() if self.zero_centered else self.weight.float()
        return (h * w + self.offset).to(x.dtype)


class HandLayerNorm(nn.Module):
    """A LayerNorm written by hand, with or without a bias."""

    def __init__(self, n, eps=1e-5, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None
        self.eps = eps

    def forward(self, x):
        h = x - x.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return h + self.bias if self.bias is not None else h


def test_hand_written_norms_are_recognised(tolerance, assert_close):
    zc = HandRMSNorm(N, zero_centered=True)
    model = nn.Sequential(HandRMSNorm(N), nn.Linear(N, N), zc, HandLayerNorm(N), HandLayerNorm(N, bias=False))
    zc_weight = zc.weight
    rng = torch.get_rng_state()
    report = patch(model)
    assert torch.equal(torch.get_rng_state(), rng)  # the probe draws from its own generator
    assert torch.count_nonzero(zc_weight) == 0 and model[2].weight is zc_weight  # probed, never modified
    assert report.replaced == {"HandRMSNorm": 2, "HandLayerNorm": 2}
    assert [type(m).__name__ for m in model] == ["RMSNorm", "Linear", "RMSNorm", "LayerNorm", "LayerNorm"]
    assert not model[0].zero_centered and model[2].zero_centered and model[3].bias is not None
    assert model[4].bias is None and model[0].variance_epsilon == 1e-6  # the original eps name still reads


class OnePlusLayerNorm(nn.LayerNorm):
    """A torch LayerNorm subclass scaling by 1 + weight (as Nemotron's LayerNorm1P does)."""

    def forward(self, x):
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


def test_hand_written_norms_match_after_patch(tolerance, assert_close):
    model = nn.Sequential(HandRMSNorm(N), nn.Linear(N, N), HandRMSNorm(N, zero_centered=True), HandLayerNorm(N),
                          OnePlusLayerNorm(N))
    report = _check_torch_patch(model, tolerance(torch.float32), assert_close)
    assert report.replaced == {"HandRMSNorm": 2, "HandLayerNorm": 1, "OnePlusLayerNorm": 1}
    assert model[4].zero_centered and model[4].bias is not None


class TanhGatedRMSNorm(HandRMSNorm):
    """A gated look-alike with other math (a tanh gate): no gated form fits it (the gated ones are
    test_patch_gated.py's)."""

    def forward(self, x, gate=None):
        return super().forward(x if gate is None else x * torch.tanh(gate))


class ResidualTakingRMSNorm(HandRMSNorm):
    """The caller passes a residual, which a replacement taking only the input would not accept."""

    def forward(self, x, residual=None):
        return super().forward(x if residual is None else x + residual)


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass normalizing dim 1 of (B, C, L) inputs (as some vision models do)."""

    def forward(self, x):
        return super().forward(x.transpose(1, -1)).transpose(1, -1)


def _hooked() -> nn.Module:
    norm = nn.RMSNorm(N)
    norm.register_forward_hook(lambda module, args, out: None)
    return norm


def _wrapped() -> nn.Module:
    norm = HandRMSNorm(N)
    forward = norm.forward
    norm.forward = lambda x: forward(x)  # as offloading hooks do
    return norm


# (id, module, substrings of the refusal)
REFUSED = [
    ("offset", lambda: HandRMSNorm(N, offset=0.01), ["matches none of", "closest: RMSNorm"]),
    ("gated-other-math", lambda: TanhGatedRMSNorm(N), ["matches no gated RMSNorm", "closest: gated RMSNorm"]),
    ("residual", lambda: ResidualTakingRMSNorm(N), ["forward takes more than the input (residual)"]),
    ("other-eps", lambda: HandRMSNorm(N, inner_eps=1e-3), ["matches none of", "eps=1e-06"]),
    ("channels-first", lambda: ChannelsFirstLayerNorm(N), ["its forward failed on a probe input"]),
    ("too-wide", lambda: nn.LayerNorm((1024, 512)), ["524288 values per row", "maximum 262144"]),
    ("float64", lambda: nn.RMSNorm(N, dtype=torch.float64), ["weight is torch.float64", "before patch()"]),
    ("hooks", _hooked, ["forward_hooks", "register them after patch()"]),
    ("instance-forward", _wrapped, ["forward is replaced on the instance"]),
    ("meta", lambda: HandRMSNorm(N).to("meta"), ["meta device", "after loading"]),
    ("bad-eps", lambda: HandLayerNorm(N, eps=0.0), ["eps (0.0) is not a positive finite number"]),
]


@pytest.mark.parametrize("make,needles", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refusals_name_the_module_reason_and_fix(make, needles):
    module = make()
    model = nn.Sequential(nn.RMSNorm(N), nn.Sequential(nn.Identity(), module))
    first = model[0]
    with pytest.raises(ValueError) as info:
        patch(model)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"cannot replace 1.1 ({type(module).__name__}): ")
    assert "strict=False" in message
    for needle in needles:
        assert needle in message, message
    assert model[0] is first and model[1][1] is module  # nothing replaced when strict refuses
    report = patch(model, strict=False)
    assert report.replaced == {"RMSNorm": 1} and list(report.skipped) == ["1.1"] and model[1][1] is module
    assert needles[0] in report.skipped["1.1"] and f"skipped 1.1: {type(module).__name__}: " in str(report)


def test_a_module_returning_another_shape_is_refused():
    class Flattening(HandRMSNorm):
        def forward(self, x):
            return super().forward(x).flatten(0, -2)

    expected = r"cannot replace 0 \(Flattening\): its forward returned Tensor \(6, 32\), not a tensor"
    with pytest.raises(ValueError, match=expected):
        patch(nn.Sequential(Flattening(N)))


def test_norms_of_unwanted_kinds_are_neither_replaced_nor_refused():
    model = nn.Sequential(nn.RMSNorm(N, dtype=torch.float64), HandRMSNorm(N).double(), nn.LayerNorm(N))
    report = patch(model, rms_norm=False)
    assert report.replaced == {"LayerNorm": 1} and report.skipped == {}
    assert [type(m).__name__ for m in model] == ["RMSNorm", "HandRMSNorm", "LayerNorm"]
    assert type(model[0]) is nn.RMSNorm and type(model[2]) is LayerNorm


@pytest.mark.parametrize("call,error,needle", [
    (lambda m: patch(nn.RMSNorm(N)), ValueError, "model is itself a norm (RMSNorm)"),
    (lambda m: patch([m]), TypeError, "model must be a torch.nn.Module, got list"),
    (lambda m: patch(m, save="x"), ValueError, "save='x' is not allowed"),
    (lambda m: patch(m, strict=None), TypeError, "strict must be True or False"),
    (lambda m: patch(m, rms_norm=1), TypeError, "rms_norm must be True or False"),
    (lambda m: patch(m, config=3), TypeError, "config must be a BackwardConfig, a dict, JSON text or None"),
    (lambda m: patch(m, config={"kernel_3": {}}), ValueError, "an object with keys kernel_1 and kernel_2"),
    (lambda m: patch(m, config="{"), ValueError, "config is not valid JSON"),
], ids=["root", "not-module", "save", "strict", "kind", "config-type", "config-value", "config-json"])
def test_bad_arguments(call, error, needle):
    model = _torch_model()
    with pytest.raises(error) as info:
        call(model)
    assert needle in str(info.value)
    assert type(model[1]) is nn.LayerNorm  # refused before anything was replaced


def test_top_level_patch_is_lazy():
    assert normtune.patch is patch
    code = "import sys, normtune; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]  # `import normtune` (the CLI) loads the kernels only on use


def test_normtune_kernels_is_reachable_from_a_bare_import():
    # README's examples call normtune.kernels.rms_norm after `import normtune` alone
    code = ("import sys, normtune; print('torch' in sys.modules); "
            "print(normtune.kernels.rms_norm.__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "rms_norm", "True"]


# ---------------------------------------------------------------------------------------------------------------
# transformers models: tiny, random init, built from their configs (no downloads)
# ---------------------------------------------------------------------------------------------------------------
# model_type -> (its RMSNorm class, how many: 2 per layer + the final one, + q_norm/k_norm over the head dim in Qwen3)
MODELS = {"llama": ("LlamaRMSNorm", 5), "qwen2": ("Qwen2RMSNorm", 5), "qwen3": ("Qwen3RMSNorm", 9),
          "gemma": ("GemmaRMSNorm", 5)}  # Gemma's is zero-centered: y = x̂·(1 + w)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256}


def test_the_folder_imported_as_kernels_is_normtune_kernels():
    """transformers imports `kernels` to look for Hugging Face's package; run from the checkout, that name is this
    repository's folder. Loaded a second time, it would register normtune's torch ops again and free the ones
    normtune.kernels calls (seen as flaky crashes of torch.compile): it must stand for normtune.kernels instead."""
    import importlib
    from pathlib import Path

    import normtune.kernels

    saved = sys.modules.pop("kernels", None)
    sys.path.insert(0, str(Path(normtune.kernels.__file__).resolve().parents[1]))
    try:
        assert importlib.import_module("kernels") is normtune.kernels
        assert not [name for name in sys.modules if name.startswith("kernels.")]
    finally:
        sys.path.pop(0)
        sys.modules.pop("kernels", None)
        if saved is not None:
            sys.modules["kernels"] = saved


def _tiny_causal_lm(model_type: str, dtype: torch.dtype, device: str, **sizes) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **sizes})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model)  # norm weights (and biases) off their init: Gemma's zeros would hide the (1 + w)
    return model.to(device=device, dtype=dtype)


def _token_ids(model: nn.Module, batch: int = 2, tokens: int = 16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (batch, tokens), generator=gen).to(next(model.parameters()).device)


def _logits_loss_grads(model: nn.Module, ids: torch.Tensor):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _patch_and_check_structure(model: nn.Module, model_type: str) -> None:
    before, keys = _snapshot(model), list(model.state_dict())
    report = normtune.patch(model)
    cls, count = MODELS[model_type]
    assert report.replaced == {cls: count} and report.skipped == {}
    _assert_same_parameters(model, before)  # 0 parameters re-created: optimizer state and checkpoints still apply
    assert list(model.state_dict()) == keys
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == count and all(m.zero_centered == (model_type == "gemma") for m in norms)
    assert not any(type(m).__name__ == cls for m in model.modules())


# Training is checked on a plain and a zero-centered model; Qwen2/Qwen3 differ from Llama in their attention
# (biases, q_norm/k_norm), which the first step's gradients cover (each step costs seconds in the interpreter).
@pytest.mark.parametrize("model_type,steps", [("llama", 5), ("qwen2", 5), ("qwen3", 1), ("gemma", 5)])
def test_transformers_model_fp32_matches_and_trains(model_type, steps, device, tolerance, assert_close):
    model = _tiny_causal_lm(model_type, torch.float32, device)
    reference = copy.deepcopy(model)
    _patch_and_check_structure(model, model_type)
    ids = _token_ids(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    tol = tolerance(torch.float32)
    for step in range(steps):
        (logits, loss, grads), ref = _logits_loss_grads(model, ids), _logits_loss_grads(reference, ids)
        if step == 0:  # the same weights: logits, loss and every gradient match
            first_loss = ref[1].item()
            assert_close(logits, ref[0], tol, "logits")
            assert_close(loss, ref[1], tol, "loss")
            for name, grad in ref[2].items():
                assert_close(grads[name], grad, tol, f"grad {name}")
        for optimizer in optimizers:
            optimizer.step()
    with torch.no_grad():
        losses = [m(input_ids=ids, labels=ids).loss.item() for m in (model, reference)]
    assert losses[1] < first_loss  # it trained
    assert abs(losses[0] - losses[1]) <= 1e-3 * abs(losses[1]), f"loss after {steps} AdamW steps: {losses}"


def _check_bf16(model_type: str, device: str, tolerance, relative_error, batch: int, tokens: int, **sizes):
    """Patched bf16 against the same weights in fp32: no further off than transformers' own bf16 model is, plus the
    bf16 tolerance of the kernel tests (both round differently: Llama casts x̂ to bf16 before scaling by w)."""
    model = _tiny_causal_lm(model_type, torch.bfloat16, device, **sizes)
    unpatched, fp32 = copy.deepcopy(model), copy.deepcopy(model).float()
    _patch_and_check_structure(model, model_type)
    ids = _token_ids(model, batch, tokens)
    results = {label: _logits_loss_grads(m, ids) for label, m in
               (("patched", model), ("unpatched", unpatched), ("fp32", fp32))}
    tol = tolerance(torch.bfloat16)
    exact = results["fp32"]
    pairs = [("logits", 0), ("loss", 1)] + [(f"grad {name}", name) for name in exact[2]]
    for what, key in pairs:
        pick = (lambda r: r[key]) if isinstance(key, int) else (lambda r: r[2][key])
        ours, theirs = (relative_error(pick(results[label]), pick(exact)) for label in ("patched", "unpatched"))
        assert ours <= tol + theirs, f"{what}: bf16 relative error {ours:.3g}, transformers' own {theirs:.3g}"


@pytest.mark.parametrize("model_type", list(MODELS))
def test_transformers_model_bf16(model_type, device, tolerance, relative_error):
    _check_bf16(model_type, device, tolerance, relative_error, batch=2, tokens=16)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma"])
def test_transformers_model_bf16_on_gpu(model_type, device, tolerance, relative_error):
    """The compiled kernels on real widths (several row blocks, the tables' configs) in bf16."""
    _check_bf16(model_type, device, tolerance, relative_error, batch=4, tokens=256, hidden_size=1024,
                intermediate_size=2816, num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=4096)


def test_transformers_model_compiled(device, tolerance, assert_close):
    """torch.compile of the patched model traces normtune's custom ops (one forward per norm, those over the head
    dim included) and matches the unpatched model."""
    model_type = "qwen3"
    model = _tiny_causal_lm(model_type, torch.float32, device)
    reference = copy.deepcopy(model)
    normtune.patch(model)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, backend=backend)
    ids = _token_ids(model)
    (logits, loss, grads), ref = _logits_loss_grads(compiled, ids), _logits_loss_grads(reference, ids)
    traced = sum(str(node.target) == "normtune.norm_forward.default" for gm in graphs for node in gm.graph.nodes)
    assert traced == MODELS[model_type][1]
    tol = tolerance(torch.float32)
    assert_close(logits, ref[0], tol, "logits")
    assert_close(loss, ref[1], tol, "loss")
    grads = {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}  # the compiled wrapper's names
    for name, grad in ref[2].items():
        assert_close(grads[name], grad, tol, f"grad {name}")


@pytest.mark.parametrize("save", ["input", "output"])
def test_activation_checkpointing_recomputes_what_the_forward_saved(save, device, tolerance, assert_close):
    """transformers' gradient checkpointing (torch.utils.checkpoint, non-reentrant) recomputes each layer in the
    backward and requires the recompute to save tensors of the shapes the forward saved. A norm's first call of a
    signature takes the checked path and later ones the planned path (`forward_calls`): both save x (or y) with
    the caller's leading dims, so a layer whose forward ran a norm's first call recomputes it as a planned one.
    Plans are cleared first, so the first step's forward holds first calls."""
    from normtune.kernels.api import forward_calls

    model = _tiny_causal_lm("llama", torch.float32, device)
    reference = copy.deepcopy(model)
    normtune.patch(model, save=save)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    ids = _token_ids(model, tokens=8)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    tol = tolerance(torch.float32)
    forward_calls.clear()
    for step in range(2):
        (logits, loss, grads), ref = _logits_loss_grads(model, ids), _logits_loss_grads(reference, ids)
        assert_close(loss, ref[1], tol, f"loss, step {step}")
        assert list(grads) == list(ref[2])
        for name, grad in ref[2].items():
            assert_close(grads[name], grad, tol, f"grad {name}, step {step}")
        for optimizer in optimizers:
            optimizer.step()
