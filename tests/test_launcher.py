"""Direct launches (`kernels/launcher.py`): after the first launch of a specialization key, the compiled kernel's
own launcher is called with the runtime arguments followed by the compile-time ones, on the current device's
stream; a new key goes through `JITFunction.run` again. On CPU with stand-ins for Triton's objects; on a GPU
with the real kernels, where a key that missed a specialization (pointer alignment, row stride) would read
misaligned memory or wrong rows.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from normtune.kernels import Problem, launcher, layer_norm, rms_norm
from normtune.kernels.device import sm_count
from normtune.tuner.space import Space


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", ("warps", 4)

    def _init_handles(self):
        pass

    def run(self, *args):
        self.log.append(("direct", args))

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream, len(args))


class FakeKernel:
    """A JITFunction stand-in: runtime parameters a, b; compile-time BLOCK and FLAG (FLAG has a default)."""

    def __init__(self, names=("a", "b", "BLOCK", "FLAG"), constexprs=("BLOCK", "FLAG")):
        def signature(a, b, BLOCK, FLAG=True):
            pass

        self.params = [SimpleNamespace(name=n, is_constexpr=n in constexprs) for n in names]
        self.signature = inspect.signature(signature)
        self.log: list = []
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return self.compiled
        return run


@pytest.fixture
def on_fake_gpu(monkeypatch):
    hooks = SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    monkeypatch.setattr(launcher, "interpret_mode", lambda: False)
    monkeypatch.setattr(launcher, "_knobs", hooks)
    device = {"index": 0}
    monkeypatch.setattr(launcher, "current_device_index", lambda: device["index"])
    monkeypatch.setattr(launcher, "_current_stream", lambda index: 1000 + index)
    return SimpleNamespace(hooks=hooks, device=device)


def test_second_launch_of_a_key_calls_the_compiled_launcher_with_constexprs_last(on_fake_gpu):
    kernel = FakeKernel()
    launch = launcher.Launcher(kernel, {"BLOCK": 64, "num_warps": 4})
    assert launch.direct
    launch(7, ("x", 3), key=("k",))
    assert kernel.log == [("jit", (7,), ("x", 3), {"BLOCK": 64, "num_warps": 4})]
    launch(9, ("y", 5), key=("k",))
    # grid, stream of the current device, function, packed metadata, no metadata/hooks, runtime args, BLOCK, FLAG
    assert kernel.log[-1] == ("direct", (9, 1, 1, 1000, "fn", ("warps", 4), None, None, None, "y", 5, 64, True))


def test_tensors_reach_the_compiled_launcher_as_addresses(on_fake_gpu):
    kernel = FakeKernel()
    launch = launcher.Launcher(kernel, {"BLOCK": 64})
    t = torch.arange(4.0)
    launch(1, (t, 3), key=0)
    assert kernel.log[-1][2][0] is t  # the first launch (Triton's JIT path) sees the tensor itself
    launch(1, (t[1:], 3), key=0)
    assert kernel.log[-1][1][9:] == (t.data_ptr() + 4, 3, 64, True)


def test_a_new_key_or_device_goes_through_jit_again(on_fake_gpu):
    kernel = FakeKernel()
    launch = launcher.Launcher(kernel, {"BLOCK": 64})
    launch(1, ("x", 3), key=1)
    launch(1, ("x", 3), key=2)
    on_fake_gpu.device["index"] = 1
    launch(1, ("x", 3), key=1)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit"]
    launch(1, ("x", 3), key=1)
    assert kernel.log[-1][0] == "direct" and kernel.log[-1][1][3] == 1001  # device 1's stream


def test_launch_hooks_get_their_metadata(on_fake_gpu):
    kernel = FakeKernel()
    launch = launcher.Launcher(kernel, {"BLOCK": 8, "FLAG": False})
    launch(2, ("x", 1), key=0)
    enter, leave = object(), object()
    on_fake_gpu.hooks.runtime.launch_enter_hook, on_fake_gpu.hooks.runtime.launch_exit_hook = enter, leave
    launch(2, ("x", 1), key=0)
    args = kernel.log[-1][1]
    assert args[6] == ("metadata", (2, 1, 1), 1000, 4) and args[7] is enter and args[8] is leave
    assert args[9:] == ("x", 1, 8, False)


def test_an_empty_hook_chain_is_no_hook(on_fake_gpu):
    """Triton >= 3.4 keeps hook chains that are empty unless a profiler adds to them: no metadata is built then,
    and a hook added later gets it."""
    kernel = FakeKernel()
    launch = launcher.Launcher(kernel, {"BLOCK": 8, "FLAG": False})
    launch(2, ("x", 1), key=0)
    enter, leave = SimpleNamespace(calls=[]), SimpleNamespace(calls=[])
    on_fake_gpu.hooks.runtime.launch_enter_hook, on_fake_gpu.hooks.runtime.launch_exit_hook = enter, leave
    launch(2, ("x", 1), key=0)
    assert kernel.log[-1][1][6:9] == (None, None, None)
    enter.calls.append(print)
    launch(2, ("x", 1), key=0)
    assert kernel.log[-1][1][6][0] == "metadata" and kernel.log[-1][1][7] is enter


def test_kernels_that_do_not_fit_stay_on_the_generic_path(on_fake_gpu):
    interleaved = FakeKernel(names=("a", "BLOCK", "b", "FLAG"))
    launch = launcher.Launcher(interleaved, {"BLOCK": 64})
    assert not launch.direct
    for _ in range(3):
        launch(1, ("x", 3), key=0)
    assert [entry[0] for entry in interleaved.log] == ["jit"] * 3

    missing = launcher.Launcher(FakeKernel(), {})  # BLOCK has no value: JITFunction.run reports it
    assert not missing.direct

    broken = FakeKernel()
    del broken.compiled.function  # a compiled-kernel layout this code does not know
    launch = launcher.Launcher(broken, {"BLOCK": 64})
    launch(1, ("x", 3), key=0)
    launch(1, ("x", 3), key=0)
    assert [entry[0] for entry in broken.log] == ["jit", "jit"] and not launch.direct


def test_the_key_table_starts_over_when_full(on_fake_gpu, monkeypatch):
    monkeypatch.setattr(launcher, "MAX_KEYS", 3)
    kernel = FakeKernel()
    launch = launcher.Launcher(kernel, {"BLOCK": 64})
    for key in range(5):
        launch(1, ("x", 3), key=key)
    assert len(launch._compiled) <= 3


def _triton_cuda_launcher(monkeypatch, log, **overrides):
    """The installed Triton's own CUDA launcher object, built without a GPU, its C launch function recording."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    if not torch.cuda.is_available():  # its __call__ looks up the active driver first
        import triton

        monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace(), raising=False)
    run = object.__new__(driver.CudaLauncher)
    fields = dict(launch=lambda *args: log.append(args), launch_cooperative_grid=False, launch_pdl=True,
                  arg_annotations=("annotations",), kernel_signature=b"signature", global_scratch_size=0,
                  global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1, num_ctas=1,
                  gsan_enabled=False)
    for name, value in {**fields, **overrides}.items():
        setattr(run, name, value)
    return run


