"""`SweepOptions.slot_seeds`: configs put in given slots of an existing study (a tune's transfers), ahead of its
seeds and its sampler, measured there once: a sweep run again, to the same or a later target, never measures a
slot it measured before. In-process, with a stand-in measuring process (no kernels run)."""

from __future__ import annotations

import pytest
from sweep_support import instant_measuring_process

from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.tuner import sweep as S
from normtune.tuner.space import Space
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import driver, measuring  # noqa: F401 - the driver bound to the real helpers first
from normtune.tuner.sweep.trials import slot_seed_configs

PROBLEM = Problem("rms_norm", 40, 96, "bf16")
OTHER = Problem("rms_norm", 24, 200, "bf16")


@pytest.fixture
def stand_in(monkeypatch):
    measurer = instant_measuring_process()
    monkeypatch.setattr(measuring, "start_helpers", lambda *a, **k: (measurer(), None))


def _sweep(url: str, trials: int, slot_seeds: dict) -> None:
    S.run(S.SweepOptions(gpu_key="auto", problems=[PROBLEM, OTHER], trials=trials, sampler="local",
                         interpret=True, compile_workers=0, storage=url, study_prefix="t", seed_limit=4,
                         slot_seeds=slot_seeds))


def _by_slot(url: str, problem: Problem) -> dict[int, tuple[BackwardConfig, str]]:
    """Slot -> (config, source) of the study's measured trials, and every stored trial's number once."""
    store = Store(url)
    try:
        name = S.study_name("interpret", problem, True, "t")
        rows = store.measurements(study_name=name)
        numbers = [m.trial_number for m in rows]
        assert len(numbers) == len(set(numbers)), numbers
        of = {m.trial_number: m for m in rows}
        return {slot: (of[s.trial_number].config, of[s.trial_number].source)
                for slot, s in store.workers.slots(name).items() if s.measured}
    finally:
        store.close()


def test_slot_seeds_go_to_their_slots_once_and_before_the_sampler(tmp_path, stand_in):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    _sweep(url, 4, {})
    space = Space(PROBLEM, INTERPRET_SM_COUNT)
    held = {config for config, _ in _by_slot(url, PROBLEM).values()}
    moved = [c for c in space.seeds() if c not in held][:3]
    assert len(moved) == 3
    named = {PROBLEM.key: (4, [c.to_dict() for c in moved])}
    _sweep(url, 6, named)  # slots 4 and 5: the first two
    first = _by_slot(url, PROBLEM)
    assert [first[s] for s in (4, 5)] == [(moved[0], "transfer"), (moved[1], "transfer")]
    assert all(source != "transfer" for _, source in _by_slot(url, OTHER).values())  # none named there
    _sweep(url, 7, named)  # run again with the same slots named: the third goes to slot 6, 4 and 5 stay
    again = _by_slot(url, PROBLEM)
    assert len(again) == 7 and again[6] == (moved[2], "transfer")
    assert {s: again[s] for s in first} == first
    assert sum(1 for config, _ in again.values() if config in moved) == 3  # each measured once
    _sweep(url, 7, named)  # nothing left to measure
    assert _by_slot(url, PROBLEM) == again


def test_slot_seeds_are_canonical_and_only_for_seeded_sweeps():
    space = Space(PROBLEM, INTERPRET_SM_COUNT)
    config = space.seeds()[3]
    opts = S.SweepOptions(gpu_key="h200", problems=[PROBLEM], trials=8, sampler="local",
                          slot_seeds={PROBLEM.key: [5, [config.to_dict()]]})
    assert slot_seed_configs(opts, PROBLEM, space) == {5: space.canonical(config)}
    assert slot_seed_configs(opts, OTHER, Space(OTHER, INTERPRET_SM_COUNT)) == {}
    for off in ({"seeded": False, "sampler": "tpe"}, {"sampler": "grid"}):
        unseeded = S.SweepOptions(**{**opts.__dict__, **off})
        assert slot_seed_configs(unseeded, PROBLEM, space) == {}


def test_slot_seeds_are_compiled_ahead_in_the_order_their_slots_are_claimed():
    from normtune.tuner.gpu_info import DeviceInfo
    from normtune.tuner.sweep.compile_ahead import by_slot, seeds_ahead
    from normtune.tuner.sweep.costs import Costs

    space = Space(PROBLEM, INTERPRET_SM_COUNT)
    seeds, named = space.seeds()[:4], space.seeds()[6:8]
    assert by_slot(seeds[:2], {3: named[0]}) == [seeds[0], seeds[1], None, named[0]]
    assert by_slot(seeds, {1: named[0]}) == [seeds[0], named[0], seeds[2], seeds[3]]  # as `prepare` gives slot 1
    opts = S.SweepOptions(gpu_key="interpret", problems=[PROBLEM], trials=8, sampler="local", interpret=True,
                          seed_limit=4, slot_seeds={PROBLEM.key: (5, [c.to_dict() for c in named])})
    info = DeviceInfo(name="cpu", key="interpret", compute_capability=None, sm_count=INTERPRET_SM_COUNT,
                      l2_bytes=0, memory_bytes=0, driver=None, cuda=None, torch="x", triton="x", normtune="0",
                      git_revision=None, host="test", python="3", interpret=True)
    claimed = {0, 1, 2, 3, 4}  # the seeds measured: the named slots are what is left to compile
    store = type("Store", (), {"workers": type("Workers", (), {"slots": staticmethod(lambda name: claimed)})()})()
    ahead = list(seeds_ahead([PROBLEM], [4, 8], opts, info, store, {}, Costs()))
    assert ahead == [(PROBLEM, named[0]), (PROBLEM, named[1])]


def test_one_sweep_ends_each_study_at_its_own_target(tmp_path, stand_in):
    """`SweepOptions.targets`: one sweep takes problems whose studies end at different counts (a tune's round),
    each at its own, and a study already there measures nothing more."""
    url = f"sqlite:///{tmp_path / 'results.db'}"
    S.run(S.SweepOptions(gpu_key="auto", problems=[PROBLEM, OTHER], trials=7, targets={PROBLEM.key: 3},
                         sampler="local", interpret=True, compile_workers=0, storage=url, study_prefix="t",
                         seed_limit=4))
    assert (len(_by_slot(url, PROBLEM)), len(_by_slot(url, OTHER))) == (3, 7)
    S.run(S.SweepOptions(gpu_key="auto", problems=[PROBLEM, OTHER], trials=5, targets={OTHER.key: 2},
                         sampler="local", interpret=True, compile_workers=0, storage=url, study_prefix="t",
                         seed_limit=4))
    assert (len(_by_slot(url, PROBLEM)), len(_by_slot(url, OTHER))) == (5, 7)
    assert S.SweepOptions(gpu_key="h200", problems=[PROBLEM], trials=6, targets={PROBLEM.key: 9}).target_of(
        PROBLEM.key) == 6  # never past `trials`
