""""The default" the tuner names and times is the analytic default the runtime runs on that GPU: sized by the
limits of the device measured on (bench, compare, validate, emit --remeasure) or, for the commands that read stored
runs (emit's fit, report, the sweep's progress), by the limits of the GPU the run recorded (its stand-in, or what
its compute capability gives). Stood in on CPU for an A100 and an MI300X, whose defaults differ from the H100's
(an A100 has no PDL, an MI300X no eviction hints and at most 16 wavefronts a program)."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch

from normtune.kernels import device as kernel_device
from normtune.kernels import limits as L
from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, default_config, kernel_1_config
from normtune.kernels.select.tables import parse_table
from normtune.tuner import gpu_info as D
from normtune.tuner.measure import bench as B
from normtune.tuner.measure import harness as measure
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.report.data import load_report_data, summarize_problems
from normtune.tuner.space import Space
from normtune.tuner.store.database import Store
from normtune.tuner.tables import compare as C
from normtune.tuner.tables import emit, remeasure
from normtune.tuner.tables import validate as V
from normtune.tuner.sweep.progress import _default_us


def info(limits: L.DeviceLimits, key: str, cc: str) -> D.DeviceInfo:
    return D.DeviceInfo(name=limits.name, key=key, compute_capability=cc, sm_count=limits.sm_count,
                        l2_bytes=50 * 2**20, memory_bytes=80 * 2**30, driver="570.1", cuda="12.8", torch="2.11.0",
                        triton="3.6.0", normtune="0.1.0", git_revision="aaaa111", host="node-1", python="3.12.3",
                        interpret=False)


A100, MI300X = info(L.A100, "a100", "8.0"), info(L.MI300X, "mi300x", "9.4")
# H100: kernel_2 overlaps kernel_1 through PDL; an A100 has none.
WIDE_LN = Problem("layer_norm", 1024, 12288, "bf16", has_bias=True)
# H100: evict_first loads; an MI300X has no eviction hints.
RMS = Problem("rms_norm", 4096, 4096, "bf16")


def ok(median: float) -> MeasureResult:
    return MeasureResult(status="ok", median_us=median, p10_us=median * 0.99, p90_us=median * 1.01, reps=20)


def other_than(config: BackwardConfig) -> BackwardConfig:
    """A valid config that is not `config`: its kernel_2 on taller tiles."""
    k2 = config.kernel_2
    return BackwardConfig(config.kernel_1, dataclasses.replace(k2, block_m=k2.block_m * 2))


def test_the_stand_ins_differ_from_the_h100_on_these_problems():
    """The premise of every test below: on these problems the device-sized default is not the H100's."""
    assert default_config(WIDE_LN, L.A100) != default_config(WIDE_LN)
    assert default_config(WIDE_LN, L.A100).kernel_2.pdl is False and default_config(WIDE_LN).kernel_2.pdl
    assert default_config(RMS, L.MI300X) != default_config(RMS)


# ------------------------------------------------------------------------------------- limits of a stored run


def test_a_stored_run_gets_its_gpus_limits_by_key_or_name_or_capability():
    a100 = D.run_limits(A100)
    assert (a100.arch, a100.vendor, a100.warp_size, a100.shared_per_block, a100.sm_count) == \
        ("sm_80", "nvidia", 32, 163 * 1024, 108)
    mi = D.run_limits(MI300X)
    assert (mi.vendor, mi.arch, mi.warp_size, mi.max_warps) == ("amd", "gfx942", 64, 16)
    # A key that is not a stand-in's (a run labelled by hand): the name's GPU key finds it.
    assert D.stored_limits("my-a100", "NVIDIA A100-SXM4-40GB", "8.0", 108) == \
        dataclasses.replace(L.A100, name="NVIDIA A100-SXM4-40GB")
    # No stand-in: the compute capability's limits (an RTX 3090 is 8.6), the SM count recorded.
    ampere = D.stored_limits("rtx3090", "NVIDIA GeForce RTX 3090", "8.6", 82)
    assert (ampere.arch, ampere.shared_per_block, ampere.sm_count) == ("sm_86", 99 * 1024, 82)
    # An AMD GPU without a stand-in: its architecture from ROCm's capability, 64-lane wavefronts.
    mi250 = D.stored_limits("mi250x", "AMD Instinct MI250X", "9.0", 110)
    assert (mi250.vendor, mi250.arch, mi250.warp_size) == ("amd", "gfx90a", 64)
    assert D.stored_limits("interpret", "cpu (triton interpreter)", None, 4, True) is None
    # H100 and H200 runs: the reference device's limits, so their defaults are today's.
    for gpu in (info(L.H100, "h100", "9.0"), info(L.H200, "h200", "9.0")):
        assert all(default_config(p, D.run_limits(gpu)) == default_config(p) for p in (WIDE_LN, RMS))


