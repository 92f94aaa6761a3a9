"""Frozen launch-heuristic tables (`configs/<gpu>.json`, emitted by `normtune emit`) and their lookup.

A table holds, per problem family (norm, dtypes, flags), an ordered list of rules over N and M; the first rule
with N <= n_max and M <= m_max (null: unbounded) gives the config. Rules were fitted on measured shapes; for any
other shape the config is adapted (single pass needs block_col >= N, …) and validated, so whatever the shape the
returned config can run it.

Which table a process uses is the chain in `table_chain.py`: the file named by $NORMTUNE_CONFIG → the user table
(`<user dir>/<gpu key>.json`, written by `normtune emit --user`) → the shipped table of this GPU (exact name, else
the same GPU family or compute capability, with a one-time warning) → none (the analytic defaults). Tables are
loaded once; a malformed or wrong-schema table is refused with an error naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .config import (
    ITEMSIZE,
    ROW_SPLITS,
    BackwardConfig,
    ConfigError,
    Problem,
    ProblemFamily,
)
from .heuristics import MAX_COLUMNS_ROWS, MAX_SINGLE_PASS, default_config, next_power_of_two, row_block_col, slice_width
from .device import gpu_key

SCHEMA_VERSION = 1
# A dtype the table has no family of borrows the rules of this one (same norm, closest flags), adapted and validated
# for the problem like any rule's config: fp16 has bf16's element size, so the same tiles, registers and bytes per
# row; fp32 rows hold twice the bytes. A config sized to a bf16 row carries over only where `carried_over` says.
# H200 held-out, analytic default against the best of an unseeded sweep: fp16 200x5120 13.5 against 10.0 µs,
# fp32 96x4096 10.0 against 6.9.
STAND_IN_DTYPES = {"fp16": "bf16", "fp32": "bf16"}
# Row widths (elements) the rules answer for when they were fitted on such widths only (`Table.aligned_width`).
ALIGNED_WIDTH = 16


class TableError(ValueError):
    """A table that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Rule:
    n_max: int | None
    m_max: int | None
    config: BackwardConfig
    fitted_on: tuple[str, ...] = ()  # the measured shapes ("MxN") the rule was chosen on

    def matches(self, M: int, N: int) -> bool:
        return (self.n_max is None or N <= self.n_max) and (self.m_max is None or M <= self.m_max)