def test_raw_launch_passes_the_c_function_what_triton_launcher_passes(on_fake_gpu, monkeypatch):
    """The raw route must be Triton's own `CudaLauncher.__call__` minus the Python wrapper: same arguments to the
    same C function, for the installed Triton (the GPU hosts run this test on theirs too)."""
    log: list = []
    kernel = FakeKernel()
    kernel.compiled.run = _triton_cuda_launcher(monkeypatch, log)
    if launcher.raw_launch(kernel.compiled.run) is None:
        pytest.skip("this Triton's CUDA launcher has a form raw_launch does not know: launches keep its __call__")
    launch = launcher.Launcher(kernel, {"BLOCK": 64})
    t = torch.arange(4.0)
    launch(3, (t, 5), key=0)  # Triton's JIT path
    launch(3, (t, 5), key=0)  # raw
    assert len(log) == 1
    kernel.compiled.run(3, 1, 1, 1000, "fn", ("warps", 4), None, None, None, t.data_ptr(), 5, 64, True)
    assert len(log) == 2 and log[0] == log[1]


class CudaLauncher:
    """The flat form of Triton's CUDA launcher object (Triton 3.6), as `raw_launch` expects it: the C function
    takes the scratch pointers before the metadata, hooks and kernel arguments."""

    def __init__(self, log):
        self.launch = lambda *args: log.append(args)
        self.launch_cooperative_grid, self.launch_pdl, self.num_ctas = False, True, 1
        self.global_scratch_size = self.profile_scratch_size = 0

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None,
                    None, *args)


