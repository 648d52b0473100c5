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
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_CLASS_LOSSES = {
    F.cross_entropy: inspect.signature(F.cross_entropy),
    F.nll_loss: inspect.signature(F.nll_loss),
}


class ExactMeans(TorchFunctionMode):
    """Records mean class losses as a sum over a count (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
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
