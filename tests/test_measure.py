"""`normtune.tuner.measure.harness` (statistics, bytes and floor, the correctness gate, failure classification, one
measurement in the interpreter) and the bench writers of `normtune.tuner.measure.bench_output`.

Kernels run on the `device` fixture's device: CPU through the Triton interpreter without a GPU (see conftest.py).
Timings are only checked for their shape (finite, positive, consistent with each other), never their values.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import time

import numpy as np
import pytest
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from normtune.kernels import backward_launch as kbackward
from normtune.kernels.backward_launch import BackwardLaunch
from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, default_config, kernel_1_config
from normtune.kernels.device import sm_count
from normtune.kernels.strategies import num_programs, partial_rows
from normtune.tuner.measure import bench_output
from normtune.tuner.measure.bench import OURS, BenchReport, summary
from normtune.tuner.gpu_info import detect
from normtune.tuner.measure.harness import (GATE_TOLERANCE, MeasureResult, Stats, bytes_moved, classify_exception,
                                    floor_bytes, floor_us, gate, make_case, measure_config, percentile)
from normtune.tuner.measure.stopwatch import L2Flusher, flush_size

# Fast timing for the interpreter: the figures only need to exist.
FAST = dict(warmup=0, min_reps=2, max_reps=2, budget_s=0.0)
BANDWIDTH = 1000.0  # GB/s: any positive value gives a finite floor


# ---------------------------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [2.5, 9.0, -1.0, 7.25, 7.25, 0.0, 13.0],
                                    list(np.random.default_rng(7).normal(50, 9, size=101))])
@pytest.mark.parametrize("q", [0, 10, 33.3, 50, 90, 99, 100])
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)


def test_percentile_of_nothing_is_nan_and_input_is_not_reordered():
    assert math.isnan(percentile([], 50))
    values = [3.0, 1.0, 2.0]
    percentile(values, 50)
    assert values == [3.0, 1.0, 2.0]


def test_stats_of_matches_numpy():
    values = list(np.random.default_rng(3).exponential(20.0, size=37))
    s = Stats.of(values)
    assert s.count == 37
    assert s.median == pytest.approx(np.median(values))
    assert s.p10 == pytest.approx(np.percentile(values, 10))
    assert s.p90 == pytest.approx(np.percentile(values, 90))
    assert s.p10 <= s.median <= s.p90


# ------------------------------------------------------------------------------------------ bytes and floor


def test_floor_bytes_is_three_passes_over_the_activations():
    assert floor_bytes(Problem("layer_norm", 3, 5, "bf16")) == 3 * 3 * 5 * 2
    assert floor_bytes(Problem("rms_norm", 7, 33, "fp32")) == 3 * 7 * 33 * 4
    assert floor_bytes(Problem("rms_norm", 7, 33, "fp16", weight_dtype="fp32")) == 3 * 7 * 33 * 2
    assert floor_bytes(Problem("layer_norm", 0, 9)) == 0


@pytest.mark.parametrize("problem, programs, expected", [
    # LayerNorm bf16 saving x: floor 90, stats 2·4·3 (rstd, mean), weight 5·2, partials 2·4·2·5·2 (dw, db
    # written then read), dw/db 2·5·2.
    (Problem("layer_norm", 3, 5, "bf16"), 2, 90 + 24 + 10 + 160 + 20),
    # Saving y: only rstd is stored, but the bias is read too to recover x̂ = (y − b)/w.
    (Problem("layer_norm", 3, 5, "bf16", save="output"), 2, 90 + 12 + 20 + 160 + 20),
    # RMSNorm, bf16 activations with fp32 weights: weight and dw are 4 bytes each, one partial buffer.
    (Problem("rms_norm", 3, 5, "bf16", weight_dtype="fp32"), 2, 90 + 12 + 20 + 80 + 20),
    # RMSNorm without a weight: no partials at all.
    (Problem("rms_norm", 3, 5, "bf16", has_weight=False), 2, 90 + 12),
    # LayerNorm fp32 with fp32 everything, 3 programs, 11 rows of 7.
    (Problem("layer_norm", 11, 7, "fp32"), 3, 3 * 11 * 7 * 4 + 2 * 4 * 11 + 7 * 4 + 2 * 4 * 3 * 7 * 2 + 2 * 7 * 4),
    # LayerNorm without bias saving y: no bias to read, one partial buffer.
    (Problem("layer_norm", 3, 5, "fp16", has_bias=False, save="output"), 1, 90 + 12 + 10 + 40 + 10),
])
def test_bytes_moved_hand_computed(problem, programs, expected):
    assert bytes_moved(problem, programs) == expected


def test_bytes_moved_grows_with_programs_by_the_partials():
    p = Problem("layer_norm", 64, 200, "bf16")
    # Two fp32 partial rows (dw, db) per program, each written and read.
    assert bytes_moved(p, 9) - bytes_moved(p, 8) == 2 * 4 * 200 * 2


def test_floor_us():
    p = Problem("rms_norm", 1000, 1000, "bf16")  # 6e6 bytes
    assert floor_us(p, 3000.0) == pytest.approx(2.0)  # 6e6 B at 3e12 B/s = 2 µs
    assert floor_us(Problem("rms_norm", 1000, 1000, "fp32"), 2000.0) == pytest.approx(6.0)
    assert math.isnan(floor_us(p, 0.0))
    assert math.isnan(floor_us(p, math.nan))


@pytest.mark.parametrize("l2_mib", [0, 1, 4, 31, 32, 33, 50, 60, 96, 253])
def test_flush_size_is_at_least_twice_l2_and_64_mib(l2_mib):
    l2 = l2_mib * 2**20 + (12345 if l2_mib % 2 else 0)
    n = flush_size(l2)
    assert n >= 2 * l2
    assert n >= 64 * 2**20
    assert n == max(2 * l2, 64 * 2**20)  # and no larger than needed


def test_l2_flusher_buffer_covers_the_flush_size():
    flusher = L2Flusher(torch.device("cpu"), 40 * 2**20 + 3)
    assert flusher.nbytes == flush_size(40 * 2**20 + 3)
    assert flusher.buffer.numel() * flusher.buffer.element_size() >= 2 * (40 * 2**20 + 3) - 4
    flusher.buffer.fill_(7)
    flusher()
    assert int(flusher.buffer.abs().max()) == 0  # it writes the whole buffer


# ------------------------------------------------------------------------------------------------- the gate


def _reference(problem: Problem, device: str, seed: int = 0):
    case = make_case(problem, device, seed=seed)
    return case, case.reference()


def test_gate_passes_the_reference_itself_and_small_rounding(device):
    problem = Problem("layer_norm", 13, 37, "bf16")
    _, ref = _reference(problem, device)
    passed, errors, message = gate(problem, ref, ref)
    assert passed and message == ""
    assert set(errors) == {"dx", "dw", "db"}
    assert all(e == 0.0 for e in errors.values())
    # A relative error at half the tolerance passes.
    tol = GATE_TOLERANCE["bf16"]
    got = tuple(t.double() * (1 + tol / 2) for t in ref)
    passed, errors, _ = gate(problem, got, ref)
    assert passed
    assert errors["dx"] == pytest.approx(tol / 2, rel=1e-6)


@pytest.mark.parametrize("bad", ["dx", "dw", "db"])
def test_gate_fails_a_nan_and_names_the_output(bad, device):
    problem = Problem("layer_norm", 9, 21, "fp32")
    _, ref = _reference(problem, device)
    got = [t.clone() for t in ref]
    got[("dx", "dw", "db").index(bad)].view(-1)[-1] = math.nan
    passed, errors, message = gate(problem, tuple(got), ref)
    assert not passed
    assert errors[bad] == math.inf
    assert message.startswith(bad) and "relative error" in message
    assert all(name not in message for name in ("dx", "dw", "db") if name != bad)


def test_gate_fails_wrong_values_and_names_each_wrong_output(device):
    problem = Problem("layer_norm", 9, 21, "fp16")
    _, ref = _reference(problem, device)
    dx, dw, db = ref
    passed, errors, message = gate(problem, (dx * 1.5, dw, -db), ref)
    assert not passed
    assert "dx relative error" in message and "db relative error" in message and "dw" not in message
    assert errors["dx"] == pytest.approx(0.5, rel=1e-3)
    assert errors["db"] == pytest.approx(2.0, rel=1e-3)
    assert errors["dw"] == 0.0


def test_gate_skips_outputs_the_problem_does_not_have(device):
    problem = Problem("rms_norm", 5, 17, "bf16")  # no bias: db is None
    _, ref = _reference(problem, device)
    assert ref[2] is None
    passed, errors, _ = gate(problem, ref, ref)
    assert passed and set(errors) == {"dx", "dw"}


def test_gate_doubles_the_tolerance_when_recovering_from_the_output(device):
    tol = GATE_TOLERANCE["fp32"]
    for save, expect in (("input", False), ("output", True)):
        problem = Problem("rms_norm", 5, 17, "fp32", save=save)
        _, ref = _reference(problem, device)
        got = (ref[0] * (1 + 1.5 * tol), ref[1], None)
        passed, _, _ = gate(problem, got, ref)
        assert passed is expect, save


@pytest.mark.parametrize("gate_at, activation", [(None, None), ("before", "silu"), ("before", "sigmoid"),
                                                 ("after", "sigmoid")])
def test_rows_of_one_column_are_judged_against_their_terms_not_their_near_zero_difference(gate_at, activation,
                                                                                          device):
    # dx of a one-column row is r·w·g·(1 − x̂²) with x̂² = 1 up to eps: two right fp32 computations of it differ by
    # thousandths of its norm. The gate measures that against a hundredth of its terms' norm instead.
    problem = Problem("rms_norm", 3, 1, "fp32", gate=gate_at, gate_activation=activation)
    config = default_config(problem)
    for seed in range(6):
        case = make_case(problem, device, seed=seed)
        result = measure_config(case, config, flusher=None, bandwidth_gbps=1.0, warmup=0, min_reps=1, max_reps=1,
                                budget_s=0.0)
        assert result.status == "ok", (seed, result.error)
        reference = case.gate_reference()
        wrong = list(case.reference())
        wrong[0] = torch.zeros_like(wrong[0])  # dx is small here, but not zero: leaving it unwritten still fails
        assert "dx relative error" in gate(problem, tuple(wrong), reference)[2], seed


def test_the_terms_do_not_widen_the_gate_where_they_do_not_cancel(device):
    problem = Problem("rms_norm", 16, 64, "fp32", gate="after", gate_activation="silu")
    case = make_case(problem, device)
    ref, reference = case.reference(), case.gate_reference()
    tol = GATE_TOLERANCE["fp32"]
    off = list(ref)
    off[0] = ref[0] * (1 + 2 * tol)
    passed, errors, _ = gate(problem, tuple(off), reference)
    assert not passed and errors["dx"] == pytest.approx(2 * tol, rel=1e-3)  # as without the terms


# ---------------------------------------------------------------------------------------- classify_exception


class _NamedCompilationError(Exception):
    pass


_NamedCompilationError.__name__ = "CompilationError"


class _NamedOutOfResources(Exception):
    pass


_NamedOutOfResources.__name__ = "OutOfResources"


def test_the_reference_is_made_once_per_problem_and_a_wrong_trial_after_right_ones_is_caught(monkeypatch, device):
    from normtune.tuner.measure.cases import Case
    from normtune.tuner.measure.harness import MeasureSession

    made = []
    original_reference = Case.reference
    monkeypatch.setattr(Case, "reference", lambda self: (made.append(self.problem), original_reference(self))[1])
    session = MeasureSession(device if device != "cpu" else "cpu")
    config = default_config(PROBLEM)
    assert [session.measure_problem(PROBLEM, config).status for _ in range(3)] == ["ok"] * 3

    def wrong(self, original):
        original(self)
        self.dx[3] *= 2

    def skipping(self, original):
        saved = self.dx[-1].clone()  # the poisoned (NaN) row of this trial's outputs
        original(self)
        self.dx[-1] = saved

    for corrupt in (wrong, skipping):
        with monkeypatch.context() as m:
            _patch(m, "kernel_1", corrupt)
            r = session.measure_problem(PROBLEM, config)
        assert r.status == "incorrect" and "dx relative error" in r.error and r.median_us is None
        assert session.measure_problem(PROBLEM, config).status == "ok"  # the same config, right again
    assert made == [PROBLEM]  # one reference for all eight trials
    other = Problem("rms_norm", 7, 40, "fp16")
    assert session.measure_problem(other, default_config(other)).status == "ok"
    assert session.measure_problem(other, default_config(other)).status == "ok"
    assert made == [PROBLEM, other]
    case = session.case(PROBLEM)  # measured without a reference given: the case's own, made once
    assert [session.measure(case, config).status for _ in range(2)] == ["ok", "ok"]
    assert made == [PROBLEM, other, PROBLEM]


def test_the_first_launch_is_its_own_phase_apart_from_the_check_and_the_timing(device):
    phases = {"load": 1.0}  # phases add up across trials
    case = make_case(PROBLEM, device, seed=5)
    t = time.perf_counter()
    r = measure_config(case, default_config(PROBLEM), flusher=None, bandwidth_gbps=BANDWIDTH, phases=phases, **FAST)
    wall = time.perf_counter() - t
    assert r.status == "ok"
    assert phases["load"] == pytest.approx(1.0 + r.compile_s)
    assert phases["gate"] >= 0 and phases["timing"] > 0
    assert phases["load"] - 1.0 + phases["gate"] + phases["timing"] == pytest.approx(wall, abs=0.05)


def test_the_gate_reads_back_once_and_agrees_with_relative_error(monkeypatch, device):
    from normtune.tuner.measure.harness import relative_error
    from normtune.tuner.measure.cases import Reference

    problem = Problem("layer_norm", 11, 33, "bf16")
    _, ref = _reference(problem, device)
    gen = torch.Generator(device=device).manual_seed(1)
    got = tuple((t.float() * (1 + 0.1 * torch.randn(t.shape, generator=gen, device=device))).to(t.dtype)
                for t in ref)
    prepared = Reference(ref)
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1])
    passed, errors, _ = gate(problem, got, prepared)
    assert len(reads) == 1  # every output compared on the device, one read back
    monkeypatch.undo()
    assert not passed  # a 10 % error per element is past bf16's tolerance
    for name, out, exact in zip(("dx", "dw", "db"), got, ref):
        assert errors[name] == pytest.approx(relative_error(out, exact), rel=1e-12, abs=0)


@pytest.mark.parametrize("err, status", [
    (OutOfResources(300000, 232448, "shared memory"), "out_of_resources"),
    (_NamedOutOfResources("too many registers"), "out_of_resources"),
    (RuntimeError("Triton Error [CUDA]: out of resources"), "out_of_resources"),
    (RuntimeError("wrapped: OutOfResources('shared memory')"), "out_of_resources"),
    (CompilationError("x = 1", ast.parse("x = 1").body[0], "bad constexpr"), "compile_error"),
    (_NamedCompilationError("at 3:4: unsupported"), "compile_error"),
    (RuntimeError("PTXAS error: Internal Triton PTX codegen error"), "compile_error"),
    (RuntimeError("MLIR pass manager failed"), "compile_error"),
    (ValueError("shapes do not match"), "error"),
    (ZeroDivisionError("division by zero"), "error"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "error"),
])
def test_classify_exception(err, status):
    assert classify_exception(err) == status


# --------------------------------------------------------------------------------- one measurement (interpreter)


@pytest.mark.parametrize("problem", [
    Problem("layer_norm", 24, 200, "bf16"),
    Problem("rms_norm", 5, 33, "fp32"),
    Problem("layer_norm", 7, 3000, "fp16", weight_dtype="fp32", save="output"),
], ids=lambda p: p.key)
def test_measure_config(problem, device):
    case = make_case(problem, device, seed=1)
    config = default_config(problem)
    r = measure_config(case, config, flusher=None, bandwidth_gbps=BANDWIDTH, **FAST)
    assert r.status == "ok", r.error
    assert r.error is None
    assert r.interpret is (device == "cpu")
    figures = dict(median_us=r.median_us, p10_us=r.p10_us, p90_us=r.p90_us, kernel_1_us=r.kernel_1_us,
                   kernel_2_us=r.kernel_2_us, gbps=r.gbps, floor_us=r.floor_us, floor_fraction=r.floor_fraction)
    for name, value in figures.items():
        assert value is not None and math.isfinite(value) and value > 0, (name, value)
    assert r.p10_us <= r.median_us <= r.p90_us
    assert r.reps == FAST["min_reps"]
    assert r.compile_s is not None and r.compile_s >= 0
    sms = sm_count(torch.device(device))
    assert r.programs == num_programs(problem.M, problem.N, config, sms)
    assert r.bytes_moved == bytes_moved(problem, partial_rows(problem.M, config, sms))
    assert r.gbps == pytest.approx(r.bytes_moved / (r.median_us * 1e3))
    assert r.floor_us == pytest.approx(floor_us(problem, BANDWIDTH))
    assert r.floor_fraction == pytest.approx(r.floor_us / r.median_us)
    assert set(r.errors) == {"dx", "dw"} | ({"db"} if problem.has_bias else set())
    assert all(e <= GATE_TOLERANCE[problem.dtype] * 2 for e in r.errors.values())
    assert MeasureResult(**r.to_dict()) == r


@pytest.mark.parametrize("kernel_1, kernel_2", [
    (kernel_1_config(block_row=2, block_col=256, num_warps=4, strategy="dual"), Kernel2Config(block_m=8, block_n=64)),
    (kernel_1_config(block_row=8, block_col=64, num_warps=4, strategy="columns"), Kernel2Config()),
], ids=["dual", "columns"])
def test_no_kernel_2_reports_no_kernel_2_time(kernel_1, kernel_2, device):
    """Without a second kernel the split's kernel_2 step is empty: its time is 0, not the events' own cost."""
    problem = Problem("layer_norm", 24, 200, "bf16")
    r = measure_config(make_case(problem, device, seed=2), BackwardConfig(kernel_1, kernel_2), flusher=None,
                       bandwidth_gbps=BANDWIDTH, **FAST)
    assert r.status == "ok", r.error
    assert r.kernel_2_us == 0.0 and r.kernel_1_us > 0


def test_measure_config_without_bandwidth_has_no_floor(device):
    problem = Problem("rms_norm", 6, 40, "bf16")
    r = measure_config(make_case(problem, device), default_config(problem), flusher=None, bandwidth_gbps=math.nan,
                       **FAST)
    assert r.status == "ok", r.error
    assert math.isnan(r.floor_us) and r.floor_fraction is None
    assert r.median_us > 0


@pytest.mark.parametrize("config, needle", [
    (BackwardConfig(kernel_1_config(block_col=64)), "block_col"),  # single pass narrower than N=200
    (BackwardConfig(kernel_1_config(block_col=256, num_warps=3)), "num_warps"),
    (BackwardConfig(kernel_1_config(block_col=256), Kernel2Config(block_n=24)), "block_n"),
    (BackwardConfig(kernel_1_config(block_col=128, two_pass=True, recompute=True)), "recompute"),
])
def test_invalid_config_is_a_status_not_a_crash(config, needle, device):
    problem = Problem("layer_norm", 10, 200, "bf16")
    r = measure_config(make_case(problem, device), config, flusher=None, bandwidth_gbps=BANDWIDTH, **FAST)
    assert r.status == "invalid"
    assert needle in r.error
    assert r.median_us is None and r.reps == 0 and r.interpret is (device == "cpu")


# ------------------------------------------------------------------------- the gate catches wrong kernels


PROBLEM = Problem("layer_norm", 19, 72, "bf16")


def _patch(monkeypatch, name, wrapper):
    original = getattr(BackwardLaunch, name)
    monkeypatch.setattr(BackwardLaunch, name, lambda self: wrapper(self, original))


def _measure(device, problem=PROBLEM, config=None):
    return measure_config(make_case(problem, device, seed=5), config or default_config(problem), flusher=None,
                          bandwidth_gbps=BANDWIDTH, **FAST)


def test_gate_catches_a_kernel_1_with_wrong_dx(monkeypatch, device):
    def wrong(self, original):
        original(self)
        self.dx[3] *= 2  # one row off by a factor of two

    _patch(monkeypatch, "kernel_1", wrong)
    r = _measure(device)
    assert r.status == "incorrect"
    assert "dx relative error" in r.error and "dw" not in r.error
    assert r.errors["dx"] > GATE_TOLERANCE["bf16"]
    assert r.median_us is None  # not timed


def test_gate_catches_a_kernel_1_that_skips_the_last_row(monkeypatch, device):
    def skipping(self, original):
        saved = self.dx[-1].clone()  # the poisoned (NaN) row
        original(self)
        self.dx[-1] = saved

    _patch(monkeypatch, "kernel_1", skipping)
    r = _measure(device)
    assert r.status == "incorrect"
    assert r.errors["dx"] == math.inf


def test_gate_catches_a_kernel_1_with_wrong_partials(monkeypatch, device):
    def wrong(self, original):
        original(self)
        self.partial_dw[0] += 1.0

    _patch(monkeypatch, "kernel_1", wrong)
    r = _measure(device)
    assert r.status == "incorrect"
    assert "dw relative error" in r.error and "dx" not in r.error and "db" not in r.error


def test_gate_catches_a_kernel_2_that_drops_a_program(monkeypatch, device):
    def dropping(self, original):
        self.partial_db[-1] = 0.0  # the last program's bias partials lost
        original(self)

    _patch(monkeypatch, "kernel_2", dropping)
    problem = Problem("layer_norm", 40, 72, "bf16")
    config = BackwardConfig(kernel_1_config(block_row=2, block_col=128, num_warps=1, programs_per_sm=1))
    r = _measure(device, problem, config)
    assert r.status == "incorrect"
    assert "db relative error" in r.error


def test_a_right_kernel_passes_the_same_harness(monkeypatch, device):
    # The counterpart of the tests above: wrapping without corrupting changes nothing.
    _patch(monkeypatch, "kernel_1", lambda self, original: original(self))
    assert _measure(device).status == "ok"


@pytest.mark.parametrize("err, status", [
    (CompilationError("tl.arange(0, 3)", ast.parse("x = 1").body[0], "arange's range must be a power of 2"),
     "compile_error"),
    (OutOfResources(262144, 232448, "shared memory"), "out_of_resources"),
    (RuntimeError("something else broke"), "error"),
])
def test_a_kernel_that_raises_is_a_status(monkeypatch, device, err, status):
    def raising(self, original):
        raise err

    _patch(monkeypatch, "kernel_1", raising)
    r = _measure(device)
    assert r.status == status
    assert type(err).__name__ in r.error
    assert r.median_us is None


def test_a_failure_while_timing_is_an_error_status(monkeypatch, device):
    calls = {"n": 0}

    def flaky(self, original):
        calls["n"] += 1
        if calls["n"] > 1:  # the gated first launch succeeds, the timed repetitions fail
            raise RuntimeError("lost the device")
        original(self)

    _patch(monkeypatch, "kernel_2", flaky)
    r = _measure(device)
    assert r.status == "error"
    assert "lost the device" in r.error
    assert r.median_us is None


def test_the_kernels_really_are_the_patched_ones(monkeypatch, device):
    # Guards the tests above: measure_config must launch through BackwardLaunch.kernel_1/kernel_2.
    seen = []
    _patch(monkeypatch, "kernel_1", lambda self, original: (seen.append(1), original(self)))
    _patch(monkeypatch, "kernel_2", lambda self, original: (seen.append(2), original(self)))
    assert _measure(device).status == "ok"
    assert seen[:2] == [1, 2] and seen.count(1) > 1 and seen.count(2) > 1
    assert kbackward.BackwardLaunch is BackwardLaunch


# ------------------------------------------------------------------------------------------- bench writers


def _report() -> BenchReport:
    info = detect(interpret=True)
    provenance = {
        "device": info.to_dict(), "peers": {"liger_kernel": None, "quack": None, "optuna": "5.0"},
        "copy_bandwidth_gbps": 2930.0, "cold_l2": True, "flush_bytes": 128 * 2**20, "dtype": "bf16",
        "weight_dtype": "bf16", "config": "table",
        "timing": {"min_reps": 20, "max_reps": 200, "budget_s": 0.5, "spin_cycles": 500000},
        "interpret": False, "started": "2025-01-01T00:00:00+0000", "peer_descriptions": {},
    }
    rows = []

    def row(norm, M, N, impl, median, *, status="ok", k1=None, k2=None, error=None, note=""):
        floor = 3 * M * N * 2 / (2930.0 * 1e3)
        r = {"norm": norm, "M": M, "N": N, "dtype": "bf16", "weight_dtype": "bf16", "floor_us": floor,
             "impl": impl, "status": status, "error": error, "median_us": median,
             "p10_us": median * 0.97 if median else None, "p90_us": median * 1.05 if median else None,
             "reps": 57 if median else 0, "kernel_1_us": k1, "kernel_2_us": k2,
             "kernels": {"kernel_1": k1, "kernel_2": k2} if impl == OURS else ({"vectorized_layer_norm": median}
                                                                             if median else {}),
             "rel_err_dx": 1e-3 if median else None,
             "config": default_config(Problem(norm, M, N)).to_dict() if impl == OURS else None,
             "config_source": "table" if impl == OURS else None, "note": note,
             "floor_fraction": floor / median if median else None}
        rows.append(r)

    for norm in ("layer_norm", "rms_norm"):
        for (M, N), ours, torch_us in (((4093, 1536), 20.0, 40.0), ((777, 7168), 30.0, 24.0)):
            row(norm, M, N, OURS, ours, k1=ours * 0.75, k2=ours * 0.25)
            row(norm, M, N, "torch", torch_us, note="eager")
            row(norm, M, N, "liger", None, status="unavailable", error="liger-kernel is not installed")
    return BenchReport(provenance, rows)


def test_write_all(tmp_path):
    report = _report()
    paths = bench_output.write_all(report, tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == sorted(["bench.csv", "bench.json", "bench.md", "bench_layer_norm.png", "bench_rms_norm.png",
                            "kernels_layer_norm.png", "kernels_rms_norm.png"])
    for p in paths:
        assert p.is_file() and p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with open(tmp_path / "out" / "bench.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == bench_output.CSV_COLUMNS
        rows = list(reader)
    assert len(rows) == len(report.rows) == 12
    assert {r["impl"] for r in rows} == {OURS, "torch", "liger"}
    for r in rows:
        if r["status"] == "ok":
            for col in ("median_us", "p10_us", "p90_us", "floor_us", "floor_fraction"):
                assert math.isfinite(float(r[col])) and float(r[col]) > 0, (col, r)
            assert isinstance(json.loads(r["kernels"]), dict)
        else:
            assert r["median_us"] == "" and "not installed" in r["error"]
    ours = [r for r in rows if r["impl"] == OURS]
    assert all(float(r["kernel_1_us"]) + float(r["kernel_2_us"]) == pytest.approx(float(r["median_us"]))
               for r in ours)
    assert all(json.loads(r["config"]) == BackwardConfig.from_dict(json.loads(r["config"])).to_dict() for r in ours)

    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["provenance"]["device"]["name"] == "cpu (triton interpreter)"
    assert data["provenance"]["timing"]["min_reps"] == 20
    assert len(data["rows"]) == 12
    speedups = {(s["norm"], s["M"], s["N"]): s["speedup"] for s in data["summary"]}
    assert speedups[("layer_norm", 4093, 1536)] == pytest.approx(2.0)  # torch 40 µs / ours 20 µs
    assert speedups[("rms_norm", 777, 7168)] == pytest.approx(0.8)
    assert {s["best_peer"] for s in data["summary"]} == {"torch"}  # an unavailable peer never wins

    md = (tmp_path / "out" / "bench.md").read_text()
    assert md.startswith("# normtune bench — cpu (triton interpreter)")
    assert "## layer_norm" in md and "## rms_norm" in md and "GPU time, host hidden (µs, lower is better)" in md
    assert "| 4093×1536 |" in md and "2.00×" in md and "0.80×" in md
    assert "normtune beats the best peer on 2/4" in md
    assert "liger unavailable: liger-kernel is not installed" in md
    # bench summary: what the Markdown is built from
    assert [s["speedup"] for s in summary(report.rows)] == pytest.approx([2.0, 0.8, 2.0, 0.8])


# ------------------------------------------------------------------------------ the three views, the session


def test_results_module_has_no_torch():
    """Storage and reports read results without importing the stopwatch (or torch)."""
    import normtune.tuner.measure.results as results

    tree = ast.parse(open(results.__file__).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "torch" not in imported and "triton" not in imported


def test_the_gpu_time_view_times_the_whole_backward_without_an_event_between_the_kernels(monkeypatch, device):
    """With PDL an event between kernel_1 and kernel_2 would break their overlap: the headline figure must come
    from one event pair around both launches."""
    from normtune.tuner.measure import harness as measure

    calls = []
    real = measure.time_kernels

    def spy(steps, **kwargs):
        calls.append(([getattr(s, "__name__", "") for s in steps], kwargs["split"]))
        return real(steps, **kwargs)

    monkeypatch.setattr(measure, "time_kernels", spy)
    r = _measure(device)
    assert r.status == "ok"
    assert calls[0] == (["kernel_1", "kernel_2"], False)  # the reported median: both kernels, no split
    assert calls[1] == (["kernel_1", "kernel_2"], True)   # the per-kernel split, separately


def test_pdl_split_reports_kernel_2_as_what_follows_kernel_1():
    from normtune.tuner.measure.stopwatch import split_kernel_times

    # Without PDL the event split stands; with PDL kernel_2 is the overlapped total minus kernel_1.
    assert split_kernel_times(30.0, 20.0, 12.0, pdl=False) == (20.0, 12.0)
    assert split_kernel_times(30.0, 20.0, 12.0, pdl=True) == (20.0, 10.0)
    assert split_kernel_times(18.0, 20.0, 12.0, pdl=True) == (20.0, 0.0)  # never negative


def test_measure_config_uses_the_pdl_split_when_the_launch_has_pdl(monkeypatch, device):
    from normtune.tuner.measure import harness as measure

    # The kernels launch as built; only the flag says PDL.
    monkeypatch.setattr(BackwardLaunch, "pdl", property(lambda self: True))
    totals = iter([[Stats(30.0, 29.0, 31.0, 2)], [Stats(20.0, 20.0, 20.0, 1), Stats(14.0, 14.0, 14.0, 1),
                                                  Stats(34.0, 34.0, 34.0, 1)]])
    monkeypatch.setattr(measure, "time_kernels", lambda steps, **kw: next(totals))
    r = _measure(device)
    assert r.status == "ok" and r.median_us == 30.0
    assert (r.kernel_1_us, r.kernel_2_us) == (20.0, 10.0)


def test_kernel_sum():
    from normtune.tuner.measure.views import kernel_sum

    assert kernel_sum({"_kernel_1_single_pass": 30.5, "_kernel_2": 4.5}) == pytest.approx(35.0)
    assert kernel_sum({}) is None
    assert kernel_sum({"a": 1.0, "<profiler failed>": float("nan")}) is None  # never a partial sum


def test_kernel_sum_counts_overlapping_kernels_once():
    """Under PDL kernel_2 starts while kernel_1 runs and waits inside its own kernel time: the time both run is
    counted once, so the kernel sum of a PDL pair is the device time spent in its kernels."""
    from normtune.tuner.measure.views import OVERLAP, kernel_sum, overlap_us

    assert overlap_us([]) == 0.0
    assert overlap_us([(0.0, 10.0), (10.0, 12.0), (20.0, 25.0)]) == 0.0  # back to back: nothing twice
    assert overlap_us([(0.0, 30.0), (1.0, 34.0)]) == pytest.approx(29.0)  # kernel_2 launched early (PDL)
    assert overlap_us([(1.0, 34.0), (0.0, 30.0), (50.0, 80.0), (51.0, 82.0)]) == pytest.approx(29.0 + 29.0)
    assert overlap_us([(0.0, 10.0), (2.0, 4.0), (3.0, 5.0)]) == pytest.approx(2.0 + 2.0)  # covered three times
    kernels = {"_kernel_1_single_pass": 30.0, "_kernel_2": 33.0, OVERLAP: -29.0}
    assert kernel_sum(kernels) == pytest.approx(34.0)


FLUSH, SPIN = "FillFunctor<int>", "spin_kernel(long)"


def _prologue_run(t: float, flush_us: float = 30.0) -> list:
    return [(FLUSH, t, t + flush_us, flush_us), (SPIN, t + flush_us, t + flush_us + 100.0, 100.0)]


def test_call_kernels_takes_the_prologue_out_by_position():
    """The prologue's kernels (flush, spin) are taken out run by run, whatever each run of them cost, so none of
    their time leaks into the call's kernels; a call's own kernel named like the flush is kept."""
    from normtune.tuner.measure.views import call_kernels

    prologue = _prologue_run(0.0) + _prologue_run(1000.0)
    kernels, t = [], 0.0
    for rep, flush_us in enumerate((31.0, 35.0)):  # the flush ran longer than in its own profile
        kernels += _prologue_run(t, flush_us)
        t += flush_us + 100.0
        kernels += [("kernel_1", t, t + 20.0, 20.0), (FLUSH, t + 20.0, t + 21.0, 1.0)]  # the call's own fill
        t += 500.0
    own = call_kernels(kernels, prologue, reps=2)
    assert [k[0] for k in own] == ["kernel_1", FLUSH, "kernel_1", FLUSH]
    assert sum(k[3] for k in own) == pytest.approx(42.0)
    assert call_kernels(kernels, prologue, reps=3) is None  # the prologue's profile is not 3 runs of one sequence
    assert call_kernels(kernels[2:], prologue, reps=2) is None  # a run of the prologue missing from the calls'
    assert call_kernels(kernels, _prologue_run(0.0) + [(SPIN, 1.0, 2.0, 1.0)], reps=2) is None  # runs differ
    assert call_kernels(kernels, [], reps=2) is None


def test_profile_kernels_counts_only_the_calls_kernels(monkeypatch):
    """A flush slower in the calls' profile than in its own used to leave its excess as a kernel of the call's
    (and a faster one was dropped, never subtracted): the kernel sum of a call is now its own kernels' alone."""
    from normtune.tuner.measure import views

    class Event:
        def __init__(self, name, start, end):
            from torch.autograd import DeviceType

            self.name, self.device_type, self.device_time_total = name, DeviceType.CUDA, end - start
            self.time_range = type("Span", (), {"start": start, "end": end})()

    profiles = iter([  # the calls' profile, then the prologue's alone
        [Event(*k[:3]) for k in _prologue_run(0.0, 33.0) + [("kernel_1", 133.0, 153.0), ("kernel_2", 150.0, 156.0)]
         + _prologue_run(1000.0, 34.0) + [("kernel_1", 1134.0, 1154.0), ("kernel_2", 1151.0, 1157.0)]],
        [Event(*k[:3]) for k in _prologue_run(0.0) + _prologue_run(1000.0)],
    ])

    class Profile:
        def __init__(self, **_):
            self.recorded = next(profiles)

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def events(self):
            return self.recorded

    monkeypatch.setattr("torch.profiler.profile", Profile)
    monkeypatch.setattr(views.torch.cuda, "synchronize", lambda device=None: None)
    out = views.profile_kernels(lambda: None, prologue=lambda: None, device=torch.device("cpu"), reps=2)
    assert out == {"kernel_1": pytest.approx(20.0), "kernel_2": pytest.approx(6.0),
                   views.OVERLAP: pytest.approx(-3.0)}
    assert views.kernel_sum(out) == pytest.approx(23.0)


