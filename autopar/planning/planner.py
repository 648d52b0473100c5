"""The planner's entry: from a model (or its captured graph) to the fastest plan that fits in memory.

:func:`plan` captures the model (:func:`capture_for`) and hands it to
:func:`plan_captured`, which builds the strategy graph
(:mod:`autopar.planning.graph.strategy_graph`), prices its edges
(:mod:`autopar.planning.graph.edge_costs`) and runs the memory search: every candidate of
:func:`memory_choices` (a ZeRO stage and the modules recomputed) is solved by the ILP
(:mod:`autopar.planning.search.solver`, with the memory terms of
:mod:`autopar.planning.search.memory_tables`) and assembled into a plan
(:mod:`autopar.planning.assembly.assemble`), whose exact memory decides whether it fits.
Planning only reads the captured graph: it can be planned any number of times, then
compiled.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from autopar.capture.export import Captured, capture
from autopar.ir.arguments import check_instance, check_int, check_number
from autopar.ir.errors import OptionError, PlanError
from autopar.ir.layout import Layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import Memory, MixedPrecision, Pipeline
from autopar.ir.plan import CollectiveKind, Plan
from autopar.ir.updates import Update, check_update
from autopar.planning.assembly.assemble import PlanSetting
from autopar.planning.cost.model import Cluster, CostModel, get_cluster
from autopar.planning.cost.update_cost import with_update
from autopar.planning.graph.axis_groups import graph_within, merged_axes
from autopar.planning.graph.edge_costs import cost_tables
from autopar.planning.graph.strategy_graph import build_strategy_graph
from autopar.planning.pipeline.stage_plan import microbatch
from autopar.planning.search.forked import default_workers
from autopar.planning.search.memory_search import Search, memory_choices, memory_search, no_fit
from autopar.planning.search.memory_tables import MemoryTerms, stage_shares
from autopar.planning.search.mesh_search import search_meshes
from autopar.planning.search.solver import SolverClock


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
    update: Update | None = None,
    workers: int | None = None,
) -> Plan:
    """Plan ``model`` for ``mesh``: capture, read annotations, solve, report.

    ``mesh`` is a ``{axis: size}`` mapping, a :class:`MeshSpec` or a named ``DeviceMesh``; no
    process group is needed. A number of devices instead searches the mesh too (``pp``, ``dp`` and
    ``tp`` axes and the pipeline: see :mod:`autopar.planning.search.mesh_search`; ``pipeline`` then fixes
    the pipeline of meshes with one, ``time_limit`` bounds each mesh's planning, and the meshes are
    planned in up to ``workers`` processes at once: by default one per CPU this process may use, at
    most 8; 1 plans them here, one after another). ``cluster`` is a preset name (default
    ``"cpu-gloo"``) or a :class:`Cluster`. ``time_limit`` bounds the solver in seconds, every solve
    of the memory search included (on the wall clock and in CP-SAT's deterministic seconds,
    whichever ends first), and sizes the ILP (``autopar.planning.graph.axis_groups``); with the same
    ``seed`` every call returns the same plan unless the wall clock ended a search (the plan's
    ``solver.status`` is then ``FEASIBLE``). ``pipeline`` runs a pipeline over one mesh axis (see
    :mod:`autopar.planning.pipeline.stage_plan`); the example inputs are the whole batch.
    ``memory`` sets ZeRO,
    the optimizer's state and offload (:class:`~autopar.ir.options.Memory`); ``memory_budget``
    (bytes per device) makes the planner choose sharding, the ZeRO stage and recompute so that the
    plan fits, or raise :class:`~autopar.ir.errors.PlanError` with the least memory it could reach.
    ``precision`` computes in a lower precision with fp32 master weights
    (:class:`~autopar.ir.options.MixedPrecision`). ``update`` (:mod:`autopar.ir.updates`) plans the
    workers' mesh as ``compile(..., update=...)`` compiles it (the synchronous plan, without ZeRO:
    the servers hold the optimizer state) and adds what the mode makes of its step (``Plan.update``;
    :mod:`autopar.planning.cost.update_cost`)."""
    if not isinstance(cluster, Cluster):
        cluster = get_cluster("cpu-gloo" if cluster is None else cluster)
    if update is not None:
        if isinstance(mesh, int):
            raise OptionError(
                f"update={update!r} plans the workers' mesh you give, such as {{'dp': 4}}; a device count "
                f"({mesh}) searches meshes for the synchronous update only"
            )
        memory = memory or Memory(zero=0)  # as compile(update=...): the servers hold the optimizer state
        spec = MeshSpec.of(mesh)
        example = {"example_args": example_args, "example_kwargs": example_kwargs}
        zero, offload = memory.zero, memory.offload_optimizer
        check_update(update, spec, pipeline=pipeline, zero=zero, offload=offload, example=example)
        synchronous = plan(
            model, example_args, spec, example_kwargs=example_kwargs, cluster=cluster, time_limit=time_limit,
            seed=seed, memory=memory, memory_budget=memory_budget, precision=precision,
        )  # fmt: skip
        return with_update(synchronous, update)
    if isinstance(mesh, int) and not isinstance(mesh, bool):

        def plan_one(
            captured: Captured, spec: MeshSpec, p: Pipeline | None, limit: float, cutoff: float | None
        ) -> Plan:
            return plan_captured(
                captured,
                spec,
                cluster=cluster,
                time_limit=limit,
                seed=seed,
                pipeline=p,
                memory=memory,
                memory_budget=memory_budget,
                cutoff_s=cutoff,
            )

        return search_meshes(
            mesh,
            cluster,
            _batch(example_args, example_kwargs),
            pipeline,
            lambda spec, p: capture_for(model, example_args, example_kwargs, spec, p, precision),
            plan_one,
            time_limit,
            default_workers() if workers is None else check_int(workers, "workers", minimum=1),
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
    stack_traces: bool = False,
) -> Captured:
    """Capture ``model`` for planning on ``mesh``: one microbatch of the example under a pipeline,
    traced in ``precision``'s compute dtype when given, each node with the user's stack where
    ``stack_traces`` (a program to compile: its errors name the line)."""
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
    return capture(model, args, kwargs, layout_mesh(mesh, pipeline), precision, stack_traces)


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
    deterministic: bool = False,
    cutoff_s: float | None = None,
) -> Plan:
    """:func:`plan` for a model captured by :func:`capture_for` (``autopar.compile`` captures once).

    ``deterministic`` limits the solver by CP-SAT's deterministic seconds alone, so that ranks
    planning the same program apart get the same plan; otherwise the wall clock limits it too
    (:class:`~autopar.planning.search.solver.SolverClock`).

    ``fixed_inputs`` pins the layouts of user inputs by placeholder name (a loss compiled for a
    model's outputs takes them as they come). The budget is ``memory_budget`` or the cluster's
    memory. The fastest plan of the first candidate of :func:`memory_choices` wins if it fits;
    otherwise the memory search (:func:`memory_search`) finds the fastest that fits, or a
    :class:`PlanError` where its first solve is bounded at or above ``cutoff_s``, a step
    another plan reaches (the automatic mesh's best so far).
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
        terms=MemoryTerms(g, memory, stage_shares(pipeline, mesh)),
        clock=SolverClock.starting(time_limit, deterministic),
        seed=seed,
        cutoff_s=math.inf if cutoff_s is None else cutoff_s,
    )
    build_s = time.perf_counter() - t1
    choices = memory_choices(captured, memory)
    best, searched = memory_search(search, choices)
    if best is not None and searched and memory.zero is None:
        best.memory = replace(best.memory, chosen=True)
    if best is None:
        raise no_fit(search, choices)
    best.solver = replace(best.solver, capture_s=capture_s, build_s=best.solver.build_s + build_s)
    _warn(best, captured, search.setting, merged_axes(stage_mesh, g.axis_groups), time_limit)
    return best


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
    threads = cluster.threads_per_rank
    if threads is None or not dist.is_initialized() or torch.get_num_threads() == threads:
        return []
    return [
        f"cluster {cluster.name!r} was measured on ranks computing on {threads} threads each, and this "
        f"rank computes on {torch.get_num_threads()} (torch.get_num_threads()): its step is priced at "
        f"their rates; call torch.set_num_threads({threads}) on each rank before compiling, or "
        "calibrate with the ranks launched as the training run launches them"
    ]


def _cores_shared(cluster: Cluster) -> list[str]:
    """Say so where this host runs more ranks per core than ``cluster.ranks_per_core`` prices:
    ranks sharing cores take turns on them, and the figures are for ranks that did not. Only for
    ranks computing on the host's cores (not a GPU cluster's), and only where this host's ranks
    are known (:func:`_host_ranks`)."""
    ranks = None if cluster.asynchronous else _host_ranks(cluster)
    cores = os.cpu_count() or 1
    if ranks is None or ranks / cores <= cluster.ranks_per_core:
        return []
    return [
        f"cluster {cluster.name!r} prices ranks at {cluster.ranks_per_core:g} per core, and this host runs "
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
