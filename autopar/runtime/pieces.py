"""Tensor arithmetic of the collectives: chunks, stacks, strided parts and uneven pieces.

Pure functions of local tensors (no process group): :mod:`autopar.runtime.collectives`
moves the data, this module cuts and reassembles it. A dim split over ``n`` ranks leaves
rank ``c`` chunk ``c``; a strided shard (``parts > 1``, :mod:`autopar.ir.strided`) leaves it
its chunk of every part; an uneven split (``size`` rows that ``n`` does not divide) leaves it
DTensor's piece (``autopar.ir.layout.piece_size``): ``ceil(size / n)`` rows, fewer on the
last rank. Collectives move uneven pieces padded to that largest piece at the end of the
dim, so that the padding of the whole is its last rows. A lookup table's ``ManualSplit`` gives
each rank the rows the user chose, held padded to the largest count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.ir.layout import piece_size, row_starts


def resized(x: torch.Tensor, dim: int, times: int = 1, over: int = 1) -> list[int]:
    """Shape of ``x`` with dimension ``dim`` multiplied by ``times`` and divided by ``over``."""
    shape = list(x.shape)
    shape[dim] = shape[dim] * times // over
    return shape


def with_rows(x: torch.Tensor, dim: int, rows: int) -> list[int]:
    """Shape of ``x`` with ``rows`` along ``dim``."""
    shape = list(x.shape)
    shape[dim] = rows
    return shape


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def stacked_chunks(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x`` cut into ``n`` chunks along ``dim``, stacked on a new leading dimension, contiguous.

    The collectives move whole leading slices; for ``dim == 0`` this is a view, no copy.
    """
    return x.unflatten(dim, (n, -1)).movedim(dim, 0).contiguous()


def concat_stacked(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`stacked_chunks`: concatenate the leading slices along ``dim``, contiguous.

    Contiguous as the concatenation on one device would be: a later ``view`` of the
    program (Swin's window partition after a gather of a size-1 dim) needs that.
    """
    return stacked.movedim(0, dim).flatten(dim, dim + 1).contiguous()


def flat_stack(stacked: torch.Tensor) -> torch.Tensor:
    """A contiguous ``(n, d0, ...)`` stack as the ``(n * d0, ...)`` concatenation, a view.

    Every backend accepts this form of the single-tensor collectives; not all accept the stack.
    """
    return stacked.flatten(0, 1)


def rank_major(x: torch.Tensor, dim: int, parts: int, n: int) -> torch.Tensor:
    """``dim`` of ``parts`` equal parts reordered so that chunk ``r`` of ``n`` holds piece ``r`` of
    every part (a strided shard's pieces, see ``autopar.ir.strided``); ``parts == 1``: ``x``."""
    if parts == 1:
        return x
    return x.unflatten(dim, (parts, n, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def part_major(x: torch.Tensor, dim: int, parts: int, n: int) -> torch.Tensor:
    """Inverse of :func:`rank_major`: the ranks' chunks back into their parts, contiguous."""
    if parts == 1:
        return x
    return x.unflatten(dim, (n, parts, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def piece(x: torch.Tensor, dim: int, n: int, c: int, parts: int = 1, size: int = 0) -> torch.Tensor:
    """Rank ``c``'s piece of ``x`` along ``dim`` split over ``n`` ranks (a view): its chunk of every
    part (``parts``), or, where ``size`` (the dim's rows) is given, its uneven piece."""
    if size:
        start = min(c * piece_size(size, n), size)  # the last ranks' pieces may be empty
        return x.narrow(dim, start, piece_size(size, n, c))
    x = rank_major(x, dim, parts, n)
    rows = x.shape[dim] // n
    return x.narrow(dim, c * rows, rows)


def manual_piece(x: torch.Tensor, dim: int, rows: Sequence[int], c: int) -> torch.Tensor:
    """Rank ``c``'s rows of ``x`` along ``dim`` when the ranks hold ``rows[c]`` rows each in order
    (a ``ManualSplit``), padded with zero rows to the largest count."""
    return padded(x.narrow(dim, row_starts(rows)[c], rows[c]), dim, max(rows))


def manual_whole(x: torch.Tensor, dim: int, rows: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`manual_piece` over all ranks: from their padded pieces laid end to end
    along ``dim``, the whole without padding."""
    block = max(rows)
    return torch.cat([x.narrow(dim, c * block, r) for c, r in enumerate(rows)], dim)


def padded(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``x`` with zero rows added at the end of ``dim`` up to ``rows`` (``x`` itself if it has them)."""
    missing = rows - x.shape[dim]
    if missing == 0:
        return x
    return torch.cat([x, x.new_zeros(with_rows(x, dim, missing))], dim)
