"""Transfers (`tuner/tune/transfer.py`): the best configs of a problem's nearest neighbours in its family, adapted
to it and not measured on it yet, in the next slots of its study; and how the rounds make room for them
(`rounds.with_transfers`). Replayed from stand-in measurements: no kernel runs."""

from __future__ import annotations

import hashlib
import json
import random
from types import SimpleNamespace

import pytest

from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.tuner.space import Space
from normtune.tuner.tune import journal as J
from normtune.tuner.tune import rounds, transfer, warm


def rms(M: int, N: int, **more) -> Problem:
    return Problem("rms_norm", M, N, "bf16", **more)


P = rms(4096, 4096)
ROWS_UP = rms(8192, 4096)  # one row-count doubling away
ROWS_DOWN = rms(1024, 4096)  # two row-count doublings away
WIDER = rms(4096, 8192)  # one width doubling away: as far as two of rows
FAR = rms(64, 512)
ELSEWHERE = [Problem("layer_norm", 4096, 4096, "bf16"), rms(4096, 4096, residual=True)]  # other families
PROBLEMS = [P, ROWS_UP, ROWS_DOWN, WIDER, FAR, *ELSEWHERE]


def identity(config, problem):
    return config


def bests(**named) -> dict:
    """Problem key -> a stand-in best config (its name; `choose` only compares configs)."""
    by_name = {"P": P, "ROWS_UP": ROWS_UP, "ROWS_DOWN": ROWS_DOWN, "WIDER": WIDER, "FAR": FAR}
    return {by_name[name].key: config for name, config in named.items()}


def test_distance_counts_a_width_ratio_twice_a_row_ratio():
    assert transfer.distance(P, ROWS_UP) == pytest.approx(transfer.distance(P, WIDER) / 2)
    assert transfer.distance(P, ROWS_DOWN) == pytest.approx(transfer.distance(P, WIDER))
    assert transfer.distance(P, P) == 0.0


def test_neighbours_are_the_family_nearest_first_ties_by_key():
    near = transfer.nearest(P, PROBLEMS)
    assert near == [ROWS_UP, ROWS_DOWN, WIDER, FAR]  # 1024x4096 before 4096x8192: the same distance, by key
    assert transfer.nearest(P, PROBLEMS, count=2) == [ROWS_UP, ROWS_DOWN]
    assert transfer.nearest(ELSEWHERE[0], PROBLEMS) == []  # alone in its family


def test_each_problem_takes_its_nearest_neighbours_bests_up_to_k():
    best = bests(P="p", ROWS_UP="a", ROWS_DOWN="b", WIDER="c", FAR="d")
    chosen = transfer.choose(PROBLEMS, best, {}, identity)
    assert chosen[P.key] == ["a", "b", "c"]  # K of them, nearest first
    assert chosen[FAR.key] == ["b", "p", "a"]  # FAR's own nearest first: 1024x4096, 4096x4096, 8192x4096
    assert not any(p.key in chosen for p in ELSEWHERE)  # nothing crosses a family
    assert transfer.choose(PROBLEMS, best, {}, identity, count=1)[P.key] == ["a"]


def test_configs_held_chosen_already_or_not_running_are_passed_over():
    best = bests(P="p", ROWS_UP="a", ROWS_DOWN="a", WIDER="c", FAR="d")
    held = {P.key: {"c"}}
    chosen = transfer.choose(PROBLEMS, best, held, lambda c, p: None if c == "d" and p == P else c)
    assert chosen[P.key] == ["a"]  # a once, c measured on P, d does not run on P
    none = transfer.choose(PROBLEMS, {**best, ROWS_UP.key: None, ROWS_DOWN.key: None}, held, identity)
    assert none[P.key] == ["d"]  # a neighbour without a correct measurement gives nothing


def test_the_choice_does_not_depend_on_the_problems_order():
    best = bests(P="p", ROWS_UP="a", ROWS_DOWN="b", WIDER="c", FAR="d")
    expected = transfer.choose(PROBLEMS, best, {}, identity)
    for seed in range(5):
        shuffled = list(PROBLEMS)
        random.Random(seed).shuffle(shuffled)
        assert transfer.choose(shuffled, best, {}, identity) == expected


