"""The strategy graph: per node, the strategies the solver picks among, and the edges between nodes.

Every node with a tensor output gets a list of :class:`~autopar.rules.Strategy`
aligned with one solver variable, its *root*:

* anchors (matrix products, attention, embeddings) and user inputs are roots: one
  variable each, one choice per strategy their rule allows;
* cheap ops *follow* one operand (the largest non-parameter one): their i-th
  strategy keeps the operand's i-th layout where the op allows, so they share the
  operand's variable (Alpa's graph simplification);
* parameters and buffers follow their first consumer backwards: they are stored in
  the layout that consumer needs; an annotated parameter is fixed instead;
* layout constraints (``shard`` in/out strategies, ``constrain``) are fixed;
* repeated blocks (``layers.0``, ``layers.1``, ... with identical ops and shapes)
  share the strategies, hence the variables, of the first such block
  (:mod:`autopar.planning.graph.tying`).

A node's compute is in seconds under each choice: its forward, plus backward as twice
the forward when a gradient flows. Edges are priced in :mod:`autopar.planning.graph.edge_costs`.
The graph is data about the captured graph: building it, and reading layouts off it
(:meth:`StrategyGraph.layouts`), leaves the captured graph untouched.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.capture.constraint_op import parse_constraint_spec
from autopar.capture.export import Captured, gradient_flow
from autopar.ir.errors import AnnotationError
from autopar.ir.layout import (
    Layout,
    format_layout,
    grad_layout,
    is_valid_for,
    local_fraction,
    on_one_device_whole,
    replicated,
)
from autopar.ir.mesh import AxisGroups, MeshSpec, each_axis, grouped_product, refine_groups
from autopar.ir.meta import NodeLayouts, module_path, output_values
from autopar.ir.ops import LAYOUT_CONSTRAINT, written_operand
from autopar.ir.plan import ChoiceKind
from autopar.ir.strided import is_split, parts_of, strided
from autopar.planning.cost.model import CostModel
from autopar.planning.graph.storages import computes_nothing
from autopar.planning.graph.tying import tie_blocks
from autopar.rules import (
    DimSpec,
    OpCall,
    Strategy,
    enumerate_strategies,
    fallback,
    follow,
    lookup,
    shape_of,
    spec_of,
)
from autopar.rules.embedding import non_lookup_use


@dataclass
class Choice:
    """The strategies of one node (or of a group of tied nodes, which share it)."""

    root: str | None  # variable key; None = a single fixed strategy
    strategies: list[Strategy | None]  # [None] for the graph's output node, which needs no strategy
    kind: ChoiceKind
    compute: np.ndarray | None = None  # seconds per strategy


@dataclass
class Edge:
    """A tensor flowing from ``src`` output ``index`` into operand ``slot`` of ``dst``."""

    src: torch.fx.Node
    dst: torch.fx.Node
    slot: int
    index: int


@dataclass(frozen=True, kw_only=True)
class StrategyGraph:
    """Everything the solver and the plan need; see the module docstring."""

    captured: Captured
    mesh: MeshSpec
    cost: CostModel
    choices: dict[torch.fx.Node, Choice]
    edges: list[Edge]
    roots: dict[str, int]  # root -> number of strategies
    requires_grad: dict[torch.fx.Node, bool]
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (op, module path)
    tied_blocks: int = 0
    # the axes planned together (``autopar.planning.graph.axis_groups``); None: each axis on its own
    axis_groups: AxisGroups | None = None
    # parameters' gradient sums happen once per step: with m microbatches, 1/m of a microbatch's cost
    grad_sum_weight: float = 1.0

    def strategy(self, node: torch.fx.Node, assignment: Mapping[str, int]) -> Strategy:
        """The strategy ``node`` runs under ``assignment`` (root -> strategy index)."""
        c = self.choices[node]
        return c.strategies[assignment[c.root] if c.root is not None else 0]

    def compute_seconds(self, node: torch.fx.Node, assignment: Mapping[str, int]) -> float:
        """Seconds of ``node``'s compute under ``assignment`` (0 for nodes that compute nothing)."""
        c = self.choices[node]
        if c.compute is None:
            return 0.0
        return float(c.compute[assignment[c.root]] if c.root else c.compute[0])

    def grad_sum_itemsize(self, param: torch.fx.Node) -> int:
        """Bytes per element of a parameter's gradient sum: mixed precision's ``reduce_dtype``,
        else the parameter's own."""
        val, precision = param.meta["val"], self.captured.precision
        if precision is not None and precision.reduce_dtype is not None and val.is_floating_point():
            return precision.reduce_dtype.itemsize
        return val.element_size()

    def layouts(self, assignment: Mapping[str, int]) -> dict[torch.fx.Node, NodeLayouts]:
        """The layouts every node computes with under ``assignment`` (the graph's output node has none)."""
        found = {}
        for node, choice in self.choices.items():
            if choice.kind != ChoiceKind.OUTPUT:
                s = self.strategy(node, assignment)
                found[node] = NodeLayouts(operands=s.operands, outputs=s.outputs, grads=s.grads)
        return found


