"""The memory search's terms of the ILP: per root and strategy, the seconds and bytes a memory choice adds.

Seconds: ZeRO-1 all-gathers the updated shard after the step, ZeRO-3 gathers in forward and
again in backward and reduce-scatters as the gradient arises (ZeRO-2's reduce-scatter and
all-gather cost what the all-reduce does, but for the gather's latency, paid per shard);
recomputed ops run their forward again, with the checkpoint's work for each
(:meth:`~autopar.planning.cost.device_model.DeviceModel.recompute_s`), and gather again the parameters
they read in another layout (a ``full-comm`` region runs all its collectives again). Bytes: each
parameter's state (:func:`~autopar.planning.memory.held_state.state_bytes`, split by ZeRO over an
axis its first consumer sums its gradient over: per pair of strategies, as are ZeRO's seconds), and each op's
saved values in the layouts of its strategy, each value counted at its first saver; inside a
recompute region only what the region keeps, plus the first region's own values (the one being
recomputed). Under a pipeline the bytes are weighted by the share of the rank holding most
(:func:`stage_shares`). A plan's figure is exact (:mod:`autopar.planning.memory.model`); this is the
linear estimate the ILP constrains.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.tensor import Replicate

from autopar.ir.layout import Layout, local_fraction
from autopar.ir.mesh import MeshSpec
from autopar.ir.ops import is_selective_save
from autopar.ir.options import FULL_COMM, SELECTIVE, Memory, Pipeline
from autopar.ir.plan import ChoiceKind, CollectiveKind
from autopar.planning.cost.device_model import RecomputeWork
from autopar.planning.cost.model import Collective
from autopar.planning.graph.edge_costs import edge_layouts, edge_table, edge_value, fold_edge, table_key
from autopar.planning.graph.gradient_sums import sums_over
from autopar.planning.graph.storages import computes_nothing, source_of, storage_of
from autopar.planning.graph.strategy_graph import Choice, Edge, StrategyGraph
from autopar.planning.memory.held_state import state_bytes, state_names, zero_split
from autopar.planning.memory.model import MemoryChoice, largest_operand, local_bytes
from autopar.planning.memory.recompute import Region, communicates_again, module_regions, rerun_ops
from autopar.planning.memory.saved_tensors import SavedSpec, saved_by
from autopar.planning.search.solver import MemoryRows, reduce_pairs
from autopar.rules import OpCall, Strategy, shape_of


@dataclass
class MemoryTables:
    """Per root, a vector over its strategies of seconds (``seconds``) and bytes (``nbytes``);
    per pair of roots joined by edges, a matrix of bytes (``pairs``: redistributed operands
    kept, ZeRO's split state) and of seconds (``seconds_pairs``: ZeRO's collectives); what no
    root decides in ``seconds_constant`` and ``bytes_constant``."""

    seconds: dict[str, np.ndarray]
    nbytes: dict[str, np.ndarray]
    pairs: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)  # bytes per pair of roots
    seconds_pairs: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    seconds_constant: float = 0.0
    bytes_constant: float = 0.0

    def rows(self) -> MemoryRows:
        """The bytes as the ILP's memory constraint takes them."""
        return MemoryRows(self.nbytes, self.pairs, self.bytes_constant)

    def add_seconds(self, choice: Choice, values: np.ndarray) -> None:
        """Add ``values`` (one per strategy of ``choice``) to the seconds of its root."""
        if choice.root is None:
            self.seconds_constant += float(values[0])
        else:
            self.seconds[choice.root] += values

    def add_bytes(self, choice: Choice, values: np.ndarray) -> None:
        """Add ``values`` (one per strategy of ``choice``) to the bytes of its root."""
        if choice.root is None:
            self.bytes_constant += float(values[0])
        else:
            self.nbytes[choice.root] += values


