"""The planner: from a captured graph to per-node strategy choices and their costs.

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
  share the strategies, hence the variables, of the first such block.

Costs are in seconds: a node's compute under each choice (forward, plus backward as
twice the forward when a gradient flows), and for each edge the redistribution of
the producer's output into the layout the consumer needs plus, in backward, of the
consumer's gradient into the layout the producer's gradient must have.
"""

from __future__ import annotations

import math
import operator
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.capture.annotations import parse_constraint_spec
from autopar.capture.export import (
    Captured,
    capture,
    gradient_flow,
    module_path,
    module_stack,
    repeated_blocks,
)
from autopar.ir.errors import PlanError
from autopar.ir.layout import (
    Layout,
    format_layout,
    grad_layout,
    is_valid_for,
    local_fraction,
    replicated,
)
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import GRADS, LAYOUTS
from autopar.ir.ops import LAYOUT_CONSTRAINT, is_selective_save
from autopar.ir.options import FULL, SELECTIVE, Memory, Pipeline
from autopar.ir.plan import (
    Alternative,
    CollectiveStep,
    MemoryPlan,
    NodeDecision,
    Plan,
    Prediction,
    Redistribution,
    SolverReport,
)
from autopar.ir.printing import format_graph
from autopar.planning.activations import saved_by
from autopar.planning.cost import Cluster, Collective, CostModel, get_cluster
from autopar.planning.gradient_sums import planned_edges
from autopar.planning.memory import (
    activation_memory,
    largest_operand,
    regions_of,
    source_of,
    state_bytes,
    storage_of,
    with_split,
    zero_split,
)
from autopar.planning.pipeline import PipelineFitError, microbatch, plan_pipeline
from autopar.planning.solver import StrategyILP
from autopar.rules import DimSpec, OpCall, Strategy, enumerate_strategies, fallback, follow, lookup, shape_of

_BLOCK = re.compile(r"^(.*)\.(\d+)$")
_FREE_OPS = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten.sym_size.int"}


@dataclass
class Choice:
    """The strategies of one node (or of a group of tied nodes, which share it)."""

    root: str | None  # variable key; None = a single fixed strategy
    strategies: list[Strategy]  # [None] for the graph's output node, which needs no strategy
    kind: str  # anchor, follow, input, param, fixed, fallback, getitem, output
    spec: DimSpec | None = None
    compute: np.ndarray | None = None  # seconds per strategy


@dataclass
class Edge:
    """A tensor flowing from ``src`` output ``index`` into operand ``slot`` of ``dst``."""

    src: torch.fx.Node
    dst: torch.fx.Node
    slot: int
    index: int


@dataclass
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
    # parameters' gradient sums happen once per step: with m microbatches, 1/m of a microbatch's cost
    grad_sum_weight: float = 1.0

    def strategy(self, node: torch.fx.Node, assignment: dict[str, int]) -> Strategy:
        c = self.choices[node]
        return c.strategies[assignment[c.root] if c.root is not None else 0]


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


def all_layouts(shape: tuple[int, ...], mesh: MeshSpec) -> list[Layout]:
    """Every even layout of a tensor: each mesh axis replicates or splits one dimension,
    no dimension split over two axes (see ``rules.enumerate_strategies``)."""
    options = [Replicate(), *(Shard(d) for d in range(len(shape)))]
    out = []
    for combo in _product(options, mesh.ndim):
        dims = [p.dim for p in combo if isinstance(p, Shard)]
        if is_valid_for(combo, shape, mesh) and len(dims) == len(set(dims)):
            out.append(combo)
    return out


def _product(options: list, n: int) -> Iterable[tuple]:
    if n == 0:
        yield ()
        return
    for rest in _product(options, n - 1):
        for o in options:
            yield (*rest, o)


def _fixed(layout: Layout, operands: int = 0) -> Strategy:
    return Strategy(
        tuple(layout for _ in range(operands)),
        (layout,),
        tuple(grad_layout(layout) for _ in range(operands)),
        (),
        1,
    )


