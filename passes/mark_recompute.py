"""Mark the ops to recompute in backward: the plan's recompute modules and the ZeRO-3 gathers.

An op of a module the plan recomputes (``ctx.plan.memory.recompute``, innermost module
first) joins that module's region; a collective inserted for a consumer joins its
consumer's region. An op reading a ZeRO-3 parameter through a gather outside any region
gets a selective region of its own, ``zero3:<op>``, holding the gather: the weight is
gathered again in backward instead of kept (the planner's ``recompute_regions`` names
the same regions, so the plan predicts what runs). A collective inside a region that
redistributes a parameter (or another placeholder) is marked to run again in backward
under either policy: what it reads is held anyway.

Reads: ``ctx.plan.memory``, ``nn_module_stack``. Writes: ``autopar.recompute`` (region,
policy) and ``autopar.regather`` (see ``apply_recompute``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from autopar.passes.context import PassContext

from autopar.ir.meta import RECOMPUTE, REGATHER
from autopar.ir.ops import is_autopar_op
from autopar.ir.options import SELECTIVE
from autopar.planning.memory import region_of


def _collective(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and is_autopar_op(node.target)


def _gathers(placeholder: torch.fx.Node) -> Iterator[tuple[list[torch.fx.Node], torch.fx.Node]]:
    """Each chain of collectives from ``placeholder`` to the op that uses it, with that op."""
    for user in placeholder.users:
        chain, node = [], user
        while _collective(node) and len(node.users) == 1:
            chain.append(node)
            node = next(iter(node.users))
        if chain and not _collective(node):
            yield chain, node


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    memory = ctx.plan.memory
    if memory is None or (not memory.recompute and memory.zero != 3):
        return gm
    graph = gm.graph
    for node in graph.nodes:
        if node.op == "call_function" and not _collective(node):
            region = region_of(node, memory.recompute)
            if region is not None:
                node.meta[RECOMPUTE] = region
    for node in reversed(graph.nodes):  # users first: a chain's last step sees its consumer's mark
        if _collective(node) and RECOMPUTE not in node.meta:
            marks = {u.meta.get(RECOMPUTE) for u in node.users}
            if len(marks) == 1 and None not in marks:
                node.meta[RECOMPUTE] = marks.pop()
    split = {name for name, fqn in ctx.captured.params.items() if fqn in memory.zero_splits}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        for chain, consumer in _gathers(node):
            region = consumer.meta.get(RECOMPUTE)
            if region is None and memory.zero == 3 and node.name in split:
                region = consumer.meta[RECOMPUTE] = (f"zero3:{consumer.name}", SELECTIVE)
            if region is not None:
                for c in chain:
                    c.meta[RECOMPUTE] = region
                    c.meta[REGATHER] = True
    return gm
