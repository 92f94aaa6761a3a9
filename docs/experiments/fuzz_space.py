"""Random problems and random configs of their search spaces, each run through the sweep's correctness gate on
CPU (Triton's interpreter): outputs poisoned with NaN, then compared with the float64 reference.

    python docs/experiments/fuzz_space.py SECONDS [SEED]

Each draw is a problem (either norm; bf16, fp16 or fp32 activations; weights in that dtype or fp32; bias,
zero-centered weights, either save mode; the residual form with its stream in the activation dtype or fp32; a
quarter of the draws the gated RMSNorm, either gate position and activation; rows from 1 to 61 and widths from 1 to
4096, most not powers of two) and a config drawn uniformly from its space's domains until the space accepts one
(`Space.why_not`). Prints every failure (problem, config, status, error) and a count every 20 draws, until SECONDS
have passed.
"""

from __future__ import annotations

import os
import random
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"

from normtune.kernels.config import Problem  # noqa: E402
from normtune.kernels.device import INTERPRET_SM_COUNT  # noqa: E402
from normtune.tuner.measure.cases import make_case  # noqa: E402
from normtune.tuner.measure.harness import measure_config  # noqa: E402
from normtune.tuner.space import Space  # noqa: E402

ROWS = (1, 2, 3, 5, 7, 13, 17, 33, 61)
WIDTHS = (1, 3, 8, 40, 72, 96, 200, 256, 300, 1000, 1024, 1500, 2100, 2560, 4096)


def draw_problem(rng: random.Random) -> Problem:
    dtype = rng.choice(["bf16", "fp16", "fp32"])
    if rng.random() < 0.25:  # the gated RMSNorm: saves its input, no residual stream
        return Problem("rms_norm", rng.choice(ROWS), rng.choice(WIDTHS), dtype,
                       weight_dtype=rng.choice([dtype, "fp32"]), zero_centered=rng.random() < 0.3,
                       gate=rng.choice(["before", "after"]),
                       gate_activation=rng.choice(["silu", "sigmoid"]))
    norm = rng.choice(["rms_norm", "layer_norm"])
    residual = rng.random() < 0.4
    return Problem(norm, rng.choice(ROWS), rng.choice(WIDTHS), dtype, weight_dtype=rng.choice([dtype, "fp32"]),
                   has_bias=norm == "layer_norm" and rng.random() < 0.7, zero_centered=rng.random() < 0.3,
                   save=rng.choice(["input", "output"]), residual=residual,
                   residual_dtype=rng.choice([dtype, "fp32"]) if residual else None)


def draw_config(space: Space, rng: random.Random, tries: int = 200):
    domains = space.domains()
    for _ in range(tries):
        config = space.config({k: rng.choice(v) for k, v in domains.items()})
        if space.why_not(config) is None:
            return space.canonical(config)
    return None


def main() -> None:
    deadline = time.time() + float(sys.argv[1])
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    checked = failed = 0
    while time.time() < deadline:
        problem = draw_problem(rng)
        config = draw_config(Space(problem, INTERPRET_SM_COUNT), rng)
        if config is None:
            continue
        case = make_case(problem, "cpu", seed=rng.randrange(1 << 30))
        result = measure_config(case, config, flusher=None, bandwidth_gbps=1000.0, reference_grads=case.gate_reference(),
                                warmup=0, min_reps=1, max_reps=1, budget_s=0.0)
        checked += 1
        if result.status != "ok":
            failed += 1
            print("FAIL", problem.key, config.to_json(), result.status, (result.error or "")[:500], flush=True)
        if checked % 20 == 0:
            print(f"{checked} checked, {failed} failed", flush=True)
    print(f"done: {checked} checked, {failed} failed", flush=True)


if __name__ == "__main__":
    main()
