"""Every rank's values, for calls every rank makes together: gathered, any of them, the first's.

Without a process group (one process) each is the value itself, with no collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def ranks() -> tuple[int, int]:
    """This process's rank and the world's size: ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gathered(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank."""
    size = ranks()[1]
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, value)
    return out


def any_rank(flags: list[bool]) -> list[bool]:
    """For each flag, whether it is set on any rank (every rank passes as many, in the same order)."""
    if ranks()[1] == 1 or not flags:
        return flags
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()):
        device = torch.device("cuda", torch.cuda.current_device())
    summed = torch.tensor(flags, dtype=torch.uint8, device=device)
    dist.all_reduce(summed, op=dist.ReduceOp.MAX)
    return [bool(f) for f in summed.tolist()]


def shared(value: Any) -> Any:
    """The first rank's ``value``, on every rank."""
    if ranks()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
