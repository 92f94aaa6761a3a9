"""The configs `test_hopper_compile.py` compiles for each target, drawn from the search space rather than listed:

- `covering_sample`: per strategy, a few configs of the device's search space (`Space` with its limits) in which
  every value of every knob the strategy uses occurs at least once (a covering array of strength 1, built
  greedily from seeded random draws that favour the values still missing); with `features_only`, every value of
  the knobs that change the generated code's form rather than its sizes (`FEATURES`: pass mode, stages,
  eviction hint, prefetch, recompute, column accumulators, pipelined split, PDL, fused reduction, split or not),
  which takes a few configs per strategy instead of one per tile size;
- `variants`: per strategy, a problem with a residual stream, and problems whose offsets need 64 bits (rows,
  single and two-pass: the only strategy a problem that large gets);
- `default_forms`: one problem per distinct form the analytic default takes on the device, over a grid of
  norms, dtypes, saves, row counts and widths (forms differ in strategy, split, pass mode, stages and the
  boolean knobs; two problems whose defaults differ only in tile sizes, split count or dtype are one form).
"""

from __future__ import annotations

import dataclasses
import random

from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, kernel_1_layout
from normtune.kernels.config import default_config
from normtune.kernels.limits import DeviceLimits
from normtune.tuner.space import Space

# Problems per strategy whose spaces between them hold every knob value the strategy can take: power-of-two and
# 3/5/7-times-a-power-of-two widths (row splits of 3-8), narrow rows (block_row 64), rows too wide for one pass
# (two-pass chunks), few rows (columns, dual), fp32 and a LayerNorm that recovers x̂ from its output.
STRATEGY_PROBLEMS = {
    "rows": [Problem("rms_norm", 4096, 4096, "bf16"), Problem("rms_norm", 4096, 2048, "bf16"),
             Problem("layer_norm", 2048, 12288, "fp16", has_bias=True, save="output"),
             Problem("rms_norm", 1024, 28672, "bf16"), Problem("rms_norm", 4096, 5120, "bf16"),
             Problem("layer_norm", 4096, 65536, "bf16", has_bias=True), Problem("rms_norm", 8192, 256, "fp32"),
             Problem("rms_norm", 2048, 16384, "bf16")],
    "columns": [Problem("rms_norm", 256, 32768, "bf16"), Problem("layer_norm", 64, 4096, "fp16", has_bias=True),
                Problem("rms_norm", 2048, 2048, "fp32")],
    "dual": [Problem("layer_norm", 64, 4096, "bf16", has_bias=True), Problem("rms_norm", 100, 8192, "bf16",
                                                                             save="output"),
             Problem("rms_norm", 512, 512, "fp32"), Problem("rms_norm", 2048, 128, "bf16")],
}
# Knob values a strategy's space never holds on these problems, and why (the sample must reach every other one).
UNREACHABLE = {
    "rows": {("k1.block_col", c): "single pass covers the row; two-pass chunks start at 512" for c in (32, 64, 128)},
    "columns": {("k1.block_col", c): "the columns strategy's slice is at most 1024 columns"
                for c in (2048, 4096, 8192)},
    "dual": {},
}
SINGLE_PASS_BLOCK_COLS = (256,)  # rows: a narrow row's own tile width (8192x256), in the domain

# The knobs a features-only sample covers, each mapped to the form its value selects (a split of 2 or 7 rows is
# one form: the split count is a compile-time size).
FEATURES = {"k1.two_pass": None, "k1.num_stages": None, "k1.eviction_policy": None, "k1.prefetch": None,
            "k1.recompute": None, "k1.column_accumulators": None, "k1.pipelined_split": None,
            "k1.row_split": lambda v: v > 1, "k2.num_stages": None, "k2.pdl": None, "k2.fused": None}

# Valid draws compared before the one covering most missing values joins the sample.
DRAWS = 12

FIELDS = {**{f"k1.{name}": ("kernel_1", name) for name in kernel_1_layout()},
          **{f"k2.{f.name}": ("kernel_2", f.name) for f in dataclasses.fields(Kernel2Config)}}


def _form(knob: str, value, features_only: bool):
    """What a knob's value counts as in the sample: itself, or with `features_only` the form it selects."""
    classify = FEATURES.get(knob)
    return classify(value) if features_only and classify else value


def _pairs(config: BackwardConfig, knobs, features_only: bool = False) -> set:
    knob = config.to_dict()
    return {(k, _form(k, knob[FIELDS[k][0]][FIELDS[k][1]], features_only)) for k in knobs}


def applicable(space: Space, strategy: str, base: dict) -> set[str]:
    """Knobs the strategy uses: changing one in the sampled parameters changes the config built from them."""
    d = space.domains()
    out = set()
    for k, values in d.items():
        if k == "k1.strategy":
            continue
        made = {space.config({**base, "k1.strategy": strategy, k: v}) for v in values}
        if len(made) > 1:
            out.add(k)
    return out


