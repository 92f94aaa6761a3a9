"""What save="output"'s weight check (kernels/api/saving.py) costs in a training loop on a GPU.

A stack of L blocks (normtune LayerNorm or RMSNorm, then a bf16 Linear) trains for a number of steps. With an
optimizer step (every norm's weight changes, so save="output" reads the check results back once per step, at the
first layer) and without one (the checks stay cached), it times save="input" and save="output" and records the
peak memory. "output" with the optimizer minus "output" without it, less the optimizer's own time (the same
difference for "input"), is the cost of the read-back.

    python docs/experiments/save_output_check.py [--layers 24] [--rows 8192] [--cols 4096] [--steps 30]

Prints one JSON line per (norm, save, optimizer) with ms per step and peak GiB.
"""

from __future__ import annotations

import argparse
import json

import torch

from normtune.kernels.api.modules import LayerNorm, RMSNorm


def _model(norm: str, layers: int, cols: int, save: str) -> torch.nn.Module:
    blocks = []
    for _ in range(layers):
        layer = LayerNorm(cols, save=save) if norm == "layer_norm" else RMSNorm(cols, eps=1e-6, save=save)
        blocks += [layer, torch.nn.Linear(cols, cols, bias=False)]
    return torch.nn.Sequential(*blocks).to("cuda", torch.bfloat16)


def _time(model, x, steps: int, optimizer) -> tuple[float, float]:
    """(ms per step, peak GiB) over `steps` steps after 3 warm-up steps."""
    def step():
        model.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        if optimizer is not None:
            optimizer.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    for norm in ("layer_norm", "rms_norm"):
        for save in ("input", "output"):
            for with_optimizer in (True, False):
                torch.manual_seed(0)
                model = _model(norm, args.layers, args.cols, save)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if with_optimizer else None
                x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                ms, peak = _time(model, x, args.steps, optimizer)
                print(json.dumps({"norm": norm, "save": save, "optimizer": with_optimizer, "layers": args.layers,
                                  "shape": f"{args.rows}x{args.cols}", "ms_per_step": round(ms, 3),
                                  "peak_gib": round(peak, 3)}), flush=True)
                del model, optimizer, x
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
