"""Activation memory: per-op saved tensors (``saved_by``) and their sum against ``ActivationMeter``."""

from __future__ import annotations

import operator
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import checkpoint

import autopar
import examples.gpt as gpt
from autopar.capture.exact_means import ExactMeans
from autopar.planning.memory.saved_tensors import SavedSpec, saved_by
from autopar.tools.activation_meter import ActivationMeter

aten = torch.ops.aten
F32 = 4


@torch.library.custom_op("autopar_tests::square", mutates_args=())
def square(x: torch.Tensor) -> torch.Tensor:
    """``x * x``; its backward keeps ``x``."""
    return x * x


@square.register_fake
def _square_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _square_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _square_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return 2 * x * grad


square.register_autograd(_square_backward, setup_context=_square_setup)


@torch.library.custom_op("autopar_tests::no_fake", mutates_args=())
def no_fake(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An op with no fake kernel: ``saved_by`` cannot run it and must assume the worst."""
    return x + y


def call_node(target, *args, **kwargs) -> torch.fx.Node:
    """An fx node calling ``target`` on placeholders for the tensor arguments (given as meta tensors)."""
    graph = torch.fx.Graph()
    nodes: dict[int, torch.fx.Node] = {}  # one placeholder per tensor, however often it is passed

    def placeholder(a):
        if not isinstance(a, torch.Tensor):
            return a
        if id(a) not in nodes:
            nodes[id(a)] = graph.placeholder(f"t{len(nodes)}")
            nodes[id(a)].meta["val"] = a
        return nodes[id(a)]

    node_args, node_kwargs = torch.utils._pytree.tree_map(placeholder, (args, kwargs))
    node = graph.call_function(target, tuple(node_args), node_kwargs)
    node.meta["val"] = target(*args, **kwargs)
    return node


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def spec(inputs=(), outputs=(), extra_bytes=0) -> SavedSpec:
    return SavedSpec(frozenset(inputs), frozenset(outputs), extra_bytes)


def saved_as(node: torch.fx.Node, flags) -> SavedSpec:
    """What :func:`saved_by` says is saved, its count of packed tensors and their order aside
    (tested apart)."""
    return replace(saved_by(node, flags), packed=0, output_before_last_pack=False)


@pytest.mark.parametrize("flags, packed", [((True, True), 2), ((False, True), 1), ((False, False), 0)])
def test_a_spec_counts_the_tensors_autograd_packs(flags, packed):
    assert saved_by(call_node(aten.mm.default, meta(4, 8), meta(8, 3)), flags).packed == packed
    x = meta(4, 8)  # one tensor packed twice counts twice: the checkpoint's hooks run for each
    assert saved_by(call_node(aten.mul.Tensor, x, x), [True, True]).packed == 2


def test_a_spec_says_whether_the_output_exists_at_the_last_pack():
    # autograd packs a product's operands before it runs, a layer norm's statistics after: a
    # recomputation torch stops at the last pack holds the layer norm's output, not the product's
    product = call_node(aten.mm.default, meta(4, 8), meta(8, 3))
    assert not saved_by(product, [True, True]).output_before_last_pack
    norm = call_node(aten.layer_norm.default, meta(4, 8), [8], meta(8), meta(8))
    assert saved_by(norm, [True, True, True]).output_before_last_pack
    linear = call_node(aten.linear.default, meta(2, 4, 8), meta(3, 8))  # the product last
    assert not saved_by(linear, [True, True]).output_before_last_pack


@pytest.mark.parametrize(
    "flags, saved",
    [((True, True), {0, 1}), ((False, True), {0}), ((True, False), {1}), ((False, False), set())],
)
def test_mm_saves_the_operand_the_other_gradient_needs(flags, saved):
    node = call_node(aten.mm.default, meta(4, 8), meta(8, 3))
    assert saved_as(node, flags) == spec(saved)


@pytest.mark.parametrize(
    "target, expected",
    [
        (aten.gelu.default, spec(inputs={0})),
        (aten.tanh.default, spec(outputs={0})),
        (aten.relu.default, spec(outputs={0})),
        (aten.sigmoid.default, spec(outputs={0})),
    ],
)
def test_pointwise_ops_save_input_or_output(target, expected):
    assert saved_as(call_node(target, meta(4, 8)), [True]) == expected


def test_add_saves_nothing_and_a_self_product_saves_its_operand_once():
    assert saved_as(call_node(aten.add.Tensor, meta(4, 8), meta(4, 8)), [True, True]) == spec()
    x = meta(4, 8)
    assert saved_as(call_node(aten.mul.Tensor, x, x), [True, True]) == spec(inputs={0})


def test_softmax_saves_its_output():
    node = call_node(aten._softmax.default, meta(4, 8), -1, False)
    assert saved_as(node, [True]) == spec(outputs={0})


def test_layer_norm_saves_input_affine_and_statistics():
    x, w, b = meta(2, 8, 64), meta(64), meta(64)
    # native_layer_norm returns its mean and rstd, so they are saved outputs
    native = call_node(aten.native_layer_norm.default, x, [64], w, b, 1e-5)
    assert saved_as(native, [True, True, True]) == spec(inputs={0, 1, 2}, outputs={1, 2})
    # the composite returns only the normalised tensor: the statistics (2 x 8 rows each) are extra
    composite = call_node(aten.layer_norm.default, x, [64], w, b, 1e-5, False)
    assert saved_as(composite, [True, True, True]) == spec(inputs={0, 1, 2}, extra_bytes=2 * 16 * F32)


def test_embedding_saves_only_the_indices():
    node = call_node(aten.embedding.default, meta(10, 4), meta(3, dtype=torch.long))
    assert saved_as(node, [True, False]) == spec(inputs={1})


def test_linear_saves_views_of_its_operands_as_the_operands():
    node = call_node(aten.linear.default, meta(2, 8, 64), meta(16, 64), meta(16))
    assert saved_as(node, [True, True, True]) == spec(inputs={0, 1})
    assert saved_by(node, [True, True, True]) is saved_by(node, [True, True, True])  # cached


def test_dropout_saves_a_mask_on_cpu():
    node = call_node(aten.dropout.default, meta(4, 8), 0.1, True)
    assert saved_as(node, [True]) == spec(extra_bytes=4 * 8 * F32)  # CPU's mask is a float tensor
    assert saved_as(call_node(aten.dropout.default, meta(4, 8), 0.0, True), [True]) == spec()


def test_attention_follows_the_cpu_kernel_not_the_meta_math_path():
    q, k, v = meta(2, 4, 32, 16), meta(2, 4, 32, 16), meta(2, 4, 32, 16)
    lse = 2 * 4 * 32 * F32
    composite = call_node(aten.scaled_dot_product_attention.default, q, k, v, None, 0.0, True)
    # the math path would save the 32 x 32 attention weights per head
    assert saved_as(composite, [True, True, True]) == spec(inputs={0, 1, 2}, outputs={0}, extra_bytes=lse)
    flash = call_node(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, True)
    assert saved_as(flash, [True, True, True]) == spec(inputs={0, 1, 2}, outputs={0, 1})


def test_nodes_that_are_not_aten_calls_save_nothing():
    node = call_node(aten.native_layer_norm.default, meta(4, 8), [8], None, None, 1e-5)
    item = node.graph.call_function(operator.getitem, (node, 0))
    assert saved_as(item, []) == spec()
    assert saved_as(node.graph.placeholder("p"), []) == spec()


def test_custom_ops_report_what_their_autograd_saves_or_the_worst_case():
    assert saved_as(call_node(square._opoverload, meta(4, 8)), [True]) == spec(inputs={0})
    node = call_node(aten.add.Tensor, meta(4, 8), meta(4, 8))
    node.target = no_fake._opoverload  # it has no meta kernel either, so the node is made for add
    assert saved_as(node, [True, False]) == spec(inputs={0})


def test_measured_saves_serve_every_plan_made_on_the_capture(monkeypatch: pytest.MonkeyPatch):
    """The automatic mesh measures what a capture's ops save once, before forking the processes
    that plan on it: a plan made afterwards measures no op's global spec again (only the pieces
    one rank holds, which depend on the mesh)."""
    from autopar.capture.export import gradient_flow
    from autopar.ir.mesh import MeshSpec
    from autopar.planning.memory import saved_tensors
    from autopar.planning.planner import capture_for, plan_captured

    model, (idx, _) = gpt.build(device="meta", batch_size=8)
    mesh = MeshSpec.of({"dp": 2, "tp": 2})
    captured = capture_for(model, (idx,), None, mesh, None)
    monkeypatch.setattr(saved_tensors, "_CACHE", {})  # nothing measured by other tests
    saved_tensors.measure_saved(captured.graph, gradient_flow(captured))
    assert saved_tensors._CACHE
    measure, again = saved_tensors._measure, []

    def recorded(node, call, flags, pieces):
        if pieces is None:
            again.append(node.name)
        return measure(node, call, flags, pieces)

    monkeypatch.setattr(saved_tensors, "_measure", recorded)
    plan_captured(captured, mesh, cluster="fast-links")
    assert again == []


def test_wrong_number_of_flags_is_an_error():
    with pytest.raises(ValueError, match="2 tensor operands"):
        saved_by(call_node(aten.mm.default, meta(4, 8), meta(8, 3)), [True])


# --- end to end: predicted against measured ---------------------------------------------------------


class SmallMLP(nn.Module):
    """Linear - GELU - Linear - LayerNorm, optionally the first three under activation checkpointing."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 128)
        self.act = nn.GELU()
        self.proj = nn.Linear(128, 32)
        self.norm = nn.LayerNorm(32)
        self.checkpointed = checkpointed

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return self.norm(checkpoint(self.body, x, use_reentrant=False))
        return self.norm(self.body(x))