class _Builder:
    def __init__(
        self, captured: Captured, mesh: MeshSpec, cost: CostModel, fixed_inputs: Mapping[str, Layout]
    ) -> None:
        self.captured = captured
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
        self.canon, self.tied_blocks = self._tie_blocks()

    # --- gradients ---------------------------------------------------------------
    # --- repeated blocks ---------------------------------------------------------
    def _block_of(self, node: torch.fx.Node) -> tuple[str, int] | None:
        for path in module_stack(node):
            m = _BLOCK.match(path)
            if m:
                return m.group(1), int(m.group(2))
        return None

    def _tie_blocks(self) -> tuple[dict[torch.fx.Node, torch.fx.Node], int]:
        blocks: dict[tuple[str, int], list[torch.fx.Node]] = {}
        for node in self.graph.nodes:
            if node.op == "call_function" and (key := self._block_of(node)) is not None:
                blocks.setdefault(key, []).append(node)
        fixed = self.captured.annotations.parameter_layouts
        canon: dict[torch.fx.Node, torch.fx.Node] = {}
        first: dict[tuple, list[torch.fx.Node]] = {}
        tied = 0
        for (prefix, _), nodes in blocks.items():
            index = {n: i for i, n in enumerate(nodes)}

            def token(a, index=index):
                if isinstance(a, torch.fx.Node):
                    if a in index:
                        return ("in", index[a])
                    fqn = self.captured.params.get(a.name) or self.captured.buffers.get(a.name)
                    layout = fixed.get(fqn) if fqn else None
                    return (
                        "ext",
                        shape_of(a) if isinstance(a.meta.get("val"), torch.Tensor) else None,
                        str(layout),
                    )
                if isinstance(a, str) and a.startswith("{"):
                    return parse_constraint_spec(a)[0]
                return a

            signature = (
                prefix,
                tuple(
                    (
                        str(n.target),
                        torch.utils._pytree.tree_map(token, (n.args, n.kwargs)),
                        str(
                            [
                                tuple(v.shape)
                                for v in torch.utils._pytree.tree_leaves(n.meta.get("val"))
                                if isinstance(v, torch.Tensor)
                            ]
                        ),
                    )
                    for n in nodes
                ),
            )
            if signature in first:
                canon.update(zip(nodes, first[signature]))
                tied += 1
            else:
                first[signature] = nodes
        return canon, tied

    # --- strategies ----------------------------------------------------------------
    def build(self) -> StrategyGraph:
        for node in _tensor_nodes(self.graph):
            if node.op == "placeholder":
                if node not in self.param_nodes:
                    self._input(node)
                continue
            if node in self.canon:
                self.choices[node] = self.choices[self.canon[node]]
                continue
            self.choices[node] = self._op(node)
        for node in self.param_nodes:
            self.choices[node] = self._param(node)
        edges = self._edges()
        roots = {c.root: len(c.strategies) for c in self.choices.values() if c.root is not None}
        return StrategyGraph(
            self.captured,
            self.mesh,
            self.cost,
            self.choices,
            edges,
            roots,
            self.requires_grad,
            self.fallbacks,
            self.tied_blocks,
        )

    def _input(self, node: torch.fx.Node) -> None:
        # loading an input costs its local bytes once, so of equally good plans the one
        # that splits the batch at the source wins
        fixed = self.fixed_inputs.get(node.name)
        layouts = all_layouts(shape_of(node), self.mesh) if fixed is None else [fixed]
        val = node.meta["val"]
        load = [
            self.cost.compute_time(
                0.0, val.numel() * val.element_size() * local_fraction(lay, self.mesh), val.dtype
            )
            for lay in layouts
        ]
        root = node.name if fixed is None else None
        self.choices[node] = Choice(root, [_fixed(lay) for lay in layouts], "input", compute=np.array(load))

    def _param(self, node: torch.fx.Node) -> Choice:
        fqn = self.captured.params.get(node.name) or self.captured.buffers.get(node.name)
        fixed = self.captured.annotations.parameter_layouts.get(fqn)
        if fixed is not None:
            return Choice(None, [_fixed(fixed)], "fixed")
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
        layouts = all_layouts(shape_of(node), self.mesh)
        return Choice(node.name, [_fixed(lay) for lay in layouts], "param")

    def _op(self, node: torch.fx.Node) -> Choice:
        if str(node.target) == LAYOUT_CONSTRAINT:
            layout, _ = parse_constraint_spec(node.args[1])
            if layout is None:  # a free choice point: any layout, the solver picks
                options = all_layouts(shape_of(node), self.mesh)
                return Choice(node.name, [_fixed(lay, operands=1) for lay in options], "anchor")
            return Choice(None, [_fixed(layout, operands=1)], "fixed")
        if node.target is operator.getitem:
            src = self.choices[node.args[0]]
            k = node.args[1]
            return Choice(
                src.root,
                [
                    Strategy((s.outputs[k],), (s.outputs[k],), (grad_layout(s.outputs[k]),), (), 1)
                    for s in src.strategies
                ],
                "getitem",
            )
        call = OpCall.of(node)
        rule = lookup(node.target)
        spec = None
        if rule is not None:
            try:
                spec = rule.fn(call)
            except Exception:  # noqa: BLE001 - an unforeseen call form of a known op
                spec = None
        if spec is None:
            self.fallbacks.append((str(node.target), module_path(node)))
            spec = fallback(call)
            return self._with_compute(
                Choice(None, [_replicated_strategy(spec, self.mesh)], "fallback", spec), call
            )
        primary = self._primary(call, spec)
        if (rule.anchor or primary is None) and spec.shardable():
            strategies = enumerate_strategies(spec, call.shapes, call.out_shapes, self.mesh)
            if len(strategies) > 1:
                return self._with_compute(Choice(node.name, strategies, "anchor", spec), call)
        if primary is None:
            return self._with_compute(
                Choice(None, [_replicated_strategy(spec, self.mesh)], "follow", spec), call
            )
        slot, producer = primary
        src = self.choices[producer]
        index = 0
        cache: dict[Layout, Strategy] = {}
        strategies = []
        for s in src.strategies:
            lay = s.outputs[index]
            if lay not in cache:
                cache[lay] = follow(spec, slot, lay, call.shapes, call.out_shapes, self.mesh)
            strategies.append(cache[lay])
        return self._with_compute(Choice(src.root, strategies, "follow", spec), call)

    def _primary(self, call: OpCall, spec: DimSpec) -> tuple[int, torch.fx.Node] | None:
        """The operand a cheap op follows: the largest one that is not a parameter."""
        best = None
        for i, op in enumerate(call.operands):
            if spec.operands[i] is None or op in self.param_nodes or op not in self.choices:
                continue
            if best is None or _numel(op) > _numel(best[1]):
                best = (i, op)
        return best

    def _with_compute(self, choice: Choice, call: OpCall) -> Choice:
        spec = choice.spec
        node = call.node
        out_vals = [
            v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)
        ]
        dtype = out_vals[0].dtype if out_vals else torch.float32
        itemsize = out_vals[0].element_size() if out_vals else 4
        total_bytes = itemsize * (
            sum(math.prod(s) for s in call.shapes) + sum(math.prod(s) for s in call.out_shapes)
        )
        backward = 3.0 if self.requires_grad.get(node, False) else 1.0
        costs = []
        for s in choice.strategies:
            costs.append(
                backward * self.cost.compute_time(spec.flops / s.split, total_bytes / s.split, dtype)
            )
        choice.compute = np.array(costs)
        return choice

    # --- edges -----------------------------------------------------------------
    def _edges(self) -> list[Edge]:
        edges = []
        # model outputs are consumers too: a Partial output is reduced to Replicate
        out = next(n for n in self.graph.nodes if n.op == "output")
        returned = [a for a in torch.utils._pytree.tree_leaves(out.args) if a in self.choices]
        if returned:
            self.choices[out] = Choice(None, [None], "output")
        for slot, op in enumerate(returned):
            edges.append(Edge(op, out, slot, 0))
        for node, choice in self.choices.items():
            if node.op != "call_function":
                continue
            if choice.kind == "getitem":
                edges.append(Edge(node.args[0], node, 0, node.args[1]))
                continue
            for slot, op in enumerate(OpCall.of(node).operands):
                if op in self.choices and choice.strategies[0].operands[slot] is not None:
                    edges.append(Edge(op, node, slot, 0))
        return edges


