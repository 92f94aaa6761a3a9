"""The public surface of `normtune.kernels`: argument checking, the `nn.Module` drop-ins against torch's modules,
config plumbing, and the custom ops under `torch.compile` and `torch.library.opcheck`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from normtune.kernels import (
    BackwardConfig,
    Kernel2Config,
    LayerNorm,
    Problem,
    RMSNorm,
    kernel_1_config,
    layer_norm,
    rms_norm,
    select_config,
)
from normtune.kernels import backward_launch as backward_module
from normtune.kernels.api import reference as reference_module
from normtune.kernels.config import MAX_N
from normtune.kernels.device import device_name, use_triton

N = 200
SMALL = BackwardConfig(kernel_1_config(block_row=2, block_col=256, num_warps=2),
                       Kernel2Config(block_m=4, block_n=64, num_warps=2))


def test_kernels_run_not_the_pytorch_fallback(device, monkeypatch, make_norm_inputs):
    """On CPU the suite must exercise the Triton kernels (interpreter), not `kernels/api/reference.py`."""

    def refuse(*args, **kwargs):
        raise AssertionError("the pure-PyTorch fallback ran: the tests would not be testing the kernels")

    monkeypatch.setattr(reference_module, "forward", refuse)
    monkeypatch.setattr(reference_module, "backward", refuse)
    inputs = make_norm_inputs((4, N), torch.float32, device, has_bias=True)
    assert use_triton(inputs["x"])
    x = inputs["x"].requires_grad_()
    layer_norm(x, inputs["weight"], inputs["bias"]).backward(inputs["grad"])
    rms_norm(x, inputs["weight"]).backward(inputs["grad"])
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_eager_call_without_the_fast_apply_gives_the_same_bits(device, monkeypatch, make_norm_inputs):
    """`ops.eager_norm` skips `Function.apply`'s Python wrapper; where that is unavailable (or functorch transforms
    are active) it calls `EagerNorm.apply`. Both give the same y and gradients, and y is the only output."""
    from normtune.kernels.api import ops

    inputs = make_norm_inputs((5, N), torch.bfloat16, device, has_bias=True)
    results = []
    for eager in (ops._EAGER, None):
        monkeypatch.setattr(ops, "_EAGER", eager)
        x, w, b = (inputs[k].detach().clone().requires_grad_() for k in ("x", "weight", "bias"))
        y = layer_norm(x, w, b)
        assert type(y.grad_fn).__name__ == "EagerNormBackward"
        y.backward(inputs["grad"])
        results.append((y.detach(), x.grad, w.grad, b.grad))
    assert ops._eager_apply() is not None  # this torch has the entry points the fast path uses
    for fast, plain in zip(*results):
        assert torch.equal(fast, plain)


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs: the right exception, naming the argument and the fix.
# ---------------------------------------------------------------------------------------------------------------
def _other_device(device: str) -> str:
    return "cpu" if device == "cuda" else "meta"


# (id, call(x, w, b, other_device), exception, substrings of the message)
BAD_CALLS = [
    ("weight-shape", lambda x, w, b, o: layer_norm(x, w[:-1], b), ValueError,
     ["weight has shape (199,)", "expected (200,)", "x.shape[-1]"]),
    ("weight-2d", lambda x, w, b, o: layer_norm(x, w[None], b), ValueError, ["weight has shape (1, 200)"]),
    ("bias-shape", lambda x, w, b, o: layer_norm(x, w, torch.cat([b, b])), ValueError,
     ["bias has shape (400,)", "expected (200,)"]),
    ("rms-weight-shape", lambda x, w, b, o: rms_norm(x, w[:100]), ValueError, ["weight has shape (100,)"]),
    ("x-int", lambda x, w, b, o: layer_norm(x.to(torch.int32), w, b), TypeError,
     ["x has dtype torch.int32", "float32, bfloat16 or float16"]),
    ("x-float64", lambda x, w, b, o: rms_norm(x.double(), w), TypeError,
     ["x has dtype torch.float64", "float32, bfloat16 or float16", "x.float()"]),
    ("weight-float64", lambda x, w, b, o: layer_norm(x, w.double(), b), TypeError,
     ["weight has dtype torch.float64", "x's dtype (torch.float32) or torch.float32"]),
    ("weight-bf16-for-fp32-x", lambda x, w, b, o: rms_norm(x, w.bfloat16()), TypeError,
     ["weight has dtype torch.bfloat16", "torch.float32"]),
    ("bias-int", lambda x, w, b, o: layer_norm(x, w, b.to(torch.int64)), TypeError, ["bias has dtype torch.int64"]),
    ("x-not-tensor", lambda x, w, b, o: layer_norm(x.tolist(), w, b), TypeError, ["x must be a torch.Tensor"]),
    ("weight-not-tensor", lambda x, w, b, o: layer_norm(x, 1.0, b), TypeError, ["weight must be a torch.Tensor"]),
    ("weight-device", lambda x, w, b, o: layer_norm(x, w.to(o), b), ValueError,
     ["weight is on", "but x is on", "move them to one device"]),
    ("bias-device", lambda x, w, b, o: layer_norm(x, w, b.to(o)), ValueError, ["bias is on", "but x is on"]),
    ("rms-weight-device", lambda x, w, b, o: rms_norm(x, w.to(o)), ValueError, ["weight is on", "but x is on"]),
    ("eps-zero", lambda x, w, b, o: layer_norm(x, w, b, 0.0), ValueError,
     ["eps must be a positive finite number", "got 0.0"]),
    ("eps-negative", lambda x, w, b, o: rms_norm(x, w, -1e-6), ValueError, ["eps must be a positive", "-1e-06"]),
    ("eps-nan", lambda x, w, b, o: layer_norm(x, w, b, float("nan")), ValueError, ["eps", "nan"]),
    ("eps-inf", lambda x, w, b, o: rms_norm(x, w, float("inf")), ValueError, ["eps", "inf"]),
    ("eps-bool", lambda x, w, b, o: layer_norm(x, w, b, True), ValueError, ["eps", "True"]),
    ("eps-str", lambda x, w, b, o: layer_norm(x, w, b, "1e-5"), ValueError, ["eps", "'1e-5'"]),
    # LayerNorm has no dtype eps (rms_norm's eps=None is torch's: the dtype's eps, test_residual_edges.py)
    ("eps-none", lambda x, w, b, o: layer_norm(x, w, b, None), ValueError, ["eps", "None"]),
    ("save", lambda x, w, b, o: layer_norm(x, w, b, save="both"), ValueError,
     ["save='both' is not allowed", "'input'", "'output'"]),
    ("save-rms", lambda x, w, b, o: rms_norm(x, w, save="y"), ValueError, ["save='y'"]),
    ("zero-centered-no-weight", lambda x, w, b, o: layer_norm(x, None, b, zero_centered=True), ValueError,
     ["zero_centered=True needs a weight", "pass weight or zero_centered=False"]),
    ("zero-centered-no-weight-rms", lambda x, w, b, o: rms_norm(x, None, zero_centered=True), ValueError,
     ["zero_centered=True needs a weight"]),
    ("config-not-power-of-two", lambda x, w, b, o: layer_norm(x, w, b, config=BackwardConfig(kernel_1_config(
        block_col=100))), ValueError, ["kernel_1.block_col=100", "power of two"]),
    ("config-bad-warps-dict", lambda x, w, b, o: rms_norm(x, w, config={"kernel_2": {"num_warps": 3}}), ValueError,
     ["kernel_2.num_warps=3", "1, 2, 4, 8, 16, 32"]),
    ("config-unknown-key", lambda x, w, b, o: layer_norm(x, w, b, config='{"kernel_1": {"block_rows": 2}}'),
     ValueError, ["unknown Kernel1Config field(s) block_rows", "allowed"]),
    ("config-single-pass-too-narrow", lambda x, w, b, o: layer_norm(x, w, b, config=BackwardConfig(kernel_1_config(
        block_col=128))), ValueError, ["config does not fit this input (6x200)", "kernel_1.block_col=128 < N=200",
                                       "two_pass"]),
    ("config-type", lambda x, w, b, o: layer_norm(x, w, b, config=42), TypeError,
     ["config must be a BackwardConfig, a dict, JSON text or None", "int"]),
    ("x-too-wide", lambda x, w, b, o: rms_norm(torch.ones((1, MAX_N + 1), device=x.device)), ValueError,
     [f"x.shape[-1]={MAX_N + 1}", f"supported maximum {MAX_N}"]),
    ("x-scalar", lambda x, w, b, o: layer_norm(x[0, 0]), ValueError, ["x is a scalar", "at least one dimension"]),
    ("x-empty-last-dim", lambda x, w, b, o: rms_norm(x[:, :0]), ValueError,
     ["x has an empty last dimension", "(6, 0)"]),
]


@pytest.mark.parametrize("call,exc,needles", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_naming_the_argument(call, exc, needles, device, make_norm_inputs):
    inputs = make_norm_inputs((6, N), torch.float32, device, has_bias=True)
    with pytest.raises(exc) as info:
        call(inputs["x"], inputs["weight"], inputs["bias"], _other_device(device))
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


# ---------------------------------------------------------------------------------------------------------------
# Config plumbing: an explicit config (value, dict or JSON) reaches the launcher; None selects one.
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def launched_configs(monkeypatch):
    seen = []
    real = backward_module.BackwardLaunch

    class SpyLaunch(real):
        def __init__(self, problem, config, *args, **kwargs):
            seen.append((problem, config))
            super().__init__(problem, config, *args, **kwargs)

    monkeypatch.setattr(backward_module, "BackwardLaunch", SpyLaunch)
    return seen


@pytest.mark.parametrize("form", ["value", "dict", "json", "none"])
def test_config_reaches_the_launcher(form, device, launched_configs, make_norm_inputs):
    given = {"value": SMALL, "dict": SMALL.to_dict(), "json": SMALL.to_json(), "none": None}[form]
    inputs = make_norm_inputs((3, 5, N), torch.bfloat16, device, has_bias=True)
    x = inputs["x"].requires_grad_()
    layer_norm(x, inputs["weight"], inputs["bias"], save="output", config=given).backward(inputs["grad"])
    (problem, config), = launched_configs
    assert problem == Problem("layer_norm", 15, N, "bf16", has_bias=True, save="output")
    expected = SMALL if given is not None else select_config(problem, device_name(torch.device(device)))
    assert config == expected


def test_direct_backward_takes_an_explicit_config(device, launched_configs, make_norm_inputs):
    from normtune.kernels import rms_norm_backward, rms_norm_forward

    inputs = make_norm_inputs((6, N), torch.bfloat16, device)
    y, rstd = rms_norm_forward(inputs["x"], inputs["weight"])
    rms_norm_backward(inputs["grad"], inputs["x"], inputs["weight"], rstd, config=SMALL.to_json())
    assert [config for _, config in launched_configs] == [SMALL]


def test_module_config_and_save_reach_the_launcher(device, launched_configs, make_norm_inputs):
    module = RMSNorm(N, eps=1e-6, device=device, zero_centered=True, save="output", config=SMALL)
    inputs = make_norm_inputs((7, N), torch.float32, device)
    module(inputs["x"].requires_grad_()).backward(inputs["grad"])
    (problem, config), = launched_configs
    assert config == SMALL
    assert (problem.norm, problem.save, problem.zero_centered, problem.has_bias) == ("rms_norm", "output", True,
                                                                                     False)


# ---------------------------------------------------------------------------------------------------------------
# Modules: torch's constructor arguments, outputs, gradients and state dicts.
# ---------------------------------------------------------------------------------------------------------------
def _randomize(module: torch.nn.Module) -> None:
    with torch.no_grad():
        if getattr(module, "weight", None) is not None:
            module.weight.copy_(1 + 0.1 * torch.randn(module.weight.shape))
        if getattr(module, "bias", None) is not None:
            module.bias.copy_(0.1 * torch.randn(module.bias.shape))


def _compare_modules(ours, reference64, x, grad, tol, assert_close):
    """ours(x) against a float64 torch module holding the same parameters: output, x.grad, parameter grads."""
    x = x.detach().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    y = ours(x)
    y.backward(grad)
    y64 = reference64(x64)
    y64.backward(grad.double())
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, y64, tol, "y")
    assert_close(x.grad, x64.grad, tol, "x.grad")
    ours_params = dict(ours.named_parameters())
    ref_params = dict(reference64.named_parameters())
    assert ours_params.keys() == ref_params.keys()
    for name, p in ours_params.items():
        assert_close(p.grad, ref_params[name].grad, tol, f"{name}.grad")


def _state_dicts_agree(ours, theirs):
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b), f"state_dict keys {list(a)} != torch's {list(b)}"
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype and a[key].device == b[key].device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, True)],
                         ids=["affine-bias", "affine-nobias", "noaffine"])
@pytest.mark.parametrize("normalized_shape", [N, (N,), (4, 50)], ids=["int", "tuple", "2d"])
def test_layer_norm_module_matches_torch(normalized_shape, affine, bias, dtype, device, tolerance, assert_close):
    kwargs = dict(eps=1e-4, elementwise_affine=affine, bias=bias)
    ours = LayerNorm(normalized_shape, **kwargs, device=device, dtype=dtype)
    theirs = torch.nn.LayerNorm(normalized_shape, **kwargs, device=device, dtype=dtype)
    _state_dicts_agree(ours, theirs)
    # torch's initialization (weight 1, bias 0) is kept: a fresh module computes what a fresh torch one does.
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
    _randomize(theirs)
    ours.load_state_dict(theirs.state_dict())  # strict: same names and shapes
    theirs.load_state_dict(ours.state_dict())
    reference64 = torch.nn.LayerNorm(normalized_shape, **kwargs, device=device, dtype=torch.float64)
    reference64.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    x = (torch.randn(3, 7, *shape) + 0.5).to(device, dtype)
    grad = torch.randn(3, 7, *shape).to(device, dtype)
    _compare_modules(ours, reference64, x, grad, tolerance(dtype), assert_close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("eps", [1e-5, None], ids=["eps", "eps-none"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
@pytest.mark.parametrize("normalized_shape", [N, (4, 50)], ids=["int", "2d"])
def test_rms_norm_module_matches_torch(normalized_shape, affine, eps, dtype, device, tolerance, assert_close):
    ours = RMSNorm(normalized_shape, eps=eps, elementwise_affine=affine, device=device, dtype=dtype)
    theirs = torch.nn.RMSNorm(normalized_shape, eps=eps, elementwise_affine=affine, device=device, dtype=dtype)
    _state_dicts_agree(ours, theirs)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
    _randomize(theirs)
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    # eps=None means finfo(x.dtype).eps, so the float64 reference gets the activation dtype's eps explicitly.
    ref_eps = torch.finfo(dtype).eps if eps is None else eps
    reference64 = torch.nn.RMSNorm(normalized_shape, eps=ref_eps, elementwise_affine=affine, device=device,
                                   dtype=torch.float64)
    reference64.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    x = (torch.randn(3, 7, *shape) + 0.5).to(device, dtype)
    grad = torch.randn(3, 7, *shape).to(device, dtype)
    _compare_modules(ours, reference64, x, grad, tolerance(dtype), assert_close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_rms_norm_eps_none_is_finfo_eps(dtype, device, tolerance, relative_error):
    """Inputs small enough that eps matters: finfo(dtype).eps must be what is added, not some other default."""
    eps = torch.finfo(dtype).eps
    scale = eps ** 0.5  # mean(x²) ~ eps
    x = ((torch.randn(5, N) + 0.5) * scale).to(device, dtype)
    y = RMSNorm(N, eps=None, device=device, dtype=dtype)(x)
    right = F.rms_norm(x.double(), (N,), eps=eps)
    wrong = F.rms_norm(x.double(), (N,), eps=1e-6 if dtype == torch.float32 else eps / 16)
    assert relative_error(right, wrong) > 10 * tolerance(dtype), "inputs do not discriminate eps"
    assert relative_error(y, right) <= tolerance(dtype)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_zero_centered_module_starts_as_identity_weight(cls, device, tolerance, assert_close):
    ours = cls(N, eps=1e-5, zero_centered=True, device=device)
    assert ours.weight is not None and torch.equal(ours.weight, torch.zeros(N, device=device))
    theirs = (torch.nn.LayerNorm if cls is LayerNorm else torch.nn.RMSNorm)(N, eps=1e-5, device=device,
                                                                           dtype=torch.float64)
    x = torch.randn(4, N, device=device) + 0.5
    assert_close(ours(x), theirs(x.double()), tolerance(torch.float32), "y")
    assert "zero_centered=True" in repr(ours)


@pytest.mark.parametrize("make,needles", [
    (lambda: LayerNorm(0), ["normalized_shape", "0"]),
    (lambda: RMSNorm(()), ["normalized_shape", "()"]),
    (lambda: LayerNorm((4, -1)), ["normalized_shape", "(4, -1)"]),
    (lambda: LayerNorm(N, elementwise_affine=False, zero_centered=True), ["zero_centered=True",
                                                                          "elementwise_affine=True"]),
    (lambda: LayerNorm((4, 50))(torch.randn(3, 200)), ["input shape (3, 200)", "normalized_shape (4, 50)"]),
    (lambda: RMSNorm(N)(torch.randn(3, 100)), ["input shape (3, 100)", "(200,)"]),
], ids=["zero", "empty", "negative", "zero-centered-no-affine", "shape-mismatch", "rms-shape-mismatch"])
def test_module_rejects_bad_arguments(make, needles):
    with pytest.raises(ValueError) as info:
        make()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("make,error,needles", [
    (lambda: RMSNorm(64.0), TypeError, ["normalized_shape", "64.0", "float"]),
    (lambda: LayerNorm((4, 8.0)), TypeError, ["normalized_shape", "(4, 8.0)"]),
    (lambda: LayerNorm("64"), TypeError, ["normalized_shape", "'64'"]),
    (lambda: LayerNorm(True), TypeError, ["normalized_shape", "True"]),
    (lambda: LayerNorm(N, eps=0.0), ValueError, ["eps", "0.0"]),
    (lambda: LayerNorm(N, eps=None), ValueError, ["eps", "None"]),
    (lambda: RMSNorm(N, eps=-1e-6), ValueError, ["eps", "-1e-06"]),
    (lambda: RMSNorm(N, eps=float("nan")), ValueError, ["eps", "nan"]),
    (lambda: LayerNorm(N, save="y"), ValueError, ["save='y'", "'input'", "'output'"]),
    (lambda: RMSNorm(N, eps=None, save="both"), ValueError, ["save='both'"]),
], ids=["float", "float-in-tuple", "str", "bool", "eps-zero", "ln-eps-none", "eps-negative", "eps-nan",
        "save", "rms-save"])
def test_module_checks_its_arguments_at_construction(make, error, needles):
    """Bad arguments fail when the module is built (not at its first forward), naming the argument."""
    with pytest.raises(error) as info:
        make()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"


def test_modules_and_functions_check_eps_and_save_in_one_place(monkeypatch, device):
    """The modules (when built) and the functions (at each call) apply one rule for eps and save:
    `functional.check_options`, so that the two can never disagree."""
    import normtune.kernels.api.functional as functional
    import normtune.kernels.api.modules as modules

    seen = []
    rule = functional.check_options

    def spy(eps, save, **kwargs):
        seen.append((eps, save))
        return rule(eps, save, **kwargs)

    monkeypatch.setattr(functional, "check_options", spy)
    monkeypatch.setattr(modules, "check_options", spy)
    with pytest.raises(ValueError, match="eps must be a positive finite number") as built:
        LayerNorm(N, eps=-1.0)
    x = torch.randn(2, N, device=device)
    with pytest.raises(ValueError, match="eps must be a positive finite number") as called:
        layer_norm(x, None, None, -1.0)
    assert str(built.value) == str(called.value)
    RMSNorm(N, eps=None, save="output")
    assert seen == [(-1.0, "input"), (-1.0, "input"), (None, "output")]


def test_module_accepts_torch_sizes_and_lists():
    assert LayerNorm(torch.Size([4, 50])).normalized_shape == (4, 50)
    assert RMSNorm([N], eps=None).normalized_shape == (N,)


# ---------------------------------------------------------------------------------------------------------------
# Heuristic tables: a malformed table is refused at load, naming the file and the field.
# ---------------------------------------------------------------------------------------------------------------
def _shipped_table_json() -> dict:
    import json
    from importlib import resources

    return json.loads(resources.files("normtune.configs").joinpath("h100.json").read_text())


@pytest.mark.parametrize("section, field, value", [
    ("gpu", "sm_count", "132"), ("gpu", "sm_count", 0), ("gpu", "sm_count", 13.2), ("gpu", "sm_count", True),
    ("gpu", "compute_capability", 9.0), ("gpu", "compute_capability", "nine"), ("gpu", "key", 100),
    ("", "interpret", "no"), ("", "provenance", []),
])
def test_table_with_a_badly_typed_field_is_refused_at_load(tmp_path, section, field, value):
    import json

    from normtune.kernels.select.tables import TableError, read_table

    data = _shipped_table_json()
    (data[section] if section else data)[field] = value
    path = tmp_path / "broken-meta.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TableError) as info:
        read_table(str(path))
    message = str(info.value)
    assert str(path) in message and (f"{section}.{field}" if section else field) in message, message
    assert repr(value) in message, message


def test_read_table_names_the_file_for_bad_json_and_missing_files(tmp_path):
    from normtune.kernels.select.tables import TableError, read_table

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(TableError, match=r"broken\.json: not valid JSON"):
        read_table(str(broken))
    with pytest.raises(TableError, match=r"absent\.json: cannot be read"):
        read_table(str(tmp_path / "absent.json"))


def test_read_table_reads_the_shipped_table_afresh(tmp_path):
    import json

    from normtune.kernels.select.tables import read_table

    path = tmp_path / "h100.json"
    path.write_text(json.dumps(_shipped_table_json()))
    first = read_table(str(path))
    assert first.sm_count == 132 and first.gpu_key == "h100"
    data = _shipped_table_json()
    data["gpu"]["sm_count"] = 114
    path.write_text(json.dumps(data))
    assert read_table(str(path)).sm_count == 114  # not cached: a file re-emitted since is seen


# ---------------------------------------------------------------------------------------------------------------
# Custom ops: torch.compile(fullgraph=True) traces through them; opcheck validates their registration.
# ---------------------------------------------------------------------------------------------------------------
COMPILE_CASES = {
    "layer_norm": (lambda x, w, b: layer_norm(x, w, b), True),
    "layer_norm-zc-save-output": (lambda x, w, b: layer_norm(x, w, b, 1e-5, zero_centered=True, save="output"), True),
    "rms_norm": (lambda x, w, b: rms_norm(x, w), False),
    "rms_norm-noweight-save-output": (lambda x, w, b: rms_norm(x, None, save="output") * 2, False),
}


def _grads(fn, x, w, b, grad):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = fn(*leaves)
    y.backward(grad)
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compile_fullgraph_matches_eager(case, device, make_norm_inputs):
    fn, has_bias = COMPILE_CASES[case]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for shape in [(4, 9, N), (5, 11, N)]:  # the second shape recompiles with dynamic sizes
        inputs = make_norm_inputs(shape, torch.bfloat16, device, has_bias=has_bias, param_dtype=torch.float32)
        args = (inputs["x"], inputs["weight"], inputs["bias"], inputs["grad"])
        eager, traced = _grads(fn, *args), _grads(compiled, *args)
        # The compiled graph calls the same custom ops on the same inputs, so results are bitwise equal.
        for name, a, c in zip(("y", "x.grad", "weight.grad", "bias.grad"), eager, traced):
            assert (a is None and c is None) or torch.equal(a, c), f"{name} differs between eager and compiled"


def test_compile_fullgraph_module(device, make_norm_inputs):
    torch._dynamo.reset()
    module = torch.nn.Sequential(LayerNorm(N, device=device), torch.nn.GELU(), RMSNorm(N, device=device))
    for m in module:
        _randomize(m)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    inputs = make_norm_inputs((6, N), torch.float32, device)
    outs = []
    for runner in (module, compiled):
        module.zero_grad()
        x = inputs["x"].detach().requires_grad_()
        y = runner(x)
        y.backward(inputs["grad"])
        outs.append([y.detach(), x.grad] + [p.grad.clone() for p in module.parameters()])
    for a, c in zip(*outs):
        assert torch.equal(a, c)


@pytest.mark.parametrize("form", ["value", "dict", "json"])
def test_compile_fullgraph_with_explicit_config(form, device, make_norm_inputs):
    torch._dynamo.reset()
    config = {"value": SMALL, "dict": SMALL.to_dict(), "json": SMALL.to_json()}[form]
    fn = lambda x, w, b: layer_norm(x, w, b, config=config)  # noqa: E731
    inputs = make_norm_inputs((4, N), torch.float32, device, has_bias=True)
    args = (inputs["x"], inputs["weight"], inputs["bias"], inputs["grad"])
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for a, c in zip(_grads(fn, *args), _grads(compiled, *args)):
        assert torch.equal(a, c)


OPCHECK_CASES = [
    # (is_rms, has_weight, has_bias, zero_centered, save_output, dtype, param_dtype, config)
    (False, True, True, False, False, torch.float32, torch.float32, ""),
    (False, True, True, True, True, torch.bfloat16, torch.float32, SMALL.to_json()),
    (False, False, True, False, True, torch.float16, torch.float16, ""),
    (True, True, False, False, False, torch.bfloat16, torch.bfloat16, ""),
    (True, False, False, False, True, torch.float32, torch.float32, ""),
]


@pytest.mark.parametrize("is_rms,has_weight,has_bias,zero_centered,save_output,dtype,param_dtype,config",
                         OPCHECK_CASES, ids=["ln", "ln-zc-out-w32-config", "ln-noweight-out", "rms", "rms-noweight-out"])
def test_opcheck(is_rms, has_weight, has_bias, zero_centered, save_output, dtype, param_dtype, config, device,
                 make_norm_inputs):
    inputs = make_norm_inputs((6, N), dtype, device, has_weight=has_weight, has_bias=has_bias,
                              zero_centered=zero_centered, param_dtype=param_dtype)
    x, w, b, g = inputs["x"], inputs["weight"], inputs["bias"], inputs["grad"]
    flags = (is_rms, zero_centered, save_output, config)
    fwd_args = (x, w, b, 1e-5, *flags)
    torch.library.opcheck(torch.ops.normtune.norm_forward.default, fwd_args)
    y, rstd, mean = torch.ops.normtune.norm_forward(*fwd_args)
    assert rstd.dtype == torch.float32 and mean.numel() == (0 if is_rms or save_output else x.shape[0])
    saved = y if save_output else x
    torch.library.opcheck(torch.ops.normtune.norm_backward.default, (g, saved, w, b, rstd, mean, *flags))


def test_table_label_is_repository_relative(tmp_path, monkeypatch):
    from normtune.kernels.select.tables import read_table, shipped_tables

    assert sorted(t.label for t in shipped_tables()) == ["configs/h100.json", "configs/h200.json"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    import json

    (tmp_path / "mine" / "t.json").write_text(json.dumps(_shipped_table_json()))
    assert read_table(str(tmp_path / "mine" / "t.json")).label == "mine/t.json"