def covering_sample(limits: DeviceLimits, seed: int = 0, tries: int = 20000, features_only: bool = False,
                    given: tuple[BackwardConfig, ...] = ()) -> tuple[list, dict[str, list[str]]]:
    """(strategy, problem, config) triples covering every knob value each strategy uses on the device, or with
    `features_only` every form of the `FEATURES` knobs (module doc), besides the values the `given` configs
    (compiled for the device anyway) already hold; and per strategy the (knob, value) pairs no draw reached."""
    rng = random.Random(seed)
    sample, unreached = [], {}
    for strategy, problems in STRATEGY_PROBLEMS.items():
        spaces = [Space(p, limits.sm_count, limits) for p in problems]
        spaces = [s for s in spaces if strategy in s.domains()["k1.strategy"]]
        knobs: set[str] = set()
        for s in spaces:
            base = {k: v[0] for k, v in s.domains().items()}
            knobs |= applicable(s, strategy, base)
        if features_only:
            knobs &= set(FEATURES)
        wanted = {(k, v) for s in spaces for k in knobs for v in s.domains()[k]} - set(UNREACHABLE[strategy])
        wanted = {(k, _form(k, v, features_only)) for k, v in wanted}
        covered = set().union(*(_pairs(c, knobs, features_only) for c in given if c.kernel_1.strategy == strategy))
        best, drawn = None, 0
        for _ in range(tries):
            missing = wanted - covered
            if not missing:
                break
            if best is not None and drawn >= DRAWS:  # the draw covering most missing values joins the sample
                covered |= _pairs(best[2], knobs, features_only)
                sample.append(best)
                best, drawn = None, 0
                continue
            space = rng.choice(spaces)
            d = space.domains()
            params = {}
            for k, values in d.items():
                gaps = [v for v in values if (k, _form(k, v, features_only)) in missing]
                params[k] = rng.choice(gaps) if gaps and rng.random() < 0.7 else rng.choice(values)
            params["k1.strategy"] = strategy
            if params["k2.fused"]:
                params["k2.pdl"], params["k2.num_warps"] = False, d["k2.num_warps"][0]
            cfg = space.config(params)
            if space.why_not(cfg) is not None:
                continue
            cfg = space.canonical(cfg)
            gain = len(_pairs(cfg, knobs, features_only) & missing)
            if space.why_not(cfg) is not None or not gain:
                continue
            drawn += 1
            if best is None or gain > len(_pairs(best[2], knobs, features_only) & missing):
                best = (strategy, space.problem, cfg)
        if best is not None and wanted - covered:
            covered |= _pairs(best[2], knobs, features_only)
            sample.append(best)
        unreached[strategy] = sorted(f"{k}={v}" for k, v in wanted - covered)
    return sample, unreached


def default_forms(limits: DeviceLimits) -> list[tuple[Problem, BackwardConfig]]:
    """One (problem, default config) per distinct form of the analytic default on the device (module doc)."""
    forms: dict[tuple, tuple[Problem, BackwardConfig]] = {}
    for norm in ("rms_norm", "layer_norm"):
        for dtype in ("bf16", "fp16", "fp32"):
            for save in ("input", "output"):
                for M in (1, 100, 600, 4096):
                    for N in (1000, 4096, 12288, 16384, 32768, 65536):
                        p = Problem(norm, M, N, dtype, has_bias=norm == "layer_norm", save=save)
                        cfg = default_config(p, limits)
                        k1, k2 = cfg.to_dict()["kernel_1"], cfg.kernel_2
                        form = (k1["strategy"], k1["two_pass"], k1["row_split"] > 1, k1["num_stages"],
                                k1["prefetch"], k1["recompute"], k1["column_accumulators"], k1["pipelined_split"],
                                k1["eviction_policy"], k2.pdl, k2.fused)
                        forms.setdefault(form, (p, cfg))
    return list(forms.values())


def variants(limits: DeviceLimits) -> list[tuple[str, Problem, BackwardConfig]]:
    """(variant, problem, config): per strategy a residual stream (fp32 or bf16) and a gate (either position and
    activation), the rows strategy's two-pass form with a gate, and its single and two-pass forms at sizes whose
    offsets need 64 bits (module doc)."""
    residual = {"rows": Problem("rms_norm", 4096, 4096, "bf16", residual=True, residual_dtype="fp32"),
                "columns": Problem("rms_norm", 256, 32768, "bf16", residual=True, residual_dtype="fp32"),
                "dual": Problem("layer_norm", 64, 4096, "bf16", has_bias=True, residual=True, residual_dtype="bf16")}
    gated = {"rows": Problem("rms_norm", 4096, 4096, "bf16", gate="after", gate_activation="silu"),
             "columns": Problem("rms_norm", 256, 32768, "bf16", gate="before", gate_activation="sigmoid"),
             "dual": Problem("rms_norm", 64, 4096, "bf16", gate="after", gate_activation="silu")}
    wide = [Problem("rms_norm", 65536, 32768, "bf16"), Problem("layer_norm", 16384, 131072, "bf16", has_bias=True)]
    out = []
    for kind, problems in (("residual", residual), ("gated", gated)):
        for strategy, problem in problems.items():
            candidates = [default_config(problem, limits)] + Space(problem, limits.sm_count, limits).seeds()
            out.append((f"{kind}-{strategy}", problem, next(c for c in candidates if c.kernel_1.strategy == strategy)))
    two_pass = Problem("rms_norm", 4096, 131072, "bf16", gate="before", gate_activation="silu")
    out.append(("gated-two-pass", two_pass, default_config(two_pass, limits)))
    # the analytic default of the forms no table tunes, where their streams fill the most shared memory
    for problem in (Problem("rms_norm", 4096, 8192, "fp32", gate="after", gate_activation="silu"),
                    Problem("layer_norm", 4096, 16384, "bf16", has_bias=True, residual=True, residual_dtype="fp32"),
                    Problem("rms_norm", 4096, 65536, "fp32", residual=True)):
        out.append(("default-wide-form", problem, default_config(problem, limits)))
    return out + [("int64", p, default_config(p, limits)) for p in wide]
