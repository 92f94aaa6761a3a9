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
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .adapt import STAND_IN_DTYPES, adapt, carried_over, holds_rows  # noqa: F401 - re-exported for table users
from ..strategies.capabilities import checked
from ..config import BackwardConfig, ConfigError, Problem, ProblemFamily
from ..heuristics import next_power_of_two
from ..limits import DeviceLimits
from ..device import gpu_key

SCHEMA_VERSION = 1
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
        tuned one, else the dtype's stand-in (`STAND_IN_DTYPES`), then the same gate position (a sigmoid-gated
        family without rules of its own reads the silu-gated family's of its gate position: the same passes over
        the same tensors, another element-wise function), then most flags equal (a residual family without rules
        of its own reads those of another stream dtype's residual family, else the plain family's: the same knobs
        run it); None when there is none."""
        if family.key in self.families:
            return family.key
        best, best_score = None, (-1, False, -1)
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
            score = (same_dtype, other.gate == family.gate, sum(getattr(other, f) == getattr(family, f)
                                     for f in ("weight_dtype", "has_weight", "has_bias", "zero_centered", "save",
                                               "residual", "residual_dtype", "gate_activation")))
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
        """False for a row width that is not a multiple of ALIGNED_WIDTH when every fitted width was one: the
        rules were never measured on such rows, and do not carry over to them reliably. bf16 rows of 3000 columns
        move in 16-byte vectors as the fitted ones do (the kernels assume the multiple of 8: `alignment_hint`), yet
        the rule of the nearest multiple of 16 can run slower than the analytic default there
        (`docs/experiments/unaligned_rows.py`; docs/kernel-figures.md, "Unaligned widths")."""
        return problem.N % ALIGNED_WIDTH == 0 or self.family_key(problem.family) not in self.aligned_only

    def match(self, problem: Problem, limits: DeviceLimits | None = None) -> "RuleMatch":
        """Which rule answers `problem` and with what config (None: no rule applies — no family of this norm and
        dtype, or outside the box of shapes the family was fitted on: the table does not extrapolate, as rules
        carried past their box ran slower than the analytic default; docs/kernel-figures.md, "Outside the box")."""
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
            config, why = carried_over(config, stand_in, problem)
            if config is None:
                return RuleMatch(key, False, box, index, rule, past, None, f"{why} → the analytic default")
        return RuleMatch(key, key == problem.family.key, box, index, rule, past,
                         adapt(config, problem, self.sm_count, limits))

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


# ------------------------------------------------------------------------------------------- loading


def _fail(path: str, message: str):
    raise TableError(f"heuristic table {path}: {message}")


# A fitted shape as a table records it: "MxN", both positive integers without sign or leading zero.
_SHAPE = re.compile(r"[1-9][0-9]*x[1-9][0-9]*")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


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


def read_json(path: str) -> Any:
    """The JSON value of the table file at `path`; a TableError naming the file when it cannot be read, is not
    UTF-8, is not JSON, or nests deeper than the parser goes (no table nests more than a few levels)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise TableError(f"heuristic table {path}: cannot be read ({err.strerror or err})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TableError(f"heuristic table {path}: not valid UTF-8 (byte 0x{data[err.start]:02x} at offset "
                         f"{err.start}); a table is the JSON text `normtune emit` writes") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TableError(f"heuristic table {path}: not valid JSON ({err})") from None
    except RecursionError:
        raise TableError(f"heuristic table {path}: its JSON nests too deeply to be a table (a table nests a few "
                         "levels)") from None


def read_table(path: str) -> Table:
    """Read and validate the table at `path` afresh (no cache: e.g. a report right after `emit`); every error is
    a TableError naming the file: unreadable, not UTF-8 JSON, or not a valid table."""
    return parse_table(read_json(path), path)


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
            fitted_on = r.get("fitted_on", [])
            if not isinstance(fitted_on, list) or not all(isinstance(t, str) and _SHAPE.fullmatch(t)
                                                          for t in fitted_on):
                _fail(path, f"{where}: fitted_on={_short(fitted_on)} must be a list of the shapes the rule was "
                            "fitted on, \"MxN\" with positive M and N (e.g. [\"4096x8192\"])")
            try:
                cfg = BackwardConfig.from_dict(r.get("config"))
                # The rule's config must run the shapes it was fitted on (without them, its own bounds); other
                # shapes in its bounds get it through `adapt` (a 3-slice split of 12288 takes 14188 in 4 slices).
                shapes = fitted_shapes([r]) or [(m_max or 1, n_max or next_power_of_two(cfg.kernel_1.block_col))]
                for m, n in shapes:
                    checked(family.problem(m, n), cfg)
            except (ConfigError, TypeError) as err:
                _fail(path, f"{where}: {err}")
            rules.append(Rule(n_max, m_max, cfg, tuple(map(str, fitted_on))))
        _check_rule_order(path, key, rules)
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


def _check_rule_order(path: str, key: str, rules: list[Rule]) -> None:
    """The first matching rule wins, so a rule whose bounds an earlier rule's contain would never be used (a
    duplicate, say, shadowing nothing but itself being shadowed): refused, as are rules out of the order `emit`
    writes (by n_max, then m_max, unbounded last), where a lookup could stop at a wider rule first."""
    def bound(v):
        return float("inf") if v is None else v

    for j, later in enumerate(rules):
        for i, earlier in enumerate(rules[:j]):
            if bound(earlier.n_max) >= bound(later.n_max) and bound(earlier.m_max) >= bound(later.m_max):
                _fail(path, f"family {key!r} rule {j} (n_max {later.n_max}, m_max {later.m_max}) is never used: rule "
                            f"{i} (n_max {earlier.n_max}, m_max {earlier.m_max}) comes first and covers it; remove "
                            "or reorder the rules (emit writes them by n_max, then m_max)")
        if j and (bound(later.n_max), bound(later.m_max)) < (bound(rules[j - 1].n_max), bound(rules[j - 1].m_max)):
            _fail(path, f"family {key!r} rule {j} (n_max {later.n_max}, m_max {later.m_max}) comes after rule {j - 1} "
                        f"(n_max {rules[j - 1].n_max}, m_max {rules[j - 1].m_max}): rules go by n_max, then m_max")


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
