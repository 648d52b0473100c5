"""Every strategy the planner can choose is lowered and runs, tensor dims split over several axes included.

* Every redistribution between layouts of a 2-d tensor on a (2, 2) and a (2, 2, 2) mesh (each
  axis R, P, S(0) or S(1), so one dim may be split over two or three axes), with every
  gradient layout its consumer may hand back, goes through the ``lower_collectives`` pass;
  the ops it issues are simulated on every rank's piece of a whole tensor. Forward, each
  rank must end with exactly its piece of the input under ``need`` (outer axis first, as
  DTensor splits); backward, the gradient's pieces must be those of the upstream gradient
  under ``grad_have``. The ops must be the cost model's ``edge_steps`` and move the bytes
  its ``redistribute`` and ``backward`` predict.
* Every strategy the rules offer with a label on two or three axes runs each op rule on
  simulated ranks (``tests/test_rules.py``'s harness) and equals the op on one device.
* Slow: the redistributions where nesting matters run the real collectives on 4 gloo ranks
  (mesh 2 x 2), forward and backward, against the whole tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ir.layout import format_layout, grad_layout, is_valid_for, local_shape
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import LAYOUTS, REDISTRIBUTION, output_layout
from autopar.ir.redistribution_steps import StepKind, axis_states, walk
from autopar.ir.strided import is_split, parts_of, strided
from autopar.passes import lower_collectives
from autopar.passes.context import PassContext
from autopar.passes.insert_redistributions import redistribute
from autopar.planning.cost.model import CostModel, get_cluster
from autopar.rules import PASSTHROUGH, OpCall, follow, lookup, split_counts
from autopar.tools.launch import spawn
from tests.test_rules import (
    CASES,
    MESHES,
    _strategies,
    join_value,
    make_node,
    partial_integers,
    r,
    run_strategy,
    split_value,
)

aten, ops = torch.ops.aten, torch.ops.autopar
R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
SHAPE = (8, 8)
MESH_2D = MeshSpec(("dp", "tp"), (2, 2))
MESH_3D = MeshSpec(("x", "y", "z"), (2, 2, 2))
FAST_LINKS = get_cluster("fast-links")


class OtherOrder(CostModel):
    """Prefers the opposite axis order within each kind (on real clusters outer links are never
    faster than inner ones): the nesting rule, not the preference, must keep the steps right."""

    def _step_order(self, step: tuple[StepKind, int]) -> tuple:
        return (super()._step_order(step)[0], -step[1])


Edge = tuple  # (have, need, grad_need, grad_have)
Pieces = dict[tuple[int, ...], torch.Tensor]

_KIND_OF_OP = {
    ops.shard.default: StepKind.SLICE,
    ops.reduce_scatter.default: StepKind.REDUCE_SCATTER,
    ops.all_to_all.default: StepKind.ALL_TO_ALL,
    ops.all_reduce.default: StepKind.ALL_REDUCE,
    ops.all_gather.default: StepKind.ALL_GATHER,
    ops.to_partial.default: StepKind.TO_PARTIAL,
    ops.grad_all_reduce.default: StepKind.GRAD_ALL_REDUCE,
}


def _nests_a_strided_split(layout: tuple) -> bool:
    return any(parts_of(p) > 1 and sum(is_split(q) and q.dim == p.dim for q in layout) > 1 for p in layout)


def edges(mesh: MeshSpec, placements: tuple = (R, P, S0, S1)) -> Iterator[Edge]:
    """Every (have, need) pair with every gradient a consumer may hand back: Shard where it
    needs Shard, whole where it needs Partial, whole or partial sums where it needs Replicate.
    A strided shard is never nested with another split of its dim."""
    layouts = [
        lay for lay in itertools.product(placements, repeat=mesh.ndim) if not _nests_a_strided_split(lay)
    ]
    for have, need in itertools.product(layouts, layouts):
        options = [(p,) if is_split(p) else (R,) if isinstance(p, Partial) else (R, P) for p in need]
        for grad_need in itertools.product(*options):
            if have != need or grad_need != grad_layout(have):
                yield have, need, grad_need, grad_layout(have)


def lower(edge: Edge, mesh: MeshSpec, cost: CostModel, shape: tuple = SHAPE) -> torch.fx.GraphModule:
    """A program ``x -> redistribute(x)`` with ``edge``'s layouts and the steps ``cost`` orders (as
    the plan records them), after ``lower_collectives`` (its graph: ``recompile()`` it to run it)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(shape)
    node = graph.call_function(redistribute, (x, *(format_layout(lay) for lay in edge)))
    node.meta.update({"val": x.meta["val"], REDISTRIBUTION: (*edge, cost.edge_plan(*edge))})
    graph.output(node)
    keys = {a: a for a in mesh.axis_names}
    cpu = torch.device("cpu")
    ctx = PassContext(mesh=mesh, device=cpu, plan=None, captured=None, axis_keys=keys)
    return lower_collectives.run(torch.fx.GraphModule(torch.nn.Module(), graph), ctx)


