"""Per-axis collectives of the per-rank program, as autograd-aware custom ops.

The compiled program runs on *local* tensors. Wherever a value changes layout, the
codegen inserts one op from this module per mesh axis that changes (see
``docs/collectives.md`` for the table and the order). Each op is a
``torch.library.custom_op`` in namespace ``autopar`` with a fake (shape-only) impl and
an autograd formula, so the backward communication follows from the forward. Where
more than one backward is possible, the planner picks it with the op's ``grad``
argument, because only the planner knows the layout the gradient arrives in.

Ops name their mesh axis by string; :func:`register_mesh` maps axis names to process
groups for this process. Shapes divide evenly over the axis unless the op is given the
rows of an unevenly split dim (``size``: DTensor's pieces, padded for the transfer, see
:mod:`autopar.runtime.pieces`), and ``dim`` is a non-negative tensor dimension.

Every collective adds the size in bytes of its input buffer on this rank to a counter
keyed by ``(kind, axis)``, the quantity :class:`autopar.planning.cost.model.Collective` predicts:
:func:`comm_counts` reads bytes, :func:`collective_calls` the number of calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.ir.layout import piece_size
from autopar.runtime import pieces


class AxisInfo(NamedTuple):
    """What the ops need to know about one mesh axis on this rank."""

    group: dist.ProcessGroup
    size: int
    coordinate: int


_AXES: dict[str, AxisInfo] = {}
_BYTES: Counter[tuple[str, str]] = Counter()
_CALLS: Counter[tuple[str, str]] = Counter()


# --------------------------------------------------------------------------- registry and counters


def register_mesh(mesh: DeviceMesh) -> dict[str, str]:
    """Make the axes of ``mesh`` (which must have ``mesh_dim_names``) known to the ops.

    Returns the key the ops name each axis by: the axis name itself (``"dp"``), unless
    another mesh already registered that name with another process group (several
    compiled modules in one process, on different meshes), then ``"dp.1"``, ``"dp.2"``...
    Registering the same mesh again returns the same keys.
    """
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "the DeviceMesh has no axis names: create it with "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    axes = {}
    for i, name in enumerate(names):
        group, coordinate = mesh.get_group(name), mesh.get_local_rank(name)
        # The collectives order chunks by group rank, the local ops by coordinate.
        if dist.get_rank(group) != coordinate:
            raise RuntimeError(
                f"mesh axis {name!r}: this rank is rank {dist.get_rank(group)} of the axis's process "
                f"group but has coordinate {coordinate} on the axis"
            )
        axes[name] = AxisInfo(group, mesh.size(i), coordinate)
    keys = {}
    for name, info in axes.items():
        key, n = name, 0
        while key in _AXES and _AXES[key].group is not info.group:
            n += 1
            key = f"{name}.{n}"
        _AXES[key] = info
        keys[name] = key
    return keys


def forget_meshes() -> None:
    """Drop every registered axis (their process groups are gone after ``destroy_process_group``)."""
    _AXES.clear()


def axis_info(axis: str) -> AxisInfo:
    """``(group, size, coordinate)`` of the registered axis ``axis``."""
    try:
        return _AXES[axis]
    except KeyError:
        raise ValueError(
            f"mesh axis {axis!r} is not registered; registered axes are {sorted(_AXES)} "
            "(call autopar.runtime.collectives.register_mesh(mesh) first)"
        ) from None


def count_collective(kind: str, axis: str, nbytes: int) -> None:
    """Record one collective of ``kind`` over ``axis`` whose input buffer has ``nbytes`` on this rank."""
    _BYTES[kind, axis] += nbytes
    _CALLS[kind, axis] += 1


def comm_counts() -> dict[tuple[str, str], int]:
    """Bytes sent into collectives so far, per ``(kind, axis)``; a copy."""
    return dict(_BYTES)


def collective_calls() -> dict[tuple[str, str], int]:
    """Number of collectives so far, per ``(kind, axis)``; a copy."""
    return dict(_CALLS)


def reset_comm_counts() -> None:
    """Zero both the byte and the call counters."""
    _BYTES.clear()
    _CALLS.clear()


# --------------------------------------------------------------------------- helpers


def _check_dim(op: str, x: torch.Tensor, dim: int, axis: str, split: bool) -> None:
    """``dim`` must be a dimension of ``x``; if ``split``, one that divides evenly over ``axis``."""
    if not 0 <= dim < x.ndim:
        raise ValueError(f"autopar::{op}: dim {dim} is not a dimension of a {x.ndim}-d tensor")
    n = axis_info(axis).size
    # A symbolic size would add a guard to a traced graph; those are checked when run.
    if split and isinstance(x.shape[dim], int) and x.shape[dim] % n:
        raise ValueError(
            f"autopar::{op}: dim {dim} of shape {tuple(x.shape)} cannot be split into {n} equal "
            f"parts over mesh axis {axis!r}"
        )


def _check_choice(op: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"autopar::{op}: {name} must be one of {choices}, got {value!r}")


def _chunk(x: torch.Tensor, dim: int, axis: str, parts: int = 1, size: int = 0) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (a view; see :func:`pieces.piece`)."""
    _, n, c = axis_info(axis)
    return pieces.piece(x, dim, n, c, parts, size)


