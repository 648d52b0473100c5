"""The distributed module: the per-rank program, DTensor parameters, bucketed gradient sync.

:class:`DistributedModule` owns a copy of the user's modules whose parameters and
buffers are DTensors on the mesh in their planned placements, under their original
names, so ``state_dict()`` keys, ``p.full_tensor()``, ``torch.optim`` and
``torch.distributed.checkpoint`` work as on any DTensor model. Its ``forward`` takes
this rank's *local* inputs (see :meth:`DistributedModule.shard_inputs`), runs the
compiled program on local tensors and returns the original output structure; a
scalar loss comes back replicated.

Gradients that only need summing over some mesh axes (data parallelism) are reduced
by :class:`GradReducer` in buckets, each launched as soon as its last gradient is
ready in backward, overlapping communication with the rest of backward.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.export.graph_signature import InputKind, OutputKind
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from autopar.ir.errors import CompileError, ShapeError
from autopar.ir.layout import Layout, format_layout, local_shape
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import LAYOUTS
from autopar.ir.options import Memory, Pipeline
from autopar.ir.printing import format_graph
from autopar.runtime import collectives
from autopar.runtime.optimizer import ZeroShard, make_optimizer
from autopar.runtime.pipeline_runtime import PipelineRuntime

if TYPE_CHECKING:
    from autopar.passes.context import PassContext

# As DDP: a small first bucket, so the first sum starts early in backward, then big ones.
FIRST_BUCKET_BYTES = 2**20
BUCKET_BYTES = 25 * 2**20


def local_piece(t: torch.Tensor, layout: Layout, mesh: Any) -> torch.Tensor:
    """This rank's piece of a global tensor that every rank holds whole (no communication).

    A split piece is a copy: a view would keep the whole tensor's memory alive.
    """
    piece = t
    for axis, p in enumerate(layout):
        if isinstance(p, Shard):
            n = mesh.size(axis)
            piece = piece.chunk(n, dim=p.dim)[mesh.get_local_rank(axis)]
    return piece.contiguous() if piece is t else piece.clone(memory_format=torch.contiguous_format)


class GradReducer:
    """Delivers gradients to the DTensor parameters, summing them over mesh axes where needed.

    The program computes with plain local leaves (see :class:`DistributedModule`); when a
    leaf's gradient is complete, its post-accumulate hook takes it. A gradient that needs
    no sum goes straight to ``p.grad`` (as a DTensor). The others are copied into a
    persistent flat buffer per bucket (the first about 1 MiB, the others about
    ``bucket_bytes``; one set of mesh axes per bucket, parameters in reverse order,
    roughly the order backward produces them);
    a full bucket is all-reduced asynchronously, overlapping the rest of backward, and
    the last bucket of a backward pass waits for all of them and hands out views of the
    sums. Every backward pass's contribution is summed and added to ``p.grad``, so
    gradients accumulate over several backward passes as on one device; inside
    :meth:`DistributedModule.no_sync` the leaves keep accumulating and the next pass
    outside it sums everything once. :meth:`expect` does the same for the microbatches
    of a pipeline step: each leaf is summed after its last microbatch's backward.

    Under ZeRO-2 (``scattered``: the :class:`~autopar.runtime.optimizer.ZeroShard` of each
    parameter split, by ``id``) a split parameter's bucket is laid out rank by rank (piece
    ``r`` of every parameter in region ``r``), summed over its other axes, then
    reduce-scattered over the split axis; each rank keeps only its region, as the shards'
    gradients, and the full bucket lives only until then.
    """

    def __init__(
        self,
        params: list[tuple[torch.nn.Parameter, torch.Tensor, tuple[str, ...]]],
        bucket_bytes: int = BUCKET_BYTES,
        scattered: Mapping[int, ZeroShard] | None = None,
    ):
        self.enabled = True
        self.waiting: dict[int, int] = {}  # id(p) -> backward passes to accumulate locally first
        self.buckets: list[list[torch.nn.Parameter]] = []
        self.axes: list[tuple[str, ...]] = []
        self.scattered = dict(scattered or {})
        self.split: list[ZeroShard | None] = []  # per bucket: a shard of its split axis (ZeRO-2)
        self.leaf_of = {id(p): leaf for p, leaf, _ in params}
        by_axes: dict[tuple, list[torch.nn.Parameter]] = {}
        for p, _leaf, axes in reversed(params):
            if axes:
                zero = self.scattered.get(id(p))
                by_axes.setdefault((axes, zero.axis if zero else None), []).append(p)
        for (axes, split), group in by_axes.items():
            size = 0
            for k, p in enumerate(group):
                nbytes = self.leaf_of[id(p)].numel() * self.leaf_of[id(p)].element_size()
                cap = bucket_bytes if self.buckets else FIRST_BUCKET_BYTES
                if k == 0 or size + nbytes > cap:
                    self.buckets.append([])
                    self.axes.append(axes)
                    self.split.append(self.scattered[id(p)] if split else None)
                    size = 0
                self.buckets[-1].append(p)
                size += nbytes
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        # a scattered bucket's offsets are within one rank's region
        self.offsets = []
        for i, b in enumerate(self.buckets):
            offsets, at = {}, 0
            for p in b:
                offsets[id(p)] = at
                at += self.leaf_of[id(p)].numel() // (self.split[i].n if self.split[i] else 1)
            self.offsets.append(offsets)
        self.sizes = [sum(self.leaf_of[id(p)].numel() for p in b) for b in self.buckets]
        self.flat: list[torch.Tensor | None] = [
            None if self.split[i] else torch.empty(self.sizes[i], dtype=self.leaf_of[id(b[0])].dtype)
            for i, b in enumerate(self.buckets)
        ]
        self.pending = [len(b) for b in self.buckets]
        self.launched: list[tuple[int, list]] = []
        self.regions: dict[int, torch.Tensor] = {}  # scattered bucket -> this rank's summed region
        # p.grad for a summed parameter is a view of its bucket, wrapped once
        self.wrapped = {
            id(p): DTensor.from_local(
                self._view(i, p).view_as(self.leaf_of[id(p)]), p.device_mesh, p.placements, run_check=False
            )
            for i, b in enumerate(self.buckets)
            if not self.split[i]
            for p in b
        }
        for p, leaf, _ in params:
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(lambda leaf, p=p: self._ready(p, leaf))

    def expect(self, passes: int) -> None:
        """Sum each gradient after ``passes`` backward passes reach it (a pipeline's microbatches)."""
        self.waiting = dict.fromkeys(self.leaf_of, passes - 1)

    def _ready(self, p: torch.nn.Parameter, leaf: torch.Tensor) -> None:
        if not self.enabled:
            return
        if self.waiting.get(id(p), 0) > 0:
            self.waiting[id(p)] -= 1
            return
        grad, leaf.grad = leaf.grad, None
        i = self.bucket_of.get(id(p))
        if i is None:
            _deliver(p, grad)
            return
        if self.split[i] is not None:
            self._scatter_in(i, p, grad)
            return
        view = self._view(i, p)
        if p.grad is not None and p.grad.to_local().data_ptr() == view.data_ptr():
            # the user kept last pass's gradient (no zero_grad): it must outlive this bucket's reuse
            kept = view.view_as(leaf).clone()
            p.grad = DTensor.from_local(kept, p.device_mesh, p.placements, run_check=False)
        view.copy_(grad.reshape(-1))
        self._arrived(i)

    def _scatter_in(self, i: int, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Copy a ZeRO-2 gradient into its bucket, piece ``r`` into rank ``r``'s region."""
        zero = self.scattered[id(p)]
        if self.flat[i] is None:  # the full bucket exists only during this backward pass
            self.flat[i] = torch.empty(self.sizes[i], dtype=grad.dtype)
        regions = self.flat[i].view(zero.n, -1)
        at, size = self.offsets[i][id(p)], grad.numel() // zero.n
        pieces = grad.unflatten(zero.dim, (zero.n, -1)).movedim(zero.dim, 0)
        regions[:, at : at + size].copy_(pieces.flatten(1))
        self._arrived(i)

    def _arrived(self, i: int) -> None:
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self._launch(i)
        if len(self.launched) == len(self.buckets):
            self._finish()

    def _view(self, i: int, p: torch.nn.Parameter) -> torch.Tensor:
        at = self.offsets[i][id(p)]
        return self.flat[i][at : at + self.leaf_of[id(p)].numel()]

    def _launch(self, i: int) -> None:
        works: list = []
        flat, zero = self.flat[i], self.split[i]
        nbytes = flat.numel() * flat.element_size()
        for axis in sorted(self.axes[i], key=lambda a: zero is not None and a == zero.key):
            for w in works:  # summing over a second axis needs the first sum
                w.wait()
            group, _, _ = collectives.axis_info(axis)
            if zero is not None and axis == zero.key:
                collectives.count_collective("reduce_scatter", axis, nbytes)
                self.regions[i] = flat.new_empty(flat.numel() // zero.n)
                works = [dist.reduce_scatter_single(self.regions[i], flat, group=group, async_op=True)]
            else:
                collectives.count_collective("all_reduce", axis, nbytes)
                works = [dist.all_reduce(flat, group=group, async_op=True)]
        self.launched.append((i, works))

    def _finish(self) -> None:
        for i, works in self.launched:
            for w in works:
                w.wait()
            zero = self.split[i]
            if zero is not None:
                region, self.flat[i] = self.regions.pop(i), None
                for p in self.buckets[i]:
                    piece = self.scattered[id(p)]
                    at, shape = self.offsets[i][id(p)], piece.piece(self.leaf_of[id(p)]).shape
                    piece.set_grad(region[at : at + shape.numel()].view(shape))
                continue
            for p in self.buckets[i]:
                if p.grad is None:
                    p.grad = self.wrapped[id(p)]
                else:
                    p.grad.to_local().add_(self._view(i, p).view_as(self.leaf_of[id(p)]))
        self.launched = []
        self.pending = [len(b) for b in self.buckets]


def _deliver(p: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Add a local gradient to the DTensor parameter's ``grad``."""
    if p.grad is None:
        p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False)
    else:
        p.grad.to_local().add_(grad)


def _device(device_type: str) -> torch.device:
    """The device this rank computes on for a mesh of ``device_type``."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


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


class _Loss(torch.nn.Module):
    """``loss_fn(output, target)`` as a module, to be captured and compiled like a model."""

    def __init__(self, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)


def materialize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of a model built on ``meta`` with real weights, the same on every rank.

    The documented initializer: the copy is moved to the CPU uninitialised, then every
    module that has ``reset_parameters()`` (all of torch's layers) calls it, after
    ``torch.manual_seed(seed)`` so that every rank draws the same weights; each rank
    later keeps its piece. A model without meta tensors is returned as it is. (The whole
    model is built on every rank before slicing: fine for models that fit one host.)
    """
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return model
    model = copy.deepcopy(model).to_empty(device="cpu")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model


class DistributedModule(torch.nn.Module):
    """A model compiled by ``autopar.compile``; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        device_mesh: Any,
        ctx: PassContext,
        program: torch.fx.GraphModule,
        *,
        stage_mesh: Any = None,
        pipeline: Pipeline | None = None,
    ):
        super().__init__()
        self.device_mesh = device_mesh
        # the mesh layouts and DTensor parameters live on: one stage's under a pipeline
        self.stage_mesh = device_mesh if stage_mesh is None else stage_mesh
        self.plan = ctx.plan
        object.__setattr__(self, "_program", program)  # not a submodule: keeps state_dict keys unchanged
        self._ctx = ctx
        self.axis_keys = dict(ctx.axis_keys)  # mesh axis -> the name the collectives know it by
        ep = ctx.captured.program
        specs = ep.graph_signature.input_specs
        local_stages = None
        kept = None  # under a pipeline: the names of this rank's stages' parameters and buffers
        if ctx.stages is not None and pipeline is not None:
            rank, size = device_mesh.get_local_rank(pipeline.axis), pipeline.size(MeshSpec.of(device_mesh))
            local_stages = [st for st in ctx.stages if st.index % size == rank]
            read = {name for st in local_stages for name in st.state}
            kept = {
                alias
                for s in specs
                if s.arg.name in read and s.kind in (InputKind.PARAMETER, InputKind.BUFFER)
                for alias in ctx.captured.aliases.get(s.target, [s.target])
            }
        placements = ctx.plan.parameter_placements
        mesh = self.stage_mesh
        replica = copy.deepcopy(model)
        path_of: dict[int, str] = {}  # module -> its first path, as named_parameters() names it
        for path, module in replica.named_modules(remove_duplicate=False):
            path_of.setdefault(id(module), path)
        swapped: dict[int, torch.Tensor] = {}
        for module in replica.modules():
            for store, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    fqn = f"{path_of[id(module)]}.{name}" if path_of[id(module)] else name
                    if kept is not None and fqn not in kept:
                        store[name] = None  # another pipeline stage's: not held on this rank
                        continue
                    if id(t) not in swapped:
                        layout = placements[fqn]
                        piece = local_piece(t.detach(), layout, mesh)
                        dt = DTensor.from_local(piece, mesh, layout, run_check=False)
                        swapped[id(t)] = (
                            torch.nn.Parameter(dt, requires_grad=t.requires_grad) if is_param else dt
                        )
                    store[name] = swapped[id(t)]
        self._modules.update(replica._modules)
        self._parameters.update(replica._parameters)
        self._buffers.update(replica._buffers)
        named = dict(self.named_parameters(remove_duplicate=False))
        named.update(self.named_buffers(remove_duplicate=False))
        # The program computes with plain local leaves sharing storage with the DTensors
        # (optimizer updates and checkpoint loads write through); autograd on plain tensors
        # is far cheaper than on DTensor leaves, and GradReducer hands gradients back.
        self._leaves: dict[int, torch.Tensor] = {}
        for t in named.values():
            if id(t) not in self._leaves:
                leaf = t.detach().to_local()
                self._leaves[id(t)] = leaf.requires_grad_(t.requires_grad) if t.requires_grad else leaf
        self._placeholders = [s.arg.name for s in specs]
        self._input_names = [s.arg.name for s in specs if s.kind == InputKind.USER_INPUT]
        self._state: dict[str, Any] = {}  # placeholder -> the tensor this rank passes for it
        for s in specs:
            if s.kind in (InputKind.PARAMETER, InputKind.BUFFER) and s.target in named:
                self._state[s.arg.name] = self._leaves[id(named[s.target])]
            elif s.kind == InputKind.CONSTANT_TENSOR:
                self._state[s.arg.name] = ep.constants[s.target]
            elif s.kind != InputKind.USER_INPUT and s.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
                self._state[s.arg.name] = None
        self._user_outputs = [
            i for i, s in enumerate(ep.graph_signature.output_specs) if s.kind == OutputKind.USER_OUTPUT
        ]
        self._out_spec = ep.call_spec.out_spec
        self._in_spec = ep.call_spec.in_spec
        nodes = {n.name: n for n in program.graph.nodes}
        self._input_layouts = {
            name: nodes[name].meta[LAYOUTS][1][0] for name in self._input_names if name in nodes
        }
        self._input_global = {name: tuple(nodes[name].meta["val"].shape) for name in self._input_layouts}
        output = next(n for n in program.graph.nodes if n.op == "output")
        results = pytree.tree_leaves(output.args)
        self._outputs = [results[i] for i in self._user_outputs]
        self._output_layouts = [
            a.meta[LAYOUTS][1][0] if isinstance(a, torch.fx.Node) and LAYOUTS in a.meta else None
            for a in self._outputs
        ]
        axes_of = {
            id(named[s.target]): ctx.grad_reductions.get(s.arg.name, ())
            for s in specs
            if s.kind == InputKind.PARAMETER and s.target in named
        }
        memory = ctx.plan.memory
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
        self.grad_reducer = GradReducer(
            [(p, self._leaves[id(p)], axes_of.get(id(p), ())) for p in self.parameters() if p.requires_grad],
            scattered=self.zero_shards if self.memory.zero == 2 else None,
        )
        self._loss_tails: dict[Any, DistributedModule] = {}  # loss_fn -> its compiled program
        self.pipeline = None
        if local_stages is not None:
            self.pipeline = PipelineRuntime(
                local_stages,
                len(ctx.stages),
                pipeline,
                device_mesh.get_group(pipeline.axis),
                [[self._state[name] for name in st.state] for st in local_stages],
                _device(device_mesh.device_type),
            )

    # --- inputs and outputs ---------------------------------------------------------
    def _user_leaves(self, args: tuple, kwargs: dict) -> list[Any]:
        ordered = self._ordered_kwargs(kwargs)
        leaves, spec = pytree.tree_flatten((args, ordered))
        if spec != self._in_spec:
            raise ShapeError(
                f"inputs must have the structure the module was compiled with: "
                f"expected {self._in_spec}, got {spec}"
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
        local = [
            local_piece(t, self._input_layouts[n], self.stage_mesh) if isinstance(t, torch.Tensor) else t
            for t, n in zip(leaves, self._input_names)
        ]
        local_args, local_kwargs = pytree.tree_unflatten(local, self._in_spec)
        return tuple(local_args), dict(local_kwargs)

    def gather_outputs(self, out: Any) -> Any:
        """Global tensors from this rank's outputs (collective: every rank must call it)."""
        leaves, spec = pytree.tree_flatten(out)
        whole = [
            DTensor.from_local(t, self.stage_mesh, lay, run_check=False).full_tensor()
            if isinstance(t, torch.Tensor) and lay is not None
            else t
            for t, lay in zip(leaves, self._output_layouts)
        ]
        return pytree.tree_unflatten(whole, spec)

    def _check(self, name: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or name not in self._input_layouts:
            return
        layout = self._input_layouts[name]
        expected = local_shape(self._input_global[name], layout, self.plan.mesh_spec)
        if tuple(t.shape) != expected:
            raise ShapeError(
                f"input '{name}' has shape {tuple(t.shape)}, "
                f"but this rank expects its local piece {expected} "
                f"(global {self._input_global[name]} laid out {format_layout(layout)} on mesh "
                f"{self.plan.mesh_spec}); pass dmodel.shard_inputs(...) of a batch shaped like the example"
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
        with self.activations_to_host(inputs) if offload else contextlib.nullcontext():
            outs = self._program(*inputs)
        return pytree.tree_unflatten([outs[i] for i in self._user_outputs], self._out_spec)

    # --- training ----------------------------------------------------------------------
    def train_step(
        self,
        inputs: Any,
        target: torch.Tensor | None = None,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
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
        result is the mean over microbatches.
        """
        if isinstance(inputs, Mapping):
            args, kwargs = (), dict(inputs)
        else:
            args, kwargs = (inputs if isinstance(inputs, tuple) else (inputs,)), {}
        if loss_fn is None and target is not None:
            raise ShapeError("train_step was given a target but no loss_fn to compare the output with")
        tail = None if loss_fn is None else self._loss_tail(loss_fn, target)
        if self.pipeline is None:
            local_args, local_kwargs = self.shard_inputs(*args, **kwargs)
            out = self(*local_args, **local_kwargs)
            loss = _loss_of(out) if tail is None else tail(out, tail.local_target(target, 1))
            loss.backward()
            return loss.detach()
        m = self.pipeline.pipeline.microbatches
        leaves = self._user_leaves(args, kwargs)
        local = [self._microbatches(name, t, m) for name, t in zip(self._input_names, leaves)]

        def microbatch_loss(output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
            out = pytree.tree_unflatten(list(output), self._out_spec)
            return (_loss_of(out) if tail is None else tail(out, target)) / m

        # torch's schedules hand the loss function one target per microbatch; a model that
        # computes its own loss gets placeholders
        local_target = torch.zeros(m) if tail is None else tail.local_target(target, m)
        self.grad_reducer.expect(m)
        return self.pipeline.step(local, local_target, microbatch_loss, loss_fn)

    def _microbatches(self, name: str, t: Any, m: int) -> Any:
        """This rank's pieces of the ``m`` microbatches of global input ``t``, concatenated along dim 0."""
        if not isinstance(t, torch.Tensor):
            return t
        one = self._input_global[name]
        if t.dim() == 0 or (t.shape[0], *t.shape[1:]) != (m * one[0], *one[1:]):
            raise ShapeError(
                f"input '{name}' has shape {tuple(t.shape)}, but the module was compiled for batches of "
                f"{m} microbatches shaped {one}: {(m * one[0], *one[1:])}"
            )
        layout = self._input_layouts[name]
        return torch.cat([local_piece(c, layout, self.stage_mesh) for c in t.chunk(m)])

    def local_target(self, target: torch.Tensor, m: int) -> torch.Tensor:
        """For a compiled loss: this rank's pieces of ``m`` microbatches of a global ``target``."""
        return self._microbatches(self._input_names[-1], target, m)

    def compiled_loss(self, loss_fn: Callable) -> DistributedModule:
        """The program ``train_step`` compiled for ``loss_fn`` (with its ``plan`` and ``code``), once run."""
        try:
            return self._loss_tails[loss_fn]
        except KeyError:
            raise KeyError(f"{loss_fn!r} has not been compiled: call train_step with it first") from None

    def _loss_tail(self, loss_fn: Callable, target: Any) -> DistributedModule:
        """``loss_fn`` compiled for this module's outputs, in their layouts (cached per function)."""
        from autopar.capture.export import capture
        from autopar.compiler import build_module
        from autopar.planning.cost import Cluster
        from autopar.planning.planner import plan_captured

        if not isinstance(target, torch.Tensor):
            raise ShapeError(f"train_step needs the target as one tensor, got {type(target).__name__}")
        tail = self._loss_tails.get(loss_fn)
        if tail is not None:
            return tail
        m = 1 if self.pipeline is None else self.pipeline.pipeline.microbatches
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
        module = _Loss(loss_fn)
        captured = capture(module, (output, example), None, self.plan.mesh_spec)
        fixed = dict(zip(captured.inputs, self._output_layouts))  # the target's layout is the solver's
        plan = plan_captured(
            captured, self.plan.mesh_spec, cluster=Cluster.from_dict(self.plan.cluster), fixed_inputs=fixed
        )
        tail = build_module(module, self.stage_mesh, self.stage_mesh, captured, plan)
        self._loss_tails[loss_fn] = tail
        return tail

    @contextlib.contextmanager
    def activations_to_host(self, inputs: Iterable[Any] = ()) -> Iterator[None]:
        """Keep what autograd saves in this block in host memory, copied back in backward.

        A tensor saved several times (or through views) is copied once; one living in
        ``inputs`` (the parameters, the batch: memory the step does not allocate) stays
        where it is. ``host_activation_bytes`` is what the last forward put on the host (the
        plan predicts it). What a recompute region keeps (its inputs, the outputs its policy
        saves) stays with the region.
        """
        host = torch.device("cpu")
        pin = self.device_mesh.device_type == "cuda"
        copies: dict[Any, torch.Tensor] = {}
        resident = {StorageWeakRef(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor)}
        self.host_activation_bytes = 0

        def pack(t: torch.Tensor) -> Any:
            storage = t.untyped_storage()
            key = StorageWeakRef(storage)
            if key in resident:
                return t
            if key not in copies:
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                copies[key] = whole.to(host, copy=True).pin_memory() if pin else whole.to(host, copy=True)
                self.host_activation_bytes += storage.nbytes()
            return t.device, key, t.storage_offset(), t.size(), t.stride(), t.dtype

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, key, offset, size, stride, dtype = packed
            storage = copies[key].to(device).untyped_storage()
            return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

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
        """Bytes this rank holds now, measured from the live tensors (each storage once).

        ``param`` and ``grad``: the parameters' local pieces and their gradients (ZeRO
        shards' gradients included); ``optimizer``: the state tensors of ``optimizer``
        shaped like its parameters (per-parameter step counters left out); under optimizer
        offload those, the master copies and their gradients count as ``host`` instead.
        The plan predicts the same (``plan.prediction``, ``plan.memory.host_bytes``).
        """
        seen: set = set()

        def size(tensors: Iterable[Any]) -> int:
            total = 0
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    local = t.to_local() if isinstance(t, DTensor) else t
                    key = StorageWeakRef(local.untyped_storage())
                    if key not in seen:
                        seen.add(key)
                        total += local.untyped_storage().nbytes()
            return total

        params = list(self.parameters())
        param = size([*params, *self.buffers()])
        grad = size([p.grad for p in params] + [s.shard.grad for s in self.zero_shards.values()])
        held = {"param": param, "grad": grad, "optimizer": 0, "host": 0}
        if optimizer is not None:
            owned = [p for group in optimizer.param_groups for p in group["params"]]
            states = [
                t
                for p in owned
                for t in optimizer.state.get(p, {}).values()
                if isinstance(t, torch.Tensor) and t.shape == p.shape
            ]
            if self.memory.offload_optimizer:
                held["host"] = size([*owned, *(p.grad for p in owned), *states])
            else:
                held["optimizer"] = size(states)
        return held

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
        return dict(self._ctx.snapshots)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (several backward passes, one reduction after the last)."""
        self.grad_reducer.enabled = False
        try:
            yield
        finally:
            self.grad_reducer.enabled = True
