"""Where a tune's sweep trials go, round by round (`next_round`).

Every problem first gets COVER trials (the analytic default and the first structural seeds), so that a short time
budget still reaches every problem, then `first_round` (the seeds: the structural ones, then the default's
neighbours, up to the tune's seed limit, before any sampled config), then one `round_step` of search: the `opening`
rounds. Then more in steps of `round_step` up to `--trials`. A problem whose best time has not improved by more than
STALL_GAIN over its last `round_step` trials stops where it is: more of the same search does not pay there. The
trials it would have had go to the problems whose best moved most over their last step, where the search pays most.
From the round after the seeds' on, a round also carries each problem's transfers (`transfer.py`: the best configs
of the problems of its family nearest to it, not measured on it yet): a raised problem's step starts with them, and
a problem stalled or at `--trials` gets as many more trials, up to TRANSFER_CEILING x `--trials`
(`with_transfers`); a stalled problem whose best a transfer moved by more than STALL_GAIN is revived, its search
going on from there. The rounds go on while a problem is raised or has transfers; each transfer is a config its
study did not hold, and the ceiling bounds them. A decision reads only the measurements, in trial order, and is
recorded in the journal (with its transfers' configs and first slots) before its trials are measured, so that a
run continued after a kill measures exactly the same configs in the same slots."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..sweep.options import FIRST_ROUND

STALL_GAIN = 0.01  # a best that moved by no more than this fraction over a step has stalled
COVER = 4  # the first round's trials per problem
TRANSFER_CEILING = 2  # transfers take a problem to at most this many times --trials


def first_round(trials: int) -> int:
    """The first round's trials per problem: the seeds' round (FIRST_ROUND), within half of `trials`."""
    return max(1, min(FIRST_ROUND, -(-trials // 2)))


def opening(trials: int) -> list[int]:
    """The targets every problem gets, round after round, before the rounds that stop a stalled problem: the cover,
    the seeds, then one step of search past them (the local sampler's moves from the best seed), so that a
    problem is judged stalled by what its search found and never by its seeds alone."""
    first = first_round(trials)
    return sorted({min(COVER, first), first, min(trials, first + round_step(trials))})


def transfers_from(targets: dict[str, int], trials: int) -> bool:
    """Whether the round after targets `targets` carries transfers: once every problem's seeds are measured."""
    return bool(targets) and min(targets.values()) >= first_round(trials)


def round_step(trials: int) -> int:
    """The trials a later round adds to a problem whose search still pays: what is left past the first round in
    three steps."""
    return max(1, -(-(trials - first_round(trials)) // 3))


def gain(values: list[float | None], window: int) -> float | None:
    """How much the best of `values` (measured times in trial order; None: a trial that failed) improved over its
    last `window` trials: the best before them ÷ the best of all − 1 (0: not at all). Infinite where only those
    trials ran correctly; None where none did, or where there is nothing before them."""
    if len(values) <= window:
        return None
    before = [v for v in values[:-window] if v]
    every = [v for v in values if v]
    if not every:
        return None
    return math.inf if not before else min(before) / min(every) - 1.0


@dataclass
class Round:
    targets: dict[str, int]  # problem key -> trials its study ends with
    raised: list[str] = field(default_factory=list)  # given one more step: their search still pays
    stalled: list[str] = field(default_factory=list)  # stopped in this round
    given: list[str] = field(default_factory=list)  # given the stalled problems' step too
    # problem key -> {"slot": its study's first slot for them, "configs": the transfers measured there}
    transfers: dict[str, dict] = field(default_factory=dict)
    revived: list[str] = field(default_factory=list)  # stopped before, raised again: a transfer moved their best

    @property
    def changed(self) -> bool:
        return bool(self.raised or self.transfers)

    def to_dict(self) -> dict:
        return {"raised": self.raised, "stalled": self.stalled, "given": self.given, "transfers": self.transfers,
                "revived": self.revived}


def with_transfers(decision: Round, before: dict[str, int], transfers: dict[str, list], trials: int,
                   counts: dict[str, int] | None = None) -> Round:
    """`decision` (from targets `before`) with each problem's `transfers` (problem key -> configs, in slot order)
    in its next slots: a raised problem's step starts with them (as many as the step holds); any other problem
    gets one more trial for each, up to TRANSFER_CEILING x `trials`. `counts`: the trials each study holds, where
    one ended short of its target (its space offered no more): its transfers start in its first empty slot."""
    targets, placed = dict(decision.targets), {}
    for key in sorted(transfers):
        start = min(before[key], (counts or {}).get(key, before[key]))
        if key in decision.raised:
            room = targets[key] - start
        else:
            room = max(0, TRANSFER_CEILING * trials - start)
        configs = list(transfers[key])[:room]
        if not configs:
            continue
        placed[key] = {"slot": start, "configs": configs}
        targets[key] = max(targets[key], start + len(configs))
    return dataclasses.replace(decision, targets=targets, transfers=placed)


def stopped_after(entries: list[dict]) -> set[str]:
    """The problems stopped after the rounds `entries` (as the journal keeps them, in order): stalled in a round
    and not revived since."""
    out: set[str] = set()
    for entry in entries:
        out = (out | set(entry["stalled"])) - set(entry.get("revived", []))
    return out


def next_round(values: dict[str, list[float | None]], targets: dict[str, int], stopped: set[str], trials: int,
               step: int, transfers: dict[str, list] | None = None, tried: dict[str, int] | None = None) -> Round:
    """The next round's targets, from each problem's measured values (trial order) at its current target.
    `stopped`: problems stalled in an earlier round (`stopped_after`), not raised again unless revived;
    `transfers`: problem key -> configs to measure on it next (`with_transfers`); `tried`: problem key -> the
    transfers its last round measured. A stopped problem whose best those moved by more than STALL_GAIN is revived:
    its search goes on, from the transfer that won."""
    tried = tried or {}
    revived = sorted(k for k in stopped if targets[k] < trials and tried.get(k)
                     and (gain(values.get(k, []), tried[k]) or 0.0) > STALL_GAIN)
    gains = {k: gain(values.get(k, []), step) for k in targets}
    active = sorted(k for k in targets if targets[k] < trials and (k not in stopped or k in revived))
    stalled = [k for k in active if k not in revived and gains[k] is not None and gains[k] <= STALL_GAIN]
    raised = [k for k in active if k not in stalled]
    new = dict(targets)
    for k in raised:
        new[k] = min(trials, targets[k] + step)
    room = [k for k in raised if new[k] < trials]
    given = sorted(room, key=lambda k: (-(gains[k] if gains[k] is not None else 0.0), k))[:len(stalled)]
    for k in given:
        new[k] = min(trials, new[k] + step)
    counts = {k: len(v) for k, v in values.items()}
    return with_transfers(Round(new, raised, stalled, sorted(given), revived=revived), targets, transfers or {},
                          trials, counts)
