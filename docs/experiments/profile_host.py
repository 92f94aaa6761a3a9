"""Where host time goes, on a CUDA host: one backward call through the public API, one Triton launch (through
`JITFunction` and straight through the compiled kernel's launcher), and one sweep trial's measurement.

    python3 docs/experiments/profile_host.py [OUT_DIR] [PART,PART…]   (parts: the functions run at the end)

Prints (and writes OUT_DIR/profile_host.txt) host µs per call, the top of cProfile's listing for each, and the
bitwise check that a direct launch computes what the JIT launch computes.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys
import time

import torch

from normtune.kernels import layer_norm, rms_norm
from normtune.kernels.backward_launch import BackwardLaunch
from normtune.kernels.config import Problem
from normtune.kernels.config import default_config
from normtune.tuner.measure.cases import make_case
from normtune.tuner.measure.harness import TIMING, MeasureSession
from normtune.tuner.space import Space

LINES: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)
    LINES.append(text)


def per_call_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) * 1e6 / calls)
        torch.cuda.synchronize()
    return best


def profile(fn, calls: int = 300, top: int = 22, sort: str = "tottime") -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    say_profile(prof, top, sort)


def say_profile(prof: cProfile.Profile, top: int, sort: str = "cumulative", width: int = 160) -> None:
    """The `top` rows of a profile, sorted by `sort`, indented."""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
    for line in buf.getvalue().splitlines():
        if line.strip():
            say("    " + line[:width])


def api_calls() -> None:
    dev = torch.device("cuda")
    M, N = 4096, 4096
    for name in ("rms_norm", "layer_norm"):
        x = torch.randn(M, N, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, device=dev, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(N, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        fwd = (lambda: rms_norm(x, w)) if name == "rms_norm" else (lambda: layer_norm(x, w, b))
        y = fwd()
        inputs = (x, w) if name == "rms_norm" else (x, w, b)
        bwd = lambda: torch.autograd.grad(y, inputs, g, retain_graph=True)  # noqa: E731
        say(f"{name} {M}x{N} bf16: forward {per_call_us(fwd):.1f} µs/call, backward {per_call_us(bwd):.1f} µs/call")
        say(f"  cProfile of the backward ({name}), by own time:")
        profile(bwd)


def launches() -> None:
    dev = torch.device("cuda")
    problem = Problem("rms_norm", 4096, 4096, "bf16", "bf16", True, False)
    case = make_case(problem, dev)
    config = default_config(problem)
    launch = case.launch(config)
    launch.run()
    torch.cuda.synchronize()
    pl = launch.plan
    jit = pl.stage_1[0].kernel
    k1_args = launch.arguments[0]
    say(f"kernel_1 through normtune's launcher: {per_call_us(launch.kernel_1):.1f} µs/launch")
    say(f"kernel_2 through normtune's launcher: {per_call_us(launch.kernel_2):.1f} µs/launch")
    say(f"kernel_1 through JITFunction: "
        f"{per_call_us(lambda: jit[(pl.programs,)](*k1_args, **pl.k1_kwargs)):.1f} µs/launch")
    compiled = jit[(pl.programs,)](*k1_args, **pl.k1_kwargs)
    compiled._init_handles()
    runtime_args = list(k1_args)
    full = []
    for p in jit.params:
        if p.is_constexpr:
            if p.name in pl.k1_kwargs:
                full.append(pl.k1_kwargs[p.name])
            else:
                full.append(jit.signature.parameters[p.name].default)
        else:
            full.append(runtime_args.pop(0))
    run = compiled.run
    function, packed = compiled.function, compiled.packed_metadata
    stream_of = torch._C._cuda_getCurrentRawStream

    def direct():
        run(pl.programs, 1, 1, stream_of(0), function, packed, None, None, None, *full)

    say(f"kernel_1 through its compiled launcher: {per_call_us(direct):.1f} µs/launch")
    launch.dx.fill_(float("nan"))
    launch.kernel_1()
    ref = launch.dx.clone()
    launch.dx.fill_(float("nan"))
    direct()
    torch.cuda.synchronize()
    say(f"direct launch bitwise equal to the JIT launch: {torch.equal(ref, launch.dx)}")
    say("  cProfile of kernel_1 through normtune's launcher:")
    profile(launch.kernel_1, top=8)
    from normtune.tuner.measure.views import host_us_per_call

    def busy(fn) -> float:  # the bench's host view: calls issued while the GPU is kept busy by a spin
        return host_us_per_call(fn, device=dev, calls=20, reps=5)

    tensors_as_ints = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in full]
    say(f"GPU busy: kernel_1 JITFunction {busy(lambda: jit[(pl.programs,)](*k1_args, **pl.k1_kwargs)):.1f}, "
        f"normtune's launcher {busy(launch.kernel_1):.1f}, compiled launcher with tensors {busy(direct):.1f}, "
        f"with addresses {busy(lambda: run(pl.programs, 1, 1, stream_of(0), function, packed, None, None, None, *tensors_as_ints)):.1f}, "
        f"torch.empty {busy(lambda: torch.empty((4096, 4096), dtype=torch.bfloat16, device=dev)):.1f} µs/call")
    say(f"torch.empty((4096,4096)) bf16: {per_call_us(lambda: torch.empty((4096, 4096), dtype=torch.bfloat16, device=dev)):.1f} µs")


def random_configs(space: Space, n: int) -> list:
    rng, domains, configs = random.Random(0), space.domains(), []
    while len(configs) < n:
        config = space.config({k: rng.choice(v) for k, v in domains.items()})
        if space.why_not(config) is None:
            configs.append(space.canonical(config))
    return configs


def bench_view() -> None:
    """Host µs per call as `normtune bench` measures it (GPU kept busy), before and after a profiler session in
    the same process (the bench runs the profiler for its kernel-sum view first)."""
    from normtune.tuner.measure.peers import NormtuneAPI, PeerUnavailable, make_peer

    dev = torch.device("cuda")
    session = MeasureSession(dev, l2_bytes=torch.cuda.get_device_properties(dev).L2_cache_size,
                             timing=TIMING["bench"])
    for norm in ("rms_norm", "layer_norm"):
        problem = Problem(norm, 4096, 4096, "bf16", "bf16", True, norm == "layer_norm")
        case = session.case(problem)
        prepared = {}
        for name in ("normtune", "torch", "compile", "liger", "quack"):
            try:
                if name == "normtune":
                    prepared[name] = NormtuneAPI().prepare(problem, case.x, case.weight, case.bias, case.grad, None)
                else:
                    prepared[name] = make_peer(name).prepare(problem, case.x, case.weight, case.bias, case.grad)
            except (PeerUnavailable, ImportError) as err:
                say(f"  {name}: unavailable ({err})")
        for when in ("before the profiler", "after the profiler"):
            figures = []
            for name, p in prepared.items():
                p.run()
                figures.append(f"{name} {session.host_us(p.run):.1f}/{session.host_us(p.forward):.1f}")
            say(f"{problem.key} host µs backward/forward, {when}: " + ", ".join(figures))
            if when == "before the profiler":
                for p in prepared.values():
                    session.kernel_times(p.run)


def sweep_trials(n: int = 30) -> None:
    dev = torch.device("cuda")
    session = MeasureSession(dev, l2_bytes=torch.cuda.get_device_properties(dev).L2_cache_size,
                             timing=TIMING["sweep"])
    for shape in ((8192, 4096), (2048, 16384), (32768, 1024)):
        problem = Problem("rms_norm", *shape, "bf16", "bf16", True, False)
        space = Space(problem, torch.cuda.get_device_properties(dev).multi_processor_count)
        configs = random_configs(space, n)
        session.measure_problem(problem, configs[0])  # inputs and reference
        for c in configs:  # compile everything first: the sweep compiles ahead in other processes
            try:
                session.measure_problem(problem, c)
            except Exception:  # noqa: BLE001
                pass
        t = time.perf_counter()
        prof = cProfile.Profile()
        prof.enable()
        statuses = [session.measure_problem(problem, c).status for c in configs]
        prof.disable()
        per = (time.perf_counter() - t) / len(configs)
        say(f"sweep trial measurement {shape}: {per * 1e3:.1f} ms/trial over {len(configs)} compiled configs "
            f"({statuses.count('ok')} ok)")
        say_profile(prof, 25)


def first_launches(n: int = 20) -> None:
    """A sweep trial's measurement when its kernels are in Triton's disk cache (compiled by other processes, as
    the sweep's compile-ahead workers do) but not yet loaded in the measuring process."""
    from normtune.tuner.sweep.compiling import compile_one, compile_pool

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    session = MeasureSession(dev, l2_bytes=torch.cuda.get_device_properties(dev).L2_cache_size,
                             timing=TIMING["sweep"])
    problem = Problem("rms_norm", 4096, 8192, "bf16", "bf16", True, False)
    configs = random_configs(Space(problem, sms), n + 1)
    pool = compile_pool(4, 0)
    t = time.perf_counter()
    statuses = list(pool.map(compile_one, [problem.to_dict()] * len(configs), [c.to_json() for c in configs],
                             [sms] * len(configs)))
    pool.shutdown()
    say(f"compiled {len(configs)} configs in 4 other processes: {time.perf_counter() - t:.1f} s "
        f"({sum(1 for s in statuses if s[0] == 'ok')} ok)")
    session.measure_problem(problem, configs[0])
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    results = [session.measure_problem(problem, c) for c in configs[1:]]
    prof.disable()
    per = (time.perf_counter() - t) / n
    say(f"first measurement of a disk-cached config: {per * 1e3:.1f} ms/trial "
        f"({sum(1 for r in results if r.status == 'ok')} ok)")
    t = time.perf_counter()
    again = [session.measure_problem(problem, c) for c in configs[1:]]
    say(f"second measurement of the same configs: {(time.perf_counter() - t) / n * 1e3:.1f} ms/trial "
        f"({sum(1 for r in again if r.status == 'ok')} ok)")
    say_profile(prof, 30, width=170)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    say(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    parts = {f.__name__: f for f in (api_calls, launches, bench_view, sweep_trials, first_launches)}
    chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else list(parts)
    for part in (parts[name] for name in chosen):
        try:
            part()
        except Exception as err:  # noqa: BLE001 - keep the other parts' figures
            say(f"{part.__name__} failed: {type(err).__name__}: {err}")
    with open(f"{out}/profile_host.txt", "w") as fh:
        fh.write("\n".join(LINES) + "\n")
