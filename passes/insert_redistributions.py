"""Insert a redistribution wherever the plan records that a value's layout, or its gradient's, changes.

For every tensor edge producer -> consumer (and every model output) the layouts are:
``have`` (the producer's output), ``need`` (the consumer's operand), ``grad_need`` (the
gradient the consumer hands back) and ``grad_have`` (the gradient layout the
producer's output must receive: ``have`` with Partial read as Replicate). The plan's record
(``ctx.plan.lowering.edges``, :class:`~autopar.ir.plan.EdgeLowering`) names each edge where
``have != need``, or where a gradient flows and ``grad_need != grad_have``, with its layouts and
the ops that lower it; a ``redistribute`` node is inserted on each, in graph order of the
consumers. The record's layouts must be the ones ``apply_plan`` wrote on the graph, and its
steps must lead from ``have`` to ``need`` on the mesh's axes: else a :class:`PlanError` names
the edge.

Gradient sums the plan leaves to the runtime's bucketed reducer (``ctx.plan.lowering.gradient_sums``:
data parallelism, summed once backward reaches the parameters) are recorded as
``ctx.grad_reductions[placeholder] = axis keys`` (see ``collectives.register_mesh``).

Reads: ``ctx.plan.lowering``, ``autopar.layouts``, ``autopar.grads``, ``autopar.stage``. Writes:
``redistribute`` nodes with ``autopar.layouts``, ``autopar.redistribution`` = (have, need,
grad_need, grad_have, the steps as :class:`~autopar.ir.redistribution_steps.EdgeStep`) and, under a
pipeline, their consumer's ``autopar.stage``; ``ctx.grad_reductions``.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from autopar.ir.errors import PlanError
from autopar.ir.layout import Layout, format_layout, grad_layout, parse_layout
from autopar.ir.meta import REDISTRIBUTION, STAGE, GraphLayouts, NodeLayouts, write_layouts
from autopar.ir.plan import EdgeLowering, Lowering
from autopar.ir.redistribution_steps import EdgeStep, StepKind, step_problem
from autopar.passes.context import PassContext

_FOUR = ("have", "need", "grad_need", "grad_have")  # an edge's layouts, in the record's order


def redistribute(x: torch.Tensor, have: str, need: str, grad_need: str, grad_have: str) -> torch.Tensor:
    """Marker for a layout change; ``lower_collectives`` replaces it with collective ops."""
    raise RuntimeError("redistribute() must be lowered to collectives before the graph runs")


def _is_tensor(a: object) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _replace_operand(node: torch.fx.Node, slot: int, new: torch.fx.Node) -> None:
    seen = -1

    def swap(a: object) -> object:
        nonlocal seen
        if _is_tensor(a):
            seen += 1
            if seen == slot:
                return new
        return a

    node.args, node.kwargs = pytree.tree_map(swap, (node.args, node.kwargs))


def _layout(text: str, what: str) -> Layout:
    try:
        return parse_layout(text)
    except ValueError as exc:
        raise PlanError(
            f"the plan's lowering record has {what} {text!r}, which is not a layout: {exc}"
        ) from None


def _steps(edge: EdgeLowering, ctx: PassContext, name: str) -> tuple[EdgeStep, ...]:
    """The record's steps of ``edge`` (called ``name``), checked to lead from its ``have`` to its ``need``."""
    steps, current = [], _layout(edge.have, f"{name}'s have")
    for i, step in enumerate(edge.steps):
        if step.axis not in ctx.mesh.axis_names:
            raise PlanError(
                f"the plan's lowering record has a step on mesh axis {step.axis!r} for {name}, but the "
                f"mesh is {ctx.mesh} (axes {', '.join(ctx.mesh.axis_names)})"
            )
        if step.kind not in tuple(StepKind):
            raise PlanError(
                f"the plan's lowering record has a step {step.kind!r} for {name}; expected one of "
                f"{', '.join(k.value for k in StepKind)}"
            )
        before, after = _layout(step.before, f"{name}'s step {i}"), _layout(step.after, f"{name}'s step {i}")
        grad = _layout(step.grad, f"{name}'s step {i} gradient")
        if before != current or len(after) != len(before) or len(grad) != 1:
            raise PlanError(
                f"the plan's lowering record has step {i} of {name} start from {step.before}, but the value "
                f"is {format_layout(current)} there (steps lead from {edge.have} to {edge.need}, "
                "one layout per mesh axis, the gradient's placement on the step's axis)"
            )
        steps.append(EdgeStep(ctx.mesh.axis_index(step.axis), StepKind(step.kind), before, after, grad[0]))
        current = after
    if format_layout(current) != edge.need:
        raise PlanError(
            f"the plan's lowering record's steps for {name} end at {format_layout(current)}, "
            f"but its consumer needs {edge.need}"
        )
    have, grad_need = _layout(edge.have, f"{name}'s have"), _layout(edge.grad_need, f"{name}'s grad_need")
    if (problem := step_problem(have, current, grad_need, tuple(steps))) is not None:
        raise PlanError(f"the plan's lowering record's steps for {name} cannot run: {problem}")
    return tuple(steps)


