"""Check every edge after lowering: the producer's layout is what the consumer expects.

Solver and lowering must agree on every edge; a disagreement fails here, naming the
edge, instead of as a shape error deep in a training step.

Reads: ``autopar.layouts``. Writes: nothing.
"""

from __future__ import annotations

import operator

import torch
from torch.utils import _pytree as pytree

from autopar.ir.errors import CompileError
from autopar.ir.layout import format_layout, grad_layout
from autopar.ir.meta import GraphLayouts
from autopar.passes.context import PassContext


def _tensors(args: object) -> list[torch.fx.Node]:
    return [
        a
        for a in pytree.tree_leaves(args)
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    layouts = GraphLayouts(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "output":
            for src in _tensors(node.args):
                have = layouts[src].output
                if have != grad_layout(have):
                    raise CompileError(
                        f"model output {src.name} is still {format_layout(have)} (a partial sum)"
                    )
            continue
        if node.op != "call_function" or node.target is operator.getitem or node not in layouts:
            continue
        for slot, (src, need) in enumerate(zip(_tensors((node.args, node.kwargs)), layouts[node].operands)):
            if need is None:
                continue
            have = layouts[src].output if src in layouts else None
            if have != need:
                shown = "no layout" if have is None else format_layout(have)
                raise CompileError(
                    f"edge {src.name} -> {node.name} (operand {slot}): the producer gives {shown}, "
                    f"the consumer expects {format_layout(need)}"
                )
    return gm