class SquareMLP(nn.Module):
    """Linear - custom square op - Linear: a forward with a custom op in it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.proj = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(square(self.fc(x)))


def predicted(model: nn.Module, args: tuple) -> int:
    """The plan's activations kept after the forward on one device: what backward needs and the
    outputs the caller holds."""
    return autopar.plan(model, args, {"dp": 1}).memory.activation_kept_bytes


def measured(model: nn.Module, args: tuple) -> tuple[ActivationMeter, torch.Tensor]:
    """One training step under the meter, marked after the forward and after the backward; and the output.

    The model runs its losses as captured (``ExactMeans``: cross entropy as its formula, which
    saves the logits and their exponentials where the fused op saves the log-softmax): the
    prediction is of the captured program's saves.
    """
    with ActivationMeter() as meter, ExactMeans():
        out = model(*args)
        meter.mark("after_forward")
        out.sum().backward()
        meter.mark("after_backward")
    return meter, out


@pytest.mark.parametrize(
    "build",
    [
        lambda: (SmallMLP(), (torch.randn(4, 16, 32),)),
        lambda: (SquareMLP(), (torch.randn(4, 16, 32),)),
        lambda: gpt.build(dropout=0.1),
        lambda: gpt.build(),
    ],
    ids=["mlp", "custom-op", "gpt-dropout", "gpt"],
)
def test_predicted_saved_bytes_match_the_meter(build):
    torch.manual_seed(0)
    model, args = build()
    expected = predicted(model, args)
    meter, out = measured(model, args)
    assert expected / meter.marks["after_forward"] == pytest.approx(1.0, abs=0.02)
    assert meter.peak >= meter.marks["after_forward"]
    # backward freed everything autograd saved: only the output, still referenced, is alive
    assert meter.marks["after_backward"] == out.untyped_storage().nbytes()


def test_checkpointing_shrinks_what_the_forward_keeps_and_recomputes_in_backward():
    torch.manual_seed(0)
    plain, (x,) = SmallMLP(), (torch.randn(4, 16, 32),)
    ckpt = SmallMLP(checkpointed=True)
    ckpt.load_state_dict(plain.state_dict())
    (full, _), (saved, _) = measured(plain, (x,)), measured(ckpt, (x,))
    assert saved.marks["after_forward"] < full.marks["after_forward"] / 2
    # backward rebuilds the fc and GELU outputs (4 x 16 x 128 each) under grad mode: they are counted
    assert 2 * 4 * 16 * 128 * F32 < saved.peak < full.peak


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def test_meter_counts_storages_allocated_in_the_forward_while_alive():
    x = torch.randn(64, 64, requires_grad=True)
    size = 64 * 64 * F32
    with ActivationMeter() as meter:
        y = x * 2
        views = (y.view(-1), y.t(), y[1:])  # views allocate nothing
        y.mul_(3)  # in place: no new storage
        with torch.no_grad():
            z = x + 1  # not activations
        with torch.inference_mode():
            i = torch.ones(64, 64)
        assert meter.live == size
        # allocated by ops under grad mode, whether or not they need grad: the ones freed right away
        w = torch.ones(64, 64) + y
        assert meter.live == 2 * size
        del y, views, w
        assert meter.live == 0
        doubled = Double.apply(x)  # an autograd.Function runs its forward with grad mode off
        assert meter.live == size
    assert meter.peak == 3 * size
    assert doubled.shape == z.shape == i.shape


def test_meter_counts_a_wrapper_subclass_by_its_inner_tensors():
    a, b = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    x = TwoTensor(a, b)
    with ActivationMeter() as meter:
        y = x * 2  # a TwoTensor of two fresh 64 x 64 tensors
        assert meter.live == 2 * 64 * 64 * F32
    assert isinstance(y, TwoTensor)


def test_a_composite_reports_the_products_it_runs_inside():
    """Attention's math path multiplies q by k first: that product is neither saved nor returned,
    but a selective recompute region keeps every product's output (the policy sees the inner
    ops), so the plan counts it; the flash kernel's statistics are saved, counted already."""
    q, k, v = meta(2, 4, 32, 16), meta(2, 4, 32, 16), meta(2, 4, 32, 16)
    math = call_node(aten._scaled_dot_product_attention_math.default, q, k, v, None, 0.0, True)
    assert saved_by(math, [True, True, True]).inner_product_bytes == 2 * 4 * 32 * 32 * F32
    flash = call_node(aten.scaled_dot_product_attention.default, q, k, v, None, 0.0, True)
    assert saved_by(flash, [True, True, True]).inner_product_bytes == 0
    assert (
        saved_by(
            call_node(aten.linear.default, meta(2, 8, 64), meta(16, 64)), [True, True]
        ).inner_product_bytes
        == 0
    )
