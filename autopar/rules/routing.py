"""Routing: the ops of a mixture-of-experts router and of index bookkeeping.

* ordering along a dim (``topk``, ``sort``, ``argsort``, and the scans ``cummax``,
  ``cummin``, ``cumprod``, ``logcumsumexp``): that dim stays whole, the others split
  freely, every output (values and indices) carries the same labels;
* writes at positions (``scatter``/``scatter_add``/``scatter_reduce``, ``index_add``,
  ``index_put``): the written dim of ``self`` stays whole; another dim splits only where
  ``self``, the index and the source all have its full size (a rank's index rows then
  address its own rows of the source). Accumulating writes (``scatter_add``, a ``"sum"``
  ``scatter_reduce`` that includes ``self``, ``index_add``, ``index_put`` with
  ``accumulate``) are sums: they are linear in ``self`` and the source together, and
  splitting the items written (the index and source along the written dim) leaves
  partial sums, with ``self`` Partial as a bias is;
* ``one_hot``: the class dim is a new output dim, whole;
* counts (``histc``, ``bincount``): a histogram of a split input is a partial count, so
  ``histc`` with a fixed range sums over its items. ``bincount``'s length is its largest
  value plus one, which differs between pieces, so its items stay whole (as does
  ``histc``'s when its range comes from the data, ``min == max``).

Index arithmetic of routers (``floor_divide``, ``remainder``) and ``clamp`` with tensor
bounds are element-wise: they take the element-wise rule of ``elementwise.nonlinear``,
registered here.
"""

from __future__ import annotations

import math

import torch

from autopar.rules import DimSpec, OpCall, broadcast, fresh, rule
from autopar.rules.elementwise import nonlinear

aten = torch.ops.aten

rule(
    aten.floor_divide.default,
    aten.floor_divide.Scalar,
    aten.remainder.Tensor,
    aten.remainder.Scalar,
    aten.clamp.Tensor,
    aten.clamp_min.Tensor,
    aten.clamp_max.Tensor,
)(nonlinear)


@rule(
    aten.topk.default,
    aten.sort.default,
    aten.sort.stable,
    aten.argsort.default,
    aten.argsort.stable,
    aten.cummax.default,
    aten.cummin.default,
    aten.cumprod.default,
    aten.logcumsumexp.default,
)
def along_dim(call: OpCall) -> DimSpec | None:
    # no arithmetic across ranks is possible along the ordered dim: it stays whole in the
    # input and in every output (topk's k-long dim is another, equally whole, label)
    x = call.shapes[0]
    if not x:
        return None  # a 0-d value (its dim 0 is the value itself): not covered
    dim = call.arg("dim", -1) % len(x)
    labels = fresh(len(x))
    out = tuple(lab.upper() if d == dim else lab for d, lab in enumerate(labels))
    return DimSpec(
        (tuple(labels),),
        tuple(out for _ in call.out_shapes),
        whole=frozenset({labels[dim], out[dim]}),
        flops=math.prod(x) * max(1, math.ceil(math.log2(max(x[dim], 2)))),
    )


def _accumulates(call: OpCall) -> bool:
    if call.node.target is aten.scatter_add.default:
        return True
    return (
        call.node.target is aten.scatter_reduce.two
        and call.arg("reduce") == "sum"
        and bool(call.arg("include_self", True))
    )


@rule(
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    aten.scatter_add.default,
    aten.scatter_reduce.two,
)
def scatter(call: OpCall) -> DimSpec | None:
    # out[..., index[i, j], ...] = src[i, j] along dim: the index's values address self's
    # dim, so that stays whole. A dim d != dim splits only where self, index and src all
    # have the same size there (the index may be smaller than both, src larger than it).
    self_shape, idx_shape, *src = call.shapes
    if not self_shape:
        return None  # a write into a 0-d value: not covered
    ndim = len(self_shape)
    dim = call.arg("dim") % ndim
    idx = fresh(ndim)
    shared = [
        d != dim and self_shape[d] == idx_shape[d] and all(s[d] == idx_shape[d] for s in src)
        for d in range(ndim)
    ]
    own = tuple(idx[d] if shared[d] else f"{idx[d]}'" for d in range(ndim))
    operands: list[tuple[str, ...]] = [own, tuple(idx)]
    summed: frozenset[str] = frozenset()
    sums: frozenset[int] = frozenset()
    if src:
        carried = [shared[d] or (d == dim and src[0][d] == idx_shape[d]) for d in range(ndim)]
        operands.append(tuple(idx[d] if carried[d] else f'{idx[d]}"' for d in range(ndim)))
        if _accumulates(call):
            # items written along dim split with their index rows: each rank adds its own
            summed = frozenset({idx[dim]}) if carried[dim] else frozenset()
            sums = frozenset({0, 2})
    whole = frozenset(own[d] for d in range(ndim) if not shared[d])
    return DimSpec(
        tuple(operands),
        (own,),
        summed=summed,
        whole=whole,
        linear=sums,
        additive=sums,
        flops=math.prod(idx_shape),
    )


