"""From the solver's assignment to a :class:`~autopar.ir.plan.Plan`: decisions, collectives, predictions.

The plan lists what the compiled program will run: every node's layouts, every
redistribution exactly as the passes insert it (the same edges and gradient sums,
:func:`~autopar.planning.graph.gradient_sums.planned_edges`), the ZeRO splits and recompute
regions of its memory choice (:mod:`autopar.planning.memory.recompute`), and the predicted
step: compute, communication and memory per device (:mod:`autopar.planning.memory.model`),
and under a pipeline its stages (:mod:`autopar.planning.pipeline.stage_plan`). Everything is
computed from the strategy graph and the assignment; the captured graph is only read.

In two steps: :func:`evaluate_plan` computes what the searches compare and fit candidates by
(the decisions, collectives, predictions, memory and stages), for every solve;
:func:`record_plan` writes the report (the program as text, named layouts, axis roles,
alternatives, warnings, the annotations and inputs planned for), once, for the plan returned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from autopar.ir.layout import Layout, format_layout, parse_layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import NodeLayouts, module_path
from autopar.ir.ops import is_selective_save
from autopar.ir.options import SELECTIVE, Memory, Pipeline, uses_policy
from autopar.ir.plan import (
    Alternative,
    ChoiceKind,
    CollectiveKind,
    CollectiveStep,
    MemoryPlan,
    NodeDecision,
    PipelinePlan,
    Plan,
    Prediction,
    Redistribution,
    SolverReport,
)
from autopar.ir.printing import format_graph
from autopar.ir.report import GRADIENT_SUM
from autopar.planning.assembly.axis_roles import axis_roles
from autopar.planning.assembly.named_layouts import named_layouts
from autopar.planning.assembly.plan_fit import annotation_record, input_shapes
from autopar.planning.cost.model import Cluster, Collective, CostModel
from autopar.planning.cost.step_overheads import (
    GradSum,
    RecomputeWork,
    StepTerms,
    gradient_seconds,
    program_ops,
    step_terms,
    update_seconds,
    whole_step,
)
from autopar.planning.graph.gradient_sums import PlannedEdge, planned_edges
from autopar.planning.graph.laid_out import LaidOutGraph
from autopar.planning.graph.strategy_graph import StrategyGraph
from autopar.planning.memory.held_state import (
    HeldState,
    Split,
    held_state,
    state_names,
    stored_split,
    zero_splits,
)
from autopar.planning.memory.model import (
    ActivationMemory,
    MemoryChoice,
    activation_memory,
    local_bytes,
)
from autopar.planning.memory.recompute import Region, communicates_again, recompute_regions, rerun_ops
from autopar.planning.memory.saved_tensors import saved_by
from autopar.planning.pipeline.stage_nodes import check_stage_memory
from autopar.planning.pipeline.stage_plan import PipelineInputs, plan_pipeline
from autopar.rules import OpCall


@dataclass(frozen=True, kw_only=True)
class PlanSetting:
    """What plans are assembled under, besides the solver's assignment and the memory choice.

    ``mesh`` is the whole mesh (the graph's is one stage's under a ``pipeline``);
    ``budget`` the bytes per device the plan is asked to fit (recorded in the plan, and
    the bound on each pipeline stage), None when the plan is not asked to fit; ``accumulation``
    the microbatches a step accumulates without a pipeline (the graph is one microbatch's).
    """

    graph: StrategyGraph
    cluster: Cluster
    memory: Memory
    mesh: MeshSpec
    pipeline: Pipeline | None = None
    budget: float | None = None
    accumulation: int = 1


@dataclass(frozen=True, kw_only=True)
class Evaluated:
    """A solved assignment evaluated under a memory choice: what the searches compare and fit by.

    ``plan`` holds the decisions, collectives, predictions, memory and pipeline stages but not
    the report :func:`record_plan` writes (its ``code`` is empty); ``graph`` is the strategy
    graph it was evaluated on (its split parameters stored split under ZeRO-3) and ``layouts``
    every node's layouts there.
    """

    plan: Plan
    choice: MemoryChoice
    assignment: Mapping[str, int]
    graph: StrategyGraph
    layouts: Mapping[torch.fx.Node, NodeLayouts]


def evaluate_plan(
    setting: PlanSetting, choice: MemoryChoice, assignment: Mapping[str, int], report: SolverReport
) -> Evaluated:
    """Evaluate the solver's ``assignment``: its decisions, collectives, predicted step and exact memory.

    Args:
        setting: what the plan is evaluated under (the graph, cluster, memory options, mesh,
            pipeline and budget).
        choice: the memory choice: its ZeRO stage (ZeRO-3 stores each split parameter split, so
            the consumers gather it) and its recompute.
        assignment: the strategy per root the solver picked.
        report: the solve's report, recorded in the plan.

    Raises:
        PipelineFitError: under a pipeline with a budget, where no split into stages holds it.
    """
    g = setting.graph
    splits = zero_splits(g, assignment, setting.memory) if choice.zero else {}
    if choice.zero == 3:
        g = stored_split(g, assignment, splits)
    graph = g.captured.graph
    layouts = g.layouts(assignment)
    laid = LaidOutGraph(graph=graph, layouts=layouts, mesh=g.mesh, flows=g.requires_grad)
    regions = recompute_regions(graph, choice.recompute, layouts, splits if choice.zero == 3 else ())
    state = held_state(g, assignment, splits, choice.zero, setting.memory)
    planned, summed = planned_edges(laid, state_names(g))
    acts = activation_memory(laid, regions, setting.memory.offload_activations, _edge_copies(g, planned))
    if setting.pipeline is not None and setting.budget is not None:
        # refuse a plan no stage split can hold before its costs and program are assembled
        memory = (state.held, acts.by_node)
        check_stage_memory(g.captured, setting.pipeline, setting.mesh, setting.budget, *memory)
    nodes = _decisions(g, assignment)
    redists = _edge_redistributions(g, planned, regions, rerun_ops(graph, regions, g.requires_grad))
    sums, grad_sums = _gradient_sums(
        g, assignment, summed, splits if choice.zero in (1, 2) else {}, choice.zero
    )
    recomputed = _recomputed(g, assignment, regions)
    work = _recompute_work(g, graph, recomputed, regions, redists)
    ops = program_ops(graph, g.requires_grad, {d.name: d.compute_s for d in nodes}, recomputed, redists, work)
    updates = {p: update_seconds(u, setting.cluster, setting.memory) for p, u in state.updates.items()}
    m = setting.accumulation  # 1 under a pipeline, whose stages are priced per microbatch
    passes = setting.pipeline.microbatches if setting.pipeline is not None else m
    gradients = {
        p: gradient_seconds(leaf, passes, p in grad_sums, setting.cluster) for p, leaf in state.leaves.items()
    }
    terms = step_terms(ops, updates, grad_sums, setting.cluster, gradients)
    extras = whole_step(terms, m)
    # each accumulated microbatch runs the ops and their layout changes; the gradient sums run once
    compute = m * (sum(d.compute_s for d in nodes) + sum(recomputed.values()))
    comm = sum((r.seconds for r in sums), m * sum(r.seconds for r in redists)) + extras.latency_s
    moved = m * _bytes(redists) + _bytes(sums)
    redists += sums
    stored = _stored_split(g, state, redists, splits)
    prediction = Prediction(
        step_time_s=compute + comm + extras.added_s,
        compute_s=compute,
        comm_s=comm,
        comm_bytes=int(moved),
        param_bytes=int(sum(b[0] for b in state.held.values())),
        grad_bytes=int(sum(b[1] for b in state.held.values())),
        optimizer_bytes=int(sum(b[2] for b in state.held.values())),
        activation_bytes=int(acts.peak),
        overhead_s=extras.overhead_s,
        optimizer_s=extras.optimizer_s,
        wait_s=extras.wait_s,
        hidden_comm_s=extras.hidden_s,
        hidden_launch_s=extras.hidden_launch_s,
    )
    result = Plan(
        mesh=g.mesh.to_dict(),
        cluster=setting.cluster.to_dict(),
        nodes=nodes,
        redistributions=redists,
        parameters=state.layouts,
        inputs={n.name: format_layout(layouts[n].output) for n in g.choices if n.name in g.captured.inputs},
        prediction=prediction,
        solver=report,
        code="",
        memory=_memory_plan(setting, choice, splits, acts, state, stored),
        accumulation=m,
    )
    if setting.pipeline is not None:
        inputs = _pipeline_inputs(setting, g, layouts, acts, state, terms)
        result.pipeline, result.prediction = plan_pipeline(result, inputs)  # a whole step under it
        result.memory = replace(  # what the pipeline rank holding most holds
            result.memory,
            host_optimizer_bytes=int(_on_rank({n: b[3] for n, b in state.held.items()}, result.pipeline)),
            stored_split_bytes=int(_on_rank(stored[1], result.pipeline)),
        )
    return Evaluated(plan=result, choice=choice, assignment=assignment, graph=g, layouts=layouts)


def record_plan(
    setting: PlanSetting,
    evaluated: Evaluated,
    costs: tuple[Mapping[str, np.ndarray], Mapping[tuple[str, str], np.ndarray]] | None = None,
) -> Plan:
    """The :class:`Plan` of ``evaluated`` with its report: the program as text, named layouts, axis
    roles, warnings of ops without a rule, the annotations, inputs and precision planned for, and
    with ``costs`` every variable's alternatives.

    Args:
        setting: what ``evaluated`` was evaluated under.
        evaluated: the plan to record, from :func:`evaluate_plan`.
        costs: the node and pair costs of the ILP solved for it, which price the alternatives
            (:func:`alternatives`); None: the plan lists none (a plan of least memory).
    """
    g, layouts, plan = evaluated.graph, evaluated.layouts, evaluated.plan
    graph, captured = g.captured.graph, g.captured
    return replace(
        plan,
        code=format_graph(
            graph, f"Constructed by autopar.plan on mesh {g.mesh} ({setting.cluster.name})", layouts
        ),
        warnings=_warnings(g),
        alternatives={} if costs is None else alternatives(setting.graph, *costs, evaluated.assignment),
        named_layouts=named_layouts(captured, layouts, g.mesh),
        manual_rows=dict(captured.annotations.parameter_rows),
        annotations=annotation_record(captured),
        input_shapes=input_shapes(captured),
        precision=captured.precision.to_dict() if captured.precision else None,
        axis_roles=axis_roles(graph, plan.nodes, g.mesh),
        parameter_nodes=dict(captured.params),
    )


def _decisions(g: StrategyGraph, assignment: Mapping[str, int]) -> list[NodeDecision]:
    """Every node's strategy, as the plan records it."""
    decisions = []
    for node, c in g.choices.items():
        if c.kind == ChoiceKind.OUTPUT:
            continue
        s = g.strategy(node, assignment)
        op = node.op == "call_function"
        decisions.append(
            NodeDecision(
                name=node.name,
                op=str(node.target) if op else node.op,
                module=module_path(node),
                kind=c.kind,
                operands=tuple(None if o is None else format_layout(o) for o in s.operands),
                outputs=tuple(format_layout(o) for o in s.outputs),
                grads=tuple(None if o is None else format_layout(o) for o in s.grads),
                compute_s=g.compute_seconds(node, assignment),
                choice=c.root,
                args=tuple(a.name for a in OpCall.of(node).operands) if op else (),
            )
        )
    return decisions


def _bytes(redists: Iterable[Redistribution]) -> float:
    """The bytes ``redists`` move, forward and backward."""
    return sum(c.bytes for r in redists for c in (*r.forward, *r.backward))


def _steps(g: StrategyGraph, collectives: Iterable[Collective]) -> tuple[CollectiveStep, ...]:
    return tuple(
        CollectiveStep(kind=c.kind, mesh_axes=c.mesh_axes, bytes=c.bytes, seconds=g.cost.collective_time(c))
        for c in collectives
    )


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(int(x) for x in node.meta["val"].shape)


def _edge_redistributions(
    g: StrategyGraph,
    planned: Iterable[PlannedEdge],
    regions: Mapping[torch.fx.Node, Region],
    rerun: set[torch.fx.Node],
) -> list[Redistribution]:
    """The collectives exactly as the compiled program will issue them (same edges, same sums); the
    forward ones again in backward where a recompute region runs them again (``rerun``: the ops
    of ``full-comm`` regions backward recomputes; see
    :func:`~autopar.planning.memory.recompute.communicates_again`)."""
    state = state_names(g)
    found = []
    for (src, dst, slot), have, need, grad_need, grad_have in planned:
        if have == need and grad_need == grad_have:
            continue
        shape, itemsize = _shape(src), src.meta["val"].element_size()
        fwd, t_fwd = g.cost.redistribute(have, need, shape, itemsize)
        bwd, t_bwd = g.cost.backward(have, need, grad_need, grad_have, shape, itemsize)
        if communicates_again(dst, src.name in state, regions, rerun):
            bwd, t_bwd = [*fwd, *bwd], t_bwd + t_fwd
        found.append(
            Redistribution(
                src=src.name,
                dst=dst.name,
                slot=slot,
                module=module_path(dst),
                shape=shape,
                have=format_layout(have),
                need=format_layout(need),
                forward=_steps(g, fwd),
                backward=_steps(g, bwd),
                seconds=t_fwd + t_bwd,
            )
        )
    return found


def _edge_copies(
    g: StrategyGraph, planned: Iterable[PlannedEdge]
) -> dict[tuple[str, int], tuple[Layout, ...]]:
    """Per edge (consumer, operand slot), the layouts of its collectives' outputs besides the one
    the consumer reads in a layout of its own (what a recompute region keeps of them too): every
    step's output but the last, and the last as well where the value keeps its layout (a
    ``grad_all_reduce``'s copy, changing only the gradient)."""
    copies = {}
    for (_, dst, slot), have, need, grad_need, grad_have in planned:
        made = [step.after for step in g.cost.edge_plan(have, need, grad_need, grad_have)]
        made = made if have == need else made[:-1]
        if made:
            copies[(dst.name, slot)] = tuple(made)
    return copies


def _gradient_sums(
    g: StrategyGraph,
    assignment: Mapping[str, int],
    summed: Mapping[torch.fx.Node, set[int]],
    splits: Mapping[torch.fx.Node, Split],
    zero: int,
) -> tuple[list[Redistribution], dict[str, GradSum]]:
    """Each parameter's gradient sum over ``summed`` axes, and how the runtime buckets it; with a
    ZeRO-1/2 split (``splits``), ZeRO-2 reduce-scatters along the split axis and the updated
    shards are all-gathered after the optimizer step.

    A sum's redistribution is priced at bandwidth only: its latency is paid once per bucket
    (:func:`~autopar.planning.cost.step_overheads.bucket_times`). The gathers run one per shard, each
    paying its latency.
    """
    found, grad_sums = [], {}
    position = {node: i for i, node in enumerate(g.captured.graph.nodes)}
    for node, axes in summed.items():
        layout = g.strategy(node, assignment).outputs[0]
        size = int(local_bytes(node, layout, g.mesh))  # the parameter's bytes
        grad_bytes = size * g.grad_sum_itemsize(node) // node.meta["val"].element_size()  # its gradient's
        split = splits.get(node)
        scattered = CollectiveKind.REDUCE_SCATTER if zero == 2 else CollectiveKind.ALL_REDUCE
        sums = [
            Collective(
                scattered if split and a == split[0] else CollectiveKind.ALL_REDUCE,
                (g.mesh.axis_names[a],),
                grad_bytes,
            )
            for a in sorted(axes, key=lambda a: split is not None and a == split[0])
        ]
        gathers = []
        if split is not None:  # the updated shards, gathered after the optimizer step
            n = g.mesh.axis_sizes[split[0]]
            gathers.append(Collective(CollectiveKind.ALL_GATHER, (g.mesh.axis_names[split[0]],), size // n))
        wire = sum(g.cost.collective_time(c, latency=False) for c in sums)
        found.append(
            Redistribution(
                src=node.name,
                dst=GRADIENT_SUM,
                slot=0,
                module="",
                shape=_shape(node),
                have=format_layout(layout),
                need=format_layout(layout),
                forward=(),
                backward=_steps(g, [*sums, *gathers]),
                seconds=wire + sum(g.cost.collective_time(c) for c in gathers),
            )
        )
        grad_sums[node.name] = GradSum(
            param=node.name,
            group=(tuple(sorted(axes)), split[0] if split and zero == 2 else None),
            leaf_bytes=size,
            wire_s=wire,
            latency_s=sum(g.cost.collective_time(replace(c, bytes=0)) for c in sums),
            first_use=min(node.users, key=position.__getitem__).name,
        )
    return found, grad_sums


def _recomputed(
    g: StrategyGraph, assignment: Mapping[str, int], regions: Mapping[torch.fx.Node, Region]
) -> dict[str, float]:
    """The ops run again in backward, with the seconds that takes: a third of forward + backward of
    each recomputed op that carries a gradient (under the selective policy, but matrix products
    and attention)."""
    return {
        node.name: g.compute_seconds(node, assignment) / 3.0
        for node, (_, policy) in regions.items()
        if (c := g.choices.get(node)) is not None
        and c.compute is not None
        and g.requires_grad.get(node)
        and (policy != SELECTIVE or not is_selective_save(node.target))
    }


def _recompute_work(
    g: StrategyGraph,
    graph: torch.fx.Graph,
    recomputed: Mapping[str, float],
    regions: Mapping[torch.fx.Node, Region],
    redists: Iterable[Redistribution],
) -> dict[str, RecomputeWork]:
    """Each recomputed op's checkpoint work: one unit for the op and one per tensor autograd saves
    for it, which the checkpoint's hooks pack in forward and unpack in backward; under the
    selective checkpoint's policy where its region is selective or a redistribution runs into it
    (its collectives join the region: ``autopar.passes.mark_recompute``)."""
    into = {r.dst for r in redists}
    with_ops = {region for node, (region, _) in regions.items() if node.name in into}
    work = {}
    for n in graph.nodes:
        if n.name in recomputed:
            region, policy = regions[n]
            saved = saved_by(n, [bool(g.requires_grad.get(a)) for a in OpCall.of(n).operands])
            work[n.name] = RecomputeWork(1 + saved.packed, uses_policy(policy, region in with_ops))
    return work


def _warnings(g: StrategyGraph) -> list[str]:
    """One warning per op without a sharding rule, per module it runs in."""
    return [
        f"no sharding rule for {op} in module '{path or '<root>'}': replicated"
        for op, path in dict.fromkeys(g.fallbacks)
    ]


def _memory_plan(
    setting: PlanSetting,
    choice: MemoryChoice,
    splits: Mapping[torch.fx.Node, Split],
    acts: ActivationMemory,
    state: HeldState,
    stored_split: tuple[dict[str, tuple[str, ...]], dict[str, float]],
) -> MemoryPlan:
    memory, g = setting.memory, setting.graph
    stored, saved = stored_split
    return MemoryPlan(
        zero=choice.zero,
        zero_threshold=memory.zero_threshold,
        optimizer_states=memory.optimizer_states,
        offload_optimizer=memory.offload_optimizer,
        offload_activations=memory.offload_activations,
        zero_splits={
            g.captured.params[node.name]: (g.mesh.axis_names[a], d) for node, (a, d) in splits.items()
        },
        recompute=dict(choice.recompute),
        budget=None if setting.budget is None else int(setting.budget),
        chosen=False,
        activation_kept_bytes=int(acts.kept),
        host_optimizer_bytes=int(sum(b[3] for b in state.held.values())),
        host_activation_bytes=int(acts.by_autograd if memory.offload_activations else 0.0),
        stored_split=stored,
        stored_split_bytes=int(sum(saved.values())),
    )


def _stored_split(
    g: StrategyGraph,
    state: HeldState,
    redists: Iterable[Redistribution],
    splits: Mapping[torch.fx.Node, Split],
) -> tuple[dict[str, tuple[str, ...]], dict[str, float]]:
    """FSDP-style storage the solver chose (not ZeRO's ``splits``): each parameter whose layout
    stores it split over mesh axes that every use gathers it over (from it, or from its cast to the
    compute dtype; a use reading it split makes it tensor-parallel, not stored split), with those
    axes; and per parameter (by node) the bytes per rank this saves against storing it whole over
    them: its state (itself, its gradient, its optimizer state) times the pieces less one."""
    cast = torch.ops.aten._to_copy.default
    gathered: dict[tuple[str, str], set[str]] = {}  # (producer, consumer) -> axes gathered over
    for r in redists:
        steps = [step for step in r.forward if step.kind == CollectiveKind.ALL_GATHER]
        gathered.setdefault((r.src, r.dst), set()).update(a for step in steps for a in step.mesh_axes)
    stored: dict[str, tuple[str, ...]] = {}
    saved: dict[str, float] = {}
    for node, fqn in ((n, g.captured.params[n.name]) for n in g.choices if n.name in g.captured.params):
        # its uses, through its casts to the compute dtype (MixedPrecision)
        uses = [(src, u) for src in (node, *(u for u in node.users if u.target is cast)) for u in src.users]
        uses = [(src.name, u.name) for src, u in uses if u.target is not cast]
        axes = set.intersection(*(gathered.get(use, set()) for use in uses)) if uses else set()
        placements = parse_layout(state.layouts[fqn])
        split = tuple(a for a, p in zip(g.mesh.axis_names, placements) if p.is_shard() and a in axes)
        if split and node not in splits:
            stored[fqn] = split
            pieces = math.prod(g.mesh.axis_sizes[g.mesh.axis_index(a)] for a in split)
            saved[node.name] = sum(state.held[node.name][:3]) * (pieces - 1)
    return stored, saved


def _on_rank(per_node: Mapping[str, float], pipeline: PipelinePlan) -> float:
    """The sum of ``per_node`` over the nodes of the pipeline rank holding most (its stages')."""
    stages, rank = pipeline.node_stages, pipeline.largest_rank
    return sum(v for name, v in per_node.items() if name in stages and stages[name] % pipeline.size == rank)


def _pipeline_inputs(
    setting: PlanSetting,
    g: StrategyGraph,
    layouts: Mapping[torch.fx.Node, NodeLayouts],
    acts: ActivationMemory,
    state: HeldState,
    terms: StepTerms,
) -> PipelineInputs:
    """What the pipeline's stages are planned from (per microbatch, on one stage's mesh)."""
    return PipelineInputs(
        captured=g.captured,
        pipeline=setting.pipeline,
        mesh=setting.mesh,
        p2p_link=CostModel(setting.mesh, setting.cluster).link(0),
        memory_bytes=math.inf if setting.budget is None else setting.budget,
        local_bytes={
            n.name: local_bytes(n, lay.output, g.mesh)
            for n, lay in layouts.items()
            if isinstance(n.meta.get("val"), torch.Tensor)
        },
        activation_bytes=acts.by_node,
        state_bytes=state.held,
        flows=g.requires_grad,
        terms=terms,
        ranks_per_core=terms.device.shared_core_speedup,
    )


def alternatives(
    g: StrategyGraph,
    node_costs: Mapping[str, np.ndarray],
    pair_costs: Mapping[tuple[str, str], np.ndarray],
    assignment: Mapping[str, int],
) -> dict[str, list[Alternative]]:
    """Every variable's strategies, each priced by the variable's terms of the objective with
    every other variable as assigned (what ``autopar explain`` shows)."""
    local = {r: c.astype(float).copy() for r, c in node_costs.items()}
    for (u, v), m in pair_costs.items():
        local[u] += m[:, assignment[v]]
        local[v] += m[assignment[u], :]
    owner = {c.root: node for node, c in g.choices.items() if c.root is not None and c.root == node.name}
    out = {}
    for r, seconds in local.items():
        strategies = g.choices[owner[r]].strategies if r in owner else []
        out[r] = [
            Alternative(
                operands=tuple(None if o is None else format_layout(o) for o in st.operands),
                outputs=tuple(format_layout(o) for o in st.outputs),
                seconds=float(seconds[i]),
                chosen=i == assignment[r],
            )
            for i, st in enumerate(strategies)
        ]
    return out
