"""Measure the activation memory of a real training step: :class:`ActivationMeter`.

The meter counts the storages that ops allocate in the forward of a real run and are still alive at
each moment. Right after the forward, that is what autograd saved plus the outputs the caller holds,
which a plan's ``memory.activation_kept_bytes`` predicts (from
:func:`autopar.planning.memory.saved_tensors.saved_by`): on CPU the two agree to the byte for the MLP and GPT
of the tests (fp32 and bf16, with and without dropout). Known reasons they can differ:

* the prediction follows storage sharing of the exported fake values, which can differ from the
  eager run's (``dropout`` with ``p=0`` returns its input eagerly but a fresh value in export:
  :func:`autopar.planning.graph.storages.source_of` follows it through), and ``capture`` adds
  ``layout_constraint``
  copies at block boundaries that the eager model lacks;
* export inlines a model's own ``torch.utils.checkpoint`` regions, so the prediction is for the
  model without them (``autopar.recompute`` regions are predicted: :mod:`autopar.planning.memory.model`);
* accelerators save differently (a CUDA dropout mask is ``bool``, attention adds RNG state): the
  prediction follows the device of the graph's operands;
* both count storage bytes, not the allocator's rounded blocks or its cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from autopar.ir.meta import storage_ref


class ActivationMeter(TorchDispatchMode):
    """Measures activation memory of real tensors during a training step (a ``with`` block).

    Counts the storage of every tensor that an op (ATen or custom) allocates in the forward: while
    ``torch.is_grad_enabled()`` (the forward pass, and activation-checkpoint recomputation inside
    backward), and inside the forward of an ``autograd.Function``, which torch runs with grad mode
    off: custom ops with autograd (``torch.library.custom_op``) are called that way, so their
    outputs would otherwise be missed. Such a forward is told apart from ``torch.no_grad`` code and
    from backward (both of which leave forward-mode AD on) by forward-mode AD being off too; code
    under ``torch.inference_mode`` is not counted. So ordinary backward ops are not counted (nor are
    the gradients), and neither is work under ``torch.no_grad`` (an optimizer step); a backward with
    ``create_graph=True`` runs with grad mode on and is counted.

    Outputs that alias an operand are not allocations and are skipped: those the op schema marks as
    aliases (views, in-place and ``out=`` ops) and those sharing an operand's storage
    (``_unsafe_view``). Each storage counts once, at ``untyped_storage().nbytes()``, for as long as
    it is alive; a wrapper subclass such as DTensor counts by its inner tensors (the local shard),
    sparse and nested tensors not at all. Liveness is re-checked after every op (any op, counted or
    not), so the cost per op is O(tracked live storages).

    What is alive after the forward is what autograd saved plus whatever the caller still holds:
    the forward's outputs (the loss, logits) and any tensor kept in Python. Tensors created before
    the block (parameters, inputs) and by code that dispatches no op are not counted.

    ``live`` is the bytes alive now, ``peak`` the most seen alive after any op or :meth:`mark`
    within the block, ``marks`` the live bytes recorded by :meth:`mark`. Entering the block again
    starts from zero.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tracked: dict[StorageWeakRef, int] = {}
        self._live = 0
        self._peak = 0
        self.marks: dict[str, int] = {}

    def __enter__(self) -> ActivationMeter:
        self._tracked.clear()
        self._live = self._peak = 0
        self.marks = {}
        return super().__enter__()

    @property
    def live(self) -> int:
        """Bytes of the tracked storages alive now."""
        self._forget_freed()
        return self._live

    @property
    def peak(self) -> int:
        """The largest ``live`` seen after an op or a mark."""
        return self._peak

    def mark(self, name: str) -> int:
        """Record the live bytes now as ``marks[name]`` and return them (e.g. ``"after_forward"``)."""
        self.marks[name] = self.live
        self._peak = max(self._peak, self._live)
        return self._live

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._forget_freed()
        if _in_forward():
            self._track(func, args, kwargs or {}, out)
        self._peak = max(self._peak, self._live)
        return out

    def _track(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        returns = func._schema.returns
        if not returns:
            return
        results = [out] if len(returns) == 1 else list(out)
        inputs = {storage_ref(t) for t in _memory_of(pytree.tree_leaves((args, kwargs)))}
        for ret, value in zip(returns, results):
            if ret.alias_info is not None:
                continue
            for t in _memory_of(pytree.tree_leaves(value)):
                storage = storage_ref(t)
                if storage not in inputs and storage not in self._tracked:
                    size = t.untyped_storage().nbytes()
                    self._tracked[storage] = size
                    self._live += size

    def _forget_freed(self) -> None:
        freed = [s for s in self._tracked if s.expired()]
        for s in freed:
            self._live -= self._tracked.pop(s)


def _in_forward() -> bool:
    """Whether ops now run a forward pass (see :class:`ActivationMeter`)."""
    if torch.is_grad_enabled():
        return True
    # autograd.Function.apply turns off both modes; no_grad and the backward engine only the first
    return not torch._C._is_fwd_grad_enabled() and not torch.is_inference_mode_enabled()


def _memory_of(values: Sequence[object]) -> Iterator[torch.Tensor]:
    """The plain strided tensors whose storages hold ``values``' tensors.

    A wrapper subclass (DTensor) holds its memory in inner tensors (the local shard); its own
    storage is a placeholder of the global size. Sparse and nested tensors, which have no single
    storage, are left out.
    """
    for t in values:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from _memory_of([getattr(t, name) for name in names])
        elif t.layout == torch.strided:
            yield t
