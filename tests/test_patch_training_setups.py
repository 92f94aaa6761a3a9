"""`patch(model, fuse_residual=True)` in the training setups real code uses: activation checkpointing of every
kind, FSDP2, layers under no_grad or inference_mode, a cut or reordered layer list, forward hooks and in-place
changes, per-layer torch.compile. Each gives the unpatched model's logits and gradients (None where it has None),
on Llama and Gemma2 (pre-norm and sandwich layers), and two of them on Qwen2 (pre-norm, as Llama).

The setup is applied after patch() (the order that leaves the patch-time links between layers in place), to the
patched model and to its unpatched copy alike.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import normtune

from patch_support import check_same, logits_and_grads, tiny_model, token_ids

pytest.importorskip("transformers")

MODELS = ("llama", "qwen2", "gemma2")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Wrapped(nn.Module):
    """A decoder layer run through `run(layer_call, hidden_states)`, as checkpoint wrappers and custom loops do."""

    def __init__(self, layer: nn.Module, run):
        super().__init__()
        self.layer, self.run = layer, run

    def forward(self, hidden_states, *args, **kwargs):
        return self.run(functools.partial(self.layer, **kwargs), hidden_states, *args)


def _wrap(model, indices, run):
    layers = model.model.layers
    for i in indices:
        layers[i] = _Wrapped(layers[i], run)


def _checkpointed(reentrant: bool):
    return lambda call, *args: checkpoint(call, *args, use_reentrant=reentrant)


def _no_grad(call, *args):
    with torch.no_grad():
        return call(*args)


def _scaled_in_place(call, *args):
    out = call(*args)
    return out.mul_(1.5)


def _wrapper(impl_name: str, indices):
    def apply(model):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        layers = model.model.layers
        for i in indices:
            layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=getattr(CheckpointImpl, impl_name))
    return apply


def _apply_activation_checkpointing(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    layer_type = type(model.model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_type))


def _hf_checkpointing(reentrant: bool):
    def apply(model):
        kwargs = {"use_reentrant": reentrant}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()
    return apply


def _hook_adding_in_place(model):
    model.model.layers[0].register_forward_hook(lambda module, args, out: out.add_(0.25))


def _cut_by_config(model):
    model.config.num_hidden_layers = 1  # transformers' loop runs layers[:num_hidden_layers]; layer 1 stays, unused


def _cut_list(model):
    model.model.layers = nn.ModuleList(list(model.model.layers)[:1])


def _reordered(model):
    model.model.layers = nn.ModuleList(list(model.model.layers)[::-1])


def _compiled_layers(model):
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")


SETUPS = {
    "checkpoint reentrant, every layer": lambda m: _wrap(m, range(2), _checkpointed(True)),
    "checkpoint non-reentrant, every layer": lambda m: _wrap(m, range(2), _checkpointed(False)),
    "checkpoint_wrapper reentrant, layer 0": _wrapper("REENTRANT", [0]),
    "checkpoint_wrapper non-reentrant, layer 1": _wrapper("NO_REENTRANT", [1]),
    "apply_activation_checkpointing": _apply_activation_checkpointing,
    "transformers checkpointing reentrant": _hf_checkpointing(True),
    "transformers checkpointing non-reentrant": _hf_checkpointing(False),
    "layer 0 under no_grad": lambda m: _wrap(m, [0], _no_grad),
    "layer 0's output changed in place": lambda m: _wrap(m, [0], _scaled_in_place),
    "forward hook adding in place": _hook_adding_in_place,
    "layers cut by the config": _cut_by_config,
    "layer list cut": _cut_list,
    "layer list reordered": _reordered,
    "per-layer torch.compile": _compiled_layers,
}


def _patched_pair(model_type, device):
    model = tiny_model(model_type, device, num_hidden_layers=2)
    reference = copy.deepcopy(model)
    report = normtune.patch(model, fuse_residual=True)
    assert sum(report.fused.values()) == 2 and report.chained == 2, str(report)
    return model, reference


# Llama (pre-norm layers) and Gemma2 (sandwich layers) run every setup. Qwen2's decoder layer has Llama's norms and
# residual adds (its attention's biases aside): it runs two setups, a checkpointed call and a reordered layer list.
QWEN2_SETUPS = ("checkpoint reentrant, every layer", "layer list reordered")
SETUP_CASES = [(m, s) for m in MODELS for s in SETUPS if m != "qwen2" or s in QWEN2_SETUPS]


@pytest.mark.parametrize("model_type,setup", SETUP_CASES, ids=[f"{m}-{s}" for m, s in SETUP_CASES])
def test_a_training_setup_gives_the_unpatched_gradients(model_type, setup, device, tolerance, assert_close):
    if setup == "per-layer torch.compile":
        torch._dynamo.reset()
    model, reference = _patched_pair(model_type, device)
    for m in (model, reference):
        SETUPS[setup](m)
        m.train()
    ids = token_ids(model, tokens=5)
    check_same(model, reference, ids, tolerance(torch.float32), assert_close)
    check_same(model, reference, ids, tolerance(torch.float32), assert_close)  # a second step: planned calls


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("model_type", MODELS)
def test_a_forward_without_autograd_gives_the_unpatched_logits(model_type, mode, device, tolerance, assert_close):
    model, reference = _patched_pair(model_type, device)
    ids = token_ids(model, tokens=5)
    with getattr(torch, mode)():
        logits, ref = (m(input_ids=ids).logits for m in (model, reference))
    assert_close(logits, ref, tolerance(torch.float32), "logits")


@pytest.fixture
def one_process_group():
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("model_type", MODELS)
def test_fsdp2_per_layer_gives_the_unpatched_gradients(model_type, one_process_group, tolerance, assert_close):
    """FSDP2 unshards a layer's parameters only inside its own forward: the layer before must not read them."""
    from torch.distributed.fsdp import fully_shard

    model, reference = _patched_pair(model_type, "cpu")
    for m in (model, reference):
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
    ids = token_ids(model, tokens=5)
    grads = []
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads.append((out.logits.detach(), {n: None if p.grad is None else p.grad.full_tensor()
                                            for n, p in m.named_parameters()}))
    (logits, got), (ref_logits, ref) = grads
    tol = tolerance(torch.float32)
    assert_close(logits, ref_logits, tol, "logits")
    assert list(got) == list(ref)
    for name, grad in ref.items():
        assert (got[name] is None) == (grad is None), name
        if grad is not None:
            assert_close(got[name], grad, tol, f"grad {name}")


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_training_setup_in_bf16_is_as_close_to_float64_as_the_unpatched_model(setup, device, tolerance,
                                                                                 relative_error):
    """bf16: the patched model's logits and gradients are no further from a float64 model than the unpatched bf16
    model's are, plus the kernels' bf16 tolerance."""
    if setup == "per-layer torch.compile":
        torch._dynamo.reset()
    model = tiny_model("llama", device, torch.bfloat16)
    unpatched, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    normtune.patch(model, fuse_residual=True)
    for m in (model, unpatched, exact):
        SETUPS[setup](m)
        m.train()
    ids = token_ids(model, tokens=5)
    (ours, our_grads), (theirs, their_grads), (ref, ref_grads) = (
        logits_and_grads(m, ids) for m in (model, unpatched, exact))
    tol = tolerance(torch.bfloat16)
    assert relative_error(ours, ref) <= tol + relative_error(theirs, ref)
    for name, grad in ref_grads.items():
        if grad is None:
            assert our_grads[name] is None and their_grads[name] is None, name
        else:
            assert relative_error(our_grads[name], grad) <= tol + relative_error(their_grads[name], grad), name
