"""`normtune.tuner.space`: domains cover every knob of the config dataclasses, enumeration yields only valid and
distinct launches, seeds start at the default, params/config round-trip, and random configs run correctly.

Spaces of real problems have ~10^5 configs and take tens of seconds to enumerate; these tests enumerate tiny
problems fully and take `itertools.islice` prefixes (and random draws) of the others. Each walk is made once per
module (`walked`) and shared by the tests that check it; those tests share an xdist group, so one worker walks.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random

import pytest
import torch

from normtune.kernels.config import (STRATEGIES, BackwardConfig, ConfigError, Kernel1Config, Kernel2Config, Problem,
                                     default_config, kernel_1_config)
from normtune.kernels.heuristics import next_power_of_two, row_block_col, slice_width
from normtune.kernels.strategies import num_programs
from normtune.kernels.device import sm_count
from normtune.tuner.measure.harness import make_case, measure_config
from normtune.tuner.space import (K1_DOMAINS, K2_DOMAINS, MAX_COLUMN_ACC_TILE, MAX_SINGLE_PASS, MAX_SPACE_TILE, Space,
                                  fitting_split)

# (norm, M, N, sm_count): a single column, odd widths, a wide row that needs two-pass chunks.
SMALL = [("layer_norm", 3, 1, 4), ("rms_norm", 3, 1, 4), ("layer_norm", 5, 3, 2), ("rms_norm", 1, 1, 2)]
LARGER = [("layer_norm", 64, 200, 4), ("rms_norm", 64, 200, 3), ("layer_norm", 8, 5000, 4),
          ("rms_norm", 8, 5000, 2), ("layer_norm", 33, 20000, 4)]


def space(norm, M, N, sms, **flags) -> Space:
    return Space(Problem(norm, M, N, **flags), sms)


def launch_key(space: Space, config: BackwardConfig):
    """What actually launches: every knob, with programs_per_sm replaced by the grid it gives."""
    progs = num_programs(space.problem.M, space.problem.N, config, space.sm_count)
    return dataclasses.replace(config.kernel_1, programs_per_sm=0.125), config.kernel_2, progs


def prefix(space: Space, n: int = 3000) -> list[BackwardConfig]:
    return list(itertools.islice(space, n))


@functools.cache
def walked(norm, M, N, sms) -> tuple[BackwardConfig, ...]:
    """What one walk of the case's space yields: every config of a SMALL space, the first 3000 of a LARGER one."""
    s = space(norm, M, N, sms)
    return tuple(prefix(s, 3000) if (norm, M, N, sms) in LARGER else s)


# The tests that check `walked` run on one xdist worker (with `--dist loadgroup`), which walks each space once.
WALKS = pytest.mark.xdist_group("space-walks")


def knob(config, name: str):
    """A kernel_1 knob of the canonical layout (the default where the config's strategy lacks it)."""
    return config.to_dict()["kernel_1"][name]


# ------------------------------------------------------------------------------------------------- domains


def test_domains_cover_every_config_field():
    """Each offered strategy's part of the space holds exactly its config type's fields and kernel_2's; together
    they are the space's domains."""
    k2 = {f"k2.{f.name}" for f in dataclasses.fields(Kernel2Config)}
    for s in (space("layer_norm", 64, 200, 4), space("rms_norm", 1, 1, 1), space("layer_norm", 8, 40000, 132)):
        d = s.domains()
        assert set(d["k1.strategy"]) == set(s.offered())
        union = set()
        for name in s.offered():
            own = {f"k1.{f.name}" for f in dataclasses.fields(STRATEGIES[name].config_type)} | {"k1.strategy"}
            assert set(s.domains(name)) == own | k2, name
            assert all(s.domains(name)[k] == d[k] for k in own | k2 if k != "k1.strategy")
            union |= own | k2
        assert union == set(d)
        assert set(K1_DOMAINS) == {f.name for f in dataclasses.fields(Kernel1Config)}
        assert set(K2_DOMAINS) == {f.name for f in dataclasses.fields(Kernel2Config)}
        assert all(len(v) >= 1 for v in d.values())


