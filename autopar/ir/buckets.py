"""How gradient sums are packed into buckets: one rule, read by the runtime that packs them
(:class:`~autopar.runtime.grad_reducer.GradReducer`) and the cost model that prices them
(:mod:`autopar.planning.cost.step_overheads`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")

# As DDP: a small first bucket, so the first sum starts early in backward, then big ones.
FIRST_BUCKET_BYTES = 2**20
BUCKET_BYTES = 25 * 2**20


def pack(
    items: Sequence[T],
    group_of: Callable[[T], Hashable],
    bytes_of: Callable[[T], float],
    bucket_bytes: float = BUCKET_BYTES,
) -> list[list[T]]:
    """``items`` (parameters in the order the module lists them) packed into buckets.

    Items are taken in reverse order (roughly the order backward completes their gradients),
    grouped by ``group_of`` (what one collective sums together: its mesh axes; groups in order
    of first appearance), and each group is cut into buckets: a new one at the group's first
    item and wherever the next would take the bucket past its cap, which is
    :data:`FIRST_BUCKET_BYTES` for the very first bucket (so the first sum starts early) and
    ``bucket_bytes`` for the others. An item larger than the cap has a bucket of its own.
    """
    groups: dict[Hashable, list[T]] = {}
    for item in reversed(items):
        groups.setdefault(group_of(item), []).append(item)
    found: list[list[T]] = []
    for group in groups.values():
        size = 0.0
        for k, item in enumerate(group):
            cap = min(FIRST_BUCKET_BYTES, bucket_bytes) if len(found) == 1 else bucket_bytes
            if k == 0 or size + bytes_of(item) > cap:
                found.append([])
                size = 0.0
            found[-1].append(item)
            size += bytes_of(item)
    return found
