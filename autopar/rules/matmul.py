"""Matrix products: mm, addmm, bmm, baddbmm, matmul, linear, grouped (MoE experts). All are anchors."""

from __future__ import annotations

import math

import torch

from autopar.rules import DimSpec, OpCall, broadcast, rule

aten = torch.ops.aten


@rule(aten.mm.default, anchor=True)
def mm(call: OpCall) -> DimSpec:
    # mk,kn->mn
    (m, k), (_, n) = call.shapes
    return DimSpec((("m", "k"), ("k", "n")), (("m", "n"),), summed=frozenset("k"), flops=2 * m * k * n)


@rule(aten.addmm.default, anchor=True)
def addmm(call: OpCall) -> DimSpec:
    # bias + mk,kn->mn ; the bias is added once, so under a split k it must be Partial
    bias_shape, (m, k), (_, n) = call.shapes
    (bias,), _ = broadcast([bias_shape], (m, n))
    bias = tuple({"a": "m", "b": "n"}.get(lab) if lab else None for lab in bias)
    return DimSpec(
        (bias, ("m", "k"), ("k", "n")),
        (("m", "n"),),
        summed=frozenset("k"),
        additive=frozenset({0}),
        flops=2 * m * k * n,
    )


@rule(aten.bmm.default, anchor=True)
def bmm(call: OpCall) -> DimSpec:
    # bmk,bkn->bmn
    (b, m, k), (_, _, n) = call.shapes
    return DimSpec(
        (("b", "m", "k"), ("b", "k", "n")), (("b", "m", "n"),), summed=frozenset("k"), flops=2 * b * m * k * n
    )


@rule(aten.baddbmm.default, anchor=True)
def baddbmm(call: OpCall) -> DimSpec:
    # add + bmk,bkn->bmn
    add_shape, (b, m, k), (_, _, n) = call.shapes
    (add,), _ = broadcast([add_shape], (b, m, n))
    add = tuple({"a": "b", "b": "m", "c": "n"}.get(lab) if lab else None for lab in add)
    return DimSpec(
        (add, ("b", "m", "k"), ("b", "k", "n")),
        (("b", "m", "n"),),
        summed=frozenset("k"),
        additive=frozenset({0}),
        flops=2 * b * m * k * n,
    )


@rule(aten.matmul.default, anchor=True)
def matmul(call: OpCall) -> DimSpec:
    # ...mk,...kn->...mn with broadcast batch dims; 1-D operands drop m or n
    a_shape, b_shape = call.shapes
    (out_shape,) = call.out_shapes
    a_batch, b_batch = a_shape[:-2], b_shape[:-2]
    batch_out = out_shape[: len(out_shape) - (len(a_shape) > 1) - (len(b_shape) > 1)]
    (a_b, b_b), batch = broadcast([a_batch, b_batch], batch_out)
    batch = tuple(lab.upper() for lab in batch)
    a_b = tuple(lab.upper() if lab else None for lab in a_b)
    b_b = tuple(lab.upper() if lab else None for lab in b_b)
    a = (*a_b, "m", "k") if len(a_shape) > 1 else ("k",)
    b = (*b_b, "k", "n") if len(b_shape) > 1 else ("k",)
    out = (*batch, *(("m",) if len(a_shape) > 1 else ()), *(("n",) if len(b_shape) > 1 else ()))
    k = a_shape[-1]
    return DimSpec((a, b), (out,), summed=frozenset("k"), flops=2 * k * math.prod(out_shape))


@rule(aten.linear.default, anchor=True)
def linear(call: OpCall) -> DimSpec | None:
    # ...k,nk->...n (+ bias n, added once)
    x_shape, w_shape = call.shapes[0], call.shapes[1]
    if len(w_shape) != 2:
        return None  # a vector weight (one dot product per row): not covered
    n, k = w_shape
    batch = tuple("ABCDEFGH"[: len(x_shape) - 1])
    operands: tuple = ((*batch, "k"), ("n", "k"))
    if len(call.shapes) == 3:
        operands = (*operands, ("n",))
    return DimSpec(
        operands,
        ((*batch, "n"),),
        summed=frozenset("k"),
        additive=frozenset({2}),
        flops=2 * math.prod(x_shape) * n,
    )


@rule(aten._grouped_mm.default, "transformers.grouped_mm_fallback.default", anchor=True)
def grouped_mm(call: OpCall) -> DimSpec | None:
    # MoE experts: tokens sorted by expert (s, k), one (k, n) matrix per expert e, and the
    # experts' token offsets. Each expert's output features split (n) and its input
    # features are summed (k); tokens and experts stay whole, since the offsets are global.
    if len(call.shapes) != 3 or len(call.shapes[0]) != 2 or len(call.shapes[1]) != 3:
        return None  # batched forms and a bias: not seen in models yet
    (s, k), (_, _, n) = call.shapes[0], call.shapes[1]
    operands = ((None, "k"), (None, "k", "n"), (None,))
    return DimSpec(operands, ((None, "n"),), summed=frozenset("k"), flops=2 * s * k * n)
