"""Pipeline parallelism at plan time: options, which node runs in which stage, predictions.

A pipeline runs over one mesh axis (``pp`` by default; it must be the mesh's first,
outermost axis). The model is cut into ``stages = size(pp) × virtual_stages``
consecutive stages; stage ``s`` lives on pipeline coordinate ``s % size(pp)`` (the
looping placement of ``torch.distributed.pipelining``), and inside a stage the model
is sharded over the remaining axes, the *stage mesh* (dp × tp, say). Every stage mesh
has the same shape, so one strategy ILP over the whole graph on the stage mesh plans
every stage, and a value crossing a stage boundary keeps its layout: coordinate
(dp, tp) of one stage sends its piece to coordinate (dp, tp) of the next.

The batch is cut into ``microbatches`` along dim 0 of every input; the graph is
captured and planned for one microbatch, which is what a stage runs at a time.

Stages come from ``pipeline_stage`` annotations when there are any (honoured exactly:
every module with parameters must have one, stage numbers must run 0, 1, ... and follow
the order of the forward), and otherwise from
:func:`~autopar.planning.pipeline.stage_split.partition`: the graph is cut into
*units* (the repeated blocks with the ops around them, see
:func:`~autopar.planning.pipeline.stage_nodes.units`) and a
dynamic program picks the contiguous split into stages that minimises Alpa's pipeline
latency ``Σ t_s + (m − 1) max t_s`` (``t_s``: one microbatch's forward and backward in
stage ``s``, communication included) subject to each stage's memory fitting a device,
and among equally fast splits the one with the smallest largest memory.

Nodes outside every annotated module or unit follow simple rules: a node computed from
some stage's values runs in the latest of those stages (user inputs count as stage 0);
a node computed from parameters, constants or nothing (``arange``, a transposed
weight) runs in the first stage that uses it. A value needed beyond the next stage is
carried through the stages in between. A parameter used in two stages (tied
embeddings) is refused: stages hold disjoint parameters. So is a buffer some op writes
(batch norm's running statistics); a constant buffer (a rotary table every layer reads)
is copied into each stage that reads it, and each stage's memory counts its copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.capture.export import Captured
from autopar.ir.errors import AnnotationError, PlanError
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import Pipeline
from autopar.ir.plan import PipelinePlan, Plan, Prediction, StagePlan
from autopar.ir.report import GRADIENT_SUM
from autopar.planning.cost.model import LinkSpec
from autopar.planning.cost.step_overheads import StepTerms, hidden_sends
from autopar.planning.pipeline.in_flight import stage_flights
from autopar.planning.pipeline.stage_nodes import (
    annotated_anchors,
    complete_stages,
    node_held_bytes,
    placed_units,
    shared_constants,
    unit_memory,
    unit_name,
)
from autopar.planning.pipeline.stage_split import partition


def microbatch(args: tuple, kwargs: Mapping[str, Any], microbatches: int) -> tuple[tuple, dict]:
    """The first of ``microbatches`` equal chunks (dim 0) of every tensor input.

    Raises ``PlanError`` naming the input when its dim 0 does not divide evenly.
    """
    leaves, spec = pytree.tree_flatten_with_path((args, dict(kwargs)))
    chunks = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            name = _input_name(path)
            if leaf.dim() == 0 or leaf.shape[0] % microbatches:
                size = "a scalar" if leaf.dim() == 0 else f"batch {leaf.shape[0]} along dim 0"
                raise PlanError(
                    f"input {name} has {size}, which cannot be cut into {microbatches} equal microbatches "
                    f"(every tensor input is split along dim 0)"
                )
            leaf = leaf[: leaf.shape[0] // microbatches]
        chunks.append(leaf)
    mb_args, mb_kwargs = pytree.tree_unflatten(chunks, pytree.tree_structure((args, dict(kwargs))))
    return tuple(mb_args), dict(mb_kwargs)


def _input_name(path: tuple) -> str:
    """``args[0]`` or ``kwargs['labels']`` for a pytree path into ``(args, kwargs)``."""
    head, *rest = path
    where = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    return where + "".join(str(k) for k in rest)


# --------------------------------------------------------------------------- predictions


@dataclass
class Crossing:
    """What crosses one stage boundary per microbatch: values forward, their gradients backward
    (bytes and tensors each)."""

    forward_bytes: float = 0.0
    forward_tensors: int = 0
    backward_bytes: float = 0.0
    backward_tensors: int = 0


def _crossing_bytes(
    graph: torch.fx.Graph,
    position: Mapping[torch.fx.Node, int],
    n: int,
    value_bytes: Mapping[torch.fx.Node, tuple[float, bool]],
) -> list[Crossing]:
    """Per cut ``i`` in ``0..n-1`` (before position ``i``): what is sent across it per microbatch.

    A value crosses every cut between its position and its last use; model outputs are
    used at the last position. ``value_bytes`` gives each value's local bytes and
    whether a gradient flows back (its gradient then crosses backward).
    """
    cuts = [Crossing() for _ in range(n)]
    output = next(node for node in graph.nodes if node.op == "output")
    for node, (nbytes, grad) in value_bytes.items():
        if node not in position:
            continue
        last = max((n - 1 if u is output else position.get(u, -1) for u in node.users), default=-1)
        for c in cuts[position[node] + 1 : last + 1]:
            c.forward_bytes += nbytes
            c.forward_tensors += 1
            if grad:
                c.backward_bytes += nbytes
                c.backward_tensors += 1
    return cuts


@dataclass(frozen=True, kw_only=True)
class PipelineInputs:
    """What the stages of a solved plan (planned per microbatch) are planned from.

    ``mesh`` is the whole mesh, ``p2p_link`` the link of its pipeline axis,
    ``memory_bytes`` what each device holds at most, ``local_bytes`` each tensor node's
    bytes on one rank, ``activation_bytes`` what each node keeps for backward,
    ``state_bytes`` each parameter's and buffer's bytes on one rank (itself, its
    gradient, its optimizer state: see :mod:`autopar.planning.memory.model`), ``flows`` which
    nodes carry a gradient, ``terms`` the step's overheads, optimizer step and gradient-sum
    buckets (:mod:`autopar.planning.cost.step_overheads`), ``ranks_per_core`` the cluster's.
    """

    captured: Captured
    pipeline: Pipeline
    mesh: MeshSpec
    p2p_link: LinkSpec
    memory_bytes: float
    local_bytes: Mapping[str, float]
    activation_bytes: Mapping[str, float]
    state_bytes: Mapping[str, tuple[float, ...]]
    flows: Mapping[torch.fx.Node, bool]
    terms: StepTerms
    ranks_per_core: float = 1.0

    def p2p_seconds(self, crossing: Crossing) -> float:
        """Seconds of sending everything that crosses a stage boundary, both ways."""
        return self.send_seconds(crossing.forward_bytes, crossing.forward_tensors) + self.send_seconds(
            crossing.backward_bytes, crossing.backward_tensors
        )

    def send_seconds(self, nbytes: float, tensors: int) -> float:
        """Seconds of sending ``tensors`` tensors of ``nbytes`` in all across a stage boundary."""
        return tensors * self.p2p_link.latency_s + nbytes / self.p2p_link.bandwidth_Bps

    def held(self, node: torch.fx.Node) -> tuple[float, float, float]:
        """Bytes of a parameter or buffer on one rank, of its gradient, of its optimizer state."""
        return node_held_bytes(self.state_bytes, node)

    def value_bytes(self) -> dict[torch.fx.Node, tuple[float, bool]]:
        """Each activation's bytes on one rank, and whether a gradient flows back to it."""
        state = {**self.captured.params, **self.captured.buffers}
        return {
            node: (self.local_bytes[node.name], bool(self.flows.get(node)))
            for node in self.captured.graph.nodes
            if node.name in self.local_bytes and node.name not in state
        }


