"""The whole step in the prediction: op overhead, the optimizer step (offload's copies included),
gradient-sum buckets (latency once per bucket, hidden behind backward as the runtime does),
ZeRO gathers one per shard, stragglers, pipeline sends and ranks sharing cores
(``autopar/planning/cost/step_overheads.py``, docs/cost_model.md "The whole step")."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autopar
from autopar.ir.report import GRADIENT_SUM
from autopar.planning.cost.model import get_cluster
from autopar.planning.cost.step_overheads import (
    FP32_BYTES,
    OPTIMIZER_OPS_PER_TENSOR,
    GradSum,
    OpTime,
    OptimizerWork,
    RecomputeWork,
    bucket_times,
    buckets,
    gradient_seconds,
    hidden_sends,
    launch_queue,
    op_seconds,
    step_terms,
    update_passes,
    update_seconds,
    whole_step,
)
from examples import gpt

BASE = get_cluster("fast-links")
MIB = 2**20


def _sum(param: str, group: int = 0, mib: float = 1.0, wire: float = 1.0, first_use: str = "a") -> GradSum:
    return GradSum(param, ((group,), None), mib * MIB, wire, 0.5, first_use)


def test_buckets_are_packed_as_the_runtime_packs_them():
    sums = [_sum("p0", mib=10), _sum("p1", group=1), _sum("p2", mib=10), _sum("p3", mib=10)]
    sums += [_sum("p4", mib=0.5), _sum("p5", mib=0.25), _sum("p6", mib=0.5)]
    # reversed, grouped by axes (groups in order of first appearance); the first bucket is cut
    # past 1 MiB, the others past 25 MiB (GradReducer packs with the same function)
    packed = [[s.param for s in b] for b in buckets(sums)]
    assert packed == [["p6", "p5"], ["p4", "p3", "p2"], ["p0"], ["p1"]]


def test_a_bucket_is_hidden_behind_the_backward_that_follows_its_launch_but_the_last_never():
    order = ["a", "b", "c"]  # forward order: backward runs c, b, a, each 2 s
    backward = dict.fromkeys(order, 2.0)
    early = _sum("late_param", group=1, wire=1.0, first_use="c")  # complete after 2 s
    late = _sum("first_param", group=0, wire=1.0, first_use="a")  # complete at the end, 6 s
    times = bucket_times([late, early], order, backward)
    assert times.latency_s == 1.0  # one latency per bucket
    # the early bucket (1.5 s) runs from 2 s to 3.5 s, hidden; the last one (1.5 s) is all exposed
    assert times.hidden_s == pytest.approx(1.5)
    # a last bucket launched while the early one still runs waits for it: less is hidden
    slow = replace(early, wire_s=5.0)  # 5.5 s from 2 s: ends at 7.5 s, 1.5 s past the backward
    assert bucket_times([late, slow], order, backward).hidden_s == pytest.approx(5.5 + 1.5 - 3.0)


class _ElementPasses(TorchDispatchMode):
    """Counts the ops (but the profiler's markers), and the elements of ``numel``-element tensors
    each reads (distinct operands) and writes (operands its schema marks written, new results);
    scalars are left out, and views read nothing."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.elements, self.ops = numel, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.ops += func.namespace != "profiler"  # the step's record_function markers run once
        schema = func._schema
        written = [
            a for a, s in zip(args, schema.arguments) if s.alias_info is not None and s.alias_info.is_write
        ]
        results = out if isinstance(out, tuple) else (out,)
        new = [r for r, s in zip(results, schema.returns) if s.alias_info is None]
        if not written and not new:  # a view (detach, expand) moves nothing
            return out
        operands = {id(a): a for a in tree_leaves(args) if self._counted(a)}  # foreach ops take lists
        for value in (list(operands.values()), written, new):
            self.elements += sum(a.numel() for a in tree_leaves(value) if self._counted(a))
        return out

    def _counted(self, value: object) -> bool:
        return isinstance(value, torch.Tensor) and value.numel() == self.numel


@pytest.mark.parametrize(
    ("optimizer", "options", "states"),
    [
        (torch.optim.SGD, {}, 0),
        (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.01}, 1),
        (torch.optim.AdamW, {}, 2),
        (torch.optim.AdamW, {"foreach": True}, 2),
    ],
)
def test_the_update_passes_are_those_torchs_optimizers_make(optimizer, options, states):
    """update_passes counts what torch's default optimizers move per element and
    OPTIMIZER_OPS_PER_TENSOR the ops Adam runs per tensor: fails when torch changes them."""
    param = torch.nn.Parameter(torch.ones(1000))
    step = optimizer([param], lr=0.1, **options)
    for _ in range(2):  # the second step: the first creates the states
        param.grad = torch.full_like(param, 0.5)
        with _ElementPasses(param.numel()) as counted:
            step.step()
    assert counted.elements == param.numel() * sum(update_passes(states))
    if states == 2 and not options:
        assert counted.ops == OPTIMIZER_OPS_PER_TENSOR