def collectives_of(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


class Ranks:
    """Every rank of a mesh at once: the autopar collectives on each rank's piece, counting
    each collective's input bytes on one rank, as ``autopar.runtime.collectives`` does."""

    def __init__(self, mesh: MeshSpec) -> None:
        self.mesh = mesh
        self.moved: list[tuple[str, str, int]] = []

    def _count(self, kind: str, x: Pieces, a: int) -> None:
        first = next(iter(x.values()))
        self.moved.append((kind, self.mesh.axis_names[a], first.numel() * first.element_size()))

    def _groups(self, x: Pieces, a: int) -> dict[tuple, list[tuple]]:
        groups: dict[tuple, list[tuple]] = {}
        for c in sorted(x):
            groups.setdefault(c[:a] + c[a + 1 :], []).append(c)
        return groups

    def chunk(self, x: Pieces, dim: int, a: int, parts: int = 1) -> Pieces:
        """Each rank's chunk (its chunk of every part, for a strided shard)."""
        n = self.mesh.axis_sizes[a]
        return {c: torch.cat([p.chunk(n, dim)[c[a]] for p in t.chunk(parts, dim)], dim) for c, t in x.items()}

    def gather(self, x: Pieces, dim: int, a: int, parts: int = 1) -> Pieces:
        """The chunks put together (part ``j`` of a strided shard: every rank's piece ``j``)."""
        self._count("all_gather", x, a)
        whole = {
            k: torch.cat([torch.cat([x[c].chunk(parts, dim)[j] for c in cs], dim) for j in range(parts)], dim)
            for k, cs in self._groups(x, a).items()
        }
        return {c: whole[c[:a] + c[a + 1 :]] for c in x}

    def sum(self, x: Pieces, a: int, kind: str = "all_reduce") -> Pieces:
        self._count(kind, x, a)
        total = {k: sum(x[c] for c in cs) for k, cs in self._groups(x, a).items()}
        return {c: total[c[:a] + c[a + 1 :]] for c in x}

    def reduce_scatter(self, x: Pieces, dim: int, a: int, parts: int = 1) -> Pieces:
        return self.chunk(self.sum(x, a, "reduce_scatter"), dim, a, parts)

    def all_to_all(self, x: Pieces, src: int, dst: int, a: int) -> Pieces:
        self._count("all_to_all", x, a)
        gathered = {k: torch.cat([x[c] for c in cs], src) for k, cs in self._groups(x, a).items()}
        return self.chunk({c: gathered[c[:a] + c[a + 1 :]] for c in x}, dst, a)

    def to_partial(self, x: Pieces, a: int, dim: int) -> Pieces:
        if dim == -1:
            return {c: t if c[a] == 0 else torch.zeros_like(t) for c, t in x.items()}
        n, out = self.mesh.axis_sizes[a], {}
        for c, t in x.items():  # zeros where the others' pieces go (uneven pieces: their sizes)
            parts = [t if i == c[a] else torch.zeros_like(x[(*c[:a], i, *c[a + 1 :])]) for i in range(n)]
            out[c] = torch.cat(parts, dim)
        return out

    def axis_of(self, node: torch.fx.Node) -> int:
        """The mesh axis a lowered collective runs over."""
        return next(self.mesh.axis_names.index(v) for v in node.args[1:] if v in self.mesh.axis_names)

    def forward(self, node: torch.fx.Node, x: Pieces) -> Pieces:
        """The op of ``node`` (a lowered collective) on every rank."""
        a, args, op = self.axis_of(node), (*node.args[1:], 1, 1), node.target  # parts default to 1
        if op is ops.shard.default:
            return self.chunk(x, args[0], a, args[2])
        if op is ops.reduce_scatter.default:
            return self.reduce_scatter(x, args[0], a, args[2])
        if op is ops.all_gather.default:
            return self.gather(x, args[0], a, args[3])
        if op is ops.all_to_all.default:
            return self.all_to_all(x, args[0], args[1], a)
        if op is ops.all_reduce.default:
            return self.sum(x, a)
        if op is ops.to_partial.default:
            return self.to_partial(x, a, args[1])
        assert op is ops.grad_all_reduce.default
        return x

    def backward(self, node: torch.fx.Node, g: Pieces) -> Pieces:
        """The autograd formula of ``node``'s op (see ``autopar.runtime.collectives``) on every rank."""
        a, args, op = self.axis_of(node), (*node.args[1:], 1, 1), node.target  # parts default to 1
        if op in (ops.shard.default, ops.reduce_scatter.default):
            return self.gather(g, args[0], a, args[2])
        if op is ops.all_gather.default:
            return (
                self.reduce_scatter(g, args[0], a, args[3])
                if args[2] == "reduce_scatter"
                else self.chunk(g, args[0], a, args[3])
            )
        if op is ops.all_to_all.default:
            return self.all_to_all(g, args[1], args[0], a)
        if op is ops.all_reduce.default:
            return self.sum(g, a) if args[1] == "all_reduce" else g
        if op is ops.to_partial.default:
            return g if args[1] == -1 else self.chunk(g, args[1], a)
        assert op is ops.grad_all_reduce.default
        return self.sum(g, a)


def _assert_pieces(pieces: Pieces, whole: torch.Tensor, layout: tuple, mesh: MeshSpec, what: str) -> None:
    """Each piece has its local shape under ``layout`` and together they make ``whole``."""
    shapes = {c: tuple(t.shape) for c, t in pieces.items()}
    assert shapes == {c: local_shape(whole.shape, layout, mesh, c) for c in pieces}, (
        f"{what}: local shapes {shapes}"
    )
    joined = join_value(pieces, layout, mesh)
    assert torch.allclose(joined, whole), f"{what}: off by up to {(joined - whole).abs().max():.3g}"


def check_edge(
    edge: Edge, mesh: MeshSpec, cost: CostModel, gen: torch.Generator, shape: tuple = SHAPE
) -> None:
    """Lower ``edge``, run it forward and backward on simulated ranks, compare with the cost model."""
    have, need, grad_need, grad_have = edge
    what = " -> ".join(format_layout(lay) for lay in edge)
    nodes, ranks = collectives_of(lower(edge, mesh, cost, shape)), Ranks(mesh)
    issued = [(ranks.axis_of(n), _KIND_OF_OP[n.target]) for n in nodes]
    assert tuple(issued) == cost.edge_steps(have, need, grad_need, grad_have), what
    layouts = [have] + [output_layout(n) for n in nodes]
    assert layouts[-1] == need, what
    assert all(n.meta[LAYOUTS][0] == (lay,) for n, lay in zip(nodes, layouts)), what

    x = torch.randn(shape, dtype=torch.float64, generator=gen)
    pieces = split_value(x, have, mesh, gen)
    for n in nodes:
        pieces = ranks.forward(n, pieces)
    _assert_pieces(pieces, x, need, mesh, f"{what} forward")
    collectives, _ = cost.redistribute(have, need, shape, 8)
    assert ranks.moved == [(c.kind, c.mesh_axes[0], c.bytes) for c in collectives], what

    ranks.moved.clear()
    g = torch.randn(shape, dtype=torch.float64, generator=gen)
    grads = split_value(g, grad_need, mesh, gen)
    for n in reversed(nodes):
        grads = ranks.backward(n, grads)
    _assert_pieces(grads, g, grad_have, mesh, f"{what} backward")
    collectives, _ = cost.backward(have, need, grad_need, grad_have, shape, 8)
    assert ranks.moved == [(c.kind, c.mesh_axes[0], c.bytes) for c in collectives], what


@pytest.mark.parametrize("model", [CostModel, OtherOrder], ids=lambda m: m.__name__)
@pytest.mark.parametrize("mesh", [MESH_2D, MESH_3D], ids=str)
def test_every_redistribution_is_lowered_to_the_pieces_dtensor_holds(mesh, model):
    cost, gen = model(mesh, FAST_LINKS), torch.Generator().manual_seed(0)
    for edge in edges(mesh):
        check_edge(edge, mesh, cost, gen)


@pytest.mark.parametrize("mesh", [MeshSpec(("tp",), (3,)), MESH_2D], ids=str)
def test_uneven_splits_are_lowered_to_the_pieces_dtensor_holds(mesh):
    """A dim the axis does not divide (7 rows over 3: 3, 3 and 1), to and from every layout."""
    cost, gen = CostModel(mesh, FAST_LINKS), torch.Generator().manual_seed(0)
    shape = (7, 6) if mesh.ndim == 1 else (5, 6)
    for edge in edges(mesh):
        if all(is_valid_for(lay, shape, mesh, uneven=True) for lay in edge):
            check_edge(edge, mesh, cost, gen, shape)


@pytest.mark.parametrize("mesh", [MeshSpec(("tp",), (2,)), MESH_2D], ids=str)
def test_strided_shards_are_lowered_to_the_pieces_dtensor_holds(mesh):
    """Fused projections' layouts (q, k and v each split): to and from every other layout."""
    cost, gen = CostModel(mesh, FAST_LINKS), torch.Generator().manual_seed(0)
    for edge in edges(mesh, (R, P, S0, S1, strided(0, 2), strided(1, 2))):
        if any(parts_of(p) > 1 for lay in edge[:2] for p in lay):
            check_edge(edge, mesh, cost, gen)


def test_nested_splits_are_unwound_only_where_no_order_works():
    cost = CostModel(MESH_2D, FAST_LINKS)
    # entering goes outer axis first, leaving inner axis first: no extra step
    assert cost.steps((P, P), (S0, S0)) == ((0, "reduce_scatter"), (1, "reduce_scatter"))
    assert cost.steps((S0, S0), (R, R)) == ((1, "all_gather"), (0, "all_gather"))
    assert cost.steps((S0, S0), (R, P)) == ((1, "to_partial"), (0, "all_gather"))
    assert cost.steps((P, S0), (S1, S1)) == ((0, "reduce_scatter"), (1, "all_to_all"))
    # tp leaves dim 0 before dp enters it, though slices usually go first
    assert cost.steps((R, S0), (S0, R)) == ((1, "all_gather"), (0, "slice"))
    # tp's unchanged split of dim 0 is in the way of every order: gathered first, split again after
    assert cost.steps((R, S0), (S0, S0)) == ((1, "all_gather"), (0, "slice"), (1, "slice"))
    assert cost.steps((P, S0), (S0, S0)) == ((1, "all_gather"), (0, "reduce_scatter"), (1, "slice"))
    # each axis waits for the other: the outer one unwinds the inner one
    assert cost.steps((S0, S1), (S1, S0)) == ((1, "all_gather"), (0, "all_to_all"), (1, "slice"))


# --------------------------------------------------------------------------- rules


def _nested(choices: tuple) -> bool:
    labels = [lab for lab in choices if lab and lab != PASSTHROUGH]
    return len(labels) != len(set(labels))


# A label over three axes on the ops of a transformer layer. Not every case of test_rules:
# their tiny shapes cut 8 ways leave rows too short for some kernels (_grouped_mm's 16-byte strides).
CORE_OPS = {
    aten.mm.default,
    aten.bmm.default,
    aten.linear.default,
    aten.scaled_dot_product_attention.default,
    aten.embedding.default,
    aten.layer_norm.default,
    aten._softmax.default,
    aten.add.Tensor,
    aten.view.default,
    aten.transpose.int,
    aten.mean.dim,
}
NESTED_CASES = [(mesh, *case) for mesh in MESHES[1:] for case in CASES] + [
    (MESH_3D, *case) for case in CASES if case[0] in CORE_OPS
]


@pytest.mark.parametrize(
    "mesh,op,args,kwargs", NESTED_CASES, ids=[f"{c[1]}-{i}-{c[0]}" for i, c in enumerate(NESTED_CASES)]
)
def test_nested_strategies_match_single_device(mesh, op, args, kwargs):
    node = make_node(op, args, kwargs)
    call = OpCall.of(node)
    spec = lookup(op).fn(call)
    for strategy in _strategies(spec, call, mesh):
        if not _nested(strategy.choices) or partial_integers(strategy, args, kwargs):
            continue
        try:
            run_strategy(op, args, kwargs, node, spec, strategy, mesh)
        except AssertionError as e:
            raise AssertionError(f"{op} strategy {strategy.choices}: {e}") from None


def test_rules_offer_a_label_on_two_axes():
    node = make_node(aten.mm.default, (r(8, 8), r(8, 4)), {})
    call = OpCall.of(node)
    spec = lookup(aten.mm.default).fn(call)
    strategies = {s.choices: s for s in _strategies(spec, call, MESHES[1])}
    assert strategies[("m", "m")].outputs[0] == (S0, S0) and strategies[("m", "m")].split == 4
    assert strategies[("k", "k")].operands == ((S1, S1), (S0, S0)) and strategies[("k", "k")].outputs[0] == (
        P,
        P,
    )
    # the 4 columns cannot be split 2 x 2 x 2 ways
    on_3d = {s.choices for s in _strategies(spec, call, MESH_3D)}
    assert ("m", "m", "m") in on_3d and ("n", "n", "n") not in on_3d


def test_follow_keeps_a_nested_split_where_it_divides():
    for shape, expected in (((8, 4), (S0, S0)), ((2, 4), (S0, R))):
        node = make_node(aten.gelu.default, (r(*shape),), {})
        call = OpCall.of(node)
        spec = lookup(aten.gelu.default).fn(call)
        strategy = follow(spec, 0, (S0, S0), call.shapes, call.out_shapes, MESHES[1])
        assert strategy.operands[0] == strategy.outputs[0] == strategy.grads[0] == expected


def test_a_dim_split_twice_counts_both_axes():
    """What localize_shapes rescales split means and localizes sizes by."""
    node = make_node(aten.mean.dim, (r(4, 8), [-1], True), {})
    spec = lookup(aten.mean.dim).fn(OpCall.of(node))
    (label,) = spec.mean_over
    assert split_counts(spec, ((S1, S1),), MESHES[1].axis_sizes) == {label: 4}
    assert local_shape((4, 8), (S1, S1), MESHES[1]) == (4, 2)


# --------------------------------------------------------------------------- real ranks


def _nesting_matters(edge: Edge, cost: CostModel) -> bool:
    """A layout along the way splits one dim over two axes, or the steps unwind a split."""
    have, need, grad_need, _ = (axis_states(lay) for lay in edge)
    steps = cost.edge_steps(*edge)
    for states in (have, *(w.after for w in walk(have, need, grad_need, steps))):
        dims = [s for s in states if isinstance(s, int)]
        if len(dims) != len(set(dims)):
            return True
    changed = sum(h != n for h, n in zip(have, need))
    return sum(kind != StepKind.GRAD_ALL_REDUCE for _, kind in steps) > changed


def _pieces_on_rank(edges_run: list[Edge]) -> list[tuple]:
    """On one gloo rank of a 2 x 2 mesh: each edge lowered and run forward and backward on this
    rank's pieces (every rank draws the same whole tensors); the output and gradient pieces
    and the bytes counted forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime import collectives

    device_mesh = init_device_mesh("cpu", MESH_2D.axis_sizes, mesh_dim_names=MESH_2D.axis_names)
    collectives.register_mesh(device_mesh)
    coordinate = tuple(device_mesh.get_coordinate())
    cost = CostModel(MESH_2D, FAST_LINKS)
    results = []
    for i, edge in enumerate(edges_run):
        gen = torch.Generator().manual_seed(i)
        x, g = (torch.randn(SHAPE, dtype=torch.float64, generator=gen) for _ in range(2))
        mine = split_value(x, edge[0], MESH_2D, gen)[coordinate].clone().requires_grad_()
        upstream = split_value(g, edge[2], MESH_2D, gen)[coordinate]
        program = lower(edge, MESH_2D, cost)
        program.recompile()
        collectives.reset_comm_counts()
        out = program(mine)
        forward = collectives.comm_counts()
        collectives.reset_comm_counts()
        out.backward(upstream)
        results.append((coordinate, out.detach(), mine.grad, forward, collectives.comm_counts()))
    return results


def _predicted(collectives: tuple) -> dict[tuple[str, str], int]:
    total: dict[tuple[str, str], int] = {}
    for c in collectives:
        total[c.kind.value, c.mesh_axes[0]] = total.get((c.kind.value, c.mesh_axes[0]), 0) + c.bytes
    return total


@pytest.mark.distributed
def test_nested_redistributions_on_4_gloo_ranks():
    cost = CostModel(MESH_2D, FAST_LINKS)
    nested = [e for e in edges(MESH_2D) if _nesting_matters(e, cost)]
    assert len(nested) > 50
    per_rank = spawn(_pieces_on_rank, 4, nested)
    for i, edge in enumerate(nested):
        have, need, grad_need, grad_have = edge
        what = " -> ".join(format_layout(lay) for lay in edge)
        gen = torch.Generator().manual_seed(i)
        x, g = (torch.randn(SHAPE, dtype=torch.float64, generator=gen) for _ in range(2))
        ranks = [results[i] for results in per_rank]
        _assert_pieces({r[0]: r[1] for r in ranks}, x, need, MESH_2D, f"{what} forward")
        _assert_pieces({r[0]: r[2] for r in ranks}, g, grad_have, MESH_2D, f"{what} backward")
        forward = _predicted(cost.redistribute(have, need, SHAPE, 8)[0])
        backward = _predicted(cost.backward(have, need, grad_need, grad_have, SHAPE, 8)[0])
        assert all(r[3] == forward and r[4] == backward for r in ranks), what
