"""A backward config is validated once per (problem, config, device): the call's selection or its explicit
`config=` check, the backward's resolution and the launch plan share one validation (`capabilities.checked`), and
a repeated call of the same signature validates nothing. Counted through the autograd API, the direct functions,
the residual form, the reference path and torch.compile, by wrapping `BackwardConfig.validate` and every
registered strategy's `validate`.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest
import torch

from normtune.kernels import BackwardConfig, Kernel2Config, kernel_1_config, layer_norm, rms_norm

from normtune.kernels.api import direct
from normtune.kernels.api import forward_calls
from normtune.kernels import Problem
from normtune.kernels.limits import STAND_INS
from normtune.kernels.select.select import clear_caches, explain
from normtune.kernels.select.tables import load_table
from normtune.kernels.strategies import STRATEGIES

N = 200
SMALL = BackwardConfig(kernel_1_config(block_row=2, block_col=256, num_warps=2),
                       Kernel2Config(block_m=4, block_n=64, num_warps=2))
FORMS = {"value": lambda c: c, "dict": lambda c: c.to_dict(), "json": lambda c: c.to_json()}


class Validations:
    """What was validated since `reset`: (problem, config, limits) triples, and the strategies' own count."""

    def __init__(self):
        self.triples: list[tuple] = []
        self.strategy_calls = 0

    def reset(self) -> None:
        self.triples.clear()
        self.strategy_calls = 0

    def count(self) -> int:
        assert self.strategy_calls == len(self.triples)  # every strategy validation went through the config's
        return len(self.triples)

    def repeated(self) -> list[tuple]:
        return [t for t, n in collections.Counter(self.triples).items() if n > 1]


@pytest.fixture
def validations(monkeypatch):
    seen = Validations()
    real = BackwardConfig.validate

    def config_validate(self, problem, limits=None):
        seen.triples.append((problem, self, limits))
        return real(self, problem, limits)

    monkeypatch.setattr(BackwardConfig, "validate", config_validate)
    for cls in {type(s) for s in STRATEGIES.values()}:
        def strategy_validate(self, config, problem, lim, _real=cls.validate):
            seen.strategy_calls += 1
            return _real(self, config, problem, lim)

        monkeypatch.setattr(cls, "validate", strategy_validate)
    clear_caches()  # earlier tests' calls may have validated these problems already
    forward_calls.clear()
    yield seen
    clear_caches()


def _leaves(inputs):
    return [t.detach().requires_grad_() if t is not None else None for t in (inputs["x"], inputs["weight"],
                                                                             inputs["bias"])]


def _first_and_repeated(validations, call, repeats: int = 3) -> tuple[int, int]:
    validations.reset()
    call()
    first = validations.count()
    assert not validations.repeated(), f"validated twice in one call: {validations.repeated()}"
    validations.reset()
    for _ in range(repeats):
        call()
    return first, validations.count()


@pytest.mark.parametrize("form", list(FORMS))
def test_autograd_call_with_an_explicit_config(form, validations, device, make_norm_inputs):
    """The forward checks the config against its problem (once), and carries what it resolved to the backward:
    neither the backward nor the launch plan validates again, and later calls of the signature validate nothing
    (before: three validations on the first call, one on every later one)."""
    inputs = make_norm_inputs((3, 5, N), torch.bfloat16, device, has_bias=True)
    x, w, b = _leaves(inputs)
    config = FORMS[form](SMALL)
    first, later = _first_and_repeated(
        validations, lambda: layer_norm(x, w, b, save="output", config=config).backward(inputs["grad"]))
    assert (first, later) == (1, 0)
    validations.reset()  # another row count is another problem: validated once
    layer_norm(x[:2], w, b, save="output", config=config).backward(inputs["grad"][:2])
    assert validations.count() == 1


def test_autograd_call_selecting_its_config(validations, device, make_norm_inputs):
    """config=None: the selection validates what it picks for the device, and the launch plan finds it validated
    (before: the plan validated the selected config a second time)."""
    inputs = make_norm_inputs((7, N), torch.float32, device, has_bias=True)
    x, w, b = _leaves(inputs)
    first, later = _first_and_repeated(validations, lambda: layer_norm(x, w, b).backward(inputs["grad"]))
    assert first >= 1 and later == 0


def test_direct_backward(validations, device, make_norm_inputs):
    inputs = make_norm_inputs((6, N), torch.float16, device, has_bias=True)
    x, w, b, g = inputs["x"], inputs["weight"], inputs["bias"], inputs["grad"]
    _, mean, rstd = direct.layer_norm_forward(x, w, b)
    first, later = _first_and_repeated(
        validations, lambda: direct.layer_norm_backward(g, x, w, b, mean, rstd, config=SMALL.to_json()))
    assert (first, later) == (1, 0)
    first, later = _first_and_repeated(validations, lambda: direct.layer_norm_backward(g, x, w, b, mean, rstd))
    assert first >= 1 and later == 0