class MemoryTerms:
    """The terms of every memory choice of one strategy graph, built once per part: the state
    terms per ZeRO stage and the activation terms per set of recomputed modules (candidates
    share them), summed per choice by :meth:`of`, the bytes weighted by ``shares``: what one
    device holds of the model's state and of one microbatch's activations
    (:func:`stage_shares`)."""

    def __init__(self, g: StrategyGraph, memory: Memory, shares: tuple[float, float] = (1.0, 1.0)) -> None:
        self.g, self.memory, self.shares = g, memory, shares
        self._state: dict[int, MemoryTables] = {}
        self._activations: dict[frozenset, MemoryTables] = {}
        self._of: dict[tuple, MemoryTables] = {}

    def _empty(self) -> MemoryTables:
        return MemoryTables(
            seconds={r: np.zeros(k) for r, k in self.g.roots.items()},
            nbytes={r: np.zeros(k) for r, k in self.g.roots.items()},
        )

    def of(self, choice: MemoryChoice) -> MemoryTables:
        """The seconds ``choice`` adds and the bytes per device it holds (see the module docstring)."""
        key = choice.key
        if key not in self._of:
            self._of[key] = self._sum(choice)
        return self._of[key]

    def _sum(self, choice: MemoryChoice) -> MemoryTables:
        if choice.zero not in self._state:
            self._state[choice.zero] = self._empty()
            _state_terms(self.g, choice, self.memory, self._state[choice.zero])
        key = frozenset(choice.recompute.items())
        if key not in self._activations:
            self._activations[key] = self._empty()
            _activation_terms(self.g, choice, self._activations[key])
        state, acts = self._state[choice.zero], self._activations[key]
        held, kept = self.shares  # of the state, of one microbatch's activations
        return MemoryTables(
            seconds={r: state.seconds[r] + acts.seconds[r] for r in state.seconds},
            nbytes={r: held * state.nbytes[r] + kept * acts.nbytes[r] for r in state.nbytes},
            pairs=summed_pairs(
                {k: held * m for k, m in state.pairs.items()}, {k: kept * m for k, m in acts.pairs.items()}
            ),
            seconds_pairs=summed_pairs(state.seconds_pairs, acts.seconds_pairs),
            seconds_constant=state.seconds_constant + acts.seconds_constant,
            bytes_constant=held * state.bytes_constant + kept * acts.bytes_constant,
        )

    def least_bytes(self, choice: MemoryChoice) -> float:
        """A lower bound of the estimate under ``choice``: each root at its fewest bytes, once
        the pairs' row and column minima are moved into the roots (what is left is not negative)."""
        t = self.of(choice)
        per_root, _ = reduce_pairs(t.nbytes, t.pairs)
        return t.bytes_constant + sum(float(b.min()) for b in per_root.values() if b.size)

    def bytes_at(self, choice: MemoryChoice, assignment: Mapping[str, int]) -> float:
        """The estimate under ``choice`` of the strategies ``assignment`` picks per root."""
        return self.of(choice).rows().at(assignment)

    def seconds_at(self, choice: MemoryChoice, assignment: Mapping[str, int]) -> float:
        """The seconds ``choice`` adds to the strategies ``assignment`` picks per root."""
        t = self.of(choice)
        return MemoryRows(t.seconds, t.seconds_pairs, t.seconds_constant).at(assignment)

    def least_seconds(self, choice: MemoryChoice) -> float:
        """The fewest seconds ``choice`` can add: each root at its cheapest, once the pairs' row
        and column minima are moved into the roots."""
        t = self.of(choice)
        per_root, _ = reduce_pairs(t.seconds, t.seconds_pairs)
        return t.seconds_constant + sum(float(v.min()) for v in per_root.values() if v.size)

    def most_seconds(self, choice: MemoryChoice) -> float:
        """The most seconds ``choice`` can add: each root and pair at its dearest."""
        t = self.of(choice)
        roots = sum(float(v.max()) for v in t.seconds.values() if v.size)
        return t.seconds_constant + roots + sum(float(m.max()) for m in t.seconds_pairs.values())


def stage_shares(pipeline: Pipeline | None, mesh: MeshSpec) -> tuple[float, float]:
    """What the rank of a pipeline holding most holds of the whole model's state and of one
    microbatch's activations, with its stages about equal: ``1/p`` of the state (all its
    ``virtual_stages`` stages) and, of the activations, as many stages' shares as it holds
    microbatch-stages in flight at its peak (:meth:`~autopar.ir.options.Pipeline.in_flight`, the
    sum of :func:`~autopar.planning.pipeline.in_flight.stage_flights` over its stages when they are
    equal; ``p`` for 1F1B's first rank). Without a pipeline, all of both."""
    if pipeline is None:
        return 1.0, 1.0
    p = pipeline.size(mesh)
    flight = max(pipeline.in_flight(p, rank) for rank in range(p))
    return 1.0 / p, flight / pipeline.stages(mesh)


