"""The held-out set `normtune validate` measures tables on: shapes and dtypes no sweep preset fits on.

The seed shapes are powers of two at three problem sizes, the `llm` preset real hidden sizes at 4096 and 16384
tokens. What a table has never seen, and where a rule fitted on those would break first: odd token counts,
hidden sizes that are not powers of two, few rows (M ≤ 256: a grid too short to fill the GPU), very wide rows
(32768 and 65536 columns: two-pass only), very tall and narrow problems (a huge kernel_2 partial buffer
relative to the work), and activations in fp32 and fp16 (tables are tuned in bf16: those read the bf16 rules
where a config carries over, `kernels/select/adapt.py`, else the analytic default).
"""

from __future__ import annotations

from normtune.kernels.config import Problem

HELDOUT_SHAPES = (
    # odd M and hidden sizes that are not powers of two
    (4093, 1536), (12289, 2560), (1000, 3584), (3001, 5120), (777, 7168), (6000, 12288), (20000, 3000),
    (8192, 2880), (2500, 5376), (4096, 6656), (1500, 10240), (5000, 896),
    # few rows
    (96, 4096), (128, 16384), (257, 14336), (64, 8192), (200, 5120), (256, 2304),
    # very wide rows
    (512, 32768), (2048, 32768), (64, 65536), (128, 65536),
    # very tall and narrow
    (65536, 768), (131072, 1024), (262144, 256), (524288, 128),
)
# Activation dtypes other than the tables' bf16, on a few shapes of each kind.
HELDOUT_OTHER_DTYPES = {
    "fp16": ((4093, 1536), (200, 5120), (512, 32768), (131072, 1024)),
    "fp32": ((3001, 5120), (96, 4096), (2048, 32768), (65536, 768)),
}


def heldout_problems(norms: list[str], dtype: str = "bf16") -> list[Problem]:
    """Every held-out problem for `norms`: HELDOUT_SHAPES in `dtype`, then HELDOUT_OTHER_DTYPES. LayerNorm has a
    bias, RMSNorm none; weights in the activation dtype; the input saved (the sweeps' defaults)."""
    cases = [(dtype, shape) for shape in HELDOUT_SHAPES]
    cases += [(dt, shape) for dt, shapes in HELDOUT_OTHER_DTYPES.items() if dt != dtype for shape in shapes]
    return [Problem(norm, M, N, dt, dt, True, norm == "layer_norm", False, "input")
            for norm in norms for dt, (M, N) in cases]
