"""Gated RMSNorm problems: their description (`GatedProblem`), the shape sets of the hybrid models that run them,
and the gated norms a hybrid model's Hugging Face `config.json` implies.

Two forms, y = w · rmsnorm(x) · act(z) ("before": the norm before the gate) and y = w · rmsnorm(x · act(z))
("after"), each normalizing `group_size` columns at a time (the whole width by default):

- Qwen3-Next and Qwen3.5 (`Qwen3NextRMSNormGated`, `Qwen3_5RMSNormGated`): norm before gate, per value head of the
  gated delta rule, so rows = tokens × linear_num_value_heads and width = linear_value_head_dim;
- Mamba-2 and its descendants (Bamba, Nemotron-H, GraniteMoeHybrid, Zamba2): norm after gate over d_inner, one
  row per token, in groups of d_inner / n_groups;
- Falcon-H1: the same width and groups, the gate position given by `mamba_norm_before_gate`, only where
  `mamba_rms_norm` is true.

The model dimensions of the shape sets, and where each comes from, are in docs/gated-shapes.md.

A `GatedProblem` is a call as a model makes it (rows × width in groups, for the peers and the bench); the tuner's
problem is what normtune's kernels run for it (`GatedProblem.problem`): the runtime runs each of a call's
groups as a problem of `group_size` columns of the same rows (every group in one launch of each kernel), so a
call of M rows × N columns in groups of g is tuned, selected and timed as the `Problem` of M rows × g columns
with the gate. The presets of `--shapes` (`GATED_PRESETS`) and `--shapes-from` a hybrid model's config give
those problems.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from normtune.kernels.config import Problem
from normtune.kernels.problem import DTYPES, GATE_ACTIVATIONS as ACTIVATIONS, GATE_POSITIONS

from .model_shapes import read_config


@dataclass(frozen=True)
class GatedProblem:
    """One gated RMSNorm problem: M rows of width N, normalized in groups of `group_size` columns (None: N)."""

    M: int
    N: int
    gate_position: str = "before"
    group_size: int | None = None
    dtype: str = "bf16"
    eps: float = 1e-6
    activation: str = "silu"
    zero_centered: bool = False

    def __post_init__(self):
        if self.M < 1 or self.N < 1:
            raise ValueError(f"gated problem {self.M}x{self.N}: need M >= 1 and N >= 1 rows and columns")
        if self.gate_position not in GATE_POSITIONS:
            raise ValueError(f"gate_position {self.gate_position!r}: use one of {', '.join(GATE_POSITIONS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: use one of {', '.join(ACTIVATIONS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.group_size is not None and (self.group_size < 1 or self.N % self.group_size):
            raise ValueError(f"group_size {self.group_size} does not divide the width {self.N}: "
                             "give a divisor of N, or none for the whole width")

    @property
    def group(self) -> int:
        """Columns per group (the whole width when no group size is given)."""
        return self.group_size or self.N

    @property
    def elements(self) -> int:
        return self.M * self.N

    @property
    def problem(self) -> Problem:
        """The kernel problem a call runs (each group: M rows of `group` columns), as the tuner plans it."""
        return Problem("rms_norm", self.M, self.group, self.dtype, gate=self.gate_position,
                       gate_activation=self.activation, zero_centered=self.zero_centered)

    def label(self) -> str:
        group = "" if self.group == self.N else f" g{self.group}"
        return f"{self.gate_position} {self.M}x{self.N}{group} {self.dtype}"


@dataclass(frozen=True)
class GatedModel:
    """The gated norm of one model: width, rows per token, group size and gate position."""

    name: str
    width: int
    rows_per_token: int
    group_size: int
    gate_position: str

    def problems(self, tokens, dtype: str = "bf16") -> list[GatedProblem]:
        return [GatedProblem(t * self.rows_per_token, self.width, self.gate_position,
                             None if self.group_size == self.width else self.group_size, dtype) for t in tokens]


GATED_TOKENS = (2048, 8192, 32768)

# name, width, rows per token, group size, gate position; sources in docs/gated-shapes.md.
QWEN3_NEXT_MODELS = (
    GatedModel("Qwen3-Next-80B-A3B", 128, 32, 128, "before"),
    GatedModel("Qwen3.5-9B", 128, 32, 128, "before"),
    GatedModel("Qwen3.5-27B", 128, 48, 128, "before"),
    GatedModel("Qwen3.5-397B-A17B", 128, 64, 128, "before"),
    GatedModel("head size 256", 256, 32, 256, "before"),
)
MAMBA2_MODELS = (
    GatedModel("Mamba-2 1.3B", 4096, 1, 4096, "after"),
    GatedModel("Mamba-2 2.7B", 5120, 1, 5120, "after"),
    GatedModel("Bamba-9B", 8192, 1, 8192, "after"),
    GatedModel("Nemotron-H-8B", 8192, 1, 1024, "after"),
)

# The issue's eight shapes: (gate position, M, N, group size).
ISSUE_SHAPES = (
    ("before", 32768, 128, 128), ("before", 131072, 128, 128), ("before", 262144, 128, 128),
    ("before", 65536, 256, 256), ("after", 8192, 5120, 5120), ("after", 4096, 8192, 1024),
    ("after", 16384, 4096, 4096), ("after", 8192, 8192, 1024),
)


def _unique(problems) -> list[GatedProblem]:
    return list(dict.fromkeys(problems))


def model_set(models, tokens=GATED_TOKENS, dtype: str = "bf16") -> list[GatedProblem]:
    """Every model × every token count, without repeats (models sharing a shape give one problem)."""
    return _unique(p for m in models for p in m.problems(tokens, dtype))


def issue_set(dtype: str = "bf16") -> list[GatedProblem]:
    return [GatedProblem(M, N, pos, None if g == N else g, dtype) for pos, M, N, g in ISSUE_SHAPES]


def tiny_set(dtype: str = "fp32") -> list[GatedProblem]:
    """Small problems of every form, for CPU checks."""
    return [GatedProblem(24, 64, "before", None, dtype), GatedProblem(16, 96, "after", 32, dtype),
            GatedProblem(8, 128, "after", None, dtype)]


GATED_SETS = {
    "issue": issue_set,
    "qwen3-next": lambda dtype="bf16": model_set(QWEN3_NEXT_MODELS, dtype=dtype),
    "mamba2": lambda dtype="bf16": model_set(MAMBA2_MODELS, dtype=dtype),
    "tiny": tiny_set,
}


# The `--shapes` presets of gated problems, by set name.
GATED_PRESETS = {"qwen3-next": "qwen3-next", "mamba2": "mamba2", "gated-issue": "issue", "gated-tiny": "tiny"}


def kernel_problems(calls) -> list[Problem]:
    """The kernel problems of gated calls (`GatedProblem.problem`), in order, without repeats."""
    return list(dict.fromkeys(c.problem for c in calls))


def preset_problems(name: str, dtype: str = "bf16") -> list[Problem]:
    """The kernel problems of a gated `--shapes` preset (`GATED_PRESETS`)."""
    if name not in GATED_PRESETS:
        raise ValueError(f"unknown gated preset {name!r} (allowed: {', '.join(GATED_PRESETS)})")
    return kernel_problems(gated_set([GATED_PRESETS[name]], dtype))


def gated_set(names, dtype: str = "bf16") -> list[GatedProblem]:
    """The union of named sets (issue, qwen3-next, mamba2, tiny), in order, without repeats."""
    out = []
    for name in names:
        if name not in GATED_SETS:
            raise ValueError(f"unknown gated shape set {name!r} (allowed: {', '.join(GATED_SETS)})")
        out += GATED_SETS[name](dtype=dtype)
    return _unique(out)


# ------------------------------------------------------------------------------------------ model configs


def _int(cfg: dict, *keys: str) -> int | None:
    for key in keys:
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _mamba_norm(cfg: dict, model_type: str, source: str) -> GatedModel | None:
    """The Mamba-2 mixer's gated norm: width d_inner, group d_inner / n_groups."""
    heads = _int(cfg, "mamba_num_heads", "mamba_n_heads")
    head_dim = _int(cfg, "mamba_head_dim", "mamba_d_head")
    hidden = _int(cfg, "hidden_size", "d_model")
    expand = _int(cfg, "mamba_expand", "expand")
    if model_type == "nemotron_h" and heads and head_dim:
        width = heads * head_dim
    elif _int(cfg, "mamba_d_ssm"):
        width = _int(cfg, "mamba_d_ssm")
    elif hidden and expand:
        width = hidden * expand
    elif heads and head_dim:
        width = heads * head_dim
    else:
        return None
    groups = _int(cfg, "mamba_n_groups", "n_groups", "mamba_ngroups") or 1
    if width % groups:
        raise ValueError(f"{source}: n_groups {groups} does not divide the mixer width {width}; "
                         "give the model's complete config.json")
    position = "after"
    if model_type == "falcon_h1":
        if cfg.get("mamba_rms_norm") is not True:
            return None
        position = "before" if cfg.get("mamba_norm_before_gate", True) else "after"
    return GatedModel(model_type or "mamba", width, 1, width // groups, position)


def gated_norms(config: dict, source: str = "config") -> list[GatedModel]:
    """The gated RMSNorms a model config (a config.json's object, as transformers writes it) implies; [] when the
    model has none. A multimodal config's `text_config` is read."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    out = []
    v_heads, v_dim = _int(cfg, "linear_num_value_heads"), _int(cfg, "linear_value_head_dim")
    if v_heads and v_dim:
        out.append(GatedModel(model_type or "linear attention", v_dim, v_heads, v_dim, "before"))
    mamba_keys = ("mamba_n_heads", "mamba_num_heads", "mamba_d_head", "mamba_head_dim", "mamba_expand")
    if model_type in ("mamba2", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "zamba2") or \
            any(k in cfg for k in mamba_keys):
        norm = _mamba_norm(cfg, model_type, source)
        if norm is not None:
            out.append(norm)
    return out


def config_problems(config: dict, tokens, dtype: str, source: str = "config") -> list[Problem]:
    """The kernel problems of a config's gated norms at each token count; [] for a model without one."""
    return kernel_problems(p for n in gated_norms(config, source) for p in n.problems(tokens, dtype))


def gated_problems_from_config(path: str | Path, tokens=GATED_TOKENS, dtype: str = "bf16") -> list[GatedProblem]:
    """The gated problems of the model whose config.json (or folder) is at `path`, at each token count."""
    norms = gated_norms(read_config(path), str(path))
    if not norms:
        raise ValueError(f"{path}: the config describes no gated RMSNorm (no linear_num_value_heads/"
                         "linear_value_head_dim, no Mamba-2 mixer): give a hybrid model's config.json")
    return _unique(p for n in norms for p in n.problems(tokens, dtype))
