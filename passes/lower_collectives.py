"""Lower each ``redistribute`` to autograd-aware collective ops, one per step on a mesh axis.

The forward steps and their order are the plan's record (``ctx.plan.lowering.edges``, which
``insert_redistributions`` carries on each ``redistribute`` as ``autopar.redistribution``): the
planner ordered them with its cost model (``CostModel.edge_plan``), so the bytes moved at run time
are the bytes the plan predicted (``CostModel.backward`` prices the backward as the adjoints of
these steps in reverse order). Each op's backward is chosen from the gradient's transition on the
same axis, the gradient ``g`` being laid out as the op's backward receives it (``EdgeStep.grad``):

| forward (before -> after) | op | gradient (g -> what backward leaves) | backward |
| --- | --- | --- | --- |
| R -> S(d) | ``shard`` | S(d) -> R | all-gather |
| P -> S(d) | ``reduce_scatter`` | S(d) -> R | all-gather |
| S(d) -> S(e) | ``all_to_all`` | S(e) -> S(d) | all-to-all |
| P -> R | ``all_reduce`` | R -> R or P -> R | identity or all-reduce |
| P(max) -> R | ``all_reduce_max`` | none: the value needs no gradient | |
| S(d) -> R | ``all_gather`` | P -> S(d) or R -> S(d) | reduce-scatter or slice |
| R or S(d) -> P | ``to_partial`` | R -> R or R -> S(d) | identity or slice |
| R -> R | ``grad_all_reduce`` | P -> R | all-reduce |

A strided shard (``S(d)xk``, :mod:`autopar.ir.strided`) moves with the same ops, given its
``parts``; to or from any other split it passes through Replicate
(``autopar.ir.redistribution_steps``). A tensor dim split over several mesh axes is split
outer axis first, so the steps never change the split of a dim while an inner axis splits it
too: where no order avoids that, the planner unwinds the inner split first (an extra
``all_gather``) and redoes it after (``shard``); see ``autopar.ir.redistribution_steps``.
Only an axis's last step can receive a partial-sum gradient: before it, the gradient is laid
out like the value.

Reads: ``autopar.redistribution`` (the plan's record of the edge), ``autopar.stage``. Writes:
collective nodes with ``autopar.layouts`` (the layout before and after their step) and the ``redistribute``'s
``autopar.stage``; removes the ``redistribute`` nodes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar.runtime.collectives  # noqa: F401  (registers torch.ops.autopar)
from autopar.ir.errors import CompileError
from autopar.ir.layout import is_uneven
from autopar.ir.meta import REDISTRIBUTION, STAGE, NodeLayouts, write_layouts
from autopar.ir.redistribution_steps import EdgeStep, StepKind
from autopar.ir.strided import is_split, parts_of
from autopar.passes.context import PassContext
from autopar.passes.insert_redistributions import redistribute

ops = torch.ops.autopar


def _op(step: EdgeStep, x: torch.fx.Node, axis: str, n: int) -> tuple[object, tuple]:
    """The op and its arguments for one step on the mesh axis named ``axis`` (its key, of ``n`` ranks)."""
    kind, before, after = step.kind, step.before[step.axis], step.after[step.axis]
    partial = isinstance(step.grad, Partial)
    shape = x.meta["val"].shape

    def rows(p: object) -> int:  # the rows of a dim this axis splits unevenly, else 0
        return int(shape[p.dim]) if is_split(p) and is_uneven(int(shape[p.dim]), n) else 0

    # optional arguments (a strided shard's parts, an uneven split's rows) only where needed:
    # printed programs stay short
    parts = max(parts_of(before), parts_of(after))
    size = rows(after) or rows(before)  # one side splits: the slice's, gather's or scatter's dim
    extra = (parts, size) if size else (parts,) if parts > 1 else ()
    if kind == StepKind.SLICE:
        return ops.shard.default, (x, after.dim, axis, *extra)
    if kind == StepKind.REDUCE_SCATTER:
        return ops.reduce_scatter.default, (x, after.dim, axis, *extra)
    if kind == StepKind.ALL_TO_ALL:
        sizes = (rows(before), rows(after)) if rows(before) or rows(after) else ()
        return ops.all_to_all.default, (x, before.dim, after.dim, axis, *sizes)
    if kind == StepKind.ALL_REDUCE and before == Partial("max"):
        return ops.all_reduce_max.default, (x, axis)
    if kind == StepKind.ALL_REDUCE:
        return ops.all_reduce.default, (x, axis, "all_reduce" if partial else "identity")
    if kind == StepKind.ALL_GATHER:
        grad = "reduce_scatter" if partial else "slice"
        return ops.all_gather.default, (x, before.dim, axis, grad, *extra)
    if kind == StepKind.TO_PARTIAL:
        dim = before.dim if isinstance(before, Shard) else -1
        return ops.to_partial.default, (x, axis, dim, *((size,) if size else ()))
    return ops.grad_all_reduce.default, (x, axis)  # the one kind left: only the gradient changes


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not redistribute:
            continue
        have, need, grad_need, grad_have, steps = node.meta[REDISTRIBUTION]
        for step in steps:
            a = step.axis
            g, gh = grad_need[a], grad_have[a]
            if step.kind == StepKind.GRAD_ALL_REDUCE and not (
                isinstance(g, Partial) and isinstance(gh, Replicate)
            ):
                raise CompileError(
                    f"{node.name}: no collective turns a {g} gradient into {gh} on mesh axis "
                    f"{ctx.mesh.axis_names[a]} while the value stays {have[a]}"
                )
        x = node.args[0]
        with graph.inserting_before(node):
            for step in steps:
                key = ctx.axis_keys[ctx.mesh.axis_names[step.axis]]
                y = graph.call_function(*_op(step, x, key, ctx.mesh.axis_sizes[step.axis]))
                y.meta["val"] = node.meta["val"]
                write_layouts(y, NodeLayouts(operands=(step.before,), outputs=(step.after,)))
                if STAGE in node.meta:
                    y.meta[STAGE] = node.meta[STAGE]
                x = y
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    return gm
