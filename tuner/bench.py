"""`normtune bench`: normtune's backward and its peers, side by side, cold L2, on one device in one run.

Every implementation runs the backward of the same inputs (the forward once, untimed), timed with the protocol
of `measure.py`; peers get a per-kernel breakdown from torch.profiler, normtune its kernel_1/kernel_2 split from
events. Rows are plain dicts (one per problem x implementation) so writers and the store stay simple.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from normtune.kernels.config import BackwardConfig, Problem, default_config
from normtune.kernels.select import select_config

from . import measure
from .device import DeviceInfo, peer_versions
from .peers import PeerUnavailable, make_peer

OURS = "normtune"


@dataclass
class BenchOptions:
    norms: list[str]
    dtype: str
    shapes: list[tuple[int, int]]
    peers: list[str]
    config: str = "default"  # "default" | "table" | BackwardConfig JSON
    weight_dtype: str | None = None
    cold: bool = True
    min_reps: int = 20
    max_reps: int = 200
    budget_s: float = 0.5
    profile_reps: int = 5


@dataclass
class BenchReport:
    provenance: dict
    rows: list[dict] = field(default_factory=list)


def problem_for(norm: str, M: int, N: int, dtype: str, weight_dtype: str | None) -> Problem:
    """The benchmarked problem: LayerNorm with weight and bias, RMSNorm with weight, saving the input."""
    return Problem(norm, M, N, dtype, weight_dtype, has_weight=True, has_bias=norm == "layer_norm")


def resolve_bench_config(spec: str, problem: Problem, info: DeviceInfo) -> tuple[BackwardConfig, str]:
    """(config, how it was chosen) for --config default|table|JSON."""
    if spec == "default":
        return default_config(problem), "default"
    if spec == "table":
        cc = tuple(int(x) for x in info.compute_capability.split(".")) if info.compute_capability else None
        name = None if info.interpret else info.name
        return select_config(problem, name, cc), "table"
    text = spec
    if os.path.isfile(spec):
        with open(spec) as fh:
            text = fh.read()
    return BackwardConfig.from_json(text).validate(problem), "explicit"


def _nan_to_none(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def run_bench(opts: BenchOptions, info: DeviceInfo, *, bandwidth_gbps: float | None = None,
              progress: Callable[[str, dict | None], None] | None = None) -> BenchReport:
    """Run every (norm, shape) for normtune and the peers; `progress(message, row)` is called as rows land."""
    device = torch.device("cpu" if info.interpret else "cuda")
    say = progress or (lambda msg, row=None: None)
    if bandwidth_gbps is None:
        bandwidth_gbps = math.nan if info.interpret else measure.copy_bandwidth(device)
    flusher = measure.L2Flusher(device, info.l2_bytes) if (opts.cold and not info.interpret) else None
    peers = {}
    for name in opts.peers:
        if info.interpret and name != "torch":
            peers[name] = None  # reported as unavailable: the interpreter only stands in for our kernels
            continue
        try:
            peers[name] = make_peer(name)
        except Exception as err:  # noqa: BLE001
            peers[name] = err
    provenance = {
        "device": info.to_dict(), "peers": peer_versions(), "copy_bandwidth_gbps": _nan_to_none(bandwidth_gbps),
        "cold_l2": opts.cold, "flush_bytes": flusher.nbytes if flusher else 0, "dtype": opts.dtype,
        "weight_dtype": opts.weight_dtype or opts.dtype, "config": opts.config,
        "timing": {"min_reps": opts.min_reps, "max_reps": opts.max_reps, "budget_s": opts.budget_s,
                   "spin_cycles": measure.SPIN_CYCLES},
        "interpret": info.interpret, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "peer_descriptions": {n: (p.description if hasattr(p, "description") else None) for n, p in peers.items()},
    }
    report = BenchReport(provenance)
    timing = dict(min_reps=opts.min_reps, max_reps=opts.max_reps, budget_s=opts.budget_s)
    for norm in opts.norms:
        for M, N in opts.shapes:
            problem = problem_for(norm, M, N, opts.dtype, opts.weight_dtype)
            case = measure.make_case(problem, device)
            ref = case.reference()
            floor = measure.floor_us(problem, bandwidth_gbps) if not info.interpret else math.nan
            base = {"norm": norm, "M": M, "N": N, "dtype": problem.dtype, "weight_dtype": problem.weight_dtype,
                    "floor_us": _nan_to_none(floor)}
            # normtune
            config, chosen = resolve_bench_config(opts.config, problem, info)
            res = measure.measure_config(case, config, flusher=flusher, bandwidth_gbps=bandwidth_gbps,
                                         reference_grads=ref, **timing)
            row = {**base, "impl": OURS, "status": res.status, "error": res.error, "median_us": res.median_us,
                   "p10_us": res.p10_us, "p90_us": res.p90_us, "reps": res.reps, "kernel_1_us": res.kernel_1_us,
                   "kernel_2_us": res.kernel_2_us, "kernels": {"kernel_1": res.kernel_1_us,
                                                               "kernel_2": res.kernel_2_us},
                   "rel_err_dx": res.errors.get("dx"), "config": config.to_dict(), "config_source": chosen,
                   "note": ""}
            report.rows.append(_finish(row, floor))
            say(f"{norm} {M}x{N} normtune", report.rows[-1])
            # peers
            for name, peer in peers.items():
                row = {**base, "impl": name, "status": "ok", "error": None, "median_us": None, "p10_us": None,
                       "p90_us": None, "reps": 0, "kernel_1_us": None, "kernel_2_us": None, "kernels": {},
                       "rel_err_dx": None, "config": None, "config_source": None, "note": ""}
                if peer is None:
                    row.update(status="unavailable", error="the interpreter runs only normtune and torch eager")
                elif isinstance(peer, Exception):
                    row.update(status="unavailable", error=f"{type(peer).__name__}: {peer}")
                elif (why := peer.supports(problem)) is not None:
                    row.update(status="unavailable", error=why)
                else:
                    row.update(_time_peer(peer, problem, case, ref, flusher, device, opts))
                report.rows.append(_finish(row, floor))
                say(f"{norm} {M}x{N} {name}", report.rows[-1])
            del case, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.provenance["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return report


def _time_peer(peer, problem, case, ref, flusher, device, opts) -> dict:
    try:
        prepared = peer.prepare(problem, case.x, case.weight, case.bias, case.grad)
        got = prepared.run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        err_dx = measure.relative_error(got[0], ref[0])
        stats = measure.time_callable(prepared.run, flusher=flusher, device=device, min_reps=opts.min_reps,
                                      max_reps=opts.max_reps, budget_s=opts.budget_s)
        kernels = {}
        if device.type == "cuda" and opts.profile_reps > 0:
            try:
                kernels = measure.profile_kernels(prepared.run, flusher=flusher, device=device,
                                                  reps=opts.profile_reps)
            except Exception as err:  # noqa: BLE001 - a breakdown failure must not lose the timing
                kernels = {"<profiler failed>": float("nan")}
                prepared.note += f" (profiler: {err})"
        return {"median_us": stats.median, "p10_us": stats.p10, "p90_us": stats.p90, "reps": stats.count,
                "kernels": kernels, "rel_err_dx": err_dx, "note": prepared.note}
    except PeerUnavailable as err:
        return {"status": "unavailable", "error": str(err)}
    except Exception as err:  # noqa: BLE001 - a failing peer is reported and the run goes on
        return {"status": "error", "error": f"{type(err).__name__}: {str(err)[:2000]}"}
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _finish(row: dict, floor: float) -> dict:
    t = row.get("median_us")
    row["floor_fraction"] = (floor / t) if (t and floor and math.isfinite(floor)) else None
    return row


# ------------------------------------------------------------------------------------------- summaries


def best_peer_rows(rows: list[dict]) -> dict[tuple, dict]:
    """(norm, M, N) → the fastest ok peer row."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["impl"] == OURS or r["status"] != "ok" or r["median_us"] is None:
            continue
        key = (r["norm"], r["M"], r["N"])
        if key not in best or r["median_us"] < best[key]["median_us"]:
            best[key] = r
    return best


