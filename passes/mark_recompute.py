"""Mark the ops to recompute in backward: the plan's recompute regions, and the collectives around them.

The regions are the plan's record (``ctx.plan.lowering``: ``regions``, ``gathered``, ``held``), so
the plan predicts what runs; the planner drew them (:mod:`autopar.planning.memory.recompute`).
In this order: each op the record names in a recompute module's region joins it (a ``getitem``
too), and so does an op a pass inserted beside an op of that module (it carries the module's
stack: a split mean's rescaling, a lookup's mask); a collective inserted for a consumer joins its
consumer's region; then each op the record names as reading a ZeRO-3 weight gathered gets its
selective region ``zero3:<op>``. A chain of collectives from a placeholder, or an op the
record names as held (a view of one), into an op of a region is marked to run again in backward
under either policy: what it reads is held anyway. A record naming a node the graph lacks, or a
policy autopar does not know, is a :class:`PlanError`.

Reads: ``ctx.plan.lowering``, ``nn_module_stack``. Writes: ``autopar.recompute`` (region, policy)
and ``autopar.regather`` (see ``apply_recompute``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from autopar.ir.errors import PlanError
from autopar.ir.meta import RECOMPUTE, REGATHER, module_stack
from autopar.ir.ops import is_collective
from autopar.ir.options import POLICIES
from autopar.passes.context import PassContext

Region = tuple[str, str]  # (name, policy)


def _gathers(
    graph: torch.fx.Graph, held: set[torch.fx.Node]
) -> Iterator[tuple[list[torch.fx.Node], torch.fx.Node]]:
    """Each chain of collectives from a placeholder or a ``held`` view of one to the op that uses
    it, with that op: what the plan's memory counts as read again, not kept."""
    for start in graph.nodes:
        operand = start.args[0] if is_collective(start) else None
        if not isinstance(operand, torch.fx.Node) or (operand.op != "placeholder" and operand not in held):
            continue
        chain, node = [], start
        while is_collective(node) and len(node.users) == 1:
            chain.append(node)
            node = next(iter(node.users))
        if chain and not is_collective(node):
            yield chain, node


def _named(record: Mapping[str, Region], nodes: Mapping[str, torch.fx.Node], what: str) -> dict:
    """``record``'s regions by node, checked: every node in the graph, every policy known."""
    found = {}
    for name, region in record.items():
        if name not in nodes:
            raise PlanError(
                f"the plan's lowering record puts node {name} in {what} {region[0]}, but the graph "
                f"has no {name}"
            )
        if region[1] not in POLICIES:
            raise PlanError(
                f"the plan's lowering record gives region {region[0]} policy {region[1]!r}; expected one of "
                f"{', '.join(POLICIES)}"
            )
        found[nodes[name]] = tuple(region)
    return found


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    record = ctx.lowering
    if not record.regions and not record.gathered:
        return gm
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    regions = _named(record.regions, nodes, "region")
    gathered = _named(record.gathered, nodes, "region")
    missing = [name for name in record.held if name not in nodes]
    if missing:
        raise PlanError(
            f"the plan's lowering record holds node {missing[0]}, but the graph has no {missing[0]}"
        )
    decided = {d.name for d in ctx.plan.nodes}
    # a node a pass placed beside an op carries its module stack: the region of that module's ops
    by_stack = {tuple(module_stack(n)): r for n, r in regions.items() if r[0] in module_stack(n)}
    for node in graph.nodes:
        if node in regions:
            node.meta[RECOMPUTE] = regions[node]
        elif node.op == "call_function" and node.name not in decided and not is_collective(node):
            if (region := by_stack.get(tuple(module_stack(node)))) is not None:
                node.meta[RECOMPUTE] = region
    for node in reversed(graph.nodes):  # users first: a chain's last step sees its consumer's mark
        if is_collective(node) and RECOMPUTE not in node.meta:
            marks = {u.meta.get(RECOMPUTE) for u in node.users}
            if len(marks) == 1 and None not in marks:
                node.meta[RECOMPUTE] = marks.pop()
    for node, region in gathered.items():
        node.meta[RECOMPUTE] = region
    for chain, consumer in _gathers(graph, {nodes[name] for name in record.held}):
        region = consumer.meta.get(RECOMPUTE)
        if region is not None:
            for c in chain:
                c.meta[RECOMPUTE] = region
                c.meta[REGATHER] = True
    return gm
