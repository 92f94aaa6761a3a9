"""`normtune bench`: normtune's backward and its peers, side by side, cold L2, on one device in one run.

Every implementation runs the backward of the same inputs (the forward once, untimed) and is reported in three
views (see `views.py`):
- `median_us`: GPU time with the host hidden: events around the whole backward behind a spin (`measure.py`).
  Every speedup and every "beats" claim rests on this view unless it is labelled kernel-sum.
- `kernel_sum_us`: the sum of the kernels' device times from torch.profiler (how peers usually report), with
  the per-kernel breakdown in `kernels`. With programmatic dependent launch (`pdl`), kernel_2's wait for
  kernel_1 is inside kernel_2's own time, so this view counts it; the GPU-time view spans the overlapped pair.
- `host_us` / `forward_host_us`: CPU time of one backward / forward call through each implementation's public
  API (normtune's `layer_norm`/`rms_norm` with autograd, like the peers'); for normtune also
  `host_direct_us` / `forward_host_direct_us`, its functions without autograd (`kernels/api/direct.py`): the call
  to set beside a peer timed without autograd (`autograd` false on its row: quack's LayerNorm). Every
  implementation of a case is host-timed in the same interleaved rounds, once all are prepared (`host_rounds.py`).
Rows are plain dicts (one per problem x implementation) so writers and the store stay simple.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from normtune.kernels.config import ConfigError, BackwardConfig, Problem, default_config
from normtune.kernels.limits import DeviceLimits
from normtune.kernels.select.select import select_config

from .cases import relative_error
from ..gpu_info import DeviceInfo, measured_limits, peer_versions, tool_versions
from .host_rounds import HostCall, measure_rounds
from .harness import TIMING, MeasureSession, Timing
from .peers import NormtuneAPI, PeerUnavailable, make_peer
from .views import kernel_sum

OURS = "normtune"
# A timing whose p90 is this many times its p10 was disturbed (another process, a clock change): it is taken
# once more and the steadier of the two kept, for every implementation alike, with a note saying so (a disturbed
# timing's median lands far above its steady runs': docs/perf-notes.md, "Why the tuner measures as it does").
DISTURBED_SPREAD = 1.5
PDL_NOTE = ("pdl: kernel_2 starts before kernel_1 ends and waits inside its own kernel time; the kernel-sum "
            "view counts the time both run at once only once")


@dataclass
class BenchOptions:
    norms: list[str]
    dtype: str
    shapes: list[tuple[int, int]]
    peers: list[str]
    config: str = "default"  # "default" | "table" | a JSON file | BackwardConfig JSON text
    weight_dtype: str | None = None
    cold: bool = True
    timing: Timing = TIMING["bench"]


@dataclass
class BenchReport:
    provenance: dict
    rows: list[dict] = field(default_factory=list)
    started_at: dt.datetime | None = None  # aware; when the bench began (before the device setup)
    finished_at: dt.datetime | None = None  # after its last measurement


def problem_for(norm: str, M: int, N: int, dtype: str, weight_dtype: str | None) -> Problem:
    """The benchmarked problem: LayerNorm with weight and bias, RMSNorm with weight, saving the input."""
    return Problem(norm, M, N, dtype, weight_dtype, has_weight=True, has_bias=norm == "layer_norm")


def parse_config_option(spec: str) -> BackwardConfig | str:
    """--config: 'default' | 'table' (kept as words) | JSON text (starts with '{') | a JSON file. Raises
    FileNotFoundError for a file that does not exist and ConfigError for JSON that is not a config."""
    if spec in ("default", "table"):
        return spec
    if spec.lstrip().startswith("{"):
        return BackwardConfig.from_json(spec)
    if not os.path.isfile(spec):
        raise FileNotFoundError(f"--config {spec}: no such file (give default, table, a JSON file or JSON text "
                                "such as '{\"kernel_1\": {...}, \"kernel_2\": {...}}')")
    with open(spec) as fh:
        text = fh.read()
    try:
        return BackwardConfig.from_json(text)
    except ConfigError as err:
        raise ConfigError(f"--config {spec}: {err}") from None


def resolve_bench_config(spec: BackwardConfig | str, problem: Problem, info: DeviceInfo,
                         limits: DeviceLimits | None = None) -> tuple[BackwardConfig, str]:
    """(config, how it was chosen) for a parsed --config, as the runtime chooses it on the device of `limits` (the
    GPU measured on: `device.measured_limits`; None: the reference device's, as on CPU)."""
    if spec == "default":
        return default_config(problem, limits), "default"
    if spec == "table":
        cc = tuple(int(x) for x in info.compute_capability.split(".")) if info.compute_capability else None
        name = None if info.interpret else info.name
        return select_config(problem, name, cc, limits), "table"
    if isinstance(spec, str):
        spec = parse_config_option(spec)
    return spec.validate(problem), "explicit"


def _nan_to_none(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def _empty_row(base: dict, impl: str) -> dict:
    return {**base, "impl": impl, "status": "ok", "error": None, "median_us": None, "p10_us": None,
            "p90_us": None, "reps": 0, "kernel_1_us": None, "kernel_2_us": None, "kernel_sum_us": None,
            "kernels": {}, "host_us": None, "forward_host_us": None, "host_direct_us": None,
            "forward_host_direct_us": None, "autograd": True, "pdl": False, "rel_err_dx": None,
            "config": None, "config_source": None, "note": ""}


def run_bench(opts: BenchOptions, info: DeviceInfo, *, session: MeasureSession | None = None,
              progress: Callable[[str, dict | None], None] | None = None,
              checkpoint: Callable | None = None) -> BenchReport:
    """Run every (norm, shape) for normtune and the peers; `progress(message, row)` is called as rows land, and
    `checkpoint(report)` once each shape's rows are complete (the command writes its tables then, so that a bench
    stopped part way keeps what it finished; "finished" is null in its provenance until the end)."""
    say = progress or (lambda msg, row=None: None)
    started_at = dt.datetime.now(dt.timezone.utc)
    config_spec = parse_config_option(opts.config) if isinstance(opts.config, str) else opts.config
    session = session or MeasureSession.for_device(info, cold=opts.cold, timing=opts.timing)
    limits = measured_limits(session.device)
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
        "device": info.to_dict(), "peers": peer_versions(), "tools": tool_versions(), **session.provenance(),
        "dtype": opts.dtype,
        "weight_dtype": opts.weight_dtype or opts.dtype, "config": opts.config if isinstance(opts.config, str)
        else opts.config.to_json(), "interpret": info.interpret, "started": _local_time(started_at), "finished": None,
        "peer_descriptions": {n: (p.description if hasattr(p, "description") else None) for n, p in peers.items()},
    }
    report = BenchReport(provenance, started_at=started_at)
    for norm in opts.norms:
        for M, N in opts.shapes:
            problem = problem_for(norm, M, N, opts.dtype, opts.weight_dtype)
            case = session.case(problem)
            ref = case.reference()
            floor = session.floor_us(problem)
            base = {"norm": norm, "M": M, "N": N, "dtype": problem.dtype, "weight_dtype": problem.weight_dtype,
                    "floor_us": _nan_to_none(floor)}
            config, chosen = resolve_bench_config(config_spec, problem, info, limits)
            host: list[HostCall] = []  # every implementation's calls, host-timed together once all are ready
            rows = [_time_ours(session, case, ref, config, chosen, _empty_row(base, OURS), host)]
            for name, peer in peers.items():
                row = _empty_row(base, name)
                if peer is None:
                    row.update(status="unavailable", error="the interpreter runs only normtune and torch eager")
                elif isinstance(peer, Exception):
                    row.update(status="unavailable", error=f"{type(peer).__name__}: {peer}")
                elif (why := peer.supports(problem)) is not None:
                    row.update(status="unavailable", error=why)
                else:
                    row.update(_time_peer(session, peer, problem, case, ref, row, host))
                rows.append(row)
            measure_rounds(host, session.timing.host_reps, lambda fn: session.host_us(fn, reps=1))
            for row in rows:
                report.rows.append(_finish(row, floor))
                say(f"{norm} {M}x{N} {row['impl']}", row)
            del case, ref, host, rows
            if checkpoint is not None:
                checkpoint(report)
            if session.on_gpu:
                torch.cuda.empty_cache()
    report.finished_at = dt.datetime.now(dt.timezone.utc)
    report.provenance["finished"] = _local_time(report.finished_at)
    return report


def _local_time(at: dt.datetime) -> str:
    return at.astimezone().strftime("%Y-%m-%dT%H:%M:%S%z")


def spread(p10: float | None, p90: float | None) -> float:
    """p90 / p10 of a timing (1.0 when either is missing)."""
    return (p90 / p10) if (p10 and p90) else 1.0


def steadier(measure: Callable[[], object], spread_of: Callable[[object], float], *,
             retake: bool = True) -> tuple[object, str]:
    """`measure()`, taken once more (when `retake`: on a GPU) if its spread is past DISTURBED_SPREAD; the
    steadier of the two and a note ("" when the first was steady)."""
    first = measure()
    first_spread = spread_of(first)
    if not retake or first_spread <= DISTURBED_SPREAD:
        return first, ""
    again = measure()
    kept = again if spread_of(again) < first_spread else first
    return kept, (f"re-timed: a timing's p90/p10 was {first_spread:.2f}, the other's {spread_of(again):.2f}; "
                  "the steadier kept")


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _time_ours(session: MeasureSession, case, ref, config: BackwardConfig, chosen: str, row: dict,
               host: list[HostCall]) -> dict:
    """normtune's row: its GPU time and kernel sum; its four host-timed calls are added to `host`."""
    res, retimed = steadier(lambda: session.measure(case, config, reference_grads=ref),
                            lambda r: spread(r.p10_us, r.p90_us) if r.status == "ok" else 1.0, retake=session.on_gpu)
    row.update(status=res.status, error=res.error, median_us=res.median_us, p10_us=res.p10_us, p90_us=res.p90_us,
               reps=res.reps, kernel_1_us=res.kernel_1_us, kernel_2_us=res.kernel_2_us,
               kernels={"kernel_1": res.kernel_1_us, "kernel_2": res.kernel_2_us}, rel_err_dx=res.errors.get("dx"),
               config=config.to_dict(), config_source=chosen)
    if res.status != "ok":
        return row
    launch = case.launch(config)
    row["pdl"] = bool(launch.pdl)
    row["note"] = _join(PDL_NOTE if launch.pdl else "", retimed)
    row.update(_other_views(session, launch.run, row))
    api = NormtuneAPI().prepare(case.problem, case.x, case.weight, case.bias, case.grad,
                                None if chosen == "table" else config)
    direct = NormtuneAPI().prepare_direct(case.problem, case.x, case.weight, case.bias, case.grad,
                                          None if chosen == "table" else config)
    host += [HostCall(row, "host_us", api.run), HostCall(row, "forward_host_us", api.forward),
             HostCall(row, "host_direct_us", direct.run), HostCall(row, "forward_host_direct_us", direct.forward)]
    return row


def _other_views(session: MeasureSession, backward: Callable[[], object], row: dict) -> dict:
    """The kernel-sum view of `backward` (kernels replaced by the profiler's breakdown where there is one)."""
    try:
        kernels = session.kernel_times(backward)
    except Exception as err:  # noqa: BLE001 - a breakdown failure must not lose the timing
        return {"note": (row["note"] + "; " if row["note"] else "") + f"profiler failed: {err}"}
    return {"kernels": kernels, "kernel_sum_us": kernel_sum(kernels)} if kernels else {}


def _time_peer(session: MeasureSession, peer, problem, case, ref, row: dict, host: list[HostCall]) -> dict:
    """A peer's GPU time and kernel sum (the updates to its `row`); its host-timed calls are added to `host`."""
    try:
        prepared = peer.prepare(problem, case.x, case.weight, case.bias, case.grad)
        got = prepared.run()
        if session.on_gpu:
            torch.cuda.synchronize(session.device)
        stats, retimed = steadier(lambda: session.time_callable(prepared.run), lambda t: spread(t.p10, t.p90),
                                  retake=session.on_gpu)
        out = {"rel_err_dx": relative_error(got[0], ref[0]), "note": _join(prepared.note, retimed)}
        out.update(median_us=stats.median, p10_us=stats.p10, p90_us=stats.p90, reps=stats.count)
        out.update(_other_views(session, prepared.run, out))
        out["autograd"] = prepared.autograd
        host.append(HostCall(row, "host_us", prepared.run))
        if prepared.forward:
            host.append(HostCall(row, "forward_host_us", prepared.forward))
        return out
    except PeerUnavailable as err:
        return {"status": "unavailable", "error": str(err)}
    except Exception as err:  # noqa: BLE001 - a failing peer is reported and the run goes on
        return {"status": "error", "error": f"{type(err).__name__}: {str(err)[:2000]}"}
    finally:
        if session.on_gpu:
            torch.cuda.synchronize(session.device)


def _finish(row: dict, floor: float) -> dict:
    t = row.get("median_us")
    row["floor_fraction"] = (floor / t) if (t and floor and math.isfinite(floor)) else None
    return row


# ------------------------------------------------------------------------------------------- summaries


def best_peer_rows(rows: list[dict], metric: str = "median_us") -> dict[tuple, dict]:
    """(norm, M, N) → the ok peer row with the lowest `metric` (median_us: GPU time; kernel_sum_us)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["impl"] == OURS or r["status"] != "ok" or r.get(metric) is None:
            continue
        key = (r["norm"], r["M"], r["N"])
        if key not in best or r[metric] < best[key][metric]:
            best[key] = r
    return best


def summary(rows: list[dict]) -> list[dict]:
    """One line per problem: normtune vs the best peer in the GPU-time view and in the kernel-sum view."""
    best, best_ks = best_peer_rows(rows), best_peer_rows(rows, "kernel_sum_us")
    out = []
    for r in rows:
        if r["impl"] != OURS:
            continue
        key = (r["norm"], r["M"], r["N"])
        bp, bk = best.get(key), best_ks.get(key)
        ok = r["status"] == "ok"
        ours, ours_ks = (r["median_us"], r.get("kernel_sum_us")) if ok else (None, None)
        out.append({
            "norm": r["norm"], "M": r["M"], "N": r["N"], "normtune_us": ours, "kernel_1_us": r["kernel_1_us"],
            "kernel_2_us": r["kernel_2_us"], "best_peer": bp["impl"] if bp else None,
            "best_peer_us": bp["median_us"] if bp else None, "floor_us": r["floor_us"],
            "speedup": (bp["median_us"] / ours) if (bp and ours) else None,
            "normtune_kernel_sum_us": ours_ks, "best_peer_kernel_sum": bk["impl"] if bk else None,
            "best_peer_kernel_sum_us": bk["kernel_sum_us"] if bk else None,
            "kernel_sum_speedup": (bk["kernel_sum_us"] / ours_ks) if (bk and ours_ks) else None,
            "host_us": r.get("host_us"), "forward_host_us": r.get("forward_host_us"), "pdl": r.get("pdl", False),
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
    """Record a bench run: normtune's rows as measurements (source "bench-<config source>"), peers as peer
    results. The run row spans the bench: it starts when the bench began and ends once its rows are stored."""
    from ..gpu_info import command_line
    from .results import MeasureResult

    run_id = store.start_run(info, kind="bench", command_line=command_line(),
                             copy_bandwidth_gbps=report.provenance.get("copy_bandwidth_gbps"),
                             started_at=report.started_at)
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
