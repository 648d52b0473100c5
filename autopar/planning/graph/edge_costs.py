"""The price of every edge of the strategy graph, and the cost tables the ILP minimises.

An edge costs the redistribution of the producer's output into the layout the consumer
needs plus, in backward, of the consumer's gradient into the layout the producer's
gradient must have. A parameter's gradient sum is bucketed by the runtime: it costs
bandwidth only, once per step (:attr:`StrategyGraph.grad_sum_weight` of it per microbatch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch

from autopar.ir.layout import Layout, grad_layout, local_fraction
from autopar.ir.options import Memory
from autopar.ir.plan import CollectiveKind
from autopar.planning.cost.step_overheads import OptimizerWork, gradient_seconds, update_seconds
from autopar.planning.graph.gradient_sums import parameter_only
from autopar.planning.graph.strategy_graph import Choice, Edge, StrategyGraph
from autopar.rules import Strategy


class CostTables(NamedTuple):
    """The ILP's objective (``StrategyILP(node_costs, pair_costs, constant)``): seconds per root and
    strategy, per pair of roots and strategies, and of everything no root decides; and of those,
    the ops' compute alone (the ILP's launch floor hides it, ``solver.LaunchFloor``)."""

    node_costs: dict[str, np.ndarray]
    pair_costs: dict[tuple[str, str], np.ndarray]
    constant: float
    # of node_costs and constant, the ops' compute alone: what launches on an asynchronous device hide
    compute: dict[str, np.ndarray] = {}
    compute_constant: float = 0.0


def edge_layouts(edge: Edge, src: Strategy, dst: Strategy | None) -> tuple[Layout, Layout, Layout | None]:
    """The producer's layout, the layout the consumer needs, and the consumer's gradient layout.

    A model output (``dst`` None) needs its Partial axes reduced and hands back a
    gradient in that same layout.
    """
    have = src.outputs[edge.index]
    if dst is None:
        need = grad_layout(have)
        return have, need, need
    return have, dst.operands[edge.slot], dst.grads[edge.slot]


def edge_value(edge: Edge) -> tuple[tuple[int, ...], int]:
    """The shape and bytes per element of the tensor ``edge`` carries."""
    val = edge.src.meta["val"]
    val = val[edge.index] if isinstance(val, (tuple, list)) else val
    return tuple(int(s) for s in val.shape), val.element_size()


def edge_cost(
    g: StrategyGraph, edge: Edge, src: Strategy, dst: Strategy | None, from_parameters: bool = False
) -> float:
    """Seconds of one edge when its producer runs ``src`` and its consumer ``dst``; an edge
    ``from_parameters`` leaves a value computed from parameters alone (a parameter, its cast to the
    compute dtype). Each collective the program issues for it is an op, launched at
    ``op_overhead_s`` as every op is (the step counts it so: on an asynchronous device whose
    launches hide its compute, the launches are the step)."""
    shape, itemsize = edge_value(edge)
    have, need, grad = edge_layouts(edge, src, dst)
    fwd, t_fwd = g.cost.redistribute(have, need, shape, itemsize)
    t_fwd += len(fwd) * g.cost.cluster.op_overhead_s
    flows = g.requires_grad.get(edge.src, False) and grad is not None
    if from_parameters and have == need and flows:
        # the gradient sum waits for the runtime's buckets, on the parameter (deferred there:
        # graph.gradient_sums), once per step: bandwidth only, in the sum's dtype
        param = _parameter_of(g, edge.src)
        bwd, _ = g.cost.backward(have, need, grad, grad_layout(have), shape, g.grad_sum_itemsize(param))
        bucketed = sum(g.cost.collective_time(c, latency=False) for c in bwd)
        if bwd:  # a summed gradient is copied into its bucket (read and written, an op)
            leaf = math.prod(shape) * param.meta["val"].element_size() * local_fraction(have, g.mesh)
            cluster = g.cost.cluster
            bucketed += gradient_seconds(leaf, 1, True, cluster) - gradient_seconds(leaf, 1, False, cluster)
        return t_fwd + g.grad_sum_weight * bucketed
    if not flows:
        return t_fwd
    bwd, t_bwd = g.cost.backward(have, need, grad, grad_layout(have), shape, itemsize)
    return t_fwd + t_bwd + len(bwd) * g.cost.cluster.op_overhead_s


class ParameterGathers(NamedTuple):
    """Where a plan gathers a parameter in forward: stored split over an axis its use needs whole
    (FSDP-style storage), per strategy of a root (its use fixed or of the same root) and per pair of
    a parameter's root and its user's strategies. The search solves again without them
    (:mod:`autopar.planning.search.memory_search`): gathers in forward are never hidden, while
    the gradient sums of a parameter stored as it is used overlap backward, which the ILP's
    objective does not count."""

    per_root: dict[str, np.ndarray]  # bool per strategy
    pairs: dict[tuple[str, str], np.ndarray]  # bool per pair of strategies

    def at(self, assignment: Mapping[str, int]) -> bool:
        """Whether the plan picking ``assignment[r]`` for every root gathers some parameter."""
        return any(m[assignment[r]] for r, m in self.per_root.items()) or any(
            m[assignment[u], assignment[v]] for (u, v), m in self.pairs.items()
        )


def parameter_gathers(g: StrategyGraph) -> ParameterGathers:
    """Every strategy and pair of strategies of ``g`` under which an edge leaving a parameter, or a
    value computed from parameters alone (a cast to the compute dtype, a transpose), gathers it
    along some mesh axis in forward."""
    derived = set(parameter_only(g.captured.graph, set(g.captured.params)))
    per_root: dict[str, np.ndarray] = {}
    pairs: dict[tuple[str, str], np.ndarray] = {}
    for e in g.edges:
        cs, cd = g.choices[e.src], g.choices[e.dst]
        if e.src not in derived or cs.root is None:
            continue
        shape, itemsize = edge_value(e)

        def gathers(
            a: Strategy, b: Strategy | None, e: Edge = e, shape: tuple = shape, size: int = itemsize
        ) -> bool:
            have, need, _ = edge_layouts(e, a, b)
            steps, _ = g.cost.redistribute(have, need, shape, size)
            return any(c.kind == CollectiveKind.ALL_GATHER for c in steps)

        m = edge_table(g, e, gathers).astype(bool)
        if _shares_root(cs, cd) or cd.root is None:
            row = m if m.ndim == 1 else m[:, 0]
            per_root[cs.root] = per_root.get(cs.root, np.zeros(len(row), bool)) | row
        else:
            pairs[(cs.root, cd.root)] = pairs.get((cs.root, cd.root), np.zeros(m.shape, bool)) | m
    return ParameterGathers(
        per_root={r: m for r, m in per_root.items() if m.any()},
        pairs={k: m for k, m in pairs.items() if m.any()},
    )


def _parameter_chains(g: StrategyGraph) -> set[torch.fx.Node]:
    """Parameters and the values computed from one alone, op after op (its cast to the compute
    dtype, a transpose): the gradient sum of such a value is the parameter's, deferred to its bucket
    wherever the value is replicated as the parameter is (``graph.gradient_sums``). A value an op
    computes from a parameter and another input (a lookup of positions) is left out: whether its
    sum is deferred depends on how that op's gradient is laid out."""
    chains = {n for n in g.choices if n.op == "placeholder" and n.name in g.captured.params}
    for node in g.captured.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "call_function" and len(inputs) == 1 and inputs[0] in chains:
            chains.add(node)
    return chains


