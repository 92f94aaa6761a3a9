"""Training-step time of a real model definition (transformers' Llama) under each way of running its norms and
residual adds, and the norm kernels' share of the step.

    python3 docs/experiments/train_step.py OUT_DIR [--layers 4] [--hidden 4096] [--seq 4096] [--rounds 20]
                                           [--variants unpatched,normtune,...]
    python3 docs/experiments/train_step.py OUT_DIR --tiny     # CPU check: 2 layers of hidden 64, 32 tokens

Variants: `unpatched`; `normtune` (`normtune.patch(model)`: the norms only); `normtune-residual`
(`normtune.patch(model, fuse_residual=True)`: the residual adds fused into the norms too); `liger-rms-norm`
(`apply_liger_kernel_to_llama(rms_norm=True)` only); `liger` (`apply_liger_kernel_to_llama` with every option it
offers: cross_entropy off, since fused_linear_cross_entropy replaces it); `compile` (`torch.compile(model)`).

Same initial weights and batch for every variant; bf16 weights, AdamW. The variants take their steps in turns
(one step each per round), each step timed between CUDA events after a synchronize; the median over the rounds
is reported, with p10/p90. `liger` patches transformers' Llama module and classes for every model (its rope, its
cross entropy forward), so it is timed after the others, on its own. One profiled step per variant gives the device
time of its norm kernels against the step's kernel total: normtune's kernels by name, any kernel named like an
RMSNorm/LayerNorm (Liger's, torch's), and inductor's fused kernels computing an rsqrt (torch.compile's norms,
with the adds it fused into them). The unpatched model's RMSNorm runs as generic elementwise kernels that no name
tells apart: n/a. `first loss` checks that every variant computes the same model. Writes OUT_DIR/train_step.md
and train_step.json. --tiny runs on CPU (the Triton interpreter) and checks the variants' losses and gradients
agree; its times are host wall-clock.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

ALL = ("unpatched", "normtune", "normtune-residual", "liger-rms-norm", "liger", "compile")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--variants", default=",".join(ALL), help="comma list of " + ", ".join(ALL))
    p.add_argument("--tiny", action="store_true", help="CPU (Triton interpreter), 2 layers of hidden 64")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in ALL]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (allowed: {', '.join(ALL)})")
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.vocab, args.seq = 2, 64, 128, 128, 32
        args.rounds = min(args.rounds, 3)
    return args


def build(args, device, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, args.hidden // 128) if not args.tiny else 4
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=min(8, heads), vocab_size=args.vocab,
                         max_position_embeddings=args.seq, rms_norm_eps=1e-5, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norm weights off their init of ones, so that a wrong weight would show in the loss
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape))
    return config, model.to(device=device, dtype=dtype)


def liger_options():
    """Every option of apply_liger_kernel_to_llama switched on, cross_entropy off (fused_linear_cross_entropy
    replaces it; Liger refuses both)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    flags = {name: True for name, p in inspect.signature(apply_liger_kernel_to_llama).parameters.items()
             if isinstance(p.default, bool)}
    if flags.get("fused_linear_cross_entropy"):
        flags["cross_entropy"] = False
    return apply_liger_kernel_to_llama, flags


def make_variant(name, base):
    """(model, note) for one variant, or (None, why) where it cannot run here."""
    import torch

    import normtune

    model = copy.deepcopy(base)
    if name == "unpatched":
        return model, ""
    if name in ("normtune", "normtune-residual"):
        report = normtune.patch(model, fuse_residual=name == "normtune-residual")
        return model, str(report).replace("\n", "; ")
    if name == "compile":
        return torch.compile(model), "torch.compile(model)"
    try:
        apply, flags = liger_options()
    except ImportError as err:
        return None, f"unavailable: {err}"
    if name == "liger-rms-norm":
        flags = {k: k == "rms_norm" for k in flags}
    apply(**flags, model=model)
    return model, "apply_liger_kernel_to_llama(" + ", ".join(f"{k}={v}" for k, v in flags.items()) + ")"


def step(model, opt, batch):
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def timed_step(model, opt, batch, cuda: bool) -> float:
    import torch

    if not cuda:
        start = time.perf_counter()
        step(model, opt, batch)
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    step(model, opt, batch)
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def normtune_kernel_names() -> set[str]:
    """The names of every Triton function in normtune's runtime (the profiler names a Triton kernel by its
    function's name)."""
    import importlib
    import pkgutil

    import triton

    import normtune.kernels as kernels

    names = set()
    for info in pkgutil.walk_packages(kernels.__path__, "normtune.kernels."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a module that does not import here has no kernel that ran
            continue
        names |= {getattr(obj, "__name__", "") or getattr(getattr(obj, "fn", None), "__name__", "")
                  for obj in vars(module).values() if isinstance(obj, triton.runtime.jit.KernelInterface)}
    return {n for n in names if n}


def is_norm_kernel(variant: str, kernel: str, ours: set[str]) -> bool | None:
    if variant == "unpatched":
        return None
    low = kernel.lower()
    if variant == "compile":
        return low.startswith("triton") and "rsqrt" in low
    return kernel in ours or any(s in low for s in ("rms_norm", "rmsnorm", "layer_norm",
                                                                     "layernorm"))


def norm_share(variant, model, opt, batch, ours) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model, opt, batch)
        torch.cuda.synchronize()
    total = norm = 0.0
    counted = variant != "unpatched"
    for evt in prof.key_averages():
        t = float(getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0) or 0.0)
        if t <= 0:
            continue
        total += t
        if is_norm_kernel(variant, evt.key, ours):
            norm += t
    return {"kernel_total_ms": total / 1e3, "norm_kernels_ms": norm / 1e3 if counted else None,
            "norm_share": norm / total if counted and total else None}


