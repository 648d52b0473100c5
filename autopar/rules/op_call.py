"""An op node as rules see it: :class:`OpCall`, its tensor operands and static shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.ir.meta import output_values, per_node


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
