"""The optimizer side of ZeRO and of host offload.

A :class:`ZeroShard` is this rank's piece of a parameter ZeRO splits (``plan.memory.zero_splits``):
a DTensor parameter whose local tensor is a view of the full local parameter along the split
dim, with the parameter's placements plus ``Shard(dim)`` on the split axis. Under ZeRO-1 its
gradient is the same view of the all-reduced gradient; under ZeRO-2 the reduce-scattered
piece itself (the full gradient is never kept). :func:`make_optimizer` builds the user's torch
optimizer over the shards (and over the parameters ZeRO keeps whole), so its state is split;
after each step every shard is all-gathered back into the full parameter. With offload, the
optimizer steps fp32 master copies on the host instead: gradients are copied there before the
step and the updated values back after it.

ZeRO-3 needs nothing here: its parameters are stored split (DTensors with the extra ``Shard``),
so any optimizer over ``dmodel.parameters()`` holds split state.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.runtime import collectives
from autopar.runtime.materialize import as_dtensor


class ZeroShard:
    """This rank's piece of a parameter split over mesh axis ``axis`` along ``dim`` (see module docstring)."""

    def __init__(self, param: torch.nn.Parameter, leaf: torch.Tensor, axis: str, dim: int, key: str) -> None:
        mesh = param.device_mesh
        a = mesh.mesh_dim_names.index(axis)
        self.param, self.leaf, self.axis, self.dim, self.key = param, leaf, axis, dim, key
        self.n, self.coordinate = mesh.size(a), mesh.get_local_rank(axis)
        self.placements = (*param.placements[:a], Shard(dim), *param.placements[a + 1 :])
        self.shard = torch.nn.Parameter(as_dtensor(self.piece(leaf.detach()), mesh, self.placements, param))

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full local tensor shaped like the parameter (a view)."""
        size = full.shape[self.dim] // self.n
        return full.narrow(self.dim, self.coordinate * size, size)

    def set_grad(self, local: torch.Tensor) -> None:
        """Add ``local`` (a piece) to the shard's gradient."""
        if self.shard.grad is None:
            self.shard.grad = as_dtensor(local, self.param.device_mesh, self.placements, self.param)
        else:
            self.shard.grad.to_local().add_(local)

    @torch.no_grad()
    def gather(self) -> None:
        """Every rank's updated piece, concatenated back into the full parameter."""
        piece = self.shard.to_local().contiguous()
        self.leaf.copy_(collectives.all_gather(piece, self.dim, self.key, "slice"))