def record(config, us, status="ok", number=0):
    return SimpleNamespace(config=config, median_us=us if status == "ok" else None, status=status,
                           trial_number=number, id=number)


def test_the_best_is_the_fastest_correct_measurement_ties_by_config():
    space = Space(P, INTERPRET_SM_COUNT)
    a, b, c = space.seeds()[:3]
    assert transfer.best_config([record(a, 5.0), record(b, 3.0), record(c, 1.0, status="incorrect")]) == b
    tied = transfer.best_config([record(a, 3.0), record(b, 3.0)])
    assert tied == min((a, b), key=lambda x: x.to_json())
    assert transfer.best_config([record(a, None, status="timeout")]) is None


def test_transfers_are_adapted_to_the_problem_as_the_warm_start_adapts_a_table():
    """`transfers` over a tune's measurements: a wide problem's best reaches a narrower one as `warm.for_problem`
    adapts it, a config the space measures; the stored configs decide what is held."""
    narrow, wide = rms(64, 1024), rms(64, 4096)
    spaces = {p.key: Space(p, INTERPRET_SM_COUNT) for p in (narrow, wide)}
    best_wide = spaces[wide.key].seeds()[-1]
    measured = {narrow.key: [record(spaces[narrow.key].seeds()[0], 10.0, number=0)],
                wide.key: [record(spaces[wide.key].seeds()[0], 9.0, number=0), record(best_wide, 4.0, number=1)]}
    ctx = SimpleNamespace(info=SimpleNamespace(sm_count=INTERPRET_SM_COUNT), limits=lambda: None)
    expected = warm.for_problem(best_wide, narrow, spaces[narrow.key], None, INTERPRET_SM_COUNT)
    assert expected.kernel_1.block_col == 1024 != best_wide.kernel_1.block_col  # fitted to the narrower row
    assert spaces[narrow.key].why_not(expected) is None
    back = warm.for_problem(measured[narrow.key][0].config, wide, spaces[wide.key], None, INTERPRET_SM_COUNT)
    assert transfer.transfers(ctx, [narrow, wide], measured) == {narrow.key: [expected.to_dict()],
                                                                 wide.key: [back.to_dict()]}
    measured[narrow.key].append(record(expected, 11.0, number=1))  # measured now: never transferred again
    assert narrow.key not in transfer.transfers(ctx, [narrow, wide], measured)


# ------------------------------------------------------------------------------------------------- rounds


def test_transfers_start_once_every_problems_seeds_are_measured():
    assert rounds.opening(40) == [4, 12, 22]
    assert not rounds.transfers_from({"a": 4, "b": 4}, 40)
    assert rounds.transfers_from({"a": 12, "b": 22}, 40)
    assert rounds.transfers_from({"a": 1}, 2)  # first_round(2) == 1


def test_a_raised_problems_step_starts_with_its_transfers():
    values = {"a": [10.0, 9.0, 9.0, 5.0], "b": [10.0, 10.0, 9.5, 9.0]}
    targets = dict.fromkeys(values, 4)
    decision = rounds.next_round(values, targets, set(), trials=10, step=2, transfers={"a": ["x", "y", "z"],
                                                                                        "b": ["w"]})
    assert decision.raised == ["a", "b"] and decision.targets == {"a": 6, "b": 6}  # the same step
    assert decision.transfers == {"a": {"slot": 4, "configs": ["x", "y"]}, "b": {"slot": 4, "configs": ["w"]}}
    assert decision.to_dict()["transfers"] == decision.transfers