def _replicated_strategy(spec: DimSpec, mesh: MeshSpec) -> Strategy:
    rep = replicated(mesh)
    return Strategy(
        tuple(None if labels is None else rep for labels in spec.operands),
        tuple(rep for _ in spec.outputs),
        tuple(None if labels is None else rep for labels in spec.operands),
        (None,) * mesh.ndim,
        1,
    )


def build_strategy_graph(
    captured: Captured, mesh: MeshSpec, cost: CostModel, fixed_inputs: Mapping[str, Layout] | None = None
) -> StrategyGraph:
    """See the module docstring; ``fixed_inputs`` pins the layouts of some user inputs (by placeholder)."""
    return _Builder(captured, mesh, cost, fixed_inputs or {}).build()


# --- edge costs ---------------------------------------------------------------------


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


def edge_cost(g: StrategyGraph, edge: Edge, src: Strategy, dst: Strategy | None) -> tuple[float, list, list]:
    """Seconds and collectives (forward, backward) of one edge under two strategies."""
    val = edge.src.meta["val"]
    val = val[edge.index] if isinstance(val, (tuple, list)) else val
    shape, itemsize = tuple(int(s) for s in val.shape), val.element_size()
    have, need, grad = edge_layouts(edge, src, dst)
    fwd, t_fwd = g.cost.redistribute(have, need, shape, itemsize)
    bwd, t_bwd = (), 0.0
    if (
        edge.src.name in g.captured.params
        and have == need
        and grad is not None
        and g.requires_grad.get(edge.src)
    ):
        # a parameter's gradient sum waits for the runtime's buckets: bandwidth only
        bwd, _ = g.cost.backward(have, need, grad, grad_layout(have), shape, itemsize)
        bucketed = sum(g.cost.collective_time(c, latency=False) for c in bwd)
        return t_fwd + g.grad_sum_weight * bucketed, list(fwd), list(bwd)
    if g.requires_grad.get(edge.src, False) and grad is not None:
        bwd, t_bwd = g.cost.backward(have, need, grad, grad_layout(have), shape, itemsize)
    return t_fwd + t_bwd, list(fwd), list(bwd)


def cost_tables(g: StrategyGraph) -> tuple[dict[str, np.ndarray], dict[tuple[str, str], np.ndarray], float]:
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
        cs, cd = g.choices[e.src], g.choices[e.dst]
        key = (id(cs), id(cd), e.slot, e.index)
        m = cache.get(key)
        if m is None:
            if cs.root is not None and cs.root == cd.root:
                m = np.array([edge_cost(g, e, a, b)[0] for a, b in zip(cs.strategies, cd.strategies)])
            else:
                m = np.array([[edge_cost(g, e, a, b)[0] for b in cd.strategies] for a in cs.strategies])
            cache[key] = m
        if cs.root is None and cd.root is None:
            constant += float(m[0, 0])
        elif cs.root is not None and cs.root == cd.root:
            node_costs[cs.root] += m
        elif cs.root is None:
            node_costs[cd.root] += m[0]
        elif cd.root is None:
            node_costs[cs.root] += m[:, 0]
        else:
            key2 = (cs.root, cd.root)
            pair_costs[key2] = pair_costs.get(key2, 0) + m
    return node_costs, pair_costs, constant


def local_bytes(node: torch.fx.Node, layout: Layout, mesh: MeshSpec, index: int = 0) -> float:
    val = node.meta["val"]
    val = val[index] if isinstance(val, (tuple, list)) else val
    return val.numel() * val.element_size() * local_fraction(layout, mesh)


# --- the public entry ------------------------------------------------------------------


