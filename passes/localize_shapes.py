"""Make shapes per rank: size arguments become local sizes, split means are rescaled.

* An op's ``size``/``shape`` argument (view, reshape, expand, new_ones, ...) describes
  the global output; it becomes the local output shape under the node's layout, this
  rank's piece where a dim splits unevenly (``ctx.coordinates``).
* An argument counting items of a split dimension (a grouped convolution's ``groups``,
  the rule's ``counts``) becomes this rank's share.
* A mean over a dimension split across ranks (``mean``, a mean-reduced loss; the
  rule's ``mean_over`` labels) is computed locally over 1/c of the items, so its
  result is multiplied by 1/c to become a correct partial sum.

Reads: ``autopar.layouts``, ``val``, ``autopar.stage``, ``nn_module_stack``. Writes: node
arguments; ``mul`` nodes after rescaled means (with ``autopar.layouts`` and the mean's
``autopar.stage`` and ``nn_module_stack``);
``autopar.mean_split`` on the means.
"""

from __future__ import annotations

import torch

from autopar.ir.layout import local_shape
from autopar.ir.meta import MEAN_SPLIT, GraphLayouts, NodeLayouts, place_beside, write_layouts
from autopar.passes.context import PassContext
from autopar.rules import DimSpec, OpCall, spec_of, split_counts

_SIZE_ARGS = ("size", "shape")


def _localize_size(node: torch.fx.Node, layouts: NodeLayouts, ctx: PassContext) -> None:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    out = node.meta["val"]
    local = list(local_shape(tuple(out.shape), layouts.output, ctx.mesh, ctx.coordinates))
    args = list(node.args)
    for i, a in enumerate(schema.arguments[: len(args)]):
        if a.name in _SIZE_ARGS and isinstance(args[i], (list, tuple)):
            args[i] = local
    node.args = tuple(args)
    for name in _SIZE_ARGS:
        if isinstance(node.kwargs.get(name), (list, tuple)):
            node.kwargs = {**node.kwargs, name: local}


def _localize_counts(node: torch.fx.Node, spec: DimSpec, split: dict[str, int]) -> None:
    """Arguments counting items of a split label (``groups``) become this rank's share."""
    arguments = node.target._schema.arguments if spec.counts else []
    for name, label in spec.counts:
        if split.get(label, 1) == 1:
            continue
        given = OpCall.of(node).arg(name)
        share = (
            [int(v) // split[label] for v in given]
            if isinstance(given, list | tuple)
            else int(given) // split[label]
        )
        index = next(i for i, a in enumerate(arguments) if a.name == name)
        if name in node.kwargs or arguments[index].kwarg_only:
            node.kwargs = {**node.kwargs, name: share}
        else:
            args = [*node.args, *(a.default_value for a in arguments[len(node.args) : index + 1])]
            args[index] = share
            node.args = tuple(args)


def _mean_split(spec: DimSpec, split: dict[str, int]) -> int:
    """How many ways a mean's items are split across ranks (1 if not a split mean)."""
    count = 1
    for label in spec.mean_over:
        count *= split.get(label, 1)
    return count


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    layouts = GraphLayouts(graph)  # the nodes before this pass: the ones it localizes
    for node in layouts:
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        _localize_size(node, layouts[node], ctx)
        spec = spec_of(OpCall.of(node))
        if spec is None:
            continue
        counts = split_counts(spec, layouts[node].operands, ctx.mesh.axis_sizes)
        _localize_counts(node, spec, counts)
        split = _mean_split(spec, counts)
        if split > 1:
            with graph.inserting_after(node):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.0 / split))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user, scaled=scaled: user is not scaled)
            scaled.meta["val"] = node.meta["val"]
            out = layouts[node].output
            write_layouts(scaled, NodeLayouts(operands=(out,), outputs=(out,)))
            place_beside(scaled, node)  # the mean's stage and module (its recompute region)
            node.meta[MEAN_SPLIT] = split
    return gm
