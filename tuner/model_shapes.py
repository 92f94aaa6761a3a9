"""The norms of a model, read from its Hugging Face `config.json` (plain JSON), as tuning problems for `--shapes-from`.

What a config gives (multimodal configs: the language model's nested `text_config`; a vision tower's norms are
not read):

- `hidden_size` (GPT-2: `n_embd`): every decoder layer's input and post-attention norms and the final norm, one
  row per token;
- per-head q/k norms over `head_dim` (else hidden_size / num_attention_heads), q on tokens × num_attention_heads
  rows and k on tokens × num_key_value_heads rows: Qwen3 (dense, MoE, Next, VL, 3.5), Gemma 3 and 3n,
  Chameleon, or any config with a true `qk_norm`, `use_qk_norm` (GLM-4 MoE, Cohere, Llama 4 — whose q/k norm has
  no weight) or `qk_layernorm` (Phi, StableLM, Persimmon);
- q/k norms over the whole projection (OLMo 2, OLMo 3, OLMoE): num_attention_heads × head_dim and
  num_key_value_heads × head_dim, one row per token;
- MLA (DeepSeek-V2/V3, Kimi-K2): the norms over `q_lora_rank` (when set) and `kv_lora_rank`, one row per token.

The norm kind: RMSNorm where the config has `rms_norm_eps` (or `"rms_norm": true`), LayerNorm where it has
`layer_norm_eps` or `layer_norm_epsilon` (GPT-2, GPT-NeoX, Phi, Falcon, …), else RMSNorm for the llama, mistral,
qwen, gemma and deepseek families. Gemma, Gemma 2, Gemma 3 and Qwen3-Next norms are zero-centered (w = 1 + w').
The activation dtype is the config's `torch_dtype` or `dtype` (bf16 when it has neither). LayerNorm problems have
a bias unless the command says `--no-bias`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from normtune.kernels.config import Problem
from normtune.kernels.problem import canonical_dtype

PER_HEAD_QK = {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_5_text",
               "qwen3_5_moe_text", "gemma3", "gemma3_text", "gemma3n_text", "chameleon"}
QK_KEYS = ("qk_norm", "use_qk_norm", "qk_layernorm")
WHOLE_QK = {"olmo2", "olmo3", "olmoe"}
WEIGHTLESS_QK = {"llama4", "llama4_text"}  # L2 norm of each head: an RMSNorm without a weight
ZERO_CENTERED = {"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next"}
RMS_FAMILIES = ("llama", "mistral", "mixtral", "qwen", "gemma", "deepseek")
# Values some saved configs omit, as transformers fills them in (Gemma 3's multimodal configs often leave the
# text model's attention shape out).
OMITTED = {"gemma3_text": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}}
DEFAULT_TOKENS = (4096, 16384)


@dataclass(frozen=True)
class ModelNorm:
    """One norm of the model: its name, the width N it normalizes and how many rows each token gives it."""

    name: str
    N: int
    rows_per_token: int = 1
    has_weight: bool = True

    def describe(self) -> str:
        rows = f" ×{self.rows_per_token} rows/token" if self.rows_per_token > 1 else ""
        return f"{self.name} {self.N}{rows}" + ("" if self.has_weight else " (no weight)")


@dataclass(frozen=True)
class ModelShapes:
    """What a config.json says about the model's norms."""

    path: str
    model_type: str
    norm: str | None  # rms_norm | layer_norm; None when the config does not tell
    zero_centered: bool
    dtype: str | None  # the config's torch_dtype/dtype as written; None when it has neither
    norms: tuple[ModelNorm, ...]

    def activation_dtype(self) -> str:
        if self.dtype is None:
            return "bf16"
        try:
            return canonical_dtype(self.dtype)
        except TypeError:
            raise ValueError(f"{self.path}: dtype {self.dtype!r} is not an activation dtype normtune runs "
                             "(float32, bfloat16, float16): pass --dtype") from None

    def problems(self, tokens, *, norms: list[str] | None = None, dtype: str | None = None,
                 weight_dtype: str | None = None, bias: bool | None = None, zero_centered: bool | None = None,
                 save: str = "input") -> list[Problem]:
        """Every norm × every token count; `norms`, `dtype`, `zero_centered` given: they replace the model's."""
        kinds = norms or [self.norm]
        if kinds == [None]:
            raise ValueError(f"{self.path}: the config names no norm epsilon (rms_norm_eps, layer_norm_eps or "
                             "layer_norm_epsilon) to tell the norm kind: pass --norm rms_norm or --norm layer_norm")
        dt = dtype or self.activation_dtype()
        zc = self.zero_centered if zero_centered is None else zero_centered
        out: list[Problem] = []
        for kind in kinds:
            has_bias = (kind == "layer_norm") if bias is None else (bias and kind == "layer_norm")
            for n in self.norms:
                for t in tokens:
                    p = Problem(kind, t * n.rows_per_token, n.N, dt, weight_dtype, n.has_weight, has_bias,
                                zc and n.has_weight, save)
                    if p not in out:
                        out.append(p)
        return out

    def describe(self) -> str:
        kind = (self.norm or "norm kind not stated") + (" zero-centered" if self.zero_centered else "")
        return (f"{self.path} ({self.model_type or 'no model_type'}, {kind}, {self.dtype or 'bf16'}): "
                + ", ".join(n.describe() for n in self.norms))


