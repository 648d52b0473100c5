"""Make shapes per rank: size arguments become local sizes, split means are rescaled.

* An op's ``size``/``shape`` argument (view, reshape, expand, new_ones, ...) describes
  the global output; it becomes the local output shape under the node's layout.
* A mean over a dimension split across ranks (``mean``, a mean-reduced loss; the
  rule's ``mean_over`` labels) is computed locally over 1/c of the items, so its
  result is multiplied by 1/c to become a correct partial sum.

Reads: ``autopar.layouts``, ``val``, ``autopar.stage``. Writes: node arguments; ``mul``
nodes after rescaled means (with ``autopar.layouts`` and the mean's ``autopar.stage``);
``autopar.mean_split`` on the means.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.layout import local_shape
from autopar.ir.meta import MEAN_SPLIT, STAGE, GraphLayouts, NodeLayouts, write_layouts
from autopar.passes.context import PassContext
from autopar.rules import OpCall, lookup

_SIZE_ARGS = ("size", "shape")


def _localize_size(node: torch.fx.Node, layouts: NodeLayouts, ctx: PassContext) -> None:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    out = node.meta["val"]
    local = list(local_shape(tuple(out.shape), layouts.output, ctx.mesh))
    args = list(node.args)
    for i, a in enumerate(schema.arguments[: len(args)]):
        if a.name in _SIZE_ARGS and isinstance(args[i], (list, tuple)):
            args[i] = local
    node.args = tuple(args)
    for name in _SIZE_ARGS:
        if isinstance(node.kwargs.get(name), (list, tuple)):
            node.kwargs = {**node.kwargs, name: local}


def _mean_split(node: torch.fx.Node, layouts: NodeLayouts, ctx: PassContext) -> int:
    """How many ways a mean's items are split across ranks (1 if not a split mean)."""
    rule = lookup(node.target)
    if rule is None:
        return 1
    spec = rule.fn(OpCall.of(node))
    if not spec.mean_over:
        return 1
    count = 1
    for a, size in enumerate(ctx.mesh.axis_sizes):
        for labels, layout in zip(spec.operands, layouts.operands):
            p = None if labels is None or layout is None else layout[a]
            if isinstance(p, Shard) and labels[p.dim] in spec.mean_over:
                count *= size
                break
    return count


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    layouts = GraphLayouts(graph)  # the nodes before this pass: the ones it localizes
    for node in layouts:
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        _localize_size(node, layouts[node], ctx)
        split = _mean_split(node, layouts[node], ctx)
        if split > 1:
            with graph.inserting_after(node):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.0 / split))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user, scaled=scaled: user is not scaled)
            scaled.meta["val"] = node.meta["val"]
            out = layouts[node].output
            write_layouts(scaled, NodeLayouts(operands=(out,), outputs=(out,)))
            if STAGE in node.meta:
                scaled.meta[STAGE] = node.meta[STAGE]
            node.meta[MEAN_SPLIT] = split
    return gm
