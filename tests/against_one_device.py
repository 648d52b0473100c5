"""Checks of a compiled model on gloo ranks against the same model on one device: its gradients
(whole, wherever ZeRO-2 keeps them) and its parameters, each mismatch naming the case, step and
parameter."""

from __future__ import annotations

import torch


def whole_grad(dmodel, p: torch.nn.Parameter) -> torch.Tensor:
    """The whole gradient of ``dmodel``'s parameter ``p`` (under ZeRO-2 only its shard holds one)."""
    shard = dmodel.zero_shards.get(id(p))
    if p.grad is None and shard is not None:
        return shard.shard.grad.full_tensor()
    return p.grad.full_tensor()


def assert_grads_match(dmodel, reference: torch.nn.Module, where: str, step: int, atol: float, rtol: float):
    """Every gradient of ``dmodel`` equals ``reference``'s within ``atol`` and ``rtol``."""
    for name, p in dmodel.named_parameters():
        torch.testing.assert_close(
            whole_grad(dmodel, p),
            reference.get_parameter(name).grad,
            atol=atol,
            rtol=rtol,
            msg=lambda m, n=name: f"{where} step {step}: grad of {n}: {m}",
        )


def assert_params_match(dmodel, reference: torch.nn.Module, where: str, atol: float, rtol: float):
    """Every parameter of ``dmodel`` equals ``reference``'s within ``atol`` and ``rtol``."""
    for name, p in dmodel.named_parameters():
        torch.testing.assert_close(
            p.full_tensor(), reference.get_parameter(name), atol=atol, rtol=rtol, msg=f"{where}: {name}"
        )
