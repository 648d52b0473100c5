"""Where data-parallel gradient sums happen: late, on parameters, in buckets.

On a mesh axis where an op is split (say the batch over ``dp``) but an operand is
not, the operand's gradient is a partial sum that must be summed over the axis.
Summing it where it arises blocks backward mid-way; summing it later is just as
correct, because backward is linear in the incoming gradient: a region of values
computed from parameters alone and replicated on the axis can carry partial
gradients all the way to its parameters, whose gradients are then summed
asynchronously in buckets, as DDP does. A parameter consumed directly is the
smallest such region.

:func:`deferred_sums` finds, per axis, the largest such region (a greatest fixed
point: a value stays in it while every use either needs the sum or feeds another
value of the region unchanged) and returns which edge sums to drop and which
parameters to sum instead. The planner uses it to price the sums (on the layouts of a plan
being made) and to record them in the plan (``assembly/lowering_record.py``), which the
``insert_redistributions`` pass applies, so both agree.
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Partial, Replicate
from torch.utils import _pytree as pytree

from autopar.ir.layout import Layout, grad_layout
from autopar.planning.graph.laid_out import LaidOutGraph
from autopar.rules.op_call import OpCall

Edge = tuple[torch.fx.Node, torch.fx.Node, int]  # (producer, consumer, operand slot)
PlannedEdge = tuple[Edge, Layout, Layout, Layout, Layout]  # (edge, have, need, grad_need, grad_have)


def _tensor(a: object) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def edges(laid: LaidOutGraph) -> list[tuple[Edge, Layout, Layout, Layout | None]]:
    """Every tensor edge with (have, need, grad_need); model outputs need their Partial axes reduced."""
    layouts = laid.layouts
    found = []
    for node in laid.graph.nodes:
        if node.op == "output":
            for slot, src in enumerate(a for a in pytree.tree_leaves(node.args) if _tensor(a)):
                have = layouts[src].output
                need = grad_layout(have)
                found.append(((src, node, slot), have, need, need))
        elif node.op == "call_function" and node in layouts and node.target is not operator.getitem:
            mine, operands = layouts[node], OpCall.of(node).operands
            for slot, (src, need, grad) in enumerate(zip(operands, mine.operands, mine.grads)):
                if need is not None:
                    found.append(((src, node, slot), layouts[src].output, need, grad))
    return found


def parameter_only(graph: torch.fx.Graph, params: set[str]) -> list[torch.fx.Node]:
    """Values computed from parameters, buffers and constants alone (no user input), in graph order."""
    only: dict[torch.fx.Node, None] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in params:
                only[node] = None
        elif node.op == "get_attr" or (
            node.op == "call_function" and all(a in only for a in node.all_input_nodes)
        ):
            only[node] = None
    return list(only)


def sums_over(have: Layout, need: Layout, grad: Layout | None, axis: int) -> bool:
    """Whether an edge from a value stored as ``have`` into a consumer needing ``need`` and handing
    back a gradient laid out ``grad`` sums that gradient over mesh axis ``axis``: the value keeps
    its layout there, is replicated there, and its consumer's gradient is a partial sum there."""
    return (
        grad is not None
        and have[axis] == need[axis]
        and isinstance(grad[axis], Partial)
        and isinstance(grad_layout(have)[axis], Replicate)
    )


def deferred_sums(
    laid: LaidOutGraph, params: set[str]
) -> tuple[dict[Edge, set[int]], dict[torch.fx.Node, set[int]]]:
    """Per edge, the axes whose gradient sum is dropped; per parameter placeholder, the axes to sum.

    ``params`` names the parameter and buffer placeholders. The parameters come in graph
    order, so every process lists the same sums in the same order.
    """
    flows = laid.flows
    all_edges = edges(laid)
    uses: dict[torch.fx.Node, list] = {}
    for e, have, need, grad in all_edges:
        uses.setdefault(e[0], []).append((e, have, need, grad))
    candidates = parameter_only(laid.graph, params)
    dropped: dict[Edge, set[int]] = {}
    summed: dict[torch.fx.Node, set[int]] = {}
    for a in range(laid.mesh.ndim):
        # a dict, not a set: graph order, whatever the nodes' hashes (their addresses)
        region = dict.fromkeys(
            v
            for v in candidates
            if flows.get(v, False) and v in laid.layouts and isinstance(laid.layouts[v].output[a], Replicate)
        )

        def sums_here(have: Layout, need: Layout, grad: Layout | None, a: int = a) -> bool:
            return sums_over(have, need, grad, a)

        def passes_on(
            e: Edge, have: Layout, need: Layout, grad: Layout | None, a: int = a, region: dict = region
        ) -> bool:
            return (
                e[1] in region and have[a] == need[a] and grad is not None and grad[a] == grad_layout(have)[a]
            )

        changed = True
        while changed:
            changed = False
            for v in list(region):
                ok = all(sums_here(h, n, g) or passes_on(e, h, n, g) for e, h, n, g in uses.get(v, []))
                # a value in the region takes partial gradients only if all its operands can too
                ok = ok and all(u in region or not flows.get(u, False) for u in v.all_input_nodes)
                if not ok:
                    del region[v]
                    changed = True
        for v in region:
            for e, h, n, g in uses.get(v, []):
                if sums_here(h, n, g):
                    dropped.setdefault(e, set()).add(a)
            if v.op == "placeholder" and any(
                sums_here(h, n, g) or passes_on(e, h, n, g) for e, h, n, g in uses.get(v, [])
            ):
                summed.setdefault(v, set()).add(a)
    return dropped, summed


def planned_edges(
    laid: LaidOutGraph, params: set[str]
) -> tuple[list[PlannedEdge], dict[torch.fx.Node, set[int]]]:
    """Every edge with (have, need, grad_need, grad_have) as it will run, and the parameters' sums.

    ``grad_have`` is the layout the producer's gradient must have; ``grad_need`` the
    gradient the consumer hands back, after dropping the sums :func:`deferred_sums`
    moves to parameters (and equal to ``grad_have`` where no gradient flows).
    """
    dropped, summed = deferred_sums(laid, params)
    out = []
    for e, have, need, grad in edges(laid):
        grad_have = grad_layout(have)
        if grad is None or not laid.flows.get(e[0], False):
            grad = grad_have
        for a in dropped.get(e, ()):
            grad = (*grad[:a], grad_have[a], *grad[a + 1 :])
        out.append((e, have, need, grad, grad_have))
    return out, summed
