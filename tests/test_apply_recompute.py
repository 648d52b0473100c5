"""The recompute pass: regions outlined into checkpointed submodules.

Graphs come from ``torch.export`` of small modules; the meta a planner would set is set by
hand on the nodes of one submodule. Each check compares against the same exported module
without the pass: values and gradients, the ops rerun in backward (counted by a dispatch
mode), the bytes held for backward, and the collectives a regather reruns.
"""

from __future__ import annotations

import functools
import gc
import operator
import weakref
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

from autopar.ir.errors import CompileError
from autopar.ir.meta import GRADS, LAYOUTS, RECOMPUTE, REGATHER, STAGE
from autopar.ir.ops import is_autopar_op
from autopar.ir.options import FULL, SELECTIVE
from autopar.ir.plan import Lowering
from autopar.passes import apply_recompute
from autopar.passes.apply_recompute import region_nodes
from autopar.runtime import collectives


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, s, 16))


class Block(nn.Module):
    """``inner`` (the region) between two layers that stay outside it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.inner = inner
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(self.inp(x))).square().sum()


def _example() -> torch.Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))


@functools.cache
def _export(inner: str) -> torch.export.ExportedProgram:
    """A :class:`Block` around an ``"mlp"`` or an ``"attention"``; ``module()`` gives a fresh copy."""
    torch.manual_seed(0)
    model = Block(MLP() if inner == "mlp" else Attention())
    return torch.export.export(model, (_example(),), strict=False)


@pytest.fixture(params=["mlp", "attention"])
def exported(request: pytest.FixtureRequest) -> torch.export.ExportedProgram:
    return _export(request.param)


def _ops_of(gm: torch.fx.GraphModule, path: str) -> list[torch.fx.Node]:
    """The call_function nodes run inside submodule ``path``."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and any(p == path or p.startswith(path + ".") for p, _ in n.meta.get("nn_module_stack", {}).values())
    ]


def _recomputed(ep: torch.export.ExportedProgram, policy: str) -> torch.fx.GraphModule:
    gm = ep.module()
    for n in _ops_of(gm, "inner"):
        n.meta[RECOMPUTE] = ("inner", policy)
    return apply_recompute.run(gm, None)


