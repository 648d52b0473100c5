"""The per-rank memory model of a plan: state and activations (options: ``ir.options``).

Per rank, for one training step (bytes; ``n`` is the size of the mesh axis ZeRO
splits a parameter over, ``s`` the optimizer's fp32 values per element)::

    parameters   sum_p  bytes(p) / (n if ZeRO-3)
    gradients    sum_p  bytes(p) / (n if ZeRO-3, or ZeRO-2 summing once per backward pass)
                                                 (p with a gradient; a step of several passes
                                                 holds ZeRO-2's whole until its one sum)
    optimizer    sum_p  4 s numel(p) / (n if ZeRO >= 1)            (on the host under offload)
    host         sum_p  4 (s + 2) numel(p) / n   under optimizer offload (master copy, its
                                                 gradient and the states), else 0
    activations  kept:  every value some op saves for backward, once per (value, layout),
                        outside recompute regions; a region keeps only its inputs and the
                        outputs its policy saves; and what the program returns (the caller
                        holds it through backward)
                 peak:  the forward's, or a region's recomputation in backward: kept up to it,
                        plus what it recomputes, less its kept outputs no op saves

``bytes(p)`` is the parameter's local size in its planned layout. A parameter is split by ZeRO
only along a mesh axis its gradient is summed over (a data-parallel axis for it), along a
dimension no other axis splits and that the axis divides, and only when its local size is at
least ``zero_threshold`` (:func:`~autopar.planning.memory.held_state.zero_split`). What autograd saves
per op comes from :mod:`autopar.planning.memory.saved_tensors` (the op run once on fake tensors: on the
rank's pieces of its operands where it can run so, :func:`_rank_spec`); under a pipeline a stage
keeps its activations for as many microbatches as its schedule has in flight. The activation
model reads a graph's layouts as data (:class:`~autopar.planning.graph.laid_out.LaidOutGraph`), never
from ``node.meta``.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from autopar.ir.layout import Layout, local_fraction, local_shape
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import NodeLayouts, storage_ref
from autopar.ir.ops import LAYOUT_CONSTRAINT, is_selective_save
from autopar.ir.options import FULL_COMM, SELECTIVE
from autopar.planning.graph.laid_out import LaidOutGraph
from autopar.planning.graph.storages import (
    allocates_beside,
    source_of,
    storage_of,
    tensor_value,
    viewed_operand,
)
from autopar.planning.memory.recompute import Region
from autopar.planning.memory.recompute_peak import KeptOnDevice, RegionLog, recompute_peak
from autopar.planning.memory.saved_tensors import SavedSpec, saved_by, saved_locally
from autopar.rules import OpCall

# per edge (consumer, operand slot), the layouts of the copies its collectives make on the way
EdgeCopies = Mapping[tuple[str, int], tuple[Layout, ...]]


@dataclass(frozen=True)
class MemoryChoice:
    """One candidate of the memory search: a ZeRO stage and the modules recomputed (path -> policy)."""

    zero: int
    recompute: Mapping[str, str]

    @property
    def key(self) -> tuple[int, frozenset]:
        """The choice as a hashable key (its recompute mapping is not hashable)."""
        return self.zero, frozenset(self.recompute.items())


# --- activations ---------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationMemory:
    """Per-rank activation bytes of one forward and backward (one microbatch)."""

    kept: float  # held from the end of the forward into the backward
    peak: float  # the most alive at once: the forward's peak, or a region being recomputed in backward
    by_node: Mapping[str, float]  # kept bytes by the op that first keeps them
    by_autograd: float  # of ``kept``, what autograd saves outside regions (what offload moves to the host)


@dataclass(frozen=True)
class Saved:
    """One tensor an op keeps for backward, per rank.

    ``key`` identifies the memory: ``(storage, layout)`` of a value (a value and its views
    share a storage, so saving both counts once), or ``(op name, "extra")`` for an op's
    own other tensors (statistics, masks), scaled like its first output. ``source`` is
    the op or placeholder whose value it is (None for extra tensors); ``redistributed``
    says the op keeps an operand in another layout than its producer's (a collective's output).
    """

    key: tuple
    nbytes: float
    source: torch.fx.Node | None
    redistributed: bool = False


def local_bytes(node: torch.fx.Node, layout: Layout, mesh: MeshSpec, index: int = 0) -> float:
    """Bytes on one rank of output ``index`` of ``node`` in ``layout``."""
    val = node.meta["val"]
    val = val[index] if isinstance(val, (tuple, list)) else val
    return val.numel() * val.element_size() * local_fraction(layout, mesh)


def _out_layout(layouts: NodeLayouts, index: int) -> Layout:
    outs = layouts.outputs
    return outs[index] if index < len(outs) else outs[0]


def held_value(
    laid: LaidOutGraph, value: torch.fx.Node, layout: Layout, edge: tuple[str, int] | None = None
) -> Saved:
    """``value`` kept in ``layout``: the whole storage it lives in (see :func:`source_of`), on one rank.

    In another layout than its own it is a collective's output, one per ``edge`` (consumer,
    operand slot): the program redistributes for each consumer separately, a tensor of the
    value's own size (a slice of a fused projection is copied alone). A value passed
    on by layout constraints (identities in the program) is what entered the first of
    them: the copy a redistribution made for it, if one did.
    """
    redistributed = layout != laid.layouts[value].output
    while not redistributed and str(value.target) == LAYOUT_CONSTRAINT:
        value, edge = value.args[0], (value.name, 0)
        redistributed = layout != laid.layouts[value].output
    if not redistributed and (gathered := _redistributed_under(laid, value)) is not None:
        return held_value(laid, *gathered)
    source, index = source_of(value)
    storage, nbytes = storage_of(source, index)
    if redistributed:  # a collective's output: a new tensor of the value's own size
        v = tensor_value(value, 0)
        nbytes = v.numel() * v.element_size()
    fraction = local_fraction(layout, laid.mesh)
    key = (storage, layout, edge) if redistributed else (storage, fraction)
    return Saved(key, nbytes * fraction, source, redistributed)


def _redistributed_under(
    laid: LaidOutGraph, value: torch.fx.Node
) -> tuple[torch.fx.Node, Layout, tuple[str, int]] | None:
    """Where ``value`` is a view (through views and a split's pieces) of an operand the program
    redistributed for the viewing op, that operand, its layout there and the edge: the view's
    memory is that collective's output (a loss's view of logits gathered for it), not its source's."""
    node = value
    while True:
        if node.target is operator.getitem:
            node = node.args[0]
        base = viewed_operand(node)
        if base is None or node not in laid.layouts or base not in laid.layouts:
            return None
        operands = OpCall.of(node).operands
        if base not in operands:
            return None
        slot = operands.index(base)
        need = laid.layouts[node].operands[slot]
        if need is not None and need != laid.layouts[base].output:
            return base, need, (node.name, slot)
        node = base


