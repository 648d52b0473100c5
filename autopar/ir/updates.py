"""Update modes for the data-parallel axis: :class:`ParameterServer`, :class:`Async`, :class:`Hybrid`.

The option ``update=`` of ``plan``/``compile`` (``None``: synchronous all-reduce, the default).
Every mode cuts the data-parallel axis's replicas into *units* that count their steps (clocks)
apart and exchange gradients and parameters with server ranks instead of summing gradients with
each other; ``docs/update_modes.md`` states the semantics. Plain frozen data, checked when built;
:func:`check_update` checks one against a mesh and the other options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.ir.arguments import check_int, is_int, plain_number
from autopar.ir.errors import OptionError, ShapeError
from autopar.ir.mesh import MeshSpec


@dataclass(frozen=True)
class _Update:
    """What every mode shares: ``servers`` (the last ranks of the job hold the parameters and the
    optimizer state, sharded by parameter) and ``axis``, the data-parallel mesh axis it replaces.
    Counts are ints (a numpy integer is taken as the int it equals; a float, a bool is refused)."""

    servers: int = 1
    axis: str = "dp"

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("servers", "staleness", "groups"):
            if hasattr(self, field):  # frozen: the plain int set in place of a numpy one
                object.__setattr__(self, field, plain_number(getattr(self, field)))
        check_int(self.servers, f"{name}(servers=...) (server ranks)", minimum=1)
        if not isinstance(self.axis, str) or not self.axis:
            raise OptionError(
                f"{name}(axis=...) is the name of the data-parallel mesh axis, a non-empty str, got "
                f"{self.axis!r}"
            )

    @property
    def bound(self) -> int | None:
        """Clocks a unit may run ahead of the slowest unit's applied updates (None: unbounded)."""
        return 0

    def units(self, replicas: int) -> int:
        """How many units exchange with the servers apart, for ``replicas`` along :attr:`axis`."""
        return replicas


@dataclass(frozen=True)
class ParameterServer(_Update):
    """Parameters and optimizer state on ``servers`` ranks; each replica pulls the parameters at the
    start of a step and pushes its gradient at its end; the servers apply one optimizer step per
    step over every replica's gradient (synchronous: the same losses and weights as all-reduce)."""


@dataclass(frozen=True)
class Async(_Update):
    """Asynchronous updates with bounded staleness: the servers apply each replica's gradient as it
    arrives (one optimizer step each), and a replica starts its step ``c`` only once every
    replica's updates of steps up to ``c - 1 - staleness`` are applied (it waits otherwise).
    ``staleness=0`` is synchronous (one step over the clock's summed gradients); ``None`` never
    waits (fully asynchronous)."""

    staleness: int | None = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_staleness(self.staleness, "Async")

    @property
    def bound(self) -> int | None:
        return self.staleness


@dataclass(frozen=True)
class Hybrid(_Update):
    """``groups`` groups of consecutive replicas: synchronous all-reduce inside each group, and the
    groups update asynchronously (as :class:`Async`, each group one unit) with ``staleness``."""

    groups: int = 2
    staleness: int | None = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.groups, "Hybrid(groups=...) (groups of replicas)", minimum=1)
        _check_staleness(self.staleness, "Hybrid")

    @property
    def bound(self) -> int | None:
        return self.staleness

    def units(self, replicas: int) -> int:
        return self.groups


Update = ParameterServer | Async | Hybrid
UPDATES = (ParameterServer, Async, Hybrid)


def _check_staleness(value: object, name: str) -> None:
    if value is not None and not is_int(value) or is_int(value) and value < 0:
        raise OptionError(
            f"{name}(staleness=...) is the clocks a replica may run ahead, an int >= 0 (or None: "
            f"unbounded), got {value!r}"
        )


def check_update_kind(update: object) -> Update:
    """``update`` if it is an update mode (:data:`UPDATES`); an :class:`OptionError` naming them otherwise.

    Args:
        update: the value given as ``update=...``, other than None (the synchronous update).
    """
    if not isinstance(update, UPDATES):
        raise OptionError(
            "update=... is autopar.ParameterServer(...), autopar.Async(...), autopar.Hybrid(...) or None "
            f"(synchronous), got {type(update).__name__} {update!r}"
        )
    return update


def check_update(
    update: object,
    mesh: MeshSpec,
    *,
    world: int | None = None,
    pipeline: object = None,
    zero: int | None = None,
    offload: bool = False,
    example: Mapping[str, Any] | None = None,
) -> Update:
    """``update`` if it can run on ``mesh`` (the workers' mesh) with the other options.

    ``world`` is the job's rank count (workers and servers; None when planning without ranks).
    Raises :class:`OptionError` naming the option for anything else: not a mode, no such axis,
    replicas not divisible into groups, servers beyond the job's ranks, or a pipeline schedule,
    ZeRO or optimizer offload (state lives on the servers, and the workers run whole steps apart).
    ``example`` names the example inputs (``{"example_args": ...}``): a batch the units cannot
    share equally is a :class:`ShapeError` (:func:`check_unit_batch`).
    """
    update = check_update_kind(update)
    name = type(update).__name__
    if update.axis not in mesh.axis_names:
        raise OptionError(
            f"update={update!r} replaces the gradient sums of data-parallel axis {update.axis!r}, but mesh "
            f"{mesh} has no such axis: name the data-parallel axis {update.axis!r} or pass {name}(axis=...)"
        )
    replicas = mesh.axis_sizes[mesh.axis_index(update.axis)]
    units = update.units(replicas)
    if units > replicas or replicas % units:
        raise OptionError(
            f"Hybrid(groups={units}) cuts the {replicas} replicas of axis {update.axis!r} into equal groups: "
            f"use a divisor of {replicas}"
        )
    if example is not None:
        check_unit_batch(example, units)
    if world is not None and mesh.size + update.servers != world:
        raise OptionError(
            f"{name}(servers={update.servers}): the job has {world} ranks, so the workers' mesh must hold "
            f"{world - update.servers} (it holds {mesh.size}); servers must leave at least one worker "
            f"(at most {world - 1})"
            if update.servers < world
            else f"{name}(servers={update.servers}) asks for more servers than the job's {world} ranks"
        )
    if pipeline is not None:
        raise OptionError(
            f"update={update!r} cannot run with pipeline={pipeline!r}: a pipeline schedule runs a step "
            "across ranks in lockstep; use the synchronous update (update=None)"
        )
    if zero or offload:
        what = f"Memory(zero={zero})" if zero else "Memory(offload_optimizer=True)"
        raise OptionError(
            f"update={update!r} cannot run with {what}: the optimizer state lives on the servers; use "
            "Memory(zero=0) without offload, or more servers"
        )
    return update


def check_unit_batch(named: Mapping[str, Any], units: int) -> None:
    """Raise :class:`ShapeError` unless every tensor in ``named``'s values (inputs by name) has a
    dim 0, the batch, that ``units`` units share equally, at least one sample each: each unit runs
    its share."""
    for name, tree in named.items():
        for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, torch.Tensor) and (
                leaf.dim() == 0 or leaf.shape[0] % units or not leaf.shape[0]
            ):
                raise ShapeError(
                    f"under an update mode every input's dim 0 is the batch, cut among {units} units: "
                    f"{name}{pytree.keystr(path)} has shape {tuple(leaf.shape)}; give a batch that {units} "
                    "units share equally, at least one sample each"
                )
