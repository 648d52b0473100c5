"""The routing rules (``autopar/rules/routing.py``) and the ops added to views and reductions,
checked against single-device results with the harness of ``tests/test_rules.py`` (every
output compared: ``topk`` and ``sort`` give values and indices; accumulating writes with
their float operands split into addends beside an integer index).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.rules import OpCall, enumerate_strategies, lookup, spec_of
from tests import test_rules as harness  # the module, so pytest does not collect its tests twice
from tests.test_rules import MESHES, make_node, r

aten = torch.ops.aten
torch.manual_seed(0)


def _rows(n: int, of: int, cols: int) -> torch.Tensor:
    """An index of ``n`` distinct rows out of ``of`` in every column (no two writes collide)."""
    return torch.argsort(torch.rand(of, cols), dim=0)[:n]


def _ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape)


CASES = [
    (aten.topk.default, (r(4, 8), 2), {}),
    (aten.topk.default, (r(4, 8), 3, 0, False), {}),
    (aten.sort.default, (r(4, 8), 1), {}),
    (aten.sort.stable, (r(4, 8),), {"stable": True, "dim": 0, "descending": True}),
    (aten.argsort.default, (r(4, 8), 1), {}),
    (aten.argsort.stable, (r(4, 8),), {"stable": True, "dim": 0}),
    (aten.cummax.default, (r(4, 8), 1), {}),
    (aten.cumprod.default, (r(4, 8), 0), {}),
    (aten.logcumsumexp.default, (r(4, 8), 1), {}),
    (aten.scatter.src, (r(4, 8), 0, _rows(2, 4, 8), r(2, 8)), {}),
    (aten.scatter.src, (r(4, 8), 0, _rows(2, 4, 8), r(4, 8)), {}),
    (aten.scatter.src, (r(4, 8), 1, _rows(2, 8, 4).T, r(4, 2)), {}),
    (aten.scatter.src, (r(4, 8), 1, _rows(2, 8, 2).T, r(4, 4)), {}),
    (aten.scatter.value, (r(4, 8), 1, _rows(2, 8, 4).T, 1.5), {}),
    (aten.scatter.reduce, (r(4, 8), 0, _ints(4, 6, 8), r(6, 8)), {"reduce": "multiply"}),
    (aten.scatter_add.default, (r(4, 8), 0, _ints(4, 6, 8), r(6, 8)), {}),
    (aten.scatter_add.default, (r(4, 8), 1, _ints(8, 4, 4), r(4, 6)), {}),
    (aten.scatter_reduce.two, (r(4, 8), 1, _ints(8, 4, 4), r(4, 4), "sum"), {}),
    (aten.scatter_reduce.two, (r(4, 8), 1, _ints(8, 4, 4), r(4, 4), "amax"), {"include_self": False}),
    (aten.scatter_reduce.two, (r(4, 8), 0, _ints(4, 2, 8), r(2, 8), "mean"), {}),
    (aten.index_add.default, (r(6, 4), 0, _ints(6, 4), r(4, 4)), {}),
    (aten.index_add.default, (r(2, 6, 4), 1, _ints(6, 8), r(2, 8, 4)), {"alpha": 0.5}),
    (aten.index_put.default, (r(8, 4), [_ints(8, 6)], r(6, 4), True), {}),
    (aten.index_put.default, (r(8, 4), [torch.randperm(8)[:4]], r(4, 4)), {}),
    (aten.index_put.default, (r(4, 8, 2), [None, torch.randperm(8)[:4]], r(4, 1, 2)), {}),
    (aten.index_put.default, (r(4, 8, 2), [_ints(4, 2, 1), _ints(2, 1, 2)], r(2), True), {}),
    (aten.index_put.default, (torch.zeros(8, dtype=torch.long), [torch.randperm(8)], torch.arange(8)), {}),
    (aten.one_hot.default, (_ints(5, 4, 6), 5), {}),
    (aten.histc.default, (r(4, 8), 4, -1.0, 1.0), {}),
    (aten.histc.default, (r(8), 4), {}),
    (aten.bincount.default, (_ints(5, 8),), {}),
    (aten.bincount.default, (_ints(5, 8), r(8), 6), {}),
    (aten.repeat.default, (r(4, 1, 2), [3, 2, 1, 2]), {}),
    (aten.repeat.default, (r(4, 8), [1, 1]), {}),
    (aten.repeat_interleave.self_int, (r(4, 8), 2, 0), {}),
    (aten.repeat_interleave.self_int, (r(4, 8), 3, 1), {}),
    (aten.repeat_interleave.self_int, (r(4, 2), 2), {}),
    (aten.floor_divide.default, (_ints(8, 4, 8), 2), {}),
    (aten.remainder.Scalar, (r(4, 8), 0.7), {}),
    (aten.clamp.Tensor, (r(4, 8), None, r(4, 1)), {}),
    (aten.clamp_min.Tensor, (r(4, 8), r(8)), {}),
    (aten.max.dim, (r(4, 8), 1, True), {}),
    (aten.min.dim, (r(4, 8), 0), {}),
    (aten.aminmax.default, (r(4, 8),), {"dim": 1}),
    (aten.kthvalue.default, (r(4, 8), 2, 1), {}),
    (aten.median.dim, (r(4, 8), 0), {}),
    (aten.median.default, (r(4, 8),), {}),
    (aten.mode.default, (_ints(3, 4, 8).float(), 1), {}),
]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("op,args,kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_routing_rule_matches_single_device(op, args, kwargs, mesh):
    harness.test_rule_matches_single_device(op, args, kwargs, mesh)


def _split_labels(op, args, kwargs=None) -> set:
    node = make_node(op, args, kwargs or {})
    call = OpCall.of(node)
    spec = lookup(op).fn(call)
    return {c for s in enumerate_strategies(spec, call.shapes, call.out_shapes, MESHES[0]) for c in s.choices}


def test_what_splits_and_what_stays_whole():
    # topk splits its rows, never its k dim
    assert len(_split_labels(aten.topk.default, (r(4, 8), 2))) == 2
    # an accumulating write splits its items (a Partial output); a plain one does not
    assert len(_split_labels(aten.scatter_add.default, (r(4, 8), 0, _ints(4, 6, 8), r(6, 8)))) == 3
    assert len(_split_labels(aten.scatter.src, (r(4, 8), 0, _ints(4, 6, 8), r(6, 8)))) == 2
    # a histogram with its range taken from the data, and bincount, never split
    assert _split_labels(aten.histc.default, (r(8), 4)) == {None}
    assert _split_labels(aten.histc.default, (r(8), 4, -1.0, 1.0)) == {None, "a"}
    assert _split_labels(aten.bincount.default, (_ints(5, 8),)) == {None}


def test_one_hot_without_a_class_count_is_not_covered():
    node = make_node(aten.one_hot.default, (_ints(5, 6),), {})
    assert spec_of(OpCall.of(node)) is None


class _Router(torch.nn.Module):
    """The routing calls of MoE layers (Mixtral's, Qwen3-MoE's and their variants)."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values, chosen = torch.topk(F.softmax(x, -1), 2, dim=-1)
        order, perm = torch.sort(chosen.reshape(-1))
        counts = torch.histc(order.float(), bins=8, min=0, max=7)
        hits = F.one_hot(chosen, 8).sum(1)
        lo, hi = x.min(dim=1), x.max(-1, keepdim=True)
        spread = x.scatter(1, idx, 0.0).scatter_add(1, idx, values) + x.index_add(0, perm // 2, x[perm // 2])
        return (
            values.clamp(max=hi.values),
            torch.argsort(x, -1),
            counts,
            hits,
            lo.values,
            spread,
            x.repeat(2, 1),
            x.masked_fill(x > 0, 0.0),
            x.scatter_reduce(1, idx, values, "amax"),
        )


def test_exported_router_calls_all_have_rules():
    """The overloads torch.export actually records for the usual Python calls are registered."""
    x, idx = torch.randn(4, 8), torch.randint(0, 8, (4, 2))
    graph = torch.export.export(_Router(), (x, idx), strict=False).graph
    ops = [
        n.target
        for n in graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and n.meta.get("val") is not None
    ]
    assert [str(op) for op in ops if lookup(op) is None] == []


def _moe(family: str, experts: str) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    if family == "mixtral":
        config = transformers.MixtralConfig(
            num_hidden_layers=1, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, **sizes
        )
        model_class = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(
            num_hidden_layers=1,
            moe_intermediate_size=64,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            **sizes,
        )
        model_class = transformers.Qwen3MoeForCausalLM
    config._experts_implementation = experts
    return model_class(config)


@pytest.mark.parametrize("family,experts", [("mixtral", "grouped_mm"), ("qwen3_moe", "batched_mm")])
def test_moe_routers_plan_without_replicated_ops(family, experts, fake_process_group):
    """Every router and dispatch op has a rule; only the expert product of the grouped path, a
    custom op of transformers (``transformers::grouped_mm_fallback``), stays replicated."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, 128, (4, 16))
    kwargs = {"labels": ids, "use_cache": False}
    compiled = autopar.compile(
        _moe(family, experts), mesh, (ids,), example_kwargs=kwargs, cluster="fast-links"
    )
    left = {w for w in compiled.plan.warnings if "grouped_mm_fallback" not in w}
    assert left == set()
