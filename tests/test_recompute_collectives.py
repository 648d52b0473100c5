"""Recompute that runs a block's collectives again in backward: ``recompute(block, "full-comm")``.

MindSpore's ``mp_comm_recompute`` and Megatron-LM's full recompute keep only a block's input and
run the rest of it again in backward, its tensor-parallel collectives included, where ``"full"``
keeps the collectives' outputs. Checked here: the checkpoint runs every op again (plain
checkpointing); the memory model keeps per region its input alone, as its producer lays it out;
the plan prices the forward collectives again in backward, up to the region's last op saving a
tensor (where torch stops recomputing); the memory search picks the policy under a budget only
it meets and leaves an annotated ``"full"`` alone; a plan keeps it through JSON; and on 4 gloo
ranks the loss and gradients equal one device's, each rank issues the same collectives in the
same order, the bytes a step moves equal the plan's (the repeated collectives included), and
backward issues, beyond what the same plan lowered ``"full"`` issues, forward collectives only:
each block's attention all-reduce and the gathers into its products, not the MLP's all-reduce.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import autopar
from autopar.capture.export import capture, gradient_flow
from autopar.ir.errors import MemoryFitError
from autopar.ir.layout import local_fraction
from autopar.ir.meta import module_path
from autopar.ir.options import FULL, FULL_COMM, POLICIES, uses_policy
from autopar.ir.plan import Plan
from autopar.passes import apply_recompute
from autopar.planning.graph.laid_out import LaidOutGraph
from autopar.planning.memory.model import activation_memory
from autopar.planning.memory.recompute import module_regions
from autopar.runtime.module import DistributedModule
from autopar.tools.launch import spawn
from examples import gpt

BATCH, LAYERS = 4, 3
INPUT_BYTES = BATCH * gpt.TINY.seq_len * gpt.TINY.d_model * 4  # a block's input, whole (fp32)


def _model(style: str, policy: str | None, **sizes: int) -> tuple[torch.nn.Module, tuple]:
    """The example GPT of ``LAYERS`` blocks annotated ``style``, each block recomputed under
    ``policy``; ``sizes`` override the batch (``batch_size``) and the config's fields."""
    torch.manual_seed(0)
    model, args = gpt.build(**({"batch_size": BATCH, "n_layers": LAYERS} | sizes))
    gpt.annotate(model, style)
    if policy:
        for block in model.blocks:
            autopar.recompute(block, policy)
    return model, args


def test_full_comm_is_a_policy_the_annotation_takes() -> None:
    assert "full-comm" in POLICIES and FULL_COMM == "full-comm"
    with pytest.raises(autopar.AnnotationError, match=r"recompute\(Block, policy='comm'\).*'full-comm'"):
        autopar.recompute(gpt.build()[0].blocks[0], "comm")
    # every op is recomputed, collectives included: what plain checkpointing does, which it runs under
    assert not uses_policy(FULL_COMM, True) and uses_policy(FULL, True)
    gather, mm = torch.ops.autopar.all_gather.default, torch.ops.aten.mm.default
    decide = apply_recompute.policy_fn(FULL_COMM, (False, True))
    forward = SimpleNamespace(is_recompute=False)
    assert [decide(forward, op) for op in (gather, mm, gather)] == [CheckpointPolicy.PREFER_RECOMPUTE] * 3


class _Gathered(torch.nn.Module):
    """A product of an activation gathered over ``dp`` (the product saves the gathered copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.autopar.all_gather(x, 0, "dp", "slice")  # slice backward: no collective
        return torch.nn.functional.gelu(h @ self.w).sum()


@pytest.mark.parametrize(("policy", "gathers"), [(FULL, 1), (FULL_COMM, 2)])
def test_a_full_comm_region_gathers_again_in_backward(fake_process_group, policy: str, gathers: int) -> None:
    """The gather's output is kept under ``"full"``; under ``"full-comm"`` the region runs under plain
    checkpointing and the gather runs again when backward recomputes the product's operand."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.ir.meta import RECOMPUTE
    from autopar.runtime import collectives

    collectives.register_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    x = torch.randn(3, 8, requires_grad=True)
    gm = torch.export.export(_Gathered(), (x,), strict=False).module()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not torch.ops.aten.sum.default:
            n.meta[RECOMPUTE] = ("layer", policy)
    gm = apply_recompute.run(gm, None)
    assert gm.recompute_0.selective == (policy == FULL)
    collectives.reset_comm_counts()
    gm(x).backward()
    assert collectives.collective_calls() == {("all_gather", "dp"): gathers}