def test_an_unknown_gpu_is_sized_as_the_reference_and_says_so():
    with pytest.warns(UserWarning, match=r"NVIDIA Future GPU: no stand-in and no limits known for compute "
                                         r"capability 13.0: sized as NVIDIA H100"):
        future = D.stored_limits("future", "NVIDIA Future GPU", "13.0", 200)
    assert (future.name, future.sm_count, future.warp_size, future.registers_per_sm) == \
        ("NVIDIA Future GPU", 200, 32, L.H100.registers_per_sm)
    with pytest.warns(UserWarning, match=r"AMD Instinct MI999: architecture unknown \(compute capability 9.9\)"
                                         r".*64-lane wavefronts"):
        amd = D.stored_limits("mi999", "AMD Instinct MI999", "9.9", 300)
    assert (amd.vendor, amd.warp_size, amd.max_warps) == ("amd", 64, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # known GPUs: no warning
        D.stored_limits("a100", "NVIDIA A100-SXM4-80GB", "8.0", 108)


# ------------------------------------------------------------------------------- offline: emit's fit, report


def test_emission_treats_the_a100_sized_default_as_the_default(tmp_path):
    """An A100 run timed its own default and a config 0.5 % faster (inside DEFAULT_TIE): the rule gives way to
    the measured default, which it knows as the default only when sized for the A100."""
    default = default_config(WIDE_LN, L.A100)
    store = Store(f"sqlite:///{tmp_path / 'a100.db'}")
    run = store.start_run(A100, kind="sweep", command_line="normtune sweep --gpu a100")
    store.add_measurement(run, WIDE_LN, default, ok(100.0), source="seed")
    store.add_measurement(run, WIDE_LN, other_than(default), ok(99.5), source="sweep")
    store.end_run(run)
    family = emit.build_table(store, "a100")["families"][WIDE_LN.family.key]
    assert family["default_unmeasured"] == []
    assert [BackwardConfig.from_dict(r["config"]) for r in family["rules"]] == [default]


def test_the_report_compares_with_the_mi300x_sized_default(tmp_path):
    default = Space(RMS, L.MI300X.sm_count, L.MI300X).canonical(default_config(RMS, L.MI300X))
    store = Store(f"sqlite:///{tmp_path / 'mi300x.db'}")
    run = store.start_run(MI300X, kind="sweep", command_line="normtune sweep --gpu mi300x")
    store.add_measurement(run, RMS, default, ok(30.0), source="seed", study_name="s", trial_number=0)
    store.add_measurement(run, RMS, other_than(default), ok(25.0), source="sweep", study_name="s", trial_number=1)
    store.end_run(run)
    (summary,) = summarize_problems(load_report_data(store, "mi300x"))
    assert summary.best.median_us == 25.0 and summary.default_us == 30.0
    # The sweep's progress: its default from the sweep's run, sized for the MI300X.
    study = SimpleNamespace(study_name="s", problem=RMS, best_run_id=run)
    assert _default_us(store, study, {r.id: r for r in store.runs()}) == 30.0


# ------------------------------------------------------------------ on a GPU: bench, compare, validate, remeasure


class FakeSession:
    """What the commands ask of a `measure.MeasureSession` on a CUDA device, recording what it is asked to time."""

    device = torch.device("cuda", 0)
    on_gpu = False  # nothing of torch.cuda is called
    recorded_bandwidth_gbps = None
    timing = SimpleNamespace(host_reps=1)

    def __init__(self):
        self.timed: list[tuple[Problem, BackwardConfig]] = []

    def measure_problem(self, problem, config):
        self.timed.append((problem, config))
        return ok(10.0)

    def case(self, problem):
        return SimpleNamespace(reference=lambda: None)

    def floor_us(self, problem):
        return 1.0

    def provenance(self):
        return {}


@pytest.fixture
def on_mi300x(monkeypatch):
    """This process's GPU is an MI300X, and every session measures on it."""
    monkeypatch.setattr(kernel_device, "device_limits", lambda device: L.MI300X)
    session = FakeSession()
    monkeypatch.setattr(measure.MeasureSession, "for_device", classmethod(lambda cls, *a, **k: session))
    return session


@pytest.mark.parametrize("spec", ["default", "table"])
def test_bench_runs_the_default_sized_for_the_gpu(on_mi300x, monkeypatch, spec):
    chosen = []

    def time_ours(session, case, ref, config, how, row, host):
        chosen.append((config, how))
        return dict(row, median_us=10.0)

    monkeypatch.setattr(B, "_time_ours", time_ours)
    opts = B.BenchOptions(norms=["rms_norm"], dtype="bf16", shapes=[(RMS.M, RMS.N)], peers=[], config=spec)
    B.run_bench(opts, MI300X, session=on_mi300x)
    problem = B.problem_for("rms_norm", RMS.M, RMS.N, "bf16", None)
    assert chosen == [(default_config(problem, L.MI300X), spec)]  # no table for an MI300X: its default


def test_compare_resolves_each_table_as_the_runtime_does_on_the_gpu(on_mi300x):
    """No rule: the MI300X's default. A rule whose config asks for 32 warps (an H100 may, an MI300X may not): the
    MI300X's default too; one with eviction hints: its portable form."""
    h100_only = BackwardConfig(kernel_1_config(block_row=1, block_col=4096, num_warps=32),
                               Kernel2Config(block_m=128, block_n=16, num_warps=4))
    hinted = BackwardConfig(kernel_1_config(block_row=1, block_col=4096, num_warps=8, eviction_policy="evict_first"),
                            Kernel2Config(block_m=128, block_n=16, num_warps=4))
    h100_only.validate(RMS)

    def table(config):
        rules = [{"n_max": None, "m_max": None, "config": config.to_dict(), "fitted_on": ["4096x4096"]}]
        return parse_table({"schema_version": emit.SCHEMA_VERSION, "interpret": False,
                            "gpu": {"name": L.H100.name, "key": "h100", "compute_capability": "9.0", "sm_count": 132},
                            "families": {RMS.family.key: {"rules": rules}}})

    (row,) = C.compare_tables(None, table(h100_only), [RMS], on_mi300x, rounds=1)
    assert row.old_config == row.new_config == default_config(RMS, L.MI300X) and on_mi300x.timed == []
    (row,) = C.compare_tables(None, table(hinted), [RMS], on_mi300x, rounds=1)
    assert row.new_config == dataclasses.replace(hinted, kernel_1=dataclasses.replace(hinted.kernel_1,
                                                                                      eviction_policy=""))
    assert {c for _, c in on_mi300x.timed} == {row.old_config, row.new_config}


def test_validate_times_the_default_sized_for_the_gpu(on_mi300x, monkeypatch, tmp_path):
    monkeypatch.setattr(V, "reference_sweep", lambda store, info, key, problems, **kw: {p.key: (None, 0)
                                                                                         for p in problems})
    store = Store(f"sqlite:///{tmp_path / 'v.db'}")
    (row,) = V.run_validate(store, MI300X, "mi300x", [RMS], None, storage_url="sqlite://", rounds=1)
    assert row.configs["default"] == row.configs["table"] == default_config(RMS, L.MI300X)
    assert {c for _, c in on_mi300x.timed} == {default_config(RMS, L.MI300X)}


def test_remeasure_times_the_default_sized_for_the_gpu(on_mi300x, tmp_path):
    """emit --remeasure times each problem's default where no run did: the MI300X's, not the H100's."""
    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    run = store.start_run(MI300X, kind="sweep", command_line="normtune sweep --gpu mi300x")
    store.add_measurement(run, RMS, other_than(default_config(RMS, L.MI300X)), ok(25.0), source="sweep")
    store.end_run(run)
    remeasure.remeasure_neighbours(store, "mi300x", MI300X, command_line="normtune emit --remeasure")
    assert on_mi300x.timed == [(RMS, default_config(RMS, L.MI300X))]
