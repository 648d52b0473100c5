"""Graphs print as readable Python, with each value's layout as a comment.

Every stage of autopar can show its graph this way; tests assert on the text.
A node's layouts (:class:`~autopar.ir.meta.NodeLayouts`: operand layouts, output
layouts) come from the caller (a plan being made) or else from the graph's nodes
(``node.meta["autopar.layouts"]``, read through :class:`~autopar.ir.meta.GraphLayouts`),
printed in the short form of :func:`autopar.ir.layout.format_layout`; an operand read
only for its shape (layout ``None``) shows as ``-``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from autopar.ir.layout import format_layout
from autopar.ir.meta import GraphLayouts, NodeLayouts


def _arg(a: object) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a)
    return repr(a)


def op_name(target: object) -> str:
    """``aten.linear`` for ``torch.ops.aten.linear.default``; overloads other than default kept."""
    name = str(target) if not hasattr(target, "__name__") or "." in str(target) else target.__name__
    if isinstance(target, torch._ops.HigherOrderOperator):
        name = target.name()
    return name.removesuffix(".default")


def format_graph(
    graph: torch.fx.Graph, header: str, layouts: Mapping[torch.fx.Node, NodeLayouts] | None = None
) -> str:
    """The graph as a Python function; ``header`` becomes its first comment line.

    ``layouts`` are the nodes' layouts; by default those written on the graph. A
    recompute region (a ``call_module`` of ``passes.apply_recompute``) prints as a
    nested function, called through ``checkpoint`` with its policy.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    body = _body(graph, "    ", GraphLayouts(graph) if layouts is None else layouts)
    lines = [f"# {header}", f"def forward({', '.join(n.name for n in placeholders)}):", *body]
    return "\n".join(lines) + "\n"


def _body(graph: torch.fx.Graph, indent: str, layouts: Mapping[torch.fx.Node, NodeLayouts]) -> list[str]:
    lines = []
    for node in graph.nodes:
        mine = layouts.get(node)
        args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
        if node.op == "placeholder":
            if mine is not None:
                lines.append(f"{indent}# {node.name}: {format_layout(mine.output)}")
        elif node.op == "call_function":
            line = f"{indent}{node.name} = {op_name(node.target)}({', '.join(args)})"
            if mine is not None:
                operands = ", ".join("-" if o is None else format_layout(o) for o in mine.operands)
                outputs = ", ".join(format_layout(o) for o in mine.outputs)
                line += f"  # {operands} -> {outputs}" if operands else f"  # {outputs}"
            lines.append(line)
        elif node.op == "call_module":
            region = graph.owning_module.get_submodule(node.target)
            inner = [n.name for n in region.region.graph.nodes if n.op == "placeholder"]
            lines.append(f"{indent}def {node.target}({', '.join(inner)}):  # recomputed in backward")
            lines += _body(region.region.graph, indent + "    ", GraphLayouts(region.region.graph))
            call = f"checkpoint({node.target}, {', '.join(args)}, policy={region.policy!r})"
            lines.append(f"{indent}{node.name} = {call}")
        elif node.op == "output":
            lines.append(f"{indent}return {_arg(node.args[0])}")
    return lines
