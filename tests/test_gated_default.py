"""The analytic default of the gated form: its register estimate counts the gate's live values (z, its activation,
the dz term) and its prefetched raw tile, so that a one-row tile of 16 elements per thread is not prefetched but
pipelined through shared memory, with z counted among the staged tiles; the plain form's default is unchanged."""

from __future__ import annotations

import pytest

from normtune.kernels.config import Problem, default_config
from normtune.kernels.heuristics import GATE_LIVE, estimate_registers, hardware_registers, staged_shared_bytes
from normtune.kernels.limits import REFERENCE


def k1(problem):
    return default_config(problem, REFERENCE).kernel_1


@pytest.mark.parametrize("M, N", [(8192, 5120), (16384, 4096), (4096, 1024), (65536, 256)])
@pytest.mark.parametrize("gate", ["before", "after"])
def test_a_gated_whole_row_tile_is_staged_not_prefetched(M, N, gate):
    plain, gated = k1(Problem("rms_norm", M, N, "bf16")), k1(Problem("rms_norm", M, N, "bf16", gate=gate))
    assert plain.prefetch and plain.num_stages == 1  # the plain default as it was
    assert (gated.block_row, gated.block_col, gated.num_warps) == (plain.block_row, plain.block_col, plain.num_warps)
    assert not gated.prefetch and gated.num_stages == 3


def test_the_gate_adds_its_live_values_and_its_staged_tile():
    plain, gated = Problem("rms_norm", 8192, 8192, "bf16"), Problem("rms_norm", 8192, 8192, "bf16", gate="after")
    per_thread = 8192 // (32 * 16)
    for prefetch in (False, True):
        extra = per_thread * (GATE_LIVE + prefetch * 2 / 4)  # z, act(z), the dz term; z's raw next tile
        assert estimate_registers(gated, 1, 8192, 16, False, prefetch) == \
            estimate_registers(plain, 1, 8192, 16, False, prefetch) + extra
    # prefetching the gated tile passes the registers 16 warps have; the plain tile's does not
    assert estimate_registers(gated, 1, 8192, 16, False, True) > hardware_registers(16) >= \
        estimate_registers(plain, 1, 8192, 16, False, True)
    # x, dy, z and the one-row tile's weight row, in 2 stages (the plain form without z)
    assert staged_shared_bytes(gated, 1, 8192, 3, False, False, 16, weight_row=True) - \
        staged_shared_bytes(plain, 1, 8192, 3, False, False, 16, weight_row=True) == 2 * 8192 * 2
