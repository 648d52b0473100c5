"""Views of local pieces: each ``view`` becomes a ``reshape``, unless something writes through it.

A captured ``view`` was valid for the strides one device's tensors had at capture. A rank
computes on pieces whose strides can differ: ``y.transpose(1, 2).contiguous().view(b, t, c)``
after attention records no copy where one device's attention output was already laid out
token-major (``contiguous()`` returned its operand), while a rank's attention over its own
heads returns them head-major, where that view is impossible. ``reshape`` is the same view
wherever the strides allow one, and a copy where they do not, so it computes the same
numbers on every rank. A view whose storage some op writes in place stays a view: a copy
there would lose the write.

Reads: ``val``. Writes: the targets of ``aten.view.default`` nodes.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.ir.meta import storage_ref
from autopar.passes.context import PassContext

_VIEW = torch.ops.aten.view.default


def _written_storages(graph: torch.fx.Graph) -> set[StorageWeakRef]:
    """The storages of every operand some op of ``graph`` writes in place (by its schema)."""
    written = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            operand = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            value = operand.meta.get("val") if isinstance(operand, torch.fx.Node) else None
            if isinstance(value, torch.Tensor):
                written.add(storage_ref(value))
    return written


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    written = _written_storages(gm.graph)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _VIEW:
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and storage_ref(value) not in written:
            node.target = torch.ops.aten.reshape.default
    return gm
