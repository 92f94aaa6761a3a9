"""`normtune bench --residual`: the residual block h = x + r, y = norm(h) — what every pre-norm transformer layer
runs — timed for normtune's public API and the peers that offer the fused form, cold L2, on one device in one run.

Every implementation gets the same inputs and both upstream gradients (dy into y, dh into h) and is timed three
ways (GPU time with the host hidden, `MeasureSession.time_callable`): the block (forward and backward through
autograd, a fresh graph per call: `block_us`), the backward alone on one retained graph (`backward_us`), and the
forward alone (`forward_us`); the block's and the backward's kernel sums come from the profiler; and the CPU time
of one block and one backward call (`block_host_us`, `backward_host_us`), every implementation of a case
host-timed in the same interleaved rounds once all are prepared (`host_rounds.py`). Values are checked
first against a float64 reference (dx = dresidual = dh + norm_backward(dy), and dw): an implementation past the
dtype's gate is reported as an error, never timed. The memory floors are the tuner's byte model of the residual
problem: 4 passes each way (`floor_bytes` for the backward, plus `forward_floor_bytes` for the block).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from normtune.kernels.config import BackwardConfig, Problem

from .bench import problem_for
from .cases import GATE_TOLERANCE, relative_error
from ..files import write_atomic
from ..gpu_info import DeviceInfo, peer_versions
from .harness import TIMING, MeasureSession, Timing
from .host_rounds import HostCall, measure_rounds
from .peers import PeerUnavailable
from .peers_residual import RESIDUAL_PEERS, Normtune, make_inputs, reference
from .results import forward_floor_bytes
from .views import kernel_sum

OURS = "normtune"
CPU_PEERS = ("torch", "compile")  # the interpreter stands in for normtune's kernels; these run on CPU too


@dataclass
class ResidualBenchOptions:
    norms: list[str]
    dtype: str
    shapes: list[tuple[int, int]]
    peers: list[str]
    residual_dtype: str | None = None  # None: the activation dtype
    weight_dtype: str | None = None
    config: BackwardConfig | None = None  # None: the runtime's choice, as a user's call gets
    cold: bool = True
    timing: Timing = TIMING["bench"]


@dataclass
class ResidualReport:
    provenance: dict
    rows: list[dict] = field(default_factory=list)


def residual_problem(norm: str, M: int, N: int, dtype: str, weight_dtype: str | None,
                     residual_dtype: str | None) -> Problem:
    """The benchmarked block: the plain bench's problem (`bench.problem_for`) with the residual add."""
    return dataclasses.replace(problem_for(norm, M, N, dtype, weight_dtype), residual=True,
                               residual_dtype=residual_dtype)


