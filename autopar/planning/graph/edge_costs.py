"""The price of every edge of the strategy graph, and the cost tables the ILP minimises.

An edge costs the redistribution of the producer's output into the layout the consumer
needs plus, in backward, of the consumer's gradient into the layout the producer's
gradient must have. A parameter's gradient sum is bucketed by the runtime: it costs
bandwidth only, once per step (:attr:`StrategyGraph.grad_sum_weight` of it per microbatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from autopar.ir.layout import Layout, grad_layout
from autopar.planning.graph.strategy_graph import Choice, Edge, StrategyGraph
from autopar.rules import Strategy


class CostTables(NamedTuple):
    """The ILP's objective (``StrategyILP(*tables)``): seconds per root and strategy, per pair
    of roots and strategies, and of everything no root decides."""

    node_costs: dict[str, np.ndarray]
    pair_costs: dict[tuple[str, str], np.ndarray]
    constant: float


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


def edge_cost(g: StrategyGraph, edge: Edge, src: Strategy, dst: Strategy | None) -> float:
    """Seconds of one edge when its producer runs ``src`` and its consumer ``dst``."""
    shape, itemsize = edge_value(edge)
    have, need, grad = edge_layouts(edge, src, dst)
    _, t_fwd = g.cost.redistribute(have, need, shape, itemsize)
    flows = g.requires_grad.get(edge.src, False) and grad is not None
    if edge.src.name in g.captured.params and have == need and flows:
        # a parameter's gradient sum waits for the runtime's buckets: bandwidth only
        bwd, _ = g.cost.backward(have, need, grad, grad_layout(have), shape, g.grad_sum_itemsize(edge.src))
        bucketed = sum(g.cost.collective_time(c, latency=False) for c in bwd)
        return t_fwd + g.grad_sum_weight * bucketed
    t_bwd = g.cost.backward(have, need, grad, grad_layout(have), shape, itemsize)[1] if flows else 0.0
    return t_fwd + t_bwd


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


def cost_tables(g: StrategyGraph) -> CostTables:
    """Node cost vectors per root, edge cost matrices per root pair, and a constant."""
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
    cache: dict[tuple, np.ndarray] = {}
    for e in g.edges:
        key = table_key(g, e)
        if key not in cache:
            cache[key] = edge_table(g, e, lambda a, b, e=e: edge_cost(g, e, a, b))
        constant += fold_edge(g, e, cache[key], node_costs, pair_costs)
    return CostTables(node_costs=node_costs, pair_costs=pair_costs, constant=constant)