def test_a_stalled_or_finished_problem_gets_a_trial_per_transfer_up_to_twice_trials():
    values = {"flat": [10.0] * 4, "done": [10.0, 9.0, 8.0, 7.0] + [7.0] * 6, "gone": [10.0] * 4,
              "full": [5.0] * 19}
    targets = {"flat": 4, "done": 10, "gone": 4, "full": 19}
    moved = {"flat": ["x"], "done": ["y", "z"], "gone": ["u", "v"], "full": ["s", "t"]}
    decision = rounds.next_round(values, targets, {"gone"}, trials=10, step=2, transfers=moved)
    assert decision.stalled == ["flat"] and decision.raised == []
    assert decision.targets == {"flat": 5, "done": 12, "gone": 6, "full": 20}  # full: at 2 x trials
    assert decision.transfers["full"] == {"slot": 19, "configs": ["s"]}
    assert decision.transfers["gone"] == {"slot": 4, "configs": ["u", "v"]}
    assert decision.changed  # the rounds go on while a problem has transfers
    quiet = rounds.next_round(values, decision.targets, {"gone", "flat"}, trials=10, step=2)
    assert not quiet.changed and quiet.transfers == {}
    ceiling = rounds.next_round({**values, "full": [5.0] * 20}, {**targets, "full": 20}, {"gone"}, trials=10, step=2,
                                transfers={"full": ["s"]})
    assert "full" not in ceiling.transfers and ceiling.targets["full"] == 20


def test_an_opening_round_takes_the_transfers_into_its_uniform_step():
    opened = rounds.Round({"a": 22, "b": 22}, raised=["a", "b"])
    decision = rounds.with_transfers(opened, {"a": 12, "b": 12}, {"b": ["x"]}, 40)
    assert decision.targets == {"a": 22, "b": 22} and decision.transfers == {"b": {"slot": 12, "configs": ["x"]}}


# ------------------------------------------------------------------------------------ the rounds, end to end


class Journal:
    """The journal's interface over a dict."""

    def __init__(self):
        self.attrs = {}

    def get(self, key, default=None):
        value = self.attrs.get(key)
        return default if value is None else value

    def put(self, key, value):
        self.attrs[key] = json.loads(json.dumps(value))  # as the database keeps it

    def append(self, key, item):
        self.put(key, self.get(key, []) + [item])
        return len(self.attrs[key]) - 1

    def touch(self):
        pass


class Killed(Exception):
    pass


def _world(problems, trials):
    from normtune.tuner.tune.clock import Clock
    from normtune.tuner.tune.context import TuneContext
    from normtune.tuner.tune.plan import Plan

    rows: dict[str, list] = {}
    store = SimpleNamespace(measurements=lambda study_name: list(rows.get(study_name, [])))
    ctx = TuneContext(plan=Plan("interpret", True, tuple(problems), trials=trials), heldout=[], store=store,
                      info=SimpleNamespace(sm_count=INTERPRET_SM_COUNT), journal=Journal(), clock=Clock(None),
                      command_line="tune")
    ctx.limits = lambda: None
    return ctx, rows


def _time(problem, config) -> float:
    """A stand-in time: the same for a config wherever it runs (within 1 %), else spread by its JSON."""
    digest = hashlib.sha256(config.to_json().encode()).digest()
    return 10.0 + digest[0] / 8 + problem.N / 1e6


def _fake_sweep(ctx, rows, kill_after=None):
    """`sweeping.sweep` stand-in: slot i of a study gets the slot seed named for it, else the i-th config of a
    fixed per-problem list (a deterministic sampler), up to each problem's own target; it checks that the journal
    named the slot seeds first and that one sweep takes the round."""
    measured = [0]

    swept_in = []  # the round each sweep ran in

    def sweep(ctx_, group, targets, *, seconds, prefix, extra_seeds, slot_seeds):
        swept_in.append(len(ctx.journal.get(J.ROUNDS)))
        assert len(swept_in) == len(set(swept_in)), "one sweep per round, each study to its own target"
        placed = ctx.journal.get(J.ROUNDS)[-1].get("transfers", {})
        assert slot_seeds == {k: (t["slot"], t["configs"]) for k, t in placed.items() if k in slot_seeds}
        for p in group:
            name = ctx.plan.study(p)
            pool = Space(p, INTERPRET_SM_COUNT).seeds()
            first, named = slot_seeds.get(p.key, (0, []))
            for slot in range(len(rows.get(name, [])), targets[p.key]):
                if kill_after is not None and measured[0] >= kill_after:
                    raise Killed
                if first <= slot < first + len(named):
                    config, source = BackwardConfig.from_dict(named[slot - first]), "transfer"
                else:
                    config, source = pool[slot % len(pool)], "sweep"
                rows.setdefault(name, []).append(SimpleNamespace(config=config, status="ok", source=source,
                                                                 median_us=_time(p, config), trial_number=slot,
                                                                 id=slot))
                measured[0] += 1
        return SimpleNamespace(signal=None, stopped=None)

    return sweep


