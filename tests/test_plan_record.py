"""The plan's lowering record (``Plan.lowering``): saved and read back, derived for a format-4 plan,
and applied by the passes as written, a plan edited by hand included; a record the graph or
mesh contradicts is refused, naming what it names."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.compiler import lower
from autopar.ir.errors import PlanError
from autopar.ir.mesh import MeshSpec
from autopar.ir.plan import EdgeLowering, Lowering, LoweringStep, Plan
from autopar.planning.planner import capture_for
from autopar.tools.fake_ranks import fake_world
from examples.gpt import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).parent))  # zoo_models

CONFIG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=2, n_layers=2, d_ff=64)
MESH = {"dp": 2, "tp": 2}


def _model(recompute: str | None = None) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if recompute is not None:
        autopar.recompute(model.blocks[0], recompute)
    return model, torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len))


@pytest.fixture(scope="module")
def planned() -> Plan:
    model, idx = _model()
    return autopar.plan(model, (idx,), MESH, cluster="fast-links", time_limit=10.0)


@pytest.fixture(scope="module")
def zero3_recompute() -> Plan:
    model, idx = _model("selective")
    memory = autopar.Memory(zero=3, zero_threshold=0)
    return autopar.plan(model, (idx,), {"dp": 4}, memory=memory, cluster="fast-links", time_limit=10.0)


def _lower(plan: Plan, mesh: dict[str, int] = MESH, recompute: str | None = None) -> tuple[Any, Any]:
    """``plan`` lowered for rank 0 of ``mesh`` on fake ranks: the program and the passes' context."""
    model, idx = _model(recompute)
    spec = MeshSpec.of(mesh)
    captured = capture_for(model, (idx,), {}, spec, None, None)
    with fake_world(math.prod(mesh.values())):
        device_mesh = init_device_mesh("cpu", spec.axis_sizes, mesh_dim_names=spec.axis_names)
        return lower(captured, plan, device_mesh)


def _edited(plan: Plan, **changes: Any) -> Plan:
    """A copy of ``plan`` (through its JSON) with its lowering record's fields replaced."""
    copy = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    copy.lowering = dataclasses.replace(copy.lowering, **changes)
    return copy


def _collectives(gm: torch.fx.GraphModule, param: str) -> list[tuple[str, tuple]]:
    """The chain of autopar ops from placeholder ``param``: each op's name and its arguments but the value."""
    found, node = [], next(iter(gm.graph.find_nodes(op="placeholder", target=param)))
    while len(node.users) == 1 and str((user := next(iter(node.users))).target).startswith("autopar."):
        found.append((str(user.target), user.args[1:]))
        node = user
    return found


def test_the_record_round_trips_through_json(planned: Plan, zero3_recompute: Plan):
    for plan in (planned, zero3_recompute):
        record = plan.lowering
        assert record.edges and all(isinstance(s, LoweringStep) for e in record.edges for s in e.steps)
        loaded = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
        assert loaded.lowering == record and loaded == plan
    assert planned.lowering.gradient_sums and zero3_recompute.lowering.regions


class _Transposed(torch.nn.Module):
    """Reads its weight through a view (``weight.T``, as Falcon's projections do)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.weight.t())


def test_a_view_of_a_gathered_weight_is_recorded_as_held():
    """Its gather into a region runs again in backward, as a parameter's does (``mark_recompute``)."""
    model = torch.nn.Sequential(_Transposed(), _Transposed())
    autopar.recompute(model[0], "full")
    memory = autopar.Memory(zero=3, zero_threshold=0)
    plan = autopar.plan(model, (torch.randn(64, 64),), {"dp": 4}, memory=memory, cluster="fast-links")
    views = [n.name for n in plan.nodes if n.op == "aten.t.default"]
    assert plan.lowering.held == tuple(views) and len(views) == 2


def test_a_format_4_plan_loads_without_a_record_and_lowers_as_one_with_it(planned: Plan):
    data = planned.to_dict()
    data["format"] = 4
    del data["lowering"]
    old = Plan.from_dict(data)
    assert old.lowering is None
    gm, ctx = _lower(old)
    assert old.lowering is None  # the plan given is left as it is
    assert ctx.plan.lowering == planned.lowering  # lowered with the record the planner made
    new_gm, new_ctx = _lower(planned)
    assert gm.code == new_gm.code and ctx.snapshots == new_ctx.snapshots
    with pytest.raises(PlanError, match=r"plan format 3 is not supported \(expected 5, or 4"):
        Plan.from_dict({**data, "format": 3})