def run_residual_bench(opts: ResidualBenchOptions, info: DeviceInfo, *, session: MeasureSession | None = None,
                       progress: Callable[[str, dict | None], None] | None = None,
                       checkpoint: Callable | None = None) -> ResidualReport:
    """Every (norm, shape) for normtune and the peers; `progress(message, row)` is called as rows land, and
    `checkpoint(report)` once each shape's rows are complete (the command writes its files then, so that a
    bench stopped part way keeps what it finished; "finished" is null in its provenance until the end)."""
    say = progress or (lambda msg, row=None: None)
    session = session or MeasureSession.for_device(info, cold=opts.cold, timing=opts.timing)
    peers = load_peers(opts.peers, lambda name: RESIDUAL_PEERS[name](), CPU_PEERS, info.interpret)
    started = dt.datetime.now(dt.timezone.utc)
    report = ResidualReport({
        "device": info.to_dict(), "peers": peer_versions(), **session.provenance(), "dtype": opts.dtype,
        "weight_dtype": opts.weight_dtype or opts.dtype, "residual_dtype": opts.residual_dtype or opts.dtype,
        "config": opts.config.to_json() if opts.config is not None else "runtime choice",
        "interpret": info.interpret, "started": started.isoformat(timespec="seconds"), "finished": None,
        "peer_descriptions": {n: RESIDUAL_PEERS[n].description for n in opts.peers},
    })
    for norm in opts.norms:
        for M, N in opts.shapes:
            problem = residual_problem(norm, M, N, opts.dtype, opts.weight_dtype, opts.residual_dtype)
            inputs = make_inputs(problem, session.device)
            ref = reference(problem, inputs)
            floor = session.floor_us(problem)
            block_floor = floor + forward_floor_bytes(problem) / (session.bandwidth_gbps * 1e3)
            base = {"norm": norm, "M": M, "N": N, "dtype": problem.dtype, "weight_dtype": problem.weight_dtype,
                    "residual_dtype": problem.residual_dtype, "floor_us": floor if math.isfinite(floor) else None,
                    "block_floor_us": block_floor if math.isfinite(block_floor) else None}
            impls = [(OURS, Normtune(opts.config))] + list(peers.items())
            host: list[HostCall] = []
            for name, impl in impls:
                row = _empty_row(base, name)
                impl_row(row, impl, problem,
                         partial(_time_impl, session, problem=problem, inputs=inputs, ref=ref, row=row, host=host),
                         "the interpreter runs only normtune, torch eager and torch.compile")
                report.rows.append(row)
                say(f"{norm} {M}x{N} {name}", row)
            host_rounds(session, host)
            del inputs, ref, host
            if checkpoint is not None:
                checkpoint(report)
            if session.on_gpu:
                torch.cuda.empty_cache()
    report.provenance["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return report


def load_peers(names, make: Callable[[str], object], cpu_peers, interpret: bool) -> dict[str, object]:
    """Each named peer made by `make(name)`, as `impl_row` takes it: None where the interpreter does not run it
    (not in `cpu_peers`), the exception where it failed to load (reported on every row of the peer)."""
    peers: dict[str, object] = {}
    for name in names:
        if interpret and name not in cpu_peers:
            peers[name] = None
            continue
        try:
            peers[name] = make(name)
        except Exception as err:  # noqa: BLE001 - reported on every row of the peer
            peers[name] = err
    return peers


def impl_row(row: dict, impl, subject, time: Callable, offline: str) -> dict:
    """One implementation's row of a block bench, from its empty `row`: unavailable where it does not run here
    (`impl` None: not under the interpreter, where `offline` says what does; an exception: it failed to load; or
    `impl.supports(subject)` says why not), else `time(impl)`'s figures; with the backward's fraction of the floor."""
    if impl is None:
        row.update(status="unavailable", error=offline)
    elif isinstance(impl, Exception):
        row.update(status="unavailable", error=f"{type(impl).__name__}: {impl}")
    elif (why := impl.supports(subject)) is not None:
        row.update(status="unavailable", error=why)
    else:
        row.update(time(impl))
    if row["floor_us"] and row["backward_us"]:
        row["floor_fraction"] = row["floor_us"] / row["backward_us"]
    return row


def _empty_row(base: dict, impl: str) -> dict:
    return {**base, "impl": impl, "status": "ok", "error": None, "note": "", "block_us": None, "block_p10_us": None,
            "block_p90_us": None, "backward_us": None, "backward_p10_us": None, "backward_p90_us": None,
            "forward_us": None, "block_kernel_sum_us": None, "backward_kernel_sum_us": None, "kernels_block": {},
            "kernels_backward": {}, "rel_err_dx": None, "rel_err_dresidual": None, "rel_err_dw": None,
            "floor_fraction": None, "block_host_us": None, "backward_host_us": None}


def check(problem: Problem, got: tuple, ref: dict) -> tuple[dict, str]:
    """Relative errors of (dx, dresidual, dw, db) against the float64 reference, and what is past the gate."""
    tol = GATE_TOLERANCE[problem.dtype]
    errors, bad = {}, []
    for name, value in zip(("dx", "dresidual", "dw", "db"), got):
        if ref[name] is None:
            continue
        err = relative_error(value, ref[name]) if value is not None else math.inf
        errors[name] = err
        if not err <= tol:
            bad.append(f"{name} relative error {err:.3g} > {tol:g}")
    return errors, "; ".join(bad)


def timed_views(session: MeasureSession, prepared, row: dict, host: list[HostCall]) -> dict:
    """A checked implementation's three views of a block bench: GPU time (host hidden) of the block and the
    backward with their kernel sums, and of the forward; its block and backward calls are added to `host`, to be
    host-timed (`block_host_us`, `backward_host_us`) with the other implementations' once all are prepared."""
    out = {}
    for view, fn in (("block", prepared.block), ("backward", prepared.backward)):
        stats = session.time_callable(fn)
        out.update({f"{view}_us": stats.median, f"{view}_p10_us": stats.p10, f"{view}_p90_us": stats.p90})
        kernels = session.kernel_times(fn)
        if kernels:
            out.update({f"kernels_{view}": kernels, f"{view}_kernel_sum_us": kernel_sum(kernels)})
    out["forward_us"] = session.time_callable(prepared.forward).median
    host += [HostCall(row, "block_host_us", prepared.block), HostCall(row, "backward_host_us", prepared.backward)]
    return out


def host_rounds(session: MeasureSession, host: list[HostCall]) -> None:
    """Host-time the calls `timed_views` collected for one case, in interleaved rounds."""
    measure_rounds(host, session.timing.host_reps, lambda fn: session.host_us(fn, reps=1))


def host_table(rows: list[dict], key: tuple, label: Callable[[dict], str]) -> list[str]:
    """Markdown lines: host µs per block / backward call, one column per implementation, one line per case."""
    timed = [r for r in rows if r["status"] == "ok" and r.get("block_host_us") is not None]
    if not timed:
        return []
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    cases = list(dict.fromkeys(tuple(r[k] for k in key) for r in timed))
    lines = ["", "Host µs per call (CPU time of one call, interleaved rounds): block / backward", "",
             "| case | " + " | ".join(impls) + " |", "|---|" + "---:|" * len(impls)]
    for case in cases:
        mine = {r["impl"]: r for r in timed if tuple(r[k] for k in key) == case}
        first = next(iter(mine.values()))
        cells = [f"{mine[i]['block_host_us']:.1f} / {mine[i]['backward_host_us']:.1f}" if i in mine else "–"
                 for i in impls]
        lines.append(f"| {label(first)} | " + " | ".join(cells) + " |")
    return lines


def _time_impl(session: MeasureSession, impl, problem: Problem, inputs, ref: dict, row: dict,
               host: list[HostCall]) -> dict:
    try:
        prepared = impl.prepare(problem, inputs)
        errors, bad = check(problem, prepared.block(), ref)
        out = {f"rel_err_{k}": v for k, v in errors.items() if k != "db"}
        if bad:
            return {**out, "status": "error", "error": f"wrong values: {bad}"}
        out["note"] = prepared.note
        return {**out, **timed_views(session, prepared, row, host)}
    except PeerUnavailable as err:
        return {"status": "unavailable", "error": str(err)}
    except Exception as err:  # noqa: BLE001 - a failing implementation is reported and the run goes on
        return {"status": "error", "error": f"{type(err).__name__}: {str(err)[:2000]}"}
    finally:
        if session.on_gpu:
            torch.cuda.synchronize(session.device)


# ------------------------------------------------------------------------------------------- summaries


def summary(rows: list[dict]) -> list[dict]:
    """One line per (norm, shape): normtune against the best peer in the block and in the backward alone."""
    out = []
    for ours in (r for r in rows if r["impl"] == OURS):
        key = (ours["norm"], ours["M"], ours["N"])
        peers = [r for r in rows if r["impl"] != OURS and r["status"] == "ok" and (r["norm"], r["M"], r["N"]) == key]
        line = {"norm": key[0], "M": key[1], "N": key[2], "status": ours["status"]}
        for view in ("block", "backward"):
            metric = f"{view}_us"
            timed = [r for r in peers if r.get(metric)]
            best = min(timed, key=lambda r: r[metric]) if timed else None
            mine = ours.get(metric) if ours["status"] == "ok" else None
            line.update({f"normtune_{view}_us": mine, f"best_peer_{view}": best["impl"] if best else None,
                         f"best_peer_{view}_us": best[metric] if best else None,
                         f"{view}_speedup": best[metric] / mine if (best and mine) else None})
        for view, floor in (("backward", ours.get("floor_us")), ("block", ours.get("block_floor_us"))):
            mine = line[f"normtune_{view}_us"]
            line[f"{view}_floor_fraction"] = floor / mine if (floor and mine) else None
        out.append(line)
    return out


def geomean(values) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def to_markdown(report: ResidualReport) -> str:
    p = report.provenance
    lines = [f"# Residual block h = x + r, y = norm(h): forward + backward, {p['dtype']} activations, "
             f"{p['residual_dtype']} residual stream, {p['weight_dtype']} weights", "",
             f"Device: {p['device'].get('name')}; " + ("times are interpreter wall-clock on the CPU, never GPU "
                                                       "time" if p["interpret"] else "GPU time with the host "
                                                       f"hidden (median), cold L2: {p.get('cold_l2')}") +
             f"; normtune's config: {p['config']}.", "",
             "| norm | M×N | normtune block µs | best peer | its µs | speedup | normtune bwd µs | best peer | its µs "
             "| speedup | floor fraction block / bwd |", "|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|"]

    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if v is not None else "–"

    rows = summary(report.rows)
    for s in rows:
        lines.append(f"| {s['norm']} | {s['M']}×{s['N']} | {f(s['normtune_block_us'])} | {s['best_peer_block'] or '–'} "
                     f"| {f(s['best_peer_block_us'])} | {f(s['block_speedup'], '{:.2f}×')} | "
                     f"{f(s['normtune_backward_us'])} | {s['best_peer_backward'] or '–'} | "
                     f"{f(s['best_peer_backward_us'])} | {f(s['backward_speedup'], '{:.2f}×')} | "
                     f"{f(s['block_floor_fraction'], '{:.3f}')} / {f(s['backward_floor_fraction'], '{:.3f}')} |")
    for norm in dict.fromkeys(s["norm"] for s in rows):
        mine = [s for s in rows if s["norm"] == norm]
        block, bwd = (geomean(s[f"{v}_speedup"] for s in mine) for v in ("block", "backward"))
        wins = sum(1 for s in mine if (s["block_speedup"] or 0) > 1)
        lines.append("")
        lines.append(f"{norm}: geometric mean {f(block, '{:.3f}×')} (block), {f(bwd, '{:.3f}×')} (backward); "
                     f"normtune faster than every peer in the block on {wins}/{len(mine)} shapes")
    lines += host_table(report.rows, ("norm", "M", "N"), lambda r: f"{r['norm']} {r['M']}×{r['N']}")
    problems = [r for r in report.rows if r["status"] != "ok"]
    if problems:
        lines += ["", "Not timed:"] + [f"- {r['norm']} {r['M']}×{r['N']} {r['impl']}: {r['status']}: {r['error']}"
                                       for r in problems]
    return "\n".join(lines) + "\n"


def write_all(report: ResidualReport, out_dir: str | Path) -> list[Path]:
    return write_block_files(out_dir, "residual", report, summary(report.rows), to_markdown(report))


def write_block_files(out_dir: str | Path, stem: str, report, summary_rows: list[dict], markdown: str) -> list[Path]:
    """A block bench's STEM.json (provenance, rows, summary) and STEM.md in `out_dir`, each replaced whole."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    write_atomic(paths[0], json.dumps({"provenance": report.provenance, "rows": report.rows,
                                       "summary": summary_rows}, indent=1, sort_keys=True, default=str) + "\n")
    write_atomic(paths[1], markdown)
    return paths
