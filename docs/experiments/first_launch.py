"""Where a config's first launch in a fresh process goes: the sweep's `load` phase.

The sweep compiles each config ahead in a compile process (`sweep/compiling.compile_one`, which runs
`kernels.backward.precompile`) and then measures it in the measuring process, whose first launch of the config
finds the binary in Triton's disk cache, loads it and builds its launcher. This script does the same for a sample
of configs of one problem and splits that first launch:

- phase 1, a child process: `compile_one` for every config (as the compile pool does);
- phase 2, this process: for every config, the plan and buffers (`Case.launch`), then the first `run()` and a
  synchronize, timed, under cProfile, counting Triton's compiles and disk-cache hits with its compilation
  listener where this Triton has one.

    python3 docs/experiments/first_launch.py OUT_DIR [--norm rms_norm] [--shape 8192x4096] [--configs 40]

Writes OUT_DIR/first_launch.txt: the distribution of the first-launch seconds, the cache hits and compiles, and
cProfile's top functions by cumulative time. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import multiprocessing as mp
import pstats
import random
import statistics
import sys
import time
from pathlib import Path


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--norm", default="rms_norm", choices=("rms_norm", "layer_norm"))
    ap.add_argument("--shape", default="8192x4096")
    ap.add_argument("--configs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def sample(problem, sms, limits, k, seed):
    """The space's seeds, then configs drawn at random from its first 20000, up to k."""
    from normtune.tuner.space import Space

    space = Space(problem, sms, limits)
    configs = list(dict.fromkeys(space.seeds()))
    pool = [c for c in itertools.islice(space, 20000) if c not in configs]
    random.Random(seed).shuffle(pool)
    return (configs + pool)[:k]


def compile_ahead(problem_dict, configs_json, sms):
    """Phase 1, in a child process: the compile pool's job for each config."""
    import torch

    from normtune.tuner.sweep.compiling import compile_one

    torch.cuda.set_device(0)
    return [compile_one(problem_dict, c, sms) for c in configs_json]


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from normtune.kernels.problem import Problem
    from normtune.kernels.config import BackwardConfig
    from normtune.tuner.gpu_info import measured_limits
    from normtune.tuner.measure.cases import make_case

    if not torch.cuda.is_available():
        print("first_launch.py: needs a CUDA GPU", file=sys.stderr)
        return 1
    M, N = (int(v) for v in args.shape.lower().split("x"))
    problem = Problem(args.norm, M, N, "bf16", "bf16", has_weight=True, has_bias=args.norm == "layer_norm")
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = sample(problem, sms, measured_limits(device), args.configs, args.seed)

    t = time.perf_counter()
    with mp.get_context("spawn").Pool(1) as pool:
        compiled = pool.apply(compile_ahead, (problem.to_dict(), [c.to_json() for c in configs], sms))
    ahead_s = time.perf_counter() - t
    ok = [c for c, (status, _, _) in zip(configs, compiled) if status == "ok"]

    events = {"hits": 0, "compiles": 0}
    try:
        from triton import knobs

        def listener(*, cache_hit, **_):
            events["hits" if cache_hit else "compiles"] += 1

        knobs.compilation.listener = listener
    except (ImportError, AttributeError):
        events = None

    case = make_case(problem, device)
    BackwardConfig.from_json(ok[0].to_json())  # imports settled before the timed loop
    plan_s, first_s = [], []
    profiler = cProfile.Profile()
    for config in ok:
        t0 = time.perf_counter()
        launch = case.launch(config)
        t1 = time.perf_counter()
        profiler.enable()
        launch.run()
        torch.cuda.synchronize(device)
        profiler.disable()
        t2 = time.perf_counter()
        plan_s.append(t1 - t0)
        first_s.append(t2 - t1)
    t = time.perf_counter()
    for config in ok:  # a second launch of each: what a launch costs once loaded
        case.launch(config).run()
    torch.cuda.synchronize(device)
    again_s = (time.perf_counter() - t) / max(1, len(ok))

    def dist(xs):
        xs = sorted(xs)
        return (f"median {1e3 * statistics.median(xs):.1f} ms, p10 {1e3 * xs[len(xs) // 10]:.1f}, "
                f"p90 {1e3 * xs[(9 * len(xs)) // 10]:.1f}, max {1e3 * xs[-1]:.1f}, total {sum(xs):.2f} s")

    text = io.StringIO()
    profile = pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("cumulative")
    profile.print_stats(35)
    lines = [f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}; {problem.key}",
             f"{len(configs)} configs, {len(ok)} compiled ahead in {ahead_s:.1f} s (one process)",
             f"plan and buffers (Case.launch): {dist(plan_s)}",
             f"first run + synchronize: {dist(first_s)}",
             f"a later launch of the same config: {1e3 * again_s:.2f} ms",
             f"Triton during the first runs: {events if events is not None else 'no compilation listener'}",
             "", text.getvalue()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "first_launch.txt").write_text("\n".join(lines))
    print("\n".join(lines[:6]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
