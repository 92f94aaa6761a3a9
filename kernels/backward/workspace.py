"""Memory the backward's kernels use between their own launches, kept per stream rather than allocated per call.

kernel_1's fp32 partial rows (read back by kernel_2 or the fused reduction), the split-row exchange and the
columns strategy's row sums live only from kernel_1's start to the last read of the same backward, on one
stream: the next backward on that stream starts after it ends. So one buffer per (device, stream) serves every
call, and the views a launch needs are made once per set of shapes. On a GPU host each `torch.empty` and each view
costs CPU time on the call's path (docs/kernel-figures.md); a LayerNorm backward with a bias needed two of each
per call.

Not kept: anything while the stream is being captured into a CUDA graph (the graph's own pool serves those, so
that a replay never shares memory with calls outside it), and sets of scratch past `MAX_SCRATCH_BYTES` (they are
allocated per call, as before).

The synchronisation counters (split rows, the fused reduction's grid barrier) are per stream too, for another
reason: programs reset them before they exit, so they must start at zero and no two streams may share them.
"""

from __future__ import annotations

import functools
import math

import torch

from ..device import sm_count
from ..heuristics import MAX_PROGRAMS_PER_SM_SYNC, cdiv
from .common import COUNTER_STRIDE_ELEMENTS

# Bytes of scratch kept per stream; a call that needs more allocates its own.
MAX_SCRATCH_BYTES = 64 << 20
# Streams (and, per stream, sets of shapes) remembered before the table starts over.
MAX_STREAMS = 64
MAX_SHAPE_SETS = 64

# Every buffer a kernel gets starts on a 16-byte boundary (4 fp32/int32 elements): Triton specializes pointer
# arguments on that alignment, and the compile-ahead path (`precompile`, whose placeholders count as aligned) must
# build exactly the kernel a launch runs, or the launch compiles it again.
ALIGN_ELEMENTS = 4

Shapes = tuple  # of shapes (tuples of ints) or None where a launch has no such buffer


def aligned(n: int) -> int:
    return cdiv(n, ALIGN_ELEMENTS) * ALIGN_ELEMENTS


# Whether a device is a CUDA device, per device object: `torch.device.type` builds its string on every read.
_IS_CUDA: dict[torch.device, bool] = {}


def _is_cuda(device: torch.device) -> bool:
    cuda = _IS_CUDA.get(device)
    if cuda is None:
        cuda = _IS_CUDA[device] = device.type == "cuda"
    return cuda


def _stream(device: torch.device) -> int | None:
    """The current stream of CUDA `device` (with its index), or None while it is being captured."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return None
    return torch._C._cuda_getCurrentRawStream(device.index)


class _StreamScratch:
    __slots__ = ("buffer", "views")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.views: dict[Shapes, tuple] = {}


_SCRATCH: dict[tuple[torch.device, int], _StreamScratch] = {}


def _carve(buffer: torch.Tensor, shapes: Shapes) -> tuple:
    views, at = [], 0
    for shape in shapes:
        if shape is None:
            views.append(None)
            continue
        n = math.prod(shape)
        views.append(buffer[at:at + n].view(shape))
        at += aligned(n)
    return tuple(views)


def scratch(device: torch.device, shapes: Shapes) -> tuple:
    """fp32 tensors of `shapes` (None stays None), each 16-byte aligned, for one backward on the current stream.
    Their contents are whatever the last backward on this stream left: kernels write before they read."""
    if not _is_cuda(device):
        stream = 0
    else:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = _stream(device)
    key = (device, stream)
    entry = _SCRATCH.get(key) if stream is not None else None
    if entry is not None:
        views = entry.views.get(shapes)
        if views is not None:
            return views
    total = sum(aligned(math.prod(s)) for s in shapes if s is not None)
    if stream is None or total * 4 > MAX_SCRATCH_BYTES:
        return tuple(None if s is None else torch.empty(s, dtype=torch.float32, device=device) for s in shapes)
    if entry is None or entry.buffer.numel() < total:
        # A larger buffer: the old one's memory returns to the stream's pool once no launch holds its views.
        if entry is None and len(_SCRATCH) >= MAX_STREAMS:
            _SCRATCH.clear()
        entry = _SCRATCH[key] = _StreamScratch(torch.empty((max(total, 1),), dtype=torch.float32, device=device))
    if len(entry.views) >= MAX_SHAPE_SETS:
        entry.views.clear()
    views = entry.views[shapes] = _carve(entry.buffer, shapes)
    return views


def clear_scratch() -> None:
    """Forget every stream's scratch (e.g. to give its memory back)."""
    _SCRATCH.clear()


@functools.lru_cache(maxsize=None)
def _sync_buffer(device: torch.device, stream: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 counters, zero between launches (each waiting kernel resets what it used), as the three parts
    kernel_1 takes: (per-group polled counters, one per COUNTER_STRIDE elements; per-group leave counters; the
    grid barrier's two counters). Polled counters each have a 128-byte line of their own. One buffer per stream,
    so two streams never share counters; the parts are views made once."""
    stride = COUNTER_STRIDE_ELEMENTS
    buf = torch.zeros(stride * (1 + groups) + groups, dtype=torch.int32, device=device)
    return buf[stride:stride * (1 + groups)], buf[stride * (1 + groups):], buf[:2]


def sync_counters(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The current stream's counters (see `_sync_buffer`): (per-group polled, per-group leave, global)."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if _is_cuda(device) else 0
    return _sync_buffer(device, stream, aligned(MAX_PROGRAMS_PER_SM_SYNC * sm_count(device)))