@pytest.mark.parametrize(("style", "mesh"), [("sp", {"tp": 4}), ("dp-tp", {"dp": 2, "tp": 2})])
def test_a_full_comm_region_keeps_its_input_alone(style: str, mesh: dict) -> None:
    """Per block, what its region keeps is its input in its producer's layout (the previous
    block's residual sum; under sequence parallelism a quarter of it), where ``"full"`` keeps
    the outputs of its collectives as well."""
    kept = {}
    for policy in (FULL, FULL_COMM):
        model, args = _model(style, policy)
        plan = autopar.plan(model, args, mesh, cluster="fast-links")
        captured = capture(model, args, None, plan.mesh_spec)
        graph = captured.graph
        decisions = {d.name: d for d in plan.nodes}
        layouts = {n: decisions[n.name].layouts() for n in graph.nodes if n.name in decisions}
        laid = LaidOutGraph(graph=graph, layouts=layouts, mesh=plan.mesh_spec, flows=gradient_flow(captured))
        regions = module_regions(graph, plan.memory.recompute)
        by_node = activation_memory(laid, regions).by_node
        kept[policy] = per_block = Counter()
        for node in graph.nodes:
            if node in regions:
                per_block[regions[node][0]] += by_node.get(node.name, 0.0)
        for i in range(1, LAYERS):  # block 0's input is the embeddings' sum, laid out as the solver chose
            residual = [n for n in graph.nodes if module_path(n) == f"blocks.{i - 1}" and "add" in n.name][-1]
            fraction = local_fraction(layouts[residual].output, plan.mesh_spec)
            if policy == FULL_COMM:
                assert per_block[f"blocks.{i}"] == INPUT_BYTES * fraction, (style, i, per_block)
    if style == "sp":  # the residual stream split by sequence over tp=4
        assert kept[FULL_COMM]["blocks.1"] == INPUT_BYTES / 4
    for i in range(LAYERS):
        assert kept[FULL_COMM][f"blocks.{i}"] * 4 < kept[FULL][f"blocks.{i}"], (style, kept)


def test_backward_is_priced_with_the_forward_collectives_up_to_the_last_saver() -> None:
    """Megatron's row-parallel outputs are all-reduced (whose own backward communicates nothing):
    the attention's all-reduce runs again in backward (the layer norm after it saves its input),
    the MLP's does not (no op after it saves one: torch stops recomputing before it)."""
    plans = {}
    for policy in (FULL, FULL_COMM):
        model, args = _model("dp-tp", policy)
        plans[policy] = autopar.plan(model, args, {"dp": 2, "tp": 2}, cluster="fast-links")
    again = plans[FULL_COMM]
    closing = {
        r.module: r for r in again.redistributions if r.module.endswith(("attn.resid_drop", "mlp.drop"))
    }
    assert len(closing) == 2 * LAYERS
    for module, r in closing.items():
        assert [(c.kind.value, c.mesh_axes) for c in r.forward] == [("all_reduce", ("tp",))]
        assert r.backward == (r.forward if module.endswith("attn.resid_drop") else ()), module
    assert all(not r.backward for r in plans[FULL].redistributions if r.module.endswith("attn.resid_drop"))
    assert again.memory.activation_kept_bytes < plans[FULL].memory.activation_kept_bytes / 4


def test_the_memory_search_takes_full_comm_under_a_budget_only_it_meets() -> None:
    """With no module annotated, full-comm recompute of every block is the search's candidate of
    least memory; an annotated ``"full"`` stays what the user wrote, and the error says so."""
    # one long sequence: activations dominate, and a batch of one accumulates in no fewer rows
    mesh, memory, sizes = {"tp": 4}, autopar.Memory(zero=0), {"batch_size": 1, "seq_len": 256}
    model, args = _model("sp", FULL_COMM, **sizes)
    budget = 1.1 * autopar.plan(model, args, mesh, memory=memory, cluster="fast-links").peak_memory_bytes
    model, args = _model("sp", None, **sizes)
    plan = autopar.plan(model, args, mesh, memory=memory, memory_budget=budget, cluster="fast-links")
    assert plan.peak_memory_bytes <= budget
    assert plan.memory.recompute == {f"blocks.{i}": "full-comm" for i in range(LAYERS)}
    loaded = Plan.from_dict(plan.to_dict())
    assert loaded.memory.recompute == plan.memory.recompute
    assert {policy for _, policy in loaded.lowering.regions.values()} == {"full-comm"}
    model, args = _model("sp", FULL, **sizes)
    with pytest.raises(MemoryFitError, match=r"least memory reached .*recompute of 3 modules \(full\)"):
        autopar.plan(model, args, mesh, memory=memory, memory_budget=budget, cluster="fast-links")