def test_raw_launch_of_the_flat_form(on_fake_gpu):
    log: list = []
    kernel = FakeKernel()
    kernel.compiled.run = CudaLauncher(log)
    assert launcher.raw_launch(kernel.compiled.run) is not None
    launch = launcher.Launcher(kernel, {"BLOCK": 64})
    launch(3, ("x", 5), key=0)
    launch(3, ("x", 5), key=0)
    kernel.compiled.run(3, 1, 1, 1000, "fn", ("warps", 4), None, None, None, "x", 5, 64, True)
    assert len(log) == 2 and log[0] == log[1]


@pytest.mark.parametrize("field,value", [("global_scratch_size", 128), ("profile_scratch_size", 64),
                                         ("num_ctas", 2), ("gsan_enabled", True)])
def test_launchers_with_scratch_or_a_sanitizer_keep_their_python_call(on_fake_gpu, monkeypatch, field, value):
    run = _triton_cuda_launcher(monkeypatch, [], **{field: value})
    assert launcher.raw_launch(run) is None
    assert launcher.raw_launch(SimpleNamespace(**vars(_triton_cuda_launcher(monkeypatch, [])))) is None  # not Triton's


def test_the_interpreter_never_launches_directly():
    kernel = FakeKernel()
    launch = launcher.Launcher(kernel, {"BLOCK": 64})
    if launcher.interpret_mode():
        assert not launch.direct


# ------------------------------------------------------------------------------------------------ GPU

STRATEGIES = {
    "rows": lambda c: c.kernel_1.strategy == "rows" and c.kernel_1.row_split == 1 and not c.kernel_2.fused,
    "pdl": lambda c: c.kernel_2.pdl and not c.kernel_2.fused,
    "columns": lambda c: c.kernel_1.strategy == "columns",
    "dual": lambda c: c.kernel_1.strategy == "dual",
    "row_split": lambda c: c.kernel_1.strategy == "rows" and c.kernel_1.row_split > 1,
    "fused": lambda c: c.kernel_2.fused,
}


def _reference(norm, x, w, b, g):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    if norm == "layer_norm":
        y = torch.nn.functional.layer_norm(x64, (x.shape[-1],), w64, b64, 1e-5)
    else:
        y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    return torch.autograd.grad(y, [x64, w64] + ([b64] if b is not None else []), g.double())


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("norm,M,N", [("layer_norm", 256, 4096), ("rms_norm", 96, 12288), ("layer_norm", 1024, 5000)])
def test_direct_launches_follow_alignment_and_strides(norm, M, N, strategy):
    problem = Problem(norm, M, N, "fp32", has_bias=norm == "layer_norm")
    config = next((c for c in Space(problem, sm_count(torch.device("cuda"))).seeds() if STRATEGIES[strategy](c)), None)
    if config is None:
        pytest.skip(f"the search space has no {strategy} seed for {problem.key}")
    dev = torch.device("cuda")
    w = (1 + 0.1 * torch.randn(N, device=dev)).requires_grad_()
    b = (0.1 * torch.randn(N, device=dev)).requires_grad_() if norm == "layer_norm" else None
    # Same problem, different specializations: aligned rows; rows one element off 16 bytes; padded row strides.
    for offset, stride in ((0, N), (1, N), (0, N + 16), (1, N + 3), (0, N)):
        buf = torch.randn(M * stride + offset, device=dev)
        x = buf[offset:].as_strided((M, N), (stride, 1)).detach().requires_grad_()
        gbuf = torch.randn(M * stride + offset, device=dev)
        g = gbuf[offset:].as_strided((M, N), (stride, 1))
        runs = []
        for _ in range(2):  # the first launch of a key may go through Triton's JIT path, the second is direct
            y = layer_norm(x, w, b, config=config) if norm == "layer_norm" else rms_norm(x, w, config=config)
            runs.append(torch.autograd.grad(y, [x, w] + ([b] if b is not None else []), g))
        for first, second in zip(*runs):
            assert torch.equal(first, second), f"direct launch differs (offset {offset}, stride {stride})"
        for name, got, ref in zip(("dx", "dw", "db"), runs[1], _reference(norm, x, w, b, g)):
            assert _rel(got, ref) < 1e-4, f"{name} wrong with offset {offset}, stride {stride}, {strategy}"