def test_the_optimizer_step_is_memory_bound_and_offload_adds_its_copies():
    update = OptimizerWork(elements=1e6, itemsize=4)
    memory = autopar.Memory(optimizer_states=2)
    cluster = replace(BASE, op_overhead_s=1e-6)
    ops = OPTIMIZER_OPS_PER_TENSOR * 1e-6
    # torch's AdamW: 6 passes over parameter and gradient, 14 over the two states
    device = update_seconds(update, cluster, memory)
    assert device == pytest.approx(1e6 * 4 * (6 + 14) / cluster.memory_bandwidth_Bps + ops)
    offload = replace(memory, offload_optimizer=True)
    host_update = 1e6 * FP32_BYTES * 20 / cluster.memory_bandwidth_Bps
    # the device is the host: each copy reads its source and writes its target
    copies = 2 * 1e6 * (4 + FP32_BYTES) / cluster.memory_bandwidth_Bps
    assert update_seconds(update, cluster, offload) == pytest.approx(copies + host_update + ops + 2e-6)
    gpu = replace(cluster, host_link_Bps=1e9, host_memory_bandwidth_Bps=1e8)
    expected = 2 * 4e6 / 1e9 + 1e6 * FP32_BYTES * 20 / 1e8 + ops + 2e-6
    assert update_seconds(update, gpu, offload) == pytest.approx(expected)
    assert update_seconds(OptimizerWork(0.0, 4), cluster, memory) == 0.0  # frozen
    # calibrated: a tensor's step on the device (DTensors) costs what autopar calibrate measured;
    # offload steps plain host copies, priced by their ops as before
    measured = replace(cluster, optimizer_tensor_s=3e-4)
    assert update_seconds(update, measured, memory) == pytest.approx(device - ops + 3e-4)
    assert update_seconds(update, measured, offload) == update_seconds(update, cluster, offload)
    # a GPU's host runs offload's update with its own op overhead, the copies are device ops
    host = replace(gpu, host_op_overhead_s=1e-7)
    host_ops = OPTIMIZER_OPS_PER_TENSOR * 1e-7
    assert update_seconds(update, host, offload) == pytest.approx(expected - ops + host_ops)


def test_later_backward_passes_add_their_gradient_to_the_first_as_priced():
    """gradient_seconds prices a pipeline's later microbatches an add over each gradient (both read,
    the sum written) and the first none (autograd takes the new gradient as it is): fails when
    torch's accumulation changes."""
    w, x = torch.nn.Parameter(torch.zeros(1000)), torch.ones(1000)
    passes = []
    for _ in range(2):
        loss = (w * x).sum()
        with _ElementPasses(w.numel()) as counted:
            loss.backward()
        passes.append(counted)
    assert passes[1].elements - passes[0].elements == 3 * w.numel()
    cluster = replace(BASE, op_overhead_s=1e-6)
    one, four = (gradient_seconds(4e6, m, False, cluster) for m in (1, 4))
    assert four - one == pytest.approx(3 * (3 * 4e6 / cluster.memory_bandwidth_Bps + 1e-6) + 3 * 2e-6)