@dataclass(frozen=True)
class _NodeCosts:
    """Per node of a plan: seconds of one microbatch (its compute and the redistributions into
    it; a parameter's, handling its gradient), the bytes those move; per parameter, its gradient
    sum's seconds and bytes (once per step)."""

    seconds: dict[str, float]
    comm_bytes: dict[str, int]
    grad_sums: dict[str, tuple[float, int]]

    @classmethod
    def of(cls, plan: Plan, terms: StepTerms, microbatches: int) -> _NodeCosts:
        """The costs of ``plan``'s nodes, each op's overhead and recompute (``terms``) included, and
        each parameter's gradient handling (priced for the step) spread over ``microbatches``."""
        decisions = {d.name: d for d in plan.nodes}
        recompute, gradients = terms.recompute_s, terms.gradient_s
        seconds = {
            name: d.compute_s
            + terms.op_s.get(name, 0.0)
            + recompute.get(name, 0.0)
            + gradients.get(name, 0.0) / microbatches
            for name, d in decisions.items()
        }
        comm_bytes: dict[str, int] = {}
        grad_sums: dict[str, tuple[float, int]] = {}
        for r in plan.redistributions:
            nbytes = sum(c.bytes for c in (*r.forward, *r.backward))
            if r.dst == GRADIENT_SUM:
                grad_sums[r.src] = (r.seconds, nbytes)
            else:  # in the consumer's stage; for the model's outputs, the producer's
                home = r.dst if r.dst in decisions else r.src
                seconds[home] = seconds.get(home, 0.0) + r.seconds
                comm_bytes[home] = comm_bytes.get(home, 0) + nbytes
        return cls(seconds=seconds, comm_bytes=comm_bytes, grad_sums=grad_sums)


