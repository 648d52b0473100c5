"""Heads that the tensor axis does not divide split as DTensor splits rows: ``torch.chunk``'s pieces,
the last ranks' perhaps empty (25 heads over 8 ranks: 4, 4, 4, 4, 4, 4, 1, 0).

Planning runs on ``meta``; the per-rank programs on torch's fake process group, as each rank of
the mesh (the one holding no head too). Numerics against one device are the model zoo's (4 gloo
ranks: 5 heads over tp=4, ``tests/test_model_zoo.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.tools.fake_ranks import fake_world
from examples.handwritten import HANDWRITTEN, MiniGPT, MiniGPTConfig


def _attention(plan: autopar.Plan) -> set[str]:
    return {n.operands[0] for n in plan.nodes if "scaled_dot_product" in n.op}


def test_gpt2_xls_25_heads_split_over_tp_8():
    # GPT-2 XL's width and heads (two of its 48 layers), one sequence of 8192 tokens, in bf16
    with torch.device("meta"):
        model = MiniGPT(MiniGPTConfig(vocab_size=50304, block_size=8192, n_layer=2, n_head=25, n_embd=1600))
    ids = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    bf16 = autopar.MixedPrecision(torch.bfloat16)
    plan = autopar.plan(model, (ids, ids), {"tp": 8}, cluster="h100", precision=bf16)
    assert _attention(plan) == {"S(1)"}  # by heads: no rank attends over all 25
    summary = plan.summary()
    assert "no sharding rule" not in summary


class _AttentionShapes(TorchDispatchMode):
    """Records the query shape of every attention kernel that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.queries: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func) and "backward" not in str(func):
            self.queries.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("rank", "heads"), [(0, 2), (1, 2), (2, 1), (3, 0)])
def test_each_rank_attends_over_its_heads_the_last_over_none(rank, heads):
    torch.manual_seed(0)
    model, args, _ = HANDWRITTEN["mini-gpt (5 heads)"]()
    with fake_world(4, rank=rank):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        dmodel = autopar.compile(model, mesh, args, cluster="fast-links")
        assert _attention(dmodel.plan) == {"S(1)"}
        with _AttentionShapes() as seen:
            _, loss = dmodel(*dmodel.shard_inputs(*args)[0])
        loss.backward()
    if heads:
        assert seen.queries == [(1, heads, 512, 16)] * 2  # each layer's
    else:  # torch skips the kernel over no heads, or runs it on an empty query
        assert all(q == (1, 0, 512, 16) for q in seen.queries)
    assert torch.isfinite(loss)
