"""Backward kernels: kernel_1 (grad_input and partial or final grad_weight/grad_bias, by strategy) and
kernel_2 (the partials' reduction), with the plan types the strategies fill (`plan.py`) and the scratch they use
(`workspace.py`). See `common.py` for the math. The launch above them, which dispatches to the strategies, is
`kernels/backward_launch.py`: nothing here imports a strategy."""

from ..heuristics import needs_int64
from .plan import TORCH_DTYPES, Plan
from .reduce import PDL_SUPPORTED

__all__ = ["PDL_SUPPORTED", "TORCH_DTYPES", "Plan", "needs_int64"]
