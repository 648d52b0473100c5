"""Index arithmetic of a lookup into a dimension split across ranks (vocab-parallel lookups).

A dimension split over mesh axes ``axes`` (their keys joined by commas, outer axis first,
as DTensor splits) leaves the rank at linear coordinate ``c`` over those axes the rows
``[starts[c], starts[c + 1])`` (``starts``: ``autopar.ir.layout.row_starts`` of the rows
each rank holds: DTensor's pieces, or a parameter's ``ManualSplit``), stored from local row
0 on. A lookup of global indices then runs on local rows: :func:`block_index` shifts the
indices into the block (those outside it go to row 0, a valid row whose result
:func:`in_block` masks away), so that the local results summed over the axes are the whole
lookup (``passes/localize_lookups.py``).

Both are ``torch.library.custom_op`` s in namespace ``autopar`` (the coordinate is read from
the rank's mesh when run); their results are integers and booleans, which carry no gradient.
"""

from __future__ import annotations

import torch

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
