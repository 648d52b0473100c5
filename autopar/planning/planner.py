"""The planner's entry: from a model (or its captured graph) to the fastest plan that fits in memory.

:func:`plan` captures the model (:func:`capture_for`) and hands it to
:func:`plan_captured`, which builds the strategy graph
(:mod:`autopar.planning.strategy_graph`), prices its edges
(:mod:`autopar.planning.edge_costs`) and runs the memory search: every candidate of
:func:`memory_choices` (a ZeRO stage and the modules recomputed) is solved by the ILP
(:mod:`autopar.planning.solver`, with the memory terms of
:mod:`autopar.planning.memory_tables`) and assembled into a plan
(:mod:`autopar.planning.assemble`), whose exact memory decides whether it fits.
Planning only reads the captured graph: it can be planned any number of times, then
compiled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from autopar.capture.export import Captured, capture, repeated_blocks
from autopar.ir.arguments import check_instance, check_int, check_number
from autopar.ir.errors import MemoryFitError, OptionError, PlanError
from autopar.ir.layout import Layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import FULL, SELECTIVE, Memory, MixedPrecision, Pipeline
from autopar.ir.plan import CollectiveKind, Plan, SolverReport
from autopar.planning.assemble import PlanSetting, alternatives, assemble_plan
from autopar.planning.axis_groups import graph_within, merged_axes
from autopar.planning.cost import Cluster, CostModel, get_cluster
from autopar.planning.edge_costs import CostTables, cost_tables
from autopar.planning.memory import MemoryChoice
from autopar.planning.memory_tables import MemoryTerms
from autopar.planning.mesh_search import search_meshes
from autopar.planning.pipeline import PipelineFitError, microbatch
from autopar.planning.solver import SolverClock, SolverStats, StrategyILP
from autopar.planning.strategy_graph import build_strategy_graph


def plan(
    model: torch.nn.Module,
    example_args: Any,
    mesh: MeshSpec | Mapping[str, int] | int | Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    cluster: str | Cluster | None = None,
    time_limit: float = 30.0,
    seed: int = 0,
    pipeline: Pipeline | None = None,
    memory: Memory | None = None,
    memory_budget: float | None = None,
    precision: MixedPrecision | None = None,
) -> Plan:
    """Plan ``model`` for ``mesh``: capture, read annotations, solve, report.

    ``mesh`` is a ``{axis: size}`` mapping, a :class:`MeshSpec` or a named ``DeviceMesh``; no
    process group is needed. A number of devices instead searches the mesh too (``pp``, ``dp`` and
    ``tp`` axes and the pipeline: see :mod:`autopar.planning.mesh_search`; ``pipeline`` then fixes
    the pipeline of meshes with one, and ``time_limit`` bounds each mesh's planning). ``cluster`` is
    a preset name (default ``"cpu-gloo"``) or a :class:`Cluster`. ``time_limit`` bounds the solver
    in deterministic seconds (about wall seconds on one core), every solve of the memory search
    included, and sizes the ILP (``autopar.planning.axis_groups``); with the same ``seed`` every
    call, on every rank, returns the same plan. ``pipeline`` runs a pipeline over one mesh axis (see
    :mod:`autopar.planning.pipeline`); the example inputs are the whole batch. ``memory`` sets ZeRO,
    the optimizer's state and offload (:class:`~autopar.ir.options.Memory`); ``memory_budget``
    (bytes per device) makes the planner choose sharding, the ZeRO stage and recompute so that the
    plan fits, or raise :class:`~autopar.ir.errors.PlanError` with the least memory it could reach.
    ``precision`` computes in a lower precision with fp32 master weights
    (:class:`~autopar.ir.options.MixedPrecision`)."""
    if not isinstance(cluster, Cluster):
        cluster = get_cluster("cpu-gloo" if cluster is None else cluster)
    if isinstance(mesh, int) and not isinstance(mesh, bool):

        def plan_one(captured: Captured, spec: MeshSpec, p: Pipeline | None, limit: float) -> Plan:
            return plan_captured(
                captured,
                spec,
                cluster=cluster,
                time_limit=limit,
                seed=seed,
                pipeline=p,
                memory=memory,
                memory_budget=memory_budget,
            )

        return search_meshes(
            mesh,
            cluster,
            _batch(example_args, example_kwargs),
            pipeline,
            lambda spec, p: capture_for(model, example_args, example_kwargs, spec, p, precision),
            plan_one,
            time_limit,
        )
    mesh = MeshSpec.of(mesh)
    t0 = time.perf_counter()
    captured = capture_for(model, example_args, example_kwargs, mesh, pipeline, precision)
    return plan_captured(
        captured,
        mesh,
        cluster=cluster,
        time_limit=time_limit,
        seed=seed,
        capture_s=time.perf_counter() - t0,
        pipeline=pipeline,
        memory=memory,
        memory_budget=memory_budget,
    )


def _batch(example_args: Any, example_kwargs: Mapping[str, Any] | None) -> int | None:
    """Dim 0 of the first tensor input: the batch a pipeline cuts into microbatches."""
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    for t in (*args, *(example_kwargs or {}).values()):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def layout_mesh(mesh: MeshSpec, pipeline: Pipeline | None) -> MeshSpec:
    """The mesh layouts refer to: ``mesh`` itself, or one stage's mesh under a pipeline."""
    if pipeline is not None:
        return pipeline.stage_mesh(mesh)
    if "pp" in mesh.axis_names:
        raise PlanError(
            f"mesh {mesh} has an axis named 'pp', the pipeline axis: pass "
            f"pipeline=autopar.Pipeline(microbatches=...) to pipeline over it, or rename the axis"
        )
    return mesh


def capture_for(
    model: torch.nn.Module,
    example_args: Any,
    example_kwargs: Mapping[str, Any] | None,
    mesh: MeshSpec,
    pipeline: Pipeline | None,
    precision: MixedPrecision | None = None,
) -> Captured:
    """Capture ``model`` for planning on ``mesh``: one microbatch of the example under a pipeline,
    traced in ``precision``'s compute dtype when given."""
    if isinstance(example_args, list):
        raise OptionError(
            "example_args is a list: give the positional inputs as a tuple, such as (ids, labels), "
            "or a list that is the one input as ([a, b],)"
        )
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    if example_kwargs is not None:
        check_instance(example_kwargs, Mapping, "example_kwargs", "a mapping of keyword inputs")
    if pipeline is not None:
        check_instance(pipeline, Pipeline, "pipeline", "an autopar.Pipeline(...)")
    if precision is not None:
        check_instance(precision, MixedPrecision, "precision", "autopar.MixedPrecision(...)")
    kwargs = dict(example_kwargs or {})
    if pipeline is not None:
        args, kwargs = microbatch(args, kwargs, pipeline.microbatches)
    return capture(model, args, kwargs, layout_mesh(mesh, pipeline), precision)


def plan_captured(
    captured: Captured,
    mesh: MeshSpec,
    *,
    cluster: str | Cluster | None = None,
    time_limit: float = 30.0,
    seed: int = 0,
    capture_s: float = 0.0,
    pipeline: Pipeline | None = None,
    fixed_inputs: Mapping[str, Layout] | None = None,
    memory: Memory | None = None,
    memory_budget: float | None = None,
) -> Plan:
    """:func:`plan` for a model captured by :func:`capture_for` (``autopar.compile`` captures once).

    ``fixed_inputs`` pins the layouts of user inputs by placeholder name (a loss
    compiled for a model's outputs takes them as they come). The budget is
    ``memory_budget`` or the cluster's memory. The fastest plan of the first candidate of
    :func:`memory_choices` wins if it fits; otherwise every candidate is solved with the
    memory constraint and the fastest plan that fits wins, the earlier on a tie.
    """
    if not isinstance(cluster, Cluster):
        cluster = get_cluster("cpu-gloo" if cluster is None else cluster)
    memory = Memory() if memory is None else check_instance(memory, Memory, "memory", "autopar.Memory(...)")
    check_number(time_limit, "time_limit", unit="seconds of solver time")
    check_int(seed, "seed")
    if memory_budget is not None:
        check_number(memory_budget, "memory_budget", unit="bytes per device, such as 40 * 2**30")
    if pipeline is not None and memory.offload_activations:
        raise PlanError(
            "Memory(offload_activations=True) is not supported with a pipeline (its stages keep "
            "activations per microbatch on the device); use recompute or ZeRO instead"
        )
    t1 = time.perf_counter()
    stage_mesh = layout_mesh(mesh, pipeline)
    g = graph_within(
        lambda groups: build_strategy_graph(
            captured,
            stage_mesh,
            CostModel(stage_mesh, cluster),
            fixed_inputs,
            grad_sum_weight=1.0 if pipeline is None else 1.0 / pipeline.microbatches,
            groups=groups,
        ),
        stage_mesh,
        time_limit,
    )
    search = Search(
        setting=PlanSetting(
            graph=g,
            cluster=cluster,
            memory=memory,
            mesh=mesh,
            pipeline=pipeline,
            budget=memory_budget if memory_budget is not None else cluster.memory_bytes,
        ),
        tables=cost_tables(g),
        terms=MemoryTerms(g, memory),
        clock=SolverClock(time_limit),
        seed=seed,
    )
    build_s = time.perf_counter() - t1
    choices = memory_choices(captured, memory)
    best, searched = _memory_search(search, choices)
    if best is not None and searched and memory.zero is None:
        best.memory = replace(best.memory, chosen=True)
    if best is None:
        raise _no_fit(search, choices)
    best.solver = replace(best.solver, capture_s=capture_s, build_s=best.solver.build_s + build_s)
    if memory.zero and best.memory is not None and not best.memory.zero_splits:
        best.warnings.append(
            f"Memory(zero={memory.zero}) splits nothing: no parameter of at least zero_threshold bytes has "
            "its gradient summed over a mesh axis of size > 1 (a data-parallel axis) to split it over"
        )
    merged = merged_axes(stage_mesh, g.axis_groups)
    if merged:
        best.warnings.append(
            f"mesh axes planned together to stay within time_limit={time_limit:g} s: {', '.join(merged)} "
            "(each op splits one dim over all axes of a group or none of them; a larger time_limit "
            "plans them apart)"
        )
    if pipeline is None and captured.annotations.stages:
        best.warnings.append("pipeline_stage annotations are ignored: the plan has no pipeline")
    best.warnings.extend(
        f"{what} is not returned (None): a compiled program returns tensors and plain values"
        for what in captured.dropped_outputs
    )
    best.warnings.extend(captured.unapplied)
    if captured.precision is not None:
        best.warnings.extend(_sums_in_compute_dtype(best, captured.precision))
    return best


def _sums_in_compute_dtype(plan: Plan, precision: MixedPrecision) -> list[str]:
    """Say so where parameters stored split are gathered in the compute dtype: the backward of
    that gather reduces their gradients in it, not in ``precision.reduce_dtype``."""
    if precision.reduce_dtype == precision.param_dtype:
        return []
    casts = plan.parameter_casts
    reduced = {
        plan.parameter_nodes[casts[r.src]]
        for r in plan.redistributions
        if r.src in casts
        and any(c.kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE) for c in r.backward)
    }
    if not reduced:
        return []
    names = precision.to_dict()
    wanted = names["reduce_dtype"] or "their own dtype"
    return [
        f"{len(reduced)} parameters stored split are gathered for use in {names['param_dtype']}, so their "
        f"gradients are reduced in {names['param_dtype']}, not in {wanted} (reduce_dtype), e.g. "
        f"{sorted(reduced)[0]}; store them whole (shard(parameter_storage=...)) to sum them in {wanted}"
    ]


