"""``cross_entropy`` captured as its formula, so that the planner may split the classes too.

The fused ``cross_entropy`` keeps its class dimension whole: split by vocabulary, the logits
of a language model would be gathered whole onto every rank before the loss (a
``(tokens, vocabulary)`` tensor). Written out, every step is a sum, a maximum or a lookup,
each of which has a rule that splits the classes (Megatron-LM's vocab-parallel cross
entropy):

    m    = amax(x.detach(), classes)                      # partial maxima, all-reduced
    lse  = log(sum(exp(x - m), classes)) + m              # partial sums, all-reduced
    nll  = w[t] * (lse - gather(x, classes, t))           # the target's logit: a masked lookup
    loss = (1 - eps) * nll + eps / C * sum(w * (lse - x), classes)

per item, zero where ``t == ignore_index``; ``reduction="mean"`` divides the sum by the
summed weights of the counted items (their number without class weights), a sum over a
count that splits exactly (as :mod:`autopar.capture.exact_means` explains). Class
probabilities as targets give ``sum(w * t' * (lse - x), classes)`` with ``t'`` the smoothed
targets, and a mean over the items. Values and gradients are torch's to rounding (the shift
``m`` is detached: ``lse`` does not depend on it).

Left as they are (fused, classes whole): inputs in half precision (torch computes their log
softmax in float internally), and the legacy ``size_average``/``reduce`` arguments.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

SIGNATURE = inspect.signature(F.cross_entropy)


def written_out(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.cross_entropy(*args, **kwargs)`` as its formula, or None where it is left fused."""
    given = SIGNATURE.bind(*args, **kwargs)
    given.apply_defaults()
    a: dict[str, Any] = given.arguments
    x, target = a["input"], a["target"]
    if (
        a["size_average"] is not None
        or a["reduce"] is not None
        or not isinstance(x, torch.Tensor)
        or not isinstance(target, torch.Tensor)
        or x.dtype not in (torch.float32, torch.float64)
        or x.dim() < 1
    ):
        return None
    unbatched = x.dim() == 1
    if unbatched:
        x, target = x.unsqueeze(0), target.unsqueeze(0)
    loss, count = _per_item(x, target, a["weight"], a["ignore_index"], a["label_smoothing"])
    if a["reduction"] == "none":
        return loss[0] if unbatched else loss
    total = loss.sum()
    return total if a["reduction"] == "sum" else total / count


def _per_item(
    x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """Each item's loss (classes on dim 1 of ``x``) and what a mean divides their sum by."""
    classes = x.shape[1]
    shift = x.detach().amax(1, keepdim=True)
    lse = (x - shift).exp().sum(1, keepdim=True).log() + shift
    w = None if weight is None else weight.view([classes] + [1] * (x.dim() - 2))
    if target.dtype.is_floating_point:  # class probabilities
        smoothed = target * (1 - smoothing) + smoothing / classes if smoothing else target
        if w is not None:
            smoothed = smoothed * w
        return (smoothed * (lse - x)).sum(1), x.numel() // classes
    counted = target != ignore_index
    safe = torch.where(counted, target, 0)
    picked = x.gather(1, safe.unsqueeze(1)).squeeze(1)
    item_weight = counted.to(x.dtype) if weight is None else weight[safe] * counted
    loss = (lse.squeeze(1) - picked) * item_weight
    if smoothing:
        spread = (lse - x).sum(1) if w is None else ((lse - x) * w).sum(1)
        loss = (1 - smoothing) * loss + (smoothing / classes) * spread * counted
    return loss, item_weight.sum()
