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

import math
import re
from collections.abc import Sequence

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


def local_shape(shape: Sequence[int], layout: Layout, mesh: MeshSpec) -> tuple[int, ...]:
    """Per-rank shape of a tensor of global ``shape`` (dimensions assumed divisible)."""
    counts = shard_counts(layout, mesh, len(shape))
    return tuple(s // c for s, c in zip(shape, counts))


def local_fraction(layout: Layout, mesh: MeshSpec) -> float:
    """Fraction of the global tensor that each rank holds."""
    return 1.0 / math.prod(size for p, size in zip(layout, mesh.axis_sizes) if is_split(p))


def is_valid_for(layout: Layout, shape: Sequence[int], mesh: MeshSpec) -> bool:
    """True if every sharded dimension exists and divides evenly (each part of a strided one)."""
    if len(layout) != mesh.ndim:
        return False
    for p in layout:
        if is_split(p) and not 0 <= p.dim < len(shape):
            return False
    counts = shard_counts(layout, mesh, len(shape))
    for p in layout:
        if is_split(p):
            counts[p.dim] *= parts_of(p)
    return all(s % c == 0 for s, c in zip(shape, counts))


def grad_layout(layout: Layout) -> Layout:
    """Layout a gradient must end in for a value held in ``layout``.

    A Partial value's gradient is the same on every rank (Replicate); a sharded or
    replicated value's gradient has the value's own layout.
    """
    return tuple(REPLICATE if isinstance(p, Partial) else p for p in layout)