def plan(
    model: torch.nn.Module,
    example_args: Any,
    mesh: MeshSpec | Mapping[str, int] | Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    cluster: str | Cluster | None = None,
    time_limit: float = 30.0,
    seed: int = 0,
    pipeline: Pipeline | None = None,
    memory: Memory | None = None,
    memory_budget: float | None = None,
) -> Plan:
    """Plan ``model`` for ``mesh``: capture, read annotations, solve, report.

    ``mesh`` is a ``{axis: size}`` mapping, a :class:`MeshSpec` or a named
    ``DeviceMesh``; no process group is needed. ``cluster`` is a preset name
    (default ``"cpu-gloo"``) or a :class:`Cluster`. ``time_limit`` bounds the
    solver in deterministic seconds (about wall seconds on one core); with the same
    ``seed`` every call, on every rank, returns the same plan. ``pipeline`` runs a
    pipeline over one mesh axis (see :mod:`autopar.planning.pipeline`); the example inputs are
    the whole batch. ``memory`` sets ZeRO, the optimizer's state and offload
    (:class:`~autopar.planning.memory.Memory`); ``memory_budget`` (bytes per device) makes the
    planner choose sharding, the ZeRO stage and recompute so that the plan fits, or
    raise :class:`~autopar.ir.errors.PlanError` with the least memory it could reach.
    """
    mesh = MeshSpec.of(mesh)
    t0 = time.perf_counter()
    captured = capture_for(model, example_args, example_kwargs, mesh, pipeline)
    return plan_captured(
        captured,
        mesh,
        cluster=cluster,
        time_limit=time_limit,
        seed=seed,
        capture_s=time.perf_counter() - t0,
        pipeline=pipeline,
        memory=memory,
        memory_budget=memory_budget,
    )


def layout_mesh(mesh: MeshSpec, pipeline: Pipeline | None) -> MeshSpec:
    """The mesh layouts refer to: ``mesh`` itself, or one stage's mesh under a pipeline."""
    if pipeline is not None:
        return pipeline.stage_mesh(mesh)
    if "pp" in mesh.axis_names:
        raise PlanError(
            f"mesh {mesh} has an axis named 'pp', the pipeline axis: pass "
            f"pipeline=autopar.Pipeline(microbatches=...) to pipeline over it, or rename the axis"
        )
    return mesh


def capture_for(
    model: torch.nn.Module,
    example_args: Any,
    example_kwargs: Mapping[str, Any] | None,
    mesh: MeshSpec,
    pipeline: Pipeline | None,
) -> Captured:
    """Capture ``model`` for planning on ``mesh``: one microbatch of the example under a pipeline."""
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    if pipeline is not None:
        args, kwargs = microbatch(args, kwargs, pipeline.microbatches)
    return capture(model, args, kwargs, layout_mesh(mesh, pipeline))


def plan_captured(
    captured: Captured,
    mesh: MeshSpec,
    *,
    cluster: str | Cluster | None = None,
    time_limit: float = 30.0,
    seed: int = 0,
    capture_s: float = 0.0,
    pipeline: Pipeline | None = None,
    fixed_inputs: Mapping[str, Layout] | None = None,
    memory: Memory | None = None,
    memory_budget: float | None = None,
) -> Plan:
    """:func:`plan` for a model captured by :func:`capture_for` (``autopar.compile`` captures once).

    ``fixed_inputs`` pins the layouts of user inputs by placeholder name (a loss
    compiled for a model's outputs takes them as they come). The budget is
    ``memory_budget`` or the cluster's memory. The fastest plan of the first candidate of
    :func:`memory_choices` wins if it fits; otherwise every candidate is solved with the
    memory constraint and the fastest plan that fits wins, the earlier on a tie.
    """
    cluster = get_cluster(cluster or "cpu-gloo") if not isinstance(cluster, Cluster) else cluster
    memory = memory or Memory()
    if memory_budget is not None and memory_budget <= 0:
        raise PlanError(f"memory_budget is bytes per device and must be positive, got {memory_budget}")
    if pipeline is not None and memory.offload_activations:
        raise PlanError(
            "Memory(offload_activations=True) is not supported with a pipeline (its stages keep "
            "activations per microbatch on the device); use recompute or ZeRO instead"
        )
    t1 = time.perf_counter()
    stage_mesh = layout_mesh(mesh, pipeline)
    g = build_strategy_graph(captured, stage_mesh, CostModel(stage_mesh, cluster), fixed_inputs)
    if pipeline is not None:
        g.grad_sum_weight = 1.0 / pipeline.microbatches
    tables = cost_tables(g)
    build_s = time.perf_counter() - t1
    budget = memory_budget if memory_budget is not None else cluster.memory_bytes
    choices = memory_choices(captured, memory)

    def solve(choice: MemoryChoice, constrained: bool) -> Plan | None:
        return _solve_choice(
            g, tables, choice, memory, budget, constrained, cluster, pipeline, mesh, time_limit, seed
        )

    # the first candidate without the memory constraint is the fastest plan of all: if it fits, it wins
    best = solve(choices[0], constrained=False)
    if best is None:
        for choice in choices:
            found = solve(choice, constrained=True)
            if found is not None and (best is None or _step_time(found) < _step_time(best)):
                best = found
        if best is not None and memory.zero is None:
            best.memory = replace(best.memory, chosen=True)
    if best is None:
        raise PlanError(_no_fit(g, tables, choices, memory, budget, cluster, pipeline, mesh, seed))
    best.solver = replace(best.solver, capture_s=capture_s, build_s=best.solver.build_s + build_s)
    if pipeline is None and captured.annotations.stages:
        best.warnings.append("pipeline_stage annotations are ignored: the plan has no pipeline")
    return best


@dataclass(frozen=True)
class MemoryChoice:
    """One candidate of the memory search: a ZeRO stage and the modules recomputed (path -> policy)."""

    zero: int
    recompute: Mapping[str, str]