def test_stragglers_are_waited_for_at_each_synchronising_point():
    ops = [
        OpTime("a", 3.0, grad=True, forward_syncs=1, backward_syncs=1, backward_comm_s=0.5),
        OpTime("b", 6.0, grad=True, forward_syncs=2),
        OpTime("output", 0.0, grad=False, runs=False),
    ]
    cluster = replace(BASE, straggler_s=0.1, op_overhead_s=1e-3)
    terms = step_terms(ops, {"w": 4.0}, {}, cluster, {})
    # forward: sync, a (1 s), sync, sync, b (2 s); backward: b (4 s), a (2 s), sync
    assert terms.segments() == ([0.0, 1.0, 0.0, 2.0], [6.0, 0.0])
    extras = whole_step(terms)
    # without buckets, the backward's last stretch runs on into the optimizer step
    assert extras.wait_s == pytest.approx(0.1 * (1 + math.sqrt(2 + 6) + math.sqrt(4)))
    assert extras.overhead_s == pytest.approx(2 * 3 * 1e-3)  # the output runs no op
    assert extras.optimizer_s == 4.0
    summed = step_terms(ops, {"w": 4.0}, {"w": _sum("w", first_use="a")}, cluster, {})
    assert whole_step(summed).wait_s == pytest.approx(0.1 * (1 + math.sqrt(8) + 0 + math.sqrt(4)))
    # and a wait per synchronising point after any compute (ranks sharing cores): three stretches
    based = step_terms(ops, {"w": 4.0}, {}, replace(cluster, straggler_base_s=0.01), {})
    assert whole_step(based).wait_s == pytest.approx(extras.wait_s + 3 * 0.01)


def _plan(cluster, **options):
    model, args = gpt.build()
    gpt.annotate(model, "dp")  # data parallelism: every weight's gradient summed over dp
    return autopar.plan(model, args, {"dp": 2}, cluster=cluster, **options)


def test_a_plan_adds_up_its_step_and_prices_each_term():
    cluster = replace(BASE, op_overhead_s=1e-4, straggler_s=1e-2)
    plan = _plan(cluster)
    p = plan.prediction
    parts = p.compute_s + p.comm_s + p.overhead_s + p.optimizer_s + p.wait_s - p.hidden_comm_s
    assert p.step_time_s == pytest.approx(parts) and p.hidden_launch_s == 0.0  # the host computes
    assert p.optimizer_s > 0 and p.wait_s > 0
    # every parameter's gradient: its accumulation and hook (two ops), and where summed over dp
    # (fp32: the sum's bytes) its copy into the bucket (an op, its bytes read and written)
    sums = [r for r in plan.redistributions if r.dst == GRADIENT_SUM]
    summed_bytes = sum(c.bytes for r in sums for c in r.backward)
    trained = len(list(gpt.build()[0].parameters()))
    copies = 2 * summed_bytes / cluster.memory_bandwidth_Bps
    assert gradient_seconds(1e6, 1, True, cluster) == pytest.approx(3e-4 + 2e6 / cluster.memory_bandwidth_Bps)
    gradients = (2 * trained + len(sums)) * 1e-4 + copies
    ops = [n for n in plan.nodes if n.op.startswith("aten.")]
    op_overhead = (p.overhead_s - gradients) / 1e-4
    assert len(ops) < op_overhead <= 3 * len(ops)  # forward, and backward where a gradient flows
    plain = _plan(BASE)  # a cluster without op overhead and stragglers: of those terms only the
    # gradients' copies into their bucket are left (memory-bound), of the sums that plan makes
    plain_sums = [c.bytes for r in plain.redistributions if r.dst == GRADIENT_SUM for c in r.backward]
    plain_copies = 2 * sum(plain_sums) / BASE.memory_bandwidth_Bps
    assert plain.prediction.overhead_s == pytest.approx(plain_copies) and plain.prediction.wait_s == 0.0
    # the gradient sums (all in one bucket) pay their latency once: one all_reduce over dp
    edges = sum(r.seconds for r in plan.redistributions)
    assert len(sums) > 1 and p.comm_s == pytest.approx(edges + 2 * 1 * BASE.intra_node.latency_s)


