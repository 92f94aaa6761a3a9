"""The forms of a norm call: which tensors it takes beside x, weight and bias, and which it returns beside y.

One public path (`functional._norm`), one custom-op family (`ops.define_ops`), one autograd Function
(`ops.EagerNorm`) and one direct path (`direct._forward`, `direct._backward`) take a `Form` and run any of them;
the Triton kernels take it as a compile-time argument (HAS_RESIDUAL). A form is a value, so a new one adds its
value here, its math (`ops.forward_impl`, `ops.input_grads`, `composite`, `reference`, the kernels) and its checks
(`call_checks`), not a second set of modules.

    PLAIN     y = norm(x)
    RESIDUAL  h = x + residual (in the residual stream's dtype), y = norm(h); returns (y, h)
    GATED     RMSNorm with a gate z shaped like x, a = act(z) (silu or sigmoid): y = w·x̂·a (the gate before: after
              the norm) or y = w·norm(x·a) (the gate after); returns y, and the backward gives z its own gradient
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Form:
    """A norm call's form.

    inputs: the names of the tensors it takes after x, each shaped like x (their gradients come back after x's).
    outputs: the names of the tensors it returns after y, each shaped like x and in the form's stream dtype (a
        custom-op argument `<name>_dtype`); the first one is the tensor the norm normalizes (x where there is none).
    op: the stem of its custom ops' names, `normtune::<op>_forward` and `normtune::<op>_backward` (users see these
        in traced graphs, so a form's op names never change).
    saved: the inputs the backward reads beside the rows normalized (saved by the forward), each of which gets a
        gradient of its own (the other inputs get x's, as the residual does).
    options: the schema of the form's own non-tensor arguments ("bool gate_after", ...), which its ops take after
        the flags (and the stream dtypes) and the calls carry as a tuple of values (`opts`).
    """

    name: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    op: str = "norm"
    saved: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Form({self.name})"


PLAIN = Form("plain")
RESIDUAL = Form("residual", inputs=("residual",), outputs=("h",), op="norm_residual")
# opts: (the gate is after the norm's input, the activation is sigmoid, the columns of one group of statistics)
GATED = Form("gated", inputs=("z",), op="norm_gated", saved=("z",),
             options=("bool gate_after", "bool gate_sigmoid", "int group_size"))

FORMS = (PLAIN, RESIDUAL, GATED)


def form_of(residual, residual_dtype) -> tuple[Form, tuple]:
    """The form of a call without a gate and its tensors of its own, from its `residual` and `residual_dtype`
    keyword arguments."""
    if residual is not None:
        return RESIDUAL, (residual,)
    if residual_dtype is not None:
        raise ValueError("residual_dtype needs a residual: pass residual=... or residual_dtype=None")
    return PLAIN, ()
