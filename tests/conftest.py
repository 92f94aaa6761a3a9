"""Shared test setup: where the kernels run, float64 references, tolerances, seeds and the `gpu` marker.

Without a CUDA GPU the Triton kernels run on CPU tensors through the Triton interpreter. `TRITON_INTERPRET=1`
must be in the environment before `triton` (and so `normtune.kernels`, whose `@triton.jit` decorators read it)
is imported, which is why it is set here, at the top of the root conftest, before anything imports them.
With a GPU the same tests run the compiled kernels on `cuda`, and `@pytest.mark.gpu` tests run too.

Kept generic on purpose (tuner, store and CLI tests share it): it sets the interpreter variable and per-test
seeds, nothing else global. The kernel helpers are fixtures, so test modules need not import this file.
"""

from __future__ import annotations

import os
import zlib

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
# A GPU host may still force the interpreter (TRITON_INTERPRET=1); then CPU tensors are the ones that run kernels.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if INTERPRET:
    from interpreter_cache import install  # noqa: E402

    install()  # helper calls inside a running kernel skip re-patching the language the kernel already patched

# Relative error ‖out − ref‖ / ‖ref‖ allowed against the float64 reference, per activation dtype. Low-precision
# outputs are bounded by their final rounding (bf16 2^-9, fp16 2^-12); calibrated on this suite's inputs (randn + 0.5
# activations, weights 1 + 0.1·randn), on the interpreter and on an H100, where the worst errors seen were ~1e-6
# (fp32, N = 1), 3e-4 (fp16) and 7e-3 (bf16).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# save="output" recovers x̂ = (y − b)/w from the *rounded* y: x̂ carries y's rounding error, amplified by 1/|w| and
# by |y|/|x̂|, so gradients can be a few times further off than when saving the input.
TOLERANCE_SAVE_OUTPUT = {torch.float32: 3e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated so the marker is known whichever ini file pytest picks up.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (real Triton kernels, large shapes)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU: gpu-marked tests run the compiled Triton kernels on large shapes")
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET is set: gpu-marked tests need the compiled kernels, not the interpreter")


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> int:
    """A fresh, reproducible seed per test (derived from its node id, so reruns and xdist workers agree)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def device() -> str:
    """Where the kernels run: "cuda" with a GPU, else "cpu" through the Triton interpreter."""
    return DEVICE


@pytest.fixture
def tolerance():
    """tolerance(dtype, save="input") → the relative error allowed against the float64 reference."""

    def lookup(dtype: torch.dtype, save: str = "input") -> float:
        table = TOLERANCE_SAVE_OUTPUT if save == "output" else TOLERANCE
        return table[dtype]

    return lookup


def relative_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """‖out − ref‖ / max(‖ref‖, floor, 1e-8), in float64. The floors only matter for a reference that is (almost)
    zero, e.g. LayerNorm's dx and dw for N = 1 (x̂ = 0), where float64 autograd leaves ~1e-17 rather than 0."""
    ref64 = ref.detach().double()
    out64 = out.detach().to(ref64.device, torch.float64)
    return ((out64 - ref64).norm() / max(ref64.norm().item(), floor, 1e-8)).item()


def assert_close(out: torch.Tensor | None, ref: torch.Tensor | None, tol: float, what: str,
                 floor: float = 0.0) -> None:
    """`out` has ref's shape, every element finite (poisoned outputs were all written), and is within `tol`
    relative error of the float64 `ref` (relative to `floor` where ‖ref‖ is smaller: pass the size of the terms
    that cancel to form ref when that cancellation can leave ref near zero)."""
    if ref is None:
        assert out is None, f"{what}: expected no output, got a tensor of shape {tuple(out.shape)}"
        return
    assert out is not None, f"{what}: missing"
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    bad = (~torch.isfinite(out)).sum().item()
    assert bad == 0, f"{what}: {bad} of {out.numel()} elements are not finite (left unwritten?)"
    err = relative_error(out, ref, floor)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


@pytest.fixture(name="assert_close")
def _assert_close_fixture():
    return assert_close


@pytest.fixture(name="relative_error")
def _relative_error_fixture():
    return relative_error


def reference_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                   grad: torch.Tensor | None = None, *, is_rms: bool, zero_centered: bool = False) -> dict:
    """The norm over the last dimension and its gradients, by torch autograd on float64 copies of the inputs
    (independent of `normtune.kernels.api.reference`). Returns y, rstd, mean, x̂ (float64; rstd and mean over the
    leading dims) and,
    given `grad`, dx, dw, db (None where there is no weight/bias) and `scale`, the error floors for them."""
    N = x.shape[-1]
    x64 = x.detach().double().requires_grad_(grad is not None)
    w64 = weight.detach().double().requires_grad_(grad is not None) if weight is not None else None
    b64 = bias.detach().double().requires_grad_(grad is not None) if bias is not None else None
    w_eff = (1.0 + w64 if zero_centered else w64) if w64 is not None else None
    if is_rms:
        y = F.rms_norm(x64, (N,), w_eff, eps)
    else:
        y = F.layer_norm(x64, (N,), w_eff, b64, eps)
    with torch.no_grad():
        x0 = x64.detach()
        mean = torch.zeros_like(x0[..., 0]) if is_rms else x0.mean(-1)
        centered = x0 if is_rms else x0 - mean[..., None]
        rstd = torch.rsqrt((centered * centered).mean(-1) + eps)
        xhat = centered * rstd[..., None]
    out = {"y": y.detach(), "rstd": rstd, "mean": mean, "xhat": xhat}
    if grad is not None:
        g64 = grad.detach().double()
        y.backward(g64)
        out["dx"] = x64.grad
        out["dw"] = w64.grad if w64 is not None else None
        out["db"] = b64.grad if b64 is not None else None
        # The size of the terms that cancel into each gradient: dx = r·(w·g − …), dw = Σ g·x̂, db = Σ g. With few
        # rows or N = 1 a gradient can cancel to almost nothing by chance, so errors are measured against
        # max(‖ref‖, ‖terms‖) (pass these as `floor`); otherwise ‖terms‖ ≈ ‖ref‖ and nothing is loosened.
        w_terms = w_eff.detach() if w_eff is not None else 1.0
        out["scale"] = {"dx": (rstd[..., None] * w_terms * g64).norm().item(), "dw": (g64 * xhat).norm().item(),
                        "db": g64.norm().item()}
    return out


