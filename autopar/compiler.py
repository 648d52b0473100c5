"""``autopar.compile``: from a model, a mesh and a plan to a module that trains on the mesh.

Called on every rank (under ``torchrun`` or spawned processes) with a real, named
``DeviceMesh``. The model is captured once; without a plan it is planned once, on the
mesh's first rank, and the plan sent to every other rank (see :func:`_plan_once`); then
the passes in
``autopar.passes.PASS_ORDER`` turn the captured graph into the per-rank program, and
:class:`~autopar.runtime.module.DistributedModule` runs it. Under a pipeline, layouts and
collectives live on the mesh of this rank's stages (the mesh without the pipeline
axis), and the program is split into one program per stage.

The runtime never plans: a loss function given to ``dmodel.train_step`` is compiled by
:func:`compile_loss`, which every module built here carries.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from autopar.capture.annotations import unclaimed_annotations
from autopar.capture.export import Captured, capture
from autopar.ir.arguments import check_bool
from autopar.ir.errors import CompileError, PlanError
from autopar.ir.fake import fake_on
from autopar.ir.mesh import MeshSpec, check_in_world
from autopar.ir.options import Memory, MixedPrecision, Pipeline
from autopar.ir.plan import Plan
from autopar.ir.printing import format_graph
from autopar.ir.updates import Update, check_update
from autopar.passes import PASS_ORDER
from autopar.passes.context import PassContext
from autopar.planning.assembly.plan_fit import check_plan_fits
from autopar.planning.cost.model import Cluster, CostModel
from autopar.planning.planner import capture_for, layout_mesh, plan_captured
from autopar.planning.planner import plan as plan_model
from autopar.runtime import collectives
from autopar.runtime.async_updates import Rejoining, compile_for_update
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
) -> torch.nn.Module:
    """Compile ``model`` for ``mesh`` (a ``DeviceMesh`` with axis names); see the module docstring.

    ``example_args``/``example_kwargs`` are *global* example inputs (the whole batch).
    Without them, compiling waits for the first call, whose inputs are the example (as
    with ``torch.compile``): see :class:`CompiledOnFirstCall`.
    ``pipeline`` pipelines over one mesh axis (a saved ``plan`` brings its own).
    ``memory`` and ``memory_budget`` are :func:`autopar.plan`'s (a saved plan brings its
    memory plan). ``precision`` computes in a lower precision with the parameters as fp32
    master weights (:class:`~autopar.ir.options.MixedPrecision`; a saved plan brings its own).
    Returns a :class:`~autopar.runtime.module.DistributedModule` whose parameters are
    DTensors under the original names, each rank holding its piece of the model's
    weights (under a pipeline, of its stages' weights only). A model built on ``meta``
    is initialised by :func:`~autopar.runtime.materialize.materialize` as its own code
    would (a transformers model's ``_init_weights``, other modules' ``reset_parameters()``),
    under ``seed``, identically on every rank; a meta tensor nothing initialises raises
    :class:`~autopar.ir.errors.InitializationError` naming it and the remedies.
    ``update`` (:mod:`autopar.ir.updates`) replaces the data-parallel gradient sums by parameter
    servers: ``mesh`` is the workers' (``autopar.worker_mesh``; a worker restarted alone passes
    ``autopar.rejoin_mesh``), a server rank gets a ``ServerRank`` to ``serve()`` (docs/update_modes.md).
    ``check_ids=False`` lets vocab-parallel lookups skip their ``IndexRangeError`` checks (docs/op_rules.md).
    """
    _check_arguments(model, check_ids)
    if update is not None:
        options = dict(plan=plan, cluster=cluster, time_limit=time_limit, seed=seed, precision=precision)
        return _compile_for_update(
            model, mesh, example_args, example_kwargs, update, pipeline, memory, options, check_ids
        )
    if isinstance(mesh, int) and not isinstance(mesh, bool) and example_args is not _ON_FIRST_CALL:
        options = dict(cluster=cluster, time_limit=time_limit, seed=seed, pipeline=pipeline, memory=memory)
        more = {"memory_budget": memory_budget, "precision": precision}
        mesh, plan = _searched_mesh(model, mesh, example_args, example_kwargs, plan, {**options, **more})
        pipeline = precision = None  # the plan brings them
    if not hasattr(mesh, "get_group") and not isinstance(mesh, int):
        raise CompileError(
            "autopar.compile needs a DeviceMesh with axis names (init_device_mesh(..., mesh_dim_names=...)); "
            "to plan without ranks use autopar.plan"
        )
    if hasattr(mesh, "get_group"):
        check_in_world(mesh)  # a mesh of ranks the world does not have
    if example_args is _ON_FIRST_CALL:
        if example_kwargs is not None:
            raise CompileError("example_kwargs were given without example_args: pass example_args=() too")
        options = dict(plan=plan, cluster=cluster, time_limit=time_limit, seed=seed, pipeline=pipeline)
        more = {"memory": memory, "memory_budget": memory_budget, "precision": precision}
        return CompiledOnFirstCall(model, mesh, {**options, **more, "check_ids": check_ids})
    spec = MeshSpec.of(mesh)
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
        pipeline = in_plan
    elif plan is not None and pipeline is not None:
        raise PlanError("the plan has no pipeline, but compile was given one: plan again with the pipeline")
    stage_spec = layout_mesh(spec, pipeline)
    stage_mesh = mesh if pipeline is None else mesh[stage_spec.axis_names]
    unapplied = unclaimed_annotations(model)  # here: a model on meta is captured as a copy
    model = materialize(model, seed)
    t0 = time.perf_counter()
    precision = _precision_of(plan, precision)
    captured = capture_for(model, example_args, example_kwargs, spec, pipeline, precision, stack_traces=True)
    captured.unapplied[:0] = unapplied
    if plan is None:
        solving = {"cluster": cluster, "time_limit": time_limit, "seed": seed, "pipeline": pipeline}
        more = {"memory": memory, "memory_budget": memory_budget, "capture_s": time.perf_counter() - t0}
        plan = _plan_once(
            mesh,
            lambda deterministic: plan_captured(
                captured, spec, deterministic=deterministic, **solving, **more
            ),
        )
    if plan.device_mesh_spec != spec:
        raise PlanError(
            f"the plan is for mesh {plan.device_mesh_spec}, but the module is compiled for {spec}"
        )
    check_plan_fits(plan, captured)
    return build_module(model, mesh, stage_mesh, captured, plan, pipeline, check_ids=check_ids)


def _compile_for_update(
    model: torch.nn.Module,
    mesh: Any,
    example_args: Any,
    example_kwargs: Mapping[str, Any] | None,
    update: Update,
    pipeline: Pipeline | None,
    memory: Memory | None,
    options: dict[str, Any],
    check_ids: bool,
) -> Any:
    """``compile`` under an update mode: each unit compiled on its own mesh for its share of the
    batch, without ZeRO (the optimizer state lives on the servers)."""
    rejoining = isinstance(mesh, Rejoining)
    if not (rejoining or hasattr(mesh, "get_group")) or example_args is _ON_FIRST_CALL:
        raise CompileError(
            "compile(..., update=...) needs the workers' DeviceMesh (autopar.worker_mesh, or "
            "autopar.rejoin_mesh for a restarted worker) and example_args"
        )
    memory = memory or Memory(zero=0)
    world = dist.get_world_size() if dist.is_initialized() and not rejoining else None
    check_update(
        update,
        mesh.spec if rejoining else MeshSpec.of(mesh),
        world=world,
        pipeline=pipeline,
        zero=memory.zero,
        offload=memory.offload_optimizer,
    )
    return compile_for_update(
        update,
        mesh,
        example_args,
        example_kwargs,
        lambda unit_mesh, args, kwargs: compile(
            model, unit_mesh, args, example_kwargs=kwargs, memory=memory, check_ids=check_ids, **options
        ),
    )


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
    Needs no weights: a model captured on ``meta`` lowers as well (``autopar show``).
    """
    ctx = PassContext(
        mesh=MeshSpec.of(stage_mesh),
        device=device_of(stage_mesh.device_type),
        plan=plan,
        cost=CostModel(MeshSpec.of(stage_mesh), Cluster.from_dict(plan.cluster)),
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
    losses = functools.partial(compile_loss, check_ids=check_ids)
    return DistributedModule(
        model, mesh, lowered, compile_loss=losses, stage_mesh=stage_mesh, pipeline=pipeline
    )


class _Loss(torch.nn.Module):
    """``loss_fn(output, target)`` as a module, to be captured and compiled like a model."""

    def __init__(self, loss_fn: LossFn) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)


def _check_arguments(model: object, check_ids: object) -> None:
    """What :func:`compile` is given that no later step checks first: the model and ``check_ids``."""
    if not isinstance(model, torch.nn.Module):
        raise CompileError(f"autopar.compile compiles an nn.Module, got {type(model).__name__} {model!r:.80}")
    check_bool(check_ids, "compile(check_ids=...)")


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
    options: dict[str, Any],
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
            None, lambda _: plan_model(model, example_args, devices, example_kwargs=example_kwargs, **options)
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

    def __init__(self, model: torch.nn.Module, mesh: Any, options: dict[str, Any]) -> None:
        super().__init__()
        self.__dict__["_model"] = model  # not a submodule: its parameters are not this module's
        self.__dict__["_mesh"] = mesh
        self.__dict__["_options"] = options
        self.compiled: DistributedModule | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            self.compiled = compile(self._model, self._mesh, args, example_kwargs=kwargs, **self._options)
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