class HostCopy:
    """An fp32 master copy of ``target`` (a parameter or a ZeRO shard) on the host, for offload."""

    def __init__(self, target: torch.nn.Parameter, host: torch.device) -> None:
        self.target = target
        local = target.to_local() if isinstance(target, DTensor) else target
        self.master = torch.nn.Parameter(local.detach().to(host, dtype=torch.float32, copy=True))

    @torch.no_grad()
    def pull_grad(self) -> None:
        grad = self.target.grad
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            self.master.grad = local.to(self.master.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def push(self) -> None:
        local = self.target.to_local() if isinstance(self.target, DTensor) else self.target
        local.copy_(self.master)


def make_optimizer(
    params: list[torch.nn.Parameter],
    shards: dict[int, ZeroShard],
    zero: int,
    offload: bool,
    host: torch.device,
    optimizer_class: Callable[..., torch.optim.Optimizer],
    **options: Any,
) -> torch.optim.Optimizer:
    """``optimizer_class(**options)`` over ``params`` as ZeRO and offload ask (see module docstring).

    ``shards`` are the ZeRO-1/2 pieces by ``id`` of their parameter. The hooks run around
    every ``step()``: ZeRO-1 points each shard's gradient at its piece of the summed
    gradient first (and releases the full gradient after); offload copies gradients to
    the host first and values back after; every shard is gathered last.
    """
    trained = [p for p in params if p.requires_grad]
    targets = [shards[id(p)].shard if id(p) in shards else p for p in trained]
    copies = [HostCopy(t, host) for t in targets] if offload else []
    optimizer = optimizer_class([c.master for c in copies] if offload else targets, **options)

    def before(*_: Any) -> None:
        if zero == 1:
            for s in shards.values():
                if s.param.grad is not None:
                    s.shard.grad = None
                    s.set_grad(s.piece(s.param.grad.to_local()))
        for c in copies:
            c.pull_grad()

    def after(*_: Any) -> None:
        for c in copies:
            c.push()
        for s in shards.values():
            s.gather()
            s.param.grad = None  # ZeRO-1: the full gradient is used up; zero_grad() clears the pieces

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
    _STANDS_FOR[optimizer] = {id(c.master): c.target for c in copies}
    # until step() runs its hooks, ZeRO-1 pieces read the full parameter's gradient and host
    # copies the device one
    _HOLDERS[optimizer] = [
        shards[id(p)].param if zero == 1 and id(p) in shards else t for p, t in zip(trained, targets)
    ]
    if offload:
        _clear_targets_too(optimizer, [c.target for c in copies])
    return optimizer


def _clear_targets_too(optimizer: torch.optim.Optimizer, targets: list[Any]) -> None:
    """Make ``optimizer.zero_grad()`` clear the gradients of the tensors its host copies stand for
    as well as the copies' own: the device gradients would otherwise add up step after step."""
    clear_copies = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        clear_copies(set_to_none)
        for t in targets:
            if set_to_none or t.grad is None:
                t.grad = None
            else:
                t.grad.zero_()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


# optimizer -> {id of a host master copy it steps: the DTensor (parameter or ZeRO shard) it stands for}
_STANDS_FOR: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, Any]] = weakref.WeakKeyDictionary()
# optimizer made by make_optimizer -> the tensors whose ``grad`` its next step() reads first
_HOLDERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def gradient_holders(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors whose ``grad`` the next ``optimizer.step()`` uses, as they stand before it runs:
    its own parameters, or for an optimizer :func:`make_optimizer` built, the full parameters
    (ZeRO-1), shards (ZeRO-2) and device tensors (offload) its hooks take the gradients from."""
    held = _HOLDERS.get(optimizer)
    return held if held is not None else [p for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def refresh_copies(optimizer: torch.optim.Optimizer) -> None:
    """Copy into each fp32 host master copy ``optimizer`` steps the value of what it copies (after
    those values were loaded: the next step would otherwise push the stale copy back)."""
    for group in optimizer.param_groups:
        for held in group["params"]:
            source = stands_for(optimizer, held)
            if source is not held:
                held.copy_(source.to_local())


def stands_for(optimizer: torch.optim.Optimizer, held: torch.Tensor) -> torch.Tensor:
    """The DTensor whose state ``held`` (a tensor ``optimizer`` steps) is: a parameter, a ZeRO shard,
    or, for an fp32 host master copy (offload), the one it copies."""
    return _STANDS_FOR.get(optimizer, {}).get(id(held), held)


def held_bytes(module: Any, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes a ``DistributedModule`` holds on this rank now, from the live tensors (each storage once).

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

    params = list(module.parameters())
    param = size([*params, *module.buffers()])
    grad = size([p.grad for p in params] + [s.shard.grad for s in module.zero_shards.values()])
    held = {"param": param, "grad": grad, "optimizer": 0, "host": 0}
    if optimizer is not None:
        owned = [p for group in optimizer.param_groups for p in group["params"]]
        states = [
            t
            for p in owned
            for t in optimizer.state.get(p, {}).values()
            if isinstance(t, torch.Tensor) and t.shape == p.shape
        ]
        if module.memory.offload_optimizer:
            held["host"] = size([*owned, *(p.grad for p in owned), *states])
        else:
            held["optimizer"] = size(states)
    return held