@dataclass(frozen=True, kw_only=True)
class Search:
    """What every candidate of the memory search is solved and assembled with: the setting
    (whose ``budget`` is the bytes per device a plan must fit), the ILP's cost tables and
    each candidate's memory terms, the solver's deterministic seconds left (``time_limit``
    shared by every solve) and its seed."""

    setting: PlanSetting
    tables: CostTables
    terms: MemoryTerms
    clock: SolverClock
    seed: int
    tried: list[tuple[Plan, MemoryChoice]] = field(default_factory=list)  # plans that did not fit


# CP-SAT works in integer units: objectives and bounds agree to about this fraction
_ROUNDING = 1e-6


def _memory_search(search: Search, choices: list[MemoryChoice]) -> tuple[Plan | None, bool]:
    """The fastest plan that fits among ``choices``, and whether the budget had to be searched.

    The first choice solved without the memory constraint is the fastest plan of all: if it
    fits, it wins. Otherwise each choice is solved with the constraint, but only while it
    could still win. The ILP's objective adds each choice's seconds (ZeRO's gathers,
    recompute's forward) to the base costs every choice shares, so a choice can do no
    better than a lower bound of the base optimum (the first solve's bound less the most
    its choice adds) plus the least its own terms add; a choice whose bound is not below
    the best objective found is skipped, as is one whose fewest bytes exceed the budget
    (the constrained ILP would have no solution). Choices are solved by their bound, at equal bounds
    the one the first solve's layouts fill least first; of plans equally fast the one solved first wins.
    """
    first = _solve_choice(search, choices[0], constrained=False)
    if first is not None and first.plan.peak_memory_bytes <= search.setting.budget:
        return first.plan, False
    # no bound when no split into pipeline stages fitted the budget
    base = -math.inf if first is None else first.stats.bound - search.terms.most_seconds(choices[0])
    # under a pipeline the ILP bounds no memory (a stage's share is known once assembled): when
    # neither the fastest plan of the choice holding least (the most ZeRO and recompute) nor its
    # plan of least estimated memory fits, no other choice is searched
    unbounded = search.setting.pipeline is not None
    if unbounded and not _last_fits(search, choices[-1]):
        return None, True
    left = [c for c in choices if unbounded or search.terms.least_bytes(c) <= search.setting.budget]

    def order(c: MemoryChoice) -> tuple[float, float]:
        # by bound; at equal bounds the one the fastest layouts fill least first: the likeliest to fit
        held = 0.0 if first is None else search.terms.bytes_at(c, first.assignment)
        return base + search.terms.least_seconds(c), held

    best: _Solved | None = None
    for i, choice in enumerate(sorted(left, key=order)):
        if best is not None and order(choice)[0] >= best.stats.objective * (1 - _ROUNDING):
            break
        # shares as if every choice were solved: what a skipped one leaves goes to the later ones,
        # and a solve whose plan overflows the budget can be solved again (see _solve_choice)
        found = _solve_choice(search, choice, constrained=True, ways=len(choices) - i)
        if found is not None and (best is None or found.plan.step_time_s < best.plan.step_time_s):
            best = found
    return (None if best is None else best.plan), True


