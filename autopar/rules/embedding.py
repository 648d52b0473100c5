"""Lookups: embedding (an anchor), index, gather, index_select.

The looked-up dimension of embedding, gather and index_select (an embedding's vocabulary,
the classes a loss picks its target's logit from) is *indexed* by the index operand: split,
each rank looks up the indices in its own block and the output is a partial sum, as in
Megatron's vocab-parallel embedding (see :class:`autopar.rules.DimSpec`).
"""

from __future__ import annotations

import math

import torch

from autopar.rules import DimSpec, OpCall, broadcast, fresh, rule, spec_of

aten = torch.ops.aten

# Ops that hand a table on row for row (a cast to the compute dtype, a copy): a lookup into
# their result is a lookup into the table.
TABLE_CASTS = frozenset({aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default})


def table_source(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor that ``node`` is a cast or copy of (through any chain of :data:`TABLE_CASTS`)."""
    while node.op == "call_function" and node.target in TABLE_CASTS:
        node = node.args[0]
    return node


def non_lookup_use(table: torch.fx.Node, dim: int) -> torch.fx.Node | None:
    """The first node that reads ``table`` (or a cast of it) other than as the table of a
    lookup over its dim ``dim``; None when every use is such a lookup."""
    for user in table.users:
        if user.op == "call_function" and user.target in TABLE_CASTS:
            found = non_lookup_use(user, dim)
            if found is not None:
                return found
            continue
        if user.op != "call_function":
            return user
        call = OpCall.of(user)
        spec = spec_of(call)
        if spec is None:
            return user
        indexed = {label for label, _ in spec.indexed}
        slots = [i for i, op in enumerate(call.operands) if op is table]
        if not all(spec.operands[i] and spec.operands[i][dim] in indexed for i in slots):
            return user
    return None


@rule(aten.embedding.default, anchor=True)
def embedding(call: OpCall) -> DimSpec:
    # vd, ... -> ...d; the vocabulary v is indexed. A gradient scaled by the frequency of
    # each index (or a sparse one) counts over the whole batch of lookups: v stays whole.
    (v, d), idx = call.shapes
    labels = fresh(len(idx), "vd")
    operands, outputs = (("v", "d"), tuple(labels)), ((*labels, "d"),)
    if call.arg("scale_grad_by_freq", False) or call.arg("sparse", False):
        return DimSpec(operands, outputs, whole=frozenset("v"))
    return DimSpec(operands, outputs, summed=frozenset("v"), indexed=(("v", 1),), flops=math.prod(idx) * d)


@rule(aten.index.Tensor)
def index(call: OpCall) -> DimSpec:
    # Advanced indexing: indexed dims of self stay whole; the broadcast index dims
    # become output dims (in place when the indexed dims are adjacent, else first).
    self_shape, idx_shapes = call.shapes[0], call.shapes[1:]
    indices = call.arg("indices")
    positions = [i for i, t in enumerate(indices) if t is not None]
    (out_shape,) = call.out_shapes
    idx_labels, bcast = broadcast(idx_shapes, out_shape[: len(out_shape) - len(self_shape) + len(positions)])
    bcast = tuple(lab.upper() for lab in bcast)
    idx_labels = tuple(tuple(lab.upper() if lab else None for lab in labels) for labels in idx_labels)
    own = fresh(len(self_shape))
    rest = [own[d] for d in range(len(self_shape)) if d not in positions]
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    if adjacent:
        before = [own[d] for d in range(positions[0])]
        out = (*before, *bcast, *rest[len(before) :])
    else:
        out = (*bcast, *rest)
    whole = frozenset(own[d] for d in positions)
    return DimSpec((tuple(own), *idx_labels), (tuple(out),), whole=whole)


@rule(aten.gather.default)
def gather(call: OpCall) -> DimSpec | None:
    # out[i][j] = self[index[i][j]][j] along dim: self's dim is indexed, the index's (=
    # output's) dim may split; other dims are shared when sizes match, else whole.
    self_shape, idx_shape = call.shapes[:2]
    if not self_shape:
        return None  # a lookup into a 0-d value: not covered
    dim = call.arg("dim") % len(self_shape)
    idx = fresh(len(idx_shape))
    own = tuple(
        idx[d] if d != dim and self_shape[d] == idx_shape[d] else f"{idx[d]}".upper()
        for d in range(len(self_shape))
    )
    whole = frozenset(own[d] for d in range(len(own)) if own[d].isupper() and d != dim)
    if call.arg("sparse_grad", False):
        return DimSpec((own, tuple(idx)), (tuple(idx),), whole=whole | {own[dim]})
    return DimSpec(
        (own, tuple(idx)), (tuple(idx),), whole=whole, summed=frozenset({own[dim]}), indexed=((own[dim], 1),)
    )


@rule(aten.index_select.default)
def index_select(call: OpCall) -> DimSpec | None:
    self_shape, _ = call.shapes
    if not self_shape:
        return None  # a lookup into a 0-d value: not covered
    dim = call.arg("dim") % len(self_shape)
    own = fresh(len(self_shape), "Z")
    out = tuple("Z" if d == dim else own[d] for d in range(len(self_shape)))
    return DimSpec((tuple(own), ("Z",)), (out,), summed=frozenset(own[dim]), indexed=((own[dim], 1),))
