"""Lower each ``redistribute`` to one autograd-aware collective op per mesh axis.

The forward steps and their order come from the cost model (``CostModel.edge_steps``),
so the bytes moved at run time are the bytes the plan predicted (``CostModel.backward``
prices the backward as the adjoints of these steps in reverse order). Each op's backward
is chosen from the gradient's transition on the same axis:

| forward (have -> need) | op | gradient (grad_need -> grad_have) | backward |
| --- | --- | --- | --- |
| R -> S(d) | ``shard`` | S(d) -> R | all-gather |
| P -> S(d) | ``reduce_scatter`` | S(d) -> R | all-gather |
| S(d) -> S(e) | ``all_to_all`` | S(e) -> S(d) | all-to-all |
| P -> R | ``all_reduce`` | R -> R or P -> R | identity or all-reduce |
| S(d) -> R | ``all_gather`` | P -> S(d) or R -> S(d) | reduce-scatter or slice |
| R or S(d) -> P | ``to_partial`` | R -> R or R -> S(d) | identity or slice |
| R -> R | ``grad_all_reduce`` | P -> R | all-reduce |

Reads: ``autopar.redistribution``, ``autopar.stage``. Writes: collective nodes with
``autopar.layouts`` (the layout before and after their axis step) and the
``redistribute``'s ``autopar.stage``; removes the ``redistribute`` nodes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar.runtime.collectives  # noqa: F401  (registers torch.ops.autopar)
from autopar.ir.errors import CompileError
from autopar.ir.meta import REDISTRIBUTION, STAGE, NodeLayouts, write_layouts
from autopar.passes.context import PassContext
from autopar.passes.insert_redistributions import redistribute
from autopar.planning.cost import StepKind

ops = torch.ops.autopar


def _step(kind: StepKind, x: torch.fx.Node, axis: str, before, after, grad_need) -> tuple[object, tuple]:
    """The op and its arguments for one axis step."""
    if kind == StepKind.SLICE:
        return ops.shard.default, (x, after.dim, axis)
    if kind == StepKind.REDUCE_SCATTER:
        return ops.reduce_scatter.default, (x, after.dim, axis)
    if kind == StepKind.ALL_TO_ALL:
        return ops.all_to_all.default, (x, before.dim, after.dim, axis)
    if kind == StepKind.ALL_REDUCE:
        return ops.all_reduce.default, (
            x,
            axis,
            "all_reduce" if isinstance(grad_need, Partial) else "identity",
        )
    if kind == StepKind.ALL_GATHER:
        return ops.all_gather.default, (
            x,
            before.dim,
            axis,
            "reduce_scatter" if isinstance(grad_need, Partial) else "slice",
        )
    if kind == StepKind.TO_PARTIAL:
        return ops.to_partial.default, (x, axis, before.dim if isinstance(before, Shard) else -1)
    raise CompileError(f"no collective for step {kind!r}")


def _check_nesting(node: torch.fx.Node, ctx: PassContext, current: list, a: int, after: object) -> None:
    """A dim split over several axes is split outer axis first: a later (inner) axis still
    splitting the dim this step leaves or enters would scramble the pieces."""
    dims = {p.dim for p in (current[a], after) if isinstance(p, Shard)}
    inner = [
        b for b in range(a + 1, len(current)) if isinstance(current[b], Shard) and current[b].dim in dims
    ]
    if inner:
        raise CompileError(
            f"{node.name}: changing the split of dim {sorted(dims)} over mesh axis {ctx.mesh.axis_names[a]} "
            f"while inner axis {ctx.mesh.axis_names[inner[0]]} splits it too is not supported yet; "
            "split each tensor dim over one mesh axis in annotations"
        )


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not redistribute:
            continue
        have, need, grad_need, grad_have = node.meta[REDISTRIBUTION]
        current = list(have)
        x = node.args[0]
        steps = ctx.cost.edge_steps(have, need, grad_need, grad_have)
        for a, kind in steps:
            g, gh = grad_need[a], grad_have[a]
            if kind == StepKind.GRAD_ALL_REDUCE and not (
                isinstance(g, Partial) and isinstance(gh, Replicate)
            ):
                raise CompileError(
                    f"{node.name}: no collective turns a {g} gradient into {gh} on mesh axis "
                    f"{ctx.mesh.axis_names[a]} while the value stays {have[a]}"
                )
        with graph.inserting_before(node):
            for a, kind in steps:
                axis = ctx.axis_keys[ctx.mesh.axis_names[a]]
                before = tuple(current)
                if kind == StepKind.GRAD_ALL_REDUCE:
                    target, args = ops.grad_all_reduce.default, (x, axis)
                else:
                    _check_nesting(node, ctx, current, a, need[a])
                    target, args = _step(kind, x, axis, current[a], need[a], grad_need[a])
                    current[a] = need[a]
                y = graph.call_function(target, args)
                y.meta["val"] = node.meta["val"]
                write_layouts(y, NodeLayouts(operands=(before,), outputs=(tuple(current),)))
                if STAGE in node.meta:
                    y.meta[STAGE] = node.meta[STAGE]
                x = y
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    return gm
