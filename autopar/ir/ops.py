"""The ops autopar gives meaning to in a graph, named once.

* ``autopar::layout_constraint`` (put there at capture by ``shard``/``constrain`` and at
  repeated-block boundaries): :data:`LAYOUT_CONSTRAINT` is its name on graph nodes.
* ``torch.ops.autopar.*`` collectives (:mod:`autopar.runtime.collectives`): :func:`is_autopar_op`.
* Matrix products and attention, whose outputs selective recompute keeps:
  :func:`is_selective_save`, for graph nodes (the composite ops export keeps, such as
  ``linear`` or ``scaled_dot_product_attention``) and for the ops they dispatch to at run
  time (``mm``, the fused attention kernels) alike.
* In-place ops, read off their schemas: :func:`written_operand`.
"""

from __future__ import annotations

import torch

LAYOUT_CONSTRAINT = "autopar.layout_constraint.default"

# aten ops (overload packets) whose outputs the selective policy keeps
SELECTIVE_SAVES = frozenset(
    {
        "linear",
        "matmul",
        "einsum",
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "_cudnn_attention_forward",
    }
)


def is_autopar_op(target: object) -> bool:
    """True for the collectives autopar registers (``torch.ops.autopar.*``)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "autopar"


def is_collective(node: torch.fx.Node) -> bool:
    """One of the ops the passes insert (``torch.ops.autopar.*``: collectives, a lookup's index
    arithmetic), not the layout constraint capture records (dropped before recompute is marked)."""
    return node.op == "call_function" and is_autopar_op(node.target) and str(node.target) != LAYOUT_CONSTRAINT


def is_selective_save(target: object) -> bool:
    """True for an aten matrix product or attention op, overload or packet (:data:`SELECTIVE_SAVES`)."""
    packet = getattr(target, "overloadpacket", target)
    name = getattr(packet, "_qualified_op_name", "")
    namespace, _, op = name.partition("::")
    return namespace == "aten" and op in SELECTIVE_SAVES


def written_operand(node: torch.fx.Node) -> torch.fx.Node | None:
    """The graph value an op node writes in place (its schema marks the argument written), or None.

    A chain of in-place ops (``x.mul_(a).add_(b)``) writes its first value: the result
    of an in-place op is the tensor it wrote.
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if not isinstance(value, torch.fx.Node):
                return None
            return written_operand(value) or value
    return None