# --------------------------------------------------------------------------- all_gather


@torch.library.custom_op("autopar::all_gather", mutates_args=())
def all_gather(
    x: torch.Tensor, dim: int, axis: str, grad: str, parts: int = 1, size: int = 0
) -> torch.Tensor:
    """Shard(dim) -> Replicate over ``axis``: the shards concatenated along ``dim`` in coordinate order
    (with ``parts``, from a strided shard: each rank's piece of every part put back in its part;
    with ``size``, from uneven pieces making ``size`` rows).

    Backward, per ``grad``: ``"reduce_scatter"`` when the gradient arrives as partial sums,
    ``"slice"`` when it is already the same on every rank (no communication).
    """
    _check_dim("all_gather", x, dim, axis, split=False)
    _check_choice("all_gather", "grad", grad, ("reduce_scatter", "slice"))
    group, n, _ = axis_info(axis)
    count_collective("all_gather", axis, pieces.nbytes(x))
    x = pieces.padded(x, dim, piece_size(size, n)) if size else x
    x = x.contiguous()
    out = x.new_empty((n, *x.shape))
    dist.all_gather_single(pieces.flat_stack(out), x, group=group)
    whole = pieces.concat_stacked(out, dim)
    return whole.narrow(dim, 0, size).contiguous() if size else pieces.part_major(whole, dim, parts, n)


@all_gather.register_fake
def _(x: torch.Tensor, dim: int, axis: str, grad: str, parts: int = 1, size: int = 0) -> torch.Tensor:
    _check_dim("all_gather", x, dim, axis, split=False)
    _check_choice("all_gather", "grad", grad, ("reduce_scatter", "slice"))
    n = axis_info(axis).size
    return x.new_empty(pieces.with_rows(x, dim, size) if size else pieces.resized(x, dim, times=n))


def _all_gather_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    if ctx.grad == "reduce_scatter":
        return reduce_scatter(g, ctx.dim, ctx.axis, ctx.parts, ctx.size), None, None, None, None, None
    # aten's narrow, not autopar::shard: its own backward (zero padding) is the exact adjoint.
    # Copied out: a view would keep the whole gradient alive as long as the piece, and a parameter
    # stored split (ZeRO-3) would hold it as its .grad.
    piece = _chunk(g, ctx.dim, ctx.axis, ctx.parts, ctx.size).clone(memory_format=torch.contiguous_format)
    return piece, None, None, None, None, None


# --------------------------------------------------------------------------- reduce_scatter


