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
parameters to sum instead. The planner uses it to predict the bytes, the
``insert_redistributions`` pass to place the collectives, so both agree.

Reads ``node.meta["autopar.layouts"]`` and ``node.meta["autopar.grads"]``.
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Partial, Replicate
from torch.utils import _pytree as pytree

from autopar.ir.layout import Layout, grad_layout
from autopar.ir.meta import GRADS, LAYOUTS

Edge = tuple[torch.fx.Node, torch.fx.Node, int]  # (producer, consumer, operand slot)


def _tensor(a: object) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def edges(graph: torch.fx.Graph) -> list[tuple[Edge, Layout, Layout, Layout | None]]:
    """Every tensor edge with (have, need, grad_need); model outputs need their Partial axes reduced."""
    found = []
    for node in graph.nodes:
        if node.op == "output":
            for slot, src in enumerate(a for a in pytree.tree_leaves(node.args) if _tensor(a)):
                need = grad_layout(src.meta[LAYOUTS][1][0])
                found.append(((src, node, slot), src.meta[LAYOUTS][1][0], need, need))
        elif node.op == "call_function" and LAYOUTS in node.meta and node.target is not operator.getitem:
            operands = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if _tensor(a)]
            for slot, (src, need, grad) in enumerate(zip(operands, node.meta[LAYOUTS][0], node.meta[GRADS])):
                if need is not None:
                    found.append(((src, node, slot), src.meta[LAYOUTS][1][0], need, grad))
    return found


def _parameter_only(graph: torch.fx.Graph, params: set[str]) -> set[torch.fx.Node]:
    """Values computed from parameters, buffers and constants alone (no user input)."""
    only: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in params:
                only.add(node)
        elif node.op == "get_attr" or (
            node.op == "call_function" and all(a in only for a in node.all_input_nodes)
        ):
            only.add(node)
    return only


def deferred_sums(
    graph: torch.fx.Graph, params: set[str], flows: dict[torch.fx.Node, bool], ndim: int
) -> tuple[dict[Edge, set[int]], dict[torch.fx.Node, set[int]]]:
    """Per edge, the axes whose gradient sum is dropped; per parameter placeholder, the axes to sum.

    ``params`` names the parameter and buffer placeholders; ``flows`` says which nodes
    carry a gradient.
    """
    all_edges = edges(graph)
    uses: dict[torch.fx.Node, list] = {}
    for e, have, need, grad in all_edges:
        uses.setdefault(e[0], []).append((e, have, need, grad))
    candidates = _parameter_only(graph, params)
    dropped: dict[Edge, set[int]] = {}
    summed: dict[torch.fx.Node, set[int]] = {}
    for a in range(ndim):
        region = {
            v
            for v in candidates
            if flows.get(v, False) and LAYOUTS in v.meta and isinstance(v.meta[LAYOUTS][1][0][a], Replicate)
        }

        def sums_here(have: Layout, need: Layout, grad: Layout | None, a: int = a) -> bool:
            return (
                grad is not None
                and have[a] == need[a]
                and isinstance(grad[a], Partial)
                and isinstance(grad_layout(have)[a], Replicate)
            )

        def passes_on(
            e: Edge, have: Layout, need: Layout, grad: Layout | None, a: int = a, region: set = region
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
                    region.discard(v)
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
    graph: torch.fx.Graph, params: set[str], flows: dict[torch.fx.Node, bool], ndim: int
) -> tuple[list[tuple[Edge, Layout, Layout, Layout, Layout]], dict[torch.fx.Node, set[int]]]:
    """Every edge with (have, need, grad_need, grad_have) as it will run, and the parameters' sums.

    ``grad_have`` is the layout the producer's gradient must have; ``grad_need`` the
    gradient the consumer hands back, after dropping the sums :func:`deferred_sums`
    moves to parameters (and equal to ``grad_have`` where no gradient flows).
    """
    dropped, summed = deferred_sums(graph, params, flows, ndim)
    out = []
    for e, have, need, grad in edges(graph):
        grad_have = grad_layout(have)
        if grad is None or not flows.get(e[0], False):
            grad = grad_have
        for a in dropped.get(e, ()):
            grad = (*grad[:a], grad_have[a], *grad[a + 1 :])
        out.append((e, have, need, grad, grad_have))
    return out, summed