def _edge(
    edge: EdgeLowering, nodes: dict[str, torch.fx.Node], layouts: GraphLayouts, ctx: PassContext
) -> tuple[torch.fx.Node, torch.fx.Node, tuple[Layout, ...], tuple[EdgeStep, ...]]:
    """The producer, consumer, layouts and steps of ``edge``, checked against the graph's layouts."""
    name = f"the edge {edge.src} -> {edge.dst} (operand {edge.slot})"
    src, dst = nodes.get(edge.src), nodes.get(edge.dst)
    for node, named in ((src, edge.src), (dst, edge.dst)):
        if node is None or (node.op != "output" and node not in layouts):
            raise PlanError(
                f"the plan's lowering record has {name}, but the graph has no laid-out node {named}"
            )
    operands = [a for a in pytree.tree_leaves((dst.args, dst.kwargs)) if _is_tensor(a)]
    have = layouts[src].output
    needs = [grad_layout(have)] * len(operands) if dst.op == "output" else layouts[dst].operands
    if not 0 <= edge.slot < min(len(operands), len(needs)) or operands[edge.slot] is not src:
        raise PlanError(
            f"the plan's lowering record has {name}, but that operand of {edge.dst} is not {edge.src}"
        )
    need = needs[edge.slot]
    four = tuple(
        _layout(text, f"{name}'s {what}")
        for text, what in zip((edge.have, edge.need, edge.grad_need, edge.grad_have), _FOUR)
    )
    if four[:2] != (have, need) or four[3] != grad_layout(have) or len(four[2]) != len(have):
        raise PlanError(
            f"the plan's lowering record has {name} go from {edge.have} to {edge.need} (its gradient to "
            f"{edge.grad_have}), but the plan lays it out from {format_layout(have)} to {format_layout(need)}"
        )
    return src, dst, four, _steps(edge, ctx, name)


def _grad_reductions(record: Lowering, graph: torch.fx.Graph, ctx: PassContext) -> None:
    """``ctx.grad_reductions`` from the record's gradient sums, each checked against the graph and mesh."""
    placeholders = {n.name for n in graph.nodes if n.op == "placeholder"}
    for name, axes in record.gradient_sums.items():
        if name not in placeholders:
            raise PlanError(
                f"the plan's lowering record sums the gradient of {name}, which is no placeholder of the "
                "graph"
            )
        if not set(axes) <= set(ctx.mesh.axis_names):
            raise PlanError(
                f"the plan's lowering record sums the gradient of {name} over {', '.join(axes)}, but "
                f"the mesh is {ctx.mesh} (axes {', '.join(ctx.mesh.axis_names)})"
            )
        ordered = sorted(axes, key=ctx.mesh.axis_index)
        ctx.grad_reductions[name] = tuple(ctx.axis_keys[a] for a in ordered)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    record = ctx.lowering
    _grad_reductions(record, graph, ctx)
    nodes = {n.name: n for n in graph.nodes}
    position = {n: i for i, n in enumerate(graph.nodes)}
    layouts = GraphLayouts(graph)
    # in the graph's order, whatever the record's: every rank names the inserted nodes alike
    edges = sorted(record.edges, key=lambda e: (position.get(nodes.get(e.dst), -1), e.slot))
    for edge in edges:
        src, node, four, steps = _edge(edge, nodes, layouts, ctx)
        with graph.inserting_before(node):
            r = graph.call_function(redistribute, (src, *(format_layout(x) for x in four)))
        r.meta["val"] = src.meta["val"]
        write_layouts(r, NodeLayouts(operands=(four[0],), outputs=(four[1],)))
        r.meta[REDISTRIBUTION] = (*four, steps)
        if STAGE in node.meta:  # runs in its consumer's pipeline stage, as the plan priced it
            r.meta[STAGE] = node.meta[STAGE]
        _replace_operand(node, edge.slot, r)
    return gm