def memory_choices(captured: Captured, memory: Memory) -> list[MemoryChoice]:
    """The candidates, the options as given first and least memory last: every ZeRO stage
    (unless ``memory.zero`` fixes one) with the annotated recompute or, when no module is
    annotated ``recompute``, no / selective / full recompute of every repeated block."""
    annotated = dict(captured.annotations.recompute)
    zeros = [memory.zero] if memory.zero is not None else [0, 1, 2, 3]
    recomputes: list[Mapping[str, str]] = [annotated]
    blocks = repeated_blocks(captured.graph)
    if not annotated and blocks:
        recomputes += [dict.fromkeys(blocks, SELECTIVE), dict.fromkeys(blocks, FULL)]
    return [MemoryChoice(z, r) for r in recomputes for z in zeros]


def _step_time(p: Plan) -> float:
    return p.pipeline.step_time_s if p.pipeline is not None else p.prediction.step_time_s


def _peak_bytes(p: Plan) -> float:
    if p.pipeline is not None:
        return max(s.memory_bytes for s in p.pipeline.stages)
    return p.prediction.memory_bytes


def _solve_choice(
    g: StrategyGraph,
    tables: tuple[dict[str, np.ndarray], dict[tuple[str, str], np.ndarray], float],
    choice: MemoryChoice,
    memory: Memory,
    budget: float,
    constrained: bool,
    cluster: Cluster,
    pipeline: Pipeline | None,
    mesh: MeshSpec,
    time_limit: float,
    seed: int,
) -> Plan | None:
    """The fastest plan under ``choice`` that fits ``budget``, or None.

    ``constrained`` puts the budget into the ILP. Its memory estimate is per node (see
    :func:`memory_tables`); the plan's figure is exact (:mod:`autopar.planning.memory`). Where it
    exceeds the budget, the ILP's limit is lowered by the difference and solved again
    (twice at most). Under a pipeline the budget bounds each stage (the ILP does not see
    microbatches in flight).
    """
    node_costs, pair_costs, constant = tables
    extra, extra_constant, mem, mem_constant = memory_tables(g, choice, memory)
    costs = {r: c + extra[r] for r, c in node_costs.items()}
    limit = budget if pipeline is None and constrained else None
    for _ in range(3):
        ilp = StrategyILP(costs, pair_costs, constant + extra_constant, (mem, mem_constant), limit)
        solved = ilp.solve(time_limit=time_limit, seed=seed)
        if solved is None:
            return None
        assignment, stats = solved
        report = SolverReport(
            variables=stats.variables,
            constraints=stats.constraints,
            roots=len(g.roots),
            tied_blocks=g.tied_blocks,
            capture_s=0.0,
            build_s=stats.build_seconds,
            solve_s=stats.solve_seconds,
            gap=stats.gap,
            status=stats.status,
        )
        try:
            result = assemble_plan(g, assignment, report, cluster, memory, choice, budget, pipeline, mesh)
        except PipelineFitError:  # no split of the model into stages fits the budget
            return None
        result.alternatives = alternatives(g, costs, pair_costs, assignment)
        if _peak_bytes(result) <= budget or limit is None:
            return result if _peak_bytes(result) <= budget else None
        limit -= _peak_bytes(result) - budget
    return None


def alternatives(
    g: StrategyGraph,
    node_costs: dict[str, np.ndarray],
    pair_costs: dict[tuple[str, str], np.ndarray],
    assignment: dict[str, int],
) -> dict[str, list[Alternative]]:
    """Every variable's strategies, each priced by the variable's terms of the objective with
    every other variable as assigned (what ``autopar explain`` shows)."""
    local = {r: c.astype(float).copy() for r, c in node_costs.items()}
    for (u, v), m in pair_costs.items():
        local[u] += m[:, assignment[v]]
        local[v] += m[assignment[u], :]
    owner = {c.root: node for node, c in g.choices.items() if c.root is not None and c.root == node.name}
    out = {}
    for r, seconds in local.items():
        strategies = g.choices[owner[r]].strategies if r in owner else []
        out[r] = [
            Alternative(
                tuple(None if o is None else format_layout(o) for o in st.operands),
                tuple(format_layout(o) for o in st.outputs),
                float(seconds[i]),
                i == assignment[r],
            )
            for i, st in enumerate(strategies)
        ]
    return out


def _no_fit(
    g: StrategyGraph,
    tables: tuple,
    choices: list[MemoryChoice],
    memory: Memory,
    budget: float,
    cluster: Cluster,
    pipeline: Pipeline | None,
    mesh: MeshSpec,
    seed: int,
) -> str:
    """The error when no plan fits: the least memory reached and what dominates it.

    Candidates: every choice's fastest plan, and the last (least memory) choice's plan
    minimising the ILP's memory estimate; the least exact figure among them is reported.
    """
    node_costs, pair_costs, constant = tables
    report = SolverReport(0, 0, len(g.roots), g.tied_blocks, 0.0, 0.0, 0.0, 0.0, "MIN_MEMORY")
    tried = []
    for choice in choices:
        extra, extra_constant, mem, mem_constant = memory_tables(g, choice, memory)
        costs = {r: c + extra[r] for r, c in node_costs.items()}
        ilp = StrategyILP(costs, pair_costs, constant + extra_constant, (mem, mem_constant))
        assignments = [ilp.solve(seed=seed)[0]]
        if choice is choices[-1]:
            assignments.append(ilp.minimum_memory(seed=seed)[0])
        for assignment in assignments:
            plan = assemble_plan(g, assignment, report, cluster, memory, choice, None, pipeline, mesh)
            tried.append((_peak_bytes(plan), plan, choice))
    peak, least, choice = min(tried, key=lambda t: t[0])
    p = least.prediction
    parts = {
        "parameters": p.param_bytes,
        "gradients": p.grad_bytes,
        "optimizer state": p.optimizer_bytes,
        "activations": p.activation_bytes,
    }
    top = max(parts, key=parts.get)
    how = f"ZeRO-{choice.zero}" + (
        f", recompute of {len(choice.recompute)} modules ({next(iter(choice.recompute.values()))})"
        if choice.recompute
        else ""
    )
    breakdown = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items())
    return (
        f"no plan fits memory_budget={budget / 2**30:.2f} GiB per device on mesh {g.mesh}: the least "
        f"memory reached is {peak / 2**30:.2f} GiB ({how}; {breakdown}), dominated by {top}; "
        f"use more devices, a smaller batch, or offload"
    )


