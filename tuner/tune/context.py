"""What every phase of a tune works with (`TuneContext`): the plan and its held-out problems, the database and the
tune's journal in it, the device, the clock, and the in-process measuring session of re-measurement, validation
and the gate (made once, on first use)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from normtune.kernels.config import Problem

from . import journal as J
from .clock import Clock
from .plan import Plan


class TuneError(ValueError):
    """A tune that cannot go on; the message says why and what to do (one line)."""


@dataclass
class TuneContext:
    plan: Plan
    heldout: list[Problem]  # the generated held-out problems (`unseen.py`)
    store: object  # tuner.store.database.Store
    info: object  # tuner.gpu_info.DeviceInfo of the device measured on
    journal: J.Journal
    clock: Clock
    command_line: str
    device: int = 0
    devices: list[int] | None = None  # --devices: one sweep worker per GPU
    compile_workers: int = 8
    heartbeats: tuple[int, int] = (20, 60)  # the sweeps' heartbeat interval and grace period, seconds
    incumbent: object = None  # kernels.tables.Table the tune must not lose to (None: none)
    incumbent_label: str | None = None  # where it came from, as the tune's first run found it
    warm_table: object = None  # kernels.tables.Table of --from (None: no warm start)
    say: Callable[[str], None] = lambda line: None  # a line worth keeping above the live display
    progress: object = None  # display.Progress (phase, held-out regret), or None
    on_sweep_event: Callable[[str, dict], None] | None = None
    helpers: object = None  # sweep.engine.KeptHelpers lent to every sweep on one device (None: each starts its own)
    _session: object = None

    def fit_problems(self) -> list[Problem]:
        """The plan's problems and those added where validation pointed (`journal.RESWEEPS`)."""
        out = list(self.plan.problems)
        for resweep in self.journal.get(J.RESWEEPS, []):
            out += [p for p in map(Problem.from_dict, resweep["added"]) if p not in out]
        return out

    def targets(self) -> dict[str, int]:
        """Problem key → the trials its study ends with: the last round's targets, raised by each resweep."""
        rounds = self.journal.get(J.ROUNDS, [])
        out = dict(rounds[-1]["targets"]) if rounds else {}
        for resweep in self.journal.get(J.RESWEEPS, []):
            out.update(resweep["targets"])
        return out

    def session(self):
        """The in-process measuring session (cold L2, head-to-head timing), made on first use."""
        if self._session is None:
            from ..measure.harness import TIMING, MeasureSession

            self._session = MeasureSession.for_device(self.info, self.device, timing=TIMING["remeasure"])
        return self._session

    def limits(self):
        """The device's limits as the runtime reads them (None on the interpreter)."""
        from ..gpu_info import measured_limits

        return measured_limits(self.session().device)