def _parameter_of(g: StrategyGraph, node: torch.fx.Node) -> torch.fx.Node:
    """The parameter a value of :func:`_parameter_chains` is computed from."""
    while node.name not in g.captured.params:
        node = node.all_input_nodes[0]
    return node


def table_key(g: StrategyGraph, e: Edge) -> tuple[int, int, int, int]:
    """Edges between the same two choices, slots and outputs share one table (tied blocks)."""
    return id(g.choices[e.src]), id(g.choices[e.dst]), e.slot, e.index


def _shares_root(cs: Choice, cd: Choice) -> bool:
    return cs.root is not None and cs.root == cd.root


def table_entries(g: StrategyGraph) -> int:
    """How many edge costs :func:`cost_tables` computes: the entries of every distinct table."""
    sizes = {}
    for e in g.edges:
        cs, cd = g.choices[e.src], g.choices[e.dst]
        n, m = len(cs.strategies), len(cd.strategies)
        sizes[table_key(g, e)] = n if _shares_root(cs, cd) else n * m
    return sum(sizes.values())


def edge_table(
    g: StrategyGraph, e: Edge, price: Callable[[Strategy, Strategy | None], float | tuple[float, ...]]
) -> np.ndarray:
    """``price`` of edge ``e`` per pair of its producer's and consumer's strategies: a matrix,
    or a vector (one entry per strategy) where both nodes share a root; where ``price`` returns
    a tuple, its items along a last axis."""
    cs, cd = g.choices[e.src], g.choices[e.dst]
    if _shares_root(cs, cd):
        return np.array([price(a, b) for a, b in zip(cs.strategies, cd.strategies)])
    return np.array([[price(a, b) for b in cd.strategies] for a in cs.strategies])


