"""A projection cut into parts of unequal sizes (grouped-query q, k and v in one weight) is captured
as one projection per part, so each part splits by its own heads.

Capture and planning only; the model zoo trains such a Phi-3 on 4 gloo ranks against one device,
its attention split by heads (``tests/test_model_zoo.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.capture.export import capture
from autopar.ir.mesh import MeshSpec

aten = torch.ops.aten


class _FusedQKV(nn.Module):
    def __init__(self, q: int, kv: int, whole_too: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, q + 2 * kv)
        self.q, self.kv, self.whole_too = q, kv, whole_too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        q, k, v = qkv[..., : self.q], qkv[..., self.q : self.q + self.kv], qkv[..., self.q + self.kv :]
        out = q.sum(-1) + k.sum(-1) * v.sum(-1)
        return out + qkv.mean(-1) if self.whole_too else out


def _linears(model: nn.Module) -> list[torch.fx.Node]:
    captured = capture(model, (torch.randn(2, 3, 16),), {}, MeshSpec(("tp",), (2,)))
    return [n for n in captured.graph.nodes if n.target is aten.linear.default]


def test_unequal_parts_become_one_projection_per_part_on_the_weights_slices():
    linears = _linears(_FusedQKV(q=8, kv=4))
    assert [tuple(n.meta["val"].shape) for n in linears] == [(2, 3, 8), (2, 3, 4), (2, 3, 4)]
    for node, (start, end) in zip(linears, [(0, 8), (8, 12), (12, 16)]):
        weight = node.args[1]
        assert weight.target is aten.slice.Tensor and weight.args[1:] == (0, start, end)
        assert node.meta["nn_module_stack"] == linears[0].meta["nn_module_stack"]  # still qkv's


def test_equal_parts_and_a_projection_also_used_whole_are_left_as_they_are():
    assert len(_linears(_FusedQKV(q=4, kv=4))) == 1  # a strided shard splits equal parts
    assert len(_linears(_FusedQKV(q=8, kv=4, whole_too=True))) == 1


def test_the_rewritten_program_computes_what_the_model_does():
    torch.manual_seed(0)
    model, x = _FusedQKV(q=8, kv=4), torch.randn(2, 3, 16, requires_grad=True)
    program = capture(model, (x,), {}, MeshSpec(("tp",), (2,))).program.module()
    torch.testing.assert_close(program(x), model(x))  # the same dot products, up to their order


def test_a_gqa_fused_projection_splits_by_heads():
    import transformers

    from tests.zoo_models import build

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model, _, kwargs = build("phi3 (fused q, k, v of unequal parts)")  # 8 heads, 2 kv heads
    plan = autopar.plan(model, (), {"tp": 2}, example_kwargs=kwargs, cluster="fast-links")
    layer = [n for n in plan.nodes if n.module.startswith("model.layers.0.self_attn")]
    parts = [n for n in layer if n.op == "aten.linear.default" and n.module.endswith("qkv_proj")]
    assert [n.outputs for n in parts] == [("S(2)",)] * 3  # q, k and v, each by its own heads
    attention = next(n for n in layer if "scaled_dot_product" in n.op)
    assert attention.operands[:3] == ("S(1)",) * 3  # q heads on the rank of the kv heads they share


def test_a_parameter_plan_gives_a_gqa_projection_its_parts_split_by_heads():
    import transformers

    from tests.zoo_models import build

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model, _, kwargs = build("phi3 (fused q, k, v of unequal parts)")  # 8 heads, 2 kv heads of 64
    qkv = autopar.Parts("tp", (512, 128, 128))
    for layer in model.model.layers:
        autopar.shard(layer.self_attn, parameter_plan={"qkv_proj.weight": (qkv, None)})
    # the cpu-gloo preset alone would keep a model this small whole on every rank
    plan = autopar.plan(model, (), {"tp": 2}, example_kwargs=kwargs)
    parts = [n for n in plan.nodes if n.module == "model.layers.0.self_attn.qkv_proj" and "linear" in n.op]
    assert [n.operands[1] for n in parts] == ["S(0)"] * 3  # each part's weight slice by its rows


def test_unequal_parts_that_do_not_fit_are_refused_naming_the_parameter():
    model = _FusedQKV(q=8, kv=4)
    mesh = MeshSpec(("tp",), (2,))
    for parts, words in [
        ((8, 4, 2), "add up to 14"),
        ((9, 3, 4), "do not split evenly over mesh axis 'tp'"),
        ((4, 8, 4), r"no projection \(linear\) reads it with its output cut"),
    ]:
        autopar.shard(model.qkv, parameter_plan={"weight": (autopar.Parts("tp", parts), None)})
        with pytest.raises(autopar.AnnotationError, match=words):
            capture(model, (torch.randn(2, 3, 16),), {}, mesh)
    autopar.shard(model.qkv, in_strategy=((None, None, autopar.Parts("tp", (8, 4, 4))),))
    with pytest.raises(autopar.AnnotationError, match="only a parameter_plan takes"):
        capture(model, (torch.randn(2, 3, 16),), {}, mesh)
