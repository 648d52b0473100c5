"""Activation offload: what autograd saves in the forward is kept in host memory until backward.

The plan predicts what moves (``plan.memory.host_activation_bytes``); :class:`HostActivations`
counts what did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# What pack() hands autograd for a copied tensor: enough to rebuild the same view of the storage.
_Packed = tuple[torch.device, StorageWeakRef, int, torch.Size, tuple[int, ...], torch.dtype]


class HostActivations:
    """Host copies of the storages autograd saves, each copied once, restored in backward.

    A tensor saved several times (or through views) is copied once; one whose storage is
    ``resident`` (parameters, the batch: memory the step does not allocate) is kept as it
    is. ``nbytes`` is what was copied to the host so far. With ``pin`` the copies live in
    pinned (page-locked) host memory, as CUDA transfers want.
    """

    def __init__(self, resident: Iterable[Any], pin: bool) -> None:
        self.pin = pin
        self.nbytes = 0
        self._resident = {
            StorageWeakRef(t.untyped_storage()) for t in resident if isinstance(t, torch.Tensor)
        }
        self._copies: dict[StorageWeakRef, torch.Tensor] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor | _Packed:
        """Autograd's pack hook: ``t`` itself if resident, else where it lives in its host copy."""
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        if key in self._resident:
            return t
        if key not in self._copies:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            host = whole.to(torch.device("cpu"), copy=True)
            self._copies[key] = host.pin_memory() if self.pin else host
            self.nbytes += storage.nbytes()
        return t.device, key, t.storage_offset(), t.size(), t.stride(), t.dtype

    def unpack(self, packed: torch.Tensor | _Packed) -> torch.Tensor:
        """Autograd's unpack hook: the saved tensor, copied back to its device."""
        if isinstance(packed, torch.Tensor):
            return packed
        device, key, offset, size, stride, dtype = packed
        storage = self._copies[key].to(device).untyped_storage()
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)


@contextlib.contextmanager
def activations_to_host(resident: Iterable[Any], pin: bool) -> Iterator[HostActivations]:
    """Keep what autograd saves inside this block on the host (see :class:`HostActivations`).

    What a recompute region keeps (its inputs, the outputs its policy saves) stays with
    the region.
    """
    host = HostActivations(resident, pin)
    with torch.autograd.graph.saved_tensors_hooks(host.pack, host.unpack):
        yield host