# --------------------------------------------------------------------------- on 4 gloo ranks


def _step(dmodel: DistributedModule, reference: torch.nn.Module, args: tuple, where: str) -> dict:
    """One forward and backward of ``dmodel`` against ``reference`` on one device: the loss and
    every gradient equal; the collectives each pass issued, in order (axes by name), and the bytes
    the step moved beside the plan's prediction."""
    from autopar.runtime import collectives

    issued: list[tuple[str, str]] = []
    count = collectives.count_collective

    def record(kind: str, axis: str, nbytes: int) -> None:
        issued.append((kind, axis.split(".")[0]))  # a second mesh registers its axes as "tp.1"
        count(kind, axis, nbytes)

    collectives.count_collective = record
    try:
        collectives.reset_comm_counts()
        loss = dmodel(*dmodel.shard_inputs(*args)[0])
        forward = len(issued)
        loss.backward()
    finally:
        collectives.count_collective = count
    ref_loss = reference(*args)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-4, msg=lambda m: f"{where}: loss {m}")
    for name, p in dmodel.named_parameters():
        torch.testing.assert_close(
            p.grad.full_tensor(), reference.get_parameter(name).grad, atol=1e-5, rtol=1e-4, msg=name
        )
    moved = (sum(collectives.comm_counts().values()), dmodel.plan.prediction.comm_bytes)
    return {"where": where, "forward": issued[:forward], "backward": issued[forward:], "moved": moved}


def _world() -> dict[str, dict]:
    """Full-comm recompute of every block under Megatron's layouts (dp=2 x tp=2) and sequence
    parallelism (tp=4), and the dp-tp plan lowered with its regions ``"full"``: the same layouts."""
    from torch.distributed.device_mesh import init_device_mesh

    runs, plans = {}, {}
    for style, shape, names in (("dp-tp", (2, 2), ("dp", "tp")), ("sp", (4,), ("tp",))):
        model, args = _model(style, FULL_COMM)
        reference = gpt.build(batch_size=BATCH, n_layers=LAYERS)[0]
        reference.load_state_dict(model.state_dict())
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dmodel = autopar.compile(model, mesh, args, cluster="fast-links")
        runs[style], plans[style] = _step(dmodel, reference, args, f"{style} {FULL_COMM}"), dmodel.plan
    full = Plan.from_dict(plans["dp-tp"].to_dict())
    full.lowering = replace(
        full.lowering, regions={n: (r, FULL) for n, (r, _) in full.lowering.regions.items()}
    )
    model, args = _model("dp-tp", FULL_COMM)  # the annotations the plan records
    reference = gpt.build(batch_size=BATCH, n_layers=LAYERS)[0]
    reference.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs["dp-tp lowered full"] = _step(autopar.compile(model, mesh, args, plan=full), reference, args, "full")
    return runs


@pytest.mark.distributed
def test_full_comm_on_4_gloo_ranks_equals_one_device_and_repeats_the_forward_collectives() -> None:
    ranks = spawn(_world, 4)
    for case, run in ranks[0].items():
        # the same collectives in the same order on every rank (every rank runs one program here)
        assert all(
            r[case]["forward"] == run["forward"] and r[case]["backward"] == run["backward"] for r in ranks
        )
    for r in ranks:
        for case in ("dp-tp", "sp"):
            moved, predicted = r[case]["moved"]
            assert moved == predicted, (case, moved, predicted)  # the repeated collectives included
    again, full = ranks[0]["dp-tp"], ranks[0]["dp-tp lowered full"]
    assert again["forward"] == full["forward"]
    extra = Counter(again["backward"])
    extra.subtract(full["backward"])
    # backward adds forward collectives only: each block's attention all-reduce (its row-parallel
    # output's; a layer norm after it saves its input) but not the MLP's (no op after it saves one)
    # and the all-gathers into its products
    assert min(extra.values()) >= 0 and +extra <= Counter(again["forward"]), extra
    assert extra[("all_reduce", "tp")] == LAYERS and extra[("all_gather", "tp")] > 0, extra
    assert set(+extra) == {("all_reduce", "tp"), ("all_gather", "tp")}, extra