@pytest.mark.parametrize("h_dtype", [None, torch.float32])
def test_residual_form(h_dtype, validations, device, make_norm_inputs):
    """The residual form's problem (h's dtype included) is the one validated, once, through autograd and through
    the direct functions."""
    inputs = make_norm_inputs((4, N), torch.bfloat16, device)
    x, w, _ = _leaves(inputs)
    r = torch.randn_like(inputs["x"]).requires_grad_()
    g = inputs["grad"]

    def autograd_call():
        y, h = rms_norm(x, w, residual=r, residual_dtype=h_dtype, config=SMALL)
        torch.autograd.backward((y, h), (g, torch.ones_like(h)))

    assert _first_and_repeated(validations, autograd_call) == (1, 0)
    xd, wd = x.detach(), w.detach()
    _, rstd, h = direct.rms_norm_forward(xd, wd, residual=r.detach(), residual_dtype=h_dtype)
    dh = torch.ones_like(h)
    first, later = _first_and_repeated(
        validations, lambda: direct.rms_norm_backward(g, h, wd, rstd, grad_residual=dh, config=SMALL.to_dict()))
    assert (first, later) == (0, 0)  # the autograd calls above validated this very problem and config


def test_reference_path(validations, monkeypatch, make_norm_inputs):
    """Off the Triton path (CPU without the interpreter) an explicit config is still checked, once."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = make_norm_inputs((5, N), torch.float32, "cpu", has_bias=True)
    x, w, b = _leaves(inputs)
    first, later = _first_and_repeated(validations,
                                       lambda: layer_norm(x, w, b, config=SMALL).backward(inputs["grad"]))
    assert (first, later) == (1, 0)


def test_a_config_that_does_not_fit_is_refused_on_every_call(validations, device, make_norm_inputs):
    """Only configs that passed are remembered: one that fails raises each time it is passed."""
    inputs = make_norm_inputs((4, N), torch.float32, device)
    wide = BackwardConfig(kernel_1_config(block_row=1, block_col=128, num_warps=2), Kernel2Config())
    for _ in range(2):
        with pytest.raises(ValueError, match="config does not fit this input"):
            rms_norm(inputs["x"], inputs["weight"], config=wide)


def test_compiled_call(validations, device, make_norm_inputs):
    """Under torch.compile the config travels as JSON text through the custom ops; the backward op resolves it
    once per signature."""
    torch._dynamo.reset()
    inputs = make_norm_inputs((4, N), torch.float32, device, has_bias=True)
    x, w, b = _leaves(inputs)
    compiled = torch.compile(lambda x, w, b: layer_norm(x, w, b, config=SMALL), fullgraph=True,
                             backend="aot_eager")
    assert _first_and_repeated(validations, lambda: compiled(x, w, b).backward(inputs["grad"])) == (1, 0)


TABLE = str(Path(__file__).resolve().parents[1] / "configs" / "h100.json")


def _table_problem(M: int, N: int) -> Problem:
    return Problem(norm="rms_norm", M=M, N=N, dtype="bf16", weight_dtype="bf16", has_weight=True, has_bias=False)


def test_a_table_hit_validates_its_config_once_on_a_first_call(validations, device, monkeypatch):
    """config=None on a problem a table rule answers, its config adapted to the shape: the rule's fitting, the
    selection and the launch plan share one validation (before: two, the fitting validated outside
    `capabilities.checked`), and later calls validate nothing."""
    monkeypatch.setenv("NORMTUNE_CONFIG", TABLE)
    clear_caches()
    load_table(TABLE)  # reading the table checks each rule on its fitted shapes: not this call's validation
    x = torch.randn(64, 1024, device=device).to(torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(1024, device=device)).to(torch.bfloat16).requires_grad_()
    g = torch.randn(64, 1024, device=device).to(torch.bfloat16)
    explanation = explain(_table_problem(64, 1024), "h100")
    assert explanation.match is not None and explanation.match.config is not None  # a table hit, adapted
    assert explanation.config != explanation.match.rule.config
    clear_caches()
    load_table(TABLE)
    first, later = _first_and_repeated(validations, lambda: rms_norm(x, w).backward(g))
    assert (first, later) == (1, 0)


def test_a_table_hit_on_a_device_validates_once(validations):
    """On a device with its own limits the rule's config is fitted and validated for that device, once: the
    selection's check of it on the device finds it validated (before: once for the reference device, once for
    the device)."""
    load_table(TABLE)
    validations.reset()
    explanation = explain(_table_problem(64, 1024), "h100", config_file=TABLE, limits=STAND_INS["h200"])
    assert explanation.match.config is not None and not explanation.fallbacks
    assert validations.count() == 1


def _validation_calls(path: Path):
    """(line, enclosing function, call) of every `.validate(...)` / `.is_valid(...)` call of a module."""
    def walk(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in ("validate", "is_valid"):
                yield child.lineno, function, ast.unparse(child)
            yield from walk(child, inner)

    yield from walk(ast.parse(path.read_text()), None)


def test_every_validation_of_a_config_goes_through_checked():
    """docs/architecture.md: the runtime validates a backward config only through `capabilities.checked` (or
    `capabilities.fits`, which asks it). Allowed elsewhere: `BackwardConfig.validate`/`is_valid` themselves
    (strategies/configs.py) and a strategy's `validate` checking the parts of the config it was given."""
    kernels = Path(__file__).resolve().parents[1] / "kernels"
    found = []
    for path in sorted(kernels.rglob("*.py")):
        rel = path.relative_to(kernels).as_posix()
        if rel in ("strategies/capabilities.py", "strategies/configs.py"):
            continue
        found += [f"kernels/{rel}:{line}: {call}" for line, function, call in _validation_calls(path)
                  if function != "validate"]
    assert not found, "validate through capabilities.checked / fits:\n" + "\n".join(found)
