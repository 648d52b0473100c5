"""State dicts that ``torch.distributed.checkpoint`` reads and writes: strided parameters as plain shards.

DCP describes each rank's piece of a DTensor as one block of the whole; a strided shard's
piece (its slice of every part, :mod:`autopar.ir.strided`) is several blocks, which DCP's
planner rejects as overlapping. So ``state_dict()`` hands out a strided parameter
redistributed to the plain shard of the same dim (an all-to-all, at checkpoint time), and
``load_state_dict()`` redistributes such a value back before copying it in. Keys, shapes
and values are the user's; only the placement of those entries differs (and they are
copies, not the parameters themselves).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.ir.strided import is_strided


def plain(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with each strided shard replaced by the plain shard of its dim."""
    return tuple(Shard(p.dim) if is_strided(p) else p for p in placements)


def _strided(value: object) -> bool:
    return isinstance(value, DTensor) and any(is_strided(p) for p in value.placements)


def _to_plain(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key, value in state_dict.items():
        if _strided(value):
            state_dict[key] = value.detach().redistribute(value.device_mesh, plain(value.placements))


def _to_strided(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(module.named_buffers(remove_duplicate=False))
    for key, value in state_dict.items():
        target = own.get(key[len(prefix) :]) if key.startswith(prefix) else None
        if _strided(target) and isinstance(value, DTensor) and value.placements != target.placements:
            state_dict[key] = value.redistribute(target.device_mesh, target.placements)


def keep_checkpoints_plain(module: torch.nn.Module) -> None:
    """Make ``module``'s state dicts hand out and take strided parameters as plain shards."""
    module.register_state_dict_post_hook(_to_plain)
    module.register_load_state_dict_pre_hook(_to_strided)
