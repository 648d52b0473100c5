"""Which ops are recomputed in backward, and in which region: one definition for the plan and the program.

Two kinds of region (:data:`Region`: ``(name, policy)``):

* a recompute module (``autopar.recompute`` or a memory-search candidate): every op it runs,
  in its innermost such module, under that module's policy (:func:`module_regions`);
* under ZeRO-3, an op outside every module region that reads a split parameter gathered
  (in another layout than it is stored in): a selective region of its own, ``zero3:<op>``,
  so the gather runs again in backward and the gathered weight is never kept
  (:func:`zero3_regions`).

The planner prices the regions of :func:`recompute_regions` on the captured graph;
``assembly/lowering_record.py`` records them in the plan as the lowered graph has them (where a
gather is a chain of autopar collectives between the parameter and the op), and the
``mark_recompute`` pass applies that record, so the plan predicts what runs.

What backward communicates again (:func:`communicates_again`): a region gathers its parameters
again under every policy; a ``full-comm`` region runs every collective feeding its ops again, up
to its last op saving a tensor (:func:`rerun_ops`).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable, Iterator, Mapping

import torch

from autopar.ir.meta import NodeLayouts, module_stack
from autopar.ir.ops import LAYOUT_CONSTRAINT, is_collective, written_operand
from autopar.ir.options import FULL_COMM, SELECTIVE
from autopar.planning.memory.saved_tensors import SavedSpec, saved_by
from autopar.rules import OpCall

Region = tuple[str, str]  # (name, policy): a recompute module's path, or zero3:<op>


def _region_of(node: torch.fx.Node, recompute: Mapping[str, str]) -> Region | None:
    """``(module path, policy)`` of the innermost recompute module ``node`` runs in, if any."""
    path = next((p for p in reversed(module_stack(node)) if p in recompute), None)
    return None if path is None else (path, recompute[path])


def _is_op(node: torch.fx.Node) -> bool:
    """A computing op: a call other than ``getitem`` (which picks an output of its op) and a
    collective (which joins the region of the op it feeds)."""
    return node.op == "call_function" and node.target is not operator.getitem and not is_collective(node)


def updates_state(node: torch.fx.Node) -> bool:
    """An in-place op writing into a placeholder: a buffer's running statistics, updated by batch
    norm in training. It stays outside every region: a checkpoint keeps its inputs and refuses
    one changed in place since, and replaying the update in backward would apply it twice."""
    written = written_operand(node) if node.op == "call_function" else None
    return written is not None and written.op == "placeholder"


def module_regions(graph: torch.fx.Graph, recompute: Mapping[str, str]) -> dict[torch.fx.Node, Region]:
    """Each op inside a recompute module (``recompute``: module path -> policy), in graph order.

    An op updating a buffer in place (:func:`updates_state`) is in none. A layout constraint
    joins the region all its users are in, whatever module it was written in: the compiler
    drops it, and the collectives it leaves join their consumers' region (the
    ``mark_recompute`` pass), so a block's output constraint read by the next, unrecomputed
    module is outside its block's region.
    """
    found = {}
    for node in graph.nodes:
        if _is_op(node) and str(node.target) != LAYOUT_CONSTRAINT and not updates_state(node):
            if (region := _region_of(node, recompute)) is not None:
                found[node] = region
    for node in reversed(graph.nodes):  # users first: a chain of constraints takes its consumer's
        if str(node.target) == LAYOUT_CONSTRAINT:
            marks = {found.get(u) for u in node.users}
            if len(marks) == 1 and None not in marks:
                found[node] = marks.pop()
    return {node: found[node] for node in graph.nodes if node in found}


def _gathered_readers(
    param: torch.fx.Node, layouts: Mapping[torch.fx.Node, NodeLayouts]
) -> Iterator[torch.fx.Node]:
    """The ops reading ``param`` in another layout than it is stored in: directly (a plan being
    made) or through a chain of collectives, each feeding the next only (a lowered graph)."""
    stored = layouts[param].output
    for user in param.users:
        value, reader = param, user
        while is_collective(reader) and len(reader.users) == 1:
            value, reader = reader, next(iter(reader.users))
        if not _is_op(reader) or reader not in layouts:
            continue
        needs = layouts[reader].operands
        slots = [i for i, operand in enumerate(OpCall.of(reader).operands) if operand is value]
        if any(needs[i] is not None and needs[i] != stored for i in slots):
            yield reader


def zero3_regions(
    params: Iterable[torch.fx.Node],
    layouts: Mapping[torch.fx.Node, NodeLayouts],
    taken: Mapping[torch.fx.Node, Region],
) -> dict[torch.fx.Node, Region]:
    """A selective region ``zero3:<op>`` for each op outside ``taken`` reading one of the ZeRO-3
    split parameter placeholders ``params`` gathered (see the module docstring)."""
    found: dict[torch.fx.Node, Region] = {}
    for param in params:
        for reader in _gathered_readers(param, layouts):
            if reader not in taken:
                found.setdefault(reader, (f"zero3:{reader.name}", SELECTIVE))
    return found


def recompute_regions(
    graph: torch.fx.Graph,
    recompute: Mapping[str, str],
    layouts: Mapping[torch.fx.Node, NodeLayouts],
    zero3_params: Iterable[torch.fx.Node],
) -> dict[torch.fx.Node, Region]:
    """Each recomputed op: the module regions, then the ZeRO-3 gathers' (``zero3_params``: the
    parameters ZeRO-3 stores split; none below ZeRO-3)."""
    regions = module_regions(graph, recompute)
    regions.update(zero3_regions(zero3_params, layouts, regions))
    return regions


def rerun_ops(
    graph: torch.fx.Graph, regions: Mapping[torch.fx.Node, Region], flows: Mapping[torch.fx.Node, bool]
) -> set[torch.fx.Node]:
    """The ops of ``full-comm`` regions that backward runs again, collectives feeding them included:
    each up to its region's last op saving a tensor for backward (``flows``: which values take a
    gradient). Torch's non-reentrant checkpoint stops recomputing once every tensor its region
    saved is made again, so an op after that one (a block's closing all-reduce and residual add)
    runs once: what it feeds the next region is that region's kept input."""
    ops: dict[str, list[torch.fx.Node]] = {}
    last: dict[str, int] = {}  # region -> how many of its ops run again
    for node in graph.nodes:
        region = regions.get(node)
        if region is None or region[1] != FULL_COMM:
            continue
        ops.setdefault(region[0], []).append(node)
        if saved_by(node, [bool(flows.get(a)) for a in OpCall.of(node).operands]) != SavedSpec():
            last[region[0]] = len(ops[region[0]])
    return {node for name, nodes in ops.items() for node in nodes[: last.get(name, 0)]}


def communicates_again(
    dst: torch.fx.Node,
    from_state: bool,
    regions: Mapping[torch.fx.Node, Region],
    rerun: Collection[torch.fx.Node],
) -> bool:
    """Whether backward runs the collectives of an edge into op ``dst`` again: in a ``full-comm``
    region, where ``dst`` runs again (``rerun``: :func:`rerun_ops`); in another region, where the
    edge gathers a parameter or buffer (``from_state``), which is never kept."""
    region = regions.get(dst)
    if region is None:
        return False
    return dst in rerun if region[1] == FULL_COMM else from_state
