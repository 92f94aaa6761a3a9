"""The backward's per-stream scratch (`kernels/backward/workspace.py`): kernel_1's partial rows, the split-row
exchange and the columns strategy's row sums are carved from one buffer per stream instead of allocated per call.
Consecutive backwards on a stream reuse it and still compute bitwise the same results; outputs are never scratch;
past the size limit, and while a CUDA graph is captured, calls allocate their own."""

from __future__ import annotations

import pytest
import torch

from normtune.kernels import Problem
from normtune.kernels.backward import workspace
from normtune.kernels.backward.workspace import scratch
from normtune.tuner.measure.cases import make_case
from normtune.tuner.space import Space


@pytest.fixture(autouse=True)
def _fresh_scratch():
    workspace.clear_scratch()
    yield
    workspace.clear_scratch()


def _config(problem: Problem, want):
    return next((c for c in Space(problem, 4).seeds() if want(c)), None)


def test_views_are_aligned_distinct_and_made_once(device):
    dev = torch.device(device)
    shapes = ((3, 5), None, (7,), (2, 3))
    views = scratch(dev, shapes)
    assert views[1] is None and [tuple(v.shape) for v in (views[0], views[2], views[3])] == [(3, 5), (7,), (2, 3)]
    assert all(v.dtype == torch.float32 and v.data_ptr() % 16 == 0 for v in (views[0], views[2], views[3]))
    spans = sorted((v.data_ptr(), v.data_ptr() + 4 * v.numel()) for v in (views[0], views[2], views[3]))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "two views overlap"
    assert scratch(dev, shapes) is views  # the second call of a set of shapes is a dict lookup


def test_a_larger_set_gets_a_larger_buffer_and_older_views_stay_valid(device):
    dev = torch.device(device)
    small = scratch(dev, ((4, 4),))
    small[0].fill_(1.0)
    large = scratch(dev, ((64, 64), (64, 64)))
    assert large[0].data_ptr() != small[0].data_ptr() or large[0].numel() > small[0].numel()
    assert bool((small[0] == 1.0).all()), "the views a launch holds keep their memory"
    again = scratch(dev, ((4, 4),))  # carved again from the larger buffer
    assert again[0].data_ptr() == large[0].data_ptr()


def test_past_the_limit_each_call_allocates(device, monkeypatch):
    monkeypatch.setattr(workspace, "MAX_SCRATCH_BYTES", 64)
    dev = torch.device(device)
    first, second = scratch(dev, ((8, 8),)), scratch(dev, ((8, 8),))
    assert first[0].data_ptr() != second[0].data_ptr()
    assert not workspace._SCRATCH


@pytest.mark.parametrize("norm,M,N,want", [
    ("layer_norm", 37, 200, lambda c: c.kernel_1.strategy == "rows" and c.kernel_1.row_split == 1),
    ("rms_norm", 130, 1000, lambda c: c.kernel_1.strategy == "rows" and c.kernel_1.row_split > 1),
    ("layer_norm", 9, 3000, lambda c: c.kernel_1.strategy == "columns"),
])
def test_consecutive_backwards_share_scratch_and_agree_bitwise(device, norm, M, N, want):
    problem = Problem(norm, M, N, "bf16", has_bias=norm == "layer_norm")
    config = _config(problem, want)
    if config is None:
        pytest.skip(f"no such seed for {problem.key}")
    case = make_case(problem, device)
    first = case.launch(config)
    out_a = [t.clone() if t is not None else None for t in first.run()]
    second = case.launch(config)
    assert second.dx.data_ptr() != first.dx.data_ptr(), "outputs are the call's own"
    if first.partial_dw is not None:
        assert second.partial_dw.data_ptr() == first.partial_dw.data_ptr(), "partial rows come from the scratch"
    out_b = second.run()
    for name, a, b in zip(("dx", "dw", "db"), out_a, out_b):
        if a is not None:
            assert torch.equal(a, b), f"{name} differs when the scratch is reused"


@pytest.mark.gpu
def test_streams_and_graph_captures_never_share_scratch():
    dev = torch.device("cuda")
    shapes = ((16, 256),)
    here = scratch(dev, shapes)[0]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        there = scratch(dev, shapes)[0]
    assert there.data_ptr() != here.data_ptr()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = scratch(dev, shapes)[0]
        captured.fill_(2.0)
    assert captured.data_ptr() not in (here.data_ptr(), there.data_ptr())
    assert scratch(dev, shapes)[0] is here
