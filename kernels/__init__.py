"""normtune runtime: Triton LayerNorm/RMSNorm forward and tunable two-kernel backward.

    from normtune.kernels import layer_norm, rms_norm, LayerNorm, RMSNorm, BackwardConfig, patch
"""

from .config import (
    BackwardConfig,
    ConfigError,
    Kernel1Config,
    Kernel2Config,
    Problem,
    ProblemFamily,
)
from .heuristics import default_config
from .functional import layer_norm, rms_norm
from .modules import LayerNorm, RMSNorm
from .patch import PatchReport, patch
from .select import select_config

__all__ = [
    "BackwardConfig", "ConfigError", "Kernel1Config", "Kernel2Config", "LayerNorm", "PatchReport", "Problem",
    "ProblemFamily", "RMSNorm", "default_config", "layer_norm", "patch", "rms_norm", "select_config",
]
