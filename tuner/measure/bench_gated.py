"""`normtune bench` of gated RMSNorm calls: y = w · rmsnorm(x) · act(z) (the gate before) or
y = w · rmsnorm(x · act(z)) (after), in groups, as hybrid models call them (`gated_shapes.GatedProblem`), timed for
normtune's public API and the peers of `peers_gated` (flash-linear-attention's two gated norms, transformers'
module eager and compiled, mamba_ssm), cold L2, on one device in one run.

Every implementation gets the same inputs and upstream gradient and is timed three ways, as the residual bench
does (GPU time with the host hidden, `MeasureSession.time_callable`): the block (forward and backward through
autograd, a fresh graph per call: `block_us`), the backward alone on one retained graph (`backward_us`) and the
forward alone (`forward_us`); the kernel sums come from the profiler; and the CPU time of one block and one
backward call (`block_host_us`, `backward_host_us`), every implementation of a call host-timed in the same
interleaved rounds once all are prepared (`host_rounds`). Values (y, dx, dz, dw) are checked first
against the float64 reference: an implementation past the dtype's gate is reported as an error, never timed. The
memory floors are `peers_gated.floor_bytes`: 3 passes forward, 5 backward.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from normtune.kernels.config import BackwardConfig

from ..gated_shapes import GatedProblem
from ..gpu_info import DeviceInfo, peer_versions
from .bench_residual import (geomean, host_rounds, host_table, impl_row, load_peers, timed_views,
                             write_block_files)
from .harness import TIMING, MeasureSession, Timing
from .peers import PeerUnavailable
from .peers_gated import GATED_PEERS, Normtune, check, floor_bytes, make_inputs, reference, within_tolerance
from .host_rounds import HostCall

OURS = "normtune"
CPU_PEERS = ("hf-eager", "hf-compile")  # the interpreter stands in for normtune's kernels; these run on CPU too


@dataclass
class GatedBenchOptions:
    calls: list[GatedProblem]
    peers: list[str]
    config: BackwardConfig | None = None  # None: the runtime's choice, as a user's call gets
    cold: bool = True
    timing: Timing = TIMING["bench"]


@dataclass
class GatedReport:
    provenance: dict
    rows: list[dict] = field(default_factory=list)


def _peer(name: str):
    cls = GATED_PEERS[name]
    return cls(dynamic_rows=False) if name == "hf-compile" else cls()


def run_gated_bench(opts: GatedBenchOptions, info: DeviceInfo, *, session: MeasureSession | None = None,
                    progress: Callable[[str, dict | None], None] | None = None,
                    checkpoint: Callable | None = None) -> GatedReport:
    """Every call for normtune and the peers; `progress(message, row)` is called as rows land, and
    `checkpoint(report)` once each shape's rows are complete (the command writes its files then, so that a
    bench stopped part way keeps what it finished; "finished" is null in its provenance until the end)."""
    say = progress or (lambda msg, row=None: None)
    session = session or MeasureSession.for_device(info, cold=opts.cold, timing=opts.timing)
    peers = load_peers(opts.peers, _peer, CPU_PEERS, info.interpret)
    started = dt.datetime.now(dt.timezone.utc)
    report = GatedReport({
        "device": info.to_dict(), "peers": peer_versions(), **session.provenance(),
        "config": opts.config.to_json() if opts.config is not None else "runtime choice",
        "interpret": info.interpret, "started": started.isoformat(timespec="seconds"), "finished": None,
        "peer_descriptions": {n: GATED_PEERS[n].description for n in opts.peers},
    })
    for call in opts.calls:
        inputs = make_inputs(call, session.device)
        ref = reference(call, inputs)
        forward_bytes, backward_bytes = floor_bytes(call)
        bw = session.bandwidth_gbps
        floor = backward_bytes / (bw * 1e3) if bw and math.isfinite(bw) else None
        block_floor = (forward_bytes + backward_bytes) / (bw * 1e3) if floor is not None else None
        base = {"gate": call.gate_position, "M": call.M, "N": call.N, "group": call.group, "dtype": call.dtype,
                "activation": call.activation, "floor_us": floor, "block_floor_us": block_floor}
        host: list[HostCall] = []  # every implementation's calls, host-timed together once all are ready
        for name, impl in [(OURS, Normtune(opts.config))] + list(peers.items()):
            row = _empty_row(base, name)
            timed = partial(_time_impl, session, call=call, inputs=inputs, ref=ref, row=row, host=host)
            impl_row(row, impl, call, timed,
                     "the interpreter runs only normtune and transformers' module (eager, compiled)")
            report.rows.append(row)
            say(f"{call.label()} {name}", row)
        host_rounds(session, host)
        del inputs, ref, host
        if checkpoint is not None:
            checkpoint(report)
        if session.on_gpu:
            torch.cuda.empty_cache()
    report.provenance["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return report


def _empty_row(base: dict, impl: str) -> dict:
    return {**base, "impl": impl, "status": "ok", "error": None, "note": "", "block_us": None, "block_p10_us": None,
            "block_p90_us": None, "backward_us": None, "backward_p10_us": None, "backward_p90_us": None,
            "forward_us": None, "block_kernel_sum_us": None, "backward_kernel_sum_us": None, "kernels_block": {},
            "kernels_backward": {}, "errors": {}, "floor_fraction": None, "block_host_us": None,
            "backward_host_us": None}


def _time_impl(session: MeasureSession, impl, call: GatedProblem, inputs, ref: dict, row: dict,
               host: list[HostCall]) -> dict:
    """An implementation's GPU times and kernel sums (the updates to its `row`); its block and backward calls are
    added to `host`, host-timed with the other implementations' once all are prepared."""
    try:
        prepared = impl.prepare(call, inputs)
        errors = check(call, prepared, ref)
        out = {"errors": errors, "note": prepared.note}
        if not within_tolerance(call, errors):
            bad = ", ".join(f"{k} {v:.3g}" for k, v in errors.items())
            return {**out, "status": "error", "error": f"wrong values (relative errors {bad})"}
        return {**out, **timed_views(session, prepared, row, host)}
    except PeerUnavailable as err:
        return {"status": "unavailable", "error": str(err)}
    except Exception as err:  # noqa: BLE001 - a failing implementation is reported and the run goes on
        return {"status": "error", "error": f"{type(err).__name__}: {str(err)[:2000]}"}
    finally:
        if session.on_gpu:
            torch.cuda.synchronize(session.device)


