"""An op node as rules see it: :class:`OpCall`, its tensor operands and static shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.ir.meta import output_values, per_node, storage_ref


@dataclass(frozen=True)
class OpCall:
    """An op node seen by a rule: its tensor operands and static shapes."""

    node: torch.fx.Node
    operands: tuple[torch.fx.Node, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    out_shapes: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, node: torch.fx.Node) -> OpCall:
        """The call of ``node`` (computed once per node: see :func:`~autopar.ir.meta.per_node`)."""
        return _call_of(node)

    def arg(self, name: str, default: object = None) -> object:
        """The argument called ``name`` in the op's schema (positional or keyword)."""
        schema = getattr(self.node.target, "_schema", None)
        if schema is None:
            return default
        for i, a in enumerate(schema.arguments):
            if a.name == name:
                if i < len(self.node.args) and not a.kwarg_only:
                    return self.node.args[i]
                if name in self.node.kwargs:
                    return self.node.kwargs[name]
                return a.default_value if a.has_default_value() else default
        return default

    def returns_its_operand(self) -> bool:
        """Whether the op hands back its first operand's own memory, forward and backward, and
        computes nothing (its only cost is its dispatch): a view of as many elements (a transpose,
        a reshape that needs no copy, a squeeze: its schema says its result may alias the operand,
        and its fake value shares the operand's storage, as the real one does), or a dropout that
        drops nothing (p 0, or not training: ATen returns the input itself, though the fake value
        is a copy). A view of fewer or more elements (a slice, an expand) is free forward but not
        backward. (An in-place op made functional keeps its fake value, which shares the storage
        it wrote; its schema declares no alias.)"""
        outs = output_values(self.node)
        if not self.operands or len(outs) != 1:
            return False
        source = self.operands[0].meta["val"]
        if self.node.target in _DROPOUTS:
            return self.arg("p") == 0 or self.arg("train") is False
        schema = getattr(self.node.target, "_schema", None)
        alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
        view = alias is not None and not alias.is_write
        same_memory = view and storage_ref(outs[0]) == storage_ref(source)
        return same_memory and outs[0].numel() == source.numel()


_DROPOUTS = (torch.ops.aten.dropout.default,)


@per_node
def _call_of(node: torch.fx.Node) -> OpCall:
    found: list[torch.fx.Node] = []  # every node argument, in order (map_arg is fast)
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    operands = tuple(a for a in found if _is_tensor(a))
    outs = output_values(node)
    return OpCall(
        node,
        operands,
        tuple(shape_of(a) for a in operands),
        tuple(tuple(int(s) for s in v.shape) for v in outs),
    )


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def shape_of(node: torch.fx.Node) -> tuple[int, ...]:
    """Static shape of a tensor-valued node."""
    return tuple(int(s) for s in node.meta["val"].shape)
