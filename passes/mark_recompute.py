"""Mark the ops to recompute in backward: the plan's recompute modules and the ZeRO-3 gathers.

The regions are the planner's (:mod:`autopar.planning.memory.recompute`), so the plan predicts
what runs: an op of a module the plan recomputes (``ctx.plan.memory.recompute``,
innermost module first) joins that module's region, and a ``getitem`` its op's; a
collective inserted for a consumer joins its consumer's region. Then an op reading a
ZeRO-3 parameter through a gather outside any region gets a selective region of its own,
``zero3:<op>``: the weight is gathered again in backward instead of kept. A collective
inside a region that redistributes a parameter (or another placeholder, or a view of one) is
marked to run again in backward under either policy: what it reads is held anyway.

Reads: ``ctx.plan.memory``, ``nn_module_stack``, ``autopar.layouts``. Writes:
``autopar.recompute`` (region, policy) and ``autopar.regather`` (see ``apply_recompute``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch

from autopar.ir.meta import RECOMPUTE, REGATHER, GraphLayouts
from autopar.passes.context import PassContext
from autopar.planning.graph.storages import source_of
from autopar.planning.memory.recompute import is_collective, module_regions, zero3_regions


def _gathers(graph: torch.fx.Graph) -> Iterator[tuple[list[torch.fx.Node], torch.fx.Node]]:
    """Each chain of collectives from a placeholder, or a view of one (Falcon's ``weight.T``), to
    the op that uses it, with that op: what the plan's memory counts as read again, not kept."""
    for start in graph.nodes:
        operand = start.args[0] if is_collective(start) else None
        if not isinstance(operand, torch.fx.Node) or is_collective(operand):
            continue
        if source_of(operand)[0].op != "placeholder":
            continue
        chain, node = [], start
        while is_collective(node) and len(node.users) == 1:
            chain.append(node)
            node = next(iter(node.users))
        if chain and not is_collective(node):
            yield chain, node


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    memory = ctx.plan.memory
    if memory is None or (not memory.recompute and memory.zero != 3):
        return gm
    graph = gm.graph
    regions = module_regions(graph, memory.recompute)
    for node in graph.nodes:
        if node in regions:
            node.meta[RECOMPUTE] = regions[node]
        elif node.target is operator.getitem and node.args[0] in regions:
            node.meta[RECOMPUTE] = regions[node.args[0]]
    for node in reversed(graph.nodes):  # users first: a chain's last step sees its consumer's mark
        if is_collective(node) and RECOMPUTE not in node.meta:
            marks = {u.meta.get(RECOMPUTE) for u in node.users}
            if len(marks) == 1 and None not in marks:
                node.meta[RECOMPUTE] = marks.pop()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if memory.zero == 3:
        split = [n for n in placeholders if ctx.captured.params.get(n.name) in memory.zero_splits]
        for node, region in zero3_regions(split, GraphLayouts(graph), regions).items():
            node.meta[RECOMPUTE] = region
    for chain, consumer in _gathers(graph):
        region = consumer.meta.get(RECOMPUTE)
        if region is not None:
            for c in chain:
                c.meta[RECOMPUTE] = region
                c.meta[REGATHER] = True
    return gm
