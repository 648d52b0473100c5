"""What parameters and buffers hold per rank under a plan's ZeRO stage: their splits and bytes.

:func:`zero_splits` picks, for every parameter whose gradient the program sums, the mesh axis
and dim ZeRO splits it along (:func:`zero_split`); :func:`held_state`
prices every parameter's and buffer's bytes per rank (itself, its gradient, optimizer state,
host) and what its optimizer step updates; under ZeRO-3 :func:`stored_split` stores the split
parameters split, so their consumers gather them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.ir.layout import Layout, format_layout, local_shape
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import Memory
from autopar.ir.plan import ChoiceKind
from autopar.ir.strided import is_split
from autopar.planning.cost.step_overheads import FP32_BYTES, OptimizerWork
from autopar.planning.graph.gradient_sums import planned_edges
from autopar.planning.graph.laid_out import LaidOutGraph
from autopar.planning.graph.strategy_graph import Choice, StrategyGraph, fixed_strategy
from autopar.planning.memory.model import local_bytes
from autopar.rules import shape_of

Split = tuple[int, int]  # (mesh axis, tensor dim) ZeRO splits a parameter along


def zero_split(
    shape: tuple[int, ...],
    layout: Layout,
    summed_axes: Iterable[int],
    mesh: MeshSpec,
    itemsize: int,
    threshold: int,
) -> tuple[int, int] | None:
    """``(mesh axis, tensor dim)`` ZeRO splits a parameter along, or None to keep it whole.

    The axis is the first of ``summed_axes`` (those its gradient is summed over) of size
    above 1 on which the parameter is replicated; the dim the first one no axis splits
    whose local size that axis divides. Parameters under ``threshold`` bytes per rank stay whole.
    """
    local = local_shape(shape, layout, mesh)
    if math.prod(local) * itemsize < max(threshold, 1):
        return None
    used = {p.dim for p in layout if is_split(p)}
    for a in sorted(summed_axes):
        n = mesh.axis_sizes[a]
        if n == 1 or not isinstance(layout[a], Replicate):
            continue
        for d, size in enumerate(local):
            if d not in used and size % n == 0:
                return a, d
    return None


def with_split(layout: Layout, split: tuple[int, int]) -> Layout:
    """``layout`` with mesh axis ``split[0]`` splitting tensor dim ``split[1]``."""
    axis, dim = split
    return (*layout[:axis], Shard(dim), *layout[axis + 1 :])


@dataclass(frozen=True)
class StateBytes:
    """Per-rank bytes of one parameter's state (see :mod:`autopar.planning.memory.model`'s docstring)."""

    param: float
    grad: float
    optimizer: float
    host: float


def state_bytes(
    local: float, itemsize: int, split: int, zero: int, memory: Memory, grad: bool, accumulates: bool = False
) -> StateBytes:
    """The state of a parameter of ``local`` bytes per rank, split ``split`` ways by ZeRO stage ``zero``.

    ZeRO-2 keeps its gradient's shard once summed, but where a step ``accumulates`` several backward
    passes (a pipeline's microbatches, or gradient accumulation) the runtime sums once, after the
    last: until then the leaf holds the whole local gradient (ZeRO-3's leaf is its shard: its sum
    runs in each pass's backward)."""
    numel = local / itemsize
    shard = numel / split
    param = local / split if zero == 3 else local
    g = (local / split if zero == 3 or (zero == 2 and not accumulates) else local) if grad else 0.0
    states = FP32_BYTES * memory.optimizer_states * (shard if zero >= 1 else numel) if grad else 0.0
    if memory.offload_optimizer and grad:
        host = FP32_BYTES * (memory.optimizer_states + 2) * (shard if zero >= 1 else numel)
        return StateBytes(param=param, grad=g, optimizer=0.0, host=host)
    return StateBytes(param=param, grad=g, optimizer=states, host=0.0)


@dataclass(frozen=True)
class HeldState:
    """Parameters' and buffers' layouts by fully-qualified name (aliases included), each one's
    bytes per rank by placeholder: (itself, its gradient, optimizer state, host), what the
    optimizer steps of each trained parameter on this rank, and the bytes of the leaf its
    gradient accumulates in (the program's placeholder: ZeRO-3's shard, else the local whole)."""

    layouts: dict[str, str]
    held: dict[str, tuple[float, float, float, float]]
    updates: dict[str, OptimizerWork]
    leaves: dict[str, float]


def zero_splits(
    g: StrategyGraph, assignment: Mapping[str, int], memory: Memory
) -> dict[torch.fx.Node, Split]:
    """Each parameter ZeRO may split: ``(mesh axis, dim)`` (see ``memory.model.zero_split``).

    The axes a parameter's gradient is summed over are those the compiled program sums
    (:func:`~autopar.planning.graph.gradient_sums.planned_edges`) under the assignment. A table split
    by ``ManualSplit`` is not split further: its lookups read its rows as the user gave them.
    """
    laid = LaidOutGraph(
        graph=g.captured.graph, layouts=g.layouts(assignment), mesh=g.mesh, flows=g.requires_grad
    )
    _, summed = planned_edges(laid, state_names(g))
    manual = g.captured.annotations.parameter_rows
    splits = {}
    for node in g.captured.graph.nodes:  # graph order: every rank lists the splits alike
        axes = summed.get(node)
        if axes and node.name in g.captured.params and g.captured.params[node.name] not in manual:
            layout = laid.layouts[node].output
            itemsize = node.meta["val"].element_size()
            split = zero_split(shape_of(node), layout, axes, g.mesh, itemsize, memory.zero_threshold)
            if split is not None:
                splits[node] = split
    return splits


def state_names(g: StrategyGraph) -> set[str]:
    """The placeholders of parameters and buffers."""
    return set(g.captured.params) | set(g.captured.buffers)


def stored_split(
    g: StrategyGraph, assignment: Mapping[str, int], splits: Mapping[torch.fx.Node, Split]
) -> StrategyGraph:
    """``g`` with each parameter ZeRO-3 splits stored split (its consumers then gather it)."""
    stored = {
        node: Choice(
            root=None,
            strategies=[fixed_strategy(with_split(g.strategy(node, assignment).outputs[0], split))],
            kind=ChoiceKind.ZERO3,
        )
        for node, split in splits.items()
    }
    return replace(g, choices={**g.choices, **stored})


def held_state(
    g: StrategyGraph,
    assignment: Mapping[str, int],
    splits: Mapping[torch.fx.Node, Split],
    zero: int,
    memory: Memory,
) -> HeldState:
    """Every parameter's and buffer's layout and bytes per rank under ZeRO stage ``zero``."""
    layouts: dict[str, str] = {}
    held: dict[str, tuple[float, float, float, float]] = {}
    updates: dict[str, OptimizerWork] = {}
    leaves: dict[str, float] = {}
    by_name = {n.name: n for n in g.choices}
    for name, fqn in {**g.captured.params, **g.captured.buffers}.items():
        node = by_name[name]
        layout = g.strategy(node, assignment).outputs[0]
        for alias in g.captured.aliases.get(fqn, [fqn]):
            layouts[alias] = format_layout(layout)
        split = splits.get(node)
        n = g.mesh.axis_sizes[split[0]] if split else 1
        local = local_bytes(node, layout, g.mesh) * (n if zero == 3 else 1)
        manual = g.captured.annotations.parameter_rows.get(fqn)
        if manual is not None:  # every rank holds its rows padded to the largest count
            local *= len(manual.rows) * max(manual.rows) / sum(manual.rows)
        grad = name in g.captured.params and bool(g.requires_grad.get(node))
        itemsize = node.meta["val"].element_size()
        b = state_bytes(local, itemsize, n, zero, memory, grad, accumulates=g.grad_sum_weight < 1)
        held[name] = (b.param, b.grad, b.optimizer, b.host)
        if grad:  # the optimizer steps its shard under ZeRO, the whole local parameter otherwise
            updates[name] = OptimizerWork(elements=local / itemsize / (n if zero else 1), itemsize=itemsize)
            leaves[name] = local / (n if zero == 3 else 1)
    return HeldState(layouts=layouts, held=held, updates=updates, leaves=leaves)
