"""Training-step time of two hybrid models from transformers (a Qwen3.5 or Qwen3-Next and a Mamba-2), whose mixers
run through gated RMSNorms, under each way of running their norms, with each kind of norm's share of the step.

    python3 docs/experiments/train_step_hybrid.py OUT_DIR [--models qwen,mamba2] [--layers 4] [--seq 4096]
                                                  [--rounds 20] [--variants unpatched,normtune,fla-norm,compile]
    python3 docs/experiments/train_step_hybrid.py OUT_DIR --tiny     # CPU check: tiny configs, 32 tokens

Models (bf16 weights, AdamW, batch 1 × --seq tokens, vocab 32000 so that the layers and not the output head
carry the step):
- `qwen`: `Qwen3_5ForCausalLM` (else `Qwen3NextForCausalLM` with dense MLPs) shaped like Qwen3.5-9B's layers:
  hidden 4096, MLP 12288, three gated-delta-rule layers to one attention layer; the gated norm is applied per value
  head (tokens × 32 rows of 128, the norm before the gate: w·norm(x)·silu(z)); its plain norms are
  zero-centred RMSNorms. The gated delta rule runs flash-linear-attention's kernels where it is installed (the
  fast path), else transformers' torch path. flash-linear-attention 0.6.0 refuses that backward on Hopper with
  Triton 3.4–3.7.0 (every variant but `compile` then fails on its RuntimeError): pass --torch-mixers there.
- `mamba2`: `Mamba2ForCausalLM` shaped like Mamba-Codestral's layers: hidden 4096, d_inner 8192 in 8 groups,
  norm after the gate (w·norm(x·silu(z)), per group where the installed transformers takes a group size). Its
  scan runs transformers' torch path unless mamba_ssm is installed.

Variants: `unpatched` (as transformers builds it); `normtune` (`normtune.patch(model)`: the gated and the plain
norms); `normtune-gated` (the gated norms only, as `patch` replaces them; the plain norms as transformers has
them); `fla-norm` (the gated norms replaced by flash-linear-attention's: `rms_norm_gated` for a norm before the
gate over the whole head, `layernorm_gated.rmsnorm_fn` otherwise; the plain norms as transformers has them);
`compile` (`torch.compile(model)`).

Same initial weights and batch for every variant of a model. The variants take their steps in turns (one step
each per round), each timed between CUDA events after a synchronize; the median over the rounds is reported, with
p10/p90. One profiled step per variant gives the device time of the replaced norms against the step's kernel
total, by their kernels' names: normtune's (`normtune`: the gated and the plain norms together; `normtune-gated`:
the gated norms), flash-linear-attention's (`fla-norm`: the gated norms). transformers' eager norms run
as generic elementwise kernels that no name tells apart, and torch.compile fuses them into other kernels: n/a.
`grad rel. err.` is the largest relative error of any parameter's gradient against the unpatched model's, in bf16.
Writes OUT_DIR/train_step_hybrid.md and .json. --tiny runs on CPU (the Triton interpreter; the models' mixers on
transformers' torch paths) and checks the variants' losses and gradients agree; its times are host wall-clock.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step as plain_step  # noqa: E402 - the Llama script's step, timing and gradient helpers

MODELS = ("qwen", "mamba2")
VARIANTS = ("unpatched", "normtune", "normtune-gated", "fla-norm", "compile")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    p.add_argument("--torch-mixers", action="store_true",
                   help="run the mixers (the gated delta rule, the scan) on transformers' torch paths even where "
                        "flash-linear-attention is installed (its norms stay available to fla-norm)")
    p.add_argument("--tiny", action="store_true", help="CPU (Triton interpreter), tiny configs, 32 tokens")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name, given, allowed in (("--models", args.models, MODELS), ("--variants", args.variants, VARIANTS)):
        unknown = [v for v in given if v not in allowed]
        if unknown:
            p.error(f"{name}: unknown {', '.join(unknown)} (allowed: {', '.join(allowed)})")
    if "unpatched" not in args.variants:
        p.error("--variants: unpatched is the reference of the gradient check; keep it in the list")
    if args.tiny:
        args.seq, args.rounds, args.torch_mixers = 32, min(args.rounds, 2), True
    return args


def _qwen_config(args):
    import transformers

    linear = ["linear_attention"] * 3 + ["full_attention"]
    layer_types = [linear[i % 4] for i in range(args.layers)]
    if args.tiny:
        dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4)
    else:
        dims = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                    linear_num_value_heads=32)
    common = dict(num_hidden_layers=args.layers, vocab_size=128 if args.tiny else 32000, layer_types=layer_types,
                  max_position_embeddings=max(args.seq, 64), rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
                  tie_word_embeddings=False, **dims)
    if hasattr(transformers, "Qwen3_5ForCausalLM") and hasattr(transformers, "Qwen3_5TextConfig"):
        return transformers.Qwen3_5TextConfig(**common), transformers.Qwen3_5ForCausalLM
    if hasattr(transformers, "Qwen3NextForCausalLM"):  # dense MLPs in every layer (no experts)
        config = transformers.Qwen3NextConfig(full_attention_interval=4, mlp_only_layers=list(range(args.layers)),
                                              **common)
        return config, transformers.Qwen3NextForCausalLM
    raise SystemExit(f"transformers {transformers.__version__} has neither Qwen3.5 nor Qwen3-Next: "
                     "pip install 'transformers>=4.57'")


def _mamba2_config(args):
    import transformers

    if not hasattr(transformers, "Mamba2ForCausalLM"):
        raise SystemExit(f"transformers {transformers.__version__} has no Mamba-2: pip install 'transformers>=4.44'")
    if args.tiny:
        dims = dict(hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=16)
    else:
        # chunks of 64: transformers' torch scan holds tensors of tokens × chunk × heads × state (64 GiB at 4096
        # tokens in chunks of 256)
        dims = dict(hidden_size=4096, num_heads=128, head_dim=64, state_size=128, n_groups=8, chunk_size=64)
    config = transformers.Mamba2Config(num_hidden_layers=args.layers, vocab_size=128 if args.tiny else 32000,
                                       expand=2, layer_norm_epsilon=1e-5, tie_word_embeddings=False, **dims)
    return config, transformers.Mamba2ForCausalLM


def build(name: str, args, device, dtype):
    import torch

    config, cls = (_qwen_config if name == "qwen" else _mamba2_config)(args)
    if name == "qwen":  # its attention layers (Mamba-2 has none)
        config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # norm weights off their init, so that a wrong weight would show in the loss
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.1 * torch.randn(p.shape))
    return config, model.to(device=device, dtype=dtype)


def fla_gated_norm(original, plan, functions):
    """A module standing in for the gated norm `original`: flash-linear-attention's function on its weight."""
    import math

    import torch

    from normtune.kernels.patching.patch_gated import KEPT_ATTRIBUTES

    width = math.prod(plan.shape)
    before_whole = plan.position == "before" and plan.group == width and plan.activation == "silu"
    gated_fn, group_fn = functions

    class FlaGatedNorm(torch.nn.Module):
        def forward(self, x, gate=None):
            rows, z = x.reshape(-1, width), None if gate is None else gate.reshape(-1, width)
            if before_whole and z is not None:
                y = gated_fn(rows, z, self.weight, None, activation="swish", eps=plan.eps)
            else:
                y = group_fn(rows, self.weight, None, z=z, eps=plan.eps, group_size=plan.group,
                             norm_before_gate=plan.position == "before")
            return y.view(x.shape)

    new = FlaGatedNorm()
    new.weight = original.weight  # the same Parameter
    for attr in (*KEPT_ATTRIBUTES, "group_size"):  # what the model's own code may read off its norm
        if attr in vars(original):
            setattr(new, attr, vars(original)[attr])
    return new.train(original.training)