def memory_tables(
    g: StrategyGraph, choice: MemoryChoice, memory: Memory
) -> tuple[dict[str, np.ndarray], float, dict[str, np.ndarray], float]:
    """Per root and strategy, the seconds ``choice`` adds and the bytes per device it holds; and constants.

    Seconds: ZeRO-1 all-gathers the updated shard after the step, ZeRO-3 gathers again
    in backward (ZeRO-2's reduce-scatter and all-gather cost what the all-reduce does);
    recomputed ops run their forward again. Bytes: each parameter's state
    (:func:`~autopar.planning.memory.state_bytes`, split over the axes it is replicated on),
    and each op's saved values in the layouts of its strategy, each value counted at
    its first saver; inside a recompute region only what the region keeps, plus the
    first region's own values (the one being recomputed). The plan's figure is exact;
    this is the linear estimate the ILP constrains.
    """
    mesh = g.mesh
    seconds = {r: np.zeros(k) for r, k in g.roots.items()}
    nbytes = {r: np.zeros(k) for r, k in g.roots.items()}
    constants = [0.0, 0.0]

    def add(table: dict[str, np.ndarray], which: int, c: Choice, values: np.ndarray) -> None:
        if c.root is None:
            constants[which] += float(values[0])
        else:
            table[c.root] += values

    state = {**g.captured.params, **g.captured.buffers}
    for node, c in g.choices.items():
        if node.name not in state:
            continue
        grad = node.name in g.captured.params and bool(g.requires_grad.get(node))
        itemsize = node.meta["val"].element_size()
        held, extra = [], []
        for s in c.strategies:
            layout = s.outputs[0]
            local = local_bytes(node, layout, mesh)
            axes = [a for a, p in enumerate(layout) if isinstance(p, Replicate)] if grad else []
            split = (
                zero_split(shape_of(node), layout, axes, mesh, itemsize, memory.zero_threshold)
                if choice.zero
                else None
            )
            n = mesh.axis_sizes[split[0]] if split else 1
            b = state_bytes(local, itemsize, n, choice.zero, memory, grad)
            held.append(b.param + b.grad + b.optimizer)
            extra.append(_zero_seconds(g, choice.zero, split, local))
        add(nbytes, 1, c, np.array(held))
        add(seconds, 0, c, np.array(extra))
    regions = regions_of(g.captured.graph, choice.recompute)
    first = next((name for name, _ in regions.values()), None)
    claimed: set[object] = set()  # storages already counted
    for node in g.captured.graph.nodes:
        c = g.choices.get(node)
        if c is None or node.op != "call_function" or c.kind in ("getitem", "output"):
            continue
        call = OpCall.of(node)
        spec = saved_by(node, [bool(g.requires_grad.get(op)) for op in call.operands])
        region = regions.get(node)
        matmul = is_selective_save(node.target)
        items = []  # (operand or output, index, global bytes, kept)
        for i in spec.inputs:
            src, index = source_of(call.operands[i])
            storage, size = storage_of(src, index)
            if src.op == "placeholder" or storage in claimed:
                continue
            claimed.add(storage)
            kept = region is None or regions.get(src, (None,))[0] != region[0]
            items.append(("operand", i, size, kept))
        for j in spec.outputs:
            storage, size = storage_of(node, j)
            if storage not in claimed:
                claimed.add(storage)
                kept = region is None or (region[1] == SELECTIVE and matmul)
                items.append(("output", j, size, kept))
        if spec.extra_bytes:
            largest = largest_operand(call)
            which = ("operand", largest) if largest is not None else ("output", 0)
            items.append((*which, float(spec.extra_bytes), region is None))
        weights = [1.0 if kept or (region is not None and region[0] == first) else 0.0 for *_, kept in items]
        values = []
        for s in c.strategies:
            total = 0.0
            for (which, index, size, _), w in zip(items, weights):
                layout = (s.operands if which == "operand" else s.outputs)[index]
                total += 0.0 if layout is None else w * size * local_fraction(layout, mesh)
            values.append(total)
        add(nbytes, 1, c, np.array(values))
        if region is not None and g.requires_grad.get(node) and c.compute is not None:
            if region[1] == FULL or not matmul:
                add(seconds, 0, c, c.compute / 3.0)  # forward again: a third of forward + backward
    return seconds, constants[0], nbytes, constants[1]


def _zero_seconds(g: StrategyGraph, zero: int, split: tuple[int, int] | None, local: float) -> float:
    """Seconds ZeRO adds for one parameter: an all-gather of its shard (ZeRO-1 after the step,
    ZeRO-3 again in backward); ZeRO-2 trades the all-reduce for a reduce-scatter and an all-gather."""
    if split is None or zero not in (1, 3):
        return 0.0
    axis = g.mesh.axis_names[split[0]]
    shard = int(local / g.mesh.axis_sizes[split[0]])
    return g.grad_sum_weight * g.cost.collective_time(Collective("all_gather", (axis,), shard), latency=False)


