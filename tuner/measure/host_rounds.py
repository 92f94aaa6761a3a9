"""Host µs per call of every implementation of one bench case, measured in interleaved rounds.

A GPU host's CPU drifts: the same host call costs several times more from one minute to the next, and a slow
stretch of a few seconds is enough to make whichever implementation it lands on look slower. Measured one
implementation after another (the bench's order), that drift decides close comparisons: an implementation
cheaper on the median over the shapes still loses single shapes on such spikes.

So the host view of a case is taken after every implementation of it has been prepared: each round times every
call once (`calls` back-to-back calls behind a spin, `views.host_us_per_call`), and the round's order is rotated
by one so that no call always comes first or last; a call's figure is its median over the rounds. A call that
raises is dropped from the later rounds and reported with a note, without touching its row's other views.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable


@dataclass
class HostCall:
    """One host-timed call: its figure goes into `row[field]`."""

    row: dict
    field: str
    fn: Callable[[], object]


def measure_rounds(calls: list[HostCall], rounds: int, time_call: Callable[[Callable[[], object]], float]) -> None:
    """Fill each call's row field with the median of its `rounds` timings (`time_call(fn)`: host µs per call, one
    sample), the calls interleaved; a call that raised gets None and a note on its row."""
    samples: list[list[float]] = [[] for _ in calls]
    failed: dict[int, str] = {}
    n = len(calls)
    for r in range(max(1, rounds)):
        for k in range(n):
            i = (r + k) % n
            if i in failed:
                continue
            try:
                samples[i].append(time_call(calls[i].fn))
            except Exception as err:  # noqa: BLE001 - a failing call costs its host figure, not the row
                failed[i] = f"{type(err).__name__}: {str(err)[:200]}"
    for i, call in enumerate(calls):
        if i in failed:
            call.row[call.field] = None
            note = f"{call.field} not measured ({failed[i]})"
            call.row["note"] = f"{call.row['note']}; {note}" if call.row.get("note") else note
        else:
            call.row[call.field] = statistics.median(samples[i])
