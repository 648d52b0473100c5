"""``autopar.plan`` and what it dispatches to: a mesh given, a device count, an update mode.

:func:`plan`, the keyword form users call, checks its options once (:class:`PlanOptions`) and hands
them whole to :func:`plan_on_mesh`, :func:`plan_for_devices` (the automatic mesh) or the update
mode's planner (:data:`UPDATE_PLANNERS`), each returning a :class:`Plan`. This module sits above
:mod:`autopar.planning.planner` and :mod:`autopar.planning.search.mesh_search` and calls both: the
mesh search holds the candidates and their outcomes as data, and each is captured and planned here.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

import torch

from autopar.capture.export import Captured, gradient_flow
from autopar.ir.errors import AnnotationError, OptionError, PlanError
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import Memory, MixedPrecision, Pipeline, PlanOptions
from autopar.ir.plan import Plan
from autopar.ir.updates import UPDATES, Update, check_update
from autopar.planning.cost.model import Cluster, get_cluster
from autopar.planning.cost.update_cost import with_update
from autopar.planning.memory.saved_tensors import measure_saved
from autopar.planning.planner import Planned, capture_for, cluster_of, evaluate_captured
from autopar.planning.search.accumulation import accumulated, batch_of
from autopar.planning.search.forked import ForkedCalls, SharedMinimum, default_workers
from autopar.planning.search.mesh_search import MeshCandidate, MeshSearch, check_devices

Mesh = MeshSpec | Mapping[str, int] | Any  # a MeshSpec, {axis: size} or a named DeviceMesh


def plan(
    model: torch.nn.Module,
    example_args: Any,
    mesh: Mesh | int,
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
    accumulation: int | None = None,
) -> Plan:
    """Plan ``model`` for ``mesh``: capture, read annotations, solve, report. No process group is needed.

    With the same ``seed`` every call returns the same plan unless the wall clock ended a search (the
    plan's ``solver.status`` is then ``FEASIBLE``).

    Args:
        model: the model to plan.
        example_args: the positional inputs, the whole batch (a tuple, or one input).
        mesh: a ``{axis: size}`` mapping, a :class:`MeshSpec` or a named ``DeviceMesh``; or a number
            of devices, which searches the mesh too (``pp``, ``dp`` and ``tp`` axes and the pipeline:
            :mod:`autopar.planning.search.mesh_search`).
        example_kwargs: the keyword inputs, the whole batch.
        cluster: a preset name (default ``"cpu-gloo"``), a cluster file or a :class:`Cluster`.
        time_limit: seconds each solve may take, every solve of the memory search included (on the
            wall clock and in CP-SAT's deterministic seconds, whichever ends first); it also sizes the
            ILP (``autopar.planning.graph.axis_groups``); with a device count, each mesh's planning, in
            CP-SAT's deterministic seconds alone (a loaded host does not change a mesh's plan).
        seed: the solver's seed.
        pipeline: a pipeline over one mesh axis (:mod:`autopar.planning.pipeline.stage_plan`); with a
            device count, the pipeline of the meshes that have one.
        memory: ZeRO, the optimizer's state and offload (:class:`~autopar.ir.options.Memory`).
        memory_budget: bytes per device: sharding, the ZeRO stage and recompute are chosen so that the
            plan fits, or :class:`~autopar.ir.errors.PlanError` says the least memory reached.
        precision: compute in a lower precision with fp32 master weights
            (:class:`~autopar.ir.options.MixedPrecision`).
        update: an update mode (:mod:`autopar.ir.updates`): the workers' mesh planned as
            ``compile(..., update=...)`` compiles it, with what the mode makes of its step
            (``Plan.update``; :mod:`autopar.planning.cost.update_cost`).
        workers: with a device count, processes the meshes are planned in at once (default: one per
            CPU this process may use, at most 8; 1 plans them here, one after another).
        accumulation: microbatches a step accumulates without a pipeline (dim 0 of every tensor input
            cut into that many; ``Plan.accumulation``); None: 1 unless the whole batch does not fit, then
            the fastest count that fits (:mod:`autopar.planning.search.accumulation`).

    Returns:
        The plan; :func:`plan_on_mesh`, :func:`plan_for_devices` and the update modes' planners
        take the same options as a :class:`PlanOptions`.
    """
    if not isinstance(cluster, Cluster):  # first: a cluster file's errors before the options'
        cluster = get_cluster("cpu-gloo" if cluster is None else cluster)
    options = PlanOptions(
        cluster=cluster,
        time_limit=time_limit,
        seed=seed,
        pipeline=pipeline,
        memory=memory,
        memory_budget=memory_budget,
        precision=precision,
        workers=workers,
        update=update,
        accumulation=accumulation,
    )
    if options.update is not None:
        return update_planner(options.update).plan(model, example_args, mesh, example_kwargs, options)
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        return plan_for_devices(model, example_args, mesh, example_kwargs, options)
    return plan_on_mesh(model, example_args, mesh, example_kwargs, options)


def plan_on_mesh(
    model: torch.nn.Module,
    example_args: Any,
    mesh: Mesh,
    example_kwargs: Mapping[str, Any] | None,
    options: PlanOptions,
) -> Plan:
    """``model`` captured and planned for ``mesh`` under ``options`` (``options.update`` is not read).

    Args:
        model: the model to plan.
        example_args: the positional inputs, the whole batch.
        mesh: a ``{axis: size}`` mapping, a :class:`MeshSpec` or a named ``DeviceMesh``.
        example_kwargs: the keyword inputs, or None.
        options: what :func:`plan` was given.
    """
    spec = MeshSpec.of(mesh)

    def plan_with(o: PlanOptions) -> Planned:
        t0 = time.perf_counter()
        m = o.accumulation or 1
        captured = capture_for(
            model, example_args, example_kwargs, spec, o.pipeline, o.precision, accumulation=m
        )
        return evaluate_captured(captured, spec, o, capture_s=time.perf_counter() - t0)

    args = example_args if isinstance(example_args, tuple) else (example_args,)
    return accumulated(plan_with, batch_of(args, example_kwargs or {}), options).record()


def plan_for_devices(
    model: torch.nn.Module,
    example_args: Any,
    devices: int,
    example_kwargs: Mapping[str, Any] | None,
    options: PlanOptions,
) -> Plan:
    """The fastest plan over the meshes of ``devices`` devices (:mod:`~autopar.planning.search.mesh_search`):
    its candidates planned in up to ``options.workers`` processes at once
    (:class:`~autopar.planning.search.forked.ForkedCalls`), each with the whole ``time_limit`` in
    CP-SAT's deterministic seconds.

    Args:
        model: the model to plan.
        example_args: the positional inputs, the whole batch.
        devices: the number of devices, a positive int.
        example_kwargs: the keyword inputs, or None.
        options: what :func:`plan` was given (``options.pipeline``: the pipeline of pipelined meshes).
    """
    check_devices(devices)
    if options.accumulation not in (None, 1):
        raise OptionError(
            f"accumulation={options.accumulation} with a device count ({devices}): the automatic mesh plans "
            "each mesh on the whole batch; give a mesh, such as {'dp': 8}, to accumulate microbatches"
        )
    options = replace(options, accumulation=None)  # a pipelined candidate takes no count (1 included)
    t0, cluster = time.perf_counter(), cluster_of(options)
    captures = _Captures(model, example_args, example_kwargs, options.precision)
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    search = MeshSearch.of(devices, cluster, captures.whole, batch_of(args, example_kwargs or {}), options)
    captures.share(search.reuse)
    candidate_options = replace(options, cluster=cluster)  # read once, here, not in every child
    best = SharedMinimum()  # the best step found, read by the candidates planned meanwhile
    with ForkedCalls(default_workers() if options.workers is None else options.workers) as calls:
        while search.left or calls.running:
            while calls.running < calls.workers and (i := search.next()) is not None:
                c = search.candidates[i]
                try:
                    made = captures.of(c)
                    mesh, mine = MeshSpec.of(c.sizes), replace(candidate_options, pipeline=c.pipeline)
                    # solves limited by CP-SAT's deterministic seconds alone: a loaded host or the
                    # number of workers must not change which plan a mesh gets (on the wall clock the
                    # 39.1B GPT's meshes without a pipeline ran out before their plans)
                    planning = functools.partial(
                        evaluate_captured, made, mesh, mine, cutoff_s=best, deterministic=True
                    )
                    calls.submit(i, planning)
                except (PlanError, AnnotationError) as e:  # its capture: this mesh cannot run the annotations
                    search.done(i, e)
            waiting = search.waiting()
            if waiting is not None and calls.running >= calls.workers > 1:
                captures.ahead(waiting)
            if calls.running:
                i, (_, found) = calls.next_done()
                search.done(i, found, calls.seconds[i])
                if search.cutoff_s is not None:
                    best.offer(search.cutoff_s)
    return search.chosen(time.perf_counter() - t0, calls.workers)


class _Captures:
    """The model's captures for the automatic mesh, made in this process: one for a mesh of one device
    (``whole``), then one per candidate, or one per microbatch shape where every mesh can share it."""

    def __init__(
        self,
        model: torch.nn.Module,
        args: Any,
        kwargs: Mapping[str, Any] | None,
        precision: MixedPrecision | None,
    ) -> None:
        self.capture = functools.partial(capture_for, model, args, kwargs, precision=precision)
        self.whole = self.capture(MeshSpec.of({"dp": 1, "tp": 1}), None)
        self.reuse = False
        self.made: dict[int | None, Captured] = {}
        self.attempted: set[int | None] = set()  # shapes captured ahead, or tried

    def share(self, reuse: bool) -> None:
        """Whether every mesh shares the capture of its microbatch shape (:attr:`MeshSearch.reuse`)."""
        self.reuse = reuse
        self.made[None] = self._shared(self.whole)

    def _shared(self, made: Captured) -> Captured:
        # a capture every candidate of its shape plans on: what its ops save is measured here
        # once, before the children fork (each child's cache dies with it)
        if self.reuse:
            measure_saved(made.graph, gradient_flow(made))
        return made

    def of(self, c: MeshCandidate) -> Captured:
        """Candidate ``c``'s capture: made here, in this process, so that every later candidate of the
        same microbatch shape reuses it; the plan may be made in another."""
        if not self.reuse or c.shape not in self.made:
            self.made[c.shape] = self._shared(self.capture(MeshSpec.of(c.sizes), c.pipeline))
        return self.made[c.shape]

    def ahead(self, c: MeshCandidate) -> None:
        """Capture the shape ``c`` needs while the children plan (where captures are reused)."""
        if self.reuse and c.shape not in self.attempted:
            self.attempted.add(c.shape)
            try:
                self.of(c)
            except (PlanError, AnnotationError):  # raised again when the candidate is submitted
                pass


class UpdatePlanner(Protocol):
    """How :func:`plan` plans under one kind of update mode (registered in :data:`UPDATE_PLANNERS`)."""

    def plan(
        self,
        model: torch.nn.Module,
        example_args: Any,
        mesh: Mesh | int,
        example_kwargs: Mapping[str, Any] | None,
        options: PlanOptions,
    ) -> Plan:
        """The plan of the workers' ``mesh`` under ``options.update``, with ``Plan.update`` set."""


class ServerUpdatesPlanner:
    """The update modes of :mod:`autopar.ir.updates` (units exchanging with server ranks): the
    synchronous plan of the workers' mesh without ZeRO (the servers hold the optimizer state), and
    what the mode makes of its step (:func:`~autopar.planning.cost.update_cost.with_update`)."""

    def plan(
        self,
        model: torch.nn.Module,
        example_args: Any,
        mesh: Mesh | int,
        example_kwargs: Mapping[str, Any] | None,
        options: PlanOptions,
    ) -> Plan:
        update = options.update
        if isinstance(mesh, int):
            raise OptionError(
                f"update={update!r} plans the workers' mesh you give, such as {{'dp': 4}}; a device count "
                f"({mesh}) searches meshes for the synchronous update only"
            )
        memory = options.memory or Memory(zero=0)  # as compile(update=...): the servers hold the state
        spec = MeshSpec.of(mesh)
        example = {"example_args": example_args, "example_kwargs": example_kwargs}
        zero, offload = memory.zero, memory.offload_optimizer
        check_update(update, spec, pipeline=options.pipeline, zero=zero, offload=offload, example=example)
        # accumulation=1: a unit exchanges after every backward pass
        synchronous = replace(options, memory=memory, update=None, accumulation=1)
        return with_update(plan_on_mesh(model, example_args, spec, example_kwargs, synchronous), update)


#: The planner of each kind of update mode; a new mode registers its own here (and its compiler in
#: :data:`autopar.compiler.UPDATE_COMPILERS`).
UPDATE_PLANNERS: dict[type, UpdatePlanner] = dict.fromkeys(UPDATES, ServerUpdatesPlanner())


def update_planner(update: Update) -> UpdatePlanner:
    """The planner registered for ``update``'s kind (or the nearest kind it derives from).

    Args:
        update: an update mode, already checked (:class:`PlanOptions`).
    """
    return next(UPDATE_PLANNERS[kind] for kind in type(update).__mro__ if kind in UPDATE_PLANNERS)