def zero_splits(
    g: StrategyGraph, assignment: dict[str, int], memory: Memory
) -> dict[torch.fx.Node, tuple[int, int]]:
    """Each parameter ZeRO may split: ``(mesh axis, dim)`` (see :func:`~autopar.planning.memory.zero_split`).

    The axes a parameter's gradient is summed over are those the compiled program sums
    (:func:`~autopar.planning.gradient_sums.planned_edges`) under the assignment.
    """
    _lay_out(g, assignment)
    state = set(g.captured.params) | set(g.captured.buffers)
    _, summed = planned_edges(g.captured.graph, state, g.requires_grad, g.mesh.ndim)
    splits = {}
    for node in g.captured.graph.nodes:  # graph order: every rank lists the splits alike
        axes = summed.get(node)
        if axes and node.name in g.captured.params:
            layout = g.strategy(node, assignment).outputs[0]
            itemsize = node.meta["val"].element_size()
            split = zero_split(shape_of(node), layout, axes, g.mesh, itemsize, memory.zero_threshold)
            if split is not None:
                splits[node] = split
    return splits


def _lay_out(g: StrategyGraph, assignment: dict[str, int]) -> None:
    """The chosen layouts onto the captured graph's nodes (``autopar.layouts``, ``autopar.grads``)."""
    for node, choice in g.choices.items():
        if choice.kind != "output":
            s = g.strategy(node, assignment)
            node.meta[LAYOUTS] = (s.operands, s.outputs)
            node.meta[GRADS] = s.grads


def recompute_regions(
    graph: torch.fx.Graph,
    recompute: Mapping[str, str],
    gathered: Iterable[torch.fx.Node],
) -> dict[torch.fx.Node, tuple[str, str]]:
    """Each recomputed op: ``(region, policy)``. Regions are the recompute modules and, for
    each op taking a ZeRO-3 parameter gathered (``gathered``: those parameters) outside
    them, a selective region of its own: the gather runs again in backward, the gathered
    weight is never kept."""
    regions = regions_of(graph, recompute)
    for param in gathered:
        for user in param.users:
            slots = [i for i, op in enumerate(OpCall.of(user).operands) if op is param]
            needs = user.meta[LAYOUTS][0] if LAYOUTS in user.meta else ()
            if user in regions or user.op != "call_function" or not slots:
                continue
            if any(needs[i] is not None and needs[i] != param.meta[LAYOUTS][1][0] for i in slots):
                regions[user] = (f"zero3:{user.name}", SELECTIVE)
    return regions