def fold_edge(
    g: StrategyGraph,
    e: Edge,
    m: np.ndarray,
    nodes: dict[str, np.ndarray],
    pairs: dict[tuple[str, str], np.ndarray],
) -> float:
    """Add edge ``e``'s table ``m`` (see :func:`edge_table`) to its roots' vectors, or to the
    matrix of their pair; return the part no root decides."""
    cs, cd = g.choices[e.src], g.choices[e.dst]
    if cs.root is None and cd.root is None:
        return float(m[0, 0])
    if _shares_root(cs, cd):
        nodes[cs.root] += m
    elif cs.root is None:
        nodes[cd.root] += m[0]
    elif cd.root is None:
        nodes[cs.root] += m[:, 0]
    else:
        pairs[(cs.root, cd.root)] = pairs.get((cs.root, cd.root), 0) + m
    return 0.0


def updates(g: StrategyGraph, memory: Memory) -> dict[str, np.ndarray]:
    """The optimizer step of each parameter with a root, per strategy: it updates the rank's piece
    of the parameter (:func:`~autopar.planning.cost.step_overheads.update_seconds`, before any ZeRO
    split, which divides every layout's alike), once per step (``grad_sum_weight`` of it per
    microbatch). A replicated weight updates whole on every rank, a split one its piece."""
    out = {}
    for node, choice in g.choices.items():
        if node.op != "placeholder" or node.name not in g.captured.params or choice.root is None:
            continue
        if not g.requires_grad.get(node, False):
            continue
        val = node.meta["val"]
        seconds = [
            update_seconds(
                OptimizerWork(val.numel() * local_fraction(s.outputs[0], g.mesh), val.element_size()),
                g.cost.cluster,
                memory,
            )
            for s in choice.strategies
        ]
        out[choice.root] = g.grad_sum_weight * np.array(seconds)
    return out


def cost_tables(g: StrategyGraph, memory: Memory | None = None) -> CostTables:
    """Node cost vectors per root, edge cost matrices per root pair, and a constant; with
    ``memory``, the optimizer's step of each parameter in its layout (:func:`updates`)."""
    node_costs = {r: np.zeros(k) for r, k in g.roots.items()}
    pair_costs: dict[tuple[str, str], np.ndarray] = {}
    constant = 0.0
    for choice in g.choices.values():
        if choice.compute is None:
            continue
        if choice.root is None:
            constant += float(choice.compute[0])
        else:
            node_costs[choice.root] += choice.compute
    compute = {r: c.copy() for r, c in node_costs.items()}
    compute_constant = constant
    for root, seconds in (updates(g, memory) if memory is not None else {}).items():
        node_costs[root] += seconds
    cache: dict[tuple, np.ndarray] = {}
    only = _parameter_chains(g)
    for e in g.edges:
        key = table_key(g, e)
        if key not in cache:
            cache[key] = edge_table(g, e, lambda a, b, e=e: edge_cost(g, e, a, b, e.src in only))
        constant += fold_edge(g, e, cache[key], node_costs, pair_costs)
    return CostTables(node_costs, pair_costs, constant, compute, compute_constant)
