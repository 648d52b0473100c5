"""ManualSplit: a lookup table split in the rows per rank the user gives (MindSpore's manual_split).

Fast tests: the annotation's mistakes, the plan's report and memory, and the program each
rank runs (on a fake process group). Training next to one device, DCP round trips and
gradients run on 4 gloo ranks in ``tests/test_megatron_layouts.py`` (case ``manual``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.ir.layout import ManualRows
from autopar.tools.fake_ranks import fake_world
from examples.recommender import Recommender, annotate, build

MESH = {"dp": 2, "tp": 2}


def _plan(model: nn.Module, inputs: tuple) -> autopar.Plan:
    return autopar.plan(model, inputs, MESH, cluster="fast-links")


class _TiedHead(nn.Module):
    """An embedding whose table is also the output projection (as GPT-2 ties them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) @ self.embed.weight.T


@pytest.mark.parametrize(
    ("where", "split", "message"),
    [
        (
            "plan",
            autopar.ManualSplit("tp", (500, 300, 200)),
            "gives 3 row counts, but mesh axis 'tp' has 2 ranks",
        ),
        (
            "plan",
            autopar.ManualSplit("tp", (600, 300)),
            "dim 0 has 1000 rows, but the rows of .* add up to 900",
        ),
        ("plan", autopar.ManualSplit("tp", (1100, -100)), "must be ints >= 0"),
        ("plan", autopar.ManualSplit("mp", (700, 300)), "unknown mesh axis 'mp'"),
        ("storage", autopar.ManualSplit("tp", (700, 300)), r"belongs in a shard\(parameter_plan=...\) only"),
        ("input", autopar.ManualSplit("tp", (4, 4)), r"belongs in a shard\(parameter_plan=...\) only"),
    ],
    ids=["count", "sum", "negative", "axis", "storage", "input"],
)
def test_a_wrong_manual_split_names_the_parameter_and_what_is_expected(where, split, message):
    model, inputs, _ = build()
    with pytest.raises(autopar.AnnotationError, match=message) as error:
        if where == "input":
            autopar.shard(model.users, in_strategy=((split,),))
        else:
            key = "parameter_plan" if where == "plan" else "parameter_storage"
            autopar.shard(model.users, **{key: {"weight": (split, None)}})
        _plan(model, inputs)
    assert "Embedding" in str(error.value)  # the module (its path, once the model is planned)


def test_a_manual_split_table_read_other_than_by_lookup_is_refused():
    model = _TiedHead()
    autopar.shard(model.embed, parameter_plan={"weight": (autopar.ManualSplit("tp", (6, 4)), None)})
    with pytest.raises(autopar.AnnotationError, match="may only be looked up along that dim") as error:
        autopar.plan(model, (torch.randint(0, 10, (4, 3)),), {"tp": 2})
    assert "'embed.weight'" in str(error.value)


def test_the_plan_names_saves_and_prices_the_rows(tmp_path):
    torch.manual_seed(0)
    model, inputs, _ = build()
    annotate(model)
    plan = _plan(model, inputs)
    assert plan.manual_rows == {"users.weight": ManualRows(0, (700, 300))}
    assert plan.named_layouts["p_users_weight"] == (
        "manual users.weight: dim 0 (1000) over tp in rows of 700, 300 (ManualSplit), "
        "each held padded to 700 rows"
    )
    assert "users.weight dim 0 (1000) split over tp, rows of 700, 300" in plan.summary(width=200)
    plan.save(tmp_path / "plan.json")
    assert autopar.load_plan(tmp_path / "plan.json").manual_rows == plan.manual_rows
    # held padded to 700 rows, where DTensor's even split would hold 500: 200 rows of 16 fp32 more
    even = Recommender()
    autopar.shard(even.users, parameter_plan={"weight": ("tp", None)})
    autopar.shard(even.items, parameter_plan={"weight": ("tp", None)})
    assert plan.prediction.param_bytes - _plan(even, inputs).prediction.param_bytes == 200 * 16 * 4


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_looks_up_its_own_rows(rank):
    """tp rank 0 holds users 0-699, rank 1 users 700-999 (padded to 700 rows)."""
    torch.manual_seed(0)
    model, inputs, _ = build()
    annotate(model)
    with fake_world(4, rank=rank):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dmodel = autopar.compile(model, mesh, inputs, cluster="fast-links")
        assert "autopar.block_index(check_ids_default, 'tp', [0, 700, 1000])" in dmodel.code
        users = dmodel.users.weight
        assert tuple(users.shape) == (1400, 16) and tuple(users.to_local().shape) == (700, 16)
        tp = rank % 2
        held = users.to_local()[: (700, 300)[tp]]
        torch.testing.assert_close(held, model.users.weight[(0, 700)[tp] :][: (700, 300)[tp]])
        assert not users.to_local()[(700, 300)[tp] :].any()  # the padding
