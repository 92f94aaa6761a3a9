"""The sweep helpers kept across sweeps (`KeptHelpers`): a caller that runs sweep after sweep on one device
(`normtune tune`: its rounds, reference sweeps and resweeps) starts the measuring process and the compile pool
once and lends them to each `run(options, helpers=…)`, instead of every sweep starting its own (importing torch,
making a CUDA context, spawning the compile processes: seconds each time). A sweep given them stops neither; the
owner does, when it closes. What a sweep leaves behind is cleared before the next: a measuring process with an
answer nobody collected is replaced, as is a broken compile pool; one the sweep killed restarts on its next trial."""

from __future__ import annotations

from .compiling import pool_usable, stop_pool
from .measuring import start_helpers


class KeptHelpers:
    """The measuring process (the sweep's timing preset, the device's own L2 size) and the compile pool of
    `compile_workers` processes for `device`, started on the first `lend`."""

    def __init__(self, device: int, interpret: bool, compile_workers: int):
        self._args = (device, interpret, compile_workers)
        self._helpers: tuple | None = None

    def lend(self) -> tuple:
        """(measurer, pool) for one sweep, started on first use and checked after the last."""
        device, interpret, workers = self._args
        if self._helpers is None:
            self._helpers = start_helpers(device, interpret, workers)
        measurer, pool = self._helpers
        measurer.discard_stale()
        if pool is not None and not pool_usable(pool):
            from .compiling import compile_pool

            stop_pool(pool)
            pool = compile_pool(workers, device)
            self._helpers = (measurer, pool)
        return self._helpers

    def close(self) -> None:
        if self._helpers is not None:
            measurer, pool = self._helpers
            self._helpers = None
            measurer.close()
            stop_pool(pool)

    def __enter__(self) -> "KeptHelpers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
