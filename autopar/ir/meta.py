"""The ``node.meta`` keys of autopar: the contract between the passes, defined once.

Only passes write them (the planner returns layouts as data, see
:class:`~autopar.ir.meta.NodeLayouts`); what reads them is named in each pass's docstring.

| key | value |
| --- | --- |
| ``autopar.layouts`` | ``(operand layouts, output layouts)`` of a node |
| ``autopar.grads`` | the layout of the gradient each operand receives |
| ``autopar.redistribution`` | ``(have, need, grad_need, grad_have)`` of an inserted redistribute |
| ``autopar.mean_split`` | on a split mean: how many ways its items are split |
| ``autopar.stage`` | the pipeline stage a node runs in |
| ``autopar.recompute`` | ``(region, policy)``: the node is recomputed in backward |
| ``autopar.regather`` | a collective of a parameter inside a region: runs again in backward |
| ``autopar.masked_by`` | on a lookup into a split dim: the node that masks its result into a partial sum |
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.ir.layout import Layout
from autopar.ir.ops import written_operand

T = TypeVar("T")

LAYOUTS = "autopar.layouts"
GRADS = "autopar.grads"
REDISTRIBUTION = "autopar.redistribution"
MEAN_SPLIT = "autopar.mean_split"
STAGE = "autopar.stage"
RECOMPUTE = "autopar.recompute"
REGATHER = "autopar.regather"
MASKED_BY = "autopar.masked_by"


@dataclass(frozen=True)
class NodeLayouts:
    """The layouts one node computes with: its operands', its outputs' and its operands' gradients'.

    ``None`` for an operand read only for its shape (or that receives no gradient).
    """

    operands: tuple[Layout | None, ...]
    outputs: tuple[Layout, ...]
    grads: tuple[Layout | None, ...] = ()

    @property
    def output(self) -> Layout:
        """The layout of the first (usually only) output."""
        return self.outputs[0]


class GraphLayouts(Mapping[torch.fx.Node, NodeLayouts]):
    """The layouts written on a graph's nodes (``autopar.layouts``, ``autopar.grads``), read as a mapping.

    What models of a laid-out graph read (gradient sums, memory), whether the layouts come
    from a plan (a plain dict) or from a lowered graph (this view).
    """

    def __init__(self, graph: torch.fx.Graph) -> None:
        self._nodes = [n for n in graph.nodes if LAYOUTS in n.meta]
        self._set = set(self._nodes)

    def __getitem__(self, node: torch.fx.Node) -> NodeLayouts:
        if node not in self._set:
            raise KeyError(node)
        operands, outputs = node.meta[LAYOUTS]
        return NodeLayouts(operands, outputs, node.meta.get(GRADS, ()))

    def __iter__(self) -> Iterator[torch.fx.Node]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._set


def set_value(node: torch.fx.Node, value: torch.Tensor) -> None:
    """Record ``value`` (a fake tensor) as what ``node`` computes: torch.export's ``val``."""
    node.meta["val"] = value


def output_values(node: torch.fx.Node) -> list[torch.Tensor]:
    """The tensors ``node`` computes, in order: those among the leaves of its ``val`` (none where
    it has no ``val``)."""
    return [v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]


def place_beside(node: torch.fx.Node, op: torch.fx.Node) -> None:
    """Give ``node``, inserted by a pass next to ``op``, ``op``'s pipeline stage and module (so it
    falls in the same stage and in the same recompute region)."""
    for key in (STAGE, "nn_module_stack"):
        if key in op.meta:
            node.meta[key] = op.meta[key]


def write_layouts(node: torch.fx.Node, layouts: NodeLayouts) -> None:
    """Record ``layouts`` on ``node`` (``autopar.layouts``, and ``autopar.grads`` when it has any)."""
    node.meta[LAYOUTS] = (layouts.operands, layouts.outputs)
    if layouts.grads:
        node.meta[GRADS] = layouts.grads


def output_layout(node: torch.fx.Node) -> Layout:
    """The layout of ``node``'s first output, as written on the node."""
    return node.meta[LAYOUTS][1][0]


def per_node(fn: Callable[[torch.fx.Node], T]) -> Callable[[torch.fx.Node], T]:
    """``fn``, a function of a node's target, arguments and values alone, computed once per node
    while those stay the very objects they were (a pass that rewrites the node, or gives it or
    an operand a new ``val``, gets a fresh result). Planning a large model reads the same
    facts of each op hundreds of thousands of times."""
    results: weakref.WeakKeyDictionary[torch.fx.Node, tuple] = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def cached(node: torch.fx.Node) -> T:
        val = node.meta.get("val")
        hit = results.get(node)
        # fx keeps args immutable: the same args object holds the same operand nodes, so only
        # their values need checking (a loop: a generator's setup costs more than the check, on
        # a path taken for every hit)
        if (
            hit is not None
            and hit[0] is node.args
            and hit[1] is node.kwargs
            and hit[2] is val
            and hit[3] is node.target
        ):
            for a, v in hit[4]:
                if a.meta.get("val") is not v:
                    break
            else:
                return hit[5]
        result = fn(node)
        operands = tuple((a, a.meta.get("val")) for a in node.all_input_nodes)
        results[node] = (node.args, node.kwargs, val, node.target, operands, result)
        return result

    return cached


def storage_ref(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference naming the storage ``t`` lives in (equal for a tensor and its views)."""
    return StorageWeakRef(t.untyped_storage())


def written_storages(gm: torch.fx.GraphModule) -> set[StorageWeakRef]:
    """The storages some op of ``gm``, or of a submodule export keeps (a ``torch.no_grad``
    region), writes in place: directly, through a view, or through a region's input."""
    written = set()
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            target = written_operand(node) if node.op == "call_function" else None
            if target is not None and isinstance(target.meta.get("val"), torch.Tensor):
                written.add(storage_ref(target.meta["val"]))
    return written


def module_path(node: torch.fx.Node) -> str:
    """The innermost module a node came from ("" for the root or none)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean_path(path)


def recorded_at(node: torch.fx.Node) -> str | None:
    """The line of the user's code that recorded ``node``, as ``File "...", line N, in f: code``
    (the innermost frame of its stack trace; None where capture kept none)."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    if len(lines) < 2:
        return None
    return f"{lines[-2].strip()}: {lines[-1].strip()}"


def module_stack(node: torch.fx.Node) -> list[str]:
    """Module paths from outermost to innermost."""
    stack = node.meta.get("nn_module_stack") or {}
    return [_clean_path(v[0]) for v in stack.values()]


@functools.cache  # a large model asks for its few thousand paths millions of times
def _clean_path(path: str) -> str:
    # strict-mode style paths look like L['self'].h[0].attn; normalise to h.0.attn
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path)
