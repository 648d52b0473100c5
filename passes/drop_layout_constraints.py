"""Remove ``layout_constraint`` nodes: once layouts are planned and redistributions
inserted, a constraint is an identity (its operand already has the pinned layout).

Reads: nothing. Writes: nothing (consumers read the constraint's operand directly).
"""

from __future__ import annotations

import torch

from autopar.ir.ops import LAYOUT_CONSTRAINT
from autopar.passes.context import PassContext


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and str(node.target) == LAYOUT_CONSTRAINT:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return gm
