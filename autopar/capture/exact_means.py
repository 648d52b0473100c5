"""Means over items some of which are ignored, captured so that any split keeps them exact.

``cross_entropy`` and ``nll_loss`` with ``reduction="mean"`` and class-index targets divide
the sum of the per-item losses by the number of items whose target is not
``ignore_index``. Split over ranks (the batch over ``dp``, the sequence over ``tp``), a
mean of per-rank means is not that mean: the ranks hold different numbers of counted
items (a causal LM's shifted labels end every row with an ignored token). While a model is
captured, :class:`ExactMeans` records such a loss as

    loss(..., reduction="sum") / (target != ignore_index).sum()

Both are sums, which the planner may split into partial sums; the division runs once both
are whole, so value and gradient are the single-device mean's under every plan.

Left as they are: class weights (the mean then divides by a sum of weights), the legacy
``size_average``/``reduce`` arguments, and class-probability targets (no item is ignored).
``cross_entropy`` is written out whole where it can be (:mod:`autopar.capture.class_losses`:
its mean, weighted or not, is a sum over a count there too), so that its classes may split.

Batch normalisation in training is a mean too: its statistics are over the whole batch
(and space), and ``batch_norm`` also updates the running statistics in place. Split over
the batch, each rank would normalise by its own piece's statistics. So ``batch_norm``
with batch statistics is recorded as its formula,

    mean = x.mean(dims); var = ((x - mean) ** 2).mean(dims)
    y = (x - mean) * rsqrt(var + eps) * weight + bias
    running_mean = (1 - m) * running_mean + m * mean
    running_var = (1 - m) * running_var + m * var * n / (n - 1)

whose means the planner may split into partial sums (their all-reduce follows from the
rules, as SyncBatchNorm's does); the running statistics are updated in place from the
whole-batch values, ``n`` the items per channel of the whole batch. A cumulative average
(``momentum=None``) is left as it is.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autopar.capture import class_losses

_CLASS_LOSSES = {
    F.cross_entropy: inspect.signature(F.cross_entropy),
    F.nll_loss: inspect.signature(F.nll_loss),
}


_BATCH_NORM = inspect.signature(F.batch_norm)


class ExactMeans(TorchFunctionMode):
    """Records cross entropy as its formula, other mean class losses as a sum over a count and
    training batch norms as their formula (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.batch_norm:
            return _batch_norm(func, args, kwargs)
        if func is F.cross_entropy and (formula := class_losses.written_out(args, kwargs)) is not None:
            return formula
        signature = _CLASS_LOSSES.get(func)
        if signature is None:
            return func(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        target = given["target"]
        if (
            given["reduction"] != "mean"
            or given["weight"] is not None
            or given["size_average"] is not None
            or given["reduce"] is not None
            or not isinstance(target, torch.Tensor)
            or target.dtype.is_floating_point
        ):
            return func(*args, **kwargs)
        given["reduction"] = "sum"
        total = func(*bound.args, **bound.kwargs)
        return total / (target != given["ignore_index"]).sum()


def _batch_norm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    bound = _BATCH_NORM.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    x, momentum = given["input"], given["momentum"]
    running_mean, running_var = given["running_mean"], given["running_var"]
    if not given["training"] or (running_mean is not None and momentum is None) or x.dim() < 2:
        return func(*args, **kwargs)
    dims = [d for d in range(x.dim()) if d != 1]
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    mean = x.mean(dims, keepdim=True)
    centred = x - mean
    var = (centred * centred).mean(dims, keepdim=True)
    y = centred * torch.rsqrt(var + given["eps"])
    if given["weight"] is not None:
        y = y * given["weight"].view(shape)
    if given["bias"] is not None:
        y = y + given["bias"].view(shape)
    if running_mean is not None:
        items = x.numel() // x.shape[1]
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.view(-1), alpha=momentum)
            running_var.mul_(1 - momentum).add_(var.view(-1), alpha=momentum * items / max(items - 1, 1))
    return y