def _loss_and_grads(gm: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    loss = gm(x)
    return [loss, *torch.autograd.grad(loss, [x, *gm.parameters()])]


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that run, by overload packet name (``"addmm"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(gm: torch.nn.Module) -> Counter[str]:
    loss = gm(_example().requires_grad_())
    with _OpCounter() as counter:
        torch.autograd.grad(loss, list(gm.parameters()))
    return counter.counts


class _StorageTracker(TorchDispatchMode):
    """Remembers, weakly, the storage of every tensor an op returns, with its size."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[tuple[weakref.ref, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.storages.append((weakref.ref(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out


def _held_for_backward(gm: torch.nn.Module) -> int:
    """Bytes of storages created in the forward that are still alive while only the loss is.

    Whatever keeps them (autograd's saved tensors, the checkpoint's cache of kept outputs)
    holds them for backward. Views of the input and the parameters are not counted.
    """
    x = _example().requires_grad_()
    existing = {t.untyped_storage().data_ptr() for t in (x, *gm.parameters())}
    with _StorageTracker() as tracker:
        loss = gm(x)
    gc.collect()
    existing.add(loss.untyped_storage().data_ptr())
    held = {s.data_ptr(): n for ref, n in tracker.storages if (s := ref()) is not None}
    return sum(n for ptr, n in held.items() if ptr not in existing)


@pytest.mark.parametrize("policy", [FULL, SELECTIVE])
def test_loss_and_gradients_are_unchanged(exported: torch.export.ExportedProgram, policy: str) -> None:
    reference = _loss_and_grads(exported.module(), _example())
    gm = _recomputed(exported, policy)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["_guards_fn", "recompute_0"]
    assert isinstance(gm.recompute_0, apply_recompute.Recomputed)
    assert gm.recompute_0.policy == policy
    # no collectives in the region: a full one needs no policy, plain checkpointing recomputes all
    assert gm.recompute_0.selective == (policy == SELECTIVE)
    for got, want in zip(_loss_and_grads(gm, _example()), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_full_reruns_matmuls_and_selective_only_the_cheap_ops(exported: torch.export.ExportedProgram) -> None:
    base = _backward_ops(exported.module())
    full = _backward_ops(_recomputed(exported, FULL)) - base
    selective = _backward_ops(_recomputed(exported, SELECTIVE)) - base
    expensive = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"]
    # Non-reentrant checkpointing stops recomputing once backward has what it needs: the
    # region's last linear, whose output no backward formula reads, does not run again.
    assert sum(full[op] for op in expensive) >= 1
    assert sum(selective[op] for op in expensive) == 0
    cheap = "gelu" if "gelu" in full else "transpose"
    assert full[cheap] >= 1 and selective[cheap] >= 1


def test_full_holds_fewest_bytes_for_backward(exported: torch.export.ExportedProgram) -> None:
    full = _held_for_backward(_recomputed(exported, FULL))
    assert full < _held_for_backward(_recomputed(exported, SELECTIVE))
    assert full < _held_for_backward(exported.module())


def test_selective_holds_fewer_bytes_than_no_recompute_around_an_mlp() -> None:
    # Not so around the attention: its cheap ops are views, so selective keeps what autograd
    # keeps anyway, plus the last linear's output that no backward formula reads.
    ep = _export("mlp")
    assert _held_for_backward(_recomputed(ep, SELECTIVE)) < _held_for_backward(ep.module())


def test_outputs_stay_under_their_names_as_getitems_with_layouts() -> None:
    gm = _export("mlp").module()
    region = _ops_of(gm, "inner")
    last = region[-1]  # the residual add: the region's one value read outside
    last.meta[LAYOUTS] = (((Replicate(),), (Replicate(),)), ((Replicate(),),))
    last.meta[GRADS] = ((Replicate(),), (Replicate(),))
    for n in region:
        n.meta[RECOMPUTE] = ("inner", FULL)
    names = {n.name for n in gm.graph.nodes} - {n.name for n in region[:-1]}
    gm = apply_recompute.run(gm, None)
    call = next(n for n in gm.graph.nodes if n.target == "recompute_0")
    (out,) = call.users
    assert (out.name, out.target, out.args) == (last.name, operator.getitem, (call, 0))
    assert out in gm.graph.find_nodes(op="call_function", target=operator.getitem)
    assert {n.name for n in gm.graph.nodes} == names | {"recompute_0"}
    assert out.meta[LAYOUTS] == (((Replicate(),),), ((Replicate(),),))
    assert GRADS not in out.meta and RECOMPUTE not in out.meta
    assert call.meta["val"][0].shape == out.meta["val"].shape == (2, 6, 16)
    assert call.meta["nn_module_stack"] == region[0].meta["nn_module_stack"]


def test_a_region_over_two_stages_is_split_in_two() -> None:
    ep = _export("mlp")
    gm = ep.module()
    region = _ops_of(gm, "inner")
    for i, n in enumerate(region):
        n.meta[RECOMPUTE] = ("inner", SELECTIVE)
        n.meta[STAGE] = 0 if i < 2 else 1
    assert list(region_nodes(gm.graph)) == [("inner", 0), ("inner", 1)]
    gm = apply_recompute.run(gm, None)
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("recompute")]
    assert [(n.target, n.meta[STAGE]) for n in calls] == [("recompute_0", 0), ("recompute_1", 1)]
    assert region_nodes(gm.graph) == {}
    for got, want in zip(
        _loss_and_grads(gm, _example()), _loss_and_grads(ep.module(), _example()), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_graph_without_regions_is_returned_unchanged() -> None:
    gm = _export("mlp").module()
    code = gm.code
    assert apply_recompute.run(gm, None) is gm
    assert gm.code == code


class Interleaved(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.sin(x)  # region
        b = torch.cos(y)  # outside, read by the region
        d = a * 2  # outside, reads the region
        c = torch.tanh(a + b)  # region
        return (c + d).sum()


def _interleaved(region: set[str]) -> torch.fx.GraphModule:
    gm = torch.export.export(Interleaved(), (torch.randn(3), torch.randn(3)), strict=False).module()
    for n in gm.graph.nodes:
        if n.name in region:
            n.meta[RECOMPUTE] = ("r", FULL)
    return gm


def test_an_interleaved_region_moves_the_nodes_that_read_it_after_the_call() -> None:
    gm = apply_recompute.run(_interleaved({"sin", "add", "tanh"}), None)
    order = [n.name for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_module"]
    assert order == ["_guards_fn", "cos", "recompute_0", "sin", "tanh", "mul", "add_1", "sum_1"]
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    got = torch.autograd.grad(gm(x, y), [x, y])
    want = torch.autograd.grad(Interleaved()(x, y), [x, y])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_region_reading_its_own_value_through_an_outside_node_is_refused() -> None:
    with pytest.raises(CompileError, match="cycle"):
        apply_recompute.run(_interleaved({"sin", "tanh"}), None)  # sin -> add (outside) -> tanh


def test_inconsistent_marks_are_refused() -> None:
    gm = _interleaved({"sin"})
    gm.graph.find_nodes(op="call_function", target=torch.ops.aten.tanh.default)[0].meta[RECOMPUTE] = (
        "r",
        SELECTIVE,
    )
    with pytest.raises(CompileError, match="'selective' here but 'full' before"):
        apply_recompute.run(gm, None)
    gm = _interleaved(set())
    gm.graph.find_nodes(op="call_function", target=torch.ops.aten.sin.default)[0].meta[REGATHER] = True
    with pytest.raises(CompileError, match="in no recompute region"):
        apply_recompute.run(gm, None)


def test_policy_keeps_collectives_but_not_regathers() -> None:
    gather, mm, gelu = (
        torch.ops.autopar.all_gather.default,
        torch.ops.aten.mm.default,
        torch.ops.aten.gelu.default,
    )
    forward = SimpleNamespace(is_recompute=False)
    full = apply_recompute.policy_fn(FULL, (False, True))
    assert [full(forward, op) for op in (gather, mm, gelu, gather)] == [
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
        CheckpointPolicy.PREFER_RECOMPUTE,
        CheckpointPolicy.PREFER_RECOMPUTE,
    ]
    with pytest.raises(RuntimeError, match="autopar op #2"):
        full(forward, gather)
    selective = apply_recompute.policy_fn(SELECTIVE, (True,))
    assert [selective(forward, op) for op in (gather, mm, gelu)] == [
        CheckpointPolicy.PREFER_RECOMPUTE,
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
    ]


class Gathered(nn.Module):
    """A ZeRO-3 style layer: this rank's shard of the weight, gathered before use."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 8))  # a quarter of the (8, 8) weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.ops.autopar.all_gather(self.w, 0, "dp", "slice")  # slice backward: no collective
        return F.gelu(x @ w.t()).sum()


@pytest.mark.parametrize(
    ("policy", "regather", "gathers"), [(FULL, True, 2), (SELECTIVE, True, 2), (FULL, False, 1)]
)
def test_a_regather_gathers_again_in_backward(
    fake_process_group: None, policy: str, regather: bool, gathers: int
) -> None:
    collectives.register_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    x = torch.randn(3, 8)
    gm = torch.export.export(Gathered(), (x,), strict=False).module()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not torch.ops.aten.sum.default:
            n.meta[RECOMPUTE] = ("layer", policy)
            n.meta[REGATHER] = regather and n.target is torch.ops.autopar.all_gather.default
    gm = apply_recompute.run(gm, None)
    assert gm.recompute_0.regathers == (regather,)
    assert gm.recompute_0.selective  # a collective in it: kept, or gathered again, by the policy
    collectives.reset_comm_counts()
    gm(x).backward()
    assert collectives.collective_calls() == {("all_gather", "dp"): gathers}


def test_batch_norm_statistics_are_updated_outside_every_region() -> None:
    """A checkpoint keeps its inputs and refuses one changed in place since (a buffer's
    ``num_batches_tracked``), and a replayed update would apply twice: the ops writing into a
    buffer stay out of the recomputed module's region, every other op of it is in."""
    from autopar.capture.export import capture
    from autopar.ir.mesh import MeshSpec
    from autopar.ir.meta import module_stack
    from autopar.planning.memory.recompute import module_regions, updates_state

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(self.bn(self.conv(x))) + x

    model = nn.Sequential(Block(), Block())
    graph = capture(model, (torch.randn(2, 4, 8, 8),), None, MeshSpec.of({"dp": 1})).graph
    regions = module_regions(graph, {"0": FULL})
    updates = [n for n in graph.nodes if updates_state(n)]
    # per batch norm: num_batches_tracked, and the running mean and variance (scaled, then added to)
    assert len(updates) == 2 * 5 and not any(n in regions for n in updates)
    first = [n for n in graph.nodes if n.op == "call_function" and "0" in module_stack(n)]
    computing = [n for n in first if n.target is not operator.getitem and not updates_state(n)]
    computing = [n for n in computing if not n.name.startswith("layout_constraint")]  # their users' region
    assert computing and all(regions[n] == ("0", FULL) for n in computing)


class _GatheredView(nn.Module):
    """A layer gathering a view of its weight (``weight.T``, as Falcon's projections read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = Gathered()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.ops.autopar.all_gather(self.layer.w.t(), 1, "dp", "slice")
        return F.gelu(x @ w).sum()


def test_a_gather_of_a_view_of_a_parameter_is_gathered_again(fake_process_group: None) -> None:
    """The plan counts a gather of a parameter in a recompute region as run again in backward
    (what it reads is held anyway), a view of one too; the pass marks it so, or the region
    keeps the gathered weight the plan left out (Falcon measured 1.58x its prediction)."""
    from autopar.passes import mark_recompute

    collectives.register_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    # the exported program's own graph: parameters are placeholders there, as in a lowered one
    gm = torch.export.export(_GatheredView(), (torch.randn(3, 8),), strict=False).graph_module
    for n in gm.graph.nodes:
        if n.op == "call_function":  # the layer's ops, as if the module had made them
            n.meta["nn_module_stack"] = {"L__self___layer": ("layer", Gathered)}
    # the plan's record: the layer's ops in its region, weight.T a view of a parameter (held anyway)
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and not is_autopar_op(n.target)]
    view = next(n.name for n in ops if n.target is torch.ops.aten.t.default)
    regions = {n.name: ("layer", FULL) for n in ops}
    lowering = Lowering(edges=(), gradient_sums={}, regions=regions, gathered={}, held=(view,))
    plan = SimpleNamespace(nodes=[SimpleNamespace(name=n.name) for n in gm.graph.nodes], lowering=lowering)
    gm = mark_recompute.run(gm, SimpleNamespace(plan=plan, lowering=lowering))
    (gather,) = gm.graph.find_nodes(op="call_function", target=torch.ops.autopar.all_gather.default)
    assert gather.args[0].target is torch.ops.aten.t.default
    assert gather.meta[REGATHER] and gather.meta[RECOMPUTE] == ("layer", FULL)
