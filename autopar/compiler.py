"""``autopar.compile``: from a model, a mesh and a plan to a module that trains on the mesh.

Called on every rank (under ``torchrun`` or spawned processes) with a real, named
``DeviceMesh``. :func:`compile`, the keyword form users call, checks its options once
(:class:`~autopar.ir.options.PlanOptions`) and hands them whole to one of the functions below, each
returning one type: :func:`compile_module` (a ``DeviceMesh`` and example inputs),
:func:`compile_for_devices` (a device count), :func:`compile_on_first_call` (no example inputs) or
the update mode's compiler (:data:`UPDATE_COMPILERS`). The model is captured once; without a plan
it is planned once, on the mesh's first rank, and the plan sent to every other rank (see
:func:`_plan_once`); then the passes in ``autopar.passes.PASS_ORDER`` turn the captured graph into
the per-rank program, and :class:`~autopar.runtime.module.DistributedModule` runs it. Under a
pipeline, layouts and collectives live on the mesh of this rank's stages (the mesh without the
pipeline axis), and the program is split into one program per stage.

The runtime never plans: a loss function given to ``dmodel.train_step`` is compiled by
:class:`ProgramLosses`, the runtime's ``LossCompiler`` every module built here carries.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from autopar.capture.annotations import unclaimed_annotations
from autopar.capture.export import Captured, capture
from autopar.ir.errors import CompileError, PlanError
from autopar.ir.fake import fake_on
from autopar.ir.mesh import MeshSpec, check_in_world
from autopar.ir.options import Memory, MixedPrecision, Pipeline, PlanOptions
from autopar.ir.plan import Plan
from autopar.ir.printing import format_graph
from autopar.ir.updates import UPDATES, Update, check_update
from autopar.passes import PASS_ORDER
from autopar.passes.context import PassContext
from autopar.planning.assembly.lowering_record import lowering_record
from autopar.planning.assembly.plan_fit import check_plan_fits
from autopar.planning.cost.model import Cluster
from autopar.planning.entry_points import plan_for_devices
from autopar.planning.planner import Planned, capture_for, evaluate_captured, layout_mesh, plan_captured
from autopar.planning.search.accumulation import accumulated, batch_of
from autopar.runtime import collectives
from autopar.runtime.async_updates import Rejoining, ServerRank, UpdatedModule, place_unit
from autopar.runtime.lowered import LoweredProgram
from autopar.runtime.materialize import materialize
from autopar.runtime.module import DistributedModule, LossFn
from autopar.runtime.pipeline_runtime import device_of

_ON_FIRST_CALL = object()  # example_args not given: the first call is the example


def compile(  # noqa: A001 - the public name mirrors torch.compile
    model: torch.nn.Module,
    mesh: Any,
    example_args: Any = _ON_FIRST_CALL,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    plan: Plan | None = None,
    cluster: str | Cluster | None = None,
    time_limit: float = 30.0,
    seed: int = 0,
    pipeline: Pipeline | None = None,
    memory: Memory | None = None,
    memory_budget: float | None = None,
    precision: MixedPrecision | None = None,
    update: Update | None = None,
    check_ids: bool = True,
    accumulation: int | None = None,
) -> DistributedModule | CompiledOnFirstCall | UpdatedModule | ServerRank:
    """Compile ``model`` for ``mesh``; see the module docstring.

    A model built on ``meta`` is initialised by :func:`~autopar.runtime.materialize.materialize` as its
    own code would (a transformers model's ``_init_weights``, other modules' ``reset_parameters()``),
    under ``seed``, identically on every rank; a meta tensor nothing initialises raises
    :class:`~autopar.ir.errors.InitializationError` naming it and the remedies.

    Args:
        model: the model to compile.
        mesh: a ``DeviceMesh`` with axis names, or a number of devices (the mesh is searched, as
            ``autopar.plan`` does, and built over the whole process group).
        example_args: *global* example inputs (the whole batch). Without them, compiling waits for the
            first call, whose inputs are the example (as with ``torch.compile``): see
            :class:`CompiledOnFirstCall`.
        example_kwargs: global keyword example inputs (only with ``example_args``).
        plan: a saved plan to compile (it brings its pipeline, memory plan and precision); None plans.
        cluster, time_limit, seed, memory, memory_budget: as :func:`autopar.plan`'s.
        pipeline: a pipeline over one mesh axis (a saved ``plan`` brings its own).
        precision: compute in a lower precision with the parameters as fp32 master weights
            (:class:`~autopar.ir.options.MixedPrecision`; a saved plan brings its own).
        update: an update mode (:mod:`autopar.ir.updates`) in place of the data-parallel gradient sums:
            ``mesh`` is the workers' (``autopar.worker_mesh``; a worker restarted alone passes
            ``autopar.rejoin_mesh``), and a server rank gets a ``ServerRank`` to ``serve()``
            (docs/update_modes.md).
        check_ids: False lets vocab-parallel lookups skip their ``IndexRangeError`` checks
            (docs/op_rules.md).
        accumulation: microbatches ``train_step`` accumulates without a pipeline, as
            :func:`autopar.plan`'s (a saved ``plan`` brings its own); the program runs one microbatch.

    Returns:
        A :class:`~autopar.runtime.module.DistributedModule` (:func:`compile_module`,
        :func:`compile_for_devices`) whose parameters are DTensors under the original names, each rank
        holding its piece of the model's weights (under a pipeline, of its stages' weights only); a
        :class:`CompiledOnFirstCall` without example inputs; under ``update``, an ``UpdatedModule`` on a
        worker rank and a ``ServerRank`` on a server rank.
    """
    _check_model(model)
    options = PlanOptions(
        cluster=cluster,
        time_limit=time_limit,
        seed=seed,
        pipeline=pipeline,
        memory=memory,
        memory_budget=memory_budget,
        precision=precision,
        check_ids=check_ids,
        update=update,
        accumulation=accumulation,
    )
    if options.update is not None:
        return update_compiler(options.update).compile(
            model, mesh, example_args, example_kwargs, options, plan
        )
    if example_args is _ON_FIRST_CALL:
        if example_kwargs is not None:
            raise CompileError("example_kwargs were given without example_args: pass example_args=() too")
        return compile_on_first_call(model, mesh, options, plan)
    return _compile_now(model, mesh, example_args, example_kwargs, options, plan)


def _compile_now(
    model: torch.nn.Module,
    mesh: Any,
    example_args: Any,
    example_kwargs: Mapping[str, Any] | None,
    options: PlanOptions,
    plan: Plan | None,
) -> DistributedModule:
    """:func:`compile_for_devices` for a device count, else :func:`compile_module`."""
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        return compile_for_devices(model, mesh, example_args, example_kwargs, options, plan)
    return compile_module(model, mesh, example_args, example_kwargs, options, plan)


def _check_mesh(mesh: object) -> None:
    """Raise unless ``mesh`` is a ``DeviceMesh`` with axis names of this world's ranks (or a count)."""
    if not hasattr(mesh, "get_group") and not isinstance(mesh, int):
        raise CompileError(
            "autopar.compile needs a DeviceMesh with axis names (init_device_mesh(..., mesh_dim_names=...)); "
            "to plan without ranks use autopar.plan"
        )
    if hasattr(mesh, "get_group"):
        check_in_world(mesh)  # a mesh of ranks the world does not have