@pytest.mark.parametrize("N, modes, splits", [
    (1, (False,), (1,)), (1024, (False,), (1, 2, 4)), (1025, (False, True), (1, 2, 4)),
    (16384, (False, True), (1, 2, 4, 8)), (16385, (False, True), (2, 4, 8)), (131072, (False, True), (8,)),
    (262144, (True,), (1,))])
def test_two_pass_and_row_split_domains_follow_the_row_width(N, modes, splits):
    """Single pass while one program (row_split = 1) or a split row's slice fits the single-pass limit;
    slices under 256 columns are not offered."""
    d = space("rms_norm", 128, N, 8).domains()
    assert d["k1.two_pass"] == modes
    assert d["k1.row_split"] == splits
    if True in modes:  # two-pass chunks are narrower than the row
        assert all(c < next_power_of_two(N) for c in d["k1.block_col"])
    assert (False in modes) == any(slice_width(N, s) <= MAX_SINGLE_PASS for s in (1, 2, 4, 8))


@pytest.mark.parametrize("N, splits", [(1536, (1, 2, 3, 4, 6)), (5120, (1, 2, 4, 5, 8)), (12288, (1, 2, 3, 4, 6, 8)),
                                       (14336, (1, 2, 4, 7, 8)), (24576, (2, 3, 4, 6, 8)), (20000, (2, 4, 8))])
def test_splits_of_3_to_7_are_offered_where_they_fit_the_row(N, splits):
    """Splits of 3, 5, 6, 7 only where every slice is exactly one power-of-two tile; seeded where the slices are
    4096 columns or wider (narrower slices ran slower than the table on every row timed), on tall tiles."""
    sp = space("layer_norm", 4096, N, 8)
    assert sp.domains()["k1.row_split"] == splits
    odd = {s for s in splits if s & (s - 1)}
    assert all(fitting_split(N, s) and row_block_col(N, s) * s == N for s in odd)
    split = [c.kernel_1 for c in sp.seeds() if c.kernel_1.strategy == "rows"]
    seeded = {k1.row_split for k1 in split}
    assert seeded & odd == {s for s in odd if row_block_col(N, s) >= 4096}
    assert all(k1.tile() >= 8192 for k1 in split if k1.row_split in odd)
    for cfg in sp.seeds():
        cfg.validate(sp.problem)


def test_block_row_domain_never_exceeds_the_rows():
    assert space("layer_norm", 3, 64, 4).domains()["k1.block_row"] == (1, 2, 4)
    assert space("layer_norm", 0, 64, 4).domains()["k1.block_row"] == (1,)
    assert space("layer_norm", 1000, 64, 4).domains()["k1.block_row"] == K1_DOMAINS["block_row"]
    assert space("layer_norm", 100, 3, 4).domains()["k2.block_n"] == (4,)


# ------------------------------------------------------------------------------------------- enumeration


@WALKS
@pytest.mark.parametrize("norm, M, N, sms", SMALL)
def test_small_spaces_enumerate_valid_distinct_launches(norm, M, N, sms):
    s = space(norm, M, N, sms)
    configs = list(walked(norm, M, N, sms))
    assert configs, "an empty space"
    assert len(configs) <= s.raw_size()  # size() is this count: test_size_and_raw_size (one more walk each)
    d = s.domains()
    launches = set()
    for cfg in configs:
        cfg.validate(s.problem)
        assert s.why_not(cfg) is None
        assert s.canonical(cfg) == cfg
        key = launch_key(s, cfg)
        assert key not in launches, f"{cfg} launches like an earlier config"
        launches.add(key)
        assert cfg.kernel_1.programs_per_sm in d["k1.programs_per_sm"]
    assert len(set(configs)) == len(configs)