def summary(rows: list[dict]) -> list[dict]:
    """One line per problem: normtune vs best peer vs floor."""
    best = best_peer_rows(rows)
    out = []
    for r in rows:
        if r["impl"] != OURS:
            continue
        key = (r["norm"], r["M"], r["N"])
        bp = best.get(key)
        ours = r["median_us"] if r["status"] == "ok" else None
        out.append({
            "norm": r["norm"], "M": r["M"], "N": r["N"], "normtune_us": ours, "kernel_1_us": r["kernel_1_us"],
            "kernel_2_us": r["kernel_2_us"], "best_peer": bp["impl"] if bp else None,
            "best_peer_us": bp["median_us"] if bp else None, "floor_us": r["floor_us"],
            "speedup": (bp["median_us"] / ours) if (bp and ours) else None,
            "floor_fraction": r["floor_fraction"], "status": r["status"],
        })
    return out


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def to_json(report: BenchReport) -> str:
    return json.dumps({"provenance": report.provenance, "rows": report.rows,
                       "summary": summary(report.rows)}, indent=1, sort_keys=True, default=str)


def store_report(store, report: BenchReport, info: DeviceInfo) -> int:
    """Record a bench run: normtune's rows as measurements (source "bench"), peers as peer results."""
    from .device import command_line
    from .measure import MeasureResult

    run_id = store.start_run(info, kind="bench", command_line=command_line(),
                             copy_bandwidth_gbps=report.provenance.get("copy_bandwidth_gbps"))
    for r in report.rows:
        problem = problem_for(r["norm"], r["M"], r["N"], r["dtype"], r["weight_dtype"])
        if r["impl"] == OURS:
            result = MeasureResult(status=r["status"], error=r["error"], median_us=r["median_us"],
                                   p10_us=r["p10_us"], p90_us=r["p90_us"], reps=r["reps"] or 0,
                                   kernel_1_us=r["kernel_1_us"], kernel_2_us=r["kernel_2_us"],
                                   floor_us=r["floor_us"], floor_fraction=r["floor_fraction"],
                                   interpret=info.interpret)
            store.add_measurement(run_id, problem, BackwardConfig.from_dict(r["config"]), result,
                                  source=f"bench-{r['config_source']}")
        else:
            status = r["status"] if r["status"] in ("ok", "error", "unavailable") else "error"
            store.add_peer_result(run_id, problem, r["impl"], status=status, median_us=r["median_us"],
                                  p10_us=r["p10_us"], p90_us=r["p90_us"], reps=r["reps"] or 0,
                                  kernels=r.get("kernels") or {}, error=r.get("error"), note=r.get("note") or None)
    store.end_run(run_id)
    return run_id
