"""Views of local pieces: each ``view`` becomes a ``reshape``, unless something writes through it.

A captured ``view`` was valid for the strides one device's tensors had at capture. A rank
computes on pieces whose strides can differ: ``y.transpose(1, 2).contiguous().view(b, t, c)``
after attention records no copy where one device's attention output was already laid out
token-major (``contiguous()`` returned its operand), while a rank given its heads as the
contiguous pieces a redistribution returns gets its attention output head-major, where that
view is impossible. ``reshape`` is the same view
wherever the strides allow one, and a copy where they do not, so it computes the same
numbers on every rank. A view whose storage some op writes in place stays a view: a copy
there would lose the write.

Reads: ``val``. Writes: the targets of ``aten.view.default`` nodes, in the program and in the
submodules export keeps (``torch.no_grad`` regions).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from autopar.ir.meta import storage_ref, written_storages
from autopar.passes.context import PassContext

_VIEW = torch.ops.aten.view.default


def _ops(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """Every op of ``gm`` and of the submodules export keeps (a ``torch.no_grad`` region)."""
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            yield from (node for node in module.graph.nodes if node.op == "call_function")


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    written = written_storages(gm)
    for node in _ops(gm):
        value = node.meta.get("val")
        if node.target is _VIEW and isinstance(value, torch.Tensor) and storage_ref(value) not in written:
            node.target = torch.ops.aten.reshape.default
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule) and module is not gm:
            module.recompile()
    return gm