@rule(aten.index_add.default)
def index_add(call: OpCall) -> DimSpec | None:
    # out = self; out[index[i]] += alpha * source[i] along dim: a sum over the items i,
    # which split with the index; self's dim stays whole
    self_shape, idx_shape, src_shape = call.shapes
    if len(idx_shape) != 1 or not self_shape:
        return None  # a 0-d index, or a write into a 0-d value: not covered
    ndim = len(self_shape)
    dim = call.arg("dim") % ndim
    labels = fresh(ndim + 1)
    own, item = tuple(labels[:ndim]), labels[ndim]
    src = tuple(item if d == dim else own[d] for d in range(ndim))
    both = frozenset({0, 2})
    return DimSpec(
        (own, (item,), src),
        (own,),
        summed=frozenset({item}),
        whole=frozenset({own[dim]}),
        linear=both,
        additive=both,
        flops=math.prod(src_shape),
    )


@rule(aten.index_put.default)
def index_put(call: OpCall) -> DimSpec | None:
    # self[indices] = values (or += with accumulate): the indexed dims of self stay whole;
    # values broadcast against self[indices], whose other dims are self's own. With
    # accumulate the positions written are a sum over the index entries, which split.
    self_shape, *idx_shapes, values_shape = call.shapes
    indices = call.arg("indices")
    if any(t is not None and t.meta["val"].dtype in (torch.bool, torch.uint8) for t in indices):
        return None  # a mask addresses as many dims of self as it has: not covered
    positions = [i for i, t in enumerate(indices) if t is not None]
    own = fresh(len(self_shape))
    bshape = tuple(torch.broadcast_shapes(*idx_shapes))
    idx_labels, bcast = broadcast(idx_shapes, bshape)
    bcast = tuple(lab.upper() for lab in bcast)
    idx_labels = tuple(tuple(lab.upper() if lab else None for lab in labels) for labels in idx_labels)
    rest = [d for d in range(len(self_shape)) if d not in positions]
    if positions == list(range(positions[0], positions[-1] + 1)):
        before = [d for d in rest if d < positions[0]]
        after = [d for d in rest if d > positions[-1]]
    else:
        before, after = [], rest
    got_l = (*(own[d] for d in before), *bcast, *(own[d] for d in after))
    got_shape = (*(self_shape[d] for d in before), *bshape, *(self_shape[d] for d in after))
    offset = len(got_shape) - len(values_shape)
    values_l = tuple(
        got_l[offset + i] if offset + i >= 0 and size == got_shape[offset + i] else None
        for i, size in enumerate(values_shape)
    )
    accumulate = bool(call.arg("accumulate", False))
    both = frozenset({0, len(call.shapes) - 1}) if accumulate else frozenset()
    return DimSpec(
        (tuple(own), *idx_labels, values_l),
        (tuple(own),),
        # an entry's split needs its values split with it: not a dim values broadcast along
        summed=frozenset(lab for lab in bcast if lab in values_l) if accumulate else frozenset(),
        whole=frozenset(own[d] for d in positions),
        linear=both,
        additive=both,
        flops=math.prod(bshape),
    )


@rule(aten.one_hot.default)
def one_hot(call: OpCall) -> DimSpec | None:
    # the class dim is new and whole; without num_classes it is the data's largest value
    # plus one, which a piece of the input does not know
    if call.arg("num_classes", -1) < 0:
        return None
    x = call.shapes[0]
    labels = fresh(len(x) + 1)
    return DimSpec((tuple(labels[:-1]),), (tuple(labels),), whole=frozenset({labels[-1]}))


@rule(aten.histc.default)
def histc(call: OpCall) -> DimSpec:
    # counts over a fixed range add up across pieces of the input (floating counts, exact);
    # a range taken from the data (min == max) differs between pieces
    x = call.shapes[0]
    labels = fresh(len(x) + 1)
    items, bins = tuple(labels[:-1]), labels[-1]
    fixed = call.arg("min", 0) < call.arg("max", 0)
    return DimSpec(
        (items,),
        ((bins,),),
        summed=frozenset(items) if fixed else frozenset(),
        whole=frozenset({bins}),
        flops=math.prod(x),
    )


@rule(aten.bincount.default)
def bincount(call: OpCall) -> DimSpec:
    # the output's length is the largest value plus one (at least minlength): pieces of a
    # split input give counts of different lengths, so nothing splits
    item, count = fresh(2)
    return DimSpec(tuple((item,) for _ in call.shapes), ((count,),), whole=frozenset({item, count}))