def memory_choices(captured: Captured, memory: Memory) -> list[MemoryChoice]:
    """The candidates, the options as given first and least memory last: every ZeRO stage
    (unless ``memory.zero`` fixes one) with the annotated recompute or, when no module is
    annotated ``recompute``, no / selective / full recompute of every repeated block."""
    annotated = dict(captured.annotations.recompute)
    zeros = [memory.zero] if memory.zero is not None else [0, 1, 2, 3]
    recomputes: list[Mapping[str, str]] = [annotated]
    blocks = repeated_blocks(captured.graph)
    if not annotated and blocks:
        recomputes += [dict.fromkeys(blocks, SELECTIVE), dict.fromkeys(blocks, FULL)]
    return [MemoryChoice(zero=z, recompute=r) for r in recomputes for z in zeros]


def _ilp(search: Search, choice: MemoryChoice, limit: float | None = None) -> StrategyILP:
    """The strategy ILP of ``choice``: the cost tables plus its memory terms, its bytes at most ``limit``."""
    node_costs, pair_costs, constant = search.tables
    extra = search.terms.of(choice)
    costs = {r: c + extra.seconds[r] for r, c in node_costs.items()}
    return StrategyILP(
        costs, pair_costs, constant + extra.seconds_constant, (extra.nbytes, extra.bytes_constant), limit
    )


