"""Every gated RMSNorm peer on the gated shapes, in one run: forward + backward and backward alone, cold L2, host
hidden, each peer checked against the float64 reference first (a wrong peer is reported, not timed).

    python3 docs/experiments/gated_peers.py --out DIR [--sets issue,qwen3-next,mamba2] [--peers all]
                                            [--dtype bf16] [--tokens 2048,8192,32768] [--compile-static]
    python3 docs/experiments/gated_peers.py --out DIR --device cpu --tiny    # CPU check (Triton interpreter)

Peers (`normtune.tuner.measure.peers_gated`): transformers' own module eager (`hf-eager`) and under torch.compile
(`hf-compile`), flash-linear-attention's `rms_norm_gated` (`fla-gated`, norm before gate only) and `rmsnorm_fn`
(`fla-fn`, groups, both positions), mamba_ssm's `rmsnorm_fn` (`mamba`). The shape sets are
`normtune.tuner.gated_shapes`' (`issue`: the issue's eight shapes; `qwen3-next`, `mamba2`: model widths at each
token count). The floor is 3 passes of M×N forward and 5 backward at the device's copy bandwidth; "÷ floor" is
floor time over measured time (1.0 is the floor); the summary gives each shape's fastest peer and how many times
slower transformers' eager module is. Writes DIR/gated_peers.md and DIR/gated_peers.json. `hf-compile` compiles
once per (width, group, gate position) with the row count dynamic, so that the run stays short; `--compile-static`
compiles once per shape instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

SETS = ("issue", "qwen3-next", "mamba2")
PEERS = ("hf-eager", "hf-compile", "fla-gated", "fla-fn", "mamba")


class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse(argv):
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for gated_peers.md and gated_peers.json")
    p.add_argument("--sets", default=",".join(SETS), help="comma list of " + ", ".join(SETS))
    p.add_argument("--peers", default="all", help="all, or a comma list of " + ", ".join(PEERS))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--tokens", default="2048,8192,32768", help="token counts of the model sets")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes of every form instead of the sets")
    p.add_argument("--compile-static", action="store_true", help="hf-compile: one compile per shape (static)")
    p.add_argument("--budget", type=float, default=0.1, help="seconds of timed repetitions per measurement")
    args = p.parse_args(argv)
    args.sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in args.sets if s not in SETS]
    if unknown or not args.sets:
        raise UsageError(f"--sets: unknown {', '.join(unknown) or 'empty list'} (allowed: {', '.join(SETS)})")
    peers = [s.strip() for s in args.peers.split(",") if s.strip()]
    bad = [s for s in peers if s not in PEERS]
    if args.peers.strip() != "all" and (bad or not peers):
        raise UsageError(f"--peers: unknown {', '.join(bad) or 'empty list'} (allowed: all, {', '.join(PEERS)})")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        args.tokens = []
    if not args.tokens or min(args.tokens) < 1:
        raise UsageError("--tokens: give a comma list of positive token counts, e.g. 2048,8192,32768")
    if args.budget <= 0:
        raise UsageError("--budget: give a positive number of seconds, e.g. 0.1")
    if args.device == "cpu" and not args.tiny:
        raise UsageError("--device cpu runs the Triton interpreter: add --tiny (the sets' shapes take hours there)")
    return args


def problems(args):
    from normtune.tuner import gated_shapes as gs

    if args.tiny:
        return gs.tiny_set("fp32") + gs.tiny_set(args.dtype)[:1]
    out = []
    for name in args.sets:
        if name == "issue":
            out += gs.issue_set(args.dtype)
        else:
            models = gs.QWEN3_NEXT_MODELS if name == "qwen3-next" else gs.MAMBA2_MODELS
            out += gs.model_set(models, args.tokens, args.dtype)
    return list(dict.fromkeys(out))


def run(args) -> list[dict]:
    import torch

    from normtune.tuner.measure import peers_gated as pg
    from normtune.tuner.measure.harness import MeasureSession, Timing

    if args.device == "cpu":
        pg.first_config_autotune()
        session = MeasureSession("cpu")
    else:
        from normtune.tuner import gpu_info

        info = gpu_info.detect()
        timing = Timing(warmup=2, min_reps=10, max_reps=60, budget_s=args.budget, host_calls=5, host_reps=1)
        session = MeasureSession.for_device(info, timing=timing)
    names = pg.parse_gated_peers(args.peers)
    peers = {}
    for name in names:
        cls = pg.GATED_PEERS[name]
        peers[name] = cls(dynamic_rows=not args.compile_static) if name == "hf-compile" else cls()
    rows = []
    todo = problems(args)
    for i, problem in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {problem.label()}", file=sys.stderr, flush=True)
        inputs = pg.make_inputs(problem, session.device)
        ref = pg.reference(problem, inputs)
        fwd_bytes, bwd_bytes = pg.floor_bytes(problem)
        block_floor = pg.floor_us(fwd_bytes + bwd_bytes, session.bandwidth_gbps)
        bwd_floor = pg.floor_us(bwd_bytes, session.bandwidth_gbps)
        for name, peer in peers.items():
            row = {"gate": problem.gate_position, "M": problem.M, "N": problem.N, "group": problem.group,
                   "dtype": problem.dtype, "peer": name, "status": "ok", "note": "", "errors": {},
                   "block_us": None, "backward_us": None, "block_floor_us": block_floor, "backward_floor_us": bwd_floor}
            rows.append(row)
            why = peer.supports(problem)
            if why is not None:
                row.update(status="unsupported", note=why)
                continue
            t0 = time.perf_counter()
            try:
                prepared = peer.prepare(problem, inputs)
                row["errors"] = pg.check(problem, prepared, ref)
            except pg.PeerUnavailable as err:
                row.update(status="unavailable", note=str(err))
                continue
            except Exception as err:  # noqa: BLE001 - a peer that fails is a result, not a crash
                row.update(status="error", note=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
                continue
            row["note"] = prepared.note
            if not pg.within_tolerance(problem, row["errors"]):
                row["status"] = "wrong"
            else:
                row["block_us"] = session.time_callable(prepared.block).median
                row["backward_us"] = session.time_callable(prepared.backward).median
            row["seconds"] = round(time.perf_counter() - t0, 2)
            del prepared
        del inputs, ref
        if session.on_gpu:
            torch.cuda.empty_cache()
    return rows


def _ratio(floor, measured):
    return f"{floor / measured:.2f}" if measured and math.isfinite(floor) else "n/a"


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"# {title}", "", "| gate | rows × width | group | dtype | peer | block µs | backward µs | "
             "block ÷ floor | backward ÷ floor | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] == "unsupported":
            continue
        us = (lambda v: f"{v:.1f}" if v is not None else "")
        status = r["status"] if r["status"] != "wrong" else "wrong: " + ", ".join(
            f"{k} {v:.1e}" for k, v in r["errors"].items())
        if r["status"] in ("unavailable", "error"):
            status += f" ({r['note']})"
        lines.append(f"| {r['gate']} | {r['M']} × {r['N']} | {r['group']} | {r['dtype']} | {r['peer']} | "
                     f"{us(r['block_us'])} | {us(r['backward_us'])} | {_ratio(r['block_floor_us'], r['block_us'])} | "
                     f"{_ratio(r['backward_floor_us'], r['backward_us'])} | {status} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    """Per shape: the fastest peer that passed its check (forward + backward), its ratios to the floor, and
    transformers' eager module's time over it."""
    lines = ["| gate | rows × width | group | dtype | best peer | µs | block ÷ floor | backward ÷ floor | "
             "eager ÷ best |", "|---|---|---|---|---|---|---|---|---|"]
    shapes = list(dict.fromkeys((r["gate"], r["M"], r["N"], r["group"], r["dtype"]) for r in rows))
    for shape in shapes:
        timed = [r for r in rows if (r["gate"], r["M"], r["N"], r["group"], r["dtype"]) == shape and r["block_us"]]
        if not timed:
            continue
        best = min((r for r in timed if r["peer"] != "hf-eager"), key=lambda r: r["block_us"], default=timed[0])
        eager = next((r["block_us"] for r in timed if r["peer"] == "hf-eager"), None)
        speedup = f"{eager / best['block_us']:.1f}×" if eager else "n/a"
        lines.append(f"| {shape[0]} | {shape[1]} × {shape[2]} | {shape[3]} | {shape[4]} | {best['peer']} | "
                     f"{best['block_us']:.1f} | {_ratio(best['block_floor_us'], best['block_us'])} | "
                     f"{_ratio(best['backward_floor_us'], best['backward_us'])} | {speedup} |")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    """Installed versions of torch, triton and the peers' libraries (None: not installed)."""
    from importlib import metadata

    out = {}
    for dist in ("torch", "triton", "transformers", "flash-linear-attention", "fla-core", "mamba-ssm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv=None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"error: --out {args.out}: cannot make the folder ({err.strerror or err}); give a folder path",
              file=sys.stderr)
        return 1
    start = time.perf_counter()
    rows = run(args)
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    text = markdown(rows, f"Gated RMSNorm peers, {args.dtype}, {device}") + "\n## Fastest peer\n\n" + summary(rows)
    (out / "gated_peers.md").write_text(text)
    (out / "gated_peers.json").write_text(json.dumps({"device": device, "args": vars(args), "rows": rows,
                                                      "versions": versions(),
                                                      "seconds": round(time.perf_counter() - start, 1)}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
