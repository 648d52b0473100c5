"""The GPU presets' efficiency model: products by size, fused attention by head dim and sequence, rings
spanning nodes, interleaved pipelines' fill and drain, and cluster files checked for their units."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import autopar
from autopar.ir.errors import OptionError
from autopar.ir.options import Pipeline
from autopar.planning.cost.cluster import Cluster, LinkSpec
from autopar.planning.cost.efficiency import Efficiency
from autopar.planning.cost.model import Collective, CostModel, get_cluster
from examples import gpt

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cost_model.md"
# The datasheets' bf16 peaks: the presets' product rates are what a large product reaches below them.
VENDOR_BF16 = {"a100": 312e12, "h100": 989e12}


@pytest.mark.parametrize("name", ["a100", "h100"])
def test_a_product_runs_faster_the_larger_it_is_and_never_above_the_presets_rate(name):
    model = CostModel({"tp": 8}, get_cluster(name))
    peak = model.peak(torch.bfloat16)
    assert 0.7 * VENDOR_BF16[name] < peak < 0.9 * VENDOR_BF16[name]  # a measured fraction of the datasheet
    rates = []
    for n in (64, 256, 1024, 4096, 16384):
        flops, moved = 2 * n**3, 3 * n * n * 2
        rates.append(flops / model.compute_time(flops, moved, torch.bfloat16))
    assert rates == sorted(rates) and rates[-1] <= peak
    assert rates[-1] > 0.99 * peak and rates[1] < 0.2 * peak  # a 256-cube product: its kernel's floor


def test_the_kernel_floor_is_a_saturating_rate():
    kernels = Efficiency(kernel_floor_s=6e-6, attention_fraction=0.7)
    peak = 780e12
    assert kernels.arithmetic_s(0.0, peak) == 0.0  # a view or a copy: its bytes alone
    half = peak * kernels.kernel_floor_s  # at these flops the floor is half the time
    assert half / kernels.arithmetic_s(half, peak) == pytest.approx(peak / 2)


def test_fused_attention_runs_slower_at_small_head_dims_and_short_sequences():
    kernels = get_cluster("a100").efficiency
    by_head = [kernels.attention_rate(d, 2048) for d in (32, 64, 96, 128, 256)]
    by_length = [kernels.attention_rate(128, n) for n in (128, 512, 2048, 8192)]
    assert by_head == sorted(by_head) and by_head[-1] == by_head[-2]  # past 128 no faster
    assert by_length == sorted(by_length) and by_length[-1] < kernels.attention_fraction <= 1
    assert kernels.attention_rate(128, 0) == kernels.attention_fraction  # length unknown: a long one


def test_causal_attention_computes_half_its_pairs_and_its_forward_a_third():
    model = CostModel({"dp": 1}, get_cluster("a100"))
    b, h, n, d = 4, 32, 2048, 128
    scores = b * h * n * n
    flops = 4 * scores * d
    moved = 4 * b * h * n * d * 2
    full = model.op_time(flops, moved, torch.bfloat16, grad=True, attention=(scores, 0))
    causal = model.op_time(flops, moved, torch.bfloat16, grad=True, attention=(scores, n))
    forward = model.op_time(flops, moved, torch.bfloat16, grad=False, attention=(scores, n))
    assert causal < 0.6 * full and forward == pytest.approx(causal / 3)
    # flash attention's published convention: forward and backward run 3.5 times the forward's counted
    # products (the causal ones halved) at its rate, besides its two kernels' floors
    rate = 3.5 * flops / 2 / causal
    expected = model.peak(torch.bfloat16) * model.cluster.efficiency.attention_rate(d, n)
    assert rate == pytest.approx(expected, rel=1e-2)


def test_a_ring_with_ranks_on_each_node_crosses_nodes_over_their_adapters():
    a100 = get_cluster("a100")
    data = Collective("all_reduce", ("dp",), 1 << 30)
    spread = CostModel({"dp": 32, "tp": 1}, a100)  # 8 of each ring's ranks on each node
    one_each = CostModel({"dp": 32, "tp": 8}, a100)  # one rank of a ring per node
    inside = CostModel({"dp": 8}, a100)
    assert spread.link(0) is a100.inter_node  # a pipeline's send still takes one adapter
    assert spread.collective_time(data) < one_each.collective_time(data) / 7
    assert spread.collective_time(data) > inside.collective_time(data)  # never above the node's own links
    alone = replace(a100, nics_per_node=None)  # a file without adapters: as before
    assert CostModel({"dp": 32, "tp": 1}, alone).collective_time(data) == one_each.collective_time(data)


def test_a_cluster_without_efficiency_prices_as_before():
    cpu = get_cluster("cpu-gloo")
    assert cpu.efficiency is None and cpu.nics_per_node is None
    model = CostModel({"dp": 2}, cpu)
    flops, moved = 2 * 64**3, 3 * 64 * 64 * 4
    assert model.compute_time(flops, moved, torch.float32) == max(
        flops / cpu.peak_flops["float32"], moved / cpu.memory_bandwidth_Bps
    )


@pytest.mark.parametrize("name", ["a100", "h100"])
def test_gpu_presets_round_trip_with_their_efficiency(name):
    cluster = get_cluster(name)
    assert cluster.efficiency is not None and cluster.nics_per_node == 8
    back = Cluster.from_dict(json.loads(json.dumps(cluster.to_dict())))
    assert back == cluster and hash(back) == hash(cluster)


def _interleaved_over_1f1b(microbatches: int) -> float:
    """The step of 4 blocks interleaved over 2 ranks (4 stages, 3 boundaries) over 1F1B's (2 stages, 1
    boundary), on a cluster where nothing but the sends between ranks takes time."""
    sends = LinkSpec(latency_s=0.0, bandwidth_Bps=1e6)
    free = Cluster("sends-only", {"float32": 1e18}, 1e18, 10**15, 1, intra_node=sends, inter_node=sends)
    steps = []
    for schedule, v in (("interleaved-1f1b", 2), ("1f1b", 1)):
        model, args = gpt.build(batch_size=8, n_layers=4, device="meta")
        pipeline = Pipeline(microbatches, schedule, v)
        plan = autopar.plan(model, args, {"pp": 2, "dp": 1}, cluster=free, pipeline=pipeline)
        steps.append(plan.pipeline.step_time_s)
    return steps[0] / steps[1]


def test_interleaving_sends_v_times_the_traffic_and_waits_on_every_boundary_to_fill_and_drain():
    # per microbatch each rank sends 3 boundaries' values interleaved against 1; its fill and drain
    # cross 3 boundaries against 1, where the bubble alone ((p - 1) / v slots) would price half a slot
    assert _interleaved_over_1f1b(2) == pytest.approx(3.0, rel=0.02)


def _doc_example() -> dict:
    """The hand-written A100 cluster file docs/cost_model.md shows (its json block under "A cluster file
    by hand")."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("### A cluster file by hand") :]
    return json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))


def test_the_docs_hand_written_a100_file_loads_and_prices_like_the_preset(tmp_path):
    path = tmp_path / "a100.json"
    path.write_text(json.dumps(_doc_example()), encoding="utf-8")
    cluster = get_cluster(str(path))
    preset = get_cluster("a100")
    assert replace(cluster, name="a100") == preset


@pytest.mark.parametrize(
    "change,words",
    [
        ({"inter_node": {"latency_s": 1e-5, "bandwidth_Bps": 25}}, ["inter_node.bandwidth_Bps", "25e9"]),
        ({"intra_node": {"latency_s": 3, "bandwidth_Bps": 230e9}}, ["intra_node.latency_s", "3e-6"]),
        ({"peak_flops": {"float32": 19.5, "bfloat16": 312}}, ["peak_flops['float32']", "312e12"]),
        ({"memory_bytes": 80}, ["memory_bytes", "80000000000"]),
        ({"memory_bytes": 0}, ["memory_bytes", ">= 1"]),
        ({"memory_bandwidth_Bps": 2.0}, ["memory_bandwidth_Bps", "bytes per second"]),
        (
            {"efficiency": {"kernel_floor_s": 6e-6, "attention_fraction": 70}},
            ["attention_fraction", "at most 1"],
        ),
        ({"efficiency": {"kernel_floor_s": 6, "attention_fraction": 0.7}}, ["kernel_floor_s", "below 0.001"]),
        ({"nics_per_node": 0}, ["nics_per_node", ">= 1"]),
    ],
)
def test_a_cluster_file_with_a_figure_in_another_unit_names_the_field(tmp_path, change, words):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**_doc_example(), **change}), encoding="utf-8")
    with pytest.raises(OptionError) as caught:
        get_cluster(str(path))
    for word in words:
        assert word in str(caught.value)


@pytest.mark.parametrize("field", ["memory_bytes", "peak_flops", "inter_node"])
def test_a_cluster_file_missing_a_field_says_what_it_takes(tmp_path, field):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({k: v for k, v in _doc_example().items() if k != field}), encoding="utf-8")
    with pytest.raises(OptionError, match=rf"cluster lacks '{field}': .*(bytes|FLOP/s|seconds)"):
        get_cluster(str(path))