@dataclass(frozen=True)
class Table:
    path: str
    gpu_name: str
    gpu_key: str
    compute_capability: str | None
    sm_count: int | None
    interpret: bool
    families: dict[str, tuple[Rule, ...]]
    raw: dict
    # Per family, the (M, N) box of the shapes its rules were fitted on: (min M, max M, min N, max N).
    fitted: dict[str, tuple[int, int, int, int]] = dataclasses.field(default_factory=dict)
    # Families fitted on row widths that are all multiples of ALIGNED_WIDTH (see `aligned_width`).
    aligned_only: frozenset[str] = frozenset()

    @property
    def label(self) -> str:
        """The table's path as reports show it: a shipped table as configs/<file> (its place in the repository),
        another relative to the working folder when it lies inside it, else as given."""
        path = Path(self.path).resolve()
        try:
            shipped = Path(str(resources.files("normtune.configs"))).resolve()
            return f"configs/{path.relative_to(shipped)}"
        except (ValueError, TypeError, ModuleNotFoundError):
            pass
        try:
            return str(path.relative_to(Path.cwd().resolve()))
        except ValueError:
            return self.path

    def family_key(self, family: ProblemFamily) -> str | None:
        """The key of the family's rules, or of the closest tuned family: same norm, the same dtype if the table
        tuned one, else the dtype's stand-in (`STAND_IN_DTYPES`), then most flags equal; None when there is none."""
        if family.key in self.families:
            return family.key
        best, best_score = None, (-1, -1)
        for key in self.families:
            other = ProblemFamily.from_key(key)
            if other.norm != family.norm:
                continue
            if other.dtype == family.dtype:
                same_dtype = 1
            elif other.dtype == STAND_IN_DTYPES.get(family.dtype):
                same_dtype = 0
            else:
                continue
            score = (same_dtype, sum(getattr(other, f) == getattr(family, f)
                                     for f in ("weight_dtype", "has_weight", "has_bias", "zero_centered", "save")))
            if score > best_score:
                best, best_score = key, score
        return best

    def rules(self, family: ProblemFamily) -> tuple[Rule, ...] | None:
        """The family's rules, or those of the closest tuned family."""
        key = self.family_key(family)
        return self.families[key] if key is not None else None

    def covers(self, problem: Problem) -> bool:
        """Whether `problem` lies in the (M, N) box its rules were fitted on (no box recorded: everywhere) and
        its row width is aligned like the fitted ones (`aligned_width`)."""
        key = self.family_key(problem.family)
        box = self.fitted.get(key) if key is not None else None
        return box is None or (box[0] <= problem.M <= box[1] and box[2] <= problem.N <= box[3]
                               and self.aligned_width(problem))

    def aligned_width(self, problem: Problem) -> bool:
        """False for a row width that is not a multiple of ALIGNED_WIDTH when every fitted width was one. Triton
        specializes row strides divisible by 16 and vectorizes their loads; other widths run another kernel, which
        the rules never measured (H100 LayerNorm 20000x3000: the analytic default 208 µs, the rule fitted at
        16384x3072 223 µs; the default ran at about 59 % of the copy floor there, 85 % at 16384x3072)."""
        return problem.N % ALIGNED_WIDTH == 0 or self.family_key(problem.family) not in self.aligned_only

    def match(self, problem: Problem) -> "RuleMatch":
        """Which rule answers `problem` and with what config (None: no rule applies — no family of this norm and
        dtype, or outside the box of shapes the family was fitted on: the table does not extrapolate; H100:
        RMSNorm rules fitted from N=1024 up ran 262144x256 at 215 vs 178 µs for the analytic default, 524288x128
        at 293 vs 228)."""
        key = self.family_key(problem.family)
        if key is None:
            return RuleMatch(None, False, None)
        box = self.fitted.get(key)
        if not self.covers(problem):
            return RuleMatch(key, key == problem.family.key, box)
        rules = self.families[key]
        index = next((i for i, r in enumerate(rules) if r.matches(problem.M, problem.N)), None)
        past = index is None
        if past:  # past every bound: the widest rule's configs, for the largest M bucket
            widest = max((r.n_max or 0) for r in rules)
            index = [i for i, r in enumerate(rules) if (r.n_max or 0) == widest][-1]
        rule = rules[index]
        config = rule.config
        stand_in = ProblemFamily.from_key(key).dtype
        if stand_in != problem.dtype and holds_rows(config):
            config, why = carried_over(config, stand_in, problem.dtype)
            if config is None:
                return RuleMatch(key, False, box, index, rule, past, None, f"{why} → the analytic default")
        return RuleMatch(key, key == problem.family.key, box, index, rule, past,
                         adapt(config, problem, self.sm_count))

    def lookup(self, problem: Problem) -> BackwardConfig | None:
        """The table's config adapted to `problem`, or None when no rule applies (see `match`)."""
        return self.match(problem).config


@dataclass(frozen=True)
class RuleMatch:
    """How a table answered one problem: the family whose rules it read (exact, or the closest tuned one), that
    family's fitted (M, N) box, the rule taken (index in the family's list) and its config adapted to the shape;
    `config` None when no rule applies."""

    family_key: str | None
    exact_family: bool
    box: tuple[int, int, int, int] | None
    index: int | None = None
    rule: Rule | None = None
    past_bounds: bool = False  # beyond every rule's bounds: the widest rule, largest M bucket
    config: BackwardConfig | None = None
    refused: str | None = None  # why the rule's config was not carried over to a stand-in's dtype

    def reason(self, problem: Problem) -> str:
        """One line: why this rule, or why none."""
        if self.family_key is None:
            return f"no {problem.norm} {problem.dtype} family in the table → the analytic default"
        family = self.family_key if self.exact_family else f"{self.family_key} (closest tuned family)"
        if self.refused is not None:
            return f"family {family}, rule #{self.index + 1}: {self.refused}"
        if self.rule is None:
            m0, m1, n0, n1 = self.box
            if m0 <= problem.M <= m1 and n0 <= problem.N <= n1:
                return (f"family {family}: N={problem.N} is not a multiple of {ALIGNED_WIDTH} and the rules were "
                        f"fitted on multiples of {ALIGNED_WIDTH} only → the analytic default")
            return (f"family {family}: {problem.M}x{problem.N} lies outside the fitted box (M {m0}…{m1}, "
                    f"N {n0}…{n1}) → the analytic default")
        bound = lambda v: "∞" if v is None else str(v)  # noqa: E731
        fitted = f", fitted on {', '.join(self.rule.fitted_on)}" if self.rule.fitted_on else ""
        past = "; past every rule's bounds: the widest rule" if self.past_bounds else ""
        adapted = "; its config adapted to the shape" if self.config != self.rule.config else ""
        return (f"family {family}, rule #{self.index + 1} (n_max {bound(self.rule.n_max)}, m_max "
                f"{bound(self.rule.m_max)}{fitted}){past}{adapted}")


