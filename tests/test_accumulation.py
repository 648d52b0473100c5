"""Gradient accumulation without a pipeline (``accumulation=``): the option's checks, the planner's
choice of a count and its prediction, and training on gloo ranks equal to one device.

The planner plans one microbatch and predicts the step as ``m`` microbatches (compute and layout
changes ``m`` times) plus one gradient sum and one optimizer step; where the option is None it
accumulates exactly when the whole batch does not fit the budget. One spawned world of 4 ranks
trains the example GPT for two steps accumulating 2 and 4 microbatches (dp=4, ZeRO-0 and ZeRO-2) and
2 on dp=2 x tp=2 (a compiled ``loss_fn``), each against one device on the whole batch, and counts
the gradient buckets launched: one set per step, not one per microbatch.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.ir.errors import MemoryFitError, OptionError, PlanError
from autopar.ir.options import PlanOptions
from autopar.ir.plan import Plan
from autopar.ir.report import GRADIENT_SUM
from autopar.tools.launch import spawn
from examples import gpt
from tests.against_one_device import assert_grads_match, assert_params_match

ATOL, RTOL = 1e-5, 1e-4
MIB = 2**20


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"accumulation": 0}, ["accumulation", ">= 1", "0"]),
        ({"accumulation": 2.0}, ["accumulation", "int"]),
        ({"accumulation": True}, ["accumulation", "int"]),
        (
            {"accumulation": 2, "pipeline": autopar.Pipeline(microbatches=4)},
            ["accumulation=2", "pipeline", "already accumulate", "Pipeline(microbatches=...)"],
        ),
        ({"accumulation": 2, "update": autopar.Async()}, ["accumulation=2", "update", "every backward"]),
    ],
)
def test_the_option_is_checked_at_the_door(kwargs, words):
    with pytest.raises(OptionError) as info:
        PlanOptions(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_count_that_does_not_divide_the_batch_names_the_input_and_what_divides():
    model, args = gpt.build(batch_size=6, device="meta")
    with pytest.raises(OptionError) as info:
        autopar.plan(model, args, {"dp": 2}, accumulation=4, time_limit=2)
    message = str(info.value)
    for words in ("accumulation=4", "args[0]", "batch 6 along dim 0", "1, 2, 3, 6"):
        assert words in message, (words, message)


def test_a_device_count_refuses_a_fixed_count():
    model, args = gpt.build(batch_size=8, device="meta")
    with pytest.raises(OptionError, match=r"accumulation=2 with a device count \(4\).*give a mesh"):
        autopar.plan(model, args, 4, accumulation=2)


def _plan(args, **options) -> Plan:
    """The example GPT on dp=2, data parallel (its layouts pinned: plans differ in memory choices)."""
    model = gpt.annotate(gpt.build(batch_size=8, device="meta")[0], "dp")
    fixed = {"cluster": "fast-links", "time_limit": 5, "memory": autopar.Memory(zero=0)}
    return autopar.plan(model, args, {"dp": 2}, **fixed, **options)


def _bytes(plan: Plan, sums: bool) -> int:
    return sum(
        c.bytes
        for r in plan.redistributions
        if (r.dst == GRADIENT_SUM) == sums
        for c in (*r.forward, *r.backward)
    )


def test_the_step_is_m_microbatches_and_one_gradient_sum(tmp_path):
    args = gpt.build(batch_size=8, device="meta")[1]
    whole, two = _plan(args), _plan(args, accumulation=2)
    assert (whole.accumulation, two.accumulation) == (1, 2)
    assert two.input_shapes == {"idx": [4, 32], "targets": [4, 32]}  # planned for one microbatch
    # activations are one microbatch's; the parameters' state is the same
    assert two.prediction.activation_bytes < 0.6 * whole.prediction.activation_bytes
    assert two.prediction.grad_bytes == whole.prediction.grad_bytes
    # compute and layout changes twice, the gradient sums once (the same as the whole batch's)
    per_microbatch = sum(n.compute_s for n in two.nodes)
    assert two.prediction.compute_s == pytest.approx(2 * per_microbatch)
    assert _bytes(two, sums=True) == _bytes(whole, sums=True) > 0
    assert two.prediction.comm_bytes == 2 * _bytes(two, sums=False) + _bytes(two, sums=True)
    assert "gradient accumulation: 2 microbatches per step" in two.summary()
    two.save(tmp_path / "two.json")
    assert autopar.load_plan(tmp_path / "two.json").accumulation == 2
    saved = whole.to_dict()
    del saved["accumulation"]  # a plan saved before the field reads one microbatch
    assert Plan.from_dict(saved).accumulation == 1


@pytest.fixture(scope="module")
def too_small() -> float:
    """A budget the fastest plan of 2 microbatches of the batch of 8 on dp=2 just fits."""
    args = gpt.build(batch_size=8, device="meta")[1]
    return _plan(args, accumulation=2).peak_memory_bytes


def test_the_planner_accumulates_where_the_whole_batch_fits_only_slower(too_small):
    """Where the whole batch fits only by recomputing, 2 microbatches without recompute are faster:
    the planner weighs both and accumulates; where the whole batch fits as it is, it does not."""
    args = gpt.build(batch_size=8, device="meta")[1]
    whole = _plan(args, accumulation=1, memory_budget=too_small)
    assert whole.memory.recompute and whole.peak_memory_bytes <= too_small
    chosen = _plan(args, memory_budget=too_small)
    assert chosen.accumulation == 2 and chosen.peak_memory_bytes <= too_small
    assert not chosen.memory.recompute  # 2 microbatches fit without recompute: no more are tried
    assert chosen.prediction.step_time_s < whole.prediction.step_time_s
    roomy = _plan(args, memory_budget=_plan(args).peak_memory_bytes)
    assert roomy.accumulation == 1  # it fits: one batch


def test_when_no_count_fits_the_error_says_the_most_microbatches_tried():
    args = gpt.build(batch_size=8, device="meta")[1]
    # 8 microbatches of 1 row would not split over dp=2 as annotated: 4 is the most tried
    with pytest.raises(
        MemoryFitError, match="accumulating 4 microbatches per step, the most tried: no plan fits"
    ):
        _plan(args, memory_budget=MIB)
    with pytest.raises(MemoryFitError, match="accumulating 2 microbatches per step: no plan fits"):
        _plan(args, accumulation=2, memory_budget=MIB)


def test_compile_runs_the_microbatch_of_the_count_the_planner_chose(too_small):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.tools.fake_ranks import fake_world

    model, args = gpt.build(batch_size=8)
    gpt.annotate(model, "dp")
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        options = {"cluster": "fast-links", "time_limit": 5, "memory": autopar.Memory(zero=0)}
        dmodel = autopar.compile(model, mesh, args, memory_budget=too_small, **options)
    assert dmodel.plan.accumulation == 2
    assert dmodel.plan.input_shapes == {"idx": [4, 32], "targets": [4, 32]}
    with pytest.raises(autopar.ShapeError, match=r"compiled for batches of 2 microbatches shaped \(4, 32\)"):
        dmodel.train_step((args[0][:6], args[1][:6]))


def test_a_saved_plan_brings_its_count_and_a_different_one_is_refused():
    from autopar.tools.fake_ranks import fake_world

    model, args = gpt.build(batch_size=8)
    with fake_world(2):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        plan = autopar.plan(model, args, {"dp": 2}, accumulation=2, time_limit=2)
        with pytest.raises(PlanError, match="accumulates 2 microbatches per step.*accumulation=4"):
            autopar.compile(model, mesh, args, plan=plan, accumulation=4)


# --------------------------------------------------------------------------- gloo ranks


def _case(
    mesh_shape: tuple, names: tuple, style: str, accumulation: int, zero: int, with_loss_fn: bool
) -> str:
    """Two AdamW steps of ``accumulation`` microbatches against one device on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, (idx, targets) = gpt.build(batch_size=16)
    reference = gpt.build(batch_size=16)[0]
    reference.load_state_dict(model.state_dict())
    gpt.annotate(model, style)
    if with_loss_fn:  # the model returns logits; train_step compiles the loss
        autopar.shard(model, in_strategy=(("dp", None),))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    example = (idx,) if with_loss_fn else (idx, targets)
    dmodel = autopar.compile(
        model,
        mesh,
        example,
        memory=autopar.Memory(zero=zero),
        accumulation=accumulation,
        cluster="fast-links",
    )
    where = f"{style} {mesh_shape} accumulation={accumulation} zero={zero}"
    assert dmodel.plan.accumulation == accumulation, where
    opt = dmodel.optimizer(torch.optim.AdamW, lr=1e-2, eps=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-3)
    buckets = len(dmodel.grad_reducer.buckets)
    assert buckets > 0, where
    for step in range(2):
        torch.manual_seed(step)
        batch = (torch.randint_like(idx, 0, 128), torch.randint_like(targets, 0, 128))
        before = dmodel.grad_reducer.launches
        if with_loss_fn:
            loss = dmodel.train_step(batch[0], batch[1], gpt.loss_fn)
        else:
            loss = dmodel.train_step(batch)
        # one set of gradient sums per step, not one per microbatch
        assert dmodel.grad_reducer.launches - before == buckets, (where, step)
        ref_loss = reference(*batch)
        ref_loss.backward()
        torch.testing.assert_close(
            loss, ref_loss.detach(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: {m}"
        )
        assert_grads_match(dmodel, reference, where, step, ATOL, RTOL)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_params_match(dmodel, reference, where, ATOL, RTOL)
    return where


CASES = [
    ((4,), ("dp",), "dp", 2, 0, False),
    ((4,), ("dp",), "dp", 4, 2, False),
    ((2, 2), ("dp", "tp"), "dp-tp", 2, 0, True),
]


def _world(cases: list[tuple]) -> list[str]:
    return [_case(*c) for c in cases]


@pytest.mark.distributed
def test_accumulated_steps_on_4_gloo_ranks_equal_one_device_with_one_sum_per_step():
    for rank in spawn(_world, 4, CASES):
        assert rank == [
            "dp (4,) accumulation=2 zero=0",
            "dp (4,) accumulation=4 zero=2",
            "dp-tp (2, 2) accumulation=2 zero=0",
        ]