# ------------------------------------------------------------------- compile-ahead specializes like a launch

def _pointer_args(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("norm,M,N", [("layer_norm", 37, 200), ("rms_norm", 130, 1000), ("layer_norm", 9, 3000)])
def test_a_launch_specializes_like_its_compile_ahead(norm, M, N, strategy, device):
    """`precompile` (the sweep's compile-ahead workers) compiles with placeholders that Triton counts as 16-byte
    aligned and the integers of contiguous rows. A launch on aligned, contiguous inputs must pass exactly that,
    or the measuring process compiles every trial's kernel again (a sync-counter slice 8 bytes off did)."""
    from normtune.kernels.backward_launch import compile_ahead_args
    from normtune.tuner.measure.cases import make_case

    problem = Problem(norm, M, N, "bf16", has_bias=norm == "layer_norm")
    configs = [c for c in Space(problem, 4).seeds() if STRATEGIES[strategy](c)]
    if not configs:
        pytest.skip(f"the search space has no {strategy} seed for {problem.key}")
    case = make_case(problem, device)
    waits = set()
    for config in configs:  # every seed of the strategy
        launch = case.launch(config)
        waits.add(launch.plan.waits)
        for args in launch.arguments:
            for t in _pointer_args(args):
                assert t.data_ptr() % 16 == 0, f"a {strategy} launch passes a pointer off 16-byte alignment"
        # precompile: the rows' strides (dh's place holds grad's), M, N and the strategy's integers, launch by launch
        _, ahead = compile_ahead_args(problem, config, launch.dx.device)
        assert len(ahead) == len(launch.arguments)
        for launched, compiled in zip(launch.arguments, ahead):
            assert [a for a in launched if not isinstance(a, torch.Tensor)] == [
                a for a in compiled if isinstance(a, int)]
            assert [a.dtype for a in launched if isinstance(a, torch.Tensor)] == [
                a for a in compiled if isinstance(a, torch.dtype)], f"{config.to_json()}"
        if config.kernel_1.strategy == "dual":
            launch_ints = [a for a in launch.arguments[0] if not isinstance(a, torch.Tensor)]
            # dh's place holds grad's stride; z's and dz's (no gate) grad's and dx's
            assert launch_ints == [N, N, N, N, N, N, M, N, launch.plan.row_programs]
    if strategy == "rows":  # a launch whose programs do not wait passes placeholder counters (int32 ahead was wrong)
        assert False in waits


def test_polled_counters_each_have_a_cache_line():
    """Programs poll their group's counter (row_split) or the grid barrier (fused) with atomics: two counters on
    one 128-byte L2 line queue behind each other's polls (H100, 4096x32768 split 4: 352.7 -> 346.3 µs once they
    were apart). The kernels step COUNTER_STRIDE elements from one group's counter to the next."""
    from normtune.kernels.backward.common import COUNTER_STRIDE_ELEMENTS
    from normtune.kernels.backward.workspace import sync_counters

    polled, leave, barrier = sync_counters(torch.device("cpu"))
    line = 128  # offsets from the buffer's start (the barrier's counters): CUDA allocations start 512-byte aligned
    start = barrier.data_ptr()
    assert COUNTER_STRIDE_ELEMENTS * polled.element_size() == line
    assert (polled.data_ptr() - start) % line == 0 and polled.data_ptr() - start >= line
    groups = polled.numel() // COUNTER_STRIDE_ELEMENTS
    assert groups >= 1 and leave.numel() >= groups, "every group a launch can have has both counters"
    assert leave.data_ptr() >= polled.data_ptr() + polled.numel() * polled.element_size()
    assert not bool(polled.any() or leave.any() or barrier.any()), "counters are all zero between launches"