class _Pinned(torch.nn.Module):
    """Reads its weight through a layout constraint (``autopar.constrain``), once."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ autopar.constrain(self.weight, (None, None)))


def test_a_zero3_weight_read_through_a_constraint_is_gathered_again_for_the_op_after_it():
    """Lowering drops the constraint: the op reading the gathered weight gets the region."""
    model = torch.nn.Sequential(_Pinned(), _Pinned())
    for pinned in model:  # stored whole by the layouts, so that ZeRO-3 is what splits them
        autopar.shard(pinned, parameter_storage={"weight": (None, None)})
    memory = autopar.Memory(zero=3, zero_threshold=0)
    plan = autopar.plan(model, (torch.randn(1024, 64),), {"dp": 4}, memory=memory, cluster="fast-links")
    assert plan.memory.zero_splits
    assert plan.lowering.gathered == {
        "matmul": ("zero3:matmul", "selective"),
        "matmul_1": ("zero3:matmul_1", "selective"),
    }


def test_a_gradient_sum_moved_from_the_buckets_into_the_graph(planned: Plan):
    """Summed in the graph: a ``grad_all_reduce`` on the parameter per axis, no bucketed sum."""
    sums = planned.lowering.gradient_sums
    recorded = {e.src for e in planned.lowering.edges}
    param = next(p for p, axes in sums.items() if len(axes) == 2 and p not in recorded)
    consumer = next(n for n in planned.nodes if param in n.args)
    slot = consumer.args.index(param)
    layout = consumer.operands[slot]
    assert layout == "RR"  # stored as used: no redistribution but the gradient's
    steps = tuple(LoweringStep(axis, "grad_all_reduce", layout, layout, "P") for axis in MESH)
    edge = EdgeLowering(param, consumer.name, slot, layout, layout, "PP", layout, steps)
    edited = _edited(
        planned,
        edges=(*planned.lowering.edges, edge),
        gradient_sums={p: a for p, a in sums.items() if p != param},
    )
    gm, ctx = _lower(planned)
    assert param in ctx.grad_reductions and _collectives(gm, param) == []
    gm, ctx = _lower(edited)
    assert param not in ctx.grad_reductions
    assert _collectives(gm, param) == [
        ("autopar.grad_all_reduce.default", ("dp",)),
        ("autopar.grad_all_reduce.default", ("tp",)),
    ]


def _recomputed(gm: torch.fx.GraphModule) -> set[str]:
    """The nodes of ``gm``'s recompute regions."""
    return {n.name for _, m in gm.named_children() for n in m.region.graph.nodes if n.op == "call_function"}


def test_a_node_dropped_from_its_region_runs_outside_it_and_trains_as_one_device():
    model, idx = _model("full")
    plan = autopar.plan(model, (idx,), {"dp": 1}, time_limit=10.0)
    last = list(plan.lowering.regions)[-1]  # the block's last op: the region stays one piece
    edited = _edited(plan, regions={n: r for n, r in plan.lowering.regions.items() if n != last})
    assert last in _recomputed(_lower(plan, {"dp": 1}, "full")[0])
    assert last not in _recomputed(_lower(edited, {"dp": 1}, "full")[0])
    with fake_world(1):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        dmodel = autopar.compile(model, mesh, (idx,), plan=edited)
        (local,), _ = dmodel.shard_inputs(idx)
        dmodel(local).float().square().mean().backward()
    model(idx).float().square().mean().backward()
    mine = {name: p.grad.to_local() for name, p in dmodel.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(mine[name], p.grad)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda r: {"edges": (_on_axis(r.edges[0], "pp"), *r.edges[1:])},
            r"a step on mesh axis 'pp' for the edge .* but the mesh is dp=2×tp=2",
        ),
        (
            lambda r: {"edges": (dataclasses.replace(r.edges[0], src="nowhere"), *r.edges[1:])},
            r"the edge nowhere -> .* but the graph has no laid-out node nowhere",
        ),
        (lambda r: {"gradient_sums": {"nowhere": ("dp",)}}, "gradient of nowhere, which is no placeholder"),
        (lambda r: {"gradient_sums": {next(iter(r.gradient_sums)): ("ep",)}}, "over ep, but the mesh is"),
        (
            lambda r: {"edges": (dataclasses.replace(r.edges[0], steps=()), *r.edges[1:])},
            r"steps for the edge .* end at",
        ),
    ],
)
def test_a_record_the_graph_or_mesh_contradicts_is_refused(planned: Plan, edit: Any, message: str):
    with pytest.raises(PlanError, match=message):
        _lower(_edited(planned, **edit(planned.lowering)))


def test_a_region_for_a_node_the_graph_lacks_is_refused(zero3_recompute: Plan):
    regions = {**zero3_recompute.lowering.regions, "nowhere": ("blocks.0", "selective")}
    with pytest.raises(PlanError, match="puts node nowhere in region blocks.0, but the graph has no nowhere"):
        _lower(_edited(zero3_recompute, regions=regions), {"dp": 4}, "selective")
    regions = {n: (r, "sometimes") for n, (r, _) in zero3_recompute.lowering.regions.items()}
    with pytest.raises(PlanError, match="policy 'sometimes'; expected one of"):
        _lower(_edited(zero3_recompute, regions=regions), {"dp": 4}, "selective")


def _on_axis(edge: EdgeLowering, axis: str) -> EdgeLowering:
    return dataclasses.replace(edge, steps=(dataclasses.replace(edge.steps[0], axis=axis), *edge.steps[1:]))


