"""Strided shards: the one adapter onto DTensor's private ``_StridedShard``.

A fused projection's output dimension concatenates equal *parts* (q, k and v; gate and up).
Split by heads, each rank must hold its own piece of every part, not one contiguous block:
dimension ``d`` of ``parts`` equal parts, each cut into ``n`` pieces over a mesh axis of size
``n``, leaves rank ``r`` the concatenation of piece ``r`` of each part. DTensor names this
placement ``_StridedShard(d, split_factor=parts)`` (private: it was made for FSDP2 over
tensor parallelism, with the same meaning); autopar uses it so that a strided parameter is
a DTensor like any other (``full_tensor()``, checkpoints). ``tests/test_strided.py`` fails
loudly if torch changes the class or its meaning.

Everything else in autopar reads strided placements through this module.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard


def strided(dim: int, parts: int) -> Placement:
    """Dimension ``dim``, made of ``parts`` equal parts, each split over the axis (``parts == 1``:
    a plain ``Shard(dim)``)."""
    return Shard(dim) if parts == 1 else _StridedShard(dim, split_factor=parts)


def is_strided(p: Placement) -> bool:
    return isinstance(p, _StridedShard)


def is_split(p: Placement) -> bool:
    """A plain or a strided shard: the placement splits a tensor dimension."""
    return isinstance(p, (Shard, _StridedShard))


def parts_of(p: Placement) -> int:
    """How many equal parts a split dimension is made of (1 for a plain shard)."""
    return int(p.split_factor) if isinstance(p, _StridedShard) else 1
