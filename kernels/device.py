"""Where kernels run: CUDA devices, or CPU tensors through the Triton interpreter (`TRITON_INTERPRET=1`)."""

from __future__ import annotations

import functools
import os
import sys
import re

import torch

from .limits import REFERENCE, DeviceLimits, from_properties

# The interpreter has no SMs; this many "SMs" sizes the persistent grid so that grid-striding, partial rows and
# kernel_2's reduction over several programs are all exercised on CPU.
INTERPRET_SM_COUNT = 4


def interpret_mode() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors always run the Triton kernels; CPU tensors only in interpreter mode, which must have been on
    when the kernels were defined (at import)."""
    if t.is_cuda:
        return True
    if t.device.type != "cpu" or not interpret_mode():
        return False
    if not _kernels_interpreted():
        raise RuntimeError("normtune: TRITON_INTERPRET=1 was set after normtune's kernels were imported, so they "
                           "cannot run on CPU tensors: set it before importing normtune (or unset it: CPU tensors "
                           "then run the PyTorch reference)")
    return True


def _kernels_interpreted() -> bool:
    """Whether the forward kernel was defined for Triton's interpreter (decided when it was imported; not imported
    yet, it will be defined under the current environment)."""
    forward = sys.modules.get("normtune.kernels.forward")
    if forward is None or not hasattr(forward, "_forward_kernel"):
        return True
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(forward._forward_kernel, InterpretedFunction)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRET_SM_COUNT


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """'NVIDIA H100 80GB HBM3', or 'cpu (triton interpreter)'."""
    if device.type == "cuda":
        return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
    return "cpu (triton interpreter)" if interpret_mode() else "cpu"


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type == "cuda":
        return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())
    return None


@functools.lru_cache(maxsize=None)
def _cuda_limits(index: int) -> DeviceLimits:
    return from_properties(torch.cuda.get_device_properties(index), hip=torch.version.hip is not None)


def device_limits(device: torch.device | None) -> DeviceLimits:
    """The GPU's resources and features (`limits.DeviceLimits`); without a GPU (CPU tensors, the interpreter) the
    reference device's, whose features the interpreter accepts."""
    if device is not None and device.type == "cuda":
        return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())
    return REFERENCE


# Known GPU families, most specific first: (regex over the device name, key). The key names tables
# (configs/<key>.json) and is what `--gpu` takes (`--gpu auto`: the key of the device found).
_GPU_KEYS = (
    (r"\bMI300X\b", "mi300x"),
    (r"\bMI300A\b", "mi300a"),
    (r"\bMI325X\b", "mi325x"),
    (r"\bMI355X\b", "mi355x"),
    (r"\bMI350X\b", "mi350x"),
    (r"\bMI250X\b", "mi250x"),
    (r"\bMI250\b", "mi250"),
    (r"\bMI210\b", "mi210"),
    (r"\bGH200\b", "gh200"),
    (r"\bH200\b", "h200"),
    (r"\bH100\b", "h100"),
    (r"\bH800\b", "h800"),
    (r"\bH20\b", "h20"),
    (r"\bGB200\b", "gb200"),
    (r"\bB200\b", "b200"),
    (r"\bB300\b", "b300"),
    (r"\bB100\b", "b100"),
    (r"\bA100\b", "a100"),
    (r"\bA10G\b", "a10g"),
    (r"\bL40S\b", "l40s"),
    (r"\bL4\b", "l4"),
    (r"\bL40\b", "l40"),
    (r"RTX PRO 6000", "rtx-pro-6000"),
    (r"RTX 6000 Ada", "rtx6000-ada"),
    (r"\bRTX (\d{4})\b", r"rtx\1"),  # GeForce RTX and a four-digit model number
)
# Device names of AMD GPUs (ROCm's torch reports them through torch.cuda).
_AMD_NAME = re.compile(r"\b(AMD|Instinct|Radeon|MI\d{3}[A-Z]?)\b|^gfx\d", re.IGNORECASE)


def vendor_of(name: str | None) -> str | None:
    """'amd' for an AMD GPU's device name or key (AMD Instinct MI300X, mi300x), 'nvidia' for any other GPU name,
    None without one."""
    if not name or name.startswith("cpu"):
        return None
    return "amd" if _AMD_NAME.search(name) else "nvidia"


def gpu_key(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' → 'h100'. Unknown names become a slug of the name."""
    for pattern, key in _GPU_KEYS:
        found = re.search(pattern, name, re.IGNORECASE)
        if found:
            return found.expand(key)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return slug or "unknown"