def test_an_unrecorded_plan_cannot_reach_the_passes(planned: Plan):
    """The passes apply a record and derive none: only ``lower`` records one on a plan without."""
    from autopar.passes import insert_redistributions
    from autopar.passes.context import PassContext

    plan = dataclasses.replace(planned, lowering=None)
    ctx = PassContext(mesh=MeshSpec.of(MESH), device=torch.device("cpu"), plan=plan, captured=None)
    with pytest.raises(PlanError, match="no lowering record"):
        insert_redistributions.run(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), ctx)
    assert isinstance(planned.lowering, Lowering)


@pytest.fixture(scope="module")
def three_axes() -> tuple[Plan, Any]:
    """GPT-2 on dp × sp × tp (a plan saved in format 4, recorded here) and how to lower it."""
    from zoo_models import build

    from autopar.ir.plan import load_plan
    from autopar.planning.assembly.lowering_record import lowering_record

    plan = load_plan(str(Path(__file__).parent / "data" / "saved_plans" / "gpt2_three_axes.json"))
    spec = MeshSpec.of(plan.mesh)

    def lowered(edited: Plan) -> Any:
        torch.manual_seed(0)
        model, _, kwargs = build("gpt2")
        captured = capture_for(model, (), kwargs, spec, None, None)
        with fake_world(spec.size):
            device_mesh = init_device_mesh("cpu", spec.axis_sizes, mesh_dim_names=spec.axis_names)
            return lower(captured, edited, device_mesh)[0]

    torch.manual_seed(0)
    model, _, kwargs = build("gpt2")
    plan.lowering = lowering_record(capture_for(model, (), kwargs, spec, None, None), plan)
    return plan, lowered


def _with_steps(plan: Plan, src: str, dst: str, *steps: tuple[str, str, str, str, str]) -> Plan:
    """``plan`` with the steps of edge ``src -> dst`` replaced by ``(axis, kind, before, after, grad)``s."""
    edges = tuple(
        dataclasses.replace(e, steps=tuple(LoweringStep(*s) for s in steps))
        if (e.src, e.dst) == (src, dst)
        else e
        for e in plan.lowering.edges
    )
    return _edited(plan, edges=edges)


def _reductions_after(gm: torch.fx.GraphModule, name: str) -> list[str]:
    """The mesh axes of the chain of ``all_reduce`` ops that starts at node ``name``, in order."""
    axes, node = [], next(n for n in gm.graph.nodes if n.name == name)
    while chain := [u for u in node.users if u.target is torch.ops.autopar.all_reduce.default]:
        node = chain[0]
        axes.append(node.args[1])
    return axes


def test_steps_reordered_by_hand_are_lowered_in_their_new_order(three_axes: tuple[Plan, Any]):
    """Two partial sums reduced over sp then tp, or (edited) over tp then sp: both are valid orders."""
    plan, lowered = three_axes
    (edge,) = [e for e in plan.lowering.edges if (e.src, e.dst) == ("view_11", "dropout_2")]
    assert [(s.axis, s.kind) for s in edge.steps] == [("sp", "all_reduce"), ("tp", "all_reduce")]
    assert _reductions_after(lowered(plan), "view_11") == ["sp", "tp"]
    swapped = _with_steps(
        plan,
        "view_11",
        "dropout_2",
        ("tp", "all_reduce", "S(2)PP", "S(2)PR", "R"),
        ("sp", "all_reduce", "S(2)PR", "S(2)RR", "R"),
    )
    assert _reductions_after(lowered(swapped), "view_11") == ["tp", "sp"]


@pytest.mark.parametrize(
    ("src", "dst", "steps", "message"),
    [
        (  # sp would split dim 0 outside tp's split of it: the pieces would not be DTensor's
            "dropout_2",
            "add_7",
            (
                ("tp", "slice", "S(2)RR", "S(2)RS(0)", "S(0)"),
                ("sp", "slice", "S(2)RS(0)", "S(2)S(0)S(0)", "S(0)"),
            ),
            r"step 1 \(slice on axis 1\) changes a dim that inner axis 2 splits",
        ),
        (  # a partial-sum gradient declared whole: backward would slice where it must reduce-scatter
            "view_8",
            "addmm_2",
            (
                ("tp", "all_gather", "RS(0)S(0)", "RS(0)R", "R"),
                ("sp", "all_gather", "RS(0)R", "RRR", "P"),
                ("dp", "slice", "RRR", "S(0)RR", "S(0)"),
            ),
            r"step 0 \(all_gather on axis 2\) receives a P gradient, not R",
        ),
        (  # an op that does not make the change it records
            "view_11",
            "dropout_2",
            (("sp", "all_gather", "S(2)PP", "S(2)RP", "R"), ("tp", "all_reduce", "S(2)RP", "S(2)RR", "R")),
            r"step 0 \(all_gather on axis 1\) does not turn P into R",
        ),
    ],
)
def test_steps_edited_into_what_cannot_run_are_refused(
    three_axes: tuple[Plan, Any], src: str, dst: str, steps: tuple, message: str
):
    plan, lowered = three_axes
    with pytest.raises(PlanError, match=rf"steps for the edge {src} -> {dst}.* cannot run: {message}"):
        lowered(_with_steps(plan, src, dst, *steps))
