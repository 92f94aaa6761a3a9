"""GPUs other than the H100, stood in on CPU: their limits are read from the device's properties, the analytic
default fits each device, and no feature a device lacks (PDL, eviction hints, inline PTX) is chosen, offered or
launched. The stand-in properties are what `torch.cuda.get_device_properties` reports on each GPU (ROCm's torch
reports AMD GPUs through torch.cuda, with a major version of 9 for gfx90a/gfx942/gfx950)."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch

from normtune.kernels import device as device_mod
from normtune.kernels import limits as L
from normtune.kernels import backward_launch as launch
from normtune.kernels.strategies.capabilities import fallbacks, portable
from normtune.kernels.config import BackwardConfig, ConfigError, Kernel2Config, Problem, default_config, kernel_1_config
from normtune.kernels.heuristics import estimate_registers, hardware_registers, staged_shared_bytes
from normtune.kernels.select.select import clear_caches, explain
from normtune.kernels.select.table_chain import choose_table, table_for
from normtune.tuner.space import Space

KiB = 1024
# What torch.cuda.get_device_properties reports (the fields the limits read), per GPU.
PROPS = {
    "a100": dict(name="NVIDIA A100-SXM4-80GB", major=8, minor=0, multi_processor_count=108,
                 shared_memory_per_block_optin=163 * KiB, shared_memory_per_multiprocessor=164 * KiB,
                 regs_per_multiprocessor=65536, warp_size=32, max_threads_per_multi_processor=2048),
    "b200": dict(name="NVIDIA B200", major=10, minor=0, multi_processor_count=148,
                 shared_memory_per_block_optin=227 * KiB, shared_memory_per_multiprocessor=228 * KiB,
                 regs_per_multiprocessor=65536, warp_size=32, max_threads_per_multi_processor=2048),
    "rtx4090": dict(name="NVIDIA GeForce RTX 4090", major=8, minor=9, multi_processor_count=128,
                    shared_memory_per_block_optin=99 * KiB, shared_memory_per_multiprocessor=100 * KiB,
                    regs_per_multiprocessor=65536, warp_size=32, max_threads_per_multi_processor=1536),
    "mi300x": dict(name="AMD Instinct MI300X", major=9, minor=4, multi_processor_count=304,
                   gcnArchName="gfx942:sramecc+:xnack-", shared_memory_per_block=64 * KiB, warp_size=64,
                   regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048),
    "mi250x": dict(name="AMD Instinct MI250X", major=9, minor=0, multi_processor_count=110,
                   gcnArchName="gfx90a:sramecc+:xnack-", shared_memory_per_block=64 * KiB, warp_size=64),
    "h100": dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                 shared_memory_per_block_optin=227 * KiB, shared_memory_per_multiprocessor=228 * KiB,
                 regs_per_multiprocessor=65536, warp_size=32, max_threads_per_multi_processor=2048),
}
HIP = {"mi300x", "mi250x"}

PROBLEMS = [
    Problem("layer_norm", 4096, 4096, "bf16", has_bias=True),
    Problem("layer_norm", 2048, 12288, "bf16", has_bias=True),  # the pipelined split in 4 on an H100
    Problem("rms_norm", 4096, 32768, "bf16"),  # split rows, evict_first
    Problem("rms_norm", 1024, 16384, "fp32"),  # fp32 split with PDL on an H100
    Problem("rms_norm", 256, 65536, "fp16"),  # columns strategy
    Problem("layer_norm", 8192, 65536, "fp32", has_bias=True, save="output"),  # two-pass
    Problem("rms_norm", 4096, 16384, "bf16", save="output"),  # prefetch with recompute
    Problem("rms_norm", 8192, 128, "bf16"),
    Problem("layer_norm", 1, 3000, "fp16", has_bias=True),
]


@pytest.fixture
def stand_in(monkeypatch):
    """Make torch.cuda describe the named GPU as device 0 (no GPU is touched: only properties are read)."""
    def use(key: str):
        props = SimpleNamespace(**PROPS[key])
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (props.major, props.minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: props.name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.version, "hip", "6.2" if key in HIP else None)
        for cached in ("_cuda_limits", "_cuda_capability", "_cuda_name", "_cuda_sm_count"):
            if hasattr(device_mod, cached):
                getattr(device_mod, cached).cache_clear()
        launch.plan.cache_clear()
        return torch.device("cuda", 0)

    yield use
    for cached in ("_cuda_limits", "_cuda_capability", "_cuda_name", "_cuda_sm_count"):
        if hasattr(device_mod, cached):
            getattr(device_mod, cached).cache_clear()
    launch.plan.cache_clear()


def test_limits_are_read_from_each_devices_properties(stand_in):
    a100 = device_mod.device_limits(stand_in("a100"))
    assert (a100.vendor, a100.arch, a100.sm_count, a100.shared_per_block, a100.warp_size) == \
        ("nvidia", "sm_80", 108, 163 * KiB, 32)
    assert (a100.pdl, a100.eviction_hints, a100.inline_ptx, a100.direct_launch) == (False, True, True, True)
    b200 = device_mod.device_limits(stand_in("b200"))
    assert (b200.arch, b200.sm_count, b200.pdl, b200.max_warps) == ("sm_100", 148, True, 32)
    rtx = device_mod.device_limits(stand_in("rtx4090"))
    assert (rtx.shared_per_block, rtx.max_threads_per_sm, rtx.pdl) == (99 * KiB, 1536, False)
    mi = device_mod.device_limits(stand_in("mi300x"))
    assert (mi.vendor, mi.arch, mi.sm_count, mi.warp_size, mi.max_warps, mi.shared_per_block) == \
        ("amd", "gfx942", 304, 64, 16, 64 * KiB)
    # ROCm's capability 9.4 is no Hopper: none of the NVIDIA features
    assert not (mi.pdl or mi.eviction_hints or mi.inline_ptx or mi.direct_launch)
    # the CDNA register file, in 64-lane wavefronts: 16 wavefronts get 128 registers a lane, 8 the 256 cap
    assert (hardware_registers(16, mi), hardware_registers(8, mi), hardware_registers(16)) == (128, 256, 128)


@pytest.mark.parametrize("key", ["a100", "b200", "rtx4090", "mi300x", "h100"])
def test_defaults_fit_each_device_and_ask_for_nothing_it_lacks(key):
    lim = L.STAND_INS[key]
    for p in PROBLEMS:
        cfg = default_config(p, lim)
        cfg.validate(p, lim)
        k1 = cfg.kernel_1
        assert fallbacks(cfg, lim) == [], (key, p.key, cfg)
        assert k1.num_warps * lim.warp_size <= lim.max_threads_per_block, (key, p.key, cfg)
        assert cfg.kernel_2.num_warps <= lim.max_warps
        knob = cfg.to_dict()["kernel_1"]  # the rows strategy's knobs at their defaults where it lacks them
        assert staged_shared_bytes(p, k1.block_row, k1.block_col, k1.num_stages, knob["two_pass"], k1.prefetch,
                                   k1.num_warps) <= lim.shared_per_block, (key, p.key, cfg)
        regs = estimate_registers(p, k1.block_row, k1.block_col, k1.num_warps, knob["two_pass"], k1.prefetch,
                                  knob["recompute"], knob["column_accumulators"], lim.warp_size)
        assert regs <= 1.3 * hardware_registers(k1.num_warps, lim), (key, p.key, cfg)
    assert default_config(PROBLEMS[0], L.H100) == default_config(PROBLEMS[0])  # the reference is the H100


def test_the_h100_only_forms_are_replaced_where_they_do_not_fit():
    wide = PROBLEMS[1]
    h100 = default_config(wide, L.H100)
    assert h100.kernel_1.pipelined_split and h100.kernel_1.num_stages == 3 and h100.kernel_2.pdl
    # 3 stages of 4x4096 bf16 tiles need 128 KB: over the RTX 4090's 99 KB and the MI300X's 64 KB
    for lim in (L.RTX4090, L.MI300X):
        cfg = default_config(wide, lim)
        assert cfg != h100 and cfg.is_valid(wide, lim) and not h100.is_valid(wide, lim)
    # the A100 has the room and the inline PTX, not PDL
    a100 = default_config(wide, L.A100)
    assert a100 == BackwardConfig(h100.kernel_1, dataclasses.replace(h100.kernel_2, pdl=False))
    # 32 warps of 64 threads exceed a program on AMD
    with pytest.raises(ValueError, match="num_warps=32 is more than the 16 warps of 64 threads"):
        BackwardConfig(kernel_1_config(block_row=1, block_col=16384, num_warps=32, programs_per_sm=1),
                       Kernel2Config()).validate(Problem("rms_norm", 64, 16384, "bf16"), L.MI300X)


def test_launch_runs_the_portable_form_of_a_config(stand_in):
    p = Problem("layer_norm", 2048, 16384, "bf16", has_bias=True)
    cfg = BackwardConfig(kernel_1_config(block_row=2, block_col=4096, num_warps=8, num_stages=2, programs_per_sm=1,
                                       eviction_policy="evict_first", row_split=4, column_accumulators=True,
                                       pipelined_split=True),
                         Kernel2Config(block_m=64, block_n=16, num_warps=1, pdl=True))
    expected = {"h100": ("evict_first", True), "a100": ("evict_first", True), "mi300x": ("", False)}
    for key, (eviction, pipelined) in expected.items():
        pl = launch.plan(p, cfg, stand_in(key), False)
        assert (pl.k1_kwargs["EVICTION"], pl.k1_kwargs["PIPELINED"]) == (eviction, pipelined), key
        assert pl.config == portable(cfg, device_mod.device_limits(torch.device("cuda", 0)))


def test_pdl_only_where_the_device_has_it(stand_in, monkeypatch):
    monkeypatch.setattr(launch, "interpret_mode", lambda: False)
    monkeypatch.setattr(launch, "PDL_SUPPORTED", True)
    cfg = BackwardConfig(kernel_1_config(block_row=1, block_col=4096, num_warps=8, programs_per_sm=1),
                         Kernel2Config(block_m=64, block_n=16, pdl=True))
    found = {key: launch.pdl_enabled(cfg, stand_in(key)) for key in ("h100", "b200", "a100", "mi300x", "mi250x")}
    # ROCm reports the MI300X as 9.4 and the MI250X as 9.0: neither has programmatic dependent launch
    assert found == {"h100": True, "b200": True, "a100": False, "mi300x": False, "mi250x": False}


@pytest.mark.parametrize("key", ["a100", "mi300x", "b200"])
def test_the_space_offers_only_what_the_device_has(key):
    lim = L.STAND_INS[key]
    p = Problem("layer_norm", 2048, 16384, "bf16", has_bias=True)
    space = Space(p, lim.sm_count, lim)
    d = space.domains()
    assert max(d["k1.num_warps"]) == lim.max_warps and max(d["k2.num_warps"]) <= lim.max_warps
    assert (True in d["k2.pdl"]) == lim.pdl
    assert ("evict_first" in d["k1.eviction_policy"]) == lim.eviction_hints
    assert (True in d["k1.pipelined_split"]) == lim.inline_ptx
    seeds = space.seeds()
    assert seeds and all(fallbacks(c, lim) == [] and c.is_valid(p, lim) for c in seeds)
    assert space.why_not(dataclasses.replace(seeds[0], kernel_2=dataclasses.replace(
        seeds[0].kernel_2, pdl=True, fused=False))) is not None or lim.pdl


def test_an_amd_gpu_takes_no_nvidia_table_by_compute_capability(monkeypatch, tmp_path):
    monkeypatch.setenv("NORMTUNE_HOME", str(tmp_path))
    monkeypatch.delenv("NORMTUNE_CONFIG", raising=False)
    clear_caches()
    # An MI250X reports compute capability 9.0, as the shipped H100 table records
    choice = choose_table("AMD Instinct MI250X", (9, 0))
    assert choice.table is None, choice.steps
    assert "normtune tune --gpu auto" in choice.warning and "user table mi250x.json" in choice.warning
    # an unknown NVIDIA GPU of the same capability still takes it, with its warning
    assert choose_table("NVIDIA H100 NVL", (9, 0)).table is not None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            assert table_for("AMD Instinct MI300X", (9, 4)) is None
    assert len([w for w in seen if "analytic default configs" in str(w.message)]) == 1  # said once
    clear_caches()


def test_explain_says_which_features_fall_back(monkeypatch, tmp_path):
    monkeypatch.setenv("NORMTUNE_HOME", str(tmp_path))
    monkeypatch.delenv("NORMTUNE_CONFIG", raising=False)
    clear_caches()
    p = Problem("layer_norm", 2048, 16384, "bf16", has_bias=True)
    on_h100 = explain(p, "NVIDIA H100 80GB HBM3", (9, 0), limits=L.H100)
    assert on_h100.table is not None and on_h100.fallbacks == ()
    asked = on_h100.config
    on_a100 = explain(p, "NVIDIA H100 80GB HBM3", (9, 0), limits=L.A100)  # the same table, an A100's features
    assert on_a100.config == portable(asked, L.A100)
    assert bool(on_a100.fallbacks) == asked.kernel_2.pdl
    clear_caches()


def test_gpu_keys_name_the_gpu_found():
    from normtune.tuner.gpu_info import gpu_key

    names = {"NVIDIA A100-SXM4-80GB": "a100", "NVIDIA B200": "b200", "AMD Instinct MI300X": "mi300x",
             "AMD Instinct MI355X": "mi355x", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200",
             "NVIDIA L40S": "l40s", "NVIDIA GeForce RTX 4090": "rtx4090", "NVIDIA GeForce RTX 5090": "rtx5090"}
    assert {n: gpu_key(n) for n in names} == names
    assert device_mod.vendor_of("AMD Instinct MI300X") == "amd" and device_mod.vendor_of("NVIDIA B200") == "nvidia"


def test_where_prints_the_devices_limits_and_each_fallback(monkeypatch, tmp_path):
    from pathlib import Path

    from typer.testing import CliRunner

    from normtune.cli import app

    monkeypatch.setenv("NORMTUNE_HOME", str(tmp_path))
    monkeypatch.delenv("NORMTUNE_CONFIG", raising=False)
    clear_caches()
    table = Path(__file__).resolve().parents[1] / "configs" / "h100.json"
    args = ["where", "--shape", "2048x16384", "--norm", "layer_norm", "--config-file", str(table)]
    out = CliRunner().invoke(app, [*args, "--gpu", "mi300x"]).output
    assert "limits   AMD Instinct MI300X: gfx942, 304 CUs, 64 KB shared per program, 64-thread warps" in out, out
    fallbacks_said = [line for line in out.splitlines() if line.startswith("fallback ")]
    # the H100 table's config there: PDL and the pipelined split dropped, then too big for 64 KB of LDS
    assert any("kernel_2.pdl" in line for line in fallbacks_said), out
    assert any("does not fit AMD Instinct MI300X" in line for line in fallbacks_said), out
    on_h100 = CliRunner().invoke(app, [*args, "--gpu", "h100"]).output
    assert "fallback" not in on_h100 and "pdl yes" in on_h100, on_h100
    clear_caches()


def test_the_driver_version_is_read_from_either_kernel_modules_proc_text():
    from normtune.tuner.gpu_info import module_driver_version

    assert module_driver_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 "
                                 "22:23:56 UTC 2024\nGCC version:") == "550.54.15"
    assert module_driver_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release "
                                 "Build  (builder@)") == "580.159.04"
    assert module_driver_version("no driver here") is None


def test_the_analytic_default_is_valid_for_every_form_on_every_device():
    """Every form (plain, saving the output, a residual stream in the activations' dtype or fp32, either gate),
    dtype and weight dtype, from one row to 65536 and from 1 to 262144 columns: the default fits every stand-in
    device, a gated tile past a small device's shared memory taking fewer stages."""
    import itertools

    forms = [{}, {"save": "output"}, {"residual": True}, {"residual": True, "residual_dtype": "fp32"},
             {"gate": "after"}, {"gate": "before"}]
    failed = []
    for key, lim in L.STAND_INS.items():
        for norm, dtype, fp32_weight, form, M, N in itertools.product(
                ("rms_norm", "layer_norm"), ("bf16", "fp16", "fp32"), (False, True), forms, (1, 1000, 65536),
                (1, 7, 100, 128, 1000, 3000, 8192, 16384, 65536, 262144)):
            if "gate" in form and norm == "layer_norm":
                continue
            p = Problem(norm, M, N, dtype, has_bias=norm == "layer_norm" and "gate" not in form,
                        weight_dtype="fp32" if fp32_weight else dtype, **form)
            try:
                default_config(p, lim).validate(p, lim)
            except ConfigError as err:
                failed.append(f"{key} {p.key}: {err}")
    assert not failed, "\n".join(failed[:20])
