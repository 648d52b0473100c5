"""A rule returns None for a call form it does not cover; a rule that raises is a bug.

Every rule runs over every op call of the example models and of the fuzz bench's seeded cases
without raising (the zoo's models are planned by ``tests/test_model_zoo.py``, where a rule that
raises fails too); hand-made calls that no rule covers are refused with None (each by a guard at
the top of its rule), and the forms beside them stay labelled. A broken rule's error reaches the
caller through ``spec_of`` and through planning, where a declined call is replicated and listed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import transformers

import autopar
from autopar.capture.export import capture
from autopar.ir.mesh import MeshSpec
from autopar.rules import RULES, OpCall, Rule, RuleError, lookup, spec_of
from bench.fuzz import draw
from tests.test_fuzz import SEEDS
from tests.test_rules import make_node

aten = torch.ops.aten
transformers.logging.set_verbosity_error()
MESH = MeshSpec(("dp", "tp"), (2, 2))


def _examples() -> Iterator[tuple[torch.nn.Module, tuple, dict, MeshSpec]]:
    from examples import cnn, gpt, megatron_gpt2, mlp, recommender
    from examples.handwritten import HANDWRITTEN

    torch.manual_seed(0)
    yield *mlp.build(), {}, MESH
    yield *gpt.build(), {}, MESH
    yield *cnn.build(batch_size=4), {}, MESH
    model, args, _ = recommender.build()
    yield model, args, {}, MESH
    model, kwargs = megatron_gpt2.build()
    yield model, (), kwargs, MESH
    for build in HANDWRITTEN.values():
        yield *build(), MESH


def _fuzzed() -> Iterator[tuple[torch.nn.Module, tuple, dict, MeshSpec]]:
    for seed in SEEDS:
        case, model, inputs = draw(seed)
        mesh = MeshSpec(tuple(n for n, _ in case.mesh), tuple(s for _, s in case.mesh))
        yield model, inputs, {}, mesh


@pytest.mark.parametrize("models", [_examples, _fuzzed], ids=["examples", "fuzz"])
def test_every_rule_labels_every_op_call_of_these_models_without_raising(models: Callable) -> None:
    labelled = 0
    for model, args, kwargs, mesh in models():
        graph = capture(model, args, kwargs, mesh).graph
        for node in graph.nodes:
            if node.op == "call_function" and lookup(node.target) is not None:
                labelled += spec_of(OpCall.of(node)) is not None  # raises RuleError where a rule raises
    assert labelled > 300


_NUMBER = torch.tensor(2.0)
_IDS = torch.tensor(0)

#: Call forms no rule covers, each refused by a guard at the top of its rule (they raised before).
DECLINED = {
    "linear with a vector weight": (aten.linear.default, (torch.randn(3, 4), torch.randn(4))),
    "softmax of a number": (aten._softmax.default, (_NUMBER, 0, False)),
    "sum over dim 0 of a number": (aten.sum.dim_IntList, (_NUMBER, [0])),
    "amax over dim 0 of a number": (aten.amax.default, (_NUMBER, [0])),
    "max over dim 0 of a number": (aten.max.dim, (_NUMBER, 0)),
    "transpose of a number": (aten.transpose.int, (_NUMBER, 0, -1)),
    "t of a number": (aten.t.default, (_NUMBER,)),
    "cumsum of a number": (aten.cumsum.default, (_NUMBER, 0)),
    "topk of a number": (aten.topk.default, (_NUMBER, 1)),
    "gather from a number": (aten.gather.default, (_NUMBER, 0, _IDS)),
    "index_select from a number": (aten.index_select.default, (_NUMBER, 0, _IDS.reshape(1))),
    "scatter into a number": (aten.scatter.value, (_NUMBER, 0, _IDS, 1.0)),
    "index_add into a number": (aten.index_add.default, (_NUMBER, 0, _IDS.reshape(1), _NUMBER)),
    "batch_norm of an empty vector": (
        aten.batch_norm.default,
        (torch.randn(0), *[None] * 4, True, 0.1, 0.0, False),
    ),
    "repeat_interleave of a number": (aten.repeat_interleave.self_int, (_NUMBER, 2)),
    "view of empty dims on one side only": (aten.view.default, (torch.randn(4, 0), [0])),
    "split of an empty dim into empty parts": (aten.split_with_sizes.default, (torch.randn(0), [0, 0])),
    "index_put through a mask of two dims": (
        aten.index_put.default,
        (torch.randn(4, 8), [torch.rand(4, 8) > 0.5], torch.tensor(1.0)),
    ),
}

#: Forms beside those guards that their rules still label.
COVERED = {
    "sum over no dims of a number": (aten.sum.dim_IntList, (_NUMBER, [])),
    "permute of a number": (aten.permute.default, (_NUMBER, [])),
    "roll of a number, flattened": (aten.roll.default, (_NUMBER, [1])),
    "view of an empty leading dim": (aten.view.default, (torch.randn(0, 4), [0, 2, 2])),
    "split of an empty dim into one part": (aten.split.Tensor, (torch.randn(0), 1)),
    "linear with a matrix weight": (aten.linear.default, (torch.randn(3, 4), torch.randn(2, 4))),
}


@pytest.mark.parametrize("form", DECLINED)
def test_a_call_form_a_rule_does_not_cover_is_refused_with_none(form: str) -> None:
    op, args = DECLINED[form]
    call = OpCall.of(make_node(op, args, {}))
    assert lookup(op).fn(call) is None
    assert spec_of(call) is None


@pytest.mark.parametrize("form", COVERED)
def test_the_forms_beside_those_guards_stay_labelled(form: str) -> None:
    op, args = COVERED[form]
    assert spec_of(OpCall.of(make_node(op, args, {}))) is not None


def _broken_rule(call: OpCall) -> None:
    raise ZeroDivisionError("integer modulo by zero")


def _declining_rule(call: OpCall) -> None:
    return None


class _Gelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.act = torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x)).sum()


def test_a_rule_that_raises_is_a_rule_error_naming_the_op_the_node_and_the_rule(monkeypatch) -> None:
    monkeypatch.setitem(RULES, aten.gelu.default, Rule(_broken_rule, anchor=False, family="test"))
    call = OpCall.of(make_node(aten.gelu.default, (torch.randn(4, 8),), {}))
    with pytest.raises(RuleError) as raised:
        spec_of(call)
    message = str(raised.value)
    assert f"the sharding rule {__name__}._broken_rule of aten.gelu.default" in message
    assert "raised ZeroDivisionError: integer modulo by zero, on node 'gelu_default'" in message
    assert "(module '<root>', operand shapes [[4, 8]])" in message
    assert "must return None for a call form it does not cover" in message
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    assert not isinstance(raised.value, autopar.AutoparError)  # a bug, not a refused input


def test_planning_raises_a_rules_error_and_replicates_a_call_its_rule_declines(monkeypatch) -> None:
    x = torch.randn(4, 8)
    monkeypatch.setitem(RULES, aten.gelu.default, Rule(_broken_rule, anchor=False, family="test"))
    with pytest.raises(RuleError, match=r"of aten\.gelu\.default raised .* on node 'gelu' \(module 'act'"):
        autopar.plan(_Gelu(), (x,), {"dp": 2})
    monkeypatch.setitem(RULES, aten.gelu.default, Rule(_declining_rule, anchor=False, family="test"))
    plan = autopar.plan(_Gelu(), (x,), {"dp": 2})
    assert "no sharding rule for aten.gelu.default in module 'act': replicated" in plan.warnings
