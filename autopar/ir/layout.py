"""Layouts: one DTensor placement per mesh axis.

A ``Layout`` is a tuple with one ``Shard(d)``, ``Replicate()`` or ``Partial()`` per
mesh axis (``Partial("max")`` too: each rank holds a value whose maximum over the axis is
the whole one), exactly DTensor's placements, so a layout can be handed to
``distribute_tensor`` unchanged. Several axes may shard the same tensor dimension;
as in DTensor, the earlier mesh axis takes the outer split.

Layouts print in DTensor's short form, one entry per axis: ``S(0)R`` on a 2-axis
mesh means "dimension 0 split over axis 0, replicated over axis 1"; a partial maximum prints
``P(max)``, and a strided shard of dimension 1 made of 3 equal parts (q, k and v; see
:mod:`autopar.ir.strided`) ``S(1)x3``;
:func:`parse_layout` reads that form back (plans are saved with it).
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Sequence
from typing import NamedTuple

from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from autopar.ir.mesh import MeshSpec
from autopar.ir.strided import is_split, parts_of, strided

Layout = tuple[Placement, ...]

REPLICATE = Replicate()
PARTIAL = Partial()
PARTIAL_MAX = Partial("max")

_TOKEN = re.compile(r"S\((\d+)\)(?:x(\d+))?|R|P\(max\)|P")


def replicated(mesh: MeshSpec) -> Layout:
    """The fully replicated layout on ``mesh``."""
    return (REPLICATE,) * mesh.ndim


@functools.cache  # plans print the same few layouts hundreds of thousands of times
def on_one_device_whole(layout: Layout, mesh: MeshSpec) -> Layout:
    """``layout`` with every placement on an axis of one device made ``Replicate``: such an axis
    splits and sums nothing, so the tensor is the same, and layouts that differ only there compare
    equal (no redistribution, no second copy in the memory model).

    Args:
        layout: one placement per axis of ``mesh``.
        mesh: the mesh it lays a tensor out on.
    """
    if all(size > 1 for size in mesh.axis_sizes):
        return layout
    return tuple(p if size > 1 else REPLICATE for p, size in zip(layout, mesh.axis_sizes))


def format_layout(layout: Layout) -> str:
    """Short form, e.g. ``S(0)R`` (see module docstring)."""
    out = []
    for p in layout:
        if is_split(p):
            parts = parts_of(p)
            out.append(f"S({p.dim})" + (f"x{parts}" if parts > 1 else ""))
        elif p == PARTIAL_MAX:
            out.append("P(max)")
        elif p == PARTIAL:
            out.append("P")
        elif isinstance(p, Replicate):
            out.append("R")
        else:
            raise TypeError(f"unsupported placement {p!r}")
    return "".join(out)


def parse_layout(text: str) -> Layout:
    """Inverse of :func:`format_layout`."""
    pos, out = 0, []
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"cannot read layout {text!r} at position {pos}: expected S(d), R or P")
        tok = m.group(0)
        named = {"R": REPLICATE, "P": PARTIAL, "P(max)": PARTIAL_MAX}
        out.append(strided(int(m.group(1)), int(m.group(2) or 1)) if tok.startswith("S") else named[tok])
        pos = m.end()
    return tuple(out)


def shard_counts(layout: Layout, mesh: MeshSpec, ndim: int) -> list[int]:
    """How many pieces each tensor dimension is cut into under ``layout``."""
    counts = [1] * ndim
    for p, size in zip(layout, mesh.axis_sizes):
        if is_split(p):
            counts[p.dim] *= size
    return counts


def piece_size(size: int, n: int, coordinate: int | None = None) -> int:
    """Rows of a dim of ``size`` rows that the rank at ``coordinate`` holds when one mesh axis of
    size ``n`` splits it as DTensor (and ``torch.chunk``) does: ``ceil(size / n)`` each, the
    last non-empty piece the rest. ``None``: the largest piece (what the planner prices)."""
    block = -(-size // n)
    if coordinate is None:
        return block
    return max(0, min(block, size - coordinate * block))


class ManualRows(NamedTuple):
    """A dim split over one mesh axis in the rows each rank holds, coordinate order (a lookup
    table's ``ManualSplit``; DTensor cannot describe it, see ``docs/annotations.md``)."""

    dim: int
    rows: tuple[int, ...]

    def held_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape the ranks' pieces make when each is padded to the largest (how the
        compiled module holds the table: a DTensor split evenly, see ``runtime/checkpoint.py``)."""
        return tuple(len(self.rows) * max(self.rows) if d == self.dim else s for d, s in enumerate(shape))


def row_starts(rows: Sequence[int]) -> tuple[int, ...]:
    """Where each rank's rows begin when ranks hold ``rows[c]`` rows each in coordinate order,
    and where the last ends: ``len(rows) + 1`` offsets (a lookup's blocks, ``runtime/lookups.py``)."""
    return tuple(itertools.accumulate(rows, initial=0))


def pieces_of(size: int, n: int) -> tuple[int, ...]:
    """The rows each of ``n`` ranks holds of a dim of ``size`` rows split as DTensor does."""
    return tuple(piece_size(size, n, c) for c in range(n))


def is_uneven(size: int, n: int) -> bool:
    """Whether splitting ``size`` rows over ``n`` ranks leaves pieces of different sizes."""
    return size % n != 0


def splits_unevenly(size: int, n: int) -> bool:
    """Whether ``size`` rows split over ``n`` ranks as DTensor splits them leave pieces of different
    sizes, the last ranks' perhaps empty (25 heads over 8 ranks: six pieces of 4, one of 1, one of
    none; see :func:`every_rank_holds_a_row`)."""
    return is_uneven(size, n)


def every_rank_holds_a_row(size: int, n: int) -> bool:
    """Whether each of ``n`` ranks holds at least one of ``size`` rows split as DTensor splits them
    (``torch.chunk``'s pieces leave the last ranks nothing where ``ceil(size / n)`` takes them all
    before: 25 over 8)."""
    return piece_size(size, n) * (n - 1) < size


def local_shape(
    shape: Sequence[int], layout: Layout, mesh: MeshSpec, coordinates: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Per-rank shape of a tensor of global ``shape``: at mesh ``coordinates``, or the largest
    piece where they are not given. A dim split unevenly is split over one axis only."""
    out = list(shape)
    for a, (p, n) in enumerate(zip(layout, mesh.axis_sizes)):
        if is_split(p):
            if is_uneven(out[p.dim], n):
                out[p.dim] = piece_size(out[p.dim], n, None if coordinates is None else coordinates[a])
            else:
                out[p.dim] //= n
    return tuple(out)


def local_fraction(layout: Layout, mesh: MeshSpec) -> float:
    """Fraction of the global tensor that each rank holds."""
    return 1.0 / math.prod(size for p, size in zip(layout, mesh.axis_sizes) if is_split(p))


def is_valid_for(layout: Layout, shape: Sequence[int], mesh: MeshSpec, uneven: bool = False) -> bool:
    """True if every sharded dimension exists and divides evenly (each part of a strided one);
    with ``uneven`` (a parameter's stored layout), a dim split plainly over one axis may also split
    unevenly where every rank holds a row (``every_rank_holds_a_row``: a parameter is not stored in
    empty pieces)."""
    if len(layout) != mesh.ndim:
        return False
    for p in layout:
        if is_split(p) and not 0 <= p.dim < len(shape):
            return False
    counts = shard_counts(layout, mesh, len(shape))
    for p in layout:
        if is_split(p):
            counts[p.dim] *= parts_of(p)
    axes_of = [
        [n for p, n in zip(layout, mesh.axis_sizes) if is_split(p) and p.dim == d] for d in range(len(shape))
    ]
    return all(
        s % c == 0
        or (
            uneven
            and len(axes) == 1
            and c == axes[0]
            and splits_unevenly(s, c)
            and every_rank_holds_a_row(s, c)
        )
        for s, c, axes in zip(shape, counts, axes_of)
    )


def grad_layout(layout: Layout) -> Layout:
    """Layout a gradient must end in for a value held in ``layout``.

    A Partial value's gradient is the same on every rank (Replicate); a sharded or
    replicated value's gradient has the value's own layout.
    """
    return tuple(REPLICATE if isinstance(p, Partial) else p for p in layout)
