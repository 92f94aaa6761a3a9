"""Training-step time of a real model definition (transformers' Llama) with its RMSNorms as they are, patched with
normtune (`normtune.patch`), and patched with Liger's RMSNorm only; and the norm kernels' share of the step.

    python3 docs/experiments/train_step.py OUT_DIR [--layers 4] [--hidden 4096] [--seq 4096] [--rounds 20]

Same initial weights and batch for every variant; bf16 weights, AdamW. The variants take their steps in turns
(one step each per round), each step timed between CUDA events after a synchronize; the median over the rounds is
reported, with p10/p90. One profiled step per variant gives the device time of the kernels named like a norm's
(normtune's forward/kernel_1/kernel_2/row_sums; Liger's `_rms_norm_*` kernels — its dW sum is a torch reduction
that is not counted) against the step's kernel total. Writes OUT_DIR/train_step.md and train_step.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

NORMTUNE_KERNELS = ("_forward_kernel", "kernel_1_single_pass", "kernel_1_two_pass", "kernel_1_columns", "row_sums",
                    "kernel_2")
LIGER_KERNELS = ("_rms_norm_forward_kernel", "_rms_norm_backward_kernel")


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 128, num_key_value_heads=8, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, rms_norm_eps=1e-5, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    return config, model


def variants(base):
    import normtune

    out = {"unpatched": copy.deepcopy(base)}
    patched = copy.deepcopy(base)
    report = normtune.patch(patched)
    out["normtune"] = patched
    notes = {"normtune": str(report)}
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        liger = copy.deepcopy(base)
        apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True,
                                    swiglu=False, model=liger)
        out["liger"] = liger
        notes["liger"] = "apply_liger_kernel_to_llama(rms_norm=True) only"
    except ImportError as err:
        notes["liger"] = f"unavailable: {err}"
    return out, notes


def step(model, opt, batch):
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def timed_step(model, opt, batch) -> tuple[float, float]:
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    loss = step(model, opt, batch)
    b.record()
    b.synchronize()
    return a.elapsed_time(b), float(loss)


def norm_share(model, opt, batch, names) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model, opt, batch)
        torch.cuda.synchronize()
    total = norm = 0.0
    for evt in prof.key_averages():
        t = float(getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0) or 0.0)
        if t <= 0:
            continue
        total += t
        if names and any(n in evt.key for n in names):
            norm += t
    return {"kernel_total_ms": total / 1e3, "norm_kernels_ms": norm / 1e3 if names else None,
            "norm_share": norm / total if names and total else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    config, base = build(args)
    models, notes = variants(base)
    del base
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True) for k, m in models.items()}
    g = torch.Generator(device="cuda").manual_seed(1)
    batch = torch.randint(0, args.vocab, (1, args.seq), device="cuda", generator=g)
    first_loss = {}
    for k, m in models.items():  # warm-up: compile kernels, allocate optimizer state
        for i in range(3):
            loss = step(m, opts[k], batch)
            if i == 0:
                first_loss[k] = float(loss)
    times = {k: [] for k in models}
    for _ in range(args.rounds):
        for k, m in models.items():
            times[k].append(timed_step(m, opts[k], batch)[0])
    shares = {k: norm_share(m, opts[k], batch, NORMTUNE_KERNELS if k == "normtune" else
                            LIGER_KERNELS if k == "liger" else ()) for k, m in models.items()}

    def q(v, f):
        v = sorted(v)
        return v[min(len(v) - 1, int(f * (len(v) - 1) + 0.5))]

    rows = {k: {"median_ms": statistics.median(v), "p10_ms": q(v, 0.1), "p90_ms": q(v, 0.9),
                "first_loss": first_loss[k], **shares[k]} for k, v in times.items()}
    gpu = torch.cuda.get_device_name()
    info = {"gpu": gpu, "torch": torch.__version__, "model_config": config.to_diff_dict(), "seq": args.seq,
            "batch": 1, "dtype": "bf16", "optimizer": "AdamW(lr=1e-5, foreach=True)", "rounds": args.rounds,
            "notes": notes, "results": rows}
    (out / "train_step.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    base_ms = rows["unpatched"]["median_ms"]
    lines = [f"# Training step: transformers Llama ({args.layers} layers, hidden {args.hidden}, "
             f"intermediate {args.intermediate}, vocab {args.vocab}), 1 × {args.seq} tokens, bf16, AdamW", "",
             f"GPU: {gpu}; torch {torch.__version__}. Median of {args.rounds} steps per variant, taken in turns; "
             "norm share = device time of the norm kernels / all kernels of one profiled step.", "",
             "| variant | step ms (median) | p10 | p90 | vs unpatched | norm kernels ms | norm share | first loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k, r in rows.items():
        share = f"{r['norm_share'] * 100:.2f} %" if r["norm_share"] is not None else "n/a"
        nk = f"{r['norm_kernels_ms']:.2f}" if r["norm_kernels_ms"] is not None else "n/a"
        lines.append(f"| {k} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | {r['p90_ms']:.2f} | "
                     f"{base_ms / r['median_ms']:.3f}× | {nk} | {share} | {r['first_loss']:.4f} |")
    lines += ["", "Patches: " + "; ".join(f"{k}: {v}" for k, v in notes.items()), "",
              "Model config: `" + json.dumps(config.to_diff_dict(), default=str) + "`", ""]
    (out / "train_step.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