def test_host_us_per_call_divides_by_the_number_of_calls(monkeypatch):
    from normtune.tuner.measure import views

    clock = iter(range(0, 10**6, 1))  # perf_counter advances 1 s per reading
    monkeypatch.setattr(views.time, "perf_counter", lambda: float(next(clock)))
    issued = []
    us = views.host_us_per_call(lambda: issued.append(1), device=torch.device("cpu"), calls=4, reps=3)
    assert len(issued) == 1 + 4 * 3  # one warm-up call, then reps x calls
    assert us == pytest.approx(1e6 / 4)  # each rep: 1 s of wall clock over 4 calls


def test_session_on_cpu(device):
    from normtune.tuner.measure.harness import TIMING, MeasureSession

    if device != "cpu":
        pytest.skip("the CPU session")
    session = MeasureSession.for_device(detect(interpret=True), timing=TIMING["bench"])
    assert session.timing == TIMING["interpret"]  # the interpreter always uses its short preset
    assert session.flusher is None and math.isnan(session.bandwidth_gbps) and session.spin_cycles == 0
    prov = session.provenance()
    assert prov["cold_l2"] is False and prov["flush_bytes"] == 0 and prov["copy_bandwidth_gbps"] is None
    assert prov["timing"]["min_reps"] == TIMING["interpret"].min_reps
    problem = Problem("rms_norm", 6, 40, "bf16")
    case = session.case(problem)
    r = session.measure(case, default_config(problem))
    assert r.status == "ok" and r.median_us > 0 and r.reps == TIMING["interpret"].min_reps
    assert session.kernel_times(case.launch(default_config(problem)).run) == {}  # no profiler on CPU
    assert session.host_us(lambda: None) >= 0


