"""Reductions: sum/mean (split dims give Partial), max-like, order statistics (median, kthvalue,
mode) and other statistics (dims whole).

A maximum of a detached value (``x.detach().amax(dim)``, the shift of a stable softmax or
log-sum-exp) may split its reduced dims: each rank holds a partial maximum, reduced by an
all-reduce of the maximum. A maximum that needs a gradient keeps them whole: its gradient
goes to the positions equal to the maximum, shared among ties, which ranks cannot count
without another collective.
"""

from __future__ import annotations

import torch

from autopar.rules import DimSpec, OpCall, fresh, rule

aten = torch.ops.aten


def _reduced_dims(call: OpCall, ndim: int) -> list[int]:
    dims = call.arg("dim")
    if dims is None or dims == []:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % ndim for d in dims)


def _reduce(call: OpCall, summable: bool, mean: bool = False) -> DimSpec | None:
    x = call.shapes[0]
    named = call.arg("dim")
    if not x and (isinstance(named, int) or bool(named)):
        return None  # a dim of a 0-d value (torch takes dim 0 or -1 as the value itself): not covered
    labels = fresh(len(x))
    dims = _reduced_dims(call, len(x))
    keep = bool(call.arg("keepdim", False))
    out = tuple(None if d in dims else labels[d] for d in range(len(x)) if keep or d not in dims)
    reduced = frozenset(labels[d] for d in dims)
    if summable:
        return DimSpec(
            (tuple(labels),),
            (out,),
            summed=reduced,
            linear=frozenset({0}),
            mean_over=reduced if mean else frozenset(),
        )
    return DimSpec((tuple(labels),), tuple(out for _ in call.out_shapes), whole=reduced)


@rule(aten.sum.dim_IntList, aten.sum.default)
def sum_(call: OpCall) -> DimSpec | None:
    return _reduce(call, summable=True)


@rule(aten.mean.dim, aten.mean.default)
def mean(call: OpCall) -> DimSpec | None:
    return _reduce(call, summable=True, mean=True)


@rule(aten.amax.default)
def amax(call: OpCall) -> DimSpec | None:
    spec = _reduce(call, summable=False)
    if spec is None or call.operands[0].target is not aten.detach.default:
        return spec
    return DimSpec(spec.operands, spec.outputs, summed=spec.whole, max_over=spec.whole)


@rule(
    aten.amin.default,
    aten.max.dim,
    aten.min.dim,
    aten.argmax.default,
    aten.argmin.default,
    aten.var.correction,
    aten.std.correction,
    aten.var_mean.correction,
    aten.any.dim,
    aten.all.dim,
    aten.logsumexp.default,
    aten.prod.dim_int,
    aten.aminmax.default,
    aten.kthvalue.default,
    aten.median.dim,
    aten.nanmedian.dim,
    aten.mode.default,
)
def whole_reduction(call: OpCall) -> DimSpec | None:
    return _reduce(call, summable=False)


@rule(
    aten.max.default,
    aten.min.default,
    aten.any.default,
    aten.all.default,
    aten.median.default,
    aten.nanmedian.default,
)
def full_reduction(call: OpCall) -> DimSpec:
    x = call.shapes[0]
    labels = tuple(fresh(len(x)))
    return DimSpec((labels,), ((),), whole=frozenset(labels))