def holds_rows(config: BackwardConfig) -> bool:
    """Whether a config sizes its register tile for the element size it was fitted on: split rows (each slice
    fills the registers) or recompute (which keeps the packed 16-bit tile live instead of fp32 values)."""
    k1 = config.kernel_1
    return k1.strategy == "rows" and not k1.two_pass and (k1.row_split > 1 or k1.recompute)


def carried_over(config: BackwardConfig, stand_in: str, dtype: str) -> tuple[BackwardConfig | None, str]:
    """A stand-in's `holds_rows` config for `dtype`, or None and why it does not carry over.

    - recompute widens packed bf16 values again after the row reductions; for fp16 the kernel keeps fp32 copies as
      well (H100 RMSNorm fp16 2048x16384 on the bf16 rule's recompute config: 878.5 µs, bf16 83.6), so a
      recompute config carries over only by splitting the row anew;
    - twice the element size (fp32): a split row in twice the slices, each of the same bytes, without recompute,
      that `adapt` then fits to the row. H200, fp32 2048x32768 on the bf16 rule's split-in-4 config as it was:
      593.7 µs (LayerNorm) against the default's 355.7; in 8 slices (H100) 340.0 against 473.0. A whole row held
      in registers does not split well: H100 RMSNorm fp32 4096x12288 in 2 slices 275.2 µs against 252.4.
    """
    k1 = config.kernel_1
    factor = ITEMSIZE[dtype] // ITEMSIZE[stand_in]
    if factor == 1:
        if k1.recompute:
            return None, f"its config recomputes from packed {stand_in} values, which {dtype} cannot"
        return config, ""
    split = k1.row_split * factor
    if k1.row_split == 1:
        return None, f"its config holds whole {stand_in} rows in registers"
    if split > ROW_SPLITS[-1]:
        return None, (f"its config holds {stand_in} rows in registers in {k1.row_split} slices, and {dtype} would "
                      f"need more than {ROW_SPLITS[-1]}")
    return BackwardConfig(dataclasses.replace(k1, row_split=split, block_col=max(1, k1.block_col // factor),
                                              recompute=False), config.kernel_2), ""


def fitted_shapes(rules_data: list) -> list[tuple[int, int]] | None:
    """(M, N) of every shape the rules were fitted on (their `fitted_on`, "MxN"); None when a rule lacks them."""
    shapes = []
    for r in rules_data:
        fitted = r.get("fitted_on") if isinstance(r, Mapping) else None
        if not isinstance(fitted, list) or not fitted:
            return None
        for text in fitted:
            m, _, n = str(text).partition("x")
            if not (m.isdigit() and n.isdigit()):
                return None
            shapes.append((int(m), int(n)))
    return shapes


def adapt(config: BackwardConfig, problem: Problem, sm_count: int | None = None) -> BackwardConfig:
    """Make a rule's config valid for `problem`: single pass takes block_col = next_pow2(N) (two-pass past
    MAX_SINGLE_PASS); knobs that cannot apply are dropped; if it still cannot run, the analytic default.
    With `sm_count`, a problem too short to fill a quarter of the rule's grid with row tiles gets smaller row
    tiles (H100: LayerNorm 128x16384 ran 20% slower on the 4-row tiles fitted at M=512 — 32 tiles for 132 SMs —
    than the best config a fresh sweep found, on 2-row tiles). Above a quarter the fitted tile is kept: 257x14336
    on the same 4-row tiles (65 tiles) validated at regret 1.000."""
    k1 = config.kernel_1
    n_pow2 = next_power_of_two(problem.N)
    if k1.strategy == "columns":  # a column slice sweeps every row: any N, up to MAX_COLUMNS_ROWS rows
        cand = BackwardConfig(dataclasses.replace(k1, block_col=min(k1.block_col, n_pow2)), config.kernel_2)
        return cand if problem.M <= MAX_COLUMNS_ROWS and cand.is_valid(problem) else default_config(problem)
    if k1.strategy == "dual" and problem.M > MAX_COLUMNS_ROWS:  # its column programs sweep every row
        return default_config(problem)
    if k1.row_split > 1:  # the row's slices must stay >= 256 columns and fit one pass
        # The rule's split if its slices still fit the rule's tile, else the next split that keeps that tile (a
        # rule fitted at 12288 columns in 3 slices of 4096 runs 12800 in 4), else the rule's split on wider tiles.
        fits = [s for s in ROW_SPLITS if s >= k1.row_split and row_block_col(problem.N, s) <= k1.block_col]
        for split in fits[:1] + [k1.row_split]:
            width = row_block_col(problem.N, split)
            if slice_width(problem.N, split) >= 256 and width <= MAX_SINGLE_PASS:
                cand = BackwardConfig(dataclasses.replace(k1, block_col=width, row_split=split), config.kernel_2)
                if cand.is_valid(problem):
                    return cand
        k1 = dataclasses.replace(k1, row_split=1)
    if sm_count:
        want = max(1, round(k1.programs_per_sm * sm_count) // 4)
        while k1.block_row > 1 and -(-problem.M // k1.block_row) < want:
            k1 = dataclasses.replace(k1, block_row=k1.block_row // 2)
    if not k1.two_pass:
        if n_pow2 <= MAX_SINGLE_PASS:
            block_row = k1.block_row
            while block_row > 1 and block_row * n_pow2 > k1.block_row * k1.block_col:
                block_row //= 2  # keep the tile no larger than the rule's
            k1 = dataclasses.replace(k1, block_col=n_pow2, block_row=block_row)
        else:
            k1 = dataclasses.replace(k1, two_pass=True, block_col=min(4096, k1.block_col), block_row=1,
                                     recompute=False, column_accumulators=False)
    elif k1.block_col >= n_pow2 and n_pow2 <= MAX_SINGLE_PASS:
        k1 = dataclasses.replace(k1, two_pass=False, block_col=n_pow2)
    k2 = config.kernel_2
    if k2.block_n > n_pow2:
        k2 = dataclasses.replace(k2, block_n=n_pow2)
    for warps in (k1.num_warps, 16, 8, 4, 2, 1):
        cand = BackwardConfig(dataclasses.replace(k1, num_warps=warps), k2)
        if cand.is_valid(problem):
            return cand
    return default_config(problem)


# ------------------------------------------------------------------------------------------- loading


def _fail(path: str, message: str):
    raise TableError(f"heuristic table {path}: {message}")


def _is_positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# Metadata fields a table may carry: (where, field) → (rule, what it must be). Checked at load, so that a bad
# value is refused naming the file and the field instead of failing at the first backward that uses it.
_METADATA_RULES = {
    ("gpu", "key"): (lambda v: v is None or isinstance(v, str), "a string (e.g. \"h100\") or null"),
    ("gpu", "compute_capability"): (
        lambda v: v is None or (isinstance(v, str) and len(v.split(".")) == 2 and all(p.isdigit() for p in v.split("."))),
        "a string major.minor (e.g. \"9.0\") or null"),
    ("gpu", "sm_count"): (lambda v: v is None or _is_positive_int(v), "a positive integer (e.g. 132) or null"),
    ("", "interpret"): (lambda v: isinstance(v, bool), "true or false"),
    ("", "provenance"): (lambda v: isinstance(v, Mapping), "an object"),
}


def _check_metadata(path: str, gpu: Mapping, data: Mapping) -> None:
    for (where, name), (ok, expected) in _METADATA_RULES.items():
        section = gpu if where == "gpu" else data
        if name in section and not ok(section[name]):
            field = f"{where}.{name}" if where else name
            _fail(path, f"{field}={section[name]!r} must be {expected}")


def read_table(path: str) -> Table:
    """Read and validate the table at `path` afresh (no cache: e.g. a report right after `emit`); every error is
    a TableError naming the file: unreadable, not JSON, or not a valid table."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise TableError(f"heuristic table {path}: cannot be read ({err.strerror or err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise TableError(f"heuristic table {path}: not valid JSON ({err})") from None
    return parse_table(data, path)


def parse_table(data: Any, path: str = "<table>") -> Table:
    """Validate a table's JSON object and build the `Table`; every error names `path` and the problem."""
    if not isinstance(data, Mapping):
        _fail(path, "is not a JSON object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        _fail(path, f"schema_version is {version!r}, this normtune reads {SCHEMA_VERSION}: re-emit it with "
                    "`normtune emit` from this version")
    gpu = data.get("gpu")
    if not isinstance(gpu, Mapping) or not isinstance(gpu.get("name"), str):
        _fail(path, "has no gpu.name (the GPU it was tuned on)")
    _check_metadata(path, gpu, data)
    fams = data.get("families")
    if not isinstance(fams, Mapping) or not fams:
        _fail(path, "has no families (rules per norm/dtype/flags)")
    families: dict[str, tuple[Rule, ...]] = {}
    fitted: dict[str, tuple[int, int, int, int]] = {}
    aligned: set[str] = set()
    for key, fam in fams.items():
        try:
            family = ProblemFamily.from_key(key)
        except ConfigError as err:
            _fail(path, f"family {key!r}: {err}")
        rules_data = fam.get("rules") if isinstance(fam, Mapping) else None
        if not isinstance(rules_data, list) or not rules_data:
            _fail(path, f"family {key!r} has no rules")
        rules = []
        for i, r in enumerate(rules_data):
            where = f"family {key!r} rule {i}"
            if not isinstance(r, Mapping):
                _fail(path, f"{where} is not an object")
            n_max, m_max = r.get("n_max"), r.get("m_max")
            for name, v in (("n_max", n_max), ("m_max", m_max)):
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                    _fail(path, f"{where}: {name}={v!r} must be a positive integer or null")
            fitted_on = r.get("fitted_on") if isinstance(r.get("fitted_on"), list) else []
            try:
                cfg = BackwardConfig.from_dict(r.get("config"))
                # The rule's config must run the shapes it was fitted on (without them, its own bounds); other
                # shapes in its bounds get it through `adapt` (a 3-slice split of 12288 runs 14188 in 4 slices).
                shapes = fitted_shapes([r]) or [(m_max or 1, n_max or next_power_of_two(cfg.kernel_1.block_col))]
                for m, n in shapes:
                    cfg.validate(family.problem(m, n))
            except (ConfigError, TypeError) as err:
                _fail(path, f"{where}: {err}")
            rules.append(Rule(n_max, m_max, cfg, tuple(map(str, fitted_on))))
        families[key] = tuple(rules)
        if (shapes := fitted_shapes(rules_data)) is not None:
            ms, ns = [m for m, _ in shapes], [n for _, n in shapes]
            fitted[key] = (min(ms), max(ms), min(ns), max(ns))
            if all(n % ALIGNED_WIDTH == 0 for n in ns):
                aligned.add(key)
    return Table(path=path, gpu_name=gpu["name"], gpu_key=gpu.get("key") or gpu_key(gpu["name"]),
                 compute_capability=gpu.get("compute_capability"), sm_count=gpu.get("sm_count"),
                 interpret=bool(data.get("interpret", False)), families=families, raw=dict(data), fitted=fitted,
                 aligned_only=frozenset(aligned))


@functools.lru_cache(maxsize=None)
def load_table(path: str) -> Table:
    """`read_table`, once per path (the runtime's tables do not change while it runs)."""
    return read_table(path)


@functools.lru_cache(maxsize=None)
def shipped_tables() -> tuple[Table, ...]:
    """Every table shipped in normtune.configs (the wheel's package data)."""
    out = []
    for entry in sorted(resources.files("normtune.configs").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            with resources.as_file(entry) as p:
                out.append(load_table(str(p)))
    return tuple(out)
