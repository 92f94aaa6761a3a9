"""A form is a parameter (`kernels/api/forms.py`): the plain norm and the fused residual form run through one public
path, one custom-op family, one autograd Function and one direct path, and their custom ops keep the names and
schemas users' traced graphs hold."""

from __future__ import annotations

import torch

from normtune.kernels import FusedAddRMSNorm, layer_norm, layer_norm_forward, rms_norm, rms_norm_backward

from normtune.kernels.api import ops
from normtune.kernels import rms_norm_forward
from normtune.kernels.api.forms import FORMS, GATED, PLAIN, RESIDUAL, Form

N = 40
SCHEMAS = {
    "norm_forward": "normtune::norm_forward(Tensor x, Tensor? weight, Tensor? bias, float eps, bool is_rms, "
                    "bool zero_centered, bool save_output, str config) -> (Tensor, Tensor, Tensor)",
    "norm_backward": "normtune::norm_backward(Tensor grad, Tensor saved, Tensor? weight, Tensor? bias, Tensor rstd, "
                     "Tensor mean, bool is_rms, bool zero_centered, bool save_output, str config) -> "
                     "(Tensor, Tensor, Tensor)",
    "norm_residual_forward": "normtune::norm_residual_forward(Tensor x, Tensor residual, Tensor? weight, "
                             "Tensor? bias, float eps, bool is_rms, bool zero_centered, bool save_output, "
                             "ScalarType h_dtype, str config) -> (Tensor, Tensor, Tensor, Tensor)",
    "norm_residual_backward": "normtune::norm_residual_backward(Tensor grad, Tensor grad_h, Tensor saved, "
                              "Tensor? weight, Tensor? bias, Tensor rstd, Tensor mean, bool is_rms, "
                              "bool zero_centered, bool save_output, str config) -> (Tensor, Tensor, Tensor)",
    "norm_gated_forward": "normtune::norm_gated_forward(Tensor x, Tensor z, Tensor? weight, Tensor? bias, float eps, "
                          "bool is_rms, bool zero_centered, bool save_output, bool gate_after, bool gate_sigmoid, "
                          "int group_size, str config) -> (Tensor, Tensor, Tensor)",
    "norm_gated_backward": "normtune::norm_gated_backward(Tensor grad, Tensor saved, Tensor z, Tensor? weight, "
                           "Tensor? bias, Tensor rstd, Tensor mean, bool is_rms, bool zero_centered, bool save_output, "
                           "bool gate_after, bool gate_sigmoid, int group_size, str config) -> "
                           "(Tensor, Tensor, Tensor, Tensor)",
}


def test_each_forms_custom_ops_keep_their_names_and_schemas():
    """One definition (`ops.define_ops`) registers every form's ops, with the schemas they always had."""
    assert FORMS == (PLAIN, RESIDUAL, GATED)
    for form in FORMS:
        for stem in ("forward", "backward"):
            name = f"{form.op}_{stem}"
            assert str(getattr(torch.ops.normtune, name).default._schema) == SCHEMAS[name]


def test_a_new_form_is_a_value_its_schema_follows():
    """A form with a tensor of its own and no stream (a gate z, say) gets its ops' schemas from its value."""
    gated = Form("gated", inputs=("z",), op="norm_gated")
    forward, backward = ops._schemas(gated)
    assert forward.startswith("(Tensor x, Tensor z, Tensor? weight, Tensor? bias, float eps,")
    assert forward.endswith("bool save_output, str config) -> (Tensor, Tensor, Tensor)")
    assert backward.startswith("(Tensor grad, Tensor saved, Tensor? weight,")


def test_both_forms_run_through_one_path(monkeypatch, device):
    """The functions, the modules and the direct functions reach the one `ops.forward_impl` with the form as an
    argument, and the autograd path is one Function for both."""
    seen = []
    real = ops.forward_impl

    def spy(form, *args, **kwargs):
        seen.append(form)
        return real(form, *args, **kwargs)

    monkeypatch.setattr(ops, "forward_impl", spy)
    from normtune.kernels.api import direct
    monkeypatch.setattr(direct, "forward_impl", spy)
    x, xr, r = (torch.randn(3, N, device=device, requires_grad=True) for _ in range(3))
    w = torch.ones(N, device=device, requires_grad=True)
    y = rms_norm(x, w, save="input", config={"kernel_1": {"strategy": "rows", "block_row": 1, "block_col": 64,
                                                          "num_warps": 1}})
    y2, h = layer_norm(xr, w, residual=r, config=None, save="input", eps=1e-3)
    assert type(y.grad_fn) is type(y2.grad_fn) and type(y.grad_fn).__name__ == "EagerNormBackward"
    (y.sum() + y2.sum() + h.sum()).backward()
    assert torch.equal(xr.grad, r.grad) and x.grad is not None and torch.isfinite(x.grad).all()
    FusedAddRMSNorm(N, device=device)(x.detach(), r.detach())
    _, rstd, h = rms_norm_forward(x.detach(), w.detach(), residual=r.detach())
    rms_norm_backward(torch.ones_like(h), h, w.detach(), rstd, grad_residual=torch.ones_like(h))
    layer_norm_forward(x.detach(), w.detach(), eps=1e-2)
    assert seen == [PLAIN, RESIDUAL, RESIDUAL, RESIDUAL, PLAIN]
