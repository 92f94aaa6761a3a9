"""normtune runtime: Triton LayerNorm/RMSNorm forward and tunable two-kernel backward.

    from normtune.kernels import layer_norm, rms_norm, LayerNorm, RMSNorm, BackwardConfig, patch
    y, h = rms_norm(x, w, residual=r)                 # fused residual form (also FusedAddRMSNorm, FusedAddLayerNorm)
    y = rms_norm(x, w, gate=z, gate_position="after")  # gated RMSNorm of hybrid models (also GatedRMSNorm)
    from normtune.kernels import layer_norm_forward, layer_norm_backward  # no autograd: for your own Function
"""

import importlib
import sys


def _stand_for_normtune_kernels(name: str) -> bool:
    """Loaded under another name than normtune.kernels — the checkout's root is on sys.path (a run from it) and
    something imported this folder as `kernels` (transformers does, looking for Hugging Face's `kernels` package):
    running these modules a second time would register normtune's torch ops again and free the first registration,
    which normtune.kernels still calls (a crash at its next call). Become normtune.kernels instead, if it can load."""
    try:
        sys.modules[name] = importlib.import_module("normtune.kernels")
    except ImportError:
        return False
    return True


if __name__ == "normtune.kernels" or not _stand_for_normtune_kernels(__name__):
    from .config import (
        BackwardConfig,
        ConfigError,
        Kernel1Config,
        Kernel2Config,
        Problem,
        ProblemFamily,
        kernel_1_config,
    )
    from .strategies import default_config
    from .api.functional import layer_norm, rms_norm
    from .api.direct import layer_norm_backward, layer_norm_forward, rms_norm_backward, rms_norm_forward
    from .api.modules import FusedAddLayerNorm, FusedAddRMSNorm, GatedRMSNorm, LayerNorm, RMSNorm
    from .patching.patch import PatchReport, patch
    from .select.select import select_config

__all__ = [
    "BackwardConfig", "ConfigError", "FusedAddLayerNorm", "FusedAddRMSNorm", "GatedRMSNorm", "Kernel1Config",
    "Kernel2Config", "LayerNorm", "PatchReport", "Problem",
    "ProblemFamily", "RMSNorm", "default_config", "layer_norm", "layer_norm_backward", "layer_norm_forward", "patch",
    "kernel_1_config", "rms_norm", "rms_norm_backward", "rms_norm_forward", "select_config",
]
