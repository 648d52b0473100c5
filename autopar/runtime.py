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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from autopar import collectives
from autopar.errors import ShapeError
from autopar.layout import Layout, format_layout, local_shape
from autopar.printing import LAYOUTS, format_graph

if TYPE_CHECKING:
    from autopar.compiler import PassContext

# As DDP: a small first bucket, so the first sum starts early in backward, then big ones.
FIRST_BUCKET_BYTES = 2**20
BUCKET_BYTES = 25 * 2**20


def local_piece(t: torch.Tensor, layout: Layout, mesh: Any) -> torch.Tensor:
    """This rank's piece of a global tensor that every rank holds whole (no communication)."""
    for axis, p in enumerate(layout):
        if isinstance(p, Shard):
            n = mesh.size(axis)
            t = t.chunk(n, dim=p.dim)[mesh.get_local_rank(axis)]
    return t.contiguous()


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
    outside it sums everything once.
    """

    def __init__(
        self,
        params: list[tuple[torch.nn.Parameter, torch.Tensor, tuple[str, ...]]],
        bucket_bytes: int = BUCKET_BYTES,
    ):
        self.enabled = True
        self.buckets: list[list[torch.nn.Parameter]] = []
        self.axes: list[tuple[str, ...]] = []
        self.leaf_of = {id(p): leaf for p, leaf, _ in params}
        by_axes: dict[tuple[str, ...], list[torch.nn.Parameter]] = {}
        for p, _leaf, axes in reversed(params):
            if axes:
                by_axes.setdefault(axes, []).append(p)
        for axes, group in by_axes.items():
            size = 0
            for p in group:
                nbytes = self.leaf_of[id(p)].numel() * self.leaf_of[id(p)].element_size()
                cap = bucket_bytes if self.buckets else FIRST_BUCKET_BYTES
                if not self.buckets or self.axes[-1] != axes or size + nbytes > cap:
                    self.buckets.append([])
                    self.axes.append(axes)
                    size = 0
                self.buckets[-1].append(p)
                size += nbytes
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.flat = [
            torch.empty(sum(self.leaf_of[id(p)].numel() for p in b), dtype=self.leaf_of[id(b[0])].dtype)
            for b in self.buckets
        ]
        self.offsets = []
        for b in self.buckets:
            offsets, at = {}, 0
            for p in b:
                offsets[id(p)] = at
                at += self.leaf_of[id(p)].numel()
            self.offsets.append(offsets)
        self.pending = [len(b) for b in self.buckets]
        self.launched: list[tuple[int, list]] = []
        # p.grad for a summed parameter is a view of its bucket, wrapped once
        self.wrapped = {
            id(p): DTensor.from_local(
                self._view(i, p).view_as(self.leaf_of[id(p)]), p.device_mesh, p.placements, run_check=False
            )
            for i, b in enumerate(self.buckets)
            for p in b
        }
        for p, leaf, _ in params:
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(lambda leaf, p=p: self._ready(p, leaf))

    def _ready(self, p: torch.nn.Parameter, leaf: torch.Tensor) -> None:
        if not self.enabled:
            return
        grad, leaf.grad = leaf.grad, None
        i = self.bucket_of.get(id(p))
        if i is None:
            _deliver(p, grad)
            return
        view = self._view(i, p)
        if p.grad is not None and p.grad.to_local().data_ptr() == view.data_ptr():
            # the user kept last pass's gradient (no zero_grad): it must outlive this bucket's reuse
            kept = view.view_as(leaf).clone()
            p.grad = DTensor.from_local(kept, p.device_mesh, p.placements, run_check=False)
        view.copy_(grad.reshape(-1))
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
        flat = self.flat[i]
        for axis in self.axes[i]:
            for w in works:  # summing over a second axis needs the first sum
                w.wait()
            group, _, _ = collectives.axis_info(axis)
            collectives.count_collective("all_reduce", axis, flat.numel() * flat.element_size())
            works = [dist.all_reduce(flat, group=group, async_op=True)]
        self.launched.append((i, works))

    def _finish(self) -> None:
        for i, works in self.launched:
            for w in works:
                w.wait()
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
    ):
        super().__init__()
        self.device_mesh = device_mesh
        self.plan = ctx.plan
        object.__setattr__(self, "_program", program)  # not a submodule: keeps state_dict keys unchanged
        self._ctx = ctx
        self.axis_keys = dict(ctx.axis_keys)  # mesh axis -> the name the collectives know it by
        ep = ctx.captured.program
        placements = ctx.plan.parameter_placements
        replica = copy.deepcopy(model)
        swapped: dict[int, torch.Tensor] = {}
        for module in replica.modules():
            for store, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) not in swapped:
                        fqn = self._fqn(replica, module, name)
                        layout = placements[fqn]
                        dt = DTensor.from_local(
                            local_piece(t.detach(), layout, device_mesh), device_mesh, layout, run_check=False
                        )
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
        self._program_inputs: list[tuple[str, Any]] = []
        for s in ep.graph_signature.input_specs:
            if s.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                self._program_inputs.append(("state", self._leaves[id(named[s.target])]))
            elif s.kind == InputKind.CONSTANT_TENSOR:
                self._program_inputs.append(("constant", ep.constants[s.target]))
            elif s.kind == InputKind.USER_INPUT:
                self._program_inputs.append(("input", s.arg.name))
            else:
                self._program_inputs.append(("constant", None))
        self._user_outputs = [
            i for i, s in enumerate(ep.graph_signature.output_specs) if s.kind == OutputKind.USER_OUTPUT
        ]
        self._out_spec = ep.call_spec.out_spec
        self._in_spec = ep.call_spec.in_spec
        nodes = {n.name: n for n in program.graph.nodes}
        self._input_layouts = {
            name: nodes[name].meta[LAYOUTS][1][0]
            for _, name in self._program_inputs
            if isinstance(name, str) and name in nodes
        }
        self._input_global = {name: tuple(nodes[name].meta["val"].shape) for name in self._input_layouts}
        output = next(n for n in program.graph.nodes if n.op == "output")
        self._output_layouts = [
            a.meta[LAYOUTS][1][0] if isinstance(a, torch.fx.Node) and LAYOUTS in a.meta else None
            for a in pytree.tree_leaves(output.args)
        ]
        axes_of = {
            id(named[s.target]): ctx.grad_reductions.get(s.arg.name, ())
            for s in ep.graph_signature.input_specs
            if s.kind == InputKind.PARAMETER
        }
        self.grad_reducer = GradReducer(
            [(p, self._leaves[id(p)], axes_of.get(id(p), ())) for p in self.parameters() if p.requires_grad]
        )

    @staticmethod
    def _fqn(root: torch.nn.Module, owner: torch.nn.Module, name: str) -> str:
        for path, module in root.named_modules(remove_duplicate=False):
            if module is owner:
                return f"{path}.{name}" if path else name
        raise AssertionError("parameter owner not found in the model")

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
        names = [name for kind, name in self._program_inputs if kind == "input"]
        local = [
            local_piece(t, self._input_layouts[n], self.device_mesh) if isinstance(t, torch.Tensor) else t
            for t, n in zip(leaves, names)
        ]
        local_args, local_kwargs = pytree.tree_unflatten(local, self._in_spec)
        return tuple(local_args), dict(local_kwargs)

    def gather_outputs(self, out: Any) -> Any:
        """Global tensors from this rank's outputs (collective: every rank must call it)."""
        leaves, spec = pytree.tree_flatten(out)
        whole = [
            DTensor.from_local(t, self.device_mesh, lay, run_check=False).full_tensor()
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
        leaves = iter(self._user_leaves(args, kwargs))
        flat = []
        for kind, item in self._program_inputs:
            if kind in ("state", "constant"):
                flat.append(item)
            else:
                t = next(leaves)
                self._check(item, t)
                flat.append(t)
        return flat

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        outs = self._program(*self.program_inputs(args, kwargs))
        return pytree.tree_unflatten([outs[i] for i in self._user_outputs], self._out_spec)

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