def plan_pipeline(plan: Plan, inputs: PipelineInputs) -> tuple[PipelinePlan, Prediction]:
    """The :class:`~autopar.ir.plan.PipelinePlan` of a solved ``plan`` (planned per microbatch), and
    the plan's prediction for a whole step under it (see :class:`~autopar.ir.plan.Prediction`)."""
    pipeline, captured = inputs.pipeline, inputs.captured
    p, n_stages, m = pipeline.size(inputs.mesh), pipeline.stages(inputs.mesh), pipeline.microbatches
    costs = _NodeCosts.of(plan, inputs.terms, m)
    value_bytes = inputs.value_bytes()
    automatic = not captured.annotations.stages
    if automatic:
        anchors = _automatic_anchors(inputs, costs, value_bytes)
    else:
        anchors = annotated_anchors(captured)
        n_annotated = max(captured.annotations.stages.values()) + 1
        if n_annotated != n_stages:
            raise AnnotationError(
                f"pipeline_stage annotations give {n_annotated} stages, but pipeline axis "
                f"{pipeline.axis}={p} with virtual_stages={pipeline.virtual_stages} runs {n_stages}; "
                f"annotate {n_stages} stages (stage counts must be a multiple of {p})"
            )
    stage_of = complete_stages(captured, anchors, n_stages)
    cuts = _crossing_bytes(captured.graph, stage_of, n_stages, value_bytes)
    copies = shared_constants(captured, stage_of)
    stages = tuple(_stage_plan(inputs, costs, stage_of, copies, cuts, s) for s in range(n_stages))
    flights = stage_flights(pipeline, p, [st.activation_bytes for st in stages])
    stages = tuple(replace(st, in_flight=float(n)) for st, n in zip(stages, flights))
    # ranks sharing cores lend each other the time they wait: a rank's compute on the critical path
    # runs up to ranks_per_core times faster while others wait, but what it waits for itself (the
    # sends between stages, the slowest rank) passes no faster; and the step takes no less than
    # the average rank's work
    busy = [
        sum(
            st.seconds / inputs.ranks_per_core
            + st.p2p_seconds
            + _waits(inputs, st, stage_of)
            - _hidden_sends(inputs, st, cuts)
            for st in stages
            if st.rank == r
        )
        for r in range(p)
    ]
    after = max(_after_backward(inputs, stages, stage_of, r) for r in range(p))
    work = m * sum(st.seconds for st in stages) / p
    # the bubble's (p - 1) / v slots are compute and waits; the fill and the drain wait instead on a send
    # across every one of the p * v - 1 boundaries (_fill_sends), which interleaving multiplies by v
    computing = [
        sum(
            st.seconds / inputs.ranks_per_core + _waits(inputs, st, stage_of) for st in stages if st.rank == r
        )
        for r in range(p)
    ]
    bubble = max(computing) * (p - 1) / pipeline.virtual_stages + _fill_sends(inputs, cuts)
    critical = max(busy) * m + bubble
    step = max(critical, work) + after
    planned = PipelinePlan(
        axis=pipeline.axis,
        size=p,
        schedule=pipeline.schedule,
        microbatches=m,
        virtual_stages=pipeline.virtual_stages,
        automatic=automatic,
        stages=stages,
        node_stages={node.name: s for node, s in stage_of.items()},
        bubble_fraction=pipeline.bubble_fraction(p),
        step_time_s=step,
    )
    busiest = max(range(p), key=busy.__getitem__)
    return planned, _step_prediction(plan, inputs, planned, stage_of, cuts, busiest)


