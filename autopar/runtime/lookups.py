"""Index arithmetic of a lookup into a dimension split across ranks (vocab-parallel lookups).

A dimension of ``size`` rows split over mesh axes ``axes`` (their keys joined by commas,
outer axis first, as DTensor splits) leaves this rank the block of rows
``[offset, offset + block)``, ``offset`` being its linear coordinate over those axes times
``block`` (split unevenly over one axis: ``block`` is the largest piece and the last rank's
block is cut at the dim's ``rows``). A lookup of global indices then
runs on local rows: :func:`block_index` shifts the indices into the block (those outside
it go to row 0, a valid row whose result :func:`in_block` masks away), so that the local
results summed over the axes are the whole lookup (``passes/localize_lookups.py``).

Both are ``torch.library.custom_op`` s in namespace ``autopar`` (the offset is read from the
rank's mesh coordinates when run); their results are integers and booleans, which carry
no gradient.
"""

from __future__ import annotations

import torch

from autopar.runtime.collectives import axis_info


def _shifted(index: torch.Tensor, axes: str, block: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``index`` minus this rank's offset, and whether it falls in the rows this rank holds."""
    linear = 0
    for axis in axes.split(","):
        info = axis_info(axis)
        linear = linear * info.size + info.coordinate
    offset = linear * block
    held = min(block, rows - offset) if rows else block
    shifted = index - offset
    return shifted, (shifted >= 0) & (shifted < held)


@torch.library.custom_op("autopar::block_index", mutates_args=())
def block_index(index: torch.Tensor, axes: str, block: int, rows: int = 0) -> torch.Tensor:
    """``index`` shifted into this rank's block of ``block`` rows; indices outside it become 0.
    ``rows``: the whole dim's rows where they split unevenly (the last block is shorter)."""
    shifted, inside = _shifted(index, axes, block, rows)
    return torch.where(inside, shifted, 0)


@block_index.register_fake
def _(index: torch.Tensor, axes: str, block: int, rows: int = 0) -> torch.Tensor:
    return torch.empty_like(index)


@torch.library.custom_op("autopar::in_block", mutates_args=())
def in_block(
    index: torch.Tensor, axes: str, block: int, leading: int, trailing: int, rows: int = 0
) -> torch.Tensor:
    """Whether each index falls in this rank's block, with ``leading`` and ``trailing`` size-1
    dims added so that the mask broadcasts against the lookup's result."""
    _, inside = _shifted(index, axes, block, rows)
    return inside.view((1,) * leading + tuple(index.shape) + (1,) * trailing)


@in_block.register_fake
def _(index: torch.Tensor, axes: str, block: int, leading: int, trailing: int, rows: int = 0) -> torch.Tensor:
    return index.new_empty((1,) * leading + tuple(index.shape) + (1,) * trailing, dtype=torch.bool)