@pytest.fixture(name="reference_norm")
def _reference_norm_fixture():
    return reference_norm


def make_norm_inputs(shape, dtype: torch.dtype, device, *, has_weight: bool = True, has_bias: bool = False,
                     zero_centered: bool = False, param_dtype: torch.dtype | None = None) -> dict:
    """Fresh random inputs, never zeros: x = randn + 0.5 (an offset mean, so LayerNorm's centering matters),
    weight 1 + 0.1·randn (zero-centered: 0.1·randn), bias 0.1·randn, grad randn. Drawn in fp32 on the CPU from
    the per-test seed, then cast, so that CPU and GPU runs see the same values."""
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    N = shape[-1]
    pdt = param_dtype or dtype
    x = torch.randn(shape) + 0.5
    grad = torch.randn(shape)
    weight = (0.1 * torch.randn(N) if zero_centered else 1.0 + 0.1 * torch.randn(N)) if has_weight else None
    bias = 0.1 * torch.randn(N) if has_bias else None
    cast = lambda t, dt: t.to(device=device, dtype=dt) if t is not None else None  # noqa: E731
    return {"x": cast(x, dtype), "grad": cast(grad, dtype), "weight": cast(weight, pdt), "bias": cast(bias, pdt)}


@pytest.fixture(name="make_norm_inputs")
def _make_norm_inputs_fixture():
    return make_norm_inputs