@WALKS
@pytest.mark.parametrize("norm, M, N, sms", LARGER)
def test_larger_spaces_enumerate_valid_distinct_launches(norm, M, N, sms):
    s = space(norm, M, N, sms)
    configs = list(walked(norm, M, N, sms))
    assert len(configs) == 3000
    launches = {launch_key(s, c) for c in configs}
    assert len(launches) == len(configs)
    for cfg in configs:
        assert s.why_not(cfg) is None, cfg
        cfg.validate(s.problem)
        assert cfg.kernel_1.tile() <= (MAX_COLUMN_ACC_TILE if knob(cfg, "column_accumulators") else MAX_SPACE_TILE)
        assert not (cfg.kernel_1.prefetch and cfg.kernel_1.num_stages > 1)
        if cfg.kernel_1.strategy == "rows" and not cfg.kernel_1.two_pass:
            assert cfg.kernel_1.block_col == row_block_col(N, cfg.kernel_1.row_split)


@pytest.mark.parametrize("norm, M, N, sms", LARGER)
def test_random_points_of_the_space_are_valid_or_explained(norm, M, N, sms):
    """Random draws from the full cartesian product: each is either pruned with a reason, or valid, and its
    canonical form keeps the grid."""
    s = space(norm, M, N, sms)
    d = s.domains()
    rng = random.Random(f"{norm}{M}x{N}")
    kept = 0
    for _ in range(400):
        params = {k: rng.choice(v) for k, v in d.items()}
        cfg = s.config(params)
        why = s.why_not(cfg)
        if why is not None:
            assert isinstance(why, str) and why
            assert not cfg.is_valid(s.problem) or any(w in why for w in ("tile", "num_warps", "prefetch",
                                                                         "pipelined_split", "two-pass chunks",
                                                                         "columns strategy"))
            continue
        kept += 1
        cfg.validate(s.problem)
        canon = s.canonical(cfg)
        assert launch_key(s, canon) == launch_key(s, cfg)
        assert canon.kernel_1.programs_per_sm in d["k1.programs_per_sm"]
    assert kept > 0


def test_canonical_collapses_programs_per_sm_that_give_the_same_grid():
    # M=3 rows in tiles of 1 row on 4 SMs: 2, 3 and 4 programs per SM all give 3 programs.
    s = space("rms_norm", 3, 64, 4)
    base = BackwardConfig(kernel_1_config(block_row=1, block_col=64, num_warps=1), Kernel2Config(32, 8, 1))
    grids = {}
    for pps in K1_DOMAINS["programs_per_sm"]:
        cfg = dataclasses.replace(base, kernel_1=dataclasses.replace(base.kernel_1, programs_per_sm=pps))
        grids.setdefault(num_programs(3, 64, cfg, 4), set()).add(s.canonical(cfg))
    assert sorted(grids) == [2, 3]  # 0.5 → 2 programs; 1 and more → 3 (capped by the 3 row tiles)
    assert all(len(canon) == 1 for canon in grids.values())
    assert {c.kernel_1.programs_per_sm for c in grids[3]} == {1}
    # Enumerate the configs that differ from `base` in programs_per_sm only (every other knob narrowed to base's
    # value; the whole space takes a minute to enumerate): one per distinct grid.
    fixed = s.params(base)
    narrowed = {k: v if k == "k1.programs_per_sm" else (fixed[k],) for k, v in s.domains().items()}
    object.__setattr__(s, "domains", lambda strategy=None: narrowed)  # the dataclass is frozen
    assert sorted(c.kernel_1.programs_per_sm for c in s) == [0.5, 1]


@WALKS
def test_size_and_raw_size():
    s = space("rms_norm", 1, 1, 2)  # the smallest of SMALL: size() walks it once more
    assert s.raw_size() == sum(math.prod(len(v) for k, v in s.domains(name).items() if k != "k1.strategy")
                               for name in s.offered())
    size = s.size()
    assert 0 < size < s.raw_size()
    assert size == len(walked("rms_norm", 1, 1, 2))  # another walk counts the same launches


# ---------------------------------------------------------------------------------------------- round trip


@WALKS
@pytest.mark.parametrize("norm, M, N, sms", SMALL + LARGER)
def test_params_config_round_trip(norm, M, N, sms):
    s = space(norm, M, N, sms)
    d = s.domains()
    for cfg in list(walked(norm, M, N, sms)[:300:7]) + s.seeds():
        params = s.params(cfg)
        assert set(params) == set(s.domains(cfg.kernel_1.strategy))  # its strategy's knobs only
        assert s.config(params) == cfg
        if cfg.kernel_1.strategy == "rows" and not cfg.kernel_1.two_pass:
            assert params["k1.block_col"] == d["k1.block_col"][0]