class _Solved(NamedTuple):
    plan: Plan
    stats: SolverStats
    assignment: dict[str, int]


def _solve_choice(search: Search, choice: MemoryChoice, constrained: bool, ways: int = 1) -> _Solved | None:
    """The fastest plan under ``choice`` that fits the budget (with its ILP's report and
    assignment), or None.

    ``constrained`` puts the budget into the ILP; each solve takes a ``ways``-th of the
    solver time left (the candidates still to solve share it). Its memory estimate is per node (see
    :mod:`autopar.planning.memory_tables`); the plan's figure is exact (:mod:`autopar.planning.memory`).
    Where it exceeds the budget, the ILP's limit is lowered by the difference and solved
    again (twice at most). Under a pipeline the budget bounds each stage (the ILP does
    not see microbatches in flight).
    """
    setting = search.setting
    g, budget = setting.graph, setting.budget
    limit = budget if setting.pipeline is None and constrained else None
    for _ in range(3):
        if constrained and search.clock.share(ways) <= 0:
            return None  # time_limit spent: the error names it (_no_fit)
        ilp = _ilp(search, choice, limit)
        solved = ilp.solve(time_limit=search.clock.share(ways), seed=search.seed)
        search.clock.spend(ilp)
        if solved is None:
            return None
        assignment, stats = solved
        report = SolverReport(
            variables=stats.variables,
            constraints=stats.constraints,
            roots=len(g.roots),
            tied_blocks=g.tied_blocks,
            capture_s=0.0,
            build_s=stats.build_seconds,
            solve_s=stats.solve_seconds,
            gap=stats.gap,
            status=stats.status,
        )
        try:
            result = assemble_plan(setting, choice, assignment, report)
        except PipelineFitError:  # no split of the model into stages fits: recorded for the error
            unfit = assemble_plan(replace(setting, budget=None), choice, assignment, report)
            search.tried.append((unfit, choice))
            return None
        result.alternatives = alternatives(g, ilp.node_costs, ilp.pair_costs, assignment)
        if result.peak_memory_bytes <= budget or limit is None:
            fits = result.peak_memory_bytes <= budget
            if not fits:
                search.tried.append((result, choice))
            return _Solved(result, stats, assignment) if fits or not constrained else None
        search.tried.append((result, choice))
        limit -= result.peak_memory_bytes - budget
    return None