def compile_module(
    model: torch.nn.Module,
    mesh: Any,
    example_args: Any,
    example_kwargs: Mapping[str, Any] | None,
    options: PlanOptions,
    plan: Plan | None = None,
) -> DistributedModule:
    """``model`` compiled for ``mesh`` on its example inputs, planned under ``options`` unless ``plan``
    is given (``options.update`` is not read: see :data:`UPDATE_COMPILERS`).

    Args:
        model: the model to compile.
        mesh: a ``DeviceMesh`` with axis names, of this world's ranks.
        example_args: the global positional example inputs.
        example_kwargs: the global keyword example inputs, or None.
        options: what :func:`compile` was given.
        plan: a saved plan (its pipeline and precision must agree with ``options``'), or None.
    """
    _check_mesh(mesh)
    spec = MeshSpec.of(mesh)
    pipeline = _pipeline_of(plan, options.pipeline)
    stage_spec = layout_mesh(spec, pipeline)
    stage_mesh = mesh if pipeline is None else mesh[stage_spec.axis_names]
    unapplied = unclaimed_annotations(model)  # here: a model on meta is captured as a copy
    model = materialize(model, options.seed)
    t0 = time.perf_counter()
    precision = _precision_of(plan, options.precision)
    m = _accumulation_of(plan, options.accumulation)
    capturing = functools.partial(
        capture_for, model, example_args, example_kwargs, spec, pipeline, precision, stack_traces=True
    )
    captured = capturing(accumulation=m)
    captured.unapplied[:0] = unapplied
    if plan is None:
        solving, capture_s = replace(options, pipeline=pipeline), time.perf_counter() - t0

        def plan_with(o: PlanOptions, deterministic: bool) -> Planned:
            made = captured if (o.accumulation or 1) == m else capturing(accumulation=o.accumulation)
            return evaluate_captured(made, spec, o, capture_s=capture_s, deterministic=deterministic)

        args = example_args if isinstance(example_args, tuple) else (example_args,)
        batch = batch_of(args, example_kwargs or {})
        plan = _plan_once(
            mesh,
            lambda deterministic: accumulated(
                functools.partial(plan_with, deterministic=deterministic), batch, solving
            ).record(),
        )
    if plan.accumulation != m:  # the count the planner chose: the program runs its microbatch
        captured = capturing(accumulation=plan.accumulation)
        captured.unapplied[:0] = unapplied
    if plan.device_mesh_spec != spec:
        raise PlanError(
            f"the plan is for mesh {plan.device_mesh_spec}, but the module is compiled for {spec}"
        )
    check_plan_fits(plan, captured)
    return build_module(model, mesh, stage_mesh, captured, plan, pipeline, check_ids=options.check_ids)


