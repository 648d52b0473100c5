"""Run the per-rank program once on fake tensors of this rank's pieces, before any step runs.

Every op then meets the operands a rank gives it: this rank's local shapes (uneven and empty
pieces, a ``ManualSplit`` table's padded rows) as the passes before made them, and the strides
the ops and collectives return. An op the plan makes impossible on a rank fails here, at
compile time, as a ``CompileError`` naming the op and the user's module that recorded it,
instead of in the first training step. Fake tensors allocate nothing and communicate nothing.

Reads: ``autopar.layouts`` and ``val`` of the placeholders. Writes: nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.ir.errors import CompileError
from autopar.ir.fake import fake_mode
from autopar.ir.layout import local_shape
from autopar.ir.meta import GraphLayouts, module_path, recorded_at
from autopar.passes.context import PassContext


class _Recording(torch.fx.Interpreter):
    """An interpreter that remembers the node it is running."""

    node: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node = n
        return super().run_node(n)


def _local_inputs(gm: torch.fx.GraphModule, ctx: PassContext) -> list[Any]:
    """A fake tensor of this rank's piece for each tensor placeholder; other values as recorded."""
    layouts = GraphLayouts(gm.graph)
    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            inputs.append(value)
            continue
        shape = tuple(value.shape)
        rows = ctx.plan.manual_rows.get(ctx.captured.params.get(node.name, ""))
        if rows is not None:  # held padded to the largest count, split evenly
            shape = rows.held_shape(shape)
        if node in layouts:
            shape = local_shape(shape, layouts[node].output, ctx.mesh, ctx.coordinates)
        inputs.append(
            torch.empty(shape, dtype=value.dtype, device=ctx.device, requires_grad=value.requires_grad)
        )
    return inputs


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    interpreter = _Recording(gm)
    with fake_mode():
        inputs = _local_inputs(gm, ctx)
        try:
            interpreter.run(*inputs)
        except Exception as e:
            node = interpreter.node
            where = (module_path(node) or "<root>") if node is not None else "<unknown>"
            first_line = str(e).splitlines()[0] if str(e) else ""
            line = recorded_at(node) if node is not None else None
            raise CompileError(
                f"the per-rank program at mesh coordinates {ctx.coordinates} fails at "
                f"{getattr(node, 'name', '?')} = {getattr(node, 'target', '?')}, an op recorded from "
                f"module '{where}'{f' at {line}' if line else ''}: {type(e).__name__}: {first_line} "
                "(a bug of autopar's lowering: please report it with the plan)"
            ) from e
    return gm