def _last_fits(search: Search, last: MemoryChoice) -> bool:
    budget = search.setting.budget
    fastest = _solve_choice(search, last, constrained=False)
    if fastest is not None and fastest.plan.peak_memory_bytes <= budget:
        return True
    return _least_memory(search, last).peak_memory_bytes <= budget


def _least_memory(search: Search, choice: MemoryChoice) -> Plan:
    """The plan of ``choice`` minimising the ILP's memory estimate (recorded as tried)."""
    ilp = _ilp(search, choice)
    assignment, _ = ilp.minimum_memory(time_limit=search.clock.share(), seed=search.seed)
    search.clock.spend(ilp)
    g = search.setting.graph
    report = SolverReport(
        variables=0,
        constraints=0,
        roots=len(g.roots),
        tied_blocks=g.tied_blocks,
        capture_s=0.0,
        build_s=0.0,
        solve_s=0.0,
        gap=0.0,
        status="MIN_MEMORY",
    )
    plan = assemble_plan(replace(search.setting, budget=None), choice, assignment, report)
    search.tried.append((plan, choice))
    return plan


def _no_fit(search: Search, choices: list[MemoryChoice]) -> MemoryFitError:
    """The error when no plan fits: the least memory reached and what dominates it.

    Candidates: the plans the search assembled that did not fit, and the last (least
    memory) choice's plan minimising the ILP's memory estimate; the least exact figure among
    them is reported, under a pipeline with the parts of the stage holding the most.
    """
    mesh, budget = search.setting.mesh, search.setting.budget
    spent = search.clock.share() <= 0
    if not any(choice is choices[-1] and p.solver.status == "MIN_MEMORY" for p, choice in search.tried):
        _least_memory(search, choices[-1])
    least, choice = min(search.tried, key=lambda t: t[0].peak_memory_bytes)
    where = ""
    if least.pipeline is not None:
        stage = max(least.pipeline.stages, key=lambda s: s.memory_bytes)
        where = f" on pipeline stage {stage.index}"
        held = (stage.param_bytes, stage.grad_bytes, stage.optimizer_bytes, stage.peak_activation_bytes)
    else:
        p = least.prediction
        held = (p.param_bytes, p.grad_bytes, p.optimizer_bytes, p.activation_bytes)
    parts = dict(zip(("parameters", "gradients", "optimizer state", "activations"), held))
    top = max(parts, key=parts.get)
    how = f"ZeRO-{choice.zero}" + (
        f", recompute of {len(choice.recompute)} modules ({next(iter(choice.recompute.values()))})"
        if choice.recompute
        else ""
    )
    breakdown = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items())
    return MemoryFitError(
        f"no plan fits memory_budget={budget / 2**30:.2f} GiB per device on mesh {mesh}: the least "
        f"memory reached is {least.peak_memory_bytes / 2**30:.2f} GiB{where} ({how}; {breakdown}), "
        f"dominated by {top}; use more devices, a smaller batch, or offload"
        + ("; time_limit ran out before every candidate was solved: raise it" if spent else ""),
        least.peak_memory_bytes,
    )
