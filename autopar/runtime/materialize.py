"""Real tensors for this rank: a model built on ``meta`` given weights, a rank's pieces of whole tensors.

None of these communicates: every rank computes the same whole tensors and keeps its piece.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopar.ir.layout import Layout, ManualRows, is_uneven
from autopar.ir.strided import is_split, parts_of
from autopar.runtime import pieces
from autopar.runtime.initialize import has_meta, initialize


def materialize(
    model: torch.nn.Module, seed: int, *, init: Callable[[torch.nn.Module], None] | None = None
) -> torch.nn.Module:
    """A copy of a model built on ``meta`` with the initial values its own code gives, the same on every rank.

    The contract is :mod:`autopar.runtime.initialize`'s: a transformers model's own
    initialisation (``_init_weights``: norms, rotary ``inv_freq``, position ids, tied
    weights kept tied), every other module's ``reset_parameters()`` children first, then
    ``init(module)`` when given, all on the CPU after ``torch.manual_seed(seed)``; tensors
    not on meta keep their values, and a meta tensor none of these sets raises
    :class:`~autopar.ir.errors.InitializationError` naming it. A model without meta tensors
    is returned as it is. (The whole model is built on every rank before each keeps its
    piece: fine for models that fit one host.)
    """
    if not has_meta(model):
        return model
    return initialize(model, seed, init)


def local_piece(t: torch.Tensor, layout: Layout, mesh: Any, manual: ManualRows | None = None) -> torch.Tensor:
    """This rank's piece of a global tensor that every rank holds whole (no communication).

    With ``manual``, its dim is cut in those rows, padded to the largest count
    (:func:`autopar.runtime.pieces.manual_piece`). A split piece is a copy: a view would keep
    the whole tensor's memory alive.
    """
    piece = t
    for axis, p in enumerate(layout):
        if is_split(p) and manual is not None and p.dim == manual.dim:
            piece = pieces.manual_piece(piece, p.dim, manual.rows, mesh.get_local_rank(axis))
        elif is_split(p):
            n, rows = mesh.size(axis), piece.shape[p.dim]
            size = rows if is_uneven(rows, n) else 0
            piece = pieces.piece(piece, p.dim, n, mesh.get_local_rank(axis), parts_of(p), size)
    return piece.contiguous() if piece is t else piece.clone(memory_format=torch.contiguous_format)


def as_dtensor(local: torch.Tensor, mesh: Any, placements: Layout, like: torch.Tensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor with ``like``'s global shape and strides: given,
    not inferred, since DTensor infers them from even pieces (wrong for an uneven split)."""
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def distributed_copy(
    model: torch.nn.Module,
    placements: Mapping[str, Layout],
    mesh: Any,
    kept: set[str] | None = None,
    manual: Mapping[str, ManualRows] = MappingProxyType({}),
) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are DTensors on ``mesh`` holding this rank's pieces.

    ``placements`` maps every name of a parameter or buffer to its layout. Names stay the
    model's, so ``state_dict()`` keys do too; a tensor with several names (tied weights)
    stays one tensor. With ``kept`` (under a pipeline: the names this rank's stages read)
    every other parameter or buffer belongs to another rank's stages and is set to None.
    A table in ``manual`` is held in its rows per rank, each padded to the largest count: a
    DTensor of :meth:`~autopar.ir.layout.ManualRows.held_shape` split evenly (DTensor cannot
    describe pieces of chosen sizes).
    """
    replica = copy.deepcopy(model)
    path_of: dict[int, str] = {}  # module -> its first path, as named_parameters() names it
    for path, module in replica.named_modules(remove_duplicate=False):
        path_of.setdefault(id(module), path)
    swapped: dict[int, torch.Tensor] = {}
    for module in replica.modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(store.items()):
                if t is None:
                    continue
                fqn = f"{path_of[id(module)]}.{name}" if path_of[id(module)] else name
                if kept is not None and fqn not in kept:
                    store[name] = None  # another pipeline stage's: not held on this rank
                    continue
                if id(t) not in swapped:
                    layout, rows = placements[fqn], manual.get(fqn)
                    like = t if rows is None else t.new_empty(rows.held_shape(t.shape), device="meta")
                    dt = as_dtensor(local_piece(t.detach(), layout, mesh, rows), mesh, layout, like)
                    swapped[id(t)] = torch.nn.Parameter(dt, requires_grad=t.requires_grad) if is_param else dt
                store[name] = swapped[id(t)]
    return replica
