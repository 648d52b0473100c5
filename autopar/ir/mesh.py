"""Meshes for planning: axis names and sizes, with or without ranks.

Planning never needs a process group. A :class:`MeshSpec` is built from a mapping
such as ``{"dp": 8, "tp": 8}``, from a real ``DeviceMesh`` (its ``mesh_dim_names``
are required), or from another ``MeshSpec``. Axes are ordered as given; devices are
numbered row-major over them, so the last axis varies fastest (the cost model reads
this to decide which axes stay inside a node).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from autopar.ir.arguments import check_int
from autopar.ir.errors import CompileError, OptionError

#: A partition of a mesh's axes into runs of consecutive axes, as axis indices: ``((0, 1), (2,))``.
AxisGroups = tuple[tuple[int, ...], ...]
T = TypeVar("T")


@dataclass(frozen=True)
class MeshSpec:
    """A logical device mesh: ``axis_names[i]`` has ``axis_sizes[i]`` devices."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.axis_sizes) or not self.axis_names:
            raise OptionError(
                f"mesh needs one size per axis name and at least one axis, got names "
                f"{self.axis_names} and sizes {self.axis_sizes}"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise OptionError(f"mesh axis names must be distinct, got {self.axis_names}")
        for name, size in zip(self.axis_names, self.axis_sizes):
            if not isinstance(name, str) or not name.isidentifier():
                raise OptionError(f"mesh axis name {name!r} must be an identifier such as 'dp'")
            check_int(size, f"the size of mesh axis {name!r}", minimum=1)

    @classmethod
    def of(cls, mesh: MeshSpec | Mapping[str, int] | Any) -> MeshSpec:
        """Build from a ``MeshSpec``, a ``{name: size}`` mapping or a named ``DeviceMesh``."""
        if isinstance(mesh, MeshSpec):
            return mesh
        if isinstance(mesh, Mapping):
            return cls(tuple(mesh.keys()), tuple(mesh.values()))
        names = getattr(mesh, "mesh_dim_names", None)
        shape = getattr(mesh, "shape", None)
        if shape is None:
            raise OptionError(
                f"expected a DeviceMesh, a MeshSpec or a mapping like {{'dp': 2, 'tp': 4}}, "
                f"got {type(mesh).__name__}"
            )
        if names is None:
            raise OptionError(
                "the DeviceMesh has no axis names: create it with "
                "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
            )
        return cls(tuple(names), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.axis_names)

    @property
    def size(self) -> int:
        """Total number of devices."""
        return math.prod(self.axis_sizes)

    def axis_index(self, name: str) -> int:
        """Index of the axis called ``name``; a clear error lists the known names."""
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise OptionError(
                f"unknown mesh axis {name!r}; this mesh has axes {list(self.axis_names)}"
            ) from None

    def to_dict(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    def __str__(self) -> str:
        return "×".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes))


def check_in_world(device_mesh: Any) -> None:
    """Raise ``CompileError`` unless every rank of ``device_mesh`` is a rank of this process's world:
    a mesh built in another process group (a bigger one, or one since destroyed) would compile a
    program for ranks that do not exist.

    Args:
        device_mesh: a named ``DeviceMesh``.
    """
    import torch.distributed as dist

    spec = MeshSpec.of(device_mesh)
    if not dist.is_initialized():
        raise CompileError(
            f"the DeviceMesh {spec} ({spec.size} ranks) needs a process group, and there is none: build "
            "it after init_process_group, on every rank of the job (or plan without ranks: autopar.plan)"
        )
    world, last = dist.get_world_size(), int(device_mesh.mesh.max())
    if last >= world:
        raise CompileError(
            f"the DeviceMesh {spec} holds {spec.size} ranks (up to rank {last}), but the world has {world}: "
            f"build the mesh from this job's ranks (a mesh of {world} devices, such as "
            f"init_device_mesh(..., ({world},)), or start {spec.size} ranks)"
        )


def each_axis(mesh: MeshSpec) -> AxisGroups:
    """The finest partition: every axis alone."""
    return tuple((a,) for a in range(mesh.ndim))


def grouped_product(
    options: Sequence[T], mesh: MeshSpec, groups: AxisGroups | None = None
) -> Iterator[tuple[T, ...]]:
    """Every tuple of one option per mesh axis (``itertools.product`` over the axes); with
    ``groups``, the axes of a group take the same option (a label on a group splits over all
    its axes, outer first)."""
    if groups is None:
        yield from itertools.product(options, repeat=mesh.ndim)
        return
    for combo in itertools.product(options, repeat=len(groups)):
        out: list[Any] = [None] * mesh.ndim
        for group, option in zip(groups, combo):
            for a in group:
                out[a] = option
        yield tuple(out)


def refine_groups(groups: AxisGroups | None, layouts: Sequence[Sequence[Any]]) -> AxisGroups | None:
    """``groups`` with each group cut where ``layouts`` (placements per axis) place its axes
    differently, so that strategies over the result can match those layouts."""
    if groups is None:
        return None
    out: list[tuple[int, ...]] = []
    for group in groups:
        parts: dict[tuple, list[int]] = {}
        for a in group:
            parts.setdefault(tuple(layout[a] for layout in layouts), []).append(a)
        out += [tuple(axes) for axes in parts.values()]
    return tuple(out)