def _accumulation_of(plan: Plan | None, accumulation: int | None) -> int:
    """The microbatches a step accumulates: a saved plan's (which ``accumulation`` must agree with),
    else the one given, else 1 until the planner chooses."""
    if plan is None:
        return accumulation or 1
    if accumulation not in (None, plan.accumulation):
        raise PlanError(
            f"the plan accumulates {plan.accumulation} microbatches per step, but compile was given "
            f"accumulation={accumulation}: plan again with it, or leave it out"
        )
    return plan.accumulation


def _pipeline_of(plan: Plan | None, pipeline: Pipeline | None) -> Pipeline | None:
    """The pipeline to compile with: the one given, else a saved plan's (which must agree)."""
    if plan is not None and plan.pipeline is not None:
        saved = plan.pipeline
        in_plan = Pipeline(
            microbatches=saved.microbatches,
            schedule=saved.schedule,
            virtual_stages=saved.virtual_stages,
            axis=saved.axis,
        )
        if pipeline not in (None, in_plan):
            raise PlanError(f"the plan pipelines with {in_plan}, but compile was given {pipeline}")
        return in_plan
    if plan is not None and pipeline is not None:
        raise PlanError("the plan has no pipeline, but compile was given one: plan again with the pipeline")
    return pipeline


def compile_for_devices(
    model: torch.nn.Module,
    devices: int,
    example_args: Any,
    example_kwargs: Mapping[str, Any] | None,
    options: PlanOptions,
    plan: Plan | None = None,
) -> DistributedModule:
    """``model`` compiled for ``devices`` devices: the mesh searched (``autopar.plan``'s automatic mesh)
    unless ``plan`` is given, and built over the whole process group, which has ``devices`` ranks.

    Args:
        model: the model to compile.
        devices: the number of devices, the process group's size.
        example_args: the global positional example inputs.
        example_kwargs: the global keyword example inputs, or None.
        options: what :func:`compile` was given.
        plan: a saved plan for ``devices`` devices, or None.
    """
    mesh, plan = _searched_mesh(model, devices, example_args, example_kwargs, plan, options)
    brought = replace(options, pipeline=None, precision=None)  # the plan brings them
    return compile_module(model, mesh, example_args, example_kwargs, brought, plan)


def compile_on_first_call(
    model: torch.nn.Module, mesh: Any, options: PlanOptions, plan: Plan | None = None
) -> CompiledOnFirstCall:
    """``model`` to compile on its first call, that call's inputs the example (:class:`CompiledOnFirstCall`).

    Args:
        model: the model to compile.
        mesh: a ``DeviceMesh`` with axis names, or a number of devices.
        options: what :func:`compile` was given.
        plan: a saved plan, or None.
    """
    _check_mesh(mesh)
    return CompiledOnFirstCall(model, mesh, options, plan)


class UpdateCompiler(Protocol):
    """How :func:`compile` compiles under one kind of update mode (registered in :data:`UPDATE_COMPILERS`)."""

    def compile(
        self,
        model: torch.nn.Module,
        mesh: Any,
        example_args: Any,
        example_kwargs: Mapping[str, Any] | None,
        options: PlanOptions,
        plan: Plan | None,
    ) -> UpdatedModule | ServerRank:
        """This rank's part of the job under ``options.update``: a worker's module or a server."""