def parse_tokens(text: str) -> list[int]:
    """'4096,16384' → [4096, 16384]: positive token counts."""
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        raise ValueError(f"{text!r}: use a comma list of positive token counts, e.g. 4096,16384")
    return list(dict.fromkeys(tokens))


def _positive(cfg: dict, *keys: str) -> int | None:
    for key in keys:
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def read_config(path: str | Path) -> dict:
    """The JSON object of a config.json, or of the config.json in a folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{path}: the folder holds no config.json; give a model's config.json or its folder")
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; give a model's config.json or the folder holding it") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{p}: not valid JSON ({err}); give a model's config.json") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: not a JSON object; give a model's config.json")
    return data


def _kind(cfg: dict, model_type: str) -> str | None:
    if "rms_norm_eps" in cfg or cfg.get("rms_norm") is True:
        return "rms_norm"
    if "layer_norm_eps" in cfg or "layer_norm_epsilon" in cfg:
        return "layer_norm"
    return "rms_norm" if model_type.startswith(RMS_FAMILIES) else None


def model_shapes(path: str | Path) -> ModelShapes:
    """Read the config at `path` (a config.json or its folder); every error is a ValueError naming it and the fix."""
    outer = read_config(path)
    cfg = outer.get("text_config") if isinstance(outer.get("text_config"), dict) else outer
    model_type = str(cfg.get("model_type") or outer.get("model_type") or "")
    cfg = {**OMITTED.get(model_type, {}), **cfg}
    hidden = _positive(cfg, "hidden_size", "n_embd", "d_model")
    if hidden is None:
        raise ValueError(f"{path}: no hidden_size (nor n_embd, d_model) in the config "
                         f"({model_type or 'no model_type'}): give the config.json of a transformer language model")
    norms = [ModelNorm("hidden", hidden)]
    heads = _positive(cfg, "num_attention_heads", "n_head", "num_heads")
    kv_heads = _positive(cfg, "num_key_value_heads", "num_kv_heads") or heads
    per_head = model_type in PER_HEAD_QK or any(cfg.get(k) is True for k in QK_KEYS)
    if per_head or model_type in WHOLE_QK:
        head_dim = _positive(cfg, "head_dim") or (hidden // heads if heads else None)
        if head_dim is None or heads is None:
            raise ValueError(f"{path}: the model has q/k norms but the config gives neither head_dim nor "
                             "num_attention_heads; give the model's complete config.json")
        if model_type in WHOLE_QK:
            norms += [ModelNorm("q_norm", heads * head_dim), ModelNorm("k_norm", kv_heads * head_dim)]
        else:
            weight = model_type not in WEIGHTLESS_QK
            norms += [ModelNorm("q_norm", head_dim, heads, weight), ModelNorm("k_norm", head_dim, kv_heads, weight)]
    if (q_rank := _positive(cfg, "q_lora_rank")) is not None:
        norms.append(ModelNorm("q_a_layernorm", q_rank))
    if (kv_rank := _positive(cfg, "kv_lora_rank")) is not None:
        norms.append(ModelNorm("kv_a_layernorm", kv_rank))
    dtype = outer.get("torch_dtype") or outer.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
    return ModelShapes(str(path), model_type, _kind(cfg, model_type), model_type in ZERO_CENTERED,
                       str(dtype) if dtype else None, tuple(norms))
