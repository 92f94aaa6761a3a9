"""Backward kernels: kernel_1 (grad_input and partial or final grad_weight/grad_bias, by strategy) and
kernel_2 (the partials' reduction), with the host-side plan and launcher. See `common.py` for the math."""

from ..heuristics import needs_int64
from .launch import TORCH_DTYPES, BackwardLaunch, Plan, plan, precompile
from .reduce import PDL_SUPPORTED

__all__ = ["PDL_SUPPORTED", "TORCH_DTYPES", "BackwardLaunch", "Plan", "needs_int64", "plan", "precompile"]