def grads_of(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def setup(tiny: bool, script: str) -> tuple:
    """(cuda, device, dtype) of a run: bf16 on the GPU, or --tiny's fp32 on CPU through the Triton interpreter (set
    before triton is imported) on one thread; exits where there is no GPU and no --tiny."""
    if tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    cuda = torch.cuda.is_available() and not tiny
    if not cuda and not tiny:
        sys.exit(f"{script} needs a CUDA GPU (or --tiny for the CPU check)")
    if tiny:
        torch.set_num_threads(1)
    return (cuda, "cuda", torch.bfloat16) if cuda else (cuda, "cpu", torch.float32)


def main(argv=None) -> int:
    args = parse(argv)
    cuda, device, dtype = setup(args.tiny, "train_step.py")
    import torch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config, base = build(args, device, dtype)
    g = torch.Generator(device=device).manual_seed(1)
    batch = torch.randint(0, args.vocab, (1, args.seq), device=device, generator=g)
    # `liger` patches transformers' module for every model: it is built and timed after the others.
    order = [v for v in args.variants if v != "liger"] + [v for v in args.variants if v == "liger"]
    groups = [[v for v in order if v != "liger"], [v for v in order if v == "liger"]]
    rows, notes, reference = {}, {}, None
    ours = normtune_kernel_names() if cuda else set()
    for group in groups:
        models = {}
        for name in group:
            model, notes[name] = make_variant(name, base)
            if model is not None:
                models[name] = model
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True) for k, m in models.items()}
        checks = {}
        for k, m in models.items():  # the same weights: the first loss and gradients; then warm-up steps
            loss, grads = grads_of(m, batch)
            if reference is None and k == "unpatched":
                reference = (loss, grads)
            checks[k] = (loss, grads)
            for _ in range(2):
                step(m, opts[k], batch)
        times = {k: [] for k in models}
        for _ in range(args.rounds):
            for k, m in models.items():
                times[k].append(timed_step(m, opts[k], batch, cuda))
        for k, m in models.items():
            loss, grads = checks[k]
            row = {"median_ms": statistics.median(times[k]), "p10_ms": _q(times[k], 0.1),
                   "p90_ms": _q(times[k], 0.9), "first_loss": loss}
            if reference is not None:
                row["grad_rel_err"] = max(((grads[n] - r).norm() / max(r.norm(), 1e-30)).item()
                                          for n, r in reference[1].items() if n in grads)
            row.update(norm_share(k, m, opts[k], batch, ours) if cuda else
                       {"kernel_total_ms": None, "norm_kernels_ms": None, "norm_share": None})
            rows[k] = row
        del models, opts
        if cuda:
            torch.cuda.empty_cache()
    write(out, args, config, rows, notes, cuda)
    if args.tiny:
        bad = {k: r.get("grad_rel_err") for k, r in rows.items() if (r.get("grad_rel_err") or 0) > 1e-3}
        if bad:
            sys.exit(f"--tiny: gradients differ from the unpatched model's: {bad}")
    return 0


def _q(v, f):
    v = sorted(v)
    return v[min(len(v) - 1, int(f * (len(v) - 1) + 0.5))]


def write(out: Path, args, config, rows, notes, cuda: bool) -> None:
    import torch

    gpu = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter, --tiny)"
    info = {"gpu": gpu, "torch": torch.__version__, "model_config": config.to_diff_dict(), "seq": args.seq,
            "batch": 1, "dtype": "bf16" if cuda else "fp32", "optimizer": "AdamW(lr=1e-5, foreach=True)",
            "rounds": args.rounds, "notes": notes, "results": rows}
    (out / "train_step.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    base_ms = rows["unpatched"]["median_ms"] if "unpatched" in rows else None

    def f(v, fmt):
        return fmt.format(v) if v is not None else "n/a"

    lines = [f"# Training step: transformers Llama ({args.layers} layers, hidden {args.hidden}, intermediate "
             f"{args.intermediate}, vocab {args.vocab}), 1 × {args.seq} tokens, {info['dtype']}, AdamW", "",
             f"Device: {gpu}; torch {torch.__version__}. Median of {args.rounds} steps per variant, taken in turns "
             "(`liger` after the others, on its own); norm share = device time of the norm kernels / all kernels "
             "of one profiled step.", "",
             "| variant | step ms (median) | p10 | p90 | vs unpatched | norm kernels ms | norm share | first loss "
             "| grad rel. err. vs unpatched |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, r in rows.items():
        speed = f"{base_ms / r['median_ms']:.3f}×" if base_ms else "n/a"
        share = f(r["norm_share"] * 100 if r["norm_share"] is not None else None, "{:.2f} %")
        lines.append(f"| {k} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | {r['p90_ms']:.2f} | {speed} | "
                     f"{f(r['norm_kernels_ms'], '{:.2f}')} | {share} | {r['first_loss']:.4f} | "
                     f"{f(r.get('grad_rel_err'), '{:.1e}')} |")
    lines += ["", "Variants: " + "; ".join(f"{k}: {v}" for k, v in notes.items()), "",
              "Model config: `" + json.dumps(config.to_diff_dict(), default=str) + "`", ""]
    (out / "train_step.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
