"""Tiny transformers models and their loss and gradients, for the tests of `patch(model, fuse_residual=True)`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96, "max_position_embeddings": 64}


def tiny_model(model_type: str, device: str, dtype=torch.float32, **sizes) -> nn.Module:
    """A tiny causal LM of `model_type` with eager attention, its 1-D parameters moved off their init values."""
    transformers = pytest.importorskip("transformers")
    try:
        config = transformers.AutoConfig.for_model(model_type, **{**TINY, **sizes})
    except ValueError:
        pytest.skip(f"this transformers has no {model_type}")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norm weights off their init (Gemma's zeros would hide the 1 + w)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.to(device=device, dtype=dtype)


def token_ids(model, batch=2, tokens=8):
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen).to(model.device)


def logits_and_grads(model, ids):
    """The logits and every parameter's gradient (None where it got none) of one training step's loss."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)  # a cache would grow again in a recompute
    out.loss.backward()
    return out.logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def check_same(model, reference, ids, tol, assert_close):
    """The same logits and gradients as the reference; a parameter without a gradient there has none here."""
    (logits, grads), (ref_logits, ref_grads) = logits_and_grads(model, ids), logits_and_grads(reference, ids)
    assert_close(logits, ref_logits, tol, "logits")
    assert list(grads) == list(ref_grads)
    for name, grad in ref_grads.items():
        if grad is None:
            assert grads[name] is None, f"grad {name}: the reference has none"
        else:
            assert grads[name] is not None, f"grad {name}: None, the reference has one"
            assert_close(grads[name], grad, tol, f"grad {name}")
