"""Which of a tune's tables it ships (`tune.finish.candidate`): of the validated tables, one with every family
the tune fitted before one that leaves a family to the analytic default, then the lowest held-out regret, the
later table on a tie."""

from __future__ import annotations

from types import SimpleNamespace

from normtune.tuner.tune import journal as J
from normtune.tuner.tune.finish import candidate


class _Journal:
    def __init__(self, data):
        self.data = data

    def get(self, key, default=None):
        return self.data.get(key, default)


def _ctx(families: list[int], regrets: list[float | None]):
    emissions = [{"table": {"families": {f"family-{i}": {} for i in range(n)}}} for n in families]
    validations = [{"emission": i, "summary": {"geomean_regret": r}} for i, r in enumerate(regrets)]
    return SimpleNamespace(journal=_Journal({J.EMISSIONS: emissions, J.VALIDATIONS: validations}))


def test_a_table_missing_a_family_is_not_shipped_over_one_with_every_family():
    # Table 0 (one family: the residual one not swept yet) validated best on noisy timings; tables 1-2 have both.
    assert candidate(_ctx([1, 2, 2], [1.10, 1.25, 1.20])) == 2


def test_among_tables_of_every_family_the_lowest_regret_then_the_later_one():
    assert candidate(_ctx([2, 2, 2], [1.05, 1.02, 1.08])) == 1
    assert candidate(_ctx([2, 2, 2], [1.05, 1.02, 1.02])) == 2
    assert candidate(_ctx([2, 2], [1.05, None])) == 0  # a table not validated is not compared