def _step_prediction(
    plan: Plan,
    inputs: PipelineInputs,
    pp: PipelinePlan,
    stage_of: Mapping[torch.fx.Node, int],
    cuts: list[Crossing],
    rank: int,
) -> Prediction:
    """The whole step of pipeline coordinate ``rank`` (the busiest): its stages' compute,
    collectives, sends and overheads for every microbatch, its gradient sums and optimizer step
    once (``comm_bytes``: what its collectives move, as its stages count them; the sends are in
    their ``p2p_bytes``); ``wait_s`` is what the schedule's step takes beyond them (the bubble,
    the waits for other ranks). The memory is that of the pipeline rank holding the most
    (:meth:`~autopar.ir.plan.PipelinePlan.rank_memory_bytes`)."""
    m, terms = pp.microbatches, inputs.terms
    mine = {node.name for node, s in stage_of.items() if s % pp.size == rank}
    stages = pp.rank_stages(rank)
    recompute = terms.recompute_s
    compute = m * sum(d.compute_s + recompute.get(d.name, 0.0) for d in plan.nodes if d.name in mine)
    sums = [r for r in plan.redistributions if r.dst == GRADIENT_SUM and r.src in mine]
    # a redistribution is its consumer's, a model output's its producer's (as in _NodeCosts)
    decided = {d.name for d in plan.nodes}
    homes = [(r, r.dst if r.dst in decided else r.src) for r in plan.redistributions if r.dst != GRADIENT_SUM]
    flows = [r for r, home in homes if home in mine]
    buckets = terms.bucket_times(mine)
    comm = m * sum(r.seconds for r in flows) + sum(r.seconds for r in sums) + buckets.latency_s
    comm += m * sum(st.p2p_seconds for st in stages)
    moved = sum(m * st.comm_bytes + st.grad_sum_bytes for st in stages)
    overhead = m * sum(t for name, t in terms.op_s.items() if name in mine)
    overhead += sum(t for name, t in terms.gradient_s.items() if name in mine)
    optimizer = sum(t for name, t in terms.update_s.items() if name in mine)
    hidden_comm = buckets.hidden_s + m * sum(_hidden_sends(inputs, st, cuts) for st in stages)
    hidden_launch = m * terms.hidden_launches(mine)
    top = pp.rank_stages(pp.largest_rank)
    return Prediction(
        step_time_s=pp.step_time_s,
        compute_s=compute,
        comm_s=comm,
        comm_bytes=int(moved),
        param_bytes=sum(st.param_bytes for st in top),
        grad_bytes=sum(st.grad_bytes for st in top),
        optimizer_bytes=sum(st.optimizer_bytes for st in top),
        activation_bytes=sum(st.peak_activation_bytes for st in top),
        overhead_s=overhead,
        optimizer_s=optimizer,
        wait_s=pp.step_time_s - (compute + comm + overhead + optimizer - hidden_comm - hidden_launch),
        hidden_comm_s=hidden_comm,
        hidden_launch_s=hidden_launch,
    )


def _fill_sends(inputs: PipelineInputs, cuts: list[Crossing]) -> float:
    """Seconds the pipeline's fill and drain wait on sends: the first microbatch's values cross every
    stage boundary before the last stage starts, and the last one's gradients every boundary back
    before the first stage ends, each waited for by a stage with nothing else to run."""
    return sum(
        inputs.send_seconds(c.forward_bytes, c.forward_tensors)
        + inputs.send_seconds(c.backward_bytes, c.backward_tensors)
        for c in cuts[1:]
    )


def _hidden_sends(inputs: PipelineInputs, stage: StagePlan, cuts: list[Crossing]) -> float:
    """Seconds per microbatch of ``stage``'s sends that run while it computes (see
    :func:`~autopar.planning.cost.step_overheads.hidden_sends`): each hides behind the next
    microbatch's forward (a third of the stage's seconds) or backward (two thirds) at most."""
    s, pipeline = stage.index, inputs.pipeline
    m = pipeline.microbatches
    forward = cuts[s + 1] if s + 1 < len(cuts) else Crossing()  # activations to the next stage
    backward = cuts[s] if s else Crossing()  # gradients to the previous one
    hidden = hidden_sends(pipeline.schedule, pipeline.size(inputs.mesh), stage.rank, m) * (
        min(inputs.send_seconds(forward.forward_bytes, forward.forward_tensors), stage.seconds / 3)
        + min(inputs.send_seconds(backward.backward_bytes, backward.backward_tensors), 2 * stage.seconds / 3)
    )
    return hidden / m


def _waits(inputs: PipelineInputs, stage: StagePlan, stage_of: Mapping[torch.fx.Node, int]) -> float:
    """Seconds per microbatch ``stage``'s ranks wait for the slowest at its synchronising points:
    its collectives, and the receives that start its forward and its backward."""
    forward, backward = inputs.terms.segments({n.name for n, s in stage_of.items() if s == stage.index})
    return inputs.terms.waits([*forward, *backward])


