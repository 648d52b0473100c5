"""Which storage a value of a captured graph lives in: what views, splits and pass-through ops share.

The memory model (:mod:`autopar.planning.memory.model`) counts each storage once; the recompute
regions (:mod:`autopar.planning.memory.recompute`) and the ``mark_recompute`` pass tell a parameter's
views from values the step allocates.
"""

from __future__ import annotations

import operator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.ir.meta import output_values, per_node, storage_ref


def tensor_value(node: torch.fx.Node, index: int) -> torch.Tensor:
    """Output ``index`` of ``node``'s value (the ``index``-th tensor of its ``val``)."""
    return output_values(node)[index]


def source_of(node: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """The op and output index whose memory a value is: through ``getitem`` of a multi-output
    op (and on to what it splits, where its outputs are views), through views (values sharing
    an operand's storage), and through a dropout that returns its input (``p=0`` or not
    training), which export records as a fresh value."""
    while True:
        if node.op == "call_function" and node.target is operator.getitem:
            op = node.args[0]
            schema = getattr(op.target, "_schema", None)
            if schema is None or not schema.returns or schema.returns[0].alias_info is None:
                return op, node.args[1]
            node = op.args[0]  # the pieces of a split or an unbind: views of what it splits
            continue
        viewed = viewed_operand(node)
        if viewed is None:
            return node, 0
        node = viewed


@per_node
def viewed_operand(node: torch.fx.Node) -> torch.fx.Node | None:
    """The operand ``node`` is a view of (or returns unchanged, or splits into views), if any."""
    if node.op != "call_function":
        return None
    if str(node.target) == "aten.dropout.default":
        p, train = (list(node.args[1:3]) + [node.kwargs.get("p"), node.kwargs.get("train")])[:2]
        if p == 0 or train is False:
            return node.args[0]
    val = node.meta.get("val")
    # a split or an unbind returns views of its operand: pieces sharing one storage
    pieces = list(val) if isinstance(val, (list, tuple)) else [val]
    if not pieces or not all(isinstance(v, torch.Tensor) for v in pieces):
        return None
    storages = {storage_ref(v) for v in pieces}
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if len(storages) == 1 and isinstance(v, torch.Tensor) and storage_ref(v) in storages:
            return a
    return None


def allocates_beside(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an in-place op the capture made out-of-place
    (:mod:`autopar.capture.functionalize`): its fake value shares the storage it wrote, so it reads
    as a view of its operand (one buffer, its operand's, lives on as its output), but the program
    runs the out-of-place op, which allocates its output while the operand is alive: one more
    buffer for the moment of the op. Its schema, unlike a view's, declares no alias."""
    if viewed_operand(node) is None or str(node.target) == "aten.dropout.default":
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and _returned_alias(node) is None


def _returned_alias(node: torch.fx.Node) -> object | None:
    """What the schema of ``node``'s op says its first result aliases (None: nothing, or no schema)."""
    schema = getattr(node.target, "_schema", None)
    return schema.returns[0].alias_info if schema is not None and schema.returns else None


def computes_nothing(node: torch.fx.Node) -> bool:
    """Whether an op hands back its operand's own memory whole, forward and backward, so that its
    only cost is its dispatch: a dropout that returns its input, or a view (:func:`viewed_operand`)
    of as many elements whose schema says its result aliases the operand (a transpose, a reshape
    that needs no copy, a squeeze). A view of fewer or more elements (a slice, an expand) is free
    forward but not backward; an in-place op made functional keeps a fake value sharing the
    storage it wrote, but computes (its schema declares no alias)."""
    viewed = viewed_operand(node)
    if viewed is None or str(node.target) == "aten.dropout.default":
        return viewed is not None
    alias = _returned_alias(node)
    out = node.meta["val"]
    whole = isinstance(out, torch.Tensor) and out.numel() == viewed.meta["val"].numel()
    return alias is not None and not alias.is_write and whole


def storage_of(node: torch.fx.Node, index: int) -> tuple[StorageWeakRef, int]:
    """The storage of output ``index`` of ``node`` (shared by its views) and its global bytes."""
    value = tensor_value(node, index)
    nbytes = value.untyped_storage().nbytes()
    if not isinstance(nbytes, int):
        # export may leave an input's storage size symbolic while its shape is concrete
        nbytes = int(value.numel()) * value.element_size()
    return storage_ref(value), nbytes