def copy_values(
    laid: LaidOutGraph, value: torch.fx.Node, layouts: Iterable[Layout], edge: tuple[str, int]
) -> list[Saved]:
    """The copies of ``value`` an edge's collectives make on the way, one per layout in ``layouts``
    (each collective's output is a new tensor of the value's size, laid out so)."""
    v = tensor_value(value, 0)
    nbytes = v.numel() * v.element_size()
    source = source_of(value)[0]
    return [
        Saved((storage_ref(v), layout, edge, k), nbytes * local_fraction(layout, laid.mesh), source, True)
        for k, layout in enumerate(layouts)
    ]


def saved_values(laid: LaidOutGraph, node: torch.fx.Node, copies: EdgeCopies | None = None) -> list[Saved]:
    """What ``node`` keeps for backward, per rank (see :class:`Saved`).

    A placeholder's value kept in its own layout (a parameter, a buffer, the batch; or a
    view of one) is not allocated by the step and is left out; one redistributed is a
    copy and counts, and so is one read through a ``grad_all_reduce`` (``copies`` of the edge,
    see :func:`activation_memory`), which copies it in forward. What is saved is the op's on
    the rank's operands (:func:`_rank_spec`).
    """
    if node.op != "call_function" or node.target is operator.getitem or node not in laid.layouts:
        return []
    call = OpCall.of(node)
    spec, local = _rank_spec(laid, node)
    mine = laid.layouts[node]
    out = []
    for i in spec.inputs:
        operand, layout = call.operands[i], mine.operands[i]
        if layout is None or operand not in laid.layouts:
            continue
        made = (copies or {}).get((node.name, i), ())
        if made and layout == laid.layouts[operand].output:  # the op reads the last copy
            out.append(copy_values(laid, operand, made, (node.name, i))[-1])
            continue
        item = held_value(laid, operand, layout, (node.name, i))
        if not (item.source.op == "placeholder" and not item.redistributed):
            out.append(item)
    for j in spec.outputs:
        storage, nbytes = storage_of(node, j)
        fraction = local_fraction(_out_layout(mine, j), laid.mesh)
        out.append(Saved((storage, fraction), nbytes * fraction, node))
    if spec.extra_bytes:
        out.append(_made_inside(laid, node, "extra", spec.extra_bytes, local))
    return out