class ServerUpdatesCompiler:
    """The update modes of :mod:`autopar.ir.updates` (:mod:`autopar.runtime.async_updates`): each unit
    compiled on its own mesh for its share of the batch, without ZeRO (the servers hold the optimizer
    state)."""

    def compile(
        self,
        model: torch.nn.Module,
        mesh: Any,
        example_args: Any,
        example_kwargs: Mapping[str, Any] | None,
        options: PlanOptions,
        plan: Plan | None,
    ) -> UpdatedModule | ServerRank:
        rejoining = isinstance(mesh, Rejoining)
        if not (rejoining or hasattr(mesh, "get_group")) or example_args is _ON_FIRST_CALL:
            raise CompileError(
                "compile(..., update=...) needs the workers' DeviceMesh (autopar.worker_mesh, or "
                "autopar.rejoin_mesh for a restarted worker) and example_args"
            )
        memory = options.memory or Memory(zero=0)
        world = dist.get_world_size() if dist.is_initialized() and not rejoining else None
        spec = mesh.spec if rejoining else MeshSpec.of(mesh)
        zero, offload = memory.zero, memory.offload_optimizer
        check_update(options.update, spec, world=world, pipeline=options.pipeline, zero=zero, offload=offload)
        place = place_unit(options.update, mesh, example_args, example_kwargs)
        if isinstance(place, ServerRank):
            return place
        unit = replace(options, memory=memory, memory_budget=None, update=None)
        return UpdatedModule.of(
            compile_module(model, place.mesh, place.args, place.kwargs, unit, plan), place
        )


#: The compiler of each kind of update mode; a new mode registers its own here (and its planner in
#: :data:`autopar.planning.entry_points.UPDATE_PLANNERS`).
UPDATE_COMPILERS: dict[type, UpdateCompiler] = dict.fromkeys(UPDATES, ServerUpdatesCompiler())


def update_compiler(update: Update) -> UpdateCompiler:
    """The compiler registered for ``update``'s kind (or the nearest kind it derives from).

    Args:
        update: an update mode, already checked (:class:`~autopar.ir.options.PlanOptions`).
    """
    return next(UPDATE_COMPILERS[kind] for kind in type(update).__mro__ if kind in UPDATE_COMPILERS)


def _precision_of(plan: Plan | None, precision: MixedPrecision | None) -> MixedPrecision | None:
    """The precision to capture in: the one given, else a saved plan's (which must agree)."""
    if plan is None or plan.precision is None:
        return precision
    saved = MixedPrecision.from_dict(plan.precision)
    if precision not in (None, saved):
        raise PlanError(f"the plan computes with {saved}, but compile was given {precision}")
    return saved


