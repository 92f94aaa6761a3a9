"""Every kernel compiles for every target GPU (sm_80, sm_90, sm_100, sm_120, gfx942, gfx950) on a machine
without a GPU.

The interpreter runs a kernel's Python, not Triton's compiler: code it accepts can still fail to compile (a
variable given different shapes in the two branches of a runtime `if`, a block that is not a power of two, inline
PTX on AMD). Run as a script, this file records what `precompile` (the sweep's compile-ahead path) would compile
on each target's stand-in device (`kernels/limits.py`: its warps, shared memory and features, so a config runs in
the portable form that device gets), then compiles each kernel once for the target, with the ptxas bundled in
Triton's wheel (NVIDIA) or Triton's AMD backend (its LLVM and linker are in the wheel), and prints one JSON line
per kernel; the tests run it in a subprocess without the interpreter. Per target it compiles:

- a covering sample of each strategy's search space (`compile_sample`): on sm_90 every knob value the strategy
  uses occurs, tile sizes included; on the other targets every value of the knobs that change the code's form
  (pass mode, stages, eviction hint, prefetch, recompute, pipelined split, PDL, fused reduction, ...); values
  that the other configs below already hold are not drawn again;
- every form the analytic default takes on that device;
- per strategy a residual stream and a gate, the rows strategy's two-pass form with a gate, and the rows strategy
  at sizes whose offsets need 64 bits;
- the forward kernel, with a gate too;
- on sm_90 also CASES below, whose compiled code the tests inspect (pipelining, spills, vector width).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from normtune.kernels.heuristics import staged_shared_bytes
from normtune.kernels.strategies.rows import exchanges_across_warps

# One worker runs the module (`--dist loadgroup`): split between workers, the second waited on the first's
# compilation (the `compiled` fixture's lock) instead of running other tests meanwhile.
pytestmark = pytest.mark.xdist_group("hopper-compile")

# target -> (Triton backend, arch, warp size, the stand-in device in kernels/limits.py)
TARGETS = {
    "sm_80": ("cuda", 80, 32, "a100"),
    "sm_90": ("cuda", 90, 32, "h100"),
    "sm_100": ("cuda", 100, 32, "b200"),
    "sm_120": ("cuda", 120, 32, "rtx5090"),
    "gfx942": ("hip", "gfx942", 64, "mi300x"),
    "gfx950": ("hip", "gfx950", 64, "mi355x"),
}

CASES = [  # (norm, M, N, dtype, save, which seed); a residual case's dtype is "x+h" (activations x, stream h)
    ("layer_norm", 4096, 4096, "bf16", "input", "default"),
    ("layer_norm", 4096, 12288, "bf16", "input", "split3"),
    ("rms_norm", 512, 16384, "bf16", "output", "split2-fused"),
    ("rms_norm", 4096, 65536, "bf16", "input", "two_pass"),
    ("rms_norm", 256, 32768, "fp16", "input", "columns"),
    ("rms_norm", 1024, 28672, "fp16", "output", "split7"),
    ("layer_norm", 64, 4096, "bf16", "input", "dual"),
    ("rms_norm", 100, 8192, "bf16", "output", "dual"),
    ("layer_norm", 64, 4096, "bf16", "input", "pdl"),
    ("layer_norm", 2048, 16384, "bf16", "input", "pipelined2"),
    ("rms_norm", 1024, 28672, "fp16", "output", "pipelined7"),
    ("layer_norm", 2048, 16384, "bf16", "input", "staged-split2"),
    ("rms_norm", 4096, 32768, "bf16", "input", "pipelined8"),  # 4-row tiles, dw/db per column, 3 stages
    ("rms_norm", 512, 16384, "bf16", "output", "pipelined2-fused"),
    ("rms_norm", 2048, 16384, "bf16", "input", "recompute"),
    ("rms_norm", 2048, 16384, "fp16", "input", "recompute"),
    ("rms_norm", 1, 16384, "fp16", "input", "recompute"),  # M = 1 compiles as a constant
    ("layer_norm", 2048, 16384, "bf16", "output", "two_pass-staged"),  # staged weight, bias and partial rows
    ("layer_norm", 20000, 3000, "bf16", "input", "unaligned"),  # rows of 3000 columns: 16-byte vectors all the same
    ("rms_norm", 64, 1000, "bf16", "output", "unaligned-dual"),
    ("layer_norm", 2048, 12288, "fp32", "input", "default"),  # fp32's wide rows: 3 slices of 2 x 4096, prefetch
    # The residual form (dh read with g and s, added where grad_input is written), every strategy
    ("rms_norm", 4096, 4096, "bf16+bf16", "input", "default"),
    ("rms_norm", 4096, 4096, "bf16+fp32", "input", "default"),
    ("layer_norm", 4096, 12288, "bf16+fp32", "input", "split3"),
    ("rms_norm", 1024, 28672, "bf16+bf16", "output", "pipelined7"),
    ("rms_norm", 512, 16384, "bf16+fp32", "input", "split2-fused"),
    ("rms_norm", 4096, 65536, "bf16+bf16", "input", "two_pass"),
    ("rms_norm", 256, 32768, "bf16+fp32", "input", "columns"),
    ("layer_norm", 64, 4096, "bf16+bf16", "input", "dual"),
    ("rms_norm", 2048, 16384, "bf16+bf16", "input", "recompute"),
    ("layer_norm", 20000, 3000, "bf16+bf16", "input", "unaligned"),
]
# Cases whose kernel_1 must (True) or must not (False) software-pipeline its tile loop (asynchronous copies).
PIPELINED = {"pipelined2": True, "pipelined7": True, "pipelined8": True, "pipelined2-fused": True,
             "staged-split2": False}


def knobs(config):
    """Every kernel_1 knob of the layout (those the config's strategy lacks at their default), by attribute: a
    rows knob read from a columns or dual config is its default, not an AttributeError."""
    return SimpleNamespace(**config.to_dict()["kernel_1"])


PICK = {
    "default": lambda c, d: c == d,
    "split3": lambda c, d: knobs(c).row_split == 3,
    "split7": lambda c, d: knobs(c).row_split == 7,
    "split2-fused": lambda c, d: knobs(c).row_split == 2,
    "two_pass": lambda c, d: knobs(c).two_pass,
    "columns": lambda c, d: knobs(c).strategy == "columns",
    "dual": lambda c, d: knobs(c).strategy == "dual",
    "pdl": lambda c, d: c.kernel_2.pdl,
    "pipelined2": lambda c, d: knobs(c).pipelined_split and knobs(c).row_split == 2,
    "pipelined7": lambda c, d: knobs(c).pipelined_split and knobs(c).row_split == 7,
    "pipelined8": lambda c, d: knobs(c).pipelined_split and knobs(c).row_split == 8,
    "pipelined2-fused": lambda c, d: knobs(c).pipelined_split and knobs(c).row_split == 2,
    # the same split seed with its exchange plain: Triton's pipeliner skips the loop (no async copy)
    "staged-split2": lambda c, d: knobs(c).pipelined_split and knobs(c).row_split == 2,
    "recompute": lambda c, d: knobs(c).recompute and knobs(c).row_split == 1 and knobs(c).block_row == 1,
    "two_pass-staged": lambda c, d: c == d,  # made two-pass, 2x4096 tiles, 3 stages below
    "unaligned": lambda c, d: c == d,
    "unaligned-dual": lambda c, d: knobs(c).strategy == "dual",
}
# Cases whose kernels must move 16-bit rows in vectors only: widths that are multiples of 8 but not of 16, which
# only the kernels' alignment hint tells the compiler. What may stay narrow is the final dw/db store (one column
# per thread, as at aligned widths: at most 2 accesses); without the hint there were 88 (LayerNorm 20000x3000's
# kernel_1) and 134 (the dual kernel at 1000 columns), and 32 in the forward at 3000.
VECTORIZED = ("unaligned", "unaligned-dual")
# Cases whose kernel_1 must keep everything in registers (no stack frame): recompute widens the packed 16-bit
# tile again after the row reductions instead of keeping fp32 copies live, in fp16 as in bf16.
NO_STACK = ("recompute",)
POINTERS = {"torch.float32": "*fp32", "torch.bfloat16": "*bf16", "torch.float16": "*fp16", "torch.int32": "*i32"}


def _signature(kernel, args, kwargs):
    """Triton's signature, compile-time values and argument attributes for a `warmup(*args, **kwargs)` call,
    specialized as a launch on the same values is: buffers start 16-byte aligned (`plan.placeholders`),
    integers divisible by 16 are marked so, and an integer 1 becomes a compile-time constant."""
    values = iter(args)
    signature, constants, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constants[p.name] = kwargs.get(p.name, kernel.signature.parameters[p.name].default)
            continue
        a = next(values)
        if "torch." in str(a):
            signature[p.name] = POINTERS[str(a)]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, float):
            signature[p.name] = "fp32"
        elif a == 1 and not p.do_not_specialize:
            signature[p.name], constants[p.name] = "constexpr", 1
        else:
            signature[p.name] = "i32"
            if a % 16 == 0 and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs



def _jobs(target: str, limits) -> list[tuple[str, object, object]]:
    """(pick, problem, config) to compile for the target: CASES on sm_90, the covering sample (every knob value
    on sm_90, every code form elsewhere), the defaults' forms, the residual and 64-bit variants."""
    from compile_sample import covering_sample, default_forms, variants

    from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, default_config
    from normtune.tuner.space import Space

    jobs = []
    if target == "sm_90":
        for norm, M, N, dtypes, save, pick in CASES:
            dtype, _, residual_dtype = dtypes.partition("+")
            problem = Problem(norm, M, N, dtype, has_bias=norm == "layer_norm", save=save,
                              residual=bool(residual_dtype), residual_dtype=residual_dtype or None)
            default = default_config(problem)
            config = next(c for c in [default] + Space(problem, 132).seeds() if PICK[pick](c, default))
            if pick in ("split2-fused", "pipelined2-fused"):
                config = BackwardConfig(config.kernel_1, Kernel2Config(block_m=32, block_n=128, num_warps=1,
                                                                       fused=True))
            if pick == "staged-split2":
                config = BackwardConfig(dataclasses.replace(config.kernel_1, pipelined_split=False), config.kernel_2)
            if pick == "two_pass-staged":
                config = BackwardConfig(dataclasses.replace(
                    config.kernel_1, two_pass=True, row_split=1, pipelined_split=False, recompute=False,
                    prefetch=False, column_accumulators=False, block_row=2, block_col=4096, num_warps=8,
                    num_stages=3), config.kernel_2)
            jobs.append((pick, problem, config))
    # The sample adds only the knob values that the cases, default forms and variants compiled here lack.
    fixed = jobs + [("default-form", problem, config) for problem, config in default_forms(limits)] + variants(limits)
    sample, unreached = covering_sample(limits, features_only=target != "sm_90", given=tuple(c for _, _, c in fixed))
    print(json.dumps({"target": target, "pick": "unreached", "unreached": unreached}), flush=True)
    return fixed + [(f"sample-{strategy}", problem, config) for strategy, problem, config in sample]


def main(targets: list[str]) -> None:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from normtune.kernels import limits as L
    from normtune.kernels import backward_launch as launch

    calls = []
    JITFunction.warmup = lambda self, *args, grid=None, **kwargs: calls.append((self, args, kwargs)) or object()
    device = torch.device("cuda", 0)  # a name only: nothing here touches a GPU
    for target in targets:
        backend, arch, warp, stand_in = TARGETS[target]
        limits = L.STAND_INS[stand_in]
        launch.sm_count = lambda device, n=limits.sm_count: n
        launch.device_limits = lambda device, lim=limits: lim
        launch.plan.cache_clear()
        compiled_keys = set()
        for pick, problem, config in _jobs(target, limits):
            config.validate(problem, limits)
            k1 = config.kernel_1
            before = len(calls)
            launch.precompile(problem, config, limits.sm_count, device)
            for kernel, args, kwargs in calls[before:]:
                signature, constants, attrs = _signature(kernel, args, kwargs)
                options = {k: v for k, v in kwargs.items() if k not in signature}
                key = (kernel.fn.__name__, repr(sorted(signature.items())), repr(sorted(constants.items())),
                       repr(sorted(attrs.items())), repr(sorted(options.items())))
                if key in compiled_keys and pick.startswith(("sample-", "default-", "residual-", "gated-",
                                                              "int64")):
                    continue  # the same kernel as an earlier config's
                compiled_keys.add(key)
                row = {"target": target, "case": f"{problem.key} {pick}", "pick": pick, "kernel": kernel.fn.__name__,
                       "config": str(config), "error": None, "num_stages": k1.num_stages,
                       "int64": constants.get("INT64"), "residual": constants.get("HAS_DRES"),
                       "gated": constants.get("HAS_GATE"),
                       "shared_limit": limits.shared_per_block,
                       "staged_estimate": staged_shared_bytes(problem, k1.block_row, k1.block_col, k1.num_stages,
                                                              knobs(config).two_pass, k1.prefetch, k1.num_warps,
                                                              exchanges_across_warps(knobs(config)),
                                                              k1.strategy == "rows")}
                try:
                    out = triton.compile(ASTSource(kernel, signature, constants, attrs),
                                         target=GPUTarget(backend, arch, warp), options=options)
                    row["shared"] = out.metadata.shared
                    if backend == "cuda":
                        ptx = out.asm["ptx"]
                        row.update(async_copies=ptx.count("cp.async.c"), narrow=_narrow_accesses(ptx),
                                   stack=_stack_bytes(out.asm["cubin"]) if pick in NO_STACK else None)
                except Exception as err:  # noqa: BLE001 - reported to the test, which names the kernel and config
                    row["error"] = f"{type(err).__name__}: {str(err)[-600:]}"
                print(json.dumps(row), flush=True)
        # rows of 3000 columns (with a residual stream on sm_90), and the chunked forward of 12288 with one
        forwards = [(3000, None, "forward", None), (12288, "fp32", "forward-chunked", None),
                    (3000, None, "forward-gated", (True, False)), (12288, None, "forward-gated", (False, True))]
        if target == "sm_90":
            forwards += [(3000, "bf16", "forward", None), (3000, "fp32", "forward", None),
                         (12288, "bf16", "forward-chunked", None)]
        for N, h_dtype, pick, gate in forwards:
            print(json.dumps(dict(_forward_case(N, backend, arch, warp, h_dtype, gate), target=target, pick=pick)),
                  flush=True)


def _narrow_accesses(ptx: str) -> int:
    """Global loads and stores of one 16-bit element (`ld.global….b16`, `st.global….b16`) in a kernel's PTX."""
    import re

    return len(re.findall(r"\b(?:ld|st)\.global[\w.:]*\.b16\b", ptx))


def _forward_case(N: int, backend: str, arch, warp: int, h_dtype: str | None = None,
                  gate: tuple | None = None) -> dict:
    """The forward kernel for bf16 rows of N columns (LayerNorm with weight and bias; with a residual and h in
    `h_dtype` where given; an RMSNorm with weight and a gate, (after, sigmoid), where `gate` is given), compiled
    for the target as its launcher specializes it, with its PTX's narrow accesses (NVIDIA)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from normtune.kernels.forward import _forward_kernel, _launcher
    from normtune.kernels.heuristics import alignment_hint

    plain = gate is None
    launcher, _ = _launcher(N, not plain, True, plain, False, plain, False, alignment_hint(N), h_dtype is not None,
                            gate)
    kwargs = dict(launcher.constexprs)
    act, f32 = torch.bfloat16, torch.float32
    h = {None: act, "bf16": act, "fp32": f32}[h_dtype]
    signature, constants, attrs = _signature(
        _forward_kernel, (act, N, act, N, h, N, h, N, act, N, act, act, f32, f32, 20000, N, 1e-5), kwargs)
    options = {k: v for k, v in kwargs.items() if k not in signature}
    row = {"case": f"forward bf16{'+' + h_dtype if h_dtype else ''}{' gate' + str(gate) if gate else ''} {N}",
           "kernel": "forward", "error": None,
           "narrow": None}
    try:
        out = triton.compile(ASTSource(_forward_kernel, signature, constants, attrs),
                             target=GPUTarget(backend, arch, warp), options=options)
        row["narrow"] = _narrow_accesses(out.asm["ptx"]) if backend == "cuda" else None
    except Exception as err:  # noqa: BLE001 - reported to the test
        row["error"] = f"{type(err).__name__}: {str(err)[-600:]}"
    return row


def _stack_bytes(cubin: bytes) -> int | None:
    """The kernel's stack frame in bytes (spilled registers live there), from the cuobjdump bundled with Triton;
    None where there is none to ask."""
    import re
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"STACK:(\d+)", usage)
    return int(found.group(1)) if found else None




def _missing(target: str) -> str | None:
    """Why this Triton cannot compile for the target here (None: it can)."""
    import triton

    backend = TARGETS[target][0]
    root = os.path.join(os.path.dirname(triton.__file__), "backends")
    if backend == "cuda":
        ptxas = os.path.join(root, "nvidia", "bin", "ptxas")
        return None if os.path.exists(ptxas) else f"this Triton has no NVIDIA backend with ptxas ({ptxas})"
    codegen = os.path.join(root, "amd", "lib", "libtriton_amd_codegen.so")
    return None if os.path.exists(codegen) else f"this Triton has no AMD backend ({codegen} is missing)"


def _compile(target: str) -> tuple[str, str]:
    """The JSON lines and stderr of one subprocess compiling for the target."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__)] + env.get("PYTHONPATH", "").split(os.pathsep))
    result = subprocess.run([sys.executable, __file__, target], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{target}: {result.stderr[-3000:]}"
    return result.stdout, result.stderr


def _compile_all() -> dict[str, tuple[str, str]]:
    """Each available target's (stdout, stderr), from one subprocess per target, two at a time (sm_90, the
    largest, first)."""
    from concurrent.futures import ThreadPoolExecutor

    targets = sorted((t for t in TARGETS if _missing(t) is None), key=lambda t: t != "sm_90")
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        return dict(zip(targets, pool.map(_compile, targets)))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[dict]]:
    """Each available target's JSON lines. Under pytest-xdist the first worker to get here compiles and the others
    read its outputs (a lock and a file in the session's shared temporary folder), so that a module split
    between workers still compiles once."""
    if not any(_missing(t) is None for t in TARGETS):
        pytest.skip("this Triton can compile for none of the targets")
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        outputs = _compile_all()
    else:
        from filelock import FileLock  # a dependency of torch

        shared = tmp_path_factory.getbasetemp().parent / "compiled-targets.json"
        with FileLock(f"{shared}.lock"):
            if not shared.exists():
                shared.write_text(json.dumps(_compile_all()))
            outputs = {t: tuple(v) for t, v in json.loads(shared.read_text()).items()}
    # The AMD backend's LLVM reports some errors (an inline-asm constraint it does not know, as PTX's) on stderr
    # and still returns a binary: none may appear.
    reported = [f"{t}: {line}" for t, (_, err) in outputs.items() for line in err.splitlines()
                if "error" in line.lower()]
    assert not reported, "\n".join(reported[:20])
    return {t: [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            for t, (out, _) in outputs.items()}


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_strategy_and_default_compiles_for(target, compiled):
    if _missing(target):
        pytest.skip(_missing(target))
    lines = compiled[target]
    unreached = next(r["unreached"] for r in lines if r["pick"] == "unreached")
    assert unreached == {"rows": [], "columns": [], "dual": []}, unreached  # every knob value in the sample
    forward = [r for r in lines if r["pick"].startswith("forward")]
    assert len(forward) >= 4 and not any(r["error"] for r in forward), forward
    assert len([r for r in forward if r["pick"] == "forward-gated"]) == 2, forward
    kernels = [r for r in lines if not r["pick"].startswith("forward") and r["pick"] != "unreached"]
    assert {"kernel_1_single_pass", "kernel_1_two_pass", "kernel_1_columns", "row_sums", "kernel_1_dual",
            "kernel_2"} <= {r["kernel"] for r in kernels}
    assert "default-form" in {r["pick"] for r in kernels}
    # each strategy's kernel_1 with a residual stream, and the rows kernels (single and two-pass) on 64-bit offsets
    residual = {r["kernel"] for r in kernels if r["residual"]}
    assert {"kernel_1_single_pass", "kernel_1_columns", "kernel_1_dual"} <= residual, residual
    # and with a gate (the two-pass form included)
    gated = {r["kernel"] for r in kernels if r["gated"]}
    assert {"kernel_1_single_pass", "kernel_1_two_pass", "kernel_1_columns", "kernel_1_dual"} <= gated, gated
    int64 = {r["kernel"] for r in kernels if r["pick"] == "int64" and r["int64"]}
    assert {"kernel_1_single_pass", "kernel_1_two_pass"} <= int64, int64
    failed = [r for r in kernels if r["error"]]
    assert not failed, "\n".join(f"{r['case']} {r['kernel']} {r['config']}: {r['error']}" for r in failed)
    for r in kernels:
        # Every kernel fits the device's shared memory, and the space's estimate bounds what a staged kernel_1
        # asks for, single pass or two-pass, in every form (a config over the budget is refused before it reaches
        # the GPU).
        assert r["shared"] <= r["shared_limit"], r
        if r["kernel"] in ("kernel_1_two_pass", "kernel_1_single_pass") and r["num_stages"] > 1 \
                and target.startswith("sm_"):
            assert r["shared"] <= r["staged_estimate"], r


def test_hopper_code_is_pipelined_vectorized_and_spill_free(compiled):
    if _missing("sm_90"):
        pytest.skip(_missing("sm_90"))
    lines = [r for r in compiled["sm_90"] if r["pick"] in PICK or r["pick"].startswith("forward")]
    forward = [r for r in lines if r["pick"] == "forward"]
    assert len(forward) == 3 and all(r["narrow"] == 0 for r in forward), forward  # rows of 3000, with a residual too
    assert len([r for r in lines if r["pick"] == "forward-chunked"]) == 2, lines
    cases = [r for r in lines if not r["pick"].startswith("forward")]
    assert len({r["case"] for r in cases}) == len(CASES)
    for r in cases:
        if r["pick"] in PIPELINED and r["kernel"] == "kernel_1_single_pass":
            assert (r["async_copies"] > 0) == PIPELINED[r["pick"]], r
        if r["pick"] in NO_STACK and r["kernel"] == "kernel_1_single_pass" and r["stack"] is not None:
            assert r["stack"] == 0, r
        if r["pick"] in VECTORIZED:
            assert r["narrow"] <= 2, r


if __name__ == "__main__":
    main(sys.argv[1:] or list(TARGETS))