def _grads(laid: LaidOutGraph, node: torch.fx.Node) -> list[bool]:
    """Which operands of ``node`` take a gradient."""
    return [bool(laid.flows.get(op, False)) for op in OpCall.of(node).operands]


def _rank_spec(laid: LaidOutGraph, node: torch.fx.Node) -> tuple[SavedSpec, bool]:
    """What ``node`` saves on one rank, and whether that was measured there: the op run on its
    operands as the rank holds them (:func:`saved_locally`: local shapes, a redistributed one
    contiguous as a collective returns it), or, where it cannot run so, at its global shapes
    (:func:`saved_by`, its other tensors then scaled like its largest operand)."""
    call, mine = OpCall.of(node), laid.layouts[node]
    grads = _grads(laid, node)
    spec = saved_by(node, grads)
    if spec == SavedSpec():
        return spec, False
    shapes, fresh = [], []
    for src, shape, need in zip(call.operands, call.shapes, mine.operands):
        shapes.append(shape if need is None else local_shape(shape, need, laid.mesh))
        fresh.append(need is not None and src in laid.layouts and need != laid.layouts[src].output)
    local = saved_locally(node, grads, shapes, fresh)
    return (spec, False) if local is None else (local, True)


def inner_products(laid: LaidOutGraph, node: torch.fx.Node) -> Saved | None:
    """What a selective recompute region keeps of the products ``node`` runs inside besides its
    outputs (:attr:`~autopar.planning.memory.saved_tensors.SavedSpec.inner_product_bytes`), if any."""
    if node.op != "call_function" or node.target is operator.getitem or node not in laid.layouts:
        return None
    spec, local = _rank_spec(laid, node)
    if not spec.inner_product_bytes:
        return None
    return _made_inside(laid, node, "products", spec.inner_product_bytes, local)


def _made_inside(laid: LaidOutGraph, node: torch.fx.Node, what: str, nbytes: int, local: bool) -> Saved:
    """Tensors ``node`` makes besides its outputs, ``nbytes`` in all: on one rank where ``local``,
    else at global shapes, scaled like its largest operand."""
    if local:
        return Saved((node.name, what), nbytes, None)
    mine = laid.layouts[node]
    i = largest_operand(OpCall.of(node))
    layout = mine.operands[i] if i is not None else _out_layout(mine, 0)
    return Saved((node.name, what), nbytes * local_fraction(layout, laid.mesh), None)