# ------------------------------------------------------------------------------------------- summaries

KEY = ("gate", "M", "N", "group", "dtype", "activation")


def summary(rows: list[dict]) -> list[dict]:
    """One line per call: normtune against the best peer in the block and in the backward alone."""
    out = []
    for ours in (r for r in rows if r["impl"] == OURS):
        key = tuple(ours[k] for k in KEY)
        peers = [r for r in rows if r["impl"] != OURS and r["status"] == "ok" and tuple(r[k] for k in KEY) == key]
        line = {**{k: ours[k] for k in KEY}, "status": ours["status"]}
        for view in ("block", "backward"):
            metric = f"{view}_us"
            timed = [r for r in peers if r.get(metric)]
            best = min(timed, key=lambda r: r[metric]) if timed else None
            mine = ours.get(metric) if ours["status"] == "ok" else None
            line.update({f"normtune_{view}_us": mine, f"best_peer_{view}": best["impl"] if best else None,
                         f"best_peer_{view}_us": best[metric] if best else None,
                         f"{view}_speedup": best[metric] / mine if (best and mine) else None})
            floor = ours.get("floor_us" if view == "backward" else "block_floor_us")
            line[f"{view}_floor_fraction"] = floor / mine if (floor and mine) else None
        out.append(line)
    return out


def to_markdown(report: GatedReport) -> str:
    p = report.provenance
    lines = ["# Gated RMSNorm: forward + backward", "",
             f"Device: {p['device'].get('name')}; " + ("times are interpreter wall-clock on the CPU, never GPU "
                                                       "time" if p["interpret"] else "GPU time with the host "
                                                       f"hidden (median), cold L2: {p.get('cold_l2')}") +
             f"; normtune's config: {p['config']}.", "",
             "| gate | rows × width | group | dtype | normtune block µs | best peer | its µs | speedup | "
             "normtune bwd µs | best peer | its µs | speedup | floor fraction block / bwd |",
             "|---|---|---:|---|---:|---|---:|---:|---:|---|---:|---:|---:|"]

    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if v is not None else "–"

    rows = summary(report.rows)
    for s in rows:
        lines.append(f"| {s['gate']} | {s['M']} × {s['N']} | {s['group']} | {s['dtype']} | "
                     f"{f(s['normtune_block_us'])} | {s['best_peer_block'] or '–'} | {f(s['best_peer_block_us'])} | "
                     f"{f(s['block_speedup'], '{:.2f}×')} | {f(s['normtune_backward_us'])} | "
                     f"{s['best_peer_backward'] or '–'} | {f(s['best_peer_backward_us'])} | "
                     f"{f(s['backward_speedup'], '{:.2f}×')} | {f(s['block_floor_fraction'], '{:.3f}')} / "
                     f"{f(s['backward_floor_fraction'], '{:.3f}')} |")
    block, bwd = (geomean(s[f"{v}_speedup"] for s in rows) for v in ("block", "backward"))
    wins = sum(1 for s in rows if (s["block_speedup"] or 0) > 1)
    lines += ["", f"geometric mean {f(block, '{:.3f}×')} (block), {f(bwd, '{:.3f}×')} (backward); normtune faster "
                  f"than every peer in the block on {wins}/{len(rows)} calls"]
    lines += host_table(report.rows, KEY, lambda r: f"{r['gate']} {r['M']} × {r['N']} group {r['group']}")
    problems = [r for r in report.rows if r["status"] != "ok"]
    if problems:
        lines += ["", "Not timed:"] + [f"- {r['gate']} {r['M']}×{r['N']} group {r['group']} {r['impl']}: "
                                       f"{r['status']}: {r['error']}" for r in problems]
    return "\n".join(lines) + "\n"


def write_all(report: GatedReport, out_dir: str | Path) -> list[Path]:
    return write_block_files(out_dir, "gated", report, summary(report.rows), to_markdown(report))
