"""docs/usage.md against the code: every name it imports or calls is part of normtune's public API, every keyword
it passes is a parameter of what it calls, the fused residual add and the CPU path are covered, and the return
values and the CPU behaviour it states are what the code does (tiny shapes, in the interpreter the suite runs)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import normtune
import normtune.kernels as kernels
from normtune.kernels import PatchReport

ROOT = Path(__file__).resolve().parents[1]
USAGE = (ROOT / "docs" / "usage.md").read_text()
CODE = re.findall(r"```python\n(.*?)```", USAGE, re.S) + re.findall(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)", USAGE)
CALL = re.compile(r"\b((?:normtune\.)?(?:kernels\.)?[A-Za-z_]\w*)\(([^()]*(?:\([^()]*\)[^()]*)*)\)")


def _public(name: str):
    """The public object a documented call names, or None where it is not normtune's (torch's, a variable's)."""
    short = name.split(".")[-1]
    if name.startswith("normtune.") and name.count(".") == 1:
        return getattr(normtune, short) if short in normtune.__all__ else "missing"
    return getattr(kernels, short) if short in kernels.__all__ else None


def test_usage_covers_the_fused_residual_add_and_the_cpu_path():
    for needle in ("residual=", "residual_dtype=", "patch(model, fuse_residual=True)", "FusedAddRMSNorm",
                   "FusedAddLayerNorm", "grad_residual=", "report.unfused", "TRITON_INTERPRET", "## On the CPU"):
        assert needle in USAGE, f"docs/usage.md does not mention {needle!r}"


def test_every_imported_name_is_public():
    imported = [n.strip() for block in CODE for line in re.findall(r"from normtune\.kernels import ([^\n]+)", block)
                for n in line.split(",")]
    assert {"FusedAddLayerNorm", "FusedAddRMSNorm", "rms_norm", "layer_norm"} <= set(imported)
    missing = [n for n in imported if n not in kernels.__all__]
    assert not missing, f"docs/usage.md imports {missing}, which normtune.kernels does not export"


def test_every_documented_call_takes_the_keywords_it_is_given():
    checked, wrong = set(), []
    for text in CODE:
        for name, args in CALL.findall(text):
            target = _public(name)
            if target is None:
                continue
            if target == "missing":
                wrong.append(f"{name}: not in normtune.__all__")
                continue
            params = inspect.signature(target.__init__ if inspect.isclass(target) else target).parameters
            for keyword in re.findall(r"(?:^|,)\s*(\w+)=", args):
                checked.add(f"{name.split('.')[-1]}({keyword}=)")
                if keyword not in params:
                    wrong.append(f"{name}({keyword}=...): no such parameter")
    assert not wrong, wrong
    assert {"rms_norm(residual=)", "layer_norm(residual_dtype=)", "patch(fuse_residual=)",
            "FusedAddRMSNorm(residual_dtype=)", "rms_norm_backward(grad_residual=)"} <= checked, checked


def test_the_report_fields_it_names_exist():
    fields = set(re.findall(r"`report\.(\w+)`", USAGE))
    assert {"fused", "chained", "unfused"} <= fields
    assert fields <= set(PatchReport.__dataclass_fields__)


def test_the_documented_returns_are_what_the_calls_return():
    x, r, w, b = torch.randn(4, 64), torch.randn(4, 64), torch.rand(64) + 0.5, torch.randn(64)
    y, h = kernels.rms_norm(x, w, eps=1e-6, residual=r)
    torch.testing.assert_close(h, x + r)
    y, h = kernels.layer_norm(x.bfloat16(), w.bfloat16(), b.bfloat16(), residual=r, residual_dtype=torch.float32)
    assert (y.dtype, h.dtype) == (torch.bfloat16, torch.float32)
    norm = kernels.FusedAddRMSNorm(64, eps=1e-6, residual_dtype=None)
    assert isinstance(norm, kernels.RMSNorm) and isinstance(kernels.FusedAddLayerNorm(64), kernels.LayerNorm)
    assert len(norm(x, r)) == 2
    y, rstd, h = kernels.rms_norm_forward(x, w, residual=r)
    assert len(kernels.layer_norm_forward(x, w, b, residual=r)) == 4
    dx, dw = kernels.rms_norm_backward(torch.ones_like(y), h, w, rstd, grad_residual=torch.ones_like(h))
    assert dx.dtype == h.dtype and dw.shape == w.shape


def test_cpu_tensors_take_the_path_the_page_states():
    """Interpreter on (as this suite runs): the Triton forward runs. Off: the pure-PyTorch reference, no kernel."""
    probe = ("import torch, normtune.kernels as k, normtune.kernels.forward as f\n"
             "calls = []\n"
             "for name in ('forward', 'forward_residual'):\n"
             "    real = getattr(f, name)\n"
             "    setattr(f, name, lambda *a, real=real, **kw: calls.append(1) or real(*a, **kw))\n"
             "x = torch.randn(2, 32)\n"
             "k.rms_norm(x, torch.ones(32)); k.rms_norm(x, torch.ones(32), residual=x)\n"
             "print(len(calls))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=ROOT.parent)
    assert off.returncode == 0, off.stderr[-2000:]
    assert off.stdout.split()[-1] == "0", "without TRITON_INTERPRET a CPU call reached the Triton kernels"
    on = subprocess.run([sys.executable, "-c", probe], env={**env, "TRITON_INTERPRET": "1"}, capture_output=True,
                        text=True, cwd=ROOT.parent)
    assert on.returncode == 0, on.stderr[-2000:]
    assert on.stdout.split()[-1] == "2", "with TRITON_INTERPRET a CPU call did not run the Triton kernels"


def test_triton_interpret_set_after_the_import_is_one_clear_error():
    probe = ("import os, torch, normtune.kernels as k\n"
             "os.environ['TRITON_INTERPRET'] = '1'\n"
             "try:\n"
             "    k.rms_norm(torch.randn(2, 32), torch.ones(32))\n"
             "except RuntimeError as err:\n"
             "    print('refused:', err)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    late = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=ROOT.parent)
    assert late.returncode == 0, late.stderr[-2000:]
    assert "refused: normtune: TRITON_INTERPRET=1 was set after normtune's kernels were imported" in late.stdout