def largest_operand(call: OpCall) -> int | None:
    """The operand an op's other saved tensors scale like: its largest (statistics, masks)."""
    return max(range(len(call.operands)), key=lambda i: math.prod(call.shapes[i]), default=None)


def _forward_peak(
    laid: LaidOutGraph, kept: Mapping[tuple, float], owner: Mapping[tuple, int], copies: EdgeCopies
) -> float:
    """The most bytes alive during the forward: every value an op allocates lives from its op
    to its last use (to the end when kept), a collective's output for its one consumer, and
    what is kept otherwise (an op's statistics) from the op that keeps it. Before an op runs, its
    operands are redistributed one after the other, each through its chain of collectives
    (``copies``: a ``grad_all_reduce``'s copy, then a slice of it): each step holds its input and
    its output, beside the operands already redistributed (see :func:`_chain_peak`). An in-place
    op made out-of-place holds its output beside its operand (:func:`allocates_beside`)."""
    layouts = laid.layouts
    nodes = list(laid.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    delta = [0.0] * (end + 2)
    # the most alive at each op above what was alive before it, while its operands' chains run or
    # beside an in-place op's operand; never negative, so the peak is the most alive plus it
    spikes = [0.0] * (end + 2)
    covered: set[tuple] = set()

    def alive(first: int, last: int, nbytes: float) -> None:
        delta[first] += nbytes
        delta[last + 1] -= nbytes

    for at, node in enumerate(nodes):
        if node.op != "call_function" or node not in layouts or node.target is operator.getitem:
            continue
        call = OpCall.of(node)
        ready = 0.0  # this op's operands redistributed so far
        for slot, (src, need) in enumerate(zip(call.operands, layouts[node].operands)):
            edge = (node.name, slot)
            moved = need is not None and src in layouts and need != layouts[src].output
            chain = copy_values(laid, src, copies.get(edge, ()), edge) if need is not None else []
            chain += [held_value(laid, src, need, edge)] if moved else []
            for k, item in enumerate(chain):
                if item.key in kept or k == len(chain) - 1:  # the op reads the last
                    covered.add(item.key)
                    alive(at, end if item.key in kept else at, item.nbytes)
            spikes[at] = max(spikes[at], _chain_peak(chain, kept, ready))
            ready += chain[-1].nbytes if chain else 0.0
        if allocates_beside(node):  # its output, beside the operand it reads as one buffer
            spikes[at] = max(spikes[at], ready + local_bytes(node, _out_layout(layouts[node], 0), laid.mesh))
        for j, key, nbytes in _outputs(laid, node):
            covered.add(key)
            alive(at, end if key in kept else _last_use(laid, node, j, position), nbytes)
    for key, nbytes in kept.items():
        if key not in covered:
            alive(owner[key], end, nbytes)
    levels = itertools.accumulate(delta, initial=0.0)  # alive before each position
    return max(level + spike for level, spike in zip(levels, spikes))


def _chain_peak(chain: list[Saved], kept: Mapping[tuple, float], ready: float) -> float:
    """The most alive while a chain of collectives runs, above what was alive before its op: at
    each step its input and output, the chain's kept outputs before them, and ``ready`` (operands
    redistributed before it)."""
    peak = 0.0
    for k in range(len(chain) - 1):
        held = sum(c.nbytes for c in chain[:k] if c.key in kept)
        peak = max(peak, ready + held + chain[k].nbytes + chain[k + 1].nbytes)
    return peak


def _last_use(
    laid: LaidOutGraph, node: torch.fx.Node, index: int | None, position: Mapping[torch.fx.Node, int]
) -> int:
    """The position of the last op reading output ``index`` of ``node`` (None: every output, as
    the pieces of a split are views of one storage), through what shares its memory (views, and
    layout constraints that do not redistribute)."""
    users = [u for u in node.users if u.target is not operator.getitem or index in (None, u.args[1])]
    through = [u for u in users if u.target is operator.getitem or viewed_operand(u) is node]
    through += [u for u in users if _passes_on(laid, u)]
    uses = [_last_use(laid, u, None, position) for u in through]
    return max(uses + [position[u] for u in users if u not in through], default=position[node])


def _passes_on(laid: LaidOutGraph, node: torch.fx.Node) -> bool:
    """A layout constraint whose operand already has its layout: the compiler drops it, and its
    value is its operand's (one that redistributes is the collective's new tensor)."""
    if str(node.target) != LAYOUT_CONSTRAINT or node not in laid.layouts or node.args[0] not in laid.layouts:
        return False
    return laid.layouts[node].output == laid.layouts[node.args[0]].output


def _outputs(laid: LaidOutGraph, node: torch.fx.Node) -> Iterator[tuple[int, tuple, float]]:
    """``(index, key, bytes on a rank)`` of each output ``node`` allocates (a view allocates none,
    nor does a ``getitem`` (its op did) or a layout constraint that redistributes nothing)."""
    if node.target is operator.getitem or viewed_operand(node) is not None or _passes_on(laid, node):
        return
    for j in range(len(laid.layouts[node].outputs)):
        storage, nbytes = storage_of(node, j)
        fraction = local_fraction(_out_layout(laid.layouts[node], j), laid.mesh)
        yield j, (storage, fraction), nbytes * fraction


def returned_values(laid: LaidOutGraph) -> list[Saved]:
    """The tensors the program returns, which the caller holds through backward (logits beside
    a loss), each in its producer's layout; a graph input returned as it is allocates nothing."""
    output = next(n for n in reversed(laid.graph.nodes) if n.op == "output")
    values = [v for v in output.all_input_nodes if v in laid.layouts]
    items = (held_value(laid, v, laid.layouts[v].output) for v in values)
    return [item for item in items if item.source.op != "placeholder"]


def _selective_saves(laid: LaidOutGraph, node: torch.fx.Node) -> list[Saved]:
    """What a selective region keeps of ``node`` beyond its collectives' outputs: its output where
    it is a matrix product or attention, and the products it runs inside (:func:`inner_products`)."""
    saves = []
    if is_selective_save(node.target):
        saves.append(held_value(laid, node, _out_layout(laid.layouts[node], 0)))
    if (products := inner_products(laid, node)) is not None:
        saves.append(products)
    return saves


def _collectives_again(log: RegionLog, at: int, outputs: Iterable[Saved]) -> None:
    """Log the ``outputs`` of the collectives into the op at position ``at`` of a ``full-comm``
    region as values its recomputation makes again: each from just before that op (the collective
    runs between it and the op before) to that op, unless the op saves it (then it is saved)."""
    for item in outputs:
        log.made.setdefault(item.key, (item.nbytes, at - 1, at))


def activation_memory(
    laid: LaidOutGraph,
    regions: Mapping[torch.fx.Node, Region],
    offload: bool = False,
    copies: EdgeCopies | None = None,
) -> ActivationMemory:
    """Activation bytes of a laid-out graph (see the module docstring).

    With ``offload`` what autograd saves outside regions goes to the host as it is saved:
    on the device it lives only until its last use, and ``peak`` is the device's.

    ``regions`` maps ops to ``(region, policy)``. A region keeps every value entering it
    from outside (its checkpoint holds them), the output of every collective it runs (a
    redistributed operand: communication is never repeated, except a gather of a
    parameter or another placeholder, which runs again; ``copies`` lists, per edge
    ``(consumer, operand slot)``, the layouts of the outputs of its collectives besides the
    one the consumer reads in a layout other than its producer's: a chain's intermediate
    values, and the copy a gradient-only ``grad_all_reduce`` makes) and, under the selective
    policy, the outputs of its matrix products and attention; everything else its ops save
    is recomputed in backward; a ``full-comm`` region keeps only what enters it, its recomputation
    making its collectives' outputs again (:func:`_collectives_again`). Liveness: backward frees
    what the ops after a region kept before it recomputes that region, but for what the program
    returns (the caller holds it); the recomputation (torch's non-reentrant checkpoint) runs the
    region's ops up to the last one saving a tensor, each adding what it saves (and what it makes
    for the next ops, until they have used it), and hands each kept output over as it goes, so
    one that no op saves for backward is freed then. The peak is the larger of the forward's
    and, over regions, the most alive during its recomputation.
    """
    layouts = laid.layouts
    kept: dict[tuple, float] = {}
    owner: dict[tuple, int] = {}  # key -> position of the first op keeping it
    logs: dict[str, RegionLog] = {}
    by_regions: set[tuple] = set()
    held: set[tuple] = set()  # what a saving op or a region's checkpoint holds into backward

    def keep(at: int, item: Saved, by_region: bool) -> None:
        kept[item.key] = item.nbytes
        owner.setdefault(item.key, at)
        if by_region:
            by_regions.add(item.key)

    position = {n: i for i, n in enumerate(laid.graph.nodes)}
    returned = returned_values(laid)  # held by the caller, on the device, from their op on
    for item in returned:
        keep(position[item.source], item, False)
    held.update(item.key for item in returned)
    for at, node in enumerate(laid.graph.nodes):
        region = regions.get(node) if node in layouts else None
        # inside a region an edge's copies are what its checkpoint caches (below)
        saved = saved_values(laid, node, copies if region is None else None)
        held.update(item.key for item in saved)
        if region is None:
            for item in saved:
                keep(at, item, False)
            continue
        name, policy = region
        log = logs.setdefault(name, RegionLog())
        log.last = at
        if saved:
            log.last_saver = at
            log.last_saver_made = saved_by(node, _grads(laid, node)).output_before_last_pack
        for item in saved:
            log.saved.setdefault(item.key, (item.nbytes, at))
        for j, key, nbytes in _outputs(laid, node):
            log.made.setdefault(key, (nbytes, at, _last_use(laid, node, j, position)))
        cached = []
        for slot, (src, need) in enumerate(zip(OpCall.of(node).operands, layouts[node].operands)):
            if need is None or src not in layouts or source_of(src)[0].op == "placeholder":
                continue
            # a getitem is in no region: its op's decides where the value was made
            made_by = src.args[0] if src.target is operator.getitem else src
            if regions.get(made_by, (None,))[0] != name:
                entering = held_value(laid, src, layouts[src].output)
                keep(at, entering, True)
                held.add(entering.key)
            if need != layouts[src].output:
                cached.append(held_value(laid, src, need, (node.name, slot)))
            cached += copy_values(laid, src, (copies or {}).get((node.name, slot), ()), (node.name, slot))
        cached += _selective_saves(laid, node) if policy == SELECTIVE else []
        if policy == FULL_COMM:
            _collectives_again(log, at, cached)
            continue
        for item in cached:
            keep(at, item, True)
            log.cached.setdefault(item.key, at)
    total = sum(kept.values())
    on_device = by_regions | {item.key for item in returned}
    device = {k: v for k, v in kept.items() if k in on_device or not offload}
    names = [n.name for n in laid.graph.nodes]
    dead = {k for k in device if k not in held}
    caller = {item.key for item in returned}
    alive = KeptOnDevice(device, owner, caller)
    recomputing = [recompute_peak(log, alive, dead) for log in logs.values()]
    peak = max([_forward_peak(laid, device, owner, copies or {}), *recomputing])
    by_node: dict[str, float] = {}
    for key, at in owner.items():
        by_node[names[at]] = by_node.get(names[at], 0.0) + kept[key]
    by_autograd = sum(v for k, v in kept.items() if k not in on_device)
    return ActivationMemory(kept=total, peak=peak, by_node=by_node, by_autograd=by_autograd)
