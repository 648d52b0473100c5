"""A projection whose output is cut into parts of unequal sizes, captured as one projection per part.

A grouped-query model's fused q, k and v projection (Phi-3 with fewer kv heads, InternLM2,
ChatGLM) computes ``qkv = linear(x, W, b)`` and slices its last dim into q (``Hq * d``
features), k and v (``Hkv * d`` each). Split by heads, each rank must hold its block of every
part; parts of one size are a strided shard (:mod:`autopar.ir.strided`, GPT-2's ``c_attn``),
but parts of different sizes are no placement DTensor has, so the dim stayed whole.
:func:`split_fused_projections` captures such a projection as one ``linear`` per part, on the
slice of the weight (and bias) that part reads: every output element is the same dot product
(a matrix library may add its terms in another order: fp32 rounding), and the weight's gradient
is the parts' gradients laid side by side. Each
part's projection then splits by its own heads like any linear (column-parallel), k and v by
theirs, so q heads and the kv heads they share meet on one rank.

Only a projection whose every use is a plain slice of its last dim (step 1), the slices tiling
it without overlap, is rewritten; equal parts are left to the strided shard. A
``parameter_plan`` giving the weight ``Parts(axis, sizes)`` of those sizes pins each part's
weight slice split over ``axis`` (a ``layout_constraint``), Megatron's split of a GQA projection.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import Shard

from autopar.capture.constraint_op import constraint_spec
from autopar.capture.strategies import Parts
from autopar.ir.errors import AnnotationError
from autopar.ir.layout import REPLICATE, Layout
from autopar.ir.mesh import MeshSpec

aten = torch.ops.aten


def _last_dim_slice(node: torch.fx.Node, source: torch.fx.Node) -> tuple[int, int] | None:
    """``(start, end)`` where ``node`` is ``source[..., start:end]`` (a step-1 slice of its last dim)."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor or node.args[0] is not source:
        return None
    size = source.meta["val"].shape
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1 :])[:4]
    if step != 1 or dim % len(size) != len(size) - 1 or node.kwargs:
        return None
    start, end = start or 0, size[-1] if end is None else end
    if not all(isinstance(v, int) for v in (start, end)):
        return None
    return max(0, min(start, size[-1])), max(0, min(end, size[-1]))


def _parts(node: torch.fx.Node) -> list[tuple[torch.fx.Node, int, int]] | None:
    """The slices a projection's output is cut into, each with its range, where they tile its last
    dim in parts not all of one size; None otherwise."""
    cuts = [(user, _last_dim_slice(user, node)) for user in node.users]
    if len(cuts) < 2 or any(span is None for _, span in cuts):
        return None
    spans = sorted(span for _, span in cuts)
    tiled = spans[0][0] == 0 and spans[-1][1] == node.meta["val"].shape[-1]
    tiled = tiled and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    if not tiled or len({end - start for start, end in spans}) == 1:
        return None
    return [(user, start, end) for user, (start, end) in cuts]


def _sliced(graph: torch.fx.Graph, value: torch.fx.Node, start: int, end: int, meta: dict) -> torch.fx.Node:
    """``value[start:end]`` along dim 0, with ``meta`` and its fake value."""
    piece = graph.call_function(aten.slice.Tensor, (value, 0, start, end))
    piece.meta = {**meta, "val": aten.slice.Tensor(value.meta["val"], 0, start, end)}
    return piece


def _parameter_of(value: torch.fx.Node) -> torch.fx.Node:
    """The placeholder ``value`` is, or is a cast of (a projection's weight under mixed precision)."""
    while value.op == "call_function" and value.args and isinstance(value.args[0], torch.fx.Node):
        source = value.args[0]
        if tuple(source.meta["val"].shape) != tuple(value.meta["val"].shape):
            break
        value = source
    return value


def _constrained(graph: torch.fx.Graph, piece: torch.fx.Node, layout: Layout, origin: str) -> torch.fx.Node:
    """``piece`` through a ``layout_constraint`` pinning ``layout`` (what ``autopar.constrain`` records)."""
    spec = constraint_spec(layout, origin)
    op = torch.ops.autopar.layout_constraint.default
    pinned = graph.call_function(op, (piece, spec))
    pinned.meta = {**piece.meta, "val": op(piece.meta["val"], spec)}
    return pinned


def _part_layout(mesh: MeshSpec, item: Parts) -> Layout:
    """A part's weight slice split by its rows (its output features) over ``item.axis``."""
    return tuple(Shard(0) if name == item.axis else REPLICATE for name in mesh.axis_names)


def split_fused_projections(
    gm: torch.fx.GraphModule, mesh: MeshSpec, annotated: Mapping[str, tuple[str, int, Parts]]
) -> list[torch.fx.Node]:
    """Rewrite each projection cut into unequal parts as one projection per part (see the module
    docstring), in place, recompiling ``gm``; returns the projections rewritten. ``annotated`` maps
    a weight's placeholder to its fqn and the dim and :class:`Parts` of unequal sizes its
    ``parameter_plan`` gives: each part's weight slice is then pinned split over that axis.

    Raises ``AnnotationError`` for such a weight that no projection so cut reads."""
    graph = gm.graph
    rewritten, laid_out = [], set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default or node.kwargs:
            continue
        parts = _parts(node)
        if parts is None:
            continue
        x, weight = node.args[:2]
        bias = node.args[2] if len(node.args) > 2 else None
        source = _parameter_of(weight).name
        pinned = annotated.get(source)
        sizes = tuple(end - start for _, start, end in sorted(parts, key=lambda part: part[1]))
        if pinned is not None and (pinned[1], pinned[2].sizes) == (0, sizes):
            laid_out.add(source)
        else:
            pinned = None
        meta = {k: v for k, v in node.meta.items() if k != "val"}
        for user, start, end in parts:
            with graph.inserting_before(user):
                w = _sliced(graph, weight, start, end, meta)
                if pinned is not None:
                    origin = f"parameter_plan of {pinned[0]!r}: {pinned[2]!r}, rows {start}-{end}"
                    w = _constrained(graph, w, _part_layout(mesh, pinned[2]), origin)
                b = _sliced(graph, bias, start, end, meta) if isinstance(bias, torch.fx.Node) else bias
                part = graph.call_function(aten.linear.default, (x, w, b))
            values = (x.meta["val"], w.meta["val"], None if b is None else b.meta["val"])
            part.meta = {**meta, "val": aten.linear.default(*values)}
            user.replace_all_uses_with(part)
            graph.erase_node(user)
        graph.erase_node(node)
        rewritten.append(node)
    for name in set(annotated) - laid_out:
        fqn, d, item = annotated[name]
        raise AnnotationError(
            f"parameter_plan of {fqn!r}: {item!r} on dim {d}, but no projection (linear) reads it with "
            f"its output cut by slices of its last dim into parts of sizes {item.parts} (with dim 0 of "
            "the weight made of those parts); give equal parts, or leave it to the planner"
        )
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten
