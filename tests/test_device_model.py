"""The device model: what each implementation answers, which one a cluster gets, and that the choice
never changes a price (``autopar/planning/cost/device_model.py``)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.planning.cost import device_model as device_module
from autopar.planning.cost.cluster import AttentionRates
from autopar.planning.cost.device_model import (
    MEASURED_TERMS,
    OPTIMIZER_OPS_PER_TENSOR,
    MeasuredDevice,
    RecomputeWork,
    RooflineDevice,
    device_model,
)
from autopar.planning.cost.model import CostModel, get_cluster
from examples import gpt

H100 = get_cluster("h100")
# One value, other than its default, for each term only the measured model reads.
TERMS = {
    "straggler_s": 0.01,
    "straggler_base_s": 0.002,
    "ranks_per_core": 2.0,
    "optimizer_tensor_s": 3e-4,
    "recompute_op_s": 6e-5,
    "recompute_unit_s": 4e-5,
    "checkpoint_unit_s": 2e-5,
    "transcendentals_per_s": 2e9,
    "function_rates": {"exp": 4e9, "gelu_backward": 1e9},
    "threads_per_rank": 1,
}
MEASURED = replace(H100, name="measured", **TERMS)


def test_the_roofline_model_adds_the_op_overhead_alone():
    device = device_model(H100)
    assert type(device) is RooflineDevice and device.asynchronous and device.op_overhead_s == 5e-6
    assert device.optimizer_tensor_s == OPTIMIZER_OPS_PER_TENSOR * 5e-6
    assert device.recompute_s(RecomputeWork(3)) == 5e-6  # one more launch, whatever it saves
    assert device.straggler_wait_s(4.0) == 0.0 and device.shared_core_speedup == 1.0
    assert device.transcendental_s(1e9) == 0.0 and device.function_s("exp", 1e9) == 0.0
    assert device.threads_per_rank is None
    # the host's terms: a GPU's PCIe link and its share of host memory, its own launches on the host
    assert device.host_copy_s(64e9, 1.0) == pytest.approx(1.0)
    assert device.host_update_Bps == 76.8e9 and device.host_op_s == 5e-6
    cpu = device_model(get_cluster("fast-links"))  # the host is the device: copies are memory traffic
    assert not cpu.asynchronous and cpu.host_copy_s(1e10, 1e10) == pytest.approx(2.0)
    assert cpu.host_update_Bps == 1e10


def test_the_measured_model_prices_each_calibrated_term():
    device = device_model(MEASURED)
    assert type(device) is MeasuredDevice
    assert device.optimizer_tensor_s == 3e-4
    assert device.recompute_s(RecomputeWork(3)) == pytest.approx(3 * 4e-5)  # units under the policy
    assert device.recompute_s(RecomputeWork(3, selective=False)) == pytest.approx(3 * 2e-5)
    assert device.straggler_wait_s(4.0) == pytest.approx(0.002 + 0.01 * math.sqrt(4.0))
    assert device.shared_core_speedup == 2.0 and device.threads_per_rank == 1
    assert device.transcendental_s(1e9) == pytest.approx(0.5)
    assert device.function_s("exp", 1e9) == pytest.approx(0.25)
    assert device.function_s("gelu_backward", 1e9) == pytest.approx(1.0)
    assert device.function_s("log", 1e9) == 0.0 and device.function_s(None, 1e9) == 0.0  # not timed
    # files calibrated before units price recompute_op_s per op; checkpoint_unit_s falls back to units
    older = device_model(replace(MEASURED, recompute_unit_s=None, checkpoint_unit_s=None))
    assert older.recompute_s(RecomputeWork(3)) == 6e-5
    policy = device_model(replace(MEASURED, checkpoint_unit_s=None))
    assert policy.recompute_s(RecomputeWork(3, selective=False)) == pytest.approx(3 * 4e-5)


@pytest.mark.parametrize("term", sorted(TERMS))
def test_the_measured_model_applies_exactly_where_a_cluster_sets_a_term(term):
    assert set(TERMS) == MEASURED_TERMS
    assert type(device_model(replace(H100, **{term: TERMS[term]}))) is MeasuredDevice
    assert type(device_model(replace(MEASURED, **{t: getattr(H100, t) for t in TERMS}))) is RooflineDevice


def test_other_figures_leave_the_roofline_model():
    others = {
        "op_overhead_s": 1e-3,
        "asynchronous": False,
        "host_link_Bps": 1e9,
        "host_op_overhead_s": 1e-6,
        "measured_on": "elsewhere",
        "attention": AttentionRates(1.2, 1e-9, 512.0),
    }
    for name, value in others.items():
        assert type(device_model(replace(H100, **{name: value}))) is RooflineDevice, name


@pytest.mark.parametrize("cluster", ["h100", "fast-links"])
def test_the_measured_model_without_its_terms_answers_as_the_roofline_one(cluster):
    roofline, measured = RooflineDevice(get_cluster(cluster)), MeasuredDevice(get_cluster(cluster))
    for work in (RecomputeWork(1), RecomputeWork(5, selective=False)):
        assert measured.recompute_s(work) == roofline.recompute_s(work)
    for stretch in (1e-3, 2.0):
        assert measured.straggler_wait_s(stretch) == roofline.straggler_wait_s(stretch)
    assert measured.optimizer_tensor_s == roofline.optimizer_tensor_s
    assert measured.shared_core_speedup == roofline.shared_core_speedup
    assert measured.transcendental_s(1e9) == roofline.transcendental_s(1e9)
    assert measured.function_s("exp", 1e9) == roofline.function_s("exp", 1e9)
    assert measured.threads_per_rank == roofline.threads_per_rank


def test_the_cost_model_asks_its_clusters_device():
    assert CostModel({"dp": 2}, H100).device == RooflineDevice(H100)
    rated = CostModel({"dp": 2}, MEASURED)
    # products at the fp32 peak (and the kernel's floor), then 1e9 exps at 2e9 a second; the timed exp
    # replaces its count
    peak, floor = H100.peak_flops["float32"], H100.efficiency.kernel_floor_s
    assert rated.compute_time(peak, 0, torch.float32, transcendentals=1e9) == pytest.approx(1.5 + floor)
    timed = rated.op_time(4e9, 0, torch.float32, (4e9, 0), function="exp")
    assert timed == pytest.approx(1.0 + 4e9 / peak + floor)


def _plan(cluster: autopar.Cluster) -> autopar.Plan:
    torch.manual_seed(0)
    model, args = gpt.build(n_layers=1, d_model=32, n_heads=2, seq_len=16, batch_size=4)
    return autopar.plan(model, args, {"dp": 2, "tp": 2}, cluster=cluster, time_limit=10)


def test_a_gpu_presets_plan_is_the_same_under_either_model(monkeypatch):
    """h100's plan and prediction are those of the measured model with its terms unset, to the last
    float; setting a term (stragglers) changes the prediction."""
    plain = _plan(H100)
    # a field no cluster leaves at this value: every cluster is priced by the measured model
    monkeypatch.setattr(device_module, "_UNSET", {**device_module._UNSET, "name": object()})
    assert type(device_model(H100)) is MeasuredDevice
    forced = _plan(H100)
    assert forced.prediction == plain.prediction and forced.nodes == plain.nodes
    assert plain.prediction.wait_s == 0.0 < _plan(replace(H100, straggler_s=1e-3)).prediction.wait_s
