"""Host µs in interleaved rounds (`tuner/measure/host_rounds.py`) and the bench's use of them."""

from __future__ import annotations

import pytest

from normtune.kernels.device import interpret_mode
from normtune.tuner.measure.host_rounds import HostCall, measure_rounds


def _calls(names):
    rows = {n: {"impl": n, "note": "", "median_us": 12.5} for n in names}
    return rows, [HostCall(rows[n], "host_us", (lambda n=n: n)) for n in names]


def test_every_round_times_every_call_once_in_a_rotated_order():
    rows, calls = _calls(["a", "b", "c"])
    order = []

    def time_call(fn):
        order.append(fn())
        return 1.0

    measure_rounds(calls, 3, time_call)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(r["host_us"] == 1.0 for r in rows.values())


def test_a_call_keeps_the_median_of_its_rounds():
    rows, calls = _calls(["ours", "peer"])
    samples = {"ours": iter([30.0, 90.0, 31.0, 29.0, 32.0]), "peer": iter([28.0, 27.0, 80.0, 29.0, 26.0])}
    measure_rounds(calls, 5, lambda fn: next(samples[fn()]))
    assert rows["ours"]["host_us"] == 31.0 and rows["peer"]["host_us"] == 28.0


def test_a_failing_call_loses_its_host_figure_only():
    rows, calls = _calls(["ours", "peer"])
    timed = []

    def time_call(fn):
        name = fn()
        timed.append(name)
        if name == "peer" and len(timed) > 2:
            raise RuntimeError("peer's call broke")
        return 5.0

    measure_rounds(calls, 4, time_call)
    assert rows["ours"]["host_us"] == 5.0 and timed.count("ours") == 4
    assert timed.count("peer") == 2  # dropped from the rounds after it raised
    assert rows["peer"]["host_us"] is None and rows["peer"]["median_us"] == 12.5
    assert rows["peer"]["note"] == "host_us not measured (RuntimeError: peer's call broke)"


def test_a_note_already_on_the_row_is_kept():
    rows, calls = _calls(["peer"])
    rows["peer"]["note"] = "quack needs fp32 weights"

    def broken(fn):
        raise ValueError("no")

    measure_rounds(calls, 2, broken)
    assert rows["peer"]["note"] == "quack needs fp32 weights; host_us not measured (ValueError: no)"


@pytest.mark.skipif(not interpret_mode(), reason="runs the kernels in the interpreter: set TRITON_INTERPRET=1")
def test_the_bench_host_times_every_implementation_of_a_case_together(monkeypatch):
    from normtune.tuner.measure import bench as B
    from normtune.tuner.gpu_info import detect

    batches = []
    real = B.measure_rounds

    def recording(calls, rounds, time_call):
        batches.append([(c.row["impl"], c.field) for c in calls])
        real(calls, rounds, time_call)

    monkeypatch.setattr(B, "measure_rounds", recording)
    opts = B.BenchOptions(norms=["layer_norm", "rms_norm"], dtype="fp32", shapes=[(8, 96)], peers=["torch"])
    report = B.run_bench(opts, detect(interpret=True))
    ours = [("normtune", f) for f in ("host_us", "forward_host_us", "host_direct_us", "forward_host_direct_us")]
    assert batches == [ours + [("torch", "host_us"), ("torch", "forward_host_us")]] * 2
    assert len(report.rows) == 4
    for row in report.rows:
        assert row["status"] == "ok" and row["host_us"] > 0 and row["forward_host_us"] > 0, row
        assert row["impl"] != "normtune" or (row["host_direct_us"] > 0 and row["forward_host_direct_us"] > 0), row
