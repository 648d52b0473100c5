"""Losses: cross_entropy_loss, nll_loss, mse_loss.

With reduction ``mean`` or ``sum`` every batch-like dimension is summed: splitting
it leaves each rank a partial loss. For ``mean`` the lowering scales each rank's
result by the fraction of the batch it holds (``mean_over``), which is exact only when
every item counts. A class loss with class-index targets skips ``ignore_index`` (and
weighs items by class weights), so its mean is a sum over a count that the ranks do not
share: its items are never split. Capture records the usual calls as a sum over a count
instead (``autopar/capture/exact_means.py``), which splits exactly.
"""

from __future__ import annotations

import math

import torch

from autopar.rules import DimSpec, OpCall, fresh, rule

aten = torch.ops.aten

_NONE, _MEAN = 0, 1


def _class_loss(call: OpCall) -> DimSpec:
    # input N C d..., target N d... (class indices) -> per-item loss, reduced or not
    x, target = call.shapes[:2]
    labels = fresh(len(x), "C")
    if len(x) == 1:
        x_labels, t_labels = ("C",), ()
    else:
        x_labels = (labels[0], "C", *labels[2:])
        t_labels = (labels[0], *labels[2:])
    if len(target) == len(x):  # class probabilities instead of indices
        t_labels = x_labels
    operands: tuple = (x_labels, t_labels, *((("C",),) if len(call.shapes) == 3 else ()))
    reduction = call.arg("reduction", _MEAN)
    per_item = tuple(lab for lab in x_labels if lab != "C")
    n = math.prod(x)
    # cross-entropy runs a log_softmax: an exp per value in forward and in backward
    exps = n if call.node.target is aten.cross_entropy_loss.default else 0
    costs = {"flops": 5 * n, "transcendentals": (exps, exps)}
    if reduction == _NONE:
        return DimSpec(operands, (per_item,), whole=frozenset("C"), **costs)
    if reduction == _MEAN and len(target) != len(x):  # a mean over the counted items only: kept whole
        return DimSpec(operands, ((),), whole=frozenset(("C", *per_item)), **costs)
    return DimSpec(
        operands,
        ((),),
        summed=frozenset(per_item),
        whole=frozenset("C"),
        mean_over=frozenset(per_item) if reduction == _MEAN else frozenset(),
        **costs,
    )


rule(aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)(_class_loss)


@rule(aten.mse_loss.default)
def mse_loss(call: OpCall) -> DimSpec:
    x, _ = call.shapes
    labels = tuple(fresh(len(x)))
    reduction = call.arg("reduction", _MEAN)
    if reduction == _NONE:
        return DimSpec((labels, labels), (labels,))
    return DimSpec(
        (labels, labels),
        ((),),
        summed=frozenset(labels),
        mean_over=frozenset(labels) if reduction == _MEAN else frozenset(),
        flops=3 * math.prod(x),
    )