def _tensor_nodes(graph: torch.fx.Graph) -> Iterable[torch.fx.Node]:
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op in ("placeholder", "call_function") and (
            isinstance(val, torch.Tensor)
            or (isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val))
        ):
            yield node


def _numel(node: torch.fx.Node) -> int:
    return math.prod(shape_of(node))


def all_layouts(
    shape: tuple[int, ...],
    mesh: MeshSpec,
    parts: Collection[tuple[int, int]] = (),
    uneven: bool = False,
    groups: AxisGroups | None = None,
) -> list[Layout]:
    """Every even layout of a tensor: each mesh axis replicates or splits one dimension,
    no dimension split over two axes (see ``rules.enumerate_strategies``); a dimension of a
    size in ``parts`` (``(size, k)`` pairs) may also split as a strided shard of ``k`` parts,
    and with ``uneven`` one that an axis does not divide may split unevenly (a parameter's
    vocabulary over ``tp``: ``autopar.ir.layout.splits_unevenly``). With ``groups`` the axes
    of a group take one placement together (``autopar.ir.mesh.grouped_product``): a dim then
    splits over every axis of one group, outer first, or over none, and strided only over a
    group of one axis."""
    options = [Replicate(), *(Shard(d) for d in range(len(shape)))]
    options += [strided(d, k) for d, n in enumerate(shape) for size, k in parts if n == size]
    groups = each_axis(mesh) if groups is None else groups
    out = []
    for combo in grouped_product(options, mesh, groups):
        firsts = [(combo[g[0]], len(g)) for g in groups if is_split(combo[g[0]])]
        dims = [p.dim for p, _ in firsts]
        if (
            is_valid_for(combo, shape, mesh, uneven)
            and len(dims) == len(set(dims))
            and all(n == 1 or parts_of(p) == 1 for p, n in firsts)
        ):
            out.append(combo)
    return out


def _whole(strategy: Strategy, mesh: MeshSpec) -> Strategy:
    """``strategy`` with its layouts whole on the axes of one device."""

    def each(layouts: tuple[Layout | None, ...]) -> tuple[Layout | None, ...]:
        return tuple(None if lay is None else on_one_device_whole(lay, mesh) for lay in layouts)

    return dataclasses.replace(
        strategy, operands=each(strategy.operands), outputs=each(strategy.outputs), grads=each(strategy.grads)
    )


def _cut_into_parts(graph: torch.fx.Graph) -> frozenset[tuple[int, int]]:
    """``(size, k)`` for every dim of that size some op cuts into ``k`` equal parts (``split``,
    ``chunk``, slices: ``DimSpec.parts``): the dims a producer may split strided for it."""
    found = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        call = OpCall.of(node)
        spec = spec_of(call) if call.operands else None
        for label, k in spec.parts if spec else ():
            found.add((call.shapes[0][spec.operands[0].index(label)], k))
    return frozenset(found)


def fixed_strategy(layout: Layout, operands: int = 0) -> Strategy:
    """The one strategy of a value held in ``layout``, taking ``operands`` operands in it too."""
    return Strategy(
        operands=tuple(layout for _ in range(operands)),
        outputs=(layout,),
        grads=tuple(grad_layout(layout) for _ in range(operands)),
        choices=(),
        split=1,
    )


def _replicated_strategy(spec: DimSpec, mesh: MeshSpec) -> Strategy:
    rep = replicated(mesh)
    return Strategy(
        operands=tuple(None if labels is None else rep for labels in spec.operands),
        outputs=tuple(rep for _ in spec.outputs),
        grads=tuple(None if labels is None else rep for labels in spec.operands),
        choices=(None,) * mesh.ndim,
        split=1,
    )


