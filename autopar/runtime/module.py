"""The distributed module: the per-rank program, DTensor parameters, bucketed gradient sync.

:class:`DistributedModule` owns a copy of the user's modules whose parameters and
buffers are DTensors on the mesh in their planned placements, under their original
names, so ``state_dict()`` keys, ``p.full_tensor()``, ``torch.optim`` and
``torch.distributed.checkpoint`` work as on any DTensor model. Its ``forward`` takes
this rank's *local* inputs (see :meth:`DistributedModule.shard_inputs`), runs the
compiled program on local tensors and returns the original output structure; a
scalar loss comes back replicated.

Gradients that only need summing over some mesh axes (data parallelism) are reduced
by :class:`~autopar.runtime.grad_reducer.GradReducer` in buckets, each launched as soon
as its last gradient is ready in backward, overlapping communication with the rest of
backward.

On a CPU mesh the module keeps freed host memory in the process (``host_memory``, see
:mod:`autopar.runtime.host_memory`), so a step's activations do not page-fault back in.

The module runs what the compiler lowered (:class:`~autopar.runtime.lowered.LoweredProgram`)
and never plans: a loss function given to ``train_step`` is compiled by the
:class:`LossCompiler` the compiler handed over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from autopar.ir.arguments import check_input_tensor, input_structure
from autopar.ir.errors import CompileError, OptionError, ShapeError
from autopar.ir.layout import Layout, format_layout, local_shape
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import LAYOUTS, output_layout
from autopar.ir.options import PRECISIONS, Memory, Pipeline
from autopar.ir.printing import format_graph
from autopar.runtime import offload
from autopar.runtime.checkpoint import keep_checkpoints_plain
from autopar.runtime.grad_reducer import GradReducer
from autopar.runtime.host_memory import keep_freed_host_memory
from autopar.runtime.loss_scaler import LossScaler
from autopar.runtime.lowered import LoweredProgram
from autopar.runtime.materialize import as_dtensor, distributed_copy, local_piece
from autopar.runtime.optimizer import ZeroShard, held_bytes, make_optimizer
from autopar.runtime.pipeline_runtime import PipelineRuntime, device_of
from autopar.runtime.program_errors import naming_the_source

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]  # loss_fn(output, target) -> a scalar loss


class LossCompiler(Protocol):
    """Compiles a loss function for a module's outputs: the interface the runtime declares and the
    compiler implements (:class:`autopar.compiler.ProgramLosses`), handed to each module it builds, so
    that the runtime compiles losses without importing the compiler (the layer rule)."""

    def __call__(
        self, module: DistributedModule, loss_fn: LossFn, output: Any, target: torch.Tensor
    ) -> DistributedModule:
        """``loss_fn(output, target)`` compiled for ``module``: planned and built on its stage mesh.

        ``output`` (shaped like the module's outputs) and ``target`` are ``meta`` examples
        of one microbatch; the program takes the outputs in ``module.output_layouts``.
        """


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a model returns: the output itself, or its ``loss`` field (transformers' outputs)."""
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ShapeError(
            f"train_step without a loss_fn needs the model to return its loss (a scalar tensor, or an "
            f"output with a 'loss' field); it returned {type(output).__name__}: pass loss_fn=..."
        )
    return loss


class DistributedModule(torch.nn.Module):
    """A model compiled by ``autopar.compile``; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        device_mesh: Any,
        lowered: LoweredProgram,
        *,
        compile_loss: LossCompiler,
        stage_mesh: Any = None,
        pipeline: Pipeline | None = None,
    ) -> None:
        """This rank's pieces of ``model``'s state, bound to ``lowered``'s program.

        ``stage_mesh`` is the mesh layouts refer to: ``device_mesh`` itself, or this
        rank's slice of it without ``pipeline``'s axis. ``compile_loss`` compiles the loss
        functions :meth:`train_step` is given.
        """
        super().__init__()
        self.device_mesh = device_mesh
        self._device = device_of(device_mesh.device_type)  # where this rank computes
        # a CPU step's activations would page-fault back in every step (runtime/host_memory.py)
        self.host_memory = keep_freed_host_memory() if device_mesh.device_type == "cpu" else None
        # the mesh layouts and DTensor parameters live on: one stage's under a pipeline
        self.stage_mesh = device_mesh if stage_mesh is None else stage_mesh
        self.plan = lowered.plan
        # not a submodule: keeps state_dict keys unchanged
        object.__setattr__(self, "_program", lowered.program)
        self._lowered = lowered
        self._compile_loss = compile_loss
        self.axis_keys = dict(lowered.axis_keys)  # mesh axis -> the name the collectives know it by
        local_stages = None
        if lowered.stages is not None and pipeline is not None:
            rank, size = device_mesh.get_local_rank(pipeline.axis), pipeline.size(MeshSpec.of(device_mesh))
            local_stages = [st for st in lowered.stages if st.index % size == rank]
        kept = None
        if local_stages is not None:  # under a pipeline, this rank holds its stages' state only
            kept = lowered.state_names(name for st in local_stages for name in st.state)
        named = self._hold_state(model, kept)
        keep_checkpoints_plain(self, self.plan.manual_rows)  # DCP reads every piece as one block
        self._bind_state(named)
        self._read_signature()
        self._prepare_gradients(named)
        self._loss_tails: dict[LossFn, DistributedModule] = {}  # loss_fn -> its compiled program
        self.pipeline = None
        if local_stages is not None:
            self.pipeline = PipelineRuntime(
                local_stages,
                len(lowered.stages),
                pipeline,
                device_mesh.get_group(pipeline.axis),
                [[self._state[name] for name in st.state] for st in local_stages],
                self._device,
            )

    def _hold_state(self, model: torch.nn.Module, kept: set[str] | None) -> dict[str, torch.Tensor]:
        """Adopt the submodules of :func:`distributed_copy` of ``model``: this rank's pieces, as DTensors.

        Returns every name of a parameter or buffer, duplicates included, with its tensor.
        """
        placements = self.plan.parameter_placements
        replica = distributed_copy(model, placements, self.stage_mesh, kept, self.plan.manual_rows)
        self._modules.update(replica._modules)
        self._parameters.update(replica._parameters)
        self._buffers.update(replica._buffers)
        named = dict(self.named_parameters(remove_duplicate=False))
        named.update(self.named_buffers(remove_duplicate=False))
        return named

    def _bind_state(self, named: dict[str, torch.Tensor]) -> None:
        """What this rank passes the program for each placeholder that is not a user input."""
        # The program computes with plain local leaves sharing storage with the DTensors
        # (optimizer updates and checkpoint loads write through); autograd on plain tensors
        # is far cheaper than on DTensor leaves, and GradReducer hands gradients back.
        self._leaves: dict[int, torch.Tensor] = {}
        for t in named.values():
            if id(t) not in self._leaves:
                leaf = t.detach().to_local().detach()  # a plain view: buffers take in-place updates
                self._leaves[id(t)] = leaf.requires_grad_(t.requires_grad) if t.requires_grad else leaf
        exported = self._lowered.exported
        self._state: dict[str, Any] = {}  # placeholder -> the tensor this rank passes for it
        for s in exported.graph_signature.input_specs:
            if s.kind in (InputKind.PARAMETER, InputKind.BUFFER) and s.target in named:
                self._state[s.arg.name] = self._leaves[id(named[s.target])]
            elif s.kind == InputKind.CONSTANT_TENSOR:
                # captured on the example inputs' device: the program runs on this rank's
                self._state[s.arg.name] = exported.constants[s.target].to(self._device)
            elif s.kind != InputKind.USER_INPUT and s.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
                self._state[s.arg.name] = None

    def _read_signature(self) -> None:
        """The program's inputs and outputs: names, pytree structures, global shapes and layouts."""
        exported, program = self._lowered.exported, self._lowered.program
        specs = exported.graph_signature.input_specs
        self._placeholders = [s.arg.name for s in specs]
        self._input_names = [s.arg.name for s in specs if s.kind == InputKind.USER_INPUT]
        self._user_outputs = [
            i for i, s in enumerate(exported.graph_signature.output_specs) if s.kind == OutputKind.USER_OUTPUT
        ]
        self._out_spec = exported.call_spec.out_spec
        self._in_spec = exported.call_spec.in_spec
        nodes = {n.name: n for n in program.graph.nodes}
        self._input_layouts = {
            name: output_layout(nodes[name])
            for name in self._input_names
            if name in nodes and LAYOUTS in nodes[name].meta
        }
        # a non-tensor input (use_cache=False, return_dict=True) is a constant of the program
        self._constant_inputs = {
            name: nodes[name].meta.get("val")
            for name in self._input_names
            if name in nodes and not isinstance(nodes[name].meta.get("val"), torch.Tensor)
        }
        self._input_global = {name: tuple(nodes[name].meta["val"].shape) for name in self._input_layouts}
        self._input_examples = {name: nodes[name].meta["val"] for name in self._input_layouts}
        output = next(n for n in program.graph.nodes if n.op == "output")
        results = pytree.tree_leaves(output.args)
        self._outputs = [results[i] for i in self._user_outputs]
        self._output_layouts = [
            output_layout(a) if isinstance(a, torch.fx.Node) and LAYOUTS in a.meta else None
            for a in self._outputs
        ]

    def _prepare_gradients(self, named: dict[str, torch.Tensor]) -> None:
        """The memory plan's ZeRO shards and the reducer that sums and delivers gradients."""
        axes_of = {
            id(named[s.target]): self._lowered.grad_reductions.get(s.arg.name, ())
            for s in self._lowered.exported.graph_signature.input_specs
            if s.kind == InputKind.PARAMETER and s.target in named
        }
        memory = self.plan.memory
        self.memory = memory.options if memory is not None else Memory(zero=0)
        # ZeRO-1/2: this rank's piece of each split parameter, for the optimizer (and ZeRO-2's gradients)
        self.zero_shards: dict[int, ZeroShard] = {}
        if memory is not None and memory.zero in (1, 2):
            # in parameter order, the same on every rank: the shards are gathered in this order
            for fqn, p in self.named_parameters():  # under a pipeline, this rank's stages' only
                if fqn in memory.zero_splits:
                    axis, dim = memory.zero_splits[fqn]
                    shard = ZeroShard(p, self._leaves[id(p)], axis, dim, self.axis_keys[axis])
                    self.zero_shards[id(p)] = shard
        precision = self.plan.precision or {}
        self.grad_reducer = GradReducer(
            [(p, self._leaves[id(p)], axes_of.get(id(p), ())) for p in self.parameters() if p.requires_grad],
            scattered=self.zero_shards if self.memory.zero == 2 else None,
            reduce_dtype=PRECISIONS.get(precision.get("reduce_dtype")),
        )

    # --- inputs and outputs ---------------------------------------------------------
    def _user_leaves(self, args: tuple, kwargs: dict) -> list[Any]:
        ordered = self._ordered_kwargs(kwargs)
        leaves, spec = pytree.tree_flatten((args, ordered))
        if spec != self._in_spec:
            raise ShapeError(
                f"inputs must have the structure the module was compiled with: "
                f"{input_structure(self._in_spec, spec, self._input_names)}"
            )
        return leaves

    def _ordered_kwargs(self, kwargs: dict) -> dict:
        keys = self._in_spec.child(1).context if self._in_spec.num_children == 2 else []
        unknown = set(kwargs) - set(keys)
        if unknown:
            raise ShapeError(f"unexpected keyword inputs {sorted(unknown)}; compiled with {list(keys)}")
        return {k: kwargs[k] for k in keys if k in kwargs}

    def shard_inputs(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """This rank's local inputs from a global batch that every rank holds whole."""
        leaves = self._user_leaves(args, kwargs)
        for name, t in zip(self._input_names, leaves):
            self._check(name, t, is_global=True)
        local = [  # on this rank's device, as the batch of a model on a GPU need not be
            local_piece(t, self._input_layouts[n], self.stage_mesh).to(self._device)
            if isinstance(t, torch.Tensor)
            else t
            for t, n in zip(leaves, self._input_names)
        ]
        local_args, local_kwargs = pytree.tree_unflatten(local, self._in_spec)
        return tuple(local_args), dict(local_kwargs)

    def gather_outputs(self, out: Any) -> Any:
        """Global tensors from this rank's outputs (collective: every rank must call it)."""
        leaves, spec = pytree.tree_flatten(out)
        whole = [
            as_dtensor(t, self.stage_mesh, lay, o.meta["val"]).full_tensor()
            if isinstance(t, torch.Tensor) and lay is not None
            else t
            for t, lay, o in zip(leaves, self._output_layouts, self._outputs)
        ]
        return pytree.tree_unflatten(whole, spec)

    def _check(self, name: str, t: Any, is_global: bool = False) -> None:
        if name in self._constant_inputs:
            compiled = self._constant_inputs[name]
            if type(t) is not type(compiled) or t != compiled:
                raise ShapeError(
                    f"input '{name}' is {t!r}, but the module was compiled with {name}={compiled!r}: a non-"
                    "tensor input is a constant of the compiled program; compile again for another value"
                )
            return
        if name not in self._input_layouts:
            return
        check_input_tensor(name, t, self._input_examples[name])  # a tensor of the compiled dtype
        layout, whole = self._input_layouts[name], self._input_global[name]
        expected = whole if is_global else local_shape(whole, layout, self.plan.mesh_spec)
        if tuple(t.shape) != expected:
            shown = f"global shape {whole}" if is_global else f"local piece {expected} (global {whole})"
            fix = "compile again for it" if is_global else "pass dmodel.shard_inputs(...) of the batch"
            raise ShapeError(
                f"input '{name}' has shape {tuple(t.shape)}; compiled for the {shown} laid out "
                f"{format_layout(layout)} on mesh {self.plan.mesh_spec} (static shapes): {fix}"
            )

    def program_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """The per-rank program's flat inputs: local parameters and buffers, constants, local inputs."""
        leaves = dict(zip(self._input_names, self._user_leaves(args, kwargs)))
        for name, t in leaves.items():
            self._check(name, t)
        return [leaves[name] if name in leaves else self._state[name] for name in self._placeholders]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise CompileError(
                "a pipelined module runs whole training steps across its stages' ranks: "
                "call dmodel.train_step(inputs, target, loss_fn)"
            )
        inputs = self.program_inputs(args, kwargs)
        offload = self.memory.offload_activations
        with self.activations_to_host(inputs) if offload else contextlib.nullcontext(), naming_the_source():
            outs = self._program(*inputs)
        leaves = [outs[i] for i in self._user_outputs]
        for i in self._lowered.number_outputs:  # whole on every rank: the plan reduced them
            leaves[i] = leaves[i].item()
        return pytree.tree_unflatten(leaves, self._out_spec)

    # --- training ----------------------------------------------------------------------
    def train_step(
        self,
        inputs: Any,
        target: torch.Tensor | None = None,
        loss_fn: LossFn | None = None,
        loss_scaler: LossScaler | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one global batch; returns the loss, on every rank.

        ``inputs`` are the model's inputs for the whole batch, the same on every rank:
        a tensor, a tuple of positional inputs or a dict of keyword inputs.
        ``loss_fn(output, target)`` computes the loss from the model's output; it is
        captured, planned (taking the output in its planned layout) and compiled on first
        use, once per function object. Without ``loss_fn`` the model's output is the loss
        (a scalar, or an output with a ``loss`` field) and ``target`` must be None.
        Gradients are added to ``p.grad`` (summed across data-parallel ranks); step the
        optimizer afterwards. Under a pipeline the batch runs as microbatches (dim 0 of
        every input and of ``target``) in the planned schedule, each microbatch's loss
        weighted ``1/microbatches``: the loss must be a mean over the batch, and the
        result is the mean over microbatches. A plan that accumulates ``m`` microbatches without a
        pipeline (``plan.accumulation``) runs forward and backward on each in turn, its loss
        weighted ``1/m`` and the gradient sums deferred to the last (one sum per step), and returns
        the mean too. With ``loss_scaler`` the backward runs on the
        loss times its scale (fp16: see :mod:`autopar.runtime.loss_scaler`); the loss returned
        is not scaled.
        """
        if isinstance(inputs, Mapping):
            args, kwargs = (), dict(inputs)
        else:
            args, kwargs = (inputs if isinstance(inputs, tuple) else (inputs,)), {}
        if loss_fn is None and target is not None:
            raise ShapeError("train_step was given a target but no loss_fn to compare the output with")
        if loss_fn is not None and not callable(loss_fn):
            raise OptionError(
                f"train_step's loss_fn must be a function loss_fn(output, target), got "
                f"{type(loss_fn).__name__} {loss_fn!r:.60}"
            )
        tail = None if loss_fn is None else self._loss_tail(loss_fn, target)
        if self.pipeline is None and self.plan.accumulation > 1:
            return self._accumulated_step(args, kwargs, target, tail, loss_scaler)
        if self.pipeline is None:
            local_args, local_kwargs = self.shard_inputs(*args, **kwargs)
            out = self(*local_args, **local_kwargs)
            loss = _loss_of(out) if tail is None else tail(out, tail.local_target(target, 1))
            (loss if loss_scaler is None else loss_scaler.scale(loss)).backward()
            return loss.detach()
        m = self.pipeline.pipeline.microbatches
        leaves = dict(zip(self._input_names, self._user_leaves(args, kwargs)))
        for name in self._constant_inputs:
            self._check(name, leaves.pop(name))  # constants are the program's own: only tensors cross stages
        local = [self._microbatches(name, t, m) for name, t in leaves.items()]

        # the schedule keeps the first function it is given: the scale is read when it runs
        self._loss_scale = 1.0 if loss_scaler is None else loss_scaler.scale_value

        def microbatch_loss(output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
            out = pytree.tree_unflatten(list(output), self._out_spec)
            return (_loss_of(out) if tail is None else tail(out, target)) * (self._loss_scale / m)

        # torch's schedules hand the loss function one target per microbatch; a model that
        # computes its own loss gets placeholders
        local_target = torch.zeros(m, device=self._device) if tail is None else tail.local_target(target, m)
        self.grad_reducer.expect(m)
        return self.pipeline.step(local, local_target, microbatch_loss, loss_fn) / self._loss_scale

    def _accumulated_step(
        self,
        args: tuple,
        kwargs: dict,
        target: torch.Tensor | None,
        tail: DistributedModule | None,
        loss_scaler: LossScaler | None,
    ) -> torch.Tensor:
        """:meth:`train_step` of a plan accumulating ``plan.accumulation`` microbatches: each one's
        forward and backward (its loss weighted ``1/m``), the gradient reducer summing every
        gradient after the last (:meth:`~autopar.runtime.grad_reducer.GradReducer.expect`); the mean loss."""
        m = self.plan.accumulation
        leaves = self._user_leaves(args, kwargs)
        # every input checked and cut before the reducer waits for m backward passes
        pieces = [
            self._chunks(name, t, m) if name in self._input_layouts else [t] * m
            for name, t in zip(self._input_names, leaves)
        ]
        targets = [None] * m if tail is None else tail._chunks(tail._input_names[-1], target, m)
        self.grad_reducer.expect(m)
        losses = []
        for i in range(m):
            chunk_args, chunk_kwargs = pytree.tree_unflatten([p[i] for p in pieces], self._in_spec)
            local_args, local_kwargs = self.shard_inputs(*chunk_args, **chunk_kwargs)
            out = self(*local_args, **local_kwargs)
            loss = _loss_of(out) if tail is None else tail(out, tail.local_target(targets[i], 1))
            (loss / m if loss_scaler is None else loss_scaler.scale(loss / m)).backward()
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    def _chunks(self, name: str, t: Any, m: int) -> tuple[torch.Tensor, ...]:
        """Global input ``t`` cut into the ``m`` microbatches the module was compiled for (dim 0)."""
        check_input_tensor(name, t, self._input_examples[name])  # a tensor of the compiled dtype
        one = self._input_global[name]
        if t.dim() == 0 or (t.shape[0], *t.shape[1:]) != (m * one[0], *one[1:]):
            raise ShapeError(
                f"input '{name}' has shape {tuple(t.shape)}, but the module was compiled for batches of "
                f"{m} microbatches shaped {one}: {(m * one[0], *one[1:])}"
            )
        return t.chunk(m)

    def _microbatches(self, name: str, t: Any, m: int) -> Any:
        """This rank's pieces of the ``m`` microbatches of global input ``t``, concatenated along dim 0."""
        layout = self._input_layouts[name]
        return torch.cat([local_piece(c, layout, self.stage_mesh) for c in self._chunks(name, t, m)])

    def local_target(self, target: torch.Tensor, m: int) -> torch.Tensor:
        """For a compiled loss: this rank's pieces of ``m`` microbatches of a global ``target``."""
        return self._microbatches(self._input_names[-1], target, m)

    def compiled_loss(self, loss_fn: LossFn) -> DistributedModule:
        """The program ``train_step`` compiled for ``loss_fn`` (with its ``plan`` and ``code``), once run."""
        try:
            return self._loss_tails[loss_fn]
        except KeyError:
            raise KeyError(f"{loss_fn!r} has not been compiled: call train_step with it first") from None

    def _loss_tail(self, loss_fn: LossFn, target: Any) -> DistributedModule:
        """``loss_fn`` compiled for this module's outputs, in their layouts (cached per function)."""
        if not isinstance(target, torch.Tensor):
            raise ShapeError(f"train_step needs the target as one tensor, got {type(target).__name__}")
        tail = self._loss_tails.get(loss_fn)
        if tail is not None:
            return tail
        m = self.plan.accumulation if self.pipeline is None else self.pipeline.pipeline.microbatches
        if target.dim() == 0 or target.shape[0] % m:
            raise ShapeError(
                f"target has shape {tuple(target.shape)}, which cannot be cut into {m} microbatches "
                f"along dim 0"
            )
        vals = [node.meta["val"] for node in self._outputs]
        output = pytree.tree_unflatten(
            [torch.empty_like(v, device="meta").requires_grad_(v.dtype.is_floating_point) for v in vals],
            self._out_spec,
        )
        example = torch.empty((target.shape[0] // m, *target.shape[1:]), dtype=target.dtype, device="meta")
        tail = self._compile_loss(self, loss_fn, output, example)
        self._loss_tails[loss_fn] = tail
        return tail

    @property
    def loss_programs(self) -> list[DistributedModule]:
        """The losses ``train_step`` compiled so far (each with its ``plan``), in order of first use."""
        return list(self._loss_tails.values())

    @property
    def output_layouts(self) -> list[Layout | None]:
        """The planned layout of each leaf of the model's output (None where it has none: not a tensor)."""
        return list(self._output_layouts)

    @contextlib.contextmanager
    def activations_to_host(self, inputs: Iterable[Any] = ()) -> Iterator[None]:
        """Keep what autograd saves in this block in host memory, copied back in backward.

        A tensor saved several times (or through views) is copied once; one living in
        ``inputs`` (the parameters, the batch: memory the step does not allocate) stays
        where it is. ``host_activation_bytes`` is what the last forward put on the host (the
        plan predicts it). What a recompute region keeps (its inputs, the outputs its policy
        saves) stays with the region.
        """
        self.host_activation_bytes = 0
        with offload.activations_to_host(inputs, pin=self.device_mesh.device_type == "cuda") as host:
            # the count, not the copies: they must be freed once backward has used them
            try:
                yield
            finally:
                self.host_activation_bytes = host.nbytes

    def optimizer(
        self, optimizer_class: Callable[..., torch.optim.Optimizer], **options: Any
    ) -> torch.optim.Optimizer:
        """``optimizer_class(params, **options)`` for this module, as its memory plan holds state.

        Without ZeRO-1/2 or offload, a plain optimizer over ``self.parameters()``; with
        them, one over this rank's ZeRO shards (or host copies) whose ``step()`` also
        gathers the updated shards (see :mod:`autopar.runtime.optimizer`). Under ZeRO-2 the full
        parameters have no ``grad``: the shards' optimizer holds the gradients.
        """
        m = self.memory
        if m.zero not in (1, 2) and not m.offload_optimizer:
            return optimizer_class(self.parameters(), **options)
        return make_optimizer(
            list(self.parameters()),
            self.zero_shards,
            m.zero,
            m.offload_optimizer,
            torch.device("cpu"),
            optimizer_class,
            **options,
        )

    def state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds now, measured from the live tensors: see :func:`held_bytes`."""
        return held_bytes(self, optimizer)

    # --- introspection ------------------------------------------------------------------
    @property
    def code(self) -> str:
        """The per-rank program as Python, every collective visible, layouts in comments."""
        return format_graph(
            self._program.graph, f"Constructed by autopar.compile on mesh {self.plan.mesh_spec}"
        )

    @property
    def pass_snapshots(self) -> dict[str, str]:
        """The graph printed after each pass, by pass name."""
        return dict(self._lowered.snapshots)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (several backward passes, one reduction after the last)."""
        self.grad_reducer.enabled = False
        try:
            yield
        finally:
            self.grad_reducer.enabled = True