@torch.library.custom_op("autopar::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, dim: int, axis: str, parts: int = 1, size: int = 0) -> torch.Tensor:
    """Partial -> Shard(dim) over ``axis``: the sum over the axis, chunk ``coordinate`` along ``dim``
    (with ``parts``, a strided shard: this rank's piece of every part; with ``size``, the rows of
    ``dim``, this rank's uneven piece).

    Backward: ``all_gather(g, dim, axis, "reduce_scatter", parts, size)``.
    """
    _check_dim("reduce_scatter", x, dim, axis, split=not size)
    group, n, c = axis_info(axis)
    count_collective("reduce_scatter", axis, pieces.nbytes(x))
    if size:
        x = pieces.padded(x, dim, n * piece_size(size, n))
    chunks = pieces.stacked_chunks(pieces.rank_major(x, dim, parts, n), dim, n)
    # Chunk r of a C-contiguous (n, ...) stack is C-contiguous, so the result needs no reordering.
    out = x.new_empty(chunks.shape[1:])
    dist.reduce_scatter_single(out, pieces.flat_stack(chunks), group=group)
    return out.narrow(dim, 0, piece_size(size, n, c)).contiguous() if size else out


@reduce_scatter.register_fake
def _(x: torch.Tensor, dim: int, axis: str, parts: int = 1, size: int = 0) -> torch.Tensor:
    _check_dim("reduce_scatter", x, dim, axis, split=not size)
    _, n, c = axis_info(axis)
    return x.new_empty(
        pieces.with_rows(x, dim, piece_size(size, n, c)) if size else pieces.resized(x, dim, over=n)
    )


def _reduce_scatter_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return all_gather(g, ctx.dim, ctx.axis, "reduce_scatter", ctx.parts, ctx.size), None, None, None, None


# --------------------------------------------------------------------------- all_reduce


@torch.library.custom_op("autopar::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, axis: str, grad: str) -> torch.Tensor:
    """Partial -> Replicate over ``axis``: the sum over the axis.

    Backward, per ``grad``: ``"identity"`` (Megatron's "g": the gradient is already the
    same on every rank) or ``"all_reduce"`` (it arrives as partial sums).
    """
    _check_choice("all_reduce", "grad", grad, ("identity", "all_reduce"))
    group = axis_info(axis).group
    count_collective("all_reduce", axis, pieces.nbytes(x))
    # dist.all_reduce works in place; the copy keeps the input intact, as a custom op must.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, axis: str, grad: str) -> torch.Tensor:
    _check_choice("all_reduce", "grad", grad, ("identity", "all_reduce"))
    axis_info(axis)  # fails on an unknown axis, as the real op does
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    if ctx.grad == "identity":
        return g, None, None
    return all_reduce(g, ctx.axis, "all_reduce"), None, None


@torch.library.custom_op("autopar::all_reduce_max", mutates_args=())
def all_reduce_max(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Partial("max") -> Replicate over ``axis``: the maximum over the axis.

    No backward: the planner makes a partial maximum only of a value that needs no gradient
    (a max taken from a detached tensor, as a stable softmax's shift is), so a gradient
    reaching this op is an error autograd reports, never a silently wrong number.
    """
    group = axis_info(axis).group
    count_collective("all_reduce", axis, pieces.nbytes(x))
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


@all_reduce_max.register_fake
def _(x: torch.Tensor, axis: str) -> torch.Tensor:
    axis_info(axis)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------- all_to_all


@torch.library.custom_op("autopar::all_to_all", mutates_args=())
def all_to_all(
    x: torch.Tensor, src_dim: int, dst_dim: int, axis: str, src_size: int = 0, dst_size: int = 0
) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim) over ``axis``: full ``src_dim``, chunk ``coordinate`` of ``dst_dim``
    (``src_size``/``dst_size``: the rows of a dim split unevenly, 0 where it splits evenly).

    Backward: ``all_to_all(g, dst_dim, src_dim, axis, dst_size, src_size)``.
    """
    _check_all_to_all(x, src_dim, dst_dim, axis, dst_size)
    group, n, c = axis_info(axis)
    count_collective("all_to_all", axis, pieces.nbytes(x))
    if src_size:
        x = pieces.padded(x, src_dim, piece_size(src_size, n))
    if dst_size:
        x = pieces.padded(x, dst_dim, n * piece_size(dst_size, n))
    # Slice j of the stack is chunk j of dst_dim, sent to coordinate j; slice j received
    # is coordinate j's shard of src_dim.
    send = pieces.stacked_chunks(x, dst_dim, n)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    out = pieces.concat_stacked(received, src_dim)
    if src_size:
        out = out.narrow(src_dim, 0, src_size)
    if dst_size:
        out = out.narrow(dst_dim, 0, piece_size(dst_size, n, c))
    return out.contiguous()


def _check_all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, axis: str, dst_size: int) -> None:
    _check_dim("all_to_all", x, src_dim, axis, split=False)
    _check_dim("all_to_all", x, dst_dim, axis, split=not dst_size)
    if src_dim == dst_dim:
        raise ValueError(f"autopar::all_to_all: src_dim and dst_dim are both {src_dim}")


@all_to_all.register_fake
def _(
    x: torch.Tensor, src_dim: int, dst_dim: int, axis: str, src_size: int = 0, dst_size: int = 0
) -> torch.Tensor:
    _check_all_to_all(x, src_dim, dst_dim, axis, dst_size)
    _, n, c = axis_info(axis)
    shape = list(x.shape)
    shape[src_dim] = src_size or shape[src_dim] * n
    shape[dst_dim] = piece_size(dst_size, n, c) if dst_size else shape[dst_dim] // n
    return x.new_empty(shape)


def _all_to_all_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    back = all_to_all(g, ctx.dst_dim, ctx.src_dim, ctx.axis, ctx.dst_size, ctx.src_size)
    return back, None, None, None, None, None


# --------------------------------------------------------------------------- local ops


@torch.library.custom_op("autopar::shard", mutates_args=())
def shard(x: torch.Tensor, dim: int, axis: str, parts: int = 1, size: int = 0) -> torch.Tensor:
    """Replicate -> Shard(dim) over ``axis``, locally: chunk ``coordinate`` along ``dim``, contiguous
    (with ``parts``, a strided shard: piece ``coordinate`` of every part; with ``size``, the rows
    of ``dim``, its uneven piece).

    Backward: ``all_gather(g, dim, axis, "reduce_scatter", parts, size)``.
    """
    _check_dim("shard", x, dim, axis, split=not size)
    return _chunk(x, dim, axis, parts, size).clone(memory_format=torch.contiguous_format)


@shard.register_fake
def _(x: torch.Tensor, dim: int, axis: str, parts: int = 1, size: int = 0) -> torch.Tensor:
    _check_dim("shard", x, dim, axis, split=not size)
    _, n, c = axis_info(axis)
    return x.new_empty(
        pieces.with_rows(x, dim, piece_size(size, n, c)) if size else pieces.resized(x, dim, over=n)
    )


def _shard_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # Rank c used only chunk c of the replicated input, so its gradient (Shard(dim)) covers
    # chunk c alone, while the input's gradient must be Replicate: the chunks concatenated,
    # an all_gather. That all_gather's own backward only matters when differentiating
    # twice, which the planner does not plan; reduce_scatter is its exact adjoint, right
    # without knowing how those cotangents are spread over the ranks.
    return all_gather(g, ctx.dim, ctx.axis, "reduce_scatter", ctx.parts, ctx.size), None, None, None, None


@torch.library.custom_op("autopar::grad_all_reduce", mutates_args=())
def grad_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity forward (a copy), all_reduce over ``axis`` backward: Megatron's "f"."""
    axis_info(axis)  # fails on an unknown axis now rather than in the backward
    return x.clone()


@grad_all_reduce.register_fake
def _(x: torch.Tensor, axis: str) -> torch.Tensor:
    axis_info(axis)  # fails on an unknown axis, as the real op does
    return torch.empty_like(x)


def _grad_all_reduce_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # As in shard's backward, the backward collective carries its exact adjoint.
    return all_reduce(g, ctx.axis, "all_reduce"), None


@torch.library.custom_op("autopar::to_partial", mutates_args=())
def to_partial(x: torch.Tensor, axis: str, dim: int, size: int = 0) -> torch.Tensor:
    """To Partial over ``axis``, locally; the sum over the axis is the value before.

    ``dim == -1``: from Replicate, coordinate 0 keeps ``x`` and the others hold zeros.
    ``dim >= 0``: from Shard(dim), zeros ``size`` times larger along ``dim`` with ``x`` at
    chunk ``coordinate`` (``size`` given: the rows of the dim split unevenly, ``x`` at this
    rank's piece). Backward: identity for ``dim == -1``, this rank's piece of the gradient
    along ``dim`` otherwise (local in both cases).
    """
    _, n, c = axis_info(axis)
    if dim == -1:
        return x.clone() if c == 0 else torch.zeros_like(x)
    _check_dim("to_partial", x, dim, axis, split=False)
    out = x.new_zeros(pieces.with_rows(x, dim, size) if size else pieces.resized(x, dim, times=n))
    _chunk(out, dim, axis, 1, size).copy_(x)
    return out


@to_partial.register_fake
def _(x: torch.Tensor, axis: str, dim: int, size: int = 0) -> torch.Tensor:
    n = axis_info(axis).size
    if dim == -1:
        return torch.empty_like(x)
    _check_dim("to_partial", x, dim, axis, split=False)
    return x.new_empty(pieces.with_rows(x, dim, size) if size else pieces.resized(x, dim, times=n))


def _to_partial_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    if ctx.dim == -1:
        return g, None, None, None
    return _chunk(g, ctx.dim, ctx.axis, 1, ctx.size), None, None, None


# --------------------------------------------------------------------------- autograd wiring


def _save_args(*names: str) -> Callable[[Any, tuple[Any, ...], torch.Tensor], None]:
    """A ``setup_context`` that stores the op's non-tensor arguments on ``ctx`` under ``names``."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        for name, value in zip(names, inputs[1:]):
            setattr(ctx, name, value)

    return setup_context


all_gather.register_autograd(
    _all_gather_backward, setup_context=_save_args("dim", "axis", "grad", "parts", "size")
)
reduce_scatter.register_autograd(
    _reduce_scatter_backward, setup_context=_save_args("dim", "axis", "parts", "size")
)
all_reduce.register_autograd(_all_reduce_backward, setup_context=_save_args("axis", "grad"))
all_to_all.register_autograd(
    _all_to_all_backward, setup_context=_save_args("src_dim", "dst_dim", "axis", "src_size", "dst_size")
)
shard.register_autograd(_shard_backward, setup_context=_save_args("dim", "axis", "parts", "size"))
grad_all_reduce.register_autograd(_grad_all_reduce_backward, setup_context=_save_args("axis"))
to_partial.register_autograd(_to_partial_backward, setup_context=_save_args("axis", "dim", "size"))