def test_zero_gathers_pay_their_latency_one_shard_at_a_time():
    cluster = replace(BASE, intra_node=replace(BASE.intra_node, latency_s=1e-2))
    plan = _plan(cluster, memory=autopar.Memory(zero=2, zero_threshold=0))
    for r in (r for r in plan.redistributions if r.dst == GRADIENT_SUM):
        gathers = [c for c in r.backward if c.kind == "all_gather"]
        sums = [c for c in r.backward if c.kind != "all_gather"]
        latencies = sum(1e-2 for _ in sums) * 1  # reduce_scatter over 2 ranks: one hop each
        assert len(gathers) == 1 and gathers[0].seconds > 1e-2
        assert r.seconds == pytest.approx(sum(c.seconds for c in r.backward) - latencies)


def test_pipeline_sends_hide_behind_the_next_compute_where_torch_waits_later():
    assert [hidden_sends("1f1b", 4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert hidden_sends("1f1b", 4, 0, 2) == 1  # fewer microbatches than warm-up slots
    assert hidden_sends("gpipe", 4, 2, 8) == hidden_sends("interleaved-1f1b", 4, 2, 8) == 7


def test_ranks_sharing_cores_fill_the_pipeline_bubble():
    model, args = gpt.build(batch_size=8, n_layers=4)
    pipeline = autopar.Pipeline(4, "1f1b")
    alone = autopar.plan(model, args, {"pp": 2, "dp": 2}, cluster=BASE, pipeline=pipeline).pipeline
    shared = autopar.plan(
        model, args, {"pp": 2, "dp": 2}, cluster=replace(BASE, ranks_per_core=2.0), pipeline=pipeline
    ).pipeline
    assert shared.stages == alone.stages
    work = 4 * sum(st.seconds for st in alone.stages) / 2  # the average rank's compute
    assert work < shared.step_time_s < alone.step_time_s
    assert alone.step_time_s > 1.2 * work  # the bubble of 1F1B over 2 ranks and 4 microbatches
    # what the critical path waits for (the sends between stages) is no work a core can share:
    # it is not shortened by the ranks beside it (a tiny GPT's pipeline on 4 ranks sharing 2 cores
    # measured 85 ms a step with 8 microbatches, priced 47 ms when it was, 69 ms since)
    slow = replace(BASE, ranks_per_core=2.0, intra_node=replace(BASE.intra_node, latency_s=0.05))
    sends = autopar.plan(model, args, {"pp": 2, "dp": 2}, cluster=slow, pipeline=pipeline).pipeline
    assert sends.step_time_s > (4 + 1) * max(st.p2p_seconds for st in sends.stages)


def test_launches_overlap_the_compute_of_an_asynchronous_device():
    """The host launches op after op; the device runs each once launched and the last is done."""
    # launch-bound: the device waits for every launch, and only each op's compute after the
    # last launch is not hidden; compute-bound: the host is ahead after the first launch
    assert launch_queue([(1.0, 0.5)] * 4) == pytest.approx(4 * 1.5 - (4 + 0.5))
    assert launch_queue([(0.5, 1.0)] * 4) == pytest.approx(4 * 1.5 - (0.5 + 4))
    assert launch_queue([(1.0, 0.0), (0.0, 1.0)]) == 0.0  # one after the other: nothing overlaps
    # a plan on an asynchronous device takes what overlaps off its step, and only that
    cluster = replace(BASE, op_overhead_s=1e-4)
    host = _plan(cluster).prediction
    gpu = _plan(replace(cluster, asynchronous=True)).prediction
    assert 0 < gpu.hidden_launch_s <= gpu.overhead_s and gpu.overhead_s == host.overhead_s
    parts = gpu.compute_s + gpu.comm_s + gpu.overhead_s + gpu.optimizer_s + gpu.wait_s - gpu.hidden_comm_s
    assert gpu.step_time_s == pytest.approx(parts - gpu.hidden_launch_s)

    # a pipeline's stages each queue their microbatch's launches
    model, args = gpt.build(batch_size=8, n_layers=4)
    pipeline = autopar.Pipeline(4, "1f1b")
    staged = [
        autopar.plan(model, args, {"pp": 2, "dp": 2}, cluster=c, pipeline=pipeline).pipeline
        for c in (cluster, replace(cluster, asynchronous=True))
    ]
    assert [s.modules for s in staged[0].stages] == [s.modules for s in staged[1].stages]
    assert all(a.seconds > b.seconds > 0 for a, b in zip(staged[0].stages, staged[1].stages))
    assert staged[1].step_time_s < staged[0].step_time_s


def test_a_recomputed_op_costs_the_calibrated_recompute_overhead():
    cluster = replace(BASE, op_overhead_s=1e-5)
    work = RecomputeWork(3)
    assert op_seconds(cluster, True, work) == pytest.approx(4e-5)  # not measured: one more op
    assert op_seconds(replace(cluster, recompute_op_s=6e-5), True, work) == pytest.approx(9e-5)
    assert op_seconds(replace(cluster, recompute_op_s=6e-5), False) == pytest.approx(1e-5)
    # calibrated per unit: the op and each tensor autograd saves for it, under the checkpoint's
    # policy or (a full region without collectives) without it
    units = replace(cluster, recompute_op_s=6e-5, recompute_unit_s=2e-5)
    assert op_seconds(units, True, work) == pytest.approx(9e-5)
    assert op_seconds(units, True, RecomputeWork(1)) == pytest.approx(5e-5)
    assert op_seconds(units, True, RecomputeWork(3, selective=False)) == pytest.approx(9e-5)
    plain = replace(units, checkpoint_unit_s=1e-5)
    assert op_seconds(plain, True, RecomputeWork(3, selective=False)) == pytest.approx(6e-5)
    assert op_seconds(plain, True, work) == pytest.approx(9e-5)


def _recompute_seconds(region: torch.nn.Module, mesh: dict[str, int], **units: float) -> float:
    """What recomputing ``region`` between two linears adds to the predicted overhead under a
    cluster of no op overhead whose recompute figures are ``units``; the first linear's output
    replicated."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), region, torch.nn.Linear(8, 8))
    autopar.shard(model[0], out_strategy=((None, None, None),))
    autopar.recompute(model[1], "full")
    args = (torch.randn(2, 4, 8),)
    clusters = [replace(BASE, recompute_unit_s=0.0, checkpoint_unit_s=0.0), replace(BASE, **units)]
    plans = [autopar.plan(model, args, mesh, cluster=c) for c in clusters]
    return plans[1].prediction.overhead_s - plans[0].prediction.overhead_s


def test_a_recomputed_op_counts_a_unit_per_tensor_it_saves():
    # a linear saves its input and weight, a product by a number nothing: what the checkpoint's
    # hooks handle for each, besides the op itself; a full region of plain ops runs without the
    # selective policy (checkpoint_unit_s)
    class Scaled(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2.0

    figures = {"recompute_unit_s": 1.0, "checkpoint_unit_s": 0.25}
    assert _recompute_seconds(Scaled(), {"dp": 1}, **figures) == pytest.approx(0.25)
    assert _recompute_seconds(torch.nn.Linear(8, 8), {"dp": 1}, **figures) == pytest.approx(0.75)
    assert _recompute_seconds(torch.nn.Linear(8, 8), {"dp": 1}, recompute_unit_s=1.0) == pytest.approx(3.0)


def test_a_region_a_redistribution_runs_into_is_priced_under_the_policy():
    # the region's input split over tp from the replicated output before it: a collective joins
    # the region, which then runs under the selective checkpoint's policy to keep its output
    region = torch.nn.Linear(8, 8)
    autopar.shard(region, in_strategy=(("tp", None, None),))
    model_figures = {"recompute_unit_s": 1.0, "checkpoint_unit_s": 0.25}
    seconds = _recompute_seconds(region, {"tp": 2}, **model_figures)
    assert seconds == pytest.approx(3.0)