def fla_functions():
    """flash-linear-attention's two gated-norm functions, imported now."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm_gated import rmsnorm_fn

    return rms_norm_gated, rmsnorm_fn


def gated_plans(model) -> dict:
    """{module path: normtune's plan} for each gated norm `normtune.patch` finds in `model` (patching a copy)."""
    import normtune
    from normtune.kernels.api.modules import GatedRMSNorm
    from normtune.kernels.patching.patch_gated import GatedPlan

    probe = copy.deepcopy(model)
    normtune.patch(probe)
    plans = {}
    for path, module in probe.named_modules():
        if isinstance(module, GatedRMSNorm):
            width = module.weight.numel()
            plans[path] = GatedPlan(tuple(module.weight.shape), float(module.eps), "eps", module.gate_position,
                                    module.activation, module.group_size or width)
    del probe
    return plans


def _swap_gated(model, plans: dict, make) -> None:
    """Replace each gated norm of `model` at the paths of `plans` by `make(original, plan)`."""
    modules = dict(model.named_modules())
    for path, plan in plans.items():
        parent_path, _, attr = path.rpartition(".")
        setattr(modules[parent_path] if parent_path else model, attr, make(modules[path], plan))


def make_variant(name, base, functions):
    """(model, note) for one variant, or (None, why) where it cannot run here."""
    import torch

    import normtune
    from normtune.kernels.patching import patch_gated

    model = copy.deepcopy(base)
    if name == "unpatched":
        kinds = sorted({type(m).__name__ for m in model.modules() if "norm" in type(m).__name__.lower()})
        return model, "transformers' norms: " + ", ".join(kinds)
    if name == "normtune":
        return model, str(normtune.patch(model)).replace("\n", "; ")
    if name == "compile":
        return torch.compile(model), "torch.compile(model)"
    plans = gated_plans(model)
    if not plans:
        return None, "no gated norm found"
    kinds = "; ".join(sorted({p.describe() for p in plans.values()}))
    if name == "normtune-gated":  # as patch() builds them, on the original weights
        _swap_gated(model, plans, lambda original, plan: patch_gated.build(original, plan, None))
        return model, f"{len(plans)} gated norms on normtune ({kinds}), the plain norms transformers'"
    if functions is None:
        return None, "unavailable: flash-linear-attention is not installed (pip install flash-linear-attention)"
    _swap_gated(model, plans, lambda original, plan: fla_gated_norm(original, plan, functions))
    return model, f"{len(plans)} gated norms on flash-linear-attention ({kinds}), the plain norms transformers'"


def norm_share(variant, model, opt, batch, cuda, ours: set[str]) -> dict:
    """Device time of the replaced norms' kernels in one profiled step, and the step's kernel total."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        return {"kernel_total_ms": None, "norm_ms": None}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        plain_step.step(model, opt, batch)
        torch.cuda.synchronize()
    total = norm = 0.0
    for evt in prof.key_averages():
        t = float(getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0) or 0.0)
        total += t
        if variant in ("normtune", "normtune-gated") and evt.key in ours:
            norm += t
        elif variant == "fla-norm" and "layer_norm" in evt.key.lower():
            norm += t
    known = variant in ("normtune", "normtune-gated", "fla-norm")
    return {"kernel_total_ms": total / 1e3, "norm_ms": norm / 1e3 if known else None}


def run_model(name, args, device, dtype, cuda, functions) -> dict:
    import torch

    ours = plain_step.normtune_kernel_names() if cuda else set()
    config, base = build(name, args, device, dtype)
    model_class = type(base).__name__
    g = torch.Generator(device=device).manual_seed(1)
    batch = torch.randint(0, config.vocab_size, (1, args.seq), device=device, generator=g)
    models, notes = {}, {}
    for variant in args.variants:
        try:
            model, notes[variant] = make_variant(variant, base, functions)
        except Exception as err:  # noqa: BLE001 - a variant that cannot be built is reported, the others run
            model, notes[variant] = None, f"failed: {type(err).__name__}: {str(err)[:300]}"
        if model is not None:
            models[variant] = model
    del base
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=cuda) for k, m in models.items()}
    checks, reference = {}, None
    for k in list(models):  # the same weights: the first loss and gradients; then warm-up steps
        try:
            checks[k] = plain_step.grads_of(models[k], batch)
            for _ in range(2):
                plain_step.step(models[k], opts[k], batch)
        except Exception as err:  # noqa: BLE001 - e.g. a compile that fails: reported, the others run
            notes[k] += f"; failed: {type(err).__name__}: {str(err)[:300]}"
            del models[k], opts[k]
            checks.pop(k, None)
    reference = checks.get("unpatched")
    times = {k: [] for k in models}
    for _ in range(args.rounds):
        for k, m in models.items():
            times[k].append(plain_step.timed_step(m, opts[k], batch, cuda))
    rows = {}
    for k, m in models.items():
        loss, grads = checks[k]
        row = {"median_ms": statistics.median(times[k]), "p10_ms": plain_step._q(times[k], 0.1),
               "p90_ms": plain_step._q(times[k], 0.9), "first_loss": loss}
        if reference is not None:
            row["grad_rel_err"] = max(((grads[n] - r).norm() / max(r.norm(), 1e-30)).item()
                                      for n, r in reference[1].items() if n in grads)
        row.update(norm_share(k, m, opts[k], batch, cuda, ours))
        rows[k] = row
    del models, opts
    if cuda:
        torch.cuda.empty_cache()
    return {"class": model_class, "config": config.to_diff_dict(), "notes": notes, "results": rows}


def main(argv=None) -> int:
    args = parse(argv)
    cuda, device, dtype = plain_step.setup(args.tiny, "train_step_hybrid.py")
    functions = None
    if "fla-norm" in args.variants:
        try:
            functions = fla_functions()
        except Exception:  # noqa: BLE001 - reported as the variant's note
            functions = None
    if args.tiny:
        from normtune.tuner.measure.peers_gated import first_config_autotune

        first_config_autotune()  # flash-linear-attention's kernels are autotuned; the interpreter cannot time
    if args.torch_mixers:
        # transformers picks a mixer kernel from an importable flash-linear-attention when it imports a model: made
        # unimportable, the mixers take the torch paths. Its norm functions are imported already (fla-norm keeps
        # them).
        for module in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            sys.modules[module] = None
        sys.modules["fla"] = None

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {name: run_model(name, args, device, dtype, cuda, functions) for name in args.models}
    write(out, args, results, cuda)
    if args.tiny:
        bad = {f"{m}/{k}": r.get("grad_rel_err") for m, res in results.items() for k, r in res["results"].items()
               if (r.get("grad_rel_err") or 0) > 1e-3}
        if bad:
            sys.exit(f"--tiny: gradients differ from the unpatched model's: {bad}")
    return 0


def write(out: Path, args, results: dict, cuda: bool) -> None:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter, --tiny)"
    info = {"gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__, "seq": args.seq,
            "mixers": "transformers' torch paths" if args.torch_mixers else "as transformers picks them",
            "batch": 1, "dtype": "bf16" if cuda else "fp32", "optimizer": "AdamW(lr=1e-5)", "rounds": args.rounds,
            "models": results}
    (out / "train_step_hybrid.json").write_text(json.dumps(info, indent=2, default=str) + "\n")

    def f(v, fmt="{:.2f}"):
        return fmt.format(v) if v is not None else "n/a"

    lines = [f"# Training step of two hybrid models, 1 × {args.seq} tokens, {info['dtype']}, AdamW", "",
             f"Device: {gpu}; torch {torch.__version__}; transformers {transformers.__version__}. Median of "
             f"{args.rounds} steps per variant, taken in turns; mixers: {info['mixers']}; the replaced norms' "
             "share = their kernels' device time in one profiled step ÷ all kernels of that step.", ""]
    for name, res in results.items():
        rows = res["results"]
        base = rows.get("unpatched", {}).get("median_ms")
        lines += [f"## {res['class']} ({args.layers} layers)", "",
                  "| variant | step ms (median) | p10 | p90 | vs unpatched | replaced norms' kernels ms | share "
                  "| first loss | grad rel. err. vs unpatched |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for k, r in rows.items():
            total, norm = r["kernel_total_ms"], r["norm_ms"]
            share = f(norm / total * 100 if norm is not None and total else None, "{:.1f} %")
            speed = f"{base / r['median_ms']:.3f}×" if base else "n/a"
            lines.append(f"| {k} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | {r['p90_ms']:.2f} | {speed} | "
                         f"{f(norm)} | {share} | {r['first_loss']:.4f} | {f(r.get('grad_rel_err'), '{:.1e}')} |")
        lines += ["", "Variants: " + "; ".join(f"{k}: {v}" for k, v in res["notes"].items()), "",
                  "Model config: `" + json.dumps(res["config"], default=str) + "`", ""]
    (out / "train_step_hybrid.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
