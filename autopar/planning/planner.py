"""The planner: from a captured model to the fastest plan that fits in memory.

``autopar.plan`` (:mod:`autopar.planning.entry_points`) captures the model (:func:`capture_for`)
and hands it to :func:`plan_captured`, which builds the strategy graph
(:mod:`autopar.planning.graph.strategy_graph`), prices its edges
(:mod:`autopar.planning.graph.edge_costs`) and runs the memory search: every candidate of
:func:`memory_choices` (a ZeRO stage and the modules recomputed) is solved by the ILP
(:mod:`autopar.planning.search.solver`, with the memory terms of
:mod:`autopar.planning.search.memory_tables`) and evaluated
(:func:`~autopar.planning.assembly.assemble.evaluate_plan`), whose exact memory decides whether
it fits; the plan returned is recorded once (its report and its lowering record). Planning only
reads the captured graph: it can be planned any number of times, then compiled.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from autopar.capture.export import Captured, capture
from autopar.ir.arguments import check_instance
from autopar.ir.errors import OptionError, PlanError
from autopar.ir.layout import Layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import Memory, MixedPrecision, Pipeline, PlanOptions
from autopar.ir.plan import CollectiveKind, Plan
from autopar.planning.assembly.assemble import PlanSetting
from autopar.planning.assembly.lowering_record import lowering_record
from autopar.planning.cost.device_model import device_model
from autopar.planning.cost.model import Cluster, CostModel, get_cluster
from autopar.planning.graph.axis_groups import graph_within, merged_axes
from autopar.planning.graph.edge_costs import cost_tables
from autopar.planning.graph.strategy_graph import build_strategy_graph
from autopar.planning.pipeline.stage_plan import microbatch
from autopar.planning.search.accumulation import first_microbatch
from autopar.planning.search.forked import SharedMinimum
from autopar.planning.search.memory_search import (
    Found,
    Search,
    memory_choices,
    memory_search,
    no_fit,
    record,
)
from autopar.planning.search.memory_tables import MemoryTerms, stage_shares
from autopar.planning.search.solver import SolverClock

DEFAULT_OPTIONS = PlanOptions()  # every option at its default


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
    stack_traces: bool = False,
    accumulation: int = 1,
) -> Captured:
    """Capture ``model`` for planning on ``mesh``: one microbatch of the example under a pipeline
    or where a step accumulates ``accumulation`` microbatches
    (:func:`~autopar.planning.search.accumulation.first_microbatch`, an ``OptionError`` where they do
    not divide an input), traced in ``precision``'s compute dtype when given, each node with the
    user's stack where ``stack_traces`` (a program to compile: its errors name the line)."""
    if isinstance(example_args, list | Mapping):
        kind = "a list" if isinstance(example_args, list) else "a mapping"
        raise OptionError(
            f"example_args is {kind}: give the positional inputs as a tuple, such as (ids, labels), "
            "keyword inputs as example_kwargs={'name': tensor}, or a list or dict that is the one input "
            "as ([a, b],)"
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
    args, kwargs = first_microbatch(args, kwargs, accumulation)
    return capture(model, args, kwargs, layout_mesh(mesh, pipeline), precision, stack_traces)


def evaluate_captured(
    captured: Captured,
    mesh: MeshSpec,
    options: PlanOptions = DEFAULT_OPTIONS,
    *,
    capture_s: float = 0.0,
    fixed_inputs: Mapping[str, Layout] | None = None,
    deterministic: bool = False,
    cutoff_s: float | SharedMinimum | None = None,
) -> Planned:
    """The plan of a model captured by :func:`capture_for`, evaluated but not yet recorded
    (:class:`Planned`; :func:`plan_captured` records it).

    The fastest plan of the first candidate of :func:`memory_choices` wins if it fits; otherwise
    the memory search (:func:`memory_search`) finds the fastest that fits.

    Args:
        captured: the model, captured for ``mesh``.
        mesh: the mesh to plan for (the whole mesh under a pipeline).
        options: the cluster, solver limits, pipeline, memory, budget and microbatches accumulated
            (``captured`` is then one microbatch's) to plan under (``precision``, ``workers``,
            ``check_ids`` and ``update`` are read by the callers).
        capture_s: the seconds capture took, recorded in the plan's solver report.
        fixed_inputs: layouts of user inputs pinned by placeholder name (a loss compiled for a
            model's outputs takes them as they come).
        deterministic: limit the solver by CP-SAT's deterministic seconds alone, so that ranks
            planning the same program apart get the same plan; otherwise the wall clock limits it
            too (:class:`~autopar.planning.search.solver.SolverClock`).
        cutoff_s: a step another plan reaches, or None; the automatic mesh's best so far, shared with
            the meshes planned beside this one, which may lower it while this one is planned.

    Raises:
        MemoryFitError: no plan fits the budget (:func:`no_fit`).
        PlanError: the memory search's solves are bounded at or above ``cutoff_s``.
    """
    cluster, pipeline, time_limit = cluster_of(options), options.pipeline, options.time_limit
    memory, memory_budget = _memory_of(options), options.memory_budget
    # the ILP prices one microbatch: a step's gradient sums are a 1/m share of it
    microbatches = pipeline.microbatches if pipeline is not None else options.accumulation or 1
    t1 = time.perf_counter()
    stage_mesh = layout_mesh(mesh, pipeline)
    g = graph_within(
        lambda groups: build_strategy_graph(
            captured,
            stage_mesh,
            CostModel(stage_mesh, cluster),
            fixed_inputs,
            grad_sum_weight=1.0 / microbatches,
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
            accumulation=options.accumulation or 1,
        ),
        tables=cost_tables(g, memory),
        terms=MemoryTerms(g, memory, stage_shares(pipeline, mesh)),
        clock=SolverClock.starting(time_limit, deterministic),
        seed=options.seed,
        cutoff=cutoff_s if isinstance(cutoff_s, SharedMinimum) else SharedMinimum(cutoff_s or math.inf),
    )
    build_s = time.perf_counter() - t1
    choices = memory_choices(captured, memory)
    best, searched = memory_search(search, choices)
    if best is None:
        raise no_fit(search, choices)
    return Planned(
        step_time_s=best.evaluated.plan.step_time_s,
        peak_memory_bytes=best.evaluated.plan.peak_memory_bytes,
        searched=searched,
        _context=_Unrecorded(
            search=search,
            found=best,
            chosen=searched and memory.zero is None,
            captured=captured,
            merged=merged_axes(stage_mesh, g.axis_groups),
            time_limit=time_limit,
            capture_s=capture_s,
            build_s=build_s,
        ),
    )


def cluster_of(options: PlanOptions) -> Cluster:
    """The :class:`Cluster` ``options`` name (a preset, a cluster file or a cluster; None: ``cpu-gloo``)."""
    given = options.cluster
    return given if isinstance(given, Cluster) else get_cluster("cpu-gloo" if given is None else given)


def _memory_of(options: PlanOptions) -> Memory:
    """``options.memory`` (None: ``Memory()``), refused where the pipeline cannot hold it."""
    memory = Memory() if options.memory is None else options.memory
    if options.pipeline is not None and memory.offload_activations:
        raise PlanError(
            "Memory(offload_activations=True) is not supported with a pipeline (its stages keep "
            "activations per microbatch on the device); use recompute or ZeRO instead"
        )
    return memory


def plan_captured(
    captured: Captured,
    mesh: MeshSpec,
    *,
    capture_s: float = 0.0,
    fixed_inputs: Mapping[str, Layout] | None = None,
    deterministic: bool = False,
    cutoff_s: float | None = None,
    **options: Any,
) -> Plan:
    """The plan of :func:`evaluate_captured`, recorded, its options given as keywords.

    Args:
        captured: the model, captured for ``mesh``.
        mesh: the mesh to plan for (the whole mesh under a pipeline).
        capture_s: as :func:`evaluate_captured`'s.
        fixed_inputs: as :func:`evaluate_captured`'s.
        deterministic: as :func:`evaluate_captured`'s.
        cutoff_s: as :func:`evaluate_captured`'s.
        options: the fields of :class:`~autopar.ir.options.PlanOptions` (checked as it checks them).
    """
    return evaluate_captured(
        captured,
        mesh,
        PlanOptions(**options),
        capture_s=capture_s,
        fixed_inputs=fixed_inputs,
        deterministic=deterministic,
        cutoff_s=cutoff_s,
    ).record()


@dataclass(frozen=True, kw_only=True)
class _Unrecorded:
    """What a plan found by the memory search is recorded from: the search, the plan it found
    (``chosen``: picked by the search rather than the options), and what the plan's warnings and
    solver report add."""

    search: Search
    found: Found
    chosen: bool
    captured: Captured
    merged: list[str]
    time_limit: float
    capture_s: float
    build_s: float


@dataclass(kw_only=True)
class Planned:
    """A captured model planned, its plan evaluated but its report not yet written: the figures the
    automatic mesh compares candidates by, and :meth:`record` to write the report, once (for the
    candidate chosen). A copy sent to another process (a candidate planned in a forked child) goes
    recorded: what it is recorded from (the strategy graph, the search) stays behind. ``searched``:
    the fastest memory choice did not fit, and the memory search chose another."""

    step_time_s: float
    peak_memory_bytes: int
    _context: _Unrecorded | None
    searched: bool = False
    _plan: Plan | None = None

    def record(self) -> Plan:
        """The plan with its report (:func:`~autopar.planning.search.memory_search.record`), its
        solver times, warnings and lowering record (:mod:`~autopar.planning.assembly.lowering_record`);
        written on the first call, the same plan on the next ones."""
        if self._plan is None:
            c = self._context
            plan = record(c.search, c.found)
            if c.chosen:
                plan.memory = replace(plan.memory, chosen=True)
            plan.solver = replace(plan.solver, capture_s=c.capture_s, build_s=plan.solver.build_s + c.build_s)
            _warn(plan, c.captured, c.search.setting, c.merged, c.time_limit)
            plan.lowering = lowering_record(c.captured, plan)
            self._plan, self._context = plan, None
        return self._plan

    def __getstate__(self) -> dict[str, Any]:
        """The state of a recorded copy: what the plan is recorded from does not travel."""
        self.record()
        return dict(self.__dict__)


def _warn(plan: Plan, captured: Captured, setting: PlanSetting, merged: list[str], time_limit: float) -> None:
    """Add to ``plan.warnings`` what its user should know: options that did nothing, mesh axes
    planned together (``merged``, to stay within ``time_limit``), outputs dropped, annotations not
    applied, and what tells its figures from a run's (this host's ranks unlike the cluster's, a
    plan that splits nothing, gradients summed in the compute dtype)."""
    memory, cluster = setting.memory, setting.cluster
    if memory.zero and plan.memory is not None and not plan.memory.zero_splits:
        plan.warnings.append(
            f"Memory(zero={memory.zero}) splits nothing: no parameter of at least zero_threshold bytes has "
            "its gradient summed over a mesh axis of size > 1 (a data-parallel axis) to split it over"
        )
    if merged:
        plan.warnings.append(
            f"mesh axes planned together to stay within time_limit={time_limit:g} s: {', '.join(merged)} "
            "(each op splits one dim over all axes of a group or none of them; a larger time_limit "
            "plans them apart)"
        )
    if setting.pipeline is None and captured.annotations.stages:
        plan.warnings.append("pipeline_stage annotations are ignored: the plan has no pipeline")
    plan.warnings.extend(
        f"{what} is not returned (None): a compiled program returns tensors and plain values"
        for what in captured.dropped_outputs
    )
    plan.warnings.extend(captured.unapplied)
    plan.warnings.extend(_threads_unlike(cluster))
    plan.warnings.extend(_cores_shared(cluster))
    plan.warnings.extend(_splits_nothing(plan, cluster))
    if captured.precision is not None:
        plan.warnings.extend(_sums_in_compute_dtype(plan, captured.precision))


def _threads_unlike(cluster: Cluster) -> list[str]:
    """Say so where this rank computes on another number of threads than the cluster's ranks did
    when calibrate measured them: its rates are theirs. Nothing off a rank (``autopar plan``
    plans in one process, on whatever threads it has)."""
    threads = device_model(cluster).threads_per_rank
    if threads is None or not dist.is_initialized() or torch.get_num_threads() == threads:
        return []
    return [
        f"cluster {cluster.name!r} was measured on ranks computing on {threads} threads each, and this "
        f"rank computes on {torch.get_num_threads()} (torch.get_num_threads()): its step is priced at "
        f"their rates; call torch.set_num_threads({threads}) on each rank before compiling, or "
        "calibrate with the ranks launched as the training run launches them"
    ]


def _cores_shared(cluster: Cluster) -> list[str]:
    """Say so where this host runs more ranks per core than the cluster's device model prices
    (``shared_core_speedup``): ranks sharing cores take turns on them, and the figures are for ranks
    that did not. Only for ranks computing on the host's cores (not a GPU cluster's), and only where
    this host's ranks are known (:func:`_host_ranks`)."""
    device = device_model(cluster)
    ranks, priced = None if device.asynchronous else _host_ranks(cluster), device.shared_core_speedup
    cores = os.cpu_count() or 1
    if ranks is None or ranks / cores <= priced:
        return []
    return [
        f"cluster {cluster.name!r} prices ranks at {priced:g} per core, and this host runs "
        f"{ranks / cores:g} per core ({ranks} ranks, os.cpu_count() {cores}), taking turns on them, so steps "
        "run slower than predicted; for predictions of this host run `autopar calibrate` with the ranks "
        "launched as the training run launches them (docs/cost_model.md)"
    ]


def _host_ranks(cluster: Cluster) -> int | None:
    """The ranks of this job on this host: torchrun's ``LOCAL_WORLD_SIZE`` (set before the process
    group is), else in a process group its whole world where ``cluster`` puts it on one node
    (``cpu-gloo``; ``autopar.tools.launch`` spawns ranks so). None where not known: off ranks
    without torchrun a plan (``autopar plan``) may be for any hosts, and a fake process group
    (:mod:`autopar.tools.fake_ranks`) is one process, whatever its world size."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return None
    world = dist.get_world_size()
    return world if world <= cluster.devices_per_node else None


def _splits_nothing(plan: Plan, cluster: Cluster) -> list[str]:
    """Say why where ``plan`` splits no tensor on a mesh of more than one device
    (:attr:`Plan.splits_nothing`): every rank computes the whole model, its stage's under a pipeline."""
    if not plan.splits_nothing:
        return []
    whole = "the whole of its stage" if plan.pipeline is not None else "the whole model"
    return [
        f"the plan splits no tensor over mesh {plan.mesh_spec}: every rank computes {whole}, since under "
        f"the figures of cluster {cluster.name!r} every split was slower (at this size the collectives "
        "cost more than the compute they save); a cluster with faster links (such as cluster='fast-links'), "
        "a larger model or batch, or shard() annotations would change that"
    ]


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