# --------------------------------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("norm, M, N, sms", SMALL + LARGER + [("layer_norm", 512, 16384, 132),
                                                              ("rms_norm", 2048, 8192, 132),
                                                              ("layer_norm", 4096, 65536, 132)])
def test_seeds_start_with_the_default_and_are_valid(norm, M, N, sms):
    s = space(norm, M, N, sms)
    seeds = s.seeds()
    assert seeds[0] == s.canonical(default_config(s.problem))
    assert len(set(seeds)) == len(seeds)
    for cfg in seeds:
        cfg.validate(s.problem)
        assert s.canonical(cfg) == cfg
    for cfg in seeds[1:]:  # the default itself: see test_the_default_is_worth_measuring
        assert s.why_not(cfg) is None, cfg


@pytest.mark.parametrize("norm, M, N, sms", [("layer_norm", 3, 1, 4), ("rms_norm", 1, 2, 2), ("rms_norm", 5, 17, 4),
                                             *LARGER, ("rms_norm", 4096, 1024, 132),
                                             ("layer_norm", 5, 3, 2), ("rms_norm", 64, 16, 4)])
def test_the_default_is_worth_measuring(norm, M, N, sms):
    """The sweep enqueues only seeds with `why_not(...) is None`: a default the space prunes is never measured,
    and the sweep reports no "default config" time for the problem."""
    s = space(norm, M, N, sms)
    assert s.why_not(s.seeds()[0]) is None


@pytest.mark.parametrize("norm, M, N, sms", [("layer_norm", 64, 200, 4), ("rms_norm", 1000, 1024, 132),
                                             ("layer_norm", 512, 16384, 132), ("rms_norm", 8, 5000, 4),
                                             ("layer_norm", 5, 1024, 4), ("layer_norm", 12, 200, 4),
                                             # shorter than the default's row tile:
                                             ("rms_norm", 3, 1, 4), ("layer_norm", 5, 200, 4), ("rms_norm", 0, 7, 4)])
def test_seeds_lie_in_the_search_space(norm, M, N, sms):
    """A seed is enqueued in the Optuna study by its params, so every param must be one of its domain's values.
    Where M is below the default's block_row (up to 64 rows for narrow N), the block_row domain stops at next_pow2(M)
    and `normtune sweep --shapes 3x1` fails before measuring anything with "error: '16' not in (1, 2, 4)."."""
    s = space(norm, M, N, sms)
    d = s.domains()
    for cfg in s.seeds():
        params = s.params(cfg)
        outside = {k: v for k, v in params.items() if v not in d[k]}
        assert not outside, f"seed {cfg} outside the domains: {outside}"


def test_seeds_include_two_pass_strategies_for_wide_rows():
    for norm, M, N in (("layer_norm", 512, 16384), ("rms_norm", 1024, 8192), ("layer_norm", 3000, 5000)):
        s = space(norm, M, N, 132)
        seeds = s.seeds()
        two_pass = [c for c in seeds if knob(c, "two_pass")]
        assert two_pass, f"no two-pass seed for {norm} {M}x{N}"
        assert {c.kernel_1.block_row for c in two_pass} >= {1, 2}
        assert all(c.kernel_1.block_col < next_power_of_two(N) for c in two_pass)
        strategies = s.strategies()
        assert strategies and all(c in seeds for c in strategies)
    # Narrow rows of many rows: only the fused reduction is a structural alternative.
    assert all(c.kernel_2.fused and c.kernel_1.strategy == "rows" and c.kernel_1.row_split == 1
               for c in space("rms_norm", 4096, 1024, 132).strategies())


def test_seeds_include_the_v2_strategies():
    wide = space("layer_norm", 2048, 16384, 132).seeds()
    assert {knob(c, "row_split") for c in wide} >= {1, 2, 4}
    assert any(c.kernel_2.fused for c in wide)
    few = space("rms_norm", 100, 8192, 132).seeds()
    assert any(c.kernel_1.strategy == "columns" for c in few)
    assert not any(c.kernel_1.strategy == "columns" for c in space("rms_norm", 65536, 1024, 132).seeds())


