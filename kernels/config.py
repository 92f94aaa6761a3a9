"""Launch configuration values, in one import: `BackwardConfig` (a strategy's kernel_1 config, built with
`kernel_1_config` or the strategy's `make`, and a `Kernel2Config`: `strategies/configs.py`, `knobs.py`), the
`Problem` it runs (`problem.py`), the strategy registry (`strategies/`) and the analytic default.

A config is hashable, printable, and round-trips through JSON: the single definition shared by the runtime
(`kernels/`), the tuner (`tuner/`) and the emitted heuristic tables (`configs/*.json`). `validate(problem)`
rejects combinations the kernels cannot run (or cannot run sensibly) before anything is compiled, with a message
naming the field and the values it could take.
"""

from __future__ import annotations

from .heuristics import ROW_SPLITS  # noqa: F401 - re-exported: the rows strategy's splits
from .knobs import (  # noqa: F401 - re-exported: `from .config import Kernel1Config` is the usual spelling
    EVICTION_POLICIES,
    MAX_BLOCK_COL,
    MAX_BLOCK_ROW,
    MAX_NUM_STAGES,
    MAX_PROGRAMS_PER_SM,
    MAX_TILE,
    NUM_WARPS,
    Kernel1Config,
    Kernel2Config,
    mapping_to_json,
)
from .problem import (  # noqa: F401 - the problem's names are re-exported: `from .config import Problem` works
    DTYPES,
    ITEMSIZE,
    MAX_M,
    MAX_N,
    NORMS,
    RECOVER_LIMITS,
    SAVE_MODES,
    ConfigError,
    Problem,
    ProblemFamily,
    canonical_dtype,
    is_power_of_two,
)
from .strategies import (  # noqa: F401 - the registry, the config of both kernels and the analytic default
    STRATEGIES,
    BackwardConfig,
    default_config,
    kernel_1_config,
    kernel_1_layout,
    register,
)