def _wide_report() -> BenchReport:
    report = _report()
    for r in report.rows:
        r["M"], r["N"] = (131072, 16384) if r["N"] == 1536 else (r["M"], r["N"])
        if r["impl"] == "torch":
            r["impl"] = "compile"
        r["kernel_sum_us"] = r["median_us"] * 0.9 if r["median_us"] else None
        r["host_us"], r["forward_host_us"] = (512.25, 250.5) if r["median_us"] else (None, None)
    return report


def test_console_summary_fits_80_columns():
    from rich.console import Console

    report = _wide_report()
    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(bench_output.summary_table(report))
    text = console.export_text()
    lines = text.splitlines()
    assert lines and max(len(line) for line in lines) <= 80, text
    assert "…" not in text, text  # no cell truncated
    assert "RMS 131072×16384" in text and "compile" in text and "512" in text
    console.print(bench_output.summary_footer(report))
    assert max(len(line) for line in console.export_text().splitlines()) <= 80


def test_markdown_shows_the_three_views_and_which_view_claims_rest_on():
    report = _wide_report()
    md = bench_output.markdown(report)
    assert "GPU time, host hidden (µs, lower is better):" in md
    assert "Kernel sum (µs, torch.profiler):" in md and "Host µs per call (backward / forward):" in md
    assert "| 131072×16384 | 18.0 | 36.0 | unavailable |" in md  # kernel sum: normtune 20·0.9, compile 40·0.9, liger n/a
    assert "| 131072×16384 | 512.2 / 250.5 | 512.2 / 250.5 | unavailable |" in md
    assert "the view every speedup and win count rests on unless marked kernel-sum" in md
    assert "Geometric-mean speedup over the best peer: 1.265× (GPU time), 1.265× (kernel sum)" in md
    summ = summary(report.rows)
    assert [s["kernel_sum_speedup"] for s in summ] == pytest.approx([2.0, 0.8, 2.0, 0.8])
    assert all(s["host_us"] == 512.25 and s["forward_host_us"] == 250.5 for s in summ)


