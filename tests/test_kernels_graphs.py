"""CUDA-graph capture of forward + backward: one captured step replays bitwise like eager calls, for every kernel
strategy (rows, columns, dual, row_split, fused reduction), and replays again correctly with new inputs.

GPU only: the capture needs real streams and compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from normtune.kernels import Problem, layer_norm, rms_norm
from normtune.kernels.device import sm_count
from normtune.tuner.space import Space

STRATEGIES = {
    "rows": lambda c: c.kernel_1.strategy == "rows" and c.kernel_1.row_split == 1 and not c.kernel_2.fused,
    "columns": lambda c: c.kernel_1.strategy == "columns",
    "dual": lambda c: c.kernel_1.strategy == "dual",
    "row_split": lambda c: c.kernel_1.strategy == "rows" and c.kernel_1.row_split > 1,
    "fused": lambda c: c.kernel_2.fused,
}
# (norm, M, N): a few-row shape (columns, dual, fused) and a wide one (row_split).
SHAPES = [("layer_norm", 256, 4096), ("rms_norm", 96, 12288), ("layer_norm", 1024, 16384)]


def _config_for(problem: Problem, strategy: str):
    seeds = Space(problem, sm_count(torch.device("cuda"))).seeds()
    return next((c for c in seeds if STRATEGIES[strategy](c)), None)


def _step(norm: str, x, w, b, g, config):
    y = layer_norm(x, w, b, config=config) if norm == "layer_norm" else rms_norm(x, w, config=config)
    dx, dw, *db = torch.autograd.grad(y, [x, w] + ([b] if b is not None else []), g)
    return [y, dx, dw] + db


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("norm,M,N", SHAPES, ids=[f"{n}-{m}x{k}" for n, m, k in SHAPES])
def test_graph_capture_replays_like_eager(norm, M, N, strategy):
    problem = Problem(norm, M, N, "bf16", has_bias=norm == "layer_norm")
    config = _config_for(problem, strategy)
    if config is None:
        pytest.skip(f"the search space has no {strategy} seed for {problem.key}")
    dev = torch.device("cuda")
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(N, device=dev)).to(torch.bfloat16).requires_grad_()
    b = (0.1 * torch.randn(N, device=dev)).to(torch.bfloat16).requires_grad_() if norm == "layer_norm" else None
    g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, caches) on the stream that captures
        for _ in range(2):
            _step(norm, x, w, b, g, config)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(norm, x, w, b, g, config)

    for _ in range(2):  # new inputs in the static tensors, then replay: outputs must match eager bitwise
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            g.copy_(torch.randn_like(g))
        graph.replay()
        torch.cuda.synchronize()
        eager = _step(norm, x, w, b, g, config)
        for name, c, e in zip(("y", "dx", "dw", "db"), captured, eager):
            assert torch.equal(c, e), f"{name}: the replayed graph differs from eager ({strategy}, {problem.key})"