@pytest.mark.parametrize("norm, M, N, run", [("layer_norm", 96, 4096, False), ("rms_norm", 64, 8192, False),
                                              ("rms_norm", 37, 2304, False), ("layer_norm", 7, 300, True),
                                              ("rms_norm", 9, 1000, True)])
def test_few_rows_get_light_dual_and_columns_seeds_that_run_correctly(norm, M, N, run, device):
    """Up to FEW_ROWS rows the seeds hold dual programs on a 1-row tile with the fewest warps the register budget
    allows and columns programs on 1-2 warps, without an eviction hint; each runs correctly (gate against the
    float64 reference; run on the small shapes, where the interpreter is quick). Above FEW_ROWS none is seeded."""
    from normtune.tuner.seeds import FEW_ROWS

    problem = Problem(norm, M, N, "bf16")
    s = Space(problem, sm_count(torch.device(device)))
    light = [c for c in s.seeds() if c.kernel_1.eviction_policy == "" and c.kernel_1.strategy in ("dual", "columns")]
    duals = [c for c in light if c.kernel_1.strategy == "dual"]
    assert any(c.kernel_1.strategy == "columns" and c.kernel_1.num_warps <= 2 for c in light)
    assert duals and min(c.kernel_1.block_row for c in duals) == 1
    one_row = next(c for c in duals if c.kernel_1.block_row == 1)
    fewer = dataclasses.replace(one_row.kernel_1, num_warps=one_row.kernel_1.num_warps // 2)
    assert one_row.kernel_1.num_warps == 2 or s.why_not(BackwardConfig(fewer, one_row.kernel_2)) is not None
    case = make_case(problem, device, seed=M)
    ref = case.reference()
    for cfg in light if run or device != "cpu" else []:
        r = measure_config(case, cfg, flusher=None, bandwidth_gbps=1000.0, reference_grads=ref, warmup=0,
                           min_reps=1, max_reps=1, budget_s=0.0)
        assert r.status == "ok", f"{cfg}: {r.status} {r.error}"
    many = Space(Problem(norm, FEW_ROWS * 2, N, "bf16"), 132).seeds()
    assert not any(c.kernel_1.eviction_policy == "" and c.kernel_1.strategy in ("dual", "columns") for c in many)


@pytest.mark.parametrize("norm, M, N, run", [("rms_norm", 4096, 32768, False), ("layer_norm", 1024, 65536, False),
                                              ("layer_norm", 2048, 12288, False), ("rms_norm", 2, 8200, True)])
def test_very_wide_rows_get_light_pipelined_split_seeds_in_the_first_round(norm, M, N, run, device):
    """Rows of 8193 columns or more are seeded split into ~4096-column slices on light programs (4 warps per 4096
    columns of a 2-row tile, the exchange pipelined, dw/db per column, no eviction hint) within the FIRST_ROUND
    seeds a time-budgeted sweep measures first, and runs correctly against the float64 reference (on the small
    shape, one of them in the interpreter). Narrower rows get none."""
    from normtune.tuner.sweep.options import FIRST_ROUND

    problem = Problem(norm, M, N, "bf16")
    s = Space(problem, sm_count(torch.device(device)))
    first = s.seeds()[:FIRST_ROUND]
    light = [c for c in first if c.kernel_1.strategy == "rows" and c.kernel_1.pipelined_split
             and c.kernel_1.eviction_policy == "" and c.kernel_1.column_accumulators]
    assert light, [str(c) for c in first]
    two_row = [c for c in light if c.kernel_1.block_row == 2]
    assert two_row and all(c.kernel_1.num_warps == 4 * c.kernel_1.block_col // 4096 for c in two_row)
    assert all(c.kernel_1.block_col <= 8192 and c.kernel_1.row_split > 1 for c in light)
    if run or device != "cpu":
        case = make_case(problem, device, seed=M)
        ref = case.reference()
        for cfg in light if device != "cpu" else two_row[:1]:  # the interpreter: one of them (a slow row)
            r = measure_config(case, cfg, flusher=None, bandwidth_gbps=1000.0, reference_grads=ref, warmup=0,
                               min_reps=1, max_reps=1, budget_s=0.0)
            assert r.status == "ok", f"{cfg}: {r.status} {r.error}"
    narrow = Space(Problem(norm, M, 8192, "bf16"), 132).seeds()
    assert not any(c.kernel_1.strategy == "rows" and c.kernel_1.pipelined_split and c.kernel_1.eviction_policy == "" and c.kernel_1.num_warps == 4
                   and c.kernel_1.row_split > 1 for c in narrow)


def test_few_rows_time_the_row_sweeping_strategies_right_after_the_default():
    """A time-budgeted sweep measures FIRST_ROUND seeds of every problem before it searches deeper: on few rows the
    dual and columns seeds come first (H200 rows-256 sweep: 12 seeds, all rows-strategy, then the budget ran out).
    Above MAX_COLUMNS_ROWS the order is the strategies' own."""
    from normtune.kernels.heuristics import MAX_COLUMNS_ROWS
    from normtune.tuner.sweep.options import FIRST_ROUND

    for norm, M, N in (("rms_norm", 256, 14336), ("layer_norm", 128, 8192), ("rms_norm", 384, 5120)):
        s = space(norm, M, N, 132)
        seeds, sweeping = s.seeds(), [c for c in s.strategies() if c.strategy.sweeps_rows]
        assert len(sweeping) >= 4 and seeds[1:1 + len(sweeping)] == sweeping
        assert sum(c.kernel_1.strategy == "dual" for c in seeds[:FIRST_ROUND]) >= 3
    tall = space("layer_norm", MAX_COLUMNS_ROWS * 2, 8192, 132)
    assert tall.seeds()[1:1 + len(tall.strategies())] == tall.strategies()


def test_seeds_move_each_knob_one_step():
    s = space("layer_norm", 4096, 1024, 132)
    base, *rest = s.seeds()
    bp = s.params(base)
    d = s.domains()
    for cfg in rest:
        if cfg.kernel_1.strategy != base.kernel_1.strategy:
            continue
        if cfg in s.strategies():
            continue
        moved = {k for k, v in s.params(cfg).items() if v != bp[k]}
        if moved == {"k1.programs_per_sm"}:
            continue
        if "k2.fused" in moved:  # fused: kernel_2's warps and PDL take their canonical values too
            moved -= {"k2.num_warps", "k2.pdl"}
        assert len(moved) == 1, (cfg, moved)
        (key,) = moved
        assert abs(d[key].index(s.params(cfg)[key]) - d[key].index(bp[key])) == 1


# ---------------------------------------------------------------------------------- random configs run right


@pytest.mark.parametrize("norm, M, N, seed", [("layer_norm", 13, 72, 0), ("rms_norm", 9, 40, 1),
                                              ("layer_norm", 6, 1500, 2)])
def test_random_configs_run_correctly(norm, M, N, seed, device):
    problem = Problem(norm, M, N, "bf16")
    s = Space(problem, sm_count(torch.device(device)))
    d = s.domains()
    rng = random.Random(seed)
    case = make_case(problem, device, seed=seed)
    ref = case.reference()
    picked: list[BackwardConfig] = []
    while len(picked) < 2:
        cfg = s.config({k: rng.choice(v) for k, v in d.items()})
        if s.why_not(cfg) is None:
            picked.append(s.canonical(cfg))
    for cfg in picked:
        r = measure_config(case, cfg, flusher=None, bandwidth_gbps=1000.0, reference_grads=ref, warmup=0,
                           min_reps=1, max_reps=1, budget_s=0.0)
        assert r.status == "ok", f"{cfg}: {r.status} {r.error}"
        assert r.median_us > 0


def test_the_columns_slice_width_is_a_sampled_knob():
    """The columns strategy's block_col is its slice width: sampled (and recorded on seed trials), not fixed."""
    import optuna

    from normtune.tuner.sweep.sampling import Sampling, inapplicable

    assert inapplicable("k1.block_col", {"k1.strategy": "columns", "k1.two_pass": False}) is None
    assert inapplicable("k1.block_col", {"k1.strategy": "rows", "k1.two_pass": False}) is not None
    problem = Problem("rms_norm", 100, 8192, "bf16")
    space = Space(problem, 132)
    sampling = Sampling("random", space, seed=0)
    columns_seed = next(c for c in space.seeds() if c.kernel_1.strategy == "columns")
    trial = sampling.seed_trial(columns_seed)
    assert trial.params["k1.block_col"] == columns_seed.kernel_1.block_col
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    widths = set()
    for _ in range(200):
        config = sampling.suggest(study.ask())
        if config.kernel_1.strategy == "columns":
            widths.add(config.kernel_1.block_col)
    assert len(widths) > 1, widths


def test_a_seed_trials_params_give_its_config_back():
    """A seed trial holds its strategy's knobs only (those that apply); its params give the seed back."""
    from normtune.tuner.sweep.sampling import Sampling, trial_config

    space = Space(Problem("rms_norm", 100, 8192, "bf16"), 132)
    sampling = Sampling("random", space, seed=0)
    trials = [(seed, sampling.seed_trial(seed)) for seed in space.seeds()]
    assert {seed.kernel_1.strategy for seed, trial in trials if trial is not None} == {"rows", "columns", "dual"}
    for seed, trial in trials:
        if trial is not None:
            assert set(trial.params) <= set(space.domains(seed.kernel_1.strategy))
            assert trial_config(space, trial.params) == seed


def _refusal(k1, problem) -> str:
    """Why the space refuses kernel_1 `k1` for `problem` (with the default's kernel_2), or '' where it accepts it."""
    try:
        BackwardConfig(k1, default_config(problem).kernel_2).validate(problem)
    except ConfigError as err:
        return str(err)
    return ""


# Shared memory of kernel_1_two_pass compiled for sm_90 by Triton 3.6; the first three are also the figures an H100
# refused to launch (OutOfResources) in sweep runs 257 and 261.
TWO_PASS_SHARED = [  # (norm, dtype, block_row, block_col, num_warps, num_stages, prefetch, bytes)
    ("layer_norm", "bf16", 1, 8192, 4, 3, False, 233472),
    ("layer_norm", "bf16", 2, 8192, 16, 3, False, 311296),
    ("rms_norm", "bf16", 2, 8192, 32, 3, False, 262144),
    ("layer_norm", "fp32", 1, 8192, 8, 3, False, 327680),
    ("layer_norm", "bf16", 1, 8192, 8, 2, True, 90112),
    ("rms_norm", "bf16", 4, 2048, 8, 4, False, 143360),
]


@pytest.mark.parametrize("norm,dtype,block_row,block_col,num_warps,num_stages,prefetch,shared", TWO_PASS_SHARED)
def test_two_pass_shared_memory_estimate_matches_the_compiler(norm, dtype, block_row, block_col, num_warps,
                                                             num_stages, prefetch, shared):
    """Two-pass stages its column chunk's weight and fp32 partial dw/db rows beside the tiles: the estimate gives
    the compiler's figure, and the space refuses the configs past the 227 KB a block may have."""
    from normtune.kernels.heuristics import SHARED_MEMORY_BUDGET, staged_shared_bytes

    problem = Problem(norm, 2048, 32768, dtype, has_bias=norm == "layer_norm")
    assert staged_shared_bytes(problem, block_row, block_col, num_stages, True, prefetch, num_warps) == shared
    k1 = kernel_1_config(block_row=block_row, block_col=block_col, num_warps=num_warps, num_stages=num_stages,
                       two_pass=True, prefetch=prefetch)
    assert ("shared memory" in _refusal(k1, problem)) == (shared > SHARED_MEMORY_BUDGET), _refusal(k1, problem)


# Shared memory of kernel_1_single_pass compiled for sm_90 by Triton 3.9 (rows strategy, M=2048, bf16 activations
# unless named): every tile stream the loop reads per row is staged (dy, the saved tensor, a gate's z, a residual
# stream's dh), and so is a one-row tile's weight row. The last two are the residual configs an H200 refused to
# launch (OutOfResources) in tune runs 334-351 of results.db.
SINGLE_PASS_SHARED = [  # (problem keywords, block_row, block_col, num_warps, num_stages, prefetch, bytes)
    ({}, 1, 8192, 8, 3, False, 98344),
    ({}, 2, 2048, 4, 3, True, 4096),
    ({"weight_dtype": "fp32"}, 1, 16384, 16, 2, False, 131140),
    ({"gate": "after"}, 1, 8192, 8, 3, False, 131112),
    ({"residual": True, "residual_dtype": "fp32"}, 1, 8192, 8, 2, True, 57344),
    ({"residual": True, "residual_dtype": "fp32", "save": "output"}, 1, 16384, 16, 2, False, 163908),
    ({"residual": True}, 4, 4096, 16, 3, False, 196896),
    ({"residual": True}, 1, 16384, 16, 3, False, 262216),
    ({"residual": True}, 1, 16384, 8, 3, False, 262216),
]


@pytest.mark.parametrize("form,block_row,block_col,num_warps,num_stages,prefetch,shared", SINGLE_PASS_SHARED)
def test_single_pass_shared_memory_estimate_bounds_the_compiler(form, block_row, block_col, num_warps, num_stages,
                                                                 prefetch, shared):
    """The single-pass estimate is never under what the compiler asks for, and over by at most the warps' scratch;
    the space refuses exactly the configs past the 227 KB a block may have."""
    from normtune.kernels.heuristics import (SHARED_MEMORY_BUDGET, STAGED_SLACK, WARP_SCRATCH,
                                             staged_shared_bytes)

    problem = Problem("rms_norm", 2048, max(block_col // 2 + 8, 1024), "bf16", **form)
    estimate = staged_shared_bytes(problem, block_row, block_col, num_stages, False, prefetch, num_warps,
                                   weight_row=True)
    assert shared <= estimate <= shared + WARP_SCRATCH * num_warps + STAGED_SLACK, (estimate, shared)
    k1 = kernel_1_config(block_row=block_row, block_col=block_col, num_warps=num_warps, num_stages=num_stages,
                         prefetch=prefetch)
    assert ("shared memory" in _refusal(k1, problem)) == (shared > SHARED_MEMORY_BUDGET), _refusal(k1, problem)


# Shared memory of kernel_1_two_pass in the fused residual and gated forms, compiled for sm_90 (Triton 3.9 unless
# named): the tiles of dy, the saved tensor (h, in the stream's dtype) and dh are staged, and z even with prefetch.
# The first is the figure an H100 refused to launch (Triton 3.6) in residual sweep run 308 of results.db.
TWO_PASS_FORMS_SHARED = [  # (norm, N, problem keywords, block_row, block_col, num_warps, num_stages, prefetch, bytes)
    ("layer_norm", 4096, {"residual": True}, 16, 1024, 16, 3, False, 233472),
    ("layer_norm", 4096, {"residual": True}, 4, 2048, 8, 3, False, 147456),
    ("layer_norm", 4096, {"residual": True}, 4, 2048, 8, 3, True, 49152),
    ("rms_norm", 65536, {"residual": True, "residual_dtype": "fp32"}, 16, 1024, 16, 3, False, 348160),
    ("rms_norm", 65536, {"residual": True, "residual_dtype": "fp32"}, 4, 2048, 8, 3, False, 196608),
    ("rms_norm", 65536, {"gate": "before"}, 4, 2048, 8, 3, True, 65536),
    ("rms_norm", 65536, {"gate": "before"}, 1, 8192, 8, 2, True, 73728),
]


@pytest.mark.parametrize("norm,N,form,block_row,block_col,num_warps,num_stages,prefetch,shared", TWO_PASS_FORMS_SHARED)
def test_two_pass_estimate_bounds_the_compiler_in_every_form(norm, N, form, block_row, block_col, num_warps,
                                                             num_stages, prefetch, shared):
    from normtune.kernels.heuristics import staged_shared_bytes

    problem = Problem(norm, 2048, N, "bf16", has_bias=norm == "layer_norm", **form)
    estimate = staged_shared_bytes(problem, block_row, block_col, num_stages, True, prefetch, num_warps)
    assert shared <= estimate <= shared + 1024 * num_warps, (estimate, shared)
