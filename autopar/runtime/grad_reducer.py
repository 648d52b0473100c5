"""Gradient delivery and bucketed gradient sums, overlapping communication with backward.

The per-rank program computes with plain local leaves that share storage with the
DTensor parameters of :class:`~autopar.runtime.module.DistributedModule`;
:class:`GradReducer` takes each leaf's gradient when backward completes it, sums it over
the mesh axes the plan asks for (data parallelism, ZeRO-2's reduce-scatter) and adds it
to the parameter's ``grad``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from autopar.ir.buckets import BUCKET_BYTES, pack
from autopar.runtime import collectives
from autopar.runtime.materialize import as_dtensor
from autopar.runtime.optimizer import ZeroShard


class GradReducer:
    """Delivers gradients to the DTensor parameters, summing them over mesh axes where needed.

    The program computes with plain local leaves (see
    :class:`~autopar.runtime.module.DistributedModule`); when a leaf's gradient is
    complete, its post-accumulate hook takes it. A gradient that needs
    no sum goes straight to ``p.grad`` (as a DTensor). The others are copied into a
    persistent flat buffer per bucket (packed by :func:`autopar.ir.buckets.pack`: the first
    about 1 MiB, the others about ``bucket_bytes``; one set of mesh axes per bucket,
    parameters in reverse order, roughly the order backward produces them);
    a full bucket is all-reduced asynchronously, overlapping the rest of backward, and
    the last bucket of a backward pass waits for all of them and hands out views of the
    sums. Every backward pass's contribution is summed and added to ``p.grad``, so
    gradients accumulate over several backward passes as on one device; inside
    :meth:`~autopar.runtime.module.DistributedModule.no_sync` the leaves keep accumulating and the next pass
    outside it sums everything once. :meth:`expect` does the same for the microbatches
    of a step (a pipeline's, or those a plan accumulates without one): each leaf is summed after
    its last microbatch's backward, so a step launches each bucket once, however many microbatches
    it runs.

    Under ZeRO-2 (``scattered``: the :class:`~autopar.runtime.optimizer.ZeroShard` of each
    parameter split, by ``id``) a split parameter's bucket is laid out rank by rank (piece
    ``r`` of every parameter in region ``r``), summed over its other axes, then
    reduce-scattered over the split axis; each rank keeps only its region, as the shards'
    gradients, and the full bucket lives only until then.

    With ``reduce_dtype`` (mixed precision's, below the parameters' own) the buckets hold
    that dtype: each gradient is cast into its bucket, summed there, and the sum is cast back
    to the parameter's dtype as it is handed out.
    """

    def __init__(
        self,
        params: list[tuple[torch.nn.Parameter, torch.Tensor, tuple[str, ...]]],
        bucket_bytes: int = BUCKET_BYTES,
        scattered: Mapping[int, ZeroShard] | None = None,
        reduce_dtype: torch.dtype | None = None,
    ):
        self.enabled = True
        self.reduce_dtype = reduce_dtype
        self.waiting: dict[int, int] = {}  # id(p) -> backward passes to accumulate locally first
        self.buckets: list[list[torch.nn.Parameter]] = []
        self.axes: list[tuple[str, ...]] = []
        self.scattered = dict(scattered or {})
        self.split: list[ZeroShard | None] = []  # per bucket: a shard of its split axis (ZeRO-2)
        self.leaf_of = {id(p): leaf for p, leaf, _ in params}
        summed = [(p, axes) for p, _leaf, axes in params if axes]
        for bucket in pack(summed, self._group_of, lambda item: self._leaf_bytes(item[0]), bucket_bytes):
            p = bucket[0][0]
            self.buckets.append([q for q, _ in bucket])
            self.axes.append(bucket[0][1])
            self.split.append(self.scattered.get(id(p)))
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        # a scattered bucket's offsets are within one rank's region
        self.offsets = []
        for i, b in enumerate(self.buckets):
            offsets, at = {}, 0
            for p in b:
                offsets[id(p)] = at
                at += self.leaf_of[id(p)].numel() // (self.split[i].n if self.split[i] else 1)
            self.offsets.append(offsets)
        self.sizes = [sum(self.leaf_of[id(p)].numel() for p in b) for b in self.buckets]
        self.flat: list[torch.Tensor | None] = [
            None if self.split[i] else self._new_flat(i) for i in range(len(self.buckets))
        ]
        self.pending = [len(b) for b in self.buckets]
        self.launched: list[tuple[int, list]] = []
        self.launches = 0  # buckets launched so far: each once per step, however many microbatches
        self.regions: dict[int, torch.Tensor] = {}  # scattered bucket -> this rank's summed region
        # p.grad for a summed parameter is a view of its bucket, wrapped once
        self.wrapped = {
            id(p): as_dtensor(self._view(i, p).view_as(self.leaf_of[id(p)]), p.device_mesh, p.placements, p)
            for i, b in enumerate(self.buckets)
            if not self.split[i] and self._dtype(i) == self.leaf_of[id(b[0])].dtype
            for p in b
        }
        for p, leaf, _ in params:
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(lambda leaf, p=p: self._ready(p, leaf))

    def _group_of(self, item: tuple[torch.nn.Parameter, tuple[str, ...]]) -> tuple:
        """What a bucket's parameters share: the axes summed over and ZeRO-2's split axis."""
        zero = self.scattered.get(id(item[0]))
        return item[1], zero.axis if zero else None

    def _leaf_bytes(self, p: torch.nn.Parameter) -> int:
        leaf = self.leaf_of[id(p)]
        return leaf.numel() * leaf.element_size()

    def _dtype(self, i: int) -> torch.dtype:
        """Bucket ``i``'s dtype: the reduce dtype, else its parameters' own."""
        own = self.leaf_of[id(self.buckets[i][0])].dtype
        return self.reduce_dtype if self.reduce_dtype is not None and own.is_floating_point else own

    def _new_flat(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s flat buffer, on its parameters' device (a GPU's, for NCCL to sum)."""
        first = self.leaf_of[id(self.buckets[i][0])]
        return torch.empty(self.sizes[i], dtype=self._dtype(i), device=first.device)

    def expect(self, passes: int) -> None:
        """Sum each gradient after ``passes`` backward passes reach it (a step's microbatches): the
        first ``passes - 1`` leave it accumulating in its leaf, the last launches its bucket."""
        self.waiting = dict.fromkeys(self.leaf_of, passes - 1)

    def _ready(self, p: torch.nn.Parameter, leaf: torch.Tensor) -> None:
        if not self.enabled:
            return
        if self.waiting.get(id(p), 0) > 0:
            self.waiting[id(p)] -= 1
            return
        grad, leaf.grad = leaf.grad, None
        i = self.bucket_of.get(id(p))
        if i is None:
            _deliver(p, grad)
            return
        if self.split[i] is not None:
            self._scatter_in(i, p, grad)
            return
        view = self._view(i, p)
        if p.grad is not None and p.grad.to_local().data_ptr() == view.data_ptr():
            # the user kept last pass's gradient (no zero_grad): it must outlive this bucket's reuse
            kept = view.view_as(leaf).clone()
            p.grad = as_dtensor(kept, p.device_mesh, p.placements, p)
        view.copy_(grad.reshape(-1))
        self._arrived(i)

    def _scatter_in(self, i: int, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Copy a ZeRO-2 gradient into its bucket, piece ``r`` into rank ``r``'s region."""
        zero = self.scattered[id(p)]
        if self.flat[i] is None:  # the full bucket exists only during this backward pass
            self.flat[i] = self._new_flat(i)
        regions = self.flat[i].view(zero.n, -1)
        at, size = self.offsets[i][id(p)], grad.numel() // zero.n
        pieces = grad.unflatten(zero.dim, (zero.n, -1)).movedim(zero.dim, 0)
        regions[:, at : at + size].copy_(pieces.flatten(1))
        self._arrived(i)

    def _arrived(self, i: int) -> None:
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self._launch(i)
        if len(self.launched) == len(self.buckets):
            self._finish()

    def _view(self, i: int, p: torch.nn.Parameter) -> torch.Tensor:
        at = self.offsets[i][id(p)]
        return self.flat[i][at : at + self.leaf_of[id(p)].numel()]

    def _launch(self, i: int) -> None:
        works: list = []
        flat, zero = self.flat[i], self.split[i]
        nbytes = flat.numel() * flat.element_size()
        for axis in sorted(self.axes[i], key=lambda a: zero is not None and a == zero.key):
            for w in works:  # summing over a second axis needs the first sum
                w.wait()
            group, _, _ = collectives.axis_info(axis)
            if zero is not None and axis == zero.key:
                collectives.count_collective("reduce_scatter", axis, nbytes)
                self.regions[i] = flat.new_empty(flat.numel() // zero.n)
                works = [dist.reduce_scatter_single(self.regions[i], flat, group=group, async_op=True)]
            else:
                collectives.count_collective("all_reduce", axis, nbytes)
                works = [dist.all_reduce(flat, group=group, async_op=True)]
        self.launched.append((i, works))
        self.launches += 1

    def _finish(self) -> None:
        for i, works in self.launched:
            for w in works:
                w.wait()
            zero = self.split[i]
            if zero is not None:
                region, self.flat[i] = self.regions.pop(i), None
                for p in self.buckets[i]:
                    piece, leaf = self.scattered[id(p)], self.leaf_of[id(p)]
                    at, shape = self.offsets[i][id(p)], piece.piece(leaf).shape
                    piece.set_grad(region[at : at + shape.numel()].view(shape).to(leaf.dtype))
                continue
            for p in self.buckets[i]:
                summed = self._view(i, p).view_as(self.leaf_of[id(p)])
                if id(p) not in self.wrapped:  # summed in the reduce dtype: handed out in the parameter's
                    _deliver(p, summed.to(self.leaf_of[id(p)].dtype))
                elif p.grad is None:
                    p.grad = self.wrapped[id(p)]
                else:
                    p.grad.to_local().add_(summed)
        self.launched = []
        self.pending = [len(b) for b in self.buckets]


def _deliver(p: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Add a local gradient to the DTensor parameter's ``grad``."""
    if p.grad is None:
        p.grad = as_dtensor(grad, p.device_mesh, p.placements, p)
    else:
        p.grad.to_local().add_(grad)
