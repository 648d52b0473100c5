"""Planning a mesh of many axes within the time limit: adjacent axes merged into groups.

An op's strategies are one choice per mesh axis, so they number about ``(labels + 1) ** axes``,
and the table of edge costs between two ops has the product of their counts: a tiny GPT needs
87 thousand table entries on 3 axes of size 2 and 1.4 million on 4, more than a time limit a
user gives can price and solve (the times: docs/benchmarks_history.md, "meshes of many axes").

:func:`graph_within` builds the strategy graph of the mesh as given when its tables hold at most
:data:`ENTRIES_PER_SECOND` entries per second of the time limit, and otherwise merges axes into
groups whose axes take one choice together: a label on a group splits over all its axes, outer
first (a nested split, lowered like any other). Every strategy an op is offered in the merged
problem is one the full problem offers it, priced on the real mesh; parameters, inputs and free
layout points may split a dim over every axis of one group (nested, as ops may; the full problem
offers them one axis per dim). What merging gives up is the plans that use the axes of one
group differently. The plan names the merged axes in a warning, and its gap is against the
merged problem.

Merging (:func:`merge_sequence`): groups are runs of consecutive axes, as balanced in devices as
can be (a size-1 axis, which splits nothing, loses nothing by merging), inner axes merged first
on a tie (they share the faster links). An op whose operand's layout is pinned by an
annotation enumerates its strategies over the groups cut where that layout places their axes
differently (``autopar.ir.mesh.refine_groups``), so annotations stay reachable. Graphs are built
from the coarsest grouping towards the finest, and the finest whose tables fit wins; a finer
one is not built when the growth so far predicts it would not fit. The choice depends on the
graph and the time limit alone, so every rank that plans makes the same one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from autopar.ir.mesh import AxisGroups, MeshSpec
from autopar.planning.graph.edge_costs import table_entries
from autopar.planning.graph.strategy_graph import StrategyGraph

#: Edge-table entries planned per second of ``time_limit``. The ILP sets the bound, not pricing the
#: entries: a larger budget gives problems the solver leaves far from optimal within the limit
#: (the measurements: docs/benchmarks_history.md, "meshes of many axes").
ENTRIES_PER_SECOND = 2000


def merge_sequence(mesh: MeshSpec) -> list[AxisGroups]:
    """The groupings tried, finest (every axis alone) to coarsest (one group of every axis): for
    each count of groups, the runs of consecutive axes whose largest group has the fewest devices
    (balanced: 6 axes of size 2 in two groups are 8 x 8), the inner groups merged on a tie."""
    sequence = []
    for k in range(mesh.ndim, 0, -1):
        candidates = []
        for cuts in itertools.combinations(range(1, mesh.ndim), k - 1):
            bounds = (0, *cuts, mesh.ndim)
            candidates.append(tuple(tuple(range(i, j)) for i, j in zip(bounds, bounds[1:])))
        sequence.append(min(candidates, key=lambda groups: _balance(mesh, groups)))
    return sequence


def _balance(mesh: MeshSpec, groups: AxisGroups) -> tuple:
    devices = sorted((_devices(mesh, g) for g in groups), reverse=True)
    return devices, [-len(g) for g in reversed(groups)]


def _devices(mesh: MeshSpec, group: tuple[int, ...]) -> int:
    return math.prod(mesh.axis_sizes[a] for a in group)


def graph_within(
    build: Callable[[AxisGroups | None], StrategyGraph], mesh: MeshSpec, time_limit: float
) -> StrategyGraph:
    """The strategy graph of the finest grouping whose edge tables fit ``time_limit``.

    ``build(groups)`` builds the graph (``None``: every axis alone, the mesh as given). A mesh of
    at most two axes of more than one device is first built as given, which fits but for the
    largest models; the coarsest grouping is used when even it does not fit.
    """
    budget = ENTRIES_PER_SECOND * time_limit
    sequence = merge_sequence(mesh)
    if sum(size > 1 for size in mesh.axis_sizes) <= 2:
        whole = build(_ones_merged(mesh))
        if len(sequence) == 1 or table_entries(whole) <= budget:
            return whole
        sequence = sequence[1:]
    chosen, previous = None, None
    for groups in reversed(sequence):
        g = build(None if len(groups) == mesh.ndim else groups)
        entries = table_entries(g)
        if chosen is not None and entries > budget:
            return chosen
        chosen = g
        if previous is not None and entries * entries / previous > budget:
            return chosen  # the next grouping would grow as much again: it would not fit
        previous = max(entries, 1)
    return chosen


def _ones_merged(mesh: MeshSpec) -> AxisGroups | None:
    """Every axis alone but those of one device, each merged into the group before it (the first
    into the one after): a size-1 axis splits nothing, so merging it loses no plan, while alone it
    doubles the strategies of every op it could label (and the ILP with them). None without one."""
    if mesh.ndim == 1 or all(size > 1 for size in mesh.axis_sizes):
        return None
    groups: list[list[int]] = []
    for a, size in enumerate(mesh.axis_sizes):
        if size > 1 or not groups:
            groups.append([a])
        else:
            groups[-1].append(a)
    if len(groups) > 1 and all(mesh.axis_sizes[a] == 1 for a in groups[0]):
        leading = groups.pop(0)  # size-1 axes before any other join the first axis after them
        groups[0][:0] = leading
    return tuple(tuple(g) for g in groups)


def merged_axes(mesh: MeshSpec, groups: AxisGroups | None) -> list[str]:
    """The merged groups of axes of more than one device by name, ``['dp+cp', 'tp+ep']``."""
    named = (tuple(mesh.axis_names[a] for a in g if mesh.axis_sizes[a] > 1) for g in groups or ())
    return ["+".join(names) for names in named if len(names) > 1]
