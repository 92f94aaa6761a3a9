"""Compile-ahead workers: CPU processes that compile upcoming configs so that Triton's on-disk cache serves the
measuring process (the GPU never waits on a compiler)."""

from __future__ import annotations

import time


def _compile_init(device_index: int) -> None:
    import torch

    torch.cuda.set_device(device_index)


def _compile_one(problem_dict: dict, config_json: str, sms: int) -> tuple[str, float, str | None]:
    """(status, seconds, error) of compiling a config ahead of its measurement."""
    from normtune.kernels.backward import precompile
    from normtune.kernels.config import BackwardConfig as BC
    from normtune.kernels.config import Problem as P

    from ..measure import classify_exception

    t = time.perf_counter()
    try:
        precompile(P.from_dict(problem_dict), BC.from_json(config_json), sms)
        return "ok", time.perf_counter() - t, None
    except Exception as err:  # noqa: BLE001
        return classify_exception(err), time.perf_counter() - t, f"{type(err).__name__}: {str(err)[:3000]}"