class _Builder:
    def __init__(
        self,
        captured: Captured,
        mesh: MeshSpec,
        cost: CostModel,
        fixed_inputs: Mapping[str, Layout],
        groups: AxisGroups | None,
    ) -> None:
        self.captured = captured
        self.groups = groups
        self.fixed_inputs = fixed_inputs
        self.graph = captured.graph
        self.mesh = mesh
        self.cost = cost
        self.choices: dict[torch.fx.Node, Choice] = {}
        self.fallbacks: list[tuple[str, str]] = []
        # a dict, not a set: graph order keeps the solver's variable order, hence the plan, reproducible
        self.param_nodes = dict.fromkeys(
            n for n in self.graph.nodes if n.name in captured.params or n.name in captured.buffers
        )
        self.requires_grad = gradient_flow(captured)
        self.canon, self.tied_blocks = tie_blocks(captured)
        self.written = {written_operand(n) for n in self.graph.nodes} - {None}
        self.parts = _cut_into_parts(self.graph)
        # values every op must read in one layout: parameters annotated with a compute
        # layout, and views or casts of them (filled in graph order by _compute_pinned)
        self.pinned: dict[torch.fx.Node, Layout] = {}
        for node in self.param_nodes:
            fqn = captured.params.get(node.name)
            if fqn in captured.annotations.compute_layouts:
                self.pinned[node] = captured.annotations.parameter_layouts[fqn]

    def build(self, grad_sum_weight: float) -> StrategyGraph:
        for node in _tensor_nodes(self.graph):
            if node.op == "placeholder":
                if node not in self.param_nodes:
                    self.choices[node] = self._input(node)
                continue
            if node in self.canon:
                self.choices[node] = self.choices[self.canon[node]]
                continue
            self.choices[node] = self._op(node)
        for node in self.param_nodes:
            self.choices[node] = self._param(node)
        self._whole_on_one_device()
        edges = self._edges()
        roots = {c.root: len(c.strategies) for c in self.choices.values() if c.root is not None}
        return StrategyGraph(
            captured=self.captured,
            mesh=self.mesh,
            cost=self.cost,
            choices=self.choices,
            edges=edges,
            roots=roots,
            requires_grad=self.requires_grad,
            fallbacks=self.fallbacks,
            tied_blocks=self.tied_blocks,
            axis_groups=self.groups,
            grad_sum_weight=grad_sum_weight,
        )

    def _whole_on_one_device(self) -> None:
        """Every strategy's layouts with the axes of one device whole (``on_one_device_whole``): a
        group of axes labels its size-1 axes too, and an annotation leaves them whole, so that the
        same tensor would otherwise read as redistributed between them. Tied nodes keep one choice."""
        if all(size > 1 for size in self.mesh.axis_sizes):
            return
        done: dict[int, Choice] = {}
        for node, choice in self.choices.items():
            if id(choice) not in done:
                strategies = [s if s is None else _whole(s, self.mesh) for s in choice.strategies]
                done[id(choice)] = dataclasses.replace(choice, strategies=strategies)
            self.choices[node] = done[id(choice)]

    def _input(self, node: torch.fx.Node) -> Choice:
        # loading an input costs its local bytes once, so of equally good plans the one
        # that splits the batch at the source wins
        fixed = self.fixed_inputs.get(node.name)
        if fixed is None and node in self.written:
            fixed = replicated(self.mesh)  # updated in place: see _param
        layouts = all_layouts(shape_of(node), self.mesh, groups=self.groups) if fixed is None else [fixed]
        val = node.meta["val"]
        load = [
            self.cost.compute_time(
                0.0, val.numel() * val.element_size() * local_fraction(lay, self.mesh), val.dtype
            )
            for lay in layouts
        ]
        return Choice(
            root=node.name if fixed is None else None,
            strategies=[fixed_strategy(lay) for lay in layouts],
            kind=ChoiceKind.INPUT,
            compute=np.array(load),
        )

    def _param(self, node: torch.fx.Node) -> Choice:
        fqn = self.captured.params.get(node.name) or self.captured.buffers.get(node.name)
        fixed = self.captured.annotations.parameter_layouts.get(fqn)
        if fixed is None and node in self.written:
            # updated in place (running statistics): kept whole, so the update is never
            # made to a redistributed copy
            fixed = replicated(self.mesh)
        if fixed is not None:
            if fqn in self.captured.annotations.parameter_rows:
                self._check_lookup_only(node, fqn, self.captured.annotations.parameter_rows[fqn].dim)
            return Choice(root=None, strategies=[fixed_strategy(fixed)], kind=ChoiceKind.FIXED)
        # a parameter of a repeated block shares the choice of its twin in the first block
        for user in node.users:
            twin_user = self.canon.get(user)
            if twin_user is None:
                continue
            slots = [i for i, op in enumerate(OpCall.of(user).operands) if op is node]
            twin = OpCall.of(twin_user).operands[slots[0]] if slots else None
            if twin is not None and twin is not node and twin in self.choices:
                return self.choices[twin]
        # stored in any even layout; its consumers redistribute what they need (a weight
        # stored split and gathered for use is ZeRO-3/FSDP; stored as used, Megatron)
        layouts = all_layouts(shape_of(node), self.mesh, self.parts, uneven=True, groups=self.groups)
        return Choice(
            root=node.name, strategies=[fixed_strategy(lay) for lay in layouts], kind=ChoiceKind.PARAM
        )

    def _check_lookup_only(self, node: torch.fx.Node, fqn: str, dim: int) -> None:
        """A ``ManualSplit`` parameter is a lookup table: only lookups over its split dim read it
        (each rank looks up its own rows; nothing else could use rows of arbitrary counts)."""
        user = non_lookup_use(node, dim)
        if user is not None:
            what = "the model's output" if user.op == "output" else f"op {user.target}"
            raise AnnotationError(
                f"module '{module_path(user) or '<root>'}': {what} "
                f"reads parameter '{fqn}' (shape {shape_of(node)}), which shard(parameter_plan=...) splits "
                f"by ManualSplit on dim {dim}; a ManualSplit table may only be looked up along that dim "
                f"(embedding, index_select, gather), so split this parameter with an axis name instead"
            )

    def _op(self, node: torch.fx.Node) -> Choice:
        if str(node.target) == LAYOUT_CONSTRAINT:
            return self._constraint(node)
        if node.target is operator.getitem:
            src = self.choices[node.args[0]]
            k = node.args[1]
            picked = [
                Strategy(
                    operands=(s.outputs[k],),
                    outputs=(s.outputs[k],),
                    grads=(grad_layout(s.outputs[k]),),
                    choices=(),
                    split=1,
                )
                for s in src.strategies
            ]
            return Choice(root=src.root, strategies=picked, kind=ChoiceKind.GETITEM)
        call = OpCall.of(node)
        spec = spec_of(call)
        if spec is None:
            self.fallbacks.append((str(node.target), module_path(node)))
            spec = fallback(call)
            strategies = self._compute_pinned(call, [_replicated_strategy(spec, self.mesh)])
            return self._priced(call, spec, None, strategies, ChoiceKind.FALLBACK)
        if any(op in self.pinned for op in call.operands):
            pins = [self.pinned[op] for op in call.operands if op in self.pinned]
            strategies = self._compute_pinned(
                call, self._enumerate(call, spec, refine_groups(self.groups, pins))
            )
            return self._priced(call, spec, node.name, strategies, ChoiceKind.ANCHOR)
        primary = self._primary(call, spec)
        # An op outside autograd that broadcasts its operands into a larger output (a mask
        # built from index vectors) decides its own layout: following its small operands,
        # replicated as factories make them, would compute and keep the whole mask on every rank.
        grows = (
            primary is not None
            and not self.requires_grad.get(node, False)
            and max(map(math.prod, call.out_shapes), default=0) > sum(map(math.prod, call.shapes))
        )
        if (lookup(node.target).anchor or primary is None or grows) and spec.shardable():
            strategies = self._enumerate(call, spec)
            if len(strategies) > 1:
                return self._priced(call, spec, node.name, strategies, ChoiceKind.ANCHOR)
        if primary is None:
            return self._priced(call, spec, None, [_replicated_strategy(spec, self.mesh)], ChoiceKind.FOLLOW)
        slot, producer = primary
        src = self.choices[producer]
        cache: dict[Layout, Strategy] = {}
        strategies = []
        for s in src.strategies:
            lay = s.outputs[0]
            if lay not in cache:
                cache[lay] = follow(spec, slot, lay, call.shapes, call.out_shapes, self.mesh)
            strategies.append(cache[lay])
        return self._priced(call, spec, src.root, strategies, ChoiceKind.FOLLOW)

    def _enumerate(self, call: OpCall, spec: DimSpec, groups: AxisGroups | None = None) -> list[Strategy]:
        """The op's strategies over ``groups``, by default the graph's."""
        groups = self.groups if groups is None else groups
        return enumerate_strategies(spec, call.shapes, call.out_shapes, self.mesh, self.parts, groups)

    def _compute_pinned(self, call: OpCall, strategies: list[Strategy]) -> list[Strategy]:
        """The strategies that read every compute-pinned operand in its pinned layout.

        A view or cast of a pinned parameter (its only operand) passes the pin on to its
        output when the kept strategies agree on one output layout. None kept is the
        user's contradiction: an ``AnnotationError`` names the op, the parameter and the
        layouts the op could read it in.
        """
        pins = [(i, self.pinned[op]) for i, op in enumerate(call.operands) if op in self.pinned]
        if not pins:
            return strategies
        kept = [s for s in strategies if all(s.operands[i] in (None, lay) for i, lay in pins)]
        if not kept:
            i, layout = pins[0]
            source = call.operands[i]
            name = self.captured.params.get(source.name, source.name)
            usable = sorted({format_layout(s.operands[i]) for s in strategies if s.operands[i] is not None})
            raise AnnotationError(
                f"module '{module_path(call.node) or '<root>'}': op {call.node.target} reads parameter "
                f"'{name}' (shape {shape_of(source)}), whose shard(parameter_plan=...) layout "
                f"{format_layout(layout)} is the layout its ops compute with, but this op can read it only "
                f"as {usable or ['R' * self.mesh.ndim]}; give one of those, or pin only its storage with "
                "shard(parameter_storage=...)"
            )
        outputs = {s.outputs[0] for s in kept}
        if len(call.operands) == 1 and len(outputs) == 1:
            self.pinned[call.node] = outputs.pop()
        return kept

    def _constraint(self, node: torch.fx.Node) -> Choice:
        layout, _ = parse_constraint_spec(node.args[1])
        if layout is None:  # a free choice point: any layout, the solver picks
            options = all_layouts(shape_of(node), self.mesh, groups=self.groups)
            return Choice(
                root=node.name,
                strategies=[fixed_strategy(lay, operands=1) for lay in options],
                kind=ChoiceKind.ANCHOR,
            )
        return Choice(root=None, strategies=[fixed_strategy(layout, operands=1)], kind=ChoiceKind.FIXED)

    def _primary(self, call: OpCall, spec: DimSpec) -> tuple[int, torch.fx.Node] | None:
        """The operand a cheap op follows: the largest one that is not a parameter."""
        best = None
        for i, op in enumerate(call.operands):
            if spec.operands[i] is None or op in self.param_nodes or op not in self.choices:
                continue
            if best is None or _numel(op) > _numel(best[1]):
                best = (i, op)
        return best

    def _priced(
        self, call: OpCall, spec: DimSpec, root: str | None, strategies: list[Strategy], kind: ChoiceKind
    ) -> Choice:
        """The choice of an op, with the seconds of its compute under each strategy
        (:meth:`CostModel.op_time`; none for an op that returns its operand's own memory)."""
        node = call.node
        out_vals = output_values(node)
        dtype = out_vals[0].dtype if out_vals else torch.float32
        itemsize = out_vals[0].element_size() if out_vals else 4
        moved = itemsize * sum(math.prod(s) for s in (*call.shapes, *call.out_shapes))
        grad, free = self.requires_grad.get(node, False), computes_nothing(node)
        whole = (
            0.0
            if free
            else self.cost.op_time(
                spec.flops, moved, dtype, spec.transcendentals, grad, spec.function, spec.attention
            )
        )
        costs = [whole / s.split for s in strategies]  # the roofline scales with its arguments
        return Choice(root=root, strategies=strategies, kind=kind, compute=np.array(costs))

    def _edges(self) -> list[Edge]:
        edges = []
        # model outputs are consumers too: a Partial output is reduced to Replicate
        out = next(n for n in self.graph.nodes if n.op == "output")
        returned = [a for a in torch.utils._pytree.tree_leaves(out.args) if a in self.choices]
        if returned:
            self.choices[out] = Choice(root=None, strategies=[None], kind=ChoiceKind.OUTPUT)
        for slot, op in enumerate(returned):
            edges.append(Edge(src=op, dst=out, slot=slot, index=0))
        for node, choice in self.choices.items():
            if node.op != "call_function":
                continue
            if choice.kind == ChoiceKind.GETITEM:
                edges.append(Edge(src=node.args[0], dst=node, slot=0, index=node.args[1]))
                continue
            for slot, op in enumerate(OpCall.of(node).operands):
                if op in self.choices and choice.strategies[0].operands[slot] is not None:
                    edges.append(Edge(src=op, dst=node, slot=slot, index=0))
        return edges


def build_strategy_graph(
    captured: Captured,
    mesh: MeshSpec,
    cost: CostModel,
    fixed_inputs: Mapping[str, Layout] | None = None,
    *,
    grad_sum_weight: float = 1.0,
    groups: AxisGroups | None = None,
) -> StrategyGraph:
    """See the module docstring; ``fixed_inputs`` pins the layouts of some user inputs (by
    placeholder); ``grad_sum_weight`` is the share of a parameter's gradient sum one
    microbatch pays (``1/m`` with ``m`` microbatches); ``groups`` plans the axes of each group
    together (``autopar.planning.graph.axis_groups``)."""
    return _Builder(captured, mesh, cost, fixed_inputs or {}, groups).build(grad_sum_weight)