def test_kernels_plot_stack_is_the_measured_total(tmp_path, monkeypatch):
    """The stacked bars of the kernel plot add up to the measured backward, never more."""
    import matplotlib.axes

    report = _report()
    for r in report.rows:
        if r["impl"] == OURS:
            r["kernel_1_us"], r["kernel_2_us"] = r["median_us"] * 0.8, r["median_us"] * 0.5  # split > total
    stacks = []
    real_bar = matplotlib.axes.Axes.bar

    def bar(self, x, height, *args, bottom=None, label=None, **kwargs):
        if label and label.startswith("rest"):
            stacks.append([b + h for b, h in zip(bottom, height)])
        return real_bar(self, x, height, *args, bottom=bottom, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    bench_output.plot(report, tmp_path)
    totals = [r["median_us"] for r in report.rows if r["impl"] == OURS]
    assert [t for s in stacks for t in s] == pytest.approx(totals)


def test_a_session_keeps_each_problems_inputs_and_reference_across_measurements(monkeypatch):
    """measure_problem makes a problem's inputs and float64 reference once, also when the problems take turns
    (they are kept while they fit the session's budget), and anew for a new problem."""
    from normtune.tuner.measure.harness import MeasureSession

    session = MeasureSession.for_device(detect(interpret=True))
    made = []
    case = session.case

    def spy(problem, seed=0):
        made.append(problem.key)
        return case(problem, seed)

    monkeypatch.setattr(session, "case", spy)
    first, second = Problem("rms_norm", 8, 96), Problem("rms_norm", 8, 128)
    config = default_config(first)
    phases: dict = {}
    results = [session.measure_problem(p, config if p == first else default_config(p), phases)
               for p in (first, first, second, first, second, first)]
    assert [r.status for r in results] == ["ok"] * 6, [r.error for r in results]
    assert made == [first.key, second.key] and phases["inputs"] > 0
