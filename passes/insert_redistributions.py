"""Insert a redistribution wherever a value's layout, or its gradient's, changes along an edge.

For every tensor edge producer -> consumer (and every model output) the layouts are:
``have`` (the producer's output), ``need`` (the consumer's operand), ``grad_need`` (the
gradient the consumer hands back) and ``grad_have`` (the gradient layout the
producer's output must receive: ``have`` with Partial read as Replicate). A
``redistribute`` node is inserted when ``have != need``, or when a gradient flows
and ``grad_need != grad_have``. Model outputs need their Partial axes reduced.

Gradient sums that can wait until backward reaches the parameters (data parallelism;
see :mod:`autopar.planning.graph.gradient_sums`, read on the layouts written on the graph, as the
planner priced them on the plan's) are left to the runtime's bucketed reducer:
``ctx.grad_reductions[placeholder] = axis keys`` (see ``collectives.register_mesh``).

Reads: ``autopar.layouts``, ``autopar.grads``, ``autopar.stage``. Writes: ``redistribute``
nodes with ``autopar.layouts``, ``autopar.redistribution`` = (have, need, grad_need,
grad_have) and, under a pipeline, their consumer's ``autopar.stage``;
``ctx.grad_reductions``.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from autopar.capture.export import gradient_flow
from autopar.ir.layout import format_layout
from autopar.ir.meta import REDISTRIBUTION, STAGE, GraphLayouts, NodeLayouts, write_layouts
from autopar.passes.context import PassContext
from autopar.planning.graph.gradient_sums import planned_edges
from autopar.planning.graph.laid_out import LaidOutGraph


def redistribute(x: torch.Tensor, have: str, need: str, grad_need: str, grad_have: str) -> torch.Tensor:
    """Marker for a layout change; ``lower_collectives`` replaces it with collective ops."""
    raise RuntimeError("redistribute() must be lowered to collectives before the graph runs")


def _is_tensor(a: object) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _replace_operand(node: torch.fx.Node, slot: int, new: torch.fx.Node) -> None:
    seen = -1

    def swap(a: object) -> object:
        nonlocal seen
        if _is_tensor(a):
            seen += 1
            if seen == slot:
                return new
        return a

    node.args, node.kwargs = pytree.tree_map(swap, (node.args, node.kwargs))


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    state = set(ctx.captured.params) | set(ctx.captured.buffers)
    laid = LaidOutGraph(
        graph=graph, layouts=GraphLayouts(graph), mesh=ctx.mesh, flows=gradient_flow(ctx.captured)
    )
    planned, summed = planned_edges(laid, state)
    for param, axes in summed.items():
        ctx.grad_reductions[param.name] = tuple(ctx.axis_keys[ctx.mesh.axis_names[a]] for a in sorted(axes))
    for (src, node, slot), have, need, grad_need, grad_have in planned:
        if have == need and grad_need == grad_have:
            continue
        with graph.inserting_before(node):
            layouts = (have, need, grad_need, grad_have)
            r = graph.call_function(redistribute, (src, *(format_layout(x) for x in layouts)))
        r.meta["val"] = src.meta["val"]
        write_layouts(r, NodeLayouts(operands=(have,), outputs=(need,)))
        r.meta[REDISTRIBUTION] = layouts
        if STAGE in node.meta:  # runs in its consumer's pipeline stage, as the plan priced it
            r.meta[STAGE] = node.meta[STAGE]
        _replace_operand(node, slot, r)
    return gm
