"""What a tune fits (`Plan`): its problems, the trials it may spend on each, how it validates, how it starts; and its
identity, a digest of all of that, which names its studies and its journal in the database. The same command on the
same database is the same tune and continues it; a tune of other problems or settings is another one.

Neither the time budget nor where the work runs (devices, hosts) nor where the table is written is part of it."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass

from normtune.kernels.config import Problem

from ..shapes import HELDOUT
from ..sweep.options import study_name

# The held-out preset: shapes kept for measuring a finished table (`normtune validate`, `normtune compare`). A tune
# never sweeps, fits or validates on them.
HELDOUT_PRESET = frozenset(HELDOUT)
FORMS = ("plain", "residual", "gated")
JOURNAL_PREFIX = "normtune-tune"


def without_heldout_preset(problems: list[Problem]) -> tuple[list[Problem], list[Problem]]:
    """(the problems outside the held-out preset, those in it)."""
    kept = [p for p in problems if (p.M, p.N) not in HELDOUT_PRESET]
    return kept, [p for p in problems if (p.M, p.N) in HELDOUT_PRESET]


@dataclass(frozen=True)
class Plan:
    gpu_key: str  # the results' label: the device's key, or "interpret"
    interpret: bool
    problems: tuple[Problem, ...]  # the problems the table is fitted on
    trials: int = 40  # the most trials one problem gets
    heldout_per_family: int = 4  # generated held-out shapes per problem family
    reference_trials: int = 8  # trials of the unseeded reference sweep per held-out shape
    warm_start: str | None = None  # the --from table, as "<label> <sha256 of its bytes>"; None: no warm start
    as_new_gpu: bool = False  # the device's own tables hidden from the whole run

    def __post_init__(self):
        for option, value in (("--trials", self.trials), ("--heldout", self.heldout_per_family),
                              ("--reference-trials", self.reference_trials)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} {value}: give a whole number of at least 1")
        if not self.problems:
            raise ValueError("nothing to tune: the options leave no problem (see --shapes, --norm, --forms)")
        inside = sorted({f"{p.M}x{p.N}" for p in self.problems if (p.M, p.N) in HELDOUT_PRESET})
        if inside:
            raise ValueError(f"shapes of the held-out preset ({', '.join(inside)}) are kept for the final measurement: "
                             "a tune never fits them")

    @property
    def tune_id(self) -> str:
        """Ten hex digits naming this tune in the database."""
        text = json.dumps({"gpu": self.gpu_key, "interpret": self.interpret,
                           "problems": sorted(p.key for p in self.problems), "trials": self.trials,
                           "heldout": self.heldout_per_family, "reference_trials": self.reference_trials,
                           "from": self.warm_start, "as_new_gpu": self.as_new_gpu}, sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:10]

    @property
    def study_prefix(self) -> str:
        """The prefix of this tune's own studies (the reference sweeps of validation share `validate`'s)."""
        return f"{JOURNAL_PREFIX}-{self.tune_id}"

    @property
    def journal_name(self) -> str:
        return f"{JOURNAL_PREFIX}:{'interpret' if self.interpret else self.gpu_key}:{self.tune_id}"

    def study(self, problem: Problem) -> str:
        return study_name(self.gpu_key, problem, self.interpret, self.study_prefix)

    def families(self) -> dict[str, list[Problem]]:
        """Family key → its problems, by (N, M)."""
        out: dict[str, list[Problem]] = defaultdict(list)
        for p in sorted(self.problems, key=lambda q: (q.N, q.M)):
            out[p.family.key].append(p)
        return dict(sorted(out.items()))
