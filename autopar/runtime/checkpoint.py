"""State dicts that ``torch.distributed.checkpoint`` reads and writes: every piece one block of the whole.

DCP describes each rank's piece of a DTensor as one block of the whole. Two kinds of
parameter are held otherwise, so ``state_dict()`` hands them out converted and
``load_state_dict()`` converts such values back before copying them in:

* a strided shard's piece (its slice of every part, :mod:`autopar.ir.strided`) is several
  blocks, which DCP's planner rejects as overlapping: it is handed out as the plain shard of
  the same dim (an all-to-all, at checkpoint time);
* a ``ManualSplit`` table is held in the user's rows per rank, each padded to the largest
  count (:func:`autopar.runtime.materialize.distributed_copy`): it is handed out in the
  model's own shape, split as DTensor splits it (an all-gather over the split axis).

Keys, shapes and values are the user's; only the placement of those entries differs (and
they are copies, not the parameters themselves).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.ir.layout import ManualRows
from autopar.ir.strided import is_split, is_strided
from autopar.runtime import pieces
from autopar.runtime.materialize import as_dtensor


def plain(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with each strided shard replaced by the plain shard of its dim."""
    return tuple(Shard(p.dim) if is_strided(p) else p for p in placements)


def _strided(value: object) -> bool:
    return isinstance(value, DTensor) and any(is_strided(p) for p in value.placements)


def _whole_on(placements: Sequence[Placement], dim: int) -> tuple[Placement, ...]:
    """``placements`` with the axis splitting ``dim`` replicated instead."""
    return tuple(Replicate() if is_split(p) and p.dim == dim else p for p in placements)


def _unpadded(value: DTensor, manual: ManualRows) -> DTensor:
    """A held ``ManualSplit`` table in its model's shape, split as DTensor splits it."""
    whole = value.detach().redistribute(value.device_mesh, _whole_on(value.placements, manual.dim))
    local = pieces.manual_whole(whole.to_local(), manual.dim, manual.rows)
    shape = list(value.shape)
    shape[manual.dim] = sum(manual.rows)
    like = local.new_empty(shape, device="meta")
    replicated = as_dtensor(local, value.device_mesh, whole.placements, like)
    return replicated.redistribute(value.device_mesh, value.placements)


def _padded(value: DTensor, target: DTensor, manual: ManualRows) -> DTensor:
    """``value`` (in the model's shape, any placements) as ``target`` holds it: this rank's rows, padded."""
    mesh, whole_on = target.device_mesh, _whole_on(target.placements, manual.dim)
    axis = next(a for a, p in enumerate(target.placements) if is_split(p) and p.dim == manual.dim)
    local = value.redistribute(mesh, whole_on).to_local()
    piece = pieces.manual_piece(local, manual.dim, manual.rows, mesh.get_local_rank(axis))
    return as_dtensor(piece.contiguous(), mesh, target.placements, target)


def handed_out(value: DTensor, manual: ManualRows | None) -> DTensor:
    """``value`` (a parameter, or optimizer state shaped like one) as a state dict hands it out:
    in its model's shape, every rank's piece one block (module docstring)."""
    if manual is not None:
        return _unpadded(value, manual)
    if _strided(value):
        return value.detach().redistribute(value.device_mesh, plain(value.placements))
    return value


def taken_back(value: DTensor, target: DTensor, manual: ManualRows | None) -> DTensor:
    """Inverse of :func:`handed_out`: ``value`` in ``target``'s form (its placements, padding)."""
    if manual is not None and value.shape != target.shape:
        return _padded(value, target, manual)
    if _strided(target) and value.placements != target.placements:
        return value.redistribute(target.device_mesh, target.placements)
    return value


def _hand_out(
    manual: Mapping[str, ManualRows], module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, _: Any
) -> None:
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            state_dict[key] = handed_out(
                value, manual.get(key[len(prefix) :]) if key.startswith(prefix) else None
            )


def _take_back(
    manual: Mapping[str, ManualRows],
    module: torch.nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    *_: Any,
) -> None:
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(module.named_buffers(remove_duplicate=False))
    for key, value in state_dict.items():
        name = key[len(prefix) :] if key.startswith(prefix) else None
        target = own.get(name) if name is not None else None
        if isinstance(value, DTensor) and isinstance(target, DTensor):
            state_dict[key] = taken_back(value, target, manual.get(name))


def keep_checkpoints_plain(module: torch.nn.Module, manual: Mapping[str, ManualRows]) -> None:
    """Make ``module``'s state dicts hand out and take strided parameters as plain shards and the
    ``manual`` tables (fqn -> rows) in their model's shape."""
    module.register_state_dict_post_hook(partial(_hand_out, manual))
    module.register_load_state_dict_pre_hook(partial(_take_back, manual))