def summed_pairs(
    a: Mapping[tuple[str, str], np.ndarray], b: Mapping[tuple[str, str], np.ndarray]
) -> dict[tuple[str, str], np.ndarray]:
    """The pair matrices of ``a`` and ``b``, added where both have a pair."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def _state_terms(g: StrategyGraph, choice: MemoryChoice, memory: Memory, tables: MemoryTables) -> None:
    """Each parameter's and buffer's state under each of its layouts, and the seconds ZeRO adds.

    ZeRO splits a parameter over an axis its gradient is summed over, which its consumers'
    strategies decide: under ZeRO a parameter's state is priced on the edge to its first
    consumer, per pair of its layout and that consumer's strategy, with the axes that edge sums
    over (:func:`_edge_price`). Where that consumer only views the parameter (a transpose), the
    sum happens further off: every axis the parameter is replicated on counts as summed."""
    state = {**g.captured.params, **g.captured.buffers}
    first: dict[torch.fx.Node, Edge] = {}
    for e in g.edges:
        first.setdefault(e.src, e)
    cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for node, c in g.choices.items():
        if node.name not in state:
            continue
        grad = node.name in g.captured.params and bool(g.requires_grad.get(node))
        e = first.get(node) if grad and choice.zero else None
        if e is None or computes_nothing(e.dst):
            priced = [_state_price(g, node, choice.zero, memory, s.outputs[0], grad) for s in c.strategies]
            tables.add_bytes(c, np.array([b for b, _ in priced]))
            tables.add_seconds(c, np.array([t for _, t in priced]))
            continue
        key = table_key(g, e)
        if key not in cache:
            both = edge_table(g, e, lambda a, b, e=e: _edge_price(g, e, a, b, choice.zero, memory))
            cache[key] = both[..., 0], both[..., 1]
        nbytes, seconds = cache[key]
        tables.bytes_constant += fold_edge(g, e, nbytes, tables.nbytes, tables.pairs)
        tables.seconds_constant += fold_edge(g, e, seconds, tables.seconds, tables.seconds_pairs)


def _edge_price(
    g: StrategyGraph, e: Edge, src: Strategy, dst: Strategy | None, zero: int, memory: Memory
) -> tuple[float, float]:
    """Bytes and ZeRO's seconds of the parameter ``e.src`` stored as ``src`` when its first
    consumer ``e.dst`` runs ``dst``: split over the first axis the edge sums its gradient over
    (:func:`~autopar.planning.graph.gradient_sums.sums_over`)."""
    have, need, grad = edge_layouts(e, src, dst)
    summed = [a for a in range(len(have)) if sums_over(have, need, grad, a)]
    return _state_price(g, e.src, zero, memory, have, True, summed)


def _state_price(
    g: StrategyGraph,
    node: torch.fx.Node,
    zero: int,
    memory: Memory,
    layout: Layout,
    grad: bool,
    summed: list[int] | None = None,
) -> tuple[float, float]:
    """Bytes per rank of parameter or buffer ``node`` stored as ``layout`` (``grad``: it has a
    gradient), and the seconds ZeRO adds, split over the first of ``summed`` axes ZeRO can take
    (by default every axis it is replicated on)."""
    mesh = g.mesh
    local = local_bytes(node, layout, mesh)
    itemsize = node.meta["val"].element_size()
    if summed is None:
        summed = [a for a, p in enumerate(layout) if isinstance(p, Replicate)] if grad else []
    threshold = memory.zero_threshold
    split = zero_split(shape_of(node), layout, summed, mesh, itemsize, threshold) if zero else None
    n = mesh.axis_sizes[split[0]] if split else 1
    b = state_bytes(local, itemsize, n, zero, memory, grad, accumulates=g.grad_sum_weight < 1)
    return b.param + b.grad + b.optimizer, _zero_seconds(g, node, zero, split, local)


def _activation_terms(g: StrategyGraph, choice: MemoryChoice, tables: MemoryTables) -> None:
    """Each op's saved values under each of its strategies (its operands' per edge, see
    :func:`_operand_bytes`), and the seconds recompute adds."""
    regions = module_regions(g.captured.graph, choice.recompute)
    _regather_terms(g, regions, tables)
    first = next((name for name, _ in regions.values()), None)
    claimed: set[object] = set()  # storages already counted in their producer's layout
    into: dict[torch.fx.Node, list[Edge]] = {}
    for e in g.edges:
        into.setdefault(e.dst, []).append(e)
    cache: dict[tuple, np.ndarray] = {}
    for node in g.captured.graph.nodes:
        c = g.choices.get(node)
        if c is None or node.op != "call_function" or c.kind in (ChoiceKind.GETITEM, ChoiceKind.OUTPUT):
            continue
        region = regions.get(node)
        in_first = region is not None and region[0] == first
        spec = saved_by(node, [bool(g.requires_grad.get(op)) for op in OpCall.of(node).operands])
        for e in into.get(node, []):
            weights = _operand_weights(e, spec.inputs, regions, in_first, claimed)
            if weights is None:
                continue
            key = (table_key(g, e), *weights)
            if key not in cache:
                cache[key] = edge_table(g, e, lambda a, b, e=e, w=weights: _operand_bytes(g, e, a, b, *w))
            tables.bytes_constant += fold_edge(g, e, cache[key], tables.nbytes, tables.pairs)
        items = _saved_items(node, spec, regions, claimed)
        weights = [1.0 if kept or in_first else 0.0 for *_, kept in items]
        values = []
        for s in c.strategies:
            total = 0.0
            for (which, index, size, _), w in zip(items, weights):
                layout = (s.operands if which == "operand" else s.outputs)[index]
                total += 0.0 if layout is None else w * size * local_fraction(layout, g.mesh)
            values.append(total)
        tables.add_bytes(c, np.array(values))
        if region is not None and g.requires_grad.get(node) and c.compute is not None:
            if region[1] != SELECTIVE or not is_selective_save(node.target):
                # forward again: a third of forward + backward, and the checkpoint's work for it
                again = g.cost.device.recompute_s(RecomputeWork(1 + spec.packed, region[1] != FULL_COMM))
                tables.add_seconds(c, c.compute / 3.0 + again)


def _regather_terms(g: StrategyGraph, regions: Mapping[torch.fx.Node, Region], tables: MemoryTables) -> None:
    """The seconds of what a recompute region redistributes again in backward, as the plan
    prices it (:func:`~autopar.planning.memory.recompute.communicates_again`): a parameter or
    buffer it reads in another layout than the one stored is gathered again (other values'
    collectives' outputs are kept), and a ``full-comm`` region runs every collective again."""
    state = state_names(g)
    rerun = rerun_ops(g.captured.graph, regions, g.requires_grad)
    cache: dict[tuple, np.ndarray] = {}
    for e in g.edges:
        if not communicates_again(e.dst, e.src.name in state, regions, rerun):
            continue
        key = table_key(g, e)
        if key not in cache:
            cache[key] = edge_table(g, e, lambda a, b, e=e: _redistributed(g, e, a, b))
        tables.seconds_constant += fold_edge(g, e, cache[key], tables.seconds, tables.seconds_pairs)


def _redistributed(g: StrategyGraph, e: Edge, src: Strategy, dst: Strategy | None) -> float:
    """Seconds of edge ``e``'s forward redistribution."""
    have, need, _ = edge_layouts(e, src, dst)
    return g.cost.redistribute(have, need, *edge_value(e))[1]


def _operand_weights(
    e: Edge,
    saved: tuple[int, ...],
    regions: Mapping[torch.fx.Node, Region],
    in_first: bool,
    claimed: set[object],
) -> tuple[float, float, float] | None:
    """What the consumer of edge ``e`` keeps of its operand, as :func:`_operand_bytes` weighs
    it: ``(bytes of the storage, weight of a redistributed copy, weight of the producer's
    own layout)``; None when it keeps nothing. Outside recompute a saved operand is kept,
    a copy per edge and the producer's layout once per storage (not a placeholder's, which
    the step does not allocate); a recompute region keeps its inputs from outside and its
    collectives' outputs (a ``full-comm`` one its inputs only), and the first region's saved
    operands count at the peak (the module docstring)."""
    source, index = source_of(e.src)
    storage, size = storage_of(source, index)
    placeholder = source.op == "placeholder"
    region = regions.get(e.dst)
    is_saved = e.slot in saved
    if region is None:
        copy, own = float(is_saved), float(is_saved and not placeholder)
    else:
        outside = regions.get(source, (None,))[0] != region[0]
        copy = float((not placeholder and region[1] != FULL_COMM) or (is_saved and in_first))
        own = float(not placeholder and (outside or (is_saved and in_first)))
    if own and storage in claimed:
        own = 0.0
    elif own:
        claimed.add(storage)
    return None if copy == own == 0.0 else (float(size), copy, own)


def _operand_bytes(
    g: StrategyGraph, e: Edge, src: Strategy, dst: Strategy | None, size: float, copy: float, own: float
) -> float:
    """Bytes of edge ``e``'s operand kept by its consumer: ``copy`` times the copy in the
    layout it needs when that is not the producer's, else ``own`` times the value."""
    have, need, _ = edge_layouts(e, src, dst)
    if need is None:
        return 0.0
    return size * local_fraction(need, g.mesh) * (copy if need != have else own)


def _saved_items(
    node: torch.fx.Node, spec: SavedSpec, regions: Mapping[torch.fx.Node, Region], claimed: set[object]
) -> list[tuple[str, int, float, bool]]:
    """What ``node`` saves of its own, each value at its first saver (``claimed``: the storages
    counted so far): ``(operand or output, index, global bytes, kept)``, its other tensors
    (statistics, masks) scaled like its largest operand; ``kept`` is False for what its
    region recomputes."""
    region = regions.get(node)
    items = []
    for j in spec.outputs:
        storage, size = storage_of(node, j)
        if storage not in claimed:
            claimed.add(storage)
            kept = region is None or (region[1] == SELECTIVE and is_selective_save(node.target))
            items.append(("output", j, size, kept))
    if spec.extra_bytes:
        largest = largest_operand(OpCall.of(node))
        which = ("operand", largest) if largest is not None else ("output", 0)
        items.append((*which, float(spec.extra_bytes), region is None))
    return items


def _zero_seconds(
    g: StrategyGraph, node: torch.fx.Node, zero: int, split: tuple[int, int] | None, local: float
) -> float:
    """Seconds ZeRO adds for one parameter of ``local`` bytes per rank, over what its bucketed
    gradient sum costs (its wire, in the base costs): ZeRO-1 all-gathers the updated shard after
    the step; ZeRO-2 trades the all-reduce for a reduce-scatter and an all-gather of as many bytes,
    adding the gather's latency. ZeRO-3's consumers gather the stored shard in forward and again in
    backward, and its gradient is reduce-scattered as it arises, not in a bucket: every pass pays
    the three collectives' latencies (each microbatch's, under a pipeline), and one gradient sum's
    wire per step is no longer paid. Each gather runs one per shard, paying its latency."""
    if split is None or zero == 0:
        return 0.0
    axis = g.mesh.axis_names[split[0]]
    n = g.mesh.axis_sizes[split[0]]
    gather = Collective(CollectiveKind.ALL_GATHER, (axis,), int(local / n))
    wire = g.cost.collective_time(gather, latency=False)
    latency = g.cost.collective_time(gather) - wire
    if zero == 3:
        grad = int(local * g.grad_sum_itemsize(node) / node.meta["val"].element_size())
        scatter = g.cost.collective_time(Collective(CollectiveKind.REDUCE_SCATTER, (axis,), grad))
        summed = g.cost.collective_time(Collective(CollectiveKind.ALL_REDUCE, (axis,), grad), latency=False)
        return 2 * (wire + latency) + scatter - g.grad_sum_weight * summed
    return g.grad_sum_weight * {1: wire + latency, 2: latency}[zero]