def _plan_once(mesh: Any | None, make_plan: Callable[[bool], Plan]) -> Plan:
    """The plan, solved once: on the mesh's first rank (rank 0 for ``None``: the whole job),
    sent to the others (as plain data) when the mesh spans the job, so the other ranks spend
    no time in the solver. An error planning there is raised on every rank. Otherwise (one
    rank, a fake process group) the rank plans alone, or (a mesh of part of the job) every
    rank of it plans: ``make_plan(deterministic)`` is then told to limit the solver by
    deterministic time alone, so that they agree.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 or dist.get_backend() == "fake":
        return make_plan(False)
    if mesh is not None and mesh.mesh.numel() != world:
        return make_plan(True)
    source = 0 if mesh is None else int(mesh.mesh.flatten()[0])
    box: list[Any] = [None]
    failure = None
    if dist.get_rank() == source:
        try:
            box[0] = make_plan(False).to_dict()
        except Exception as exc:  # noqa: BLE001 - re-raised here, and said on every other rank
            failure, box[0] = exc, f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(box, src=source)
    if failure is not None:
        raise failure
    if isinstance(box[0], str):
        raise PlanError(f"planning failed on rank {source}, which plans for the mesh: {box[0]}")
    return Plan.from_dict(box[0])


def lower(
    captured: Captured, plan: Plan, stage_mesh: Any, *, check_ids: bool = True
) -> tuple[torch.fx.GraphModule, PassContext]:
    """The per-rank program: ``autopar.passes.PASS_ORDER`` run on ``captured`` under ``plan``.

    ``stage_mesh`` is the ``DeviceMesh`` layouts refer to (one stage's under a pipeline);
    ``check_ids`` is :func:`compile`'s.
    Needs no weights: a model captured on ``meta`` lowers as well (``autopar show``). A plan
    without a lowering record (saved in format 4) is lowered as a copy holding the record the
    planner would have made; the plan given is left as it is.
    """
    if plan.lowering is None:
        plan = replace(plan, lowering=lowering_record(captured, plan))
    ctx = PassContext(
        mesh=MeshSpec.of(stage_mesh),
        device=device_of(stage_mesh.device_type),
        plan=plan,
        captured=captured,
        axis_keys=collectives.register_mesh(stage_mesh),
        coordinates=tuple(stage_mesh.get_local_rank(a) for a in range(stage_mesh.ndim)),
        check_ids=check_ids,
    )
    gm = captured.program.graph_module
    for p in PASS_ORDER:
        gm = p.run(gm, ctx)
        name = p.__name__.rsplit(".", 1)[-1]
        ctx.snapshots[name] = format_graph(gm.graph, f"after pass {name}")
    gm.graph.lint()
    gm.recompile()
    return gm, ctx


def build_module(
    model: torch.nn.Module,
    mesh: Any,
    stage_mesh: Any,
    captured: Captured,
    plan: Plan,
    pipeline: Pipeline | None = None,
    *,
    check_ids: bool = True,
) -> DistributedModule:
    """Lower ``captured`` under ``plan`` (:func:`lower`) and wrap the program in a ``DistributedModule``.

    ``stage_mesh`` is the ``DeviceMesh`` layouts refer to: ``mesh`` itself, or this
    rank's slice of it without the pipeline axis. ``check_ids`` is :func:`compile`'s, for this
    program and the losses the module's ``train_step`` compiles.
    """
    gm, ctx = lower(captured, plan, stage_mesh, check_ids=check_ids)
    lowered = LoweredProgram(
        program=gm,
        plan=ctx.plan,
        exported=ctx.captured.program,
        aliases=ctx.captured.aliases,
        axis_keys=ctx.axis_keys,
        grad_reductions=ctx.grad_reductions,
        stages=None if ctx.stages is None else tuple(ctx.stages),
        snapshots=ctx.snapshots,
        number_outputs=ctx.captured.number_outputs,
    )
    losses = ProgramLosses(check_ids)
    return DistributedModule(
        model, mesh, lowered, compile_loss=losses, stage_mesh=stage_mesh, pipeline=pipeline
    )


@dataclass(frozen=True)
class ProgramLosses:
    """The runtime's :class:`~autopar.runtime.module.LossCompiler`, as the compiler implements it: each
    loss function a module's ``train_step`` is given is compiled by :func:`compile_loss`, checking ids
    as the module does (``check_ids``: :func:`compile`'s). The runtime declares the interface and the
    compiler hands an instance to every module it builds, so the runtime never imports the compiler.
    """

    check_ids: bool = True

    def __call__(
        self, module: DistributedModule, loss_fn: LossFn, output: Any, target: torch.Tensor
    ) -> DistributedModule:
        return compile_loss(module, loss_fn, output, target, check_ids=self.check_ids)


class _Loss(torch.nn.Module):
    """``loss_fn(output, target)`` as a module, to be captured and compiled like a model."""

    def __init__(self, loss_fn: LossFn) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)


def _check_model(model: object) -> None:
    """What :func:`compile` checks before its options: the model."""
    if not isinstance(model, torch.nn.Module):
        raise CompileError(f"autopar.compile compiles an nn.Module, got {type(model).__name__} {model!r:.80}")


def compile_loss(
    module: DistributedModule, loss_fn: LossFn, output: Any, target: torch.Tensor, *, check_ids: bool = True
) -> DistributedModule:
    """``loss_fn(output, target)`` compiled for ``module``'s outputs (the runtime's ``LossCompiler``).

    ``output`` and ``target`` are ``meta`` examples of one microbatch. The loss is captured on
    fake tensors of the stage mesh's device (so it may hold tensors of its own there, such as
    class weights) and planned on ``module``'s plan's mesh and cluster with the outputs' layouts
    fixed to ``module.output_layouts`` (the target's is the solver's choice), then built on
    ``module``'s stage mesh, checking ids as the module does (``check_ids``: :func:`compile`'s).
    ``DistributedModule.train_step`` calls this on first use of a loss function and caches the result.
    """
    spec = module.plan.mesh_spec
    loss = _Loss(loss_fn)
    # traced on fake tensors of the ranks' device, not on meta: a loss may hold tensors of its own
    # (class weights, as a buffer or in a closure) on the device it runs on
    examples = fake_on((output, target), module.stage_mesh.device_type)
    captured = capture(loss, examples, None, spec)
    fixed = dict(zip(captured.inputs, module.output_layouts))  # the target, the last input, stays free
    cluster = Cluster.from_dict(module.plan.cluster)
    # every rank plans its loss apart: the deterministic limit alone makes their plans agree
    plan = plan_captured(captured, spec, cluster=cluster, fixed_inputs=fixed, deterministic=True)
    return build_module(loss, module.stage_mesh, module.stage_mesh, captured, plan, check_ids=check_ids)


def _searched_mesh(
    model: torch.nn.Module,
    devices: int,
    example_args: Any,
    example_kwargs: Mapping[str, Any] | None,
    plan: Plan | None,
    options: PlanOptions,
) -> tuple[Any, Plan]:
    """For ``compile(model, devices)``: the plan (the mesh searched unless ``plan`` is given) and a
    ``DeviceMesh`` of its axes over the whole process group."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise CompileError(
            f"autopar.compile(model, {devices}) builds its mesh over the process group: call "
            "torch.distributed.init_process_group first (torchrun), or pass a DeviceMesh"
        )
    if dist.get_world_size() != devices:
        raise CompileError(
            f"autopar.compile(model, {devices}) asks for {devices} devices, but the process group has "
            f"{dist.get_world_size()} ranks: pass the world size"
        )
    if plan is None:
        plan = _plan_once(
            None, lambda _: plan_for_devices(model, example_args, devices, example_kwargs, options)
        )
    spec = plan.device_mesh_spec
    if spec.size != devices:
        raise PlanError(f"the plan is for mesh {spec} ({spec.size} devices), not {devices}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, spec.axis_sizes, mesh_dim_names=spec.axis_names), plan


class CompiledOnFirstCall(torch.nn.Module):
    """A model ``autopar.compile`` compiles on its first call, that call's inputs the example.

    It stands in for the user's model in a training loop: every call takes the *global*
    batch, whole on every rank (as the plain model would), and each rank runs the compiled
    program on its own piece (``DistributedModule.shard_inputs``). The first call captures,
    plans and builds the :class:`~autopar.runtime.module.DistributedModule` (``compiled``);
    every attribute after that is the compiled module's (``plan``, ``code``, ``train_step``,
    ``gather_outputs``, ...), and so are the parameters, buffers and ``state_dict``.

    A compiled program has static shapes: a later call with another input shape or
    structure raises a ``ShapeError`` naming the input (rather than planning again, which
    would re-create the parameters under an optimizer that already holds the old ones).
    Before the first call there are no distributed parameters yet: asking for them raises,
    so an optimizer cannot silently be built on the plain model's.
    """

    def __init__(
        self, model: torch.nn.Module, mesh: Any, options: PlanOptions, plan: Plan | None = None
    ) -> None:
        """``model`` to compile for ``mesh`` (a ``DeviceMesh`` or a device count) under ``options``, and
        ``plan`` (a saved plan) unless None, as :func:`compile` would with the first call's inputs."""
        super().__init__()
        self.__dict__["_model"] = model  # not a submodule: its parameters are not this module's
        self.__dict__["_mesh"] = mesh
        self.__dict__["_options"] = options
        self.__dict__["_plan"] = plan
        self.compiled: DistributedModule | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            self.compiled = _compile_now(self._model, self._mesh, args, kwargs, self._options, self._plan)
        local_args, local_kwargs = self.compiled.shard_inputs(*args, **kwargs)
        return self.compiled(*local_args, **local_kwargs)

    def _require(self, what: str) -> DistributedModule:
        if self.compiled is None:
            raise CompileError(
                f"{type(self._model).__name__} compiles on its first call, so its distributed {what} do not "
                "exist yet: call the module once (a global batch) before building an optimizer or reading "
                "its state, or give autopar.compile example inputs"
            )
        return self.compiled

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self._require("parameters").named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        return self._require("buffers").named_buffers(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._require("state").state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._require("state").load_state_dict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._require(f"attributes ({name!r})"), name)