def _after_backward(
    inputs: PipelineInputs, stages: tuple[StagePlan, ...], stage_of: Mapping[torch.fx.Node, int], rank: int
) -> float:
    """Seconds pipeline coordinate ``rank`` spends after its last backward: its gradient sums (the
    buckets' latency added, what runs during that backward taken off) and its optimizer step, with
    the wait for the slowest rank that ends it."""
    mine = {node.name for node, s in stage_of.items() if s % inputs.pipeline.size(inputs.mesh) == rank}
    buckets = inputs.terms.bucket_times(mine)
    sums = sum(st.grad_sum_seconds for st in stages if st.rank == rank) + buckets.latency_s - buckets.hidden_s
    optimizer = sum(t for name, t in inputs.terms.update_s.items() if name in mine)
    return sums + optimizer + inputs.terms.waits([optimizer])  # which ends at the step's end or a gather


def _automatic_anchors(
    inputs: PipelineInputs, costs: _NodeCosts, value_bytes: Mapping[torch.fx.Node, tuple[float, bool]]
) -> dict[torch.fx.Node, int]:
    """The stage of every op of a unit, from the split :func:`partition` picks."""
    pipeline, captured = inputs.pipeline, inputs.captured
    m = pipeline.microbatches
    n, unit_of, placed = placed_units(captured)
    seconds = [0.0] * n
    for node, i in placed.items():
        once = costs.grad_sums.get(node.name, (0.0, 0))[0] + inputs.terms.update_s.get(node.name, 0.0)
        seconds[i] += costs.seconds.get(node.name, 0.0) + once / m  # once a step: spread over microbatches
    cuts = _crossing_bytes(captured.graph, placed, n, value_bytes)
    unit_costs = replace(
        unit_memory(captured, placed, n, inputs.state_bytes, inputs.activation_bytes),
        seconds=seconds,
        cut_seconds=[inputs.p2p_seconds(c) for c in cuts],
    )
    stage_of_unit = partition(unit_costs, pipeline, pipeline.size(inputs.mesh), inputs.memory_bytes)
    return {node: stage_of_unit[i] for node, i in unit_of.items()}


def _stage_plan(
    inputs: PipelineInputs,
    costs: _NodeCosts,
    stage_of: Mapping[torch.fx.Node, int],
    copies: Mapping[torch.fx.Node, tuple[int, ...]],
    cuts: list[Crossing],
    s: int,
) -> StagePlan:
    """Stage ``s``: its nodes' costs and bytes (a copy of each constant buffer it reads, from
    ``copies``, included), and what crosses its boundaries (``cuts``)."""
    pipeline = inputs.pipeline
    p, n_stages = pipeline.size(inputs.mesh), len(cuts)
    nodes = [
        node for node in inputs.captured.graph.nodes if stage_of.get(node) == s or s in copies.get(node, ())
    ]
    sent = [cuts[s] if s else Crossing(), cuts[s + 1] if s + 1 < n_stages else Crossing()]
    param_b, grad_b, optimizer_b = (sum(column) for column in zip(*map(inputs.held, nodes)))
    modules = list(dict.fromkeys(unit_name(n) for n in nodes if n.op == "call_function"))
    return StagePlan(
        index=s,
        rank=s % p,
        modules=tuple(modules),
        # on an asynchronous device a microbatch's launches overlap its compute, stage by stage
        seconds=sum(costs.seconds.get(node.name, 0.0) for node in nodes)
        - inputs.terms.hidden_launches({node.name for node in nodes}),
        p2p_seconds=sum(inputs.p2p_seconds(c) for c in sent),
        grad_sum_seconds=sum(costs.grad_sums.get(node.name, (0.0, 0))[0] for node in nodes),
        comm_bytes=sum(costs.comm_bytes.get(node.name, 0) for node in nodes),
        grad_sum_bytes=sum(costs.grad_sums.get(node.name, (0.0, 0))[1] for node in nodes),
        p2p_bytes=int(sum(c.forward_bytes + c.backward_bytes for c in sent)),
        param_bytes=int(param_b),
        grad_bytes=int(grad_b),
        optimizer_bytes=int(optimizer_b),
        activation_bytes=int(sum(inputs.activation_bytes.get(node.name, 0.0) for node in nodes)),
        in_flight=0.0,  # set once every stage's activations are known (its rank's peak)
    )