def assemble_plan(
    g: StrategyGraph,
    assignment: dict[str, int],
    report: SolverReport,
    cluster: Cluster,
    memory: Memory | None = None,
    choice: MemoryChoice | None = None,
    budget: float | None = None,
    pipeline: Pipeline | None = None,
    mesh: MeshSpec | None = None,
) -> Plan:
    """Turn solver choices into a :class:`Plan` with costs, bytes and memory.

    ``choice`` applies its ZeRO stage (ZeRO-3 stores each split parameter split, so the
    consumers gather it) and its recompute; ``pipeline`` (on the whole ``mesh``) adds the
    stages.
    """
    memory = memory or Memory()
    choice = choice or MemoryChoice(0, {})
    splits = zero_splits(g, assignment, memory) if choice.zero else {}
    if choice.zero == 3:
        stored = {
            node: Choice(None, [_fixed(with_split(g.strategy(node, assignment).outputs[0], split))], "zero3")
            for node, split in splits.items()
        }
        g = replace(g, choices={**g.choices, **stored})
    _lay_out(g, assignment)
    nodes, redists, warnings = [], [], []
    compute = 0.0
    for node, c in g.choices.items():
        if c.kind == "output":
            continue
        s = g.strategy(node, assignment)
        t = float(c.compute[assignment[c.root]] if c.root else c.compute[0]) if c.compute is not None else 0.0
        compute += t
        nodes.append(
            NodeDecision(
                node.name,
                str(node.target) if node.op == "call_function" else node.op,
                module_path(node),
                c.kind,
                tuple(None if o is None else format_layout(o) for o in s.operands),
                tuple(format_layout(o) for o in s.outputs),
                tuple(None if o is None else format_layout(o) for o in s.grads),
                t,
                c.root,
                tuple(op.name for op in OpCall.of(node).operands) if node.op == "call_function" else (),
            )
        )
    graph = g.captured.graph
    state = set(g.captured.params) | set(g.captured.buffers)
    regions = recompute_regions(graph, choice.recompute, splits if choice.zero == 3 else ())
    # the collectives exactly as the compiled program will issue them (same edges, same sums)
    planned, summed = planned_edges(graph, state, g.requires_grad, g.mesh.ndim)
    for (src, dst, slot), have, need, grad_need, grad_have in planned:
        if have == need and grad_need == grad_have:
            continue
        shape, itemsize = tuple(int(x) for x in src.meta["val"].shape), src.meta["val"].element_size()
        fwd, t_fwd = g.cost.redistribute(have, need, shape, itemsize)
        bwd, t_bwd = g.cost.backward(have, need, grad_need, grad_have, shape, itemsize)
        if src.name in state and dst in regions:  # gathered again when the region is recomputed
            bwd, t_bwd = [*fwd, *bwd], t_bwd + t_fwd
        redists.append(
            _redistribution(g, src, dst.name, module_path(dst), slot, have, need, fwd, bwd, t_fwd + t_bwd)
        )
    for node, axes in summed.items():
        layout = g.strategy(node, assignment).outputs[0]
        size = int(local_bytes(node, layout, g.mesh))
        split = splits.get(node) if choice.zero in (1, 2) else None
        bwd = [
            Collective(
                "reduce_scatter" if split and a == split[0] and choice.zero == 2 else "all_reduce",
                (g.mesh.axis_names[a],),
                size,
            )
            for a in sorted(axes, key=lambda a: split is not None and a == split[0])
        ]
        if split is not None:  # the updated shards, gathered after the optimizer step
            n = g.mesh.axis_sizes[split[0]]
            bwd.append(Collective("all_gather", (g.mesh.axis_names[split[0]],), size // n))
        seconds = sum(g.cost.collective_time(c, latency=False) for c in bwd)  # bucketed
        redists.append(_redistribution(g, node, "<gradient sum>", "", 0, layout, layout, [], bwd, seconds))
    recomputed = sum(
        float(c.compute[assignment[c.root]] if c.root else c.compute[0]) / 3.0
        for node, (_, policy) in regions.items()
        if (c := g.choices.get(node)) is not None
        and c.compute is not None
        and g.requires_grad.get(node)
        and (policy == FULL or not is_selective_save(node.target))
    )
    compute += recomputed
    comm = sum(r.seconds for r in redists)
    comm_bytes = sum(c.bytes for r in redists for c in (*r.forward, *r.backward))
    params: dict[str, str] = {}
    held: dict[str, tuple[float, float, float, float]] = {}
    for name, fqn in {**g.captured.params, **g.captured.buffers}.items():
        node = next(n for n in g.choices if n.name == name)
        layout = g.strategy(node, assignment).outputs[0]
        for alias in g.captured.aliases.get(fqn, [fqn]):
            params[alias] = format_layout(layout)
        split = splits.get(node)
        n = g.mesh.axis_sizes[split[0]] if split else 1
        local = local_bytes(node, layout, g.mesh) * (n if choice.zero == 3 else 1)
        grad = name in g.captured.params and bool(g.requires_grad.get(node))
        b = state_bytes(local, node.meta["val"].element_size(), n, choice.zero, memory, grad)
        held[name] = (b.param, b.grad, b.optimizer, b.host)
    param_bytes, grad_bytes, optimizer_bytes, host_bytes = (
        sum(b[k] for b in held.values()) for k in range(4)
    )
    acts = activation_memory(graph, g.requires_grad, g.mesh, regions, memory.offload_activations)
    host_acts = acts.by_autograd if memory.offload_activations else 0.0
    device_acts = acts.peak
    seen = set()
    for op, path in g.fallbacks:
        if (op, path) not in seen:
            seen.add((op, path))
            warnings.append(f"no sharding rule for {op} in module '{path or '<root>'}': replicated")
    inputs = {
        name: format_layout(g.strategy(n, assignment).outputs[0])
        for n in g.choices
        if (name := n.name) in g.captured.inputs
    }
    prediction = Prediction(
        step_time_s=compute + comm,
        compute_s=compute,
        comm_s=comm,
        comm_bytes=int(comm_bytes),
        param_bytes=int(param_bytes),
        grad_bytes=int(grad_bytes),
        optimizer_bytes=int(optimizer_bytes),
        activation_bytes=int(device_acts),
    )
    by_name = {n.name: n for n in g.choices}
    memory_plan = MemoryPlan(
        zero=choice.zero,
        zero_threshold=memory.zero_threshold,
        optimizer_states=memory.optimizer_states,
        offload_optimizer=memory.offload_optimizer,
        offload_activations=memory.offload_activations,
        zero_splits={
            g.captured.params[node.name]: (g.mesh.axis_names[a], d) for node, (a, d) in splits.items()
        },
        recompute=dict(choice.recompute),
        budget=None if budget is None else int(budget),
        chosen=False,
        activation_kept_bytes=int(acts.kept),
        host_optimizer_bytes=int(host_bytes),
        host_activation_bytes=int(host_acts),
    )
    code = format_graph(graph, f"Constructed by autopar.plan on mesh {g.mesh} ({cluster.name})")
    result = Plan(
        g.mesh.to_dict(),
        cluster.to_dict(),
        nodes,
        redists,
        params,
        inputs,
        prediction,
        report,
        code,
        warnings,
        memory=memory_plan,
    )
    if pipeline is not None:
        result.pipeline = plan_pipeline(
            result,
            g.captured,
            pipeline,
            mesh,
            CostModel(mesh, cluster).link(0),
            math.inf if budget is None else budget,
            {
                name: local_bytes(n, g.strategy(n, assignment).outputs[0], g.mesh)
                for name, n in by_name.items()
                if isinstance(n.meta.get("val"), torch.Tensor)
            },
            acts.by_node,
            held,
            g.requires_grad,
        )
    return result


def _redistribution(
    g: StrategyGraph,
    src: torch.fx.Node,
    dst: str,
    module: str,
    slot: int,
    have: Layout,
    need: Layout,
    fwd: list,
    bwd: list,
    seconds: float,
) -> Redistribution:
    val = src.meta["val"]
    steps = [
        tuple(CollectiveStep(c.kind, c.mesh_axes, c.bytes, g.cost.collective_time(c)) for c in cs)
        for cs in (fwd, bwd)
    ]
    return Redistribution(
        src.name,
        dst,
        slot,
        module,
        tuple(int(x) for x in val.shape),
        format_layout(have),
        format_layout(need),
        steps[0],
        steps[1],
        seconds,
    )
