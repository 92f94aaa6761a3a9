"""kernel_2: the reduction of kernel_1's fp32 partial rows into grad_weight/grad_bias — as its own launch, or
fused into kernel_1's tail (`reduce_columns` is the one loop both run, so both give bitwise the same sums)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import assume_multiple, store_column_sums

try:  # Programmatic Dependent Launch (Hopper+): kernel_2 launches while kernel_1 drains, then waits on its writes.
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    PDL_SUPPORTED = "launch_pdl" in CUDAOptions.__dataclass_fields__
except Exception:  # noqa: BLE001 - an older Triton, or no NVIDIA backend: PDL is simply off
    PDL_SUPPORTED = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def reduce_columns(PARTIAL_DW, PARTIAL_DB, DW, DB, P, N, first, step, HAS_WEIGHT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Sum the P partial rows of column blocks first, first + step, … (block_n columns each) in row order and
    store them in the outputs' dtype. Loads bypass L1 (.cg): in the fused form other SMs wrote the partials."""
    for block in range(first, tl.cdiv(N, BLOCK_N), step):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc_dw = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_db = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for m0 in tl.range(0, P, BLOCK_M, num_stages=NUM_STAGES):
            rows = m0 + tl.arange(0, BLOCK_M)
            mask = (rows < P)[:, None] & col_mask[None, :]
            offsets = rows[:, None] * N + cols[None, :]
            if HAS_WEIGHT:
                acc_dw += tl.load(PARTIAL_DW + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc_db += tl.load(PARTIAL_DB + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        store_column_sums(DW, DB, acc_dw, acc_db, cols, col_mask, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def kernel_2(
    PARTIAL_DW, PARTIAL_DB,  # [P, N] fp32 partials from kernel_1
    DW, DB,  # [N] outputs, in the weight's dtype
    P, N,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, HINT: tl.constexpr = 1,  # N is a multiple of HINT
):
    """Program i reduces column blocks i, i + programs, … (one block each on the usual cdiv(N, block_n) grid;
    the interpreter runs a fused config's reduction on kernel_1's grid instead)."""
    if PDL:
        gdc_wait()  # launched early (programmatic dependent launch): wait until kernel_1's partials are visible
    reduce_columns(PARTIAL_DW, PARTIAL_DB, DW, DB, P, assume_multiple(N, HINT), tl.program_id(0), tl.num_programs(0),
                   HAS_WEIGHT, HAS_BIAS, BLOCK_M, BLOCK_N, NUM_STAGES)
