"""The suite's interpreter cache (tests/interpreter_cache.py): kernels run with it give the bits Triton's own
interpreter gives, with the language patched fewer times."""

from __future__ import annotations

import pytest
import torch
from triton.runtime import interpreter

from normtune.kernels import BackwardConfig, kernel_1_config, layer_norm, rms_norm
from normtune.kernels.config import Kernel2Config

pytestmark = pytest.mark.skipif(not hasattr(interpreter.InterpretedFunction.__call__, "_patches_once"),
                                reason="the suite runs compiled kernels here (no interpreter cache installed)")

# The rows strategy in two passes (its helpers and tl.sum in every chunk) and with the fused reduction, dual.
CONFIGS = [BackwardConfig(kernel_1_config(block_row=2, block_col=64, two_pass=True), Kernel2Config(block_m=4)),
           BackwardConfig(kernel_1_config(block_row=4, block_col=256), Kernel2Config(block_m=4, fused=True)),
           BackwardConfig(kernel_1_config(strategy="dual", block_row=2, block_col=256), Kernel2Config(block_m=4))]


def _run(norm, config, inputs):
    x, w, b, grad = (t.clone().requires_grad_() if t is not None and i < 3 else t for i, t in enumerate(inputs))
    y = layer_norm(x, w, b, config=config) if norm == "layer_norm" else rms_norm(x, w, config=config)
    y.backward(grad)
    return [t for t in (y.detach(), x.grad, w.grad, b.grad if b is not None else None) if t is not None]


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_kernels_give_the_interpreters_bits_with_fewer_patches(norm, monkeypatch):
    x, grad = torch.randn(13, 200, dtype=torch.bfloat16) + 0.5, torch.randn(13, 200, dtype=torch.bfloat16)
    w = 1.0 + 0.1 * torch.randn(200, dtype=torch.bfloat16)
    b = 0.1 * torch.randn(200, dtype=torch.bfloat16) if norm == "layer_norm" else None
    patches = []
    patch_lang = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patches.append(fn) or patch_lang(fn))
    cached = [_run(norm, config, (x, w, b, grad)) for config in CONFIGS]
    with_cache = len(patches)
    patches.clear()
    for cls in (interpreter.GridExecutor, interpreter.InterpretedFunction):
        monkeypatch.setattr(cls, "__call__", cls.__call__.__wrapped__)
    stock = [_run(norm, config, (x, w, b, grad)) for config in CONFIGS]
    for config, ours, theirs in zip(CONFIGS, cached, stock):
        for a, e in zip(ours, theirs, strict=True):
            assert torch.equal(a, e), config
    assert with_cache < len(patches) / 2, (with_cache, len(patches))
