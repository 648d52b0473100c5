"""What each mesh axis does in a plan, in words: ``dp: splits the batch``.

Mesh axis names are labels: the solver may split the batch over ``tp`` and heads over ``dp``.
:func:`axis_roles` reads, for each axis, the dims the plan's heavy ops (matrix products,
attention, embeddings, convolutions: the summarised kinds) split over it, names each dim by
what it is in that op (the batch, the sequence, attention heads, the hidden or vocabulary
dimension, channels), weights the names by the ops' compute time and keeps those above a
twentieth of the axis's split compute. An op left holding partial sums over an axis (a
row-parallel product) counts as splitting its reduction dimension.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial

from autopar.ir.layout import parse_layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.plan import NodeDecision
from autopar.ir.strided import is_split

_NAMED_DIMS = {
    "scaled_dot_product_attention": ("batch", "heads", "sequence", "head dim"),
    "convolution": ("batch", "channels", "height", "width", "depth"),
}
# the share of an axis's split compute a name needs to be listed
_LISTED = 0.05


def axis_roles(graph: torch.fx.Graph, decisions: Sequence[NodeDecision], mesh: MeshSpec) -> dict[str, str]:
    """For every axis of ``mesh``, what the plan splits over it, in words (see the module docstring)."""
    nodes = {n.name: n for n in graph.nodes}
    vocabularies = _vocabularies(graph)
    shares: list[Counter] = [Counter() for _ in mesh.axis_names]
    for d in decisions:
        node = nodes.get(d.name)
        if not d.kind.summarised or node is None or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        layout = parse_layout(d.outputs[0])
        for axis, p in enumerate(layout):
            if mesh.axis_sizes[axis] == 1:
                continue
            if is_split(p):
                shares[axis][_dim_name(node, p.dim, vocabularies)] += d.compute_s
            elif isinstance(p, Partial):
                shares[axis]["a reduction (partial sums)"] += d.compute_s
    roles = {}
    for axis, name in enumerate(mesh.axis_names):
        total = sum(shares[axis].values())
        named = [k for k, s in shares[axis].most_common() if total and s >= _LISTED * total]
        roles[name] = "splits " + ", ".join(named) if named else "splits nothing"
    return roles


def _vocabularies(graph: torch.fx.Graph) -> set[int]:
    """Row counts of the tables embeddings look up in: a dim of that size is a vocabulary."""
    found = set()
    for node in graph.nodes:
        if node.op == "call_function" and "embedding" in str(node.target):
            table = node.args[0]
            if isinstance(table, torch.fx.Node) and isinstance(table.meta.get("val"), torch.Tensor):
                found.add(int(table.meta["val"].shape[0]))
    return found


def _dim_name(node: torch.fx.Node, dim: int, vocabularies: set[int]) -> str:
    val = node.meta["val"]
    rank, size = val.dim(), int(val.shape[dim])
    for op, names in _NAMED_DIMS.items():
        if op in str(node.target) and dim < len(names):
            return names[dim]
    if dim == rank - 1 and rank >= 2:
        return "the vocabulary" if size in vocabularies else "hidden"
    if dim == 0:
        return "batch"
    return "sequence" if dim == 1 and rank == 3 else f"dim {dim}"
