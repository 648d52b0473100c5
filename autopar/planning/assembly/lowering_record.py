"""The plan's record of what lowering applies (:class:`~autopar.ir.plan.Lowering`), computed once.

Entry point: :func:`lowering_record`, on a captured graph and a plan whose node decisions lay it
out. The planner records it on every plan it returns; the compiler records it on a plan that
has none (a format-4 plan, saved before plans held it) before lowering. The passes then apply
the record and derive nothing: the edges the program redistributes on and the ops of each
(:meth:`~autopar.planning.cost.model.CostModel.edge_plan` on the plan's cluster), the gradient
sums left to the runtime's buckets (:func:`~autopar.planning.graph.gradient_sums.planned_edges`)
and the recompute regions (:mod:`autopar.planning.memory.recompute`), as the lowered program
has them: layout constraints, which the compiler drops first, are in no region, and a ZeRO-3
weight read through one is read by the op after it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from autopar.capture.export import Captured, gradient_flow
from autopar.ir.errors import PlanError
from autopar.ir.layout import Layout, format_layout
from autopar.ir.meta import NodeLayouts
from autopar.ir.ops import LAYOUT_CONSTRAINT
from autopar.ir.options import SELECTIVE
from autopar.ir.plan import EdgeLowering, Lowering, LoweringStep, Plan
from autopar.planning.cost.model import Cluster, CostModel
from autopar.planning.graph.gradient_sums import PlannedEdge, planned_edges
from autopar.planning.graph.laid_out import LaidOutGraph
from autopar.planning.graph.storages import source_of
from autopar.planning.memory.recompute import Region, module_regions, zero3_regions
from autopar.rules import OpCall


def lowering_record(captured: Captured, plan: Plan) -> Lowering:
    """What the passes apply to ``captured``'s graph under ``plan``, beyond its nodes' layouts.

    Args:
        captured: the model as captured, not yet lowered (the graph ``plan`` was made for).
        plan: a plan deciding every tensor node of that graph (its mesh is one stage's under a
            pipeline, as the passes lower it).

    Raises:
        PlanError: ``plan`` decides nothing for a tensor node of the graph (another model's).
    """
    graph = captured.graph
    layouts = _plan_layouts(graph, plan)
    mesh = plan.mesh_spec
    laid = LaidOutGraph(graph=graph, layouts=layouts, mesh=mesh, flows=gradient_flow(captured))
    planned, summed = planned_edges(laid, set(captured.params) | set(captured.buffers))
    edges = _edges(planned, CostModel(mesh, Cluster.from_dict(plan.cluster)))
    gradient_sums = {p.name: tuple(mesh.axis_names[a] for a in sorted(axes)) for p, axes in summed.items()}
    regions, gathered = _regions(captured, plan, layouts)
    held = _held(graph, layouts) if regions or gathered else ()
    return Lowering(
        edges=edges,
        gradient_sums=gradient_sums,
        regions={n.name: r for n, r in regions.items()},
        gathered={n.name: r for n, r in gathered.items()},
        held=held,
    )


def _plan_layouts(graph: torch.fx.Graph, plan: Plan) -> dict[torch.fx.Node, NodeLayouts]:
    """Each decided node's layouts, as the ``apply_plan`` pass writes them on the graph."""
    decisions = {d.name: d for d in plan.nodes}
    found = {}
    for node in graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        decision = decisions.get(node.name)
        if decision is None:
            if isinstance(node.meta.get("val"), torch.Tensor):
                raise PlanError(
                    f"the plan decides nothing for node {node.name}; it was made for another model or "
                    "other input shapes: plan again with this model and these example inputs"
                )
            continue
        found[node] = decision.layouts()
    return found


def _edges(planned: list[PlannedEdge], cost: CostModel) -> tuple[EdgeLowering, ...]:
    """The edges whose value or gradient changes layout, with the ops the lowering issues for each."""
    names = cost.mesh.axis_names
    found = []
    for (src, dst, slot), have, need, grad_need, grad_have in planned:
        if have == need and grad_need == grad_have:
            continue
        steps = tuple(
            LoweringStep(
                axis=names[s.axis],
                kind=s.kind.value,
                before=format_layout(s.before),
                after=format_layout(s.after),
                grad=format_layout((s.grad,)),
            )
            for s in cost.edge_plan(have, need, grad_need, grad_have)
        )
        layouts = (format_layout(x) for x in (have, need, grad_need, grad_have))
        found.append(EdgeLowering(src.name, dst.name, slot, *layouts, steps=steps))
    return tuple(found)


def _regions(
    captured: Captured, plan: Plan, layouts: Mapping[torch.fx.Node, NodeLayouts]
) -> tuple[dict[torch.fx.Node, Region], dict[torch.fx.Node, Region]]:
    """The recompute modules' ops (with each ``getitem`` of one) and the ZeRO-3 gathers' regions."""
    memory = plan.memory
    if memory is None or (not memory.recompute and memory.zero != 3):
        return {}, {}
    graph = captured.graph
    modules = module_regions(graph, memory.recompute)
    regions = {}
    for node in graph.nodes:
        if node in modules and str(node.target) != LAYOUT_CONSTRAINT and node in layouts:
            regions[node] = modules[node]
        elif node.target is operator.getitem and node.args[0] in modules:
            regions[node] = modules[node.args[0]]
    gathered = {}
    if memory.zero == 3:
        params = [n for n in graph.find_nodes(op="placeholder") if n.name in captured.params]
        for param in (n for n in params if captured.params[n.name] in memory.zero_splits):
            stored = layouts[param].output
            for reader in zero3_regions([param], layouts, modules):
                reader = _past_constraints(reader, stored, layouts)
                if reader is not None and reader not in modules:
                    gathered.setdefault(reader, (f"zero3:{reader.name}", SELECTIVE))
    return regions, gathered


def _past_constraints(
    reader: torch.fx.Node, stored: Layout, layouts: Mapping[torch.fx.Node, NodeLayouts]
) -> torch.fx.Node | None:
    """The op that reads a gathered weight in the lowered program, where ``reader`` reads it in
    the captured one: past layout constraints (dropped by then), each with one user; None where
    none does (a constraint with several users, or an op reading it as it is stored)."""
    value = None
    while str(reader.target) == LAYOUT_CONSTRAINT:
        if len(reader.users) != 1:
            return None
        value, reader = reader, next(iter(reader.users))
    if value is None:
        return reader
    if reader.op != "call_function" or reader.target is operator.getitem or reader not in layouts:
        return None
    needs = layouts[reader].operands
    slots = [i for i, operand in enumerate(OpCall.of(reader).operands) if operand is value]
    return reader if any(needs[i] is not None and needs[i] != stored for i in slots) else None


def _held(graph: torch.fx.Graph, layouts: Mapping[torch.fx.Node, NodeLayouts]) -> tuple[str, ...]:
    """The ops whose value is a view of a placeholder's storage (Falcon's ``weight.T``): held anyway,
    as the placeholders are."""
    return tuple(
        n.name
        for n in graph.nodes
        if n.op == "call_function"
        and n in layouts
        and str(n.target) != LAYOUT_CONSTRAINT
        and source_of(n)[0].op == "placeholder"
    )
