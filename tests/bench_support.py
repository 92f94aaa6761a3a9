"""What the block benches' tests share: a measuring session that runs each timed callable once and reports made-up
times (the interpreter's timings are wall-clock and slow), counting the calls it was asked to time."""

from __future__ import annotations

from normtune.tuner.measure.harness import MeasureSession
from normtune.tuner.measure.results import Stats


class StandInTiming:
    def __init__(self):
        self.session = MeasureSession("cpu")
        self.calls = 0

    def time_callable(self, fn):
        self.calls += 1
        fn()
        return Stats(10.0 + self.calls, 9.0, 12.0, 1)

    def __getattr__(self, name):
        return getattr(self.session, name)