FAMILY = [rms(64, 1024), rms(64, 2048), rms(256, 1024), rms(1024, 4096), Problem("layer_norm", 64, 1024, "bf16")]


def _tune(monkeypatch, kill_after=None, again=None):
    from normtune.tuner.tune import driver

    ctx, rows = again or _world(FAMILY, 6)
    monkeypatch.setattr(driver, "sweep", _fake_sweep(ctx, rows, kill_after))
    assert driver.sweep_rounds(ctx, None)
    return ctx, rows


def test_the_rounds_measure_each_transfer_in_the_slot_the_journal_named(monkeypatch):
    ctx, rows = _tune(monkeypatch)
    entries = ctx.journal.get(J.ROUNDS)
    placed = [(k, t) for r in entries for k, t in r.get("transfers", {}).items()]
    assert placed, "the family's problems share configs: some transfer"
    assert all(entry["targets"][k] >= t["slot"] + len(t["configs"]) for entry in entries
               for k, t in entry.get("transfers", {}).items())
    by_key = {p.key: rows[ctx.plan.study(p)] for p in FAMILY}
    for key, t in placed:
        got = by_key[key][t["slot"]:t["slot"] + len(t["configs"])]
        assert [m.config.to_dict() for m in got] == t["configs"] and {m.source for m in got} == {"transfer"}
        before = {m.config for m in by_key[key][:t["slot"]]}
        assert not before & {m.config for m in got}  # a transfer is a config new to its problem
    final = entries[-1]["targets"]
    assert all(len(by_key[k]) == final[k] <= 2 * 6 for k in final)
    assert "layer_norm" not in {k.split("/")[0] for k, _ in placed}  # alone in its family


def test_a_killed_tune_measures_the_same_configs_in_the_same_slots(monkeypatch):
    whole, rows = _tune(monkeypatch)
    total = sum(len(v) for v in rows.values())
    for kill_after in (total // 2, total - 3):
        world = _world(FAMILY, 6)
        with pytest.raises(Killed):
            _tune(monkeypatch, kill_after=kill_after, again=world)
        ctx, resumed = _tune(monkeypatch, again=world)
        assert ctx.journal.get(J.ROUNDS) == whole.journal.get(J.ROUNDS)
        assert {k: [(m.config, m.source) for m in v] for k, v in resumed.items()} == \
            {k: [(m.config, m.source) for m in v] for k, v in rows.items()}


def test_a_study_that_ended_short_takes_its_transfers_in_its_first_empty_slot():
    values = {"short": [10.0, 10.0, 10.0], "full": [10.0] * 6}  # "short": its space offered no fourth config
    decision = rounds.next_round(values, {"short": 6, "full": 6}, set(), trials=6, step=2,
                                 transfers={"short": ["x"], "full": ["y"]})
    assert decision.transfers == {"short": {"slot": 3, "configs": ["x"]}, "full": {"slot": 6, "configs": ["y"]}}
    assert decision.targets == {"short": 6, "full": 7}


def test_a_stalled_problem_whose_best_a_transfer_moved_searches_again():
    entries = [{"stalled": ["a", "b"]}, {"stalled": ["c"], "revived": ["a"]}]
    assert rounds.stopped_after(entries) == {"b", "c"}
    values = {"a": [10.0] * 4 + [8.0], "b": [10.0] * 4 + [10.0], "c": [10.0] * 5}  # a's transfer won, b's did not
    decision = rounds.next_round(values, dict.fromkeys(values, 5), {"a", "b", "c"}, trials=10, step=2,
                                 tried={"a": 1, "b": 1})
    assert decision.revived == ["a"] and decision.raised == ["a"] and decision.targets == {"a": 7, "b": 5, "c": 5}
    assert decision.to_dict()["revived"] == ["a"]
    assert rounds.stopped_after(entries + [decision.to_dict()]) == {"b", "c"}
    at_trials = rounds.next_round(values, dict.fromkeys(values, 10), {"a"}, trials=10, step=2, tried={"a": 1})
    assert at_trials.revived == [] and not at_trials.changed  # no room left to search
