"""A graph together with the layouts its nodes compute with: what the gradient-sum and memory models read.

The layouts come as data, never from ``node.meta``'s side channel in planning: while a plan is
being made they are the solver's (:meth:`~autopar.planning.graph.strategy_graph.StrategyGraph.layouts`),
and after the passes wrote them on a lowered graph they are read back through
:class:`~autopar.ir.meta.GraphLayouts`. So the planner can price any number of candidate plans
on one captured graph without touching it, and the passes place exactly what the plan priced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import NodeLayouts


@dataclass(frozen=True, kw_only=True)
class LaidOutGraph:
    """``graph`` with ``layouts`` on ``mesh``; ``flows`` says which nodes carry a gradient.

    A node missing from ``layouts`` has none (the graph's output, values that are not tensors).
    """

    graph: torch.fx.Graph
    layouts: Mapping[torch.fx.Node, NodeLayouts]
    mesh: MeshSpec
    flows: Mapping[torch.fx.Node, bool]
