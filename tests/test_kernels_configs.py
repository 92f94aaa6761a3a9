"""Launch configs: values (JSON, hashing, immutability, validation messages), every knob giving correct results,
the analytic default and `select_config` valid over the whole (M, N) range, and bitwise determinism.

The Triton interpreter ignores num_warps, num_stages, eviction hints and PDL, but the launchers must still accept
and pass them; on a GPU (`gpu`-marked test) the same variations run compiled.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from normtune.kernels import (
    BackwardConfig,
    ConfigError,
    Kernel2Config,
    Problem,
    default_config,
    kernel_1_config,
    select_config,
)
from normtune.kernels.backward_launch import BackwardLaunch
from normtune.kernels.heuristics import WIDE_DEFAULT_MIN_ROWS, alignment_hint, row_block_col, slice_width
from normtune.kernels.strategies import num_programs, partial_rows
from normtune.kernels.config import DTYPES, MAX_N, NORMS, SAVE_MODES, kernel_1_layout
from normtune.kernels.device import sm_count
from normtune.tuner.space import Space

# ---------------------------------------------------------------------------------------------------------------
# Config values.
# ---------------------------------------------------------------------------------------------------------------
SAMPLE = BackwardConfig(
    kernel_1_config(block_row=4, block_col=512, num_warps=8, num_stages=3, programs_per_sm=3, two_pass=True,
                  eviction_policy="evict_first", prefetch=True),
    Kernel2Config(block_m=32, block_n=128, num_warps=2, num_stages=2, pdl=True),
)


def test_config_json_round_trip():
    text = SAMPLE.to_json()
    assert json.loads(text) == SAMPLE.to_dict()
    assert BackwardConfig.from_json(text) == SAMPLE
    assert BackwardConfig.from_dict(SAMPLE.to_dict()) == SAMPLE
    assert BackwardConfig.from_json(BackwardConfig().to_json()) == BackwardConfig()
    # Canonical text: the same config always serializes the same way (usable as a storage key).
    assert BackwardConfig.from_json(text).to_json() == text
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    # Missing fields take their defaults.
    partial = BackwardConfig.from_json('{"kernel_1": {"block_row": 8}}')
    assert partial == BackwardConfig(kernel_1_config(block_row=8), Kernel2Config())


def test_config_is_hashable_and_frozen():
    twin = BackwardConfig.from_json(SAMPLE.to_json())
    assert twin is not SAMPLE and hash(twin) == hash(SAMPLE)
    assert {SAMPLE: "a", twin: "b"} == {SAMPLE: "b"}
    other = dataclasses.replace(SAMPLE, kernel_2=dataclasses.replace(SAMPLE.kernel_2, pdl=False))
    assert other != SAMPLE and len({SAMPLE, other}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLE.kernel_1 = kernel_1_config()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLE.kernel_1.block_row = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLE.kernel_2.block_m = 2  # type: ignore[misc]


def test_programs_per_sm_has_one_spelling():
    """2 and 2.0 are the same grid: equal, same hash, same JSON; fractions are kept."""
    a, b = kernel_1_config(programs_per_sm=2), kernel_1_config(programs_per_sm=2.0)
    assert a == b and hash(a) == hash(b)
    assert BackwardConfig(b).to_json() == BackwardConfig(a).to_json()
    half = BackwardConfig(kernel_1_config(programs_per_sm=0.5))
    assert BackwardConfig.from_json(half.to_json()) == half and half.kernel_1.programs_per_sm == 0.5


def test_config_str_names_the_knobs():
    text = str(SAMPLE)
    for part in ("2pass", "4x512", "w8", "s3", "pps3", "prefetch", "evict_first", "32x128", "pdl"):
        assert part in text, f"{part!r} missing from {text!r}"
    assert "recompute" in str(BackwardConfig(kernel_1_config(recompute=True))) and "recompute" not in text


PROBLEM = Problem("layer_norm", 64, 200, "bf16")
WIDE = Problem("layer_norm", 64, 16384, "bf16")
K1, K2 = kernel_1_config, Kernel2Config
BAD_CONFIGS = [
    # (config, problem, exception, substrings of the message)
    (BackwardConfig(K1(block_col=200)), PROBLEM, ["kernel_1.block_col=200", "power of two", "128 or 256"]),
    (BackwardConfig(K1(block_row=3, block_col=256)), PROBLEM, ["kernel_1.block_row=3", "power of two"]),
    (BackwardConfig(K1(block_col=256), K2(block_m=3)), PROBLEM, ["kernel_2.block_m=3", "power of two"]),
    (BackwardConfig(K1(block_col=256), K2(block_n=100)), PROBLEM, ["kernel_2.block_n=100", "power of two"]),
    (BackwardConfig(K1(block_col=128)), PROBLEM,
     ["kernel_1.block_col=128 < N=200", "single pass", "block_col >= 256", "two_pass"]),
    (BackwardConfig(K1(block_row=64, block_col=1024, num_warps=1)), PROBLEM,
     ["kernel_1 register budget", "64x1024", "1 warps", "more warps"]),
    (BackwardConfig(K1(block_col=256, num_warps=3)), PROBLEM,
     ["kernel_1.num_warps=3", "not allowed", "1, 2, 4, 8, 16, 32"]),
    (BackwardConfig(K1(block_col=256), K2(num_warps=64)), PROBLEM, ["kernel_2.num_warps=64", "1, 2, 4, 8, 16, 32"]),
    (BackwardConfig(K1(block_col=256, eviction_policy="evict_sometimes")), PROBLEM,
     ["kernel_1.eviction_policy='evict_sometimes'", "'evict_first'", "'evict_last'"]),
    (BackwardConfig(K1(block_col=256, num_stages=0)), PROBLEM, ["kernel_1.num_stages=0", "1 <= kernel_1.num_stages"]),
    (BackwardConfig(K1(block_col=256), K2(num_stages=5)), PROBLEM, ["kernel_2.num_stages=5", "<= 4"]),
    (BackwardConfig(K1(block_col=256, programs_per_sm=0)), PROBLEM,
     ["kernel_1.programs_per_sm=0", "out of range", "0.125", "32"]),
    (BackwardConfig(K1(block_col=256, programs_per_sm=0.1)), PROBLEM, ["kernel_1.programs_per_sm=0.1", "0.125"]),
    (BackwardConfig(K1(block_col=256, programs_per_sm=True)), PROBLEM, ["kernel_1.programs_per_sm=True"]),
    (BackwardConfig(K1(block_col=256, programs_per_sm="2")), PROBLEM, ["kernel_1.programs_per_sm='2'"]),
    (BackwardConfig(K1(block_col=256, recompute=1)), PROBLEM, ["kernel_1.recompute=1", "true or false"]),
    (BackwardConfig(K1(block_col=256, pipelined_split=1)), PROBLEM, ["kernel_1.pipelined_split=1", "true or false"]),
    (BackwardConfig(K1(block_col=256, pipelined_split=True)), PROBLEM,
     ["kernel_1.pipelined_split=true", "row_split > 1", "pipelined_split=false"]),
    (BackwardConfig(K1(block_col=64, two_pass=True, recompute=True)), PROBLEM,
     ["kernel_1.recompute=true", "single pass", "recompute=false"]),
    (BackwardConfig(K1(block_row=True, block_col=256)), PROBLEM, ["kernel_1.block_row=True", "integer"]),
    (BackwardConfig(K1(block_col=256, two_pass="yes")), PROBLEM, ["kernel_1.two_pass='yes'", "true or false"]),
    (BackwardConfig(K1(block_col=256, prefetch=1)), PROBLEM, ["kernel_1.prefetch=1", "true or false"]),
    (BackwardConfig(K1(block_col=256), K2(pdl="no")), PROBLEM, ["kernel_2.pdl='no'", "true or false"]),
    (BackwardConfig(K1(block_row=64, block_col=2048, num_warps=32, two_pass=True)), WIDE,
     ["tile", "131072", "exceeds 65536", "block_row or block_col"]),
    (BackwardConfig(K1(block_row=1, block_col=32, num_warps=4, two_pass=True)), PROBLEM,
     ["kernel_1.num_warps=4", "idle", "num_warps <= 1"]),
    (BackwardConfig(K1(block_row=1, block_col=16384, num_warps=16, num_stages=6)), WIDE,
     ["kernel_1.num_stages=6", "shared memory", "fewer stages"]),
    (BackwardConfig(K1(block_col=256), K2(block_m=1024, block_n=4096, num_warps=1)), PROBLEM,
     ["kernel_2 tile 1024x4096", "registers"]),
]


@pytest.mark.parametrize("config,problem,needles", BAD_CONFIGS, ids=[str(i) for i in range(len(BAD_CONFIGS))])
def test_validate_names_field_and_allowed_values(config, problem, needles):
    assert not config.is_valid(problem)
    with pytest.raises(ConfigError) as info:
        config.validate(problem)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert isinstance(info.value, ValueError), "ConfigError must be a ValueError"


def test_validate_returns_the_config():
    cfg = BackwardConfig(K1(block_col=256))
    assert cfg.validate(PROBLEM) is cfg and cfg.is_valid(PROBLEM)
    # The same config is fine for a narrower row and invalid (single pass) for a wider one.
    assert cfg.is_valid(PROBLEM.with_shape(7, 256)) and not cfg.is_valid(PROBLEM.with_shape(7, 257))


@pytest.mark.parametrize("text,needles", [
    ('{"kernel_1": {"block_rows": 2}}', ["unknown Kernel1Config field(s) block_rows", "allowed:", "block_row"]),
    ('{"kernel_2": {"warps": 4, "pdl": true}}', ["unknown Kernel2Config field(s) warps", "allowed:", "num_warps"]),
    ('{"kernel_1": {}, "kernel_3": {}}', ["keys kernel_1 and kernel_2", "kernel_3"]),
    ('[1, 2]', ["keys kernel_1 and kernel_2"]),
    ('{"families": {"rms_norm/bf16": {"rules": []}}, "gpu": {}}', ["this is a table", "$NORMTUNE_CONFIG"]),
    ('{"kernel_1": [4]}', ["Kernel1Config expects a JSON object", "list"]),
    # another strategy's knob (the flat layout's are accepted at their defaults only)
    ('{"kernel_1": {"strategy": "dual", "pipelined_split": true}}',
     ["kernel_1.pipelined_split=True", "knob of strategy='rows'", "strategy='dual'"]),
    ('{"kernel_1": {"strategy": "columns", "row_split": 2}}', ["kernel_1.row_split=2", "strategy='columns'"]),
    ('{"kernel_1": {"strategy": "dual", "recompute": true}}', ["kernel_1.recompute=True", "strategy='dual'"]),
    ('{"kernel_1": {"strategy": "columns", "two_pass": 1}}', ["kernel_1.two_pass=1", "strategy='columns'"]),
    ('{"kernel_1": {"block_row": 2,}', ["not valid JSON", "expected e.g.", '"kernel_1"']),
])
def test_from_json_rejects_unknown_keys_and_bad_text(text, needles):
    with pytest.raises(ConfigError) as info:
        BackwardConfig.from_json(text)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("kwargs,exc,needles", [
    (dict(norm="layer_norm", M=4, N=MAX_N + 1), ConfigError, [f"N={MAX_N + 1}", f"maximum {MAX_N}"]),
    (dict(norm="layer_norm", M=4, N=0), ConfigError, ["N=0", "positive integer"]),
    (dict(norm="layer_norm", M=-1, N=8), ConfigError, ["M=-1"]),
    (dict(norm="rms_norm", M=4, N=8, has_bias=True), ConfigError, ["rms_norm has no bias", "has_bias=False"]),
    (dict(norm="layer_norm", M=4, N=8, has_weight=False, zero_centered=True), ConfigError,
     ["zero_centered=True needs a weight"]),
    (dict(norm="layer_norm", M=4, N=8, dtype="bf16", weight_dtype="fp16"), ConfigError,
     ["weight_dtype='fp16'", "fp32 or the activation dtype"]),
    (dict(norm="layer_norm", M=4, N=8, save="both"), ConfigError, ["save='both'", "'input', 'output'"]),
    (dict(norm="batch_norm", M=4, N=8), ConfigError, ["norm='batch_norm'", "'layer_norm', 'rms_norm'"]),
    (dict(norm="layer_norm", M=4, N=8, dtype="float64"), TypeError, ["float64", "float32, bfloat16, float16"]),
])
def test_problem_rejects_impossible_problems(kwargs, exc, needles):
    with pytest.raises(exc) as info:
        Problem(**kwargs)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"


# ---------------------------------------------------------------------------------------------------------------
# Every knob at two or more values gives correct results (poisoned buffers, float64 reference, partial rows).
# ---------------------------------------------------------------------------------------------------------------
M_VAR, N_VAR = 25, 200  # 13 row tiles of 2 (the last one row): programs own uneven numbers of tiles, and 12
# programs (programs_per_sm=3) are still fewer than the tiles; N not a power of two
BASE = BackwardConfig(
    K1(block_row=2, block_col=256, num_warps=2, num_stages=1, programs_per_sm=2, two_pass=False,
       eviction_policy="", prefetch=False),
    K2(block_m=4, block_n=64, num_warps=2, num_stages=1, pdl=False),
)
K1_VARIATIONS = {
    "block_row": [1, 4, 8],
    "block_col": [512, 1024],
    "num_warps": [1, 4, 16],
    "num_stages": [2, 3],
    "programs_per_sm": [0.125, 0.5, 1, 3, 32],  # fractions round to whole programs (0.125 x 4 SMs → 1)
    "two_pass": [True],
    "eviction_policy": ["evict_first", "evict_last"],
    "prefetch": [True],
    "recompute": [True],
    "strategy": ["columns", "dual"],  # columns with its slice: block_col 16..256; dual with its column tile
    "row_split": [2, 3, 4, 5, 6, 7, 8],  # on the wide problems only (slices of >= 256 columns): SPLIT_VARIATIONS
    "column_accumulators": [True],  # 2-row base tiles; taller ones below and in SPLIT_VARIATIONS
    "pipelined_split": [True],  # split rows only: SPLIT_VARIATIONS (the GPU's exchange; the interpreter's phases)
}
K2_VARIATIONS = {
    "block_m": [1, 2, 16, 32],
    "block_n": [16, 32, 256],
    "num_warps": [1, 4, 8],
    "num_stages": [2, 3, 4],
    "pdl": [True],
    "fused": [True],
}


def _k1(**fields) -> BackwardConfig:
    """BASE with kernel_1's knobs changed (`strategy`: another strategy's config, the shared knobs kept)."""
    if "strategy" in fields:
        return dataclasses.replace(BASE, kernel_1=kernel_1_config(BASE.kernel_1.shared_fields(), **fields))
    return dataclasses.replace(BASE, kernel_1=dataclasses.replace(BASE.kernel_1, **fields))


def _variations():
    out = [("base", BASE)]
    for name, values in K1_VARIATIONS.items():
        if name in ("strategy", "row_split", "pipelined_split"):
            continue
        out += [(f"k1.{name}={v}", dataclasses.replace(BASE, kernel_1=dataclasses.replace(BASE.kernel_1, **{name: v})))
                for v in values]
    for name, values in K2_VARIATIONS.items():
        out += [(f"k2.{name}={v}", dataclasses.replace(BASE, kernel_2=dataclasses.replace(BASE.kernel_2, **{name: v})))
                for v in values]
    # recompute widens the raw tile (and, with single-row tiles, the raw weight) again after the reductions.
    for name, v in [("prefetch", True), ("block_row", 1), ("num_stages", 2)]:
        out.append((f"k1.recompute+{name}={v}", dataclasses.replace(
            BASE, kernel_1=dataclasses.replace(BASE.kernel_1, recompute=True, **{name: v}))))
    # Per-column dw/db accumulators: tall tiles, one row, prefetch, recompute, pipelining, the fused reduction.
    for fields in ({"block_row": 8}, {"block_row": 1}, {"block_row": 16, "num_warps": 4, "prefetch": True},
                   {"recompute": True}, {"num_stages": 3}):
        label = "+".join(f"{k}={v}" for k, v in fields.items())
        out.append((f"k1.column_accumulators=True+{label}", _k1(column_accumulators=True, **fields)))
    out.append(("k1.column_accumulators=True+k2.fused", BackwardConfig(
        dataclasses.replace(BASE.kernel_1, column_accumulators=True), dataclasses.replace(BASE.kernel_2, fused=True))))
    # Two-pass knobs only matter with several column chunks: narrow block_col, alone and with the other knobs.
    two = dataclasses.replace(BASE.kernel_1, two_pass=True, block_col=64)
    out += [("k1.two_pass+block_col=64", dataclasses.replace(BASE, kernel_1=two)),
            ("k1.two_pass+block_col=64+block_row=1", dataclasses.replace(
                BASE, kernel_1=dataclasses.replace(two, block_row=1)))]
    for name, v in [("prefetch", True), ("num_stages", 3), ("block_row", 8), ("programs_per_sm", 1),
                    ("eviction_policy", "evict_first")]:
        out.append((f"k1.two_pass+block_col=64+{name}={v}",
                    dataclasses.replace(BASE, kernel_1=dataclasses.replace(two, **{name: v}))))
    # Columns strategy: slices narrower than, equal to and wider than N's remainder; its row tile and warps.
    for block_col, block_row, warps in [(16, 2, 1), (64, 1, 1), (64, 8, 4), (256, 4, 8)]:
        out.append((f"k1.strategy=columns+block_col={block_col}+block_row={block_row}+w{warps}",
                    _k1(strategy="columns", block_col=block_col, block_row=block_row, num_warps=warps,
                        programs_per_sm=1)))
    # Dual: row programs (the base tile, one to many programs, prefetch or pipelined) beside column programs
    # (kernel_2's tile: one to many rows per step, slices narrower and wider than N's remainder).
    for k1_fields, block_m, block_n in [({}, 4, 64), ({"programs_per_sm": 0.25}, 1, 64), ({"prefetch": True}, 16, 32),
                                        ({"block_row": 1, "num_stages": 2}, 8, 256),
                                        ({"programs_per_sm": 32, "eviction_policy": "evict_first"}, 64, 8)]:
        label = "+".join(f"{k}={v}" for k, v in k1_fields.items()) or "base"
        out.append((f"k1.strategy=dual+k2.{block_m}x{block_n}+{label}", BackwardConfig(
            _k1(strategy="dual", **k1_fields).kernel_1, K2(block_m=block_m, block_n=block_n))))
    # Fused reduction: the grid barrier with one to many programs, single and two-pass, other kernel_2 tiles.
    fused = dataclasses.replace(BASE.kernel_2, fused=True)
    for k1_fields, block_m in [({}, 4), ({"programs_per_sm": 0.25}, 4), ({"programs_per_sm": 32}, 1),
                               ({"two_pass": True, "block_col": 64}, 16), ({"block_row": 1}, 32)]:
        label = "+".join(f"{k}={v}" for k, v in k1_fields.items()) or "base"
        out.append((f"k2.fused+block_m={block_m}+{label}", BackwardConfig(
            dataclasses.replace(BASE.kernel_1, **k1_fields), dataclasses.replace(fused, block_m=block_m))))
    return out


VARIATIONS = _variations()
# row_split needs slices of >= 256 columns: a wide row (N not a power of two) and few rows keep it fast. 13 rows:
# 7 row tiles of 2, 4 of 4 and 2 of 8, the last one partly masked in each; more tiles than the 4 row groups of a
# 2-way split (the interpreter gives each group's tiles their own exchange slots, so the count adds no code path).
M_WIDE, N_WIDE = 13, 2100


# Every split runs plain (on both wide problems) and with the fused reduction; the other variations run on two
# splits of each of the exchange's two code paths: 2 and 4 (a power of two: the slices' row sums added in one
# sum), 3 and 7 (no power-of-two block spans them: added one slice after another; 1024- and 512-column slices).
# 5, 6 and 8 run the same code with another number of slices.
VARIED_SPLITS = (2, 4, 3, 7)


def _split_variations():
    out = []
    for split in K1_VARIATIONS["row_split"]:
        block_col = row_block_col(N_WIDE, split)
        base = dataclasses.replace(BASE.kernel_1, row_split=split, block_col=block_col, num_warps=4)
        out.append((f"k1.row_split={split}", BackwardConfig(base, BASE.kernel_2)))
        out.append((f"k1.row_split={split}+k2.fused", BackwardConfig(
            base, dataclasses.replace(BASE.kernel_2, fused=True))))
        if split not in VARIED_SPLITS:
            continue
        every = split in (2, 4, 8)  # 3, 5, 6, 7 share their code past the row-sum exchange: fewer variations
        for fields in ({"block_row": 1}, {"block_row": 4, "num_warps": 8, "prefetch": True}, {"recompute": True},
                       {"programs_per_sm": 32},
                       {"block_row": 4, "num_warps": 16, "prefetch": True, "column_accumulators": True},
                       # the space's largest tiles: 32768 elements with dw/db per column, raw tile kept
                       {"block_row": 8, "num_warps": 16, "recompute": True, "column_accumulators": True}):
            if not every and "column_accumulators" not in fields and "programs_per_sm" not in fields:
                continue
            label = "+".join(f"{k}={v}" for k, v in fields.items())
            out.append((f"k1.row_split={split}+{label}",
                        BackwardConfig(dataclasses.replace(base, **fields), BASE.kernel_2)))
        # The exchange pipelined: three stages on the base tile; two on the tall tile keeping the raw tile.
        for fields in ({"num_stages": 3}, {"num_stages": 2, "block_row": 4, "num_warps": 16, "recompute": True,
                                           "column_accumulators": True}):
            label = "+".join(f"{k}={v}" for k, v in fields.items())
            out.append((f"k1.pipelined_split=True+row_split={split}+{label}", BackwardConfig(
                dataclasses.replace(base, pipelined_split=True, **fields), BASE.kernel_2)))
    return out


SPLIT_VARIATIONS = _split_variations()
# LayerNorm with weight and bias (every partial buffer), and zero-centered RMSNorm (no bias): both saving modes.
VARIATION_PROBLEMS = [
    Problem("layer_norm", M_VAR, N_VAR, "bf16", has_bias=True, save="input"),
    Problem("layer_norm", M_VAR, N_VAR, "bf16", has_bias=True, save="output"),
    Problem("rms_norm", M_VAR, N_VAR, "fp16", weight_dtype="fp32", zero_centered=True, save="input"),
    Problem("rms_norm", M_VAR, N_VAR, "fp16", weight_dtype="fp32", zero_centered=True, save="output"),
]
WIDE_PROBLEMS = [
    Problem("layer_norm", M_WIDE, N_WIDE, "bf16", has_bias=True, save="input"),
    Problem("rms_norm", M_WIDE, N_WIDE, "fp16", weight_dtype="fp32", zero_centered=True, save="output"),
]
TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def test_every_field_is_varied():
    """Guard: each knob of the layout (every strategy's config type, `kernel_1_layout`) and of Kernel2Config appears
    in the variations at >= 2 values (with the base)."""
    assert set(K1_VARIATIONS) == set(kernel_1_layout())
    assert set(K2_VARIATIONS) == {f.name for f in dataclasses.fields(Kernel2Config)}
    for name, cfg in VARIATIONS:
        cfg.validate(VARIATION_PROBLEMS[0])  # the variations must be valid configs to test anything
    for name, cfg in SPLIT_VARIATIONS:
        cfg.validate(WIDE_PROBLEMS[0])
    varied = {n.split("=")[0].split("+")[0] for n, _ in VARIATIONS + SPLIT_VARIATIONS}
    expected = {f"k1.{name}" for name in kernel_1_layout()} | {
        f"k2.{f.name}" for f in dataclasses.fields(Kernel2Config)}
    assert expected <= varied | {"k2.fused"}, expected - varied
    assert any(c.kernel_2.fused for _, c in VARIATIONS) and any(c.kernel_2.fused for _, c in SPLIT_VARIATIONS)
    assert {n for n, _ in VARIATIONS + SPLIT_VARIATIONS} >= set(STRATEGY_RERUNS)  # each named variation exists
    reruns = [c for c in _variation_cases() + _split_cases() if c.values[3]]
    assert sorted(c.values[0] for c in reruns) == sorted(STRATEGY_RERUNS)  # each reruns on one problem


def saved_inputs(problem: Problem, device, reference_norm, make_norm_inputs, shape=None):
    """Inputs, their float64 reference and what the forward would have saved, for a launcher-level run."""
    dtype, pdt = TORCH_DTYPE[problem.dtype], TORCH_DTYPE[problem.weight_dtype]
    inputs = make_norm_inputs(shape or (problem.M, problem.N), dtype, device, has_weight=problem.has_weight,
                              has_bias=bool(problem.has_bias), zero_centered=problem.zero_centered, param_dtype=pdt)
    is_rms = problem.norm == "rms_norm"
    ref = reference_norm(inputs["x"], inputs["weight"], inputs["bias"], 1e-5, inputs["grad"], is_rms=is_rms,
                         zero_centered=problem.zero_centered)
    saved = inputs["x"] if problem.save == "input" else ref["y"].to(dtype)
    rstd = ref["rstd"].float()
    mean = ref["mean"].float() if not is_rms and problem.save == "input" else rstd.new_empty((0,))
    return inputs, ref, (inputs["grad"], saved, inputs["weight"], inputs["bias"], rstd, mean)


def poisoned_run(problem, config, args) -> BackwardLaunch:
    launch = BackwardLaunch(problem, config, *args)
    for buf in (launch.dx, launch.dw, launch.db, launch.partial_dw, launch.partial_db):
        if buf is not None:
            buf.fill_(float("nan"))
    launch.run()
    return launch


# Determinism: fixed-order sums, no atomics, so reruns are bitwise identical. Every variation reruns on a GPU; on
# the interpreter one config per strategy does, on the first problem it runs on (`check_variation`'s rerun).
STRATEGY_RERUNS = ("k1.strategy=columns+block_col=64+block_row=1+w1", "k1.strategy=dual+k2.4x64+base",
                   "k2.fused+block_m=4+base", "k1.column_accumulators=True+block_row=8", "k1.row_split=3",
                   "k1.row_split=8+k2.fused", "k1.pipelined_split=True+row_split=2+num_stages=3")


def _variation_cases():
    """Each variation on both norms and both save modes, in two of the four problems: LayerNorm saving its input
    with RMSNorm saving its output, or the other way round, alternately (every variation × problem pair would
    run each config twice per norm, for the save mode alone)."""
    pairs = ((0, 3), (1, 2))  # indices into VARIATION_PROBLEMS
    return [pytest.param(name, config, VARIATION_PROBLEMS[j], name in STRATEGY_RERUNS and j == pairs[i % 2][0],
                         id=f"{name}-{VARIATION_PROBLEMS[j].family.key}".replace("/", "-"))
            for i, (name, config) in enumerate(VARIATIONS) for j in pairs[i % 2]]


@pytest.mark.parametrize("name,config,problem,rerun", _variation_cases())
def test_config_variation_is_correct(name, config, problem, rerun, device, tolerance, assert_close, reference_norm,
                                     make_norm_inputs):
    check_variation(config, problem, device, tolerance, assert_close, reference_norm, make_norm_inputs, rerun)


def _split_cases():
    """Each split's plain config on both wide problems, and each of its variations on one of them, alternately:
    every split and every variation's form runs on both norms and both save modes across the splits."""
    cases, turn = [], 0
    for name, config in SPLIT_VARIATIONS:
        if "+" in name:
            chosen, turn = [WIDE_PROBLEMS[turn % 2]], turn + 1
        else:
            chosen = WIDE_PROBLEMS
        cases += [pytest.param(name, config, p, name in STRATEGY_RERUNS and p == chosen[0],
                               id=f"{name}-{p.family.key}".replace("/", "-")) for p in chosen]
    return cases


@pytest.mark.parametrize("name,config,problem,rerun", _split_cases())
def test_row_split_variation_is_correct(name, config, problem, rerun, device, tolerance, assert_close, reference_norm,
                                        make_norm_inputs):
    check_variation(config, problem, device, tolerance, assert_close, reference_norm, make_norm_inputs, rerun)


# Rows of 3, 5 and 7 times a power of two, split so that every slice fills its tile (`Space.fitting_split`).
FITTING_SPLITS = [(3, 1536), (6, 1536), (5, 2560), (7, 3584)]


# Both save modes, on alternate splits (each split's slices run the same code in either mode).
@pytest.mark.parametrize("split,N,save",
                         [(s, n, ("input", "output")[i % 2]) for i, (s, n) in enumerate(FITTING_SPLITS)],
                         ids=[f"split{s}-N{n}" for s, n in FITTING_SPLITS])
def test_fitting_row_split_is_correct(split, N, save, device, tolerance, assert_close, reference_norm,
                                      make_norm_inputs):
    assert N % split == 0 and row_block_col(N, split) == N // split  # the slice is exactly one tile
    problem = Problem("layer_norm", 13, N, "bf16", has_bias=True, save=save)  # 7 row tiles, the last one row
    k1 = dataclasses.replace(BASE.kernel_1, row_split=split, block_col=N // split, block_row=2, num_warps=4,
                             column_accumulators=True)
    check_variation(BackwardConfig(k1, BASE.kernel_2), problem, device, tolerance, assert_close, reference_norm,
                    make_norm_inputs)


@pytest.mark.parametrize("norm,N,save", [("layer_norm", 8200, "output"), ("rms_norm", 16384, "input")])
def test_wide_fp32_default_is_correct(norm, N, save, device, tolerance, assert_close, reference_norm,
                                      make_norm_inputs):
    """The analytic default of fp32 rows of 8193-16384 columns, as it runs: the rows split in 3 or 4 slices of
    2 x 4096 tiles (the last slice partly masked at 8200 columns), prefetch, dw/db per column.

    The default is picked for WIDE_DEFAULT_MIN_ROWS rows and run on 7: the property is the row width, and 7 rows
    are 4 row tiles per program (the prefetch's first, steady and last tile, the last one half masked), as the
    interpreter's one row group loops over every tile of the larger problem too."""
    picked = Problem(norm, WIDE_DEFAULT_MIN_ROWS, N, "fp32", has_bias=norm == "layer_norm", save=save)
    config = default_config(picked)
    assert config.kernel_1.row_split == (3 if N <= 12288 else 4) and config.kernel_1.prefetch
    problem = dataclasses.replace(picked, M=7)
    sms = sm_count(torch.device(device))
    if device != "cuda":  # the same grid as the larger problem's: one row group, each slice's program loops
        assert num_programs(problem.M, N, config, sms) == num_programs(picked.M, N, config, sms)
    check_variation(config, problem, device, tolerance, assert_close, reference_norm, make_norm_inputs)


def knob(config, name: str):
    """A kernel_1 knob of the canonical layout (the default where the config's strategy lacks it)."""
    return config.to_dict()["kernel_1"][name]


def check_variation(config, problem, device, tolerance, assert_close, reference_norm, make_norm_inputs,
                    rerun: bool = False):
    """Poisoned outputs against the float64 reference, the grid the heuristics promise, each row group's
    partial rows, and a bitwise-identical rerun (on a GPU always, on the interpreter where `rerun` asks)."""
    inputs, ref, args = saved_inputs(problem, device, reference_norm, make_norm_inputs)
    launch = poisoned_run(problem, config, args)
    k1 = config.kernel_1
    split = knob(config, "row_split")
    sms = sm_count(torch.device(device))
    waits = split > 1 or config.kernel_2.fused  # such grids are capped at what the GPU holds at once
    promised = num_programs(problem.M, problem.N, config, sms)
    assert launch.programs == promised or (waits and split <= launch.programs < promised)
    if k1.strategy == "columns":
        assert launch.programs == -(-problem.N // k1.block_col) and launch.partial_rows == 0
    elif k1.strategy == "dual":  # the row programs, then one per kernel_2.block_n columns; no partials
        column_programs = -(-problem.N // config.kernel_2.block_n)
        assert launch.plan.row_programs == launch.programs - column_programs >= 1 and launch.partial_rows == 0
    else:
        assert launch.partial_rows == launch.programs // split
        # One partial row per row group: exactly the heuristics' count unless the waiting grid was capped.
        expected_rows = partial_rows(problem.M, config, sms)
        assert launch.partial_rows == expected_rows or (waits and launch.partial_rows < expected_rows)
    tol = tolerance(TORCH_DTYPE[problem.dtype], problem.save)
    scale = ref["scale"]
    assert_close(launch.dx, ref["dx"], tol, "dx", floor=scale["dx"])
    assert_close(launch.dw, ref["dw"], tol, "dw", floor=scale["dw"])
    assert_close(launch.db, ref["db"], tol, "db", floor=scale["db"])
    if launch.partial_rows:
        # Each row group's partial row holds exactly the rows of its tiles (tile t → group t mod groups).
        groups = launch.partial_rows
        owner = (torch.arange(problem.M, device=device) // k1.block_row) % groups
        g64 = inputs["grad"].double()
        want_dw = torch.zeros((groups, problem.N), dtype=torch.float64, device=device)
        assert_close(launch.partial_dw, want_dw.index_add(0, owner, g64 * ref["xhat"]), tol, "partial_dw",
                     floor=scale["dw"])
        if problem.has_bias:
            assert_close(launch.partial_db, want_dw.index_add(0, owner, g64), tol, "partial_db",
                         floor=scale["db"])
    # The interpreter runs a grid's programs one after another: no order to vary there, one rerun per strategy.
    if device == "cuda" or rerun:
        first = [t.clone() for t in (launch.dx, launch.dw, launch.db) if t is not None]
        again = poisoned_run(problem, config, args)
        for a, b in zip(first, [t for t in (again.dx, again.dw, again.db) if t is not None]):
            assert torch.equal(a, b), f"a rerun of {config} must be bitwise identical"


# ---------------------------------------------------------------------------------------------------------------
# The analytic default and select_config over the whole supported range.
# ---------------------------------------------------------------------------------------------------------------
def _families():
    out = []
    for norm, dtype, fp32_weight, has_weight, has_bias, zc, save in itertools.product(
            NORMS, DTYPES, (False, True), (False, True), (False, True), (False, True), SAVE_MODES):
        try:
            out.append(Problem(norm, 1, 1, dtype, "fp32" if fp32_weight else None, has_weight, has_bias, zc, save))
        except ConfigError:
            continue
    return sorted(set(out), key=lambda p: p.family.key)


FAMILIES = _families()
DEVICE_NAMES = [None, "NVIDIA H100 80GB HBM3", "NVIDIA H200", "cpu (triton interpreter)"]


def check_default_for(problem: Problem) -> None:
    cfg = default_config(problem)
    assert isinstance(cfg, BackwardConfig)
    cfg.validate(problem)
    assert BackwardConfig.from_json(cfg.to_json()) == cfg and hash(cfg) == hash(BackwardConfig.from_json(cfg.to_json()))
    if cfg.kernel_1.strategy == "rows" and not cfg.kernel_1.two_pass:
        assert cfg.kernel_1.block_col >= slice_width(problem.N, cfg.kernel_1.row_split)
    if cfg.kernel_1.strategy == "columns":  # only where rows are too wide for one pass and few enough to sweep
        assert problem.N > 16384 and problem.M <= 2048
    wide = 8192 < problem.N <= 16384 and problem.M >= WIDE_DEFAULT_MIN_ROWS
    wide_16_bit = wide and problem.itemsize == 2
    if problem.norm == "layer_norm" and wide_16_bit:  # LayerNorm's wide rows: split in 4, pipelined exchange
        assert knob(cfg, "row_split") == 4 and cfg.kernel_1.pipelined_split and cfg.kernel_1.column_accumulators
    elif wide and problem.itemsize == 4:  # fp32's wide rows: 3-4 slices of at most 4096 columns, 2-row tiles
        k1 = cfg.kernel_1
        assert knob(cfg, "row_split") == (3 if problem.N <= 12288 else 4) and (k1.block_row, k1.block_col) == (2, 4096)
        assert k1.prefetch and k1.column_accumulators and not k1.pipelined_split
    elif knob(cfg, "row_split") > 1:  # only many 16-bit rows too wide for one pass, in slices of at most 8192
        assert problem.N > 16384 and problem.M > 2048 and problem.itemsize == 2
        assert cfg.kernel_1.column_accumulators and slice_width(problem.N, cfg.kernel_1.row_split) <= 8192
    elif problem.norm == "rms_norm" and wide_16_bit:
        assert cfg.kernel_1.prefetch and cfg.kernel_1.block_col == 16384  # recompute where prefetch needs it
    programs = num_programs(problem.M, problem.N, cfg, 132)
    if problem.M == 0:
        assert programs == 0  # nothing to launch
    elif cfg.kernel_1.strategy == "columns":
        assert programs == -(-problem.N // cfg.kernel_1.block_col)
    else:
        assert 0 < programs <= max(1, -(-problem.M // cfg.kernel_1.block_row)) * knob(cfg, "row_split")
    for name in DEVICE_NAMES:
        selected = select_config(problem, name)
        assert selected.is_valid(problem), f"select_config({problem.key}, {name!r}) gave an invalid {selected}"


def test_families_cover_the_flags():
    assert len(FAMILIES) >= 40
    assert {p.norm for p in FAMILIES} == set(NORMS) and {p.save for p in FAMILIES} == set(SAVE_MODES)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(family=st.sampled_from(FAMILIES), M=st.integers(0, 2**20), N=st.integers(1, MAX_N))
@example(family=FAMILIES[0], M=0, N=1)
@example(family=FAMILIES[-1], M=1, N=MAX_N)
def test_default_and_selected_configs_are_valid(family, M, N):
    check_default_for(family.with_shape(M, N))


def test_default_configs_valid_at_power_of_two_boundaries():
    """Every family at N = 2^k − 1, 2^k, 2^k + 1 (where the single-pass threshold and tile sizes switch)."""
    widths = sorted({n for k in range(19) for n in (2**k - 1, 2**k, 2**k + 1) if 1 <= n <= MAX_N} | {MAX_N})
    for family in FAMILIES:
        for N in widths:
            for M in (1, 4097):
                check_default_for(family.with_shape(M, N))


# ---------------------------------------------------------------------------------------------------------------
# Determinism: one launch's partial rows summed by kernel_2 over several steps, rerun and relaunched (one config
# per strategy reruns in the variations above: STRATEGY_RERUNS).
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("two_pass", [False, True], ids=["1pass", "2pass"])
def test_backward_is_bitwise_deterministic(two_pass, device, reference_norm, make_norm_inputs):
    problem = Problem("layer_norm", 25, 200, "bf16", weight_dtype="fp32", has_bias=True)  # 13 row tiles, 12 programs
    k1 = K1(block_row=2, block_col=64 if two_pass else 256, num_warps=2, programs_per_sm=3, two_pass=two_pass)
    config = BackwardConfig(k1, K2(block_m=2, block_n=32, num_warps=1))
    _, _, args = saved_inputs(problem, device, reference_norm, make_norm_inputs)
    first = poisoned_run(problem, config, args)
    # Several programs, and more partial rows than kernel_2's block_m: kernel_2 sums partials over several steps.
    assert first.programs > 2 * config.kernel_2.block_m
    second = poisoned_run(problem, config, args)
    outputs = ("dx", "dw", "db", "partial_dw", "partial_db")
    for name in outputs:
        assert torch.equal(getattr(first, name), getattr(second, name)), f"{name} differs between two runs"
    again = [getattr(first, name).clone() for name in outputs]
    first.run()  # a launch is reusable: running it again recomputes the same values in place
    for name, before in zip(outputs, again):
        assert torch.equal(getattr(first, name), before), f"{name} differs after relaunching"


# ---------------------------------------------------------------------------------------------------------------
# GPU: the knob variations compiled (warps, stages, eviction and PDL take effect there), determinism at scale.
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name,config", VARIATIONS, ids=[n for n, _ in VARIATIONS])
def test_gpu_config_variation_is_correct(name, config, tolerance, assert_close, reference_norm, make_norm_inputs):
    problem = Problem("layer_norm", 4099, N_VAR, "bf16", has_bias=True, save="output")
    inputs, ref, args = saved_inputs(problem, "cuda", reference_norm, make_norm_inputs)
    launch = poisoned_run(problem, config, args)
    tol, scale = tolerance(torch.bfloat16, "output"), ref["scale"]
    assert_close(launch.dx, ref["dx"], tol, "dx", floor=scale["dx"])
    assert_close(launch.dw, ref["dw"], tol, "dw", floor=scale["dw"])
    assert_close(launch.db, ref["db"], tol, "db", floor=scale["db"])


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("M,N", [(4096, 16384), (32768, 1024), (512, 65536)])
def test_gpu_bitwise_deterministic_at_scale(M, N, norm, reference_norm, make_norm_inputs):
    problem = Problem(norm, M, N, "bf16")
    config = select_config(problem, torch.cuda.get_device_name())
    inputs = make_norm_inputs((M, N), torch.bfloat16, "cuda", has_bias=bool(problem.has_bias))
    ref = reference_norm(inputs["x"], inputs["weight"], inputs["bias"], 1e-5, is_rms=norm == "rms_norm")
    rstd = ref["rstd"].float()
    mean = ref["mean"].float() if norm == "layer_norm" else rstd.new_empty((0,))
    args = (inputs["grad"], inputs["x"], inputs["weight"], inputs["bias"], rstd, mean)
    runs = [poisoned_run(problem, config, args) for _ in range(3)]
    assert runs[0].programs > 1
    for name in ("dx", "dw", "db"):
        a = getattr(runs[0], name)
        for other in runs[1:]:
            b = getattr(other, name)
            assert (a is None and b is None) or torch.equal(a, b), f"{name} differs between runs"


@pytest.mark.gpu
@pytest.mark.parametrize("norm,M,N,dtype,split", [("layer_norm", 2048, 16384, "bf16", 2),
                                                  ("rms_norm", 1024, 28672, "fp16", 7),
                                                  ("layer_norm", 4096, 32768, "bf16", 4)])
def test_gpu_pipelined_split_is_correct_and_bitwise_at_scale(norm, M, N, dtype, split, tolerance, assert_close,
                                                             reference_norm, make_norm_inputs):
    """The pipelined exchange (inline-assembly wait inside a software-pipelined loop) on wide rows, each of the
    space's pipelined seeds of that split: float64 reference on poisoned outputs, and three runs bitwise equal."""
    problem = Problem(norm, M, N, dtype, has_bias=norm == "layer_norm")
    seeds = [c for c in Space(problem, torch.cuda.get_device_properties(0).multi_processor_count).seeds()
             if knob(c, "pipelined_split") and knob(c, "row_split") == split]
    assert seeds, "the space seeds this split pipelined"
    inputs, ref, args = saved_inputs(problem, "cuda", reference_norm, make_norm_inputs)
    tol, scale = tolerance(TORCH_DTYPE[dtype], "input"), ref["scale"]
    for config in seeds:
        runs = [poisoned_run(problem, config, args) for _ in range(3)]
        for name in ("dx", "dw", "db"):
            first = getattr(runs[0], name)
            if first is None:
                continue
            assert_close(first, ref[name], tol, f"{name} of {config}", floor=scale[name])
            assert all(torch.equal(first, getattr(r, name)) for r in runs[1:]), f"{name} differs between runs"


def test_alignment_hint_is_what_every_width_and_stride_shares():
    """Up to 8, and 1 where Triton's own specialization already knows (all multiples of 16) or nothing is shared."""
    assert alignment_hint(3000) == 8  # bf16 rows of 3000 columns start on 16-byte boundaries
    assert alignment_hint(3000, 3000, 3004) == 4
    assert alignment_hint(4096, 4102) == 2
    assert alignment_hint(4096, 8192) == 1 and alignment_hint(4096) == 1
    assert alignment_hint(1001) == 1 and alignment_hint(1) == 1
    assert alignment_hint(24, 48) == 8 and alignment_hint(12) == 4
