"""Workers and servers of an update mode: the units, their programs, the exchange each step.

``autopar.compile(model, mesh, example_args, update=...)`` (``mesh`` the workers' mesh, from
:func:`worker_mesh`) asks :func:`place_unit` where this rank stands. The data-parallel axis's
replicas are cut into ``units`` (each replica, or each ``Hybrid`` group); every unit compiles the
model for its own mesh (the workers' mesh without the units: under ``Hybrid`` its replicas
all-reduce there) and its share of the batch (dim 0 of every input cut in ``units``), so its
program has no collective across units. On a worker rank the compiler wraps the unit's module in
an :class:`UpdatedModule`; on a server rank a :class:`ServerRank` whose :meth:`~ServerRank.serve`
runs :mod:`autopar.runtime.param_server`.

A worker's step: ``train_step`` (forward and backward of its unit's share), then
``optimizer.step()`` pushes each piece of gradient this rank owns to the server holding it and
receives the parameters to start its next clock with, once the servers allow it (the
staleness bound). A piece is owned by the first rank of the unit holding it, so a replicated
parameter is pushed once per unit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.ir.arguments import check_instance, check_int, plain_number
from autopar.ir.errors import CheckpointError, OptionError
from autopar.ir.mesh import MeshSpec
from autopar.ir.updates import Update, check_unit_batch, check_update
from autopar.runtime import param_server
from autopar.runtime import update_wire as wire
from autopar.runtime.checkpoint_files import checkpoint_path

UNIT_AXIS = "autopar_unit"  # the axis of units in the mesh built over the workers
_generations = [0]  # modules compiled under an update mode in this process (every rank alike)


def worker_mesh(update: Update, sizes: Mapping[str, int], device_type: str = "cpu") -> DeviceMesh:
    """The workers' ``DeviceMesh`` (axes ``sizes``, in order) over the job's first ranks, the last
    ``update.servers`` ranks left to the servers. Every rank of the job calls it (servers too).

    Args:
        update: the update mode the job trains under (it says how many servers there are).
        sizes: the workers' mesh as ``{axis: size}``, such as ``{"dp": 4}``; with the servers, the
            job's ranks.
        device_type: the workers' device type, such as ``"cpu"`` or ``"cuda"``.

    Raises:
        OptionError: no process group, or ``sizes`` and ``update`` that do not fit the job's ranks.
    """
    spec = _workers(update, sizes, device_type, "worker_mesh")
    if not dist.is_initialized():
        raise OptionError(
            "worker_mesh(...) lays the workers out over the job's process group, but there is none: call "
            "torch.distributed.init_process_group(...) on every rank first (torchrun sets what it reads)"
        )
    world = dist.get_world_size()
    check_update(update, spec, world=world)
    ranks = torch.arange(spec.size).reshape(spec.axis_sizes)
    return DeviceMesh(device_type, ranks, mesh_dim_names=spec.axis_names)


def _workers(update: Any, sizes: Any, device_type: Any, call: str) -> MeshSpec:
    """The workers' mesh ``sizes`` given to ``call``, its arguments checked (the update mode by
    :func:`check_update` after)."""
    check_instance(
        sizes, Mapping, f"{call}(sizes=...)", "the workers' mesh as {axis: size}, such as {'dp': 4}"
    )
    check_instance(device_type, str, f"{call}(device_type=...)", "a device type such as 'cpu' or 'cuda'")
    return MeshSpec(tuple(sizes), tuple(sizes.values()))


@dataclass(frozen=True)
class Rejoining:
    """What a worker rank restarted alone compiles for (see :func:`rejoin_mesh`): the job's
    workers' mesh ``spec``, the rank it was in the job, and this process's one-rank ``mesh``."""

    spec: MeshSpec
    rank: int
    mesh: DeviceMesh


def rejoin_mesh(update: Update, sizes: Mapping[str, int], rank: int, device_type: str = "cpu") -> Rejoining:
    """For a worker rank restarted on its own while the job's other ranks run on: pass the result
    to ``autopar.compile(..., update=update)`` in place of :func:`worker_mesh`'s mesh.

    ``sizes`` are the job's workers' mesh, ``rank`` the rank this process replaces. The process
    has no process group of the job (the job's world lost a rank for good): unless it has one
    already, it gets a group of its own, met through the launcher's store at
    ``MASTER_ADDR:MASTER_PORT`` (which must outlive the dead rank: torchrun's agent store, or a
    store the launcher hosts). Only units of one rank can rejoin, each replica a unit and no
    other axis: a unit of several ranks that lost one would need all of them restarted.

    Args:
        update: the update mode the job trains under.
        sizes: the job's workers' mesh as ``{axis: size}``, as given to :func:`worker_mesh`.
        rank: the worker rank this process replaces.
        device_type: the worker's device type, such as ``"cpu"`` or ``"cuda"``.

    Raises:
        OptionError: a rank outside the workers, or units of more than one rank.
    """
    spec = _workers(update, sizes, device_type, "rejoin_mesh")
    check_update(update, spec)
    rank = check_int(plain_number(rank), "rejoin_mesh(rank=...) (the rank this process replaces)")
    units = update.units(spec.axis_sizes[spec.axis_index(update.axis)])
    if units != spec.size:
        raise OptionError(
            f"rejoin_mesh: only units of one rank can rejoin, but {update!r} on mesh {spec} makes units of "
            f"{spec.size // units} ranks"
        )
    if not 0 <= rank < spec.size:
        raise OptionError(f"rejoin_mesh(rank={rank}): the workers are ranks 0 to {spec.size - 1}")
    if not dist.is_initialized():
        client = wire.launcher_store(None)
        attempt = client.add(f"rejoin/{rank}", 1)
        own = dist.PrefixStore(f"rejoin/{rank}/{attempt}/", client)
        dist.init_process_group("gloo", store=own, rank=0, world_size=1)
    mesh = DeviceMesh(
        device_type, torch.zeros((1,) * len(sizes), dtype=torch.int), mesh_dim_names=spec.axis_names
    )
    return Rejoining(spec, rank, mesh)


def unit_share(named: Mapping[str, Any], unit: int, units: int) -> list[Any]:
    """Unit ``unit``'s share of every tensor in each of ``named``'s values (inputs by name, as
    errors name them): dim 0 cut in ``units`` equal pieces (:func:`check_unit_batch`)."""
    check_unit_batch(named, units)

    def share(t: Any) -> Any:
        return t.chunk(units)[unit] if isinstance(t, torch.Tensor) else t

    return [pytree.tree_map(share, tree) for tree in named.values()]


def _example(example_args: Any, example_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The example inputs by the names their errors give them."""
    return {"example_args": example_args, "example_kwargs": dict(example_kwargs or {})}


@dataclass(frozen=True)
class WorkerUnit:
    """A worker rank's unit under ``update`` (see the module docstring): the ``mesh`` its model is
    compiled for, its share of the example inputs (``args``, ``kwargs``), and what its
    :class:`UpdatedModule` exchanges with the servers over (``store``, this ``rank``, ``servers``)."""

    update: Update
    unit: int
    units: int
    mesh: Any
    args: Any
    kwargs: Any
    store: Any
    rank: int
    servers: int


def place_unit(
    update: Update, mesh: Any, example_args: Any, example_kwargs: Mapping[str, Any] | None
) -> WorkerUnit | ServerRank:
    """This rank's part of a job under ``update``: a server's :class:`ServerRank`, or the worker's unit
    to compile (every rank calls it; a restarted worker rank alone, with a :func:`rejoin_mesh`).

    ``update`` is checked against the mesh, the job's world and the other options by the caller
    (``autopar.compile``), which compiles the unit and wraps it (:meth:`UpdatedModule.of`).

    Args:
        update: the update mode.
        mesh: the workers' ``DeviceMesh`` (:func:`worker_mesh`), or a :class:`Rejoining`.
        example_args: the whole batch's positional example inputs.
        example_kwargs: its keyword example inputs, or None.
    """
    store = wire.launcher_store(_generations[0])
    _generations[0] += 1
    example = _example(example_args, example_kwargs)
    if isinstance(mesh, Rejoining):  # a unit of one rank, its index the rank's (see rejoin_mesh)
        units = mesh.spec.size
        args, kwargs = unit_share(example, mesh.rank, units)
        return WorkerUnit(update, mesh.rank, units, mesh.mesh, args, kwargs, store, mesh.rank, update.servers)
    spec = MeshSpec.of(mesh)
    axis = update.axis
    i, replicas = spec.axis_index(axis), spec.axis_sizes[spec.axis_index(axis)]
    units = update.units(replicas)
    others = [a for a in spec.axis_names if a != axis]
    shape = [units, replicas // units, *(spec.axis_sizes[spec.axis_index(a)] for a in others)]
    big = DeviceMesh(
        mesh.device_type, mesh.mesh.movedim(i, 0).reshape(shape), mesh_dim_names=(UNIT_AXIS, axis, *others)
    )
    workers = [int(r) for r in mesh.mesh.flatten()]
    servers = [r for r in range(dist.get_world_size()) if r not in set(workers)]
    coordinate = big.get_coordinate()
    if coordinate is None:
        return ServerRank(servers.index(dist.get_rank()), store, workers)
    args, kwargs = unit_share(example, coordinate[0], units)
    unit_mesh = big[(axis, *others)]
    return WorkerUnit(
        update, coordinate[0], units, unit_mesh, args, kwargs, store, dist.get_rank(), len(servers)
    )


class ServerRank:
    """A server rank of an update mode: call :meth:`serve` (it returns once every worker is done)."""

    is_server = True

    def __init__(self, index: int, store: Any, workers: list[int]) -> None:
        self.index, self.store, self.workers = index, store, workers
        self.log: list[tuple] = []

    def serve(self, resume: str | Path | None = None) -> list[tuple]:
        """Hold this server's parameters and optimizer state and answer the workers until every one
        has finished (a dead worker may rejoin meanwhile). ``resume``: a folder a checkpoint was
        saved to (:meth:`UpdatedModule.save_checkpoint`) to start from. Returns the server's log
        (:class:`~autopar.runtime.param_server.ServerCore`)."""
        if resume is not None:
            check_instance(resume, (str, os.PathLike), "serve(resume=...)", "a checkpoint folder or None")
            if not (Path(resume) / f"server-{self.index}.pt").is_file():
                raise CheckpointError(
                    f"serve(resume={os.fspath(resume)!r}): it holds no server-{self.index}.pt; give the "
                    "folder dmodel.save_checkpoint(folder) wrote on the workers"
                )
        core = param_server.ServerCore(self.index, resume)
        param_server.serve(core, self.store, len(self.workers))
        self.log = core.log
        return core.log


class UpdatedModule:
    """A worker rank's view of a model trained under an update mode; see the module docstring.

    Every attribute it does not define is its unit's ``DistributedModule``'s (``plan``, ``code``,
    ``parameters()``, ``state_dict()``...). ``clock`` is the step this unit starts next;
    ``log`` one ``(clock, server, staleness, version)`` per parameters received.
    """

    is_server = False

    def __init__(
        self,
        module: Any,
        update: Update,
        unit: int,
        units: int,
        unit_mesh: Any,
        store: Any,
        rank: int,
        servers: int,
    ) -> None:
        self.module, self.update, self.unit, self.units = module, update, unit, units
        self.unit_mesh, self.store, self.rank, self.servers = unit_mesh, store, rank, servers
        flat = unit_mesh.mesh.flatten().tolist()  # ranks of this process's group (a rejoined one's own)
        self.unit_rank, self.unit_size = flat.index(dist.get_rank()), len(flat)
        self.clock = 0
        self.log: list[tuple[int, int, int, int]] = []
        self._pairs: list[Any] = []
        self._pieces = _pieces(module, unit_mesh, servers)

    @classmethod
    def of(cls, module: Any, unit: WorkerUnit) -> UpdatedModule:
        """``module``, compiled for ``unit`` (:func:`place_unit`), as its worker rank trains it.

        Args:
            module: the unit's ``DistributedModule``.
            unit: where it runs and whom it exchanges with.
        """
        return cls(module, unit.update, unit.unit, unit.units, unit.mesh, unit.store, unit.rank, unit.servers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def train_step(
        self, inputs: Any, target: torch.Tensor | None = None, loss_fn: Any = None
    ) -> torch.Tensor:
        """Forward and backward of this unit's share of the global batch (dim 0 cut in ``units``);
        returns this unit's loss. Step the optimizer from :meth:`optimizer` afterwards."""
        inputs, target = unit_share({"inputs": inputs, "target": target}, self.unit, self.units)
        return self.module.train_step(inputs, target, loss_fn)

    def optimizer(
        self, optimizer_class: Callable[..., torch.optim.Optimizer], **options: Any
    ) -> ServerOptimizer:
        """Join the servers, which build ``optimizer_class(pieces, **options)`` over the pieces they
        hold (the first worker's choice counts), and receive the parameters to start with; returns
        what stands for that optimizer here."""
        if self._pairs:
            raise OptionError("optimizer(...) joins the servers once per module; it was called already")
        incarnation = self.store.add(f"incarnation/{self.rank}", 1)
        self.store.set(wire.join_key(self.rank, incarnation), "1")
        self._pairs = [
            wire.pair_group(self.store, s, self.rank, incarnation, on_server=False)
            for s in range(self.servers)
        ]
        for s, pg in enumerate(self._pairs):
            keys = [(key, tuple(_local(p).shape), p.dtype, owned) for key, p, owned in self._pieces[s]]
            meta = {
                "unit": self.unit,
                "unit_rank": self.unit_rank,
                "unit_size": self.unit_size,
                "units": self.units,
                "bound": self.update.bound,
                "optimizer": (optimizer_class, options),
                "keys": keys,
                "worker": self.rank,
                "incarnation": incarnation,
            }
            wire.send_header(pg, 0, wire.JOIN)
            wire.send_object(pg, 0, meta)
            wire.send_tensors(pg, 0, [_local(p) for _, p, owned in self._pieces[s] if owned])
        self._receive()
        return ServerOptimizer(self)

    def _receive(self) -> None:
        """The parameters of this unit's next clock from every server, written into this rank's pieces."""
        for s, pg in enumerate(self._pairs):
            _, clock, stale, version = wire.recv_header(pg, 0)
            values = wire.recv_tensors(
                pg, 0, [(tuple(_local(p).shape), p.dtype) for _, p, _ in self._pieces[s]]
            )
            with torch.no_grad():  # in place: the program's leaves share the DTensors' storage
                for (_, p, _), v in zip(self._pieces[s], values):
                    _local(p).copy_(v)
            self.clock = clock
            self.log.append((clock, s, stale, version))

    def exchange(self) -> None:
        """Push this rank's owned gradient pieces of the current clock, then receive the next clock's
        parameters (waiting as the staleness bound says)."""
        for s, pg in enumerate(self._pairs):
            wire.send_header(pg, 0, wire.PUSH, self.clock)
            wire.send_tensors(pg, 0, [_grad(p) for _, p, owned in self._pieces[s] if owned])
        self._receive()

    def save_checkpoint(self, folder: str | Path) -> None:
        """Have every server write its whole state (pieces, optimizer state, clocks) under ``folder``,
        between steps; the unit's first rank of unit 0 asks, the other ranks do nothing. A job
        resumes from it with ``server.serve(resume=folder)``.

        Args:
            folder: a non-empty str or os.PathLike naming the folder (made where missing); every rank
                checks it. Each server replaces its file whole or not at all.

        Raises:
            CheckpointError: ``folder`` is no usable path, or a server could not write its file.
        """
        where = checkpoint_path(folder, "UpdatedModule.save_checkpoint")
        if self.unit != 0 or self.unit_rank != 0:
            return
        if not self._pairs:
            raise CheckpointError(
                "UpdatedModule.save_checkpoint: this rank has not joined the servers: call "
                "dmodel.optimizer(...) first (and not after dmodel.close())"
            )
        problems = []
        for pg in self._pairs:
            wire.send_header(pg, 0, wire.SAVE, self.clock)
            wire.send_object(pg, 0, str(where))
            if wire.recv_header(pg, 0)[2]:
                problems.append(wire.recv_object(pg, 0))
        if problems:
            raise CheckpointError(f"UpdatedModule.save_checkpoint({str(where)!r}): {'; '.join(problems)}")

    def close(self) -> None:
        """Tell the servers this rank is done (its unit stops counting)."""
        for pg in self._pairs:
            wire.send_header(pg, 0, wire.DONE, self.clock)
        self._pairs = []


class ServerOptimizer:
    """Stands, on a worker, for the optimizer the servers run: :meth:`step` is the exchange."""

    def __init__(self, owner: UpdatedModule) -> None:
        self.owner = owner

    def step(self) -> None:
        """Push this step's gradients and receive the parameters of the next (see
        :meth:`UpdatedModule.exchange`)."""
        self.owner.exchange()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in _trained(self.owner.module):
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of DTensor ``p``, sharing its storage."""
    return p.detach().to_local()


def _grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``p``'s gradient (zeros where backward gave it none)."""
    return torch.zeros_like(_local(p)) if p.grad is None else p.grad.to_local()


def _trained(module: Any) -> list[tuple[str, torch.Tensor]]:
    return [(fqn, p) for fqn, p in module.named_parameters() if p.requires_grad]


def _pieces(
    module: Any, unit_mesh: Any, servers: int
) -> list[list[tuple[wire.PieceKey, torch.Tensor, bool]]]:
    """Per server, this rank's pieces it holds: ``(key, parameter, owned)``.

    Parameters go to servers by size, largest first, each to the least loaded (the same on every
    rank). A piece's key is the parameter and this rank's coordinates on the axes splitting it;
    the rank owns it (pushes its gradient) where its other coordinates are 0.
    """
    coordinate = unit_mesh.get_coordinate()
    params = _trained(module)
    loads, server_of = [0] * servers, {}
    for fqn, p in sorted(params, key=lambda x: (-x[1].numel() * x[1].element_size(), x[0])):
        s = loads.index(min(loads))
        server_of[fqn], loads[s] = s, loads[s] + p.numel() * p.element_size()
    found: list[list[tuple[wire.PieceKey, torch.Tensor, bool]]] = [[] for _ in range(servers)]
    for fqn, p in params:
        split = [pl.is_shard() for pl in p.placements]
        key = (fqn, tuple(c if s else -1 for c, s in zip(coordinate, split)))
        owned = all(c == 0 for c, s in zip(coordinate, split) if not s)
        found[server_of[fqn]].append((key, p, owned))
    return found
