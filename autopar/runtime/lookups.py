"""Index arithmetic of a lookup into a dimension split across ranks (vocab-parallel lookups).

A dimension split over mesh axes ``axes`` (their keys joined by commas, outer axis first,
as DTensor splits) leaves the rank at linear coordinate ``c`` over those axes the rows
``[starts[c], starts[c + 1])`` (``starts``: ``autopar.ir.layout.row_starts`` of the rows
each rank holds: DTensor's pieces, or a parameter's ``ManualSplit``), stored from local row
0 on. A lookup of global indices then runs on local rows: :func:`block_index` shifts the
indices into the block (those outside it go to row 0, a valid row whose result
:func:`in_block` masks away), so that the local results summed over the axes are the whole
lookup (``passes/localize_lookups.py``).

An id outside the whole dimension falls in no rank's block and would look up zeros, where
one device raises ``IndexError``: :func:`check_ids` raises first, on every rank together (the
lookup's ids pass through it on their way to the other two).

All three are ``torch.library.custom_op`` s in namespace ``autopar`` (the coordinate is read
from the rank's mesh when run); their results are integers and booleans, which carry no
gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ir.errors import IndexRangeError
from autopar.runtime.collectives import axis_info


def _shifted(index: torch.Tensor, axes: str, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``index`` minus this rank's first row, and whether it falls in the rows this rank holds."""
    linear = 0
    for axis in axes.split(","):
        info = axis_info(axis)
        linear = linear * info.size + info.coordinate
    shifted = index - starts[linear]
    return shifted, (shifted >= 0) & (shifted < starts[linear + 1] - starts[linear])


@torch.library.custom_op("autopar::block_index", mutates_args=())
def block_index(index: torch.Tensor, axes: str, starts: list[int]) -> torch.Tensor:
    """``index`` shifted into this rank's block of rows; indices outside it become 0."""
    shifted, inside = _shifted(index, axes, starts)
    return torch.where(inside, shifted, 0)


@block_index.register_fake
def _(index: torch.Tensor, axes: str, starts: list[int]) -> torch.Tensor:
    return torch.empty_like(index)


@torch.library.custom_op("autopar::in_block", mutates_args=())
def in_block(index: torch.Tensor, axes: str, starts: list[int], leading: int, trailing: int) -> torch.Tensor:
    """Whether each index falls in this rank's block, with ``leading`` and ``trailing`` size-1
    dims added so that the mask broadcasts against the lookup's result."""
    _, inside = _shifted(index, axes, starts)
    return inside.view((1,) * leading + tuple(index.shape) + (1,) * trailing)


@in_block.register_fake
def _(index: torch.Tensor, axes: str, starts: list[int], leading: int, trailing: int) -> torch.Tensor:
    return index.new_empty((1,) * leading + tuple(index.shape) + (1,) * trailing, dtype=torch.bool)


def _id_range(index: torch.Tensor, axes: str) -> tuple[int, int]:
    """The least and the greatest id in ``index`` on every rank over ``axes`` (comma-joined keys,
    "" for this rank alone); ``(int64 max, int64 min)`` when no rank holds an id."""
    if index.numel():
        lo, hi = torch.aminmax(index.to(torch.int64))
        packed = torch.stack([~lo, hi])  # ~ reverses the order without overflow: max(~lo) = ~min(lo)
    else:
        packed = torch.full((2,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=index.device)
    for axis in filter(None, axes.split(",")):
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=axis_info(axis).group)
    not_lo, hi = packed.tolist()
    return ~not_lo, hi


@torch.library.custom_op("autopar::check_ids", mutates_args=())
def check_ids(index: torch.Tensor, size: int, axes: str, lookup: str) -> torch.Tensor:
    """A copy of ``index`` once every id of the whole lookup is known to lie in ``[0, size)``.

    ``size`` is the whole looked-up dim's (every rank's rows together). ``axes`` are the keys
    (comma-joined, "" for none) of the mesh axes whose ranks hold other ids (those that split
    ``index``): the least and greatest id are all-reduced over them, so every rank reaches the
    verdict of the whole batch; on the other axes every rank holds the same ids, and so reaches
    it alone. Raises :class:`~autopar.ir.errors.IndexRangeError`, naming ``lookup`` (words naming
    the op, its module and the dim), the ids' range and the valid one, on every rank together.
    """
    lo, hi = _id_range(index, axes)
    if lo < 0 or hi >= size:
        raise IndexRangeError(
            f"index out of range in {lookup}: its ids range from {lo} to {hi}, but the dim has {size} rows "
            f"(ids 0 to {size - 1}); one device raises IndexError here (autopar checks the ids of lookups "
            "into a dim split across ranks: compile's check_ids)"
        )
    return index.clone()


@check_ids.register_fake
def _(index: torch.Tensor, size: int, axes: str, lookup: str) -> torch.Tensor:
    return torch.empty_like(index)
