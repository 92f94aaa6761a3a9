"""Where kernels run: CUDA devices, or CPU tensors through the Triton interpreter (`TRITON_INTERPRET=1`)."""

from __future__ import annotations

import functools
import os
import re

import torch

# The interpreter has no SMs; this many "SMs" sizes the persistent grid so that grid-striding, partial rows and
# kernel_2's reduction over several programs are all exercised on CPU.
INTERPRET_SM_COUNT = 4


def interpret_mode() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors always run the Triton kernels; CPU tensors only in interpreter mode."""
    return t.is_cuda or (t.device.type == "cpu" and interpret_mode())


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


# Known GPU families, most specific first: (regex over the device name, key). The key names tables
# (configs/<key>.json) and is what `--gpu` takes.
_GPU_KEYS = (
    (r"\bGH200\b", "gh200"),
    (r"\bH200\b", "h200"),
    (r"\bH100\b", "h100"),
    (r"\bH800\b", "h800"),
    (r"\bH20\b", "h20"),
    (r"\bGB200\b", "gb200"),
    (r"\bB200\b", "b200"),
    (r"\bA100\b", "a100"),
    (r"\bA10G\b", "a10g"),
    (r"\bL40S\b", "l40s"),
    (r"\bL4\b", "l4"),
    (r"RTX 4090", "rtx4090"),
)


def gpu_key(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' → 'h100'. Unknown names become a slug of the name."""
    for pattern, key in _GPU_KEYS:
        if re.search(pattern, name, re.IGNORECASE):
            return key
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return slug or "unknown"
