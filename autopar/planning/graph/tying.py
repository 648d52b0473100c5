"""Repeated blocks share strategies: the ops of ``layers.1``, ``layers.2``, ... are tied to ``layers.0``'s.

A block is what :func:`~autopar.capture.export.block_of` says (the one definition of a
repeated block, also used for free layout points at capture, pipeline units and memory
candidates). Two blocks of one list (same path but for the index) are tied when their
ops match one to one, in graph order: same op, same arguments (values from inside the
block by position, from outside by shape and annotated layout, layout constraints by
layout) and same output shapes. Each block after the first of its kind then shares the
solver variables of that first block, which keeps the plan's blocks alike and the ILP small.

The match is by position, not by graph isomorphism: export records every block's ops in
the same order, so one signature per block, compared in a dictionary, finds all twins in
linear time, and it pairs each op with the op at the same place in the twin, which an
isomorphism would not do for blocks with symmetric ops (the ``q`` and ``k`` projections
of attention look alike).
"""

from __future__ import annotations

import weakref

import torch

from autopar.capture.constraint_op import parse_constraint_spec
from autopar.capture.export import Captured, block_of
from autopar.ir.meta import output_values
from autopar.rules import shape_of


def _token(captured: Captured, index: dict[torch.fx.Node, int], a: object) -> object:
    """One argument of an op as its block's signature sees it (see the module docstring)."""
    if isinstance(a, torch.fx.Node):
        if a in index:
            return ("in", index[a])
        fqn = captured.params.get(a.name) or captured.buffers.get(a.name)
        layout = captured.annotations.parameter_layouts.get(fqn) if fqn else None
        computed = fqn in captured.annotations.compute_layouts
        return (
            "ext",
            shape_of(a) if isinstance(a.meta.get("val"), torch.Tensor) else None,
            str(layout),
            computed,
        )
    if isinstance(a, str) and a.startswith("{"):
        return parse_constraint_spec(a)[0]
    return a


def _signature(captured: Captured, block: str, nodes: list[torch.fx.Node]) -> tuple:
    """What must match for two blocks to be tied: their list and, op by op, target, arguments and shapes."""
    index = {n: i for i, n in enumerate(nodes)}

    def token(a: object) -> object:
        return _token(captured, index, a)

    ops = tuple(
        (
            str(n.target),
            torch.utils._pytree.tree_map(token, (n.args, n.kwargs)),
            str([tuple(v.shape) for v in output_values(n)]),
        )
        for n in nodes
    )
    return block.rpartition(".")[0], ops  # the list the block belongs to ("" for a root Sequential)


Ties = tuple[dict[torch.fx.Node, torch.fx.Node], int]
# per graph, with its node count: the automatic mesh plans one capture on many meshes, and the
# signatures are a large share of building its strategy graph; lowering, which adds nodes, starts afresh
_FOUND: weakref.WeakKeyDictionary[torch.fx.Graph, tuple[int, Ties]] = weakref.WeakKeyDictionary()


def tie_blocks(captured: Captured) -> Ties:
    """Each op of a tied block -> its twin in the first block of its kind; and how many blocks are
    tied. The caller must not change what it is given."""
    graph = captured.graph
    kept = _FOUND.get(graph)
    if kept is None or kept[0] != len(graph.nodes):
        kept = _FOUND[graph] = (len(graph.nodes), _tie_blocks(captured))
    return kept[1]


def _tie_blocks(captured: Captured) -> Ties:
    blocks: dict[str, list[torch.fx.Node]] = {}
    for node in captured.graph.nodes:
        if node.op == "call_function" and (block := block_of(node)) is not None:
            blocks.setdefault(block, []).append(node)
    canon: dict[torch.fx.Node, torch.fx.Node] = {}
    first: dict[tuple, list[torch.fx.Node]] = {}
    tied = 0
    for block, nodes in blocks.items():
        signature = _signature(captured, block, nodes)
        if signature in first:
            canon.update(zip(nodes, first[signature]))
            tied += 1
        else:
            first[signature] = nodes
    return canon, tied
