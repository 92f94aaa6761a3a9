"""The forms no table tunes at the widths where their streams fill the most shared memory, on a CUDA GPU: each case
runs normtune's forward and backward with the config the runtime picks (`select_config`), and its gradients are
compared with a float64 reference on the same inputs. Prints one line per case: the problem, the config, the
relative error of each gradient (x, w, [b,] gate or residual), and ok / FAILED.

    python3 docs/experiments/wide_forms_launch.py          # on the GPU
    python3 docs/experiments/wide_forms_launch.py --cpu    # a check of the script: 3 rows each, Triton's interpreter
"""

from __future__ import annotations

import os
import sys

CPU = "--cpu" in sys.argv[1:]
if CPU:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import normtune.kernels as nk  # noqa: E402

DEVICE = "cpu" if CPU else "cuda"

CASES = [  # (norm, M, N, dtype, keywords of the call)
    ("rms_norm", 4096, 8192, torch.float32, {"gate_position": "after"}),
    ("rms_norm", 4096, 8192, torch.float32, {"gate_position": "before"}),
    ("rms_norm", 4096, 65536, torch.float32, {"residual_dtype": torch.float32}),
    ("rms_norm", 1000, 65536, torch.bfloat16, {"residual_dtype": torch.float32}),
    ("layer_norm", 4096, 16384, torch.bfloat16, {"residual_dtype": torch.float32}),
    ("layer_norm", 4096, 65536, torch.float32, {"residual_dtype": torch.float32}),
]


def reference(norm, x, w, b, extra, kw):
    """y (and h) in float64 with autograd."""
    if "gate_position" in kw:
        a = F.silu(extra)
        if kw["gate_position"] == "after":
            x = x * a
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return (y * a if kw["gate_position"] == "before" else y,)
    h = x + extra
    if norm == "rms_norm":
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w, h
    return F.layer_norm(h, h.shape[-1:], w, b, 1e-5), h


def run(norm, M, N, dtype, kw):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    M = 3 if CPU else M
    x = torch.randn(M, N, device=DEVICE, dtype=dtype, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(N, device=DEVICE, generator=gen)).to(dtype).requires_grad_()
    b = None
    if norm == "layer_norm":
        b = (0.1 * torch.randn(N, device=DEVICE, generator=gen)).to(dtype).requires_grad_()
    if "gate_position" in kw:
        extra = torch.randn(M, N, device=DEVICE, dtype=dtype, generator=gen).requires_grad_()
        out = nk.rms_norm(x, w, 1e-6, gate=extra, **kw)
        outs = (out,)
    else:
        extra = torch.randn(M, N, device=DEVICE, dtype=kw["residual_dtype"], generator=gen).requires_grad_()
        outs = (nk.rms_norm(x, w, 1e-6, residual=extra, **kw) if norm == "rms_norm"
                else nk.layer_norm(x, w, b, 1e-5, residual=extra, **kw))
    grads_out = [torch.randn_like(o) for o in outs]
    leaves = [t for t in (x, w, b, extra) if t is not None]
    got = torch.autograd.grad(outs, leaves, grads_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rx, rw, *rest = ref_leaves
    rb = rest[0] if b is not None else None
    rextra = rest[-1]
    ref_outs = reference(norm, rx, rw, rb, rextra, kw)
    want = torch.autograd.grad(ref_outs, ref_leaves, [g.double() for g in grads_out])
    errors = [((g.double() - r).norm() / r.norm().clamp_min(1e-30)).item() for g, r in zip(got, want)]
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    problem = nk.Problem(norm, M, N, {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype],
                         has_bias=b is not None, **({"gate": kw["gate_position"]} if "gate_position" in kw else
                                                  {"residual": True, "residual_dtype": "fp32"}))
    config = (nk.select_config(problem, torch.cuda.get_device_name(), torch.cuda.get_device_capability(),
                               nk.device.device_limits(torch.device("cuda"))) if not CPU else "interpreter")
    print(f"{problem.key}: {config}; gradient errors {', '.join(f'{e:.1e}' for e in errors)}: "
          + ("ok" if max(errors) < tolerance else "FAILED"), flush=True)


def main() -> None:
    print(torch.cuda.get_device_name() if not CPU else "CPU (Triton's interpreter)", "torch", torch.__version__)
    for case in CASES:
        try:
            run(*case)
        except Exception as err:  # noqa: BLE001 - reported per case
            print(f"{case[0]} {case[1]}x{case[2]} {case[3]} {case[4]}: {type(err).__name__}: {str(err)[:300]}")


if __name__ == "__main__":
    main()
