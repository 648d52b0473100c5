"""Insert a redistribution wherever a value's layout, or its gradient's, changes along an edge.

For every tensor edge producer -> consumer (and every model output) the layouts are:
``have`` (the producer's output), ``need`` (the consumer's operand), ``grad_need`` (the
gradient the consumer hands back) and ``grad_have`` (the gradient layout the
producer's output must receive: ``have`` with Partial read as Replicate). A
``redistribute`` node is inserted when ``have != need``, or when a gradient flows
and ``grad_need != grad_have``. Model outputs need their Partial axes reduced.

Gradients of parameters that only need summing over some axes (data parallelism:
the parameter is Replicate there, its consumer's gradient Partial) are left to the
runtime's bucketed reducer: ``ctx.grad_reductions[placeholder] = axis names``.

Reads: ``autopar.layouts``, ``autopar.grads``. Writes: ``redistribute`` nodes with
``autopar.layouts`` and ``autopar.redistribution`` = (have, need, grad_need, grad_have);
``ctx.grad_reductions``.
"""

from __future__ import annotations

import operator

import torch
from torch.utils import _pytree as pytree

from autopar.capture import gradient_flow
from autopar.compiler import PassContext
from autopar.layout import format_layout, grad_layout, reduction_only_axes
from autopar.printing import GRADS, LAYOUTS

REDISTRIBUTION = "autopar.redistribution"


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
    flows = gradient_flow(ctx.captured)
    params = set(ctx.captured.params)
    for node in list(graph.nodes):
        if node.op == "output":
            operands = [a for a in pytree.tree_leaves(node.args) if _is_tensor(a)]
            needs = [grad_layout(a.meta[LAYOUTS][1][0]) for a in operands]
            grads = needs
        elif node.op == "call_function" and LAYOUTS in node.meta and node.target is not operator.getitem:
            operands = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if _is_tensor(a)]
            needs, grads = list(node.meta[LAYOUTS][0]), list(node.meta[GRADS])
        else:
            continue
        for slot, (src, need, grad_need) in enumerate(zip(operands, needs, grads)):
            if need is None:
                continue
            have = src.meta[LAYOUTS][1][0]
            flowing = flows.get(src, False) and grad_need is not None
            grad_have = grad_layout(have)
            if not flowing:
                grad_need = grad_have
            if have == need and grad_need == grad_have:
                continue
            if src.op == "placeholder" and src.name in params:
                axes = reduction_only_axes(have, need, grad_need, grad_have)
                if axes is not None:
                    names = {ctx.mesh.axis_names[a] for a in axes}
                    ctx.grad_reductions[src.name] = tuple(
                        n
                        for n in ctx.mesh.axis_names
                        if n in names | set(ctx.grad_reductions.get(src.name, ()))
                    )
                    continue
            with graph.inserting_before(node):
                layouts = (have, need, grad_need, grad_have)
                r = graph.call_function(redistribute, (src, *(format_layout(x) for x in layouts)))
            r.meta["val"] = src.meta["val"]
            r.meta[LAYOUTS] = ((have,), (need,))
            r.meta[REDISTRIBUTION] = layouts
            _replace_operand(node, slot, r)
    return gm
