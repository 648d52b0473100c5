"""Cluster files: ``autopar calibrate`` measures this machine or a torchrun world (ranks all running
at once, links per node level and per collective) into a JSON file that ``plan``, ``compile`` and
``--cluster`` take; a file that is missing, malformed or from another machine is an ``OptionError``
saying which."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import autopar
from autopar import OptionError
from autopar.ir.plan import CollectiveKind
from autopar.planning.cost.cluster import AttentionRates
from autopar.planning.cost.model import Cluster, Collective, CostModel, LinkSpec, get_cluster, this_machine
from autopar.rules.elementwise import TIMED_BACKWARD, TIMED_FUNCTIONS
from autopar.tools.calibrate import _straggle, fit_ring, threads_per_rank
from autopar.tools.cli import main
from autopar.tools.launch import free_port
from autopar.tools.rank_speed import _ATTENTION, attention_rates
from examples import gpt

_LINK = {"latency_s": 1e-4, "bandwidth_Bps": 1e9}

# The ring formulas of CostModel.collective_time's docstring, written out: seconds of a collective
# with an input of B bytes per rank over n ranks on a link of latency a and bandwidth b.
RING = {
    "all_gather": lambda n, a, b, B: (n - 1) * (a + B / b),
    "reduce_scatter": lambda n, a, b, B: (n - 1) * a + (n - 1) / n * B / b,
    "all_to_all": lambda n, a, b, B: (n - 1) * a + (n - 1) / n * B / b,
    "all_reduce": lambda n, a, b, B: 2 * ((n - 1) * a + (n - 1) / n * B / b),
}


def _write(path: Path, **changes: object) -> str:
    data = {**get_cluster("cpu-gloo").to_dict(), "name": "calibrated", "measured_on": this_machine()}
    path.write_text(json.dumps({**data, **changes}))
    return str(path)


def test_a_cluster_file_is_a_cluster(tmp_path: Path):
    model, args = gpt.build()
    path = _write(tmp_path / "cluster.json", peak_flops={"float32": 1e9})
    plan = autopar.plan(model, args, {"dp": 2}, cluster=path)
    assert plan.cluster["name"] == "calibrated" and plan.cluster["measured_on"] == this_machine()
    slower = autopar.plan(model, args, {"dp": 2}).prediction.compute_s
    assert plan.prediction.compute_s > 10 * slower  # 1 GFLOP/s against the preset's 132


def test_a_rank_computing_on_other_threads_than_the_calibration_is_told(tmp_path: Path):
    """The rates hold for ranks on the calibration's threads: a plan made on a rank with another
    number says so; off a rank (``autopar plan``, one process) nothing is said."""
    from autopar.tools.fake_ranks import fake_world

    model, args = gpt.build()
    mine = torch.get_num_threads()
    other = _write(tmp_path / "other.json", threads_per_rank=mine + 1)
    same = _write(tmp_path / "same.json", threads_per_rank=mine)
    told = f"measured on ranks computing on {mine + 1} threads each, and this rank computes on {mine}"
    assert not any(told in w for w in autopar.plan(model, args, {"dp": 2}, cluster=other).warnings)
    with fake_world(4):
        assert any(told in w for w in autopar.plan(model, args, {"dp": 2}, cluster=other).warnings)
        warnings = autopar.plan(model, args, {"dp": 2}, cluster=same).warnings
        assert not any("threads each" in w for w in warnings)


def test_bad_cluster_files_are_refused(tmp_path: Path):
    model, args = gpt.build()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        (str(tmp_path / "missing.json"), "does not exist; measure this machine with `autopar calibrate -o"),
        (str(bad), "cannot be read as JSON"),
        (_write(tmp_path / "partial.json", intra_node=None), "is malformed: missing or bad field"),
        (_write(tmp_path / "other.json", measured_on="gpu-node-17"), "was measured on 'gpu-node-17', not on"),
        (
            _write(
                tmp_path / "kind.json",
                intra_node={**_LINK, "collectives": {"broadcast": _LINK}},
            ),
            "is malformed: missing or bad field intra_node.collectives: unknown key 'broadcast'",
        ),
    ]
    for path, message in cases:
        with pytest.raises(OptionError, match=message.replace("(", r"\(")):
            autopar.plan(model, args, {"dp": 2}, cluster=path)
    with pytest.raises(SystemExit) as usage:  # the command line says so in one line
        main(["plan", "examples/gpt.py:build", "--mesh", "dp=2", "--cluster", cases[0][0]])
    assert usage.value.code == 2


def _cluster(link: LinkSpec) -> Cluster:
    return Cluster("synthetic", {"float32": 1e9}, 1e9, 2**30, 8, intra_node=link, inter_node=link)


def test_each_collective_is_fitted_to_its_own_ring_formula_and_priced_by_it():
    n, sizes = 4, [1 << k for k in range(10, 25, 2)]
    # each kind its own figures, as gloo's collectives differ
    truth = {kind: (30e-6 * (i + 1), 2e9 / (i + 1)) for i, kind in enumerate(RING)}
    samples = {kind: [(b, RING[kind](n, a, beta, b)) for b in sizes] for kind, (a, beta) in truth.items()}
    fitted = {kind: fit_ring(kind, samples[kind], n) for kind in RING}
    for kind, (a, beta) in truth.items():
        assert fitted[kind].latency_s == pytest.approx(a, rel=1e-6)
        assert fitted[kind].bandwidth_Bps == pytest.approx(beta, rel=1e-6)
    # general figures far from every kind's: a kind with figures of its own must not use them
    link = LinkSpec(latency_s=1.0, bandwidth_Bps=1.0, collectives=fitted)
    model = CostModel({"x": n}, _cluster(link))
    for kind in RING:
        for b, t in samples[kind]:
            assert model.collective_time(Collective(kind, ("x",), b)) == pytest.approx(t, rel=1e-6)
        wire_only = model.collective_time(Collective(kind, ("x",), 1 << 20), latency=False)
        assert wire_only == pytest.approx(RING[kind](n, 0.0, truth[kind][1], 1 << 20), rel=1e-6)
    # a kind without figures of its own falls back to the link's
    partial = LinkSpec(1e-4, 1e9, {"all_gather": fitted["all_gather"]})
    model = CostModel({"x": n}, _cluster(partial))
    assert model.collective_time(Collective("all_reduce", ("x",), 1 << 20)) == RING["all_reduce"](
        n, 1e-4, 1e9, 1 << 20
    )


def test_per_collective_figures_round_trip_and_files_without_them_are_unchanged():
    link = LinkSpec(
        1e-4, 1e9, {CollectiveKind.ALL_TO_ALL: LinkSpec(2e-4, 5e8), "all_gather": LinkSpec(3e-4, 4e8)}
    )
    cluster = _cluster(link)
    back = Cluster.from_dict(json.loads(json.dumps(cluster.to_dict())))
    assert back == cluster and hash(back) == hash(cluster)
    assert back.intra_node.for_collective(CollectiveKind.ALL_TO_ALL) == LinkSpec(2e-4, 5e8)
    assert back.intra_node.for_collective(CollectiveKind.ALL_REDUCE) is back.intra_node
    with pytest.raises(TypeError):  # read-only, as peak_flops
        link.collectives["all_reduce"] = LinkSpec(1.0, 1.0)
    for name in ("cpu-gloo", "h100", "fast-links"):
        preset = get_cluster(name).to_dict()
        assert set(preset["intra_node"]) == set(preset["inter_node"]) == {"latency_s", "bandwidth_Bps"}


def test_files_written_before_the_step_figures_load_with_their_defaults():
    added = (
        "op_overhead_s",
        "straggler_s",
        "straggler_base_s",
        "ranks_per_core",
        "host_link_Bps",
        "host_memory_bandwidth_Bps",
        "transcendentals_per_s",
        "optimizer_tensor_s",
        "function_rates",
        "recompute_op_s",
        "recompute_unit_s",
        "checkpoint_unit_s",
        "asynchronous",
        "host_op_overhead_s",
        "threads_per_rank",
        "attention",
    )
    old = {k: v for k, v in get_cluster("cpu-gloo").to_dict().items() if k not in added}
    cluster = Cluster.from_dict(old)
    defaults = [0.0, 0.0, 0.0, 1.0, None, None, None, None, {}, None, None, None, False, None, None, None]
    assert [getattr(cluster, k) for k in added] == defaults
    measured = replace(
        cluster,
        op_overhead_s=5e-6,
        straggler_s=0.01,
        ranks_per_core=2.0,
        host_link_Bps=6e10,
        optimizer_tensor_s=3e-4,
        function_rates={"gelu": 2e9, "gelu_backward": 1e9},
        recompute_op_s=6e-5,
        recompute_unit_s=3e-5,
        checkpoint_unit_s=2e-5,
        asynchronous=True,
        host_op_overhead_s=4e-6,
        threads_per_rank=4,
        attention=AttentionRates(flop_scale=1.2, score_s=1e-9, causal_block=512.0),
    )
    assert Cluster.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured
    for bad in (
        {"op_overhead_s": -1.0},
        {"optimizer_tensor_s": -1e-6},
        {"recompute_op_s": -1e-6},
        {"recompute_unit_s": -1e-6},
        {"checkpoint_unit_s": -1e-6},
        {"host_op_overhead_s": -1e-6},
        {"ranks_per_core": 0.5},
        {"threads_per_rank": 0},
        {"host_link_Bps": 0.0},
        {"transcendentals_per_s": 0.0},
        {"function_rates": {"tanh": 0.0}},
    ):
        with pytest.raises(OptionError):
            replace(cluster, **bad)
    with pytest.raises(OptionError, match="AttentionRates flop_scale must be a number above 0"):
        AttentionRates(flop_scale=0.0, score_s=1e-9, causal_block=0.0)


def test_a_collective_fit_is_not_dragged_down_by_one_lucky_sample():
    n, a, b = 4, 1e-3, 1e9
    samples = [(size, RING["all_gather"](n, a, b, size)) for size in (1 << k for k in range(10, 25, 2))]
    samples[4] = (samples[4][0], samples[4][1] / 6)  # ranks sharing cores: one call ran at a lucky moment
    fitted = fit_ring("all_gather", samples, n)
    assert fitted.latency_s == pytest.approx(a, rel=0.25)
    assert fitted.bandwidth_Bps == pytest.approx(b, rel=0.25)


def test_a_collective_fit_leaves_out_calls_that_stalled():
    n, a, b = 2, 1e-4, 1e9
    samples = [(size, RING["reduce_scatter"](n, a, b, size)) for size in (1 << k for k in range(10, 25, 2))]
    samples[1] = (samples[1][0], 20 * samples[1][1])  # a small call stalled on shared cores: slower than
    samples[2] = (samples[2][0], 8 * samples[2][1])  # larger ones (as measured in a CI run)
    fitted = fit_ring("reduce_scatter", samples, n)
    assert fitted.latency_s == pytest.approx(a, rel=0.05)
    assert fitted.bandwidth_Bps == pytest.approx(b, rel=0.05)


def test_stragglers_are_fitted_to_a_wait_per_collective_and_the_square_root_of_the_compute_before_it():
    bursts = (0.001, 0.004, 0.016, 0.064)

    def rank(base: float, wait: float, stalled: float = 0.0, slow_b2b: float = 0.0) -> dict[str, object]:
        # each rank's typical burst, and the mean span of burst and all_reduce (1 ms back to back),
        # in three rounds; ``stalled`` adds a wait to every burst of the second round, ``slow_b2b``
        # to its back-to-back time alone
        return {
            "back_to_back": [1e-3 + (slow_b2b if r == 1 else 0.0) for r in range(3)],
            "rounds": [
                [(t, t + 1e-3 + base + wait * math.sqrt(t) + (stalled if r == 1 else 0.0)) for t in bursts]
                for r in range(3)
            ],
        }

    # the step waits for the last rank
    assert _straggle([rank(0.0, 0.02), rank(0.0, 0.01)]) == pytest.approx((0.0, 0.02), abs=1e-12)
    assert _straggle([rank(0.003, 0.01)]) == pytest.approx((0.003, 0.01))
    # ranks sharing cores wait a scheduler's slice whatever they computed before
    assert _straggle([rank(0.004, 0.0), rank(0.002, 0.0)]) == pytest.approx((0.004, 0.0), abs=1e-12)
    assert _straggle([{"back_to_back": [1e-3] * 3, "rounds": [[(t, t) for t in bursts]] * 3}]) == (0.0, 0.0)
    # one round's back-to-back time taken at a slow moment: the median over the rounds leaves it out
    assert _straggle([rank(0.003, 0.01, slow_b2b=0.05)]) == pytest.approx((0.003, 0.01))
    # one round the host stalled in: the median over the rounds leaves it out
    assert _straggle([rank(0.003, 0.01, stalled=0.05)]) == pytest.approx((0.003, 0.01))


def test_attention_rates_are_fitted_within_what_a_kernel_can_do():
    """Times made by the model give back its rates; a difference of head dims faster than the
    product rate is read at that rate (the rest per score), a narrow call faster than its own
    products at that rate all as products; a causal call at half the full one skips by 0 keys."""
    batch, heads, length = _ATTENTION["cpu"]
    scores = batch * heads * length * length
    counted, peak = 3 * 2 * scores * 2 * 64, 1e11
    narrow = 1.25 * counted / peak + 2e-9 * scores
    fitted = attention_rates((narrow, narrow + 1.25 * counted / peak, 0.75 * narrow), peak)
    assert fitted.flop_scale == pytest.approx(1.25) and fitted.score_s == pytest.approx(2e-9)
    assert fitted.causal_block == pytest.approx(length / 2)
    fast_products = attention_rates((narrow, narrow + 0.3 * counted / peak, 0.5 * narrow), peak)
    assert fast_products.flop_scale == pytest.approx(1.0) and fast_products.causal_block == 0
    assert fast_products.score_s == pytest.approx((narrow - counted / peak) / scores)
    all_products = attention_rates((0.5 * counted / peak, counted / peak, counted / peak), peak)
    assert all_products.flop_scale == pytest.approx(0.5) and all_products.score_s == 0


def _check_attention(cluster: Cluster) -> None:
    """Attention was timed: its products near the product rate (the kernels' small blocks and
    the backward's recomputed scores run somewhat slower, docs/cost_model.md), a score's own cost,
    and the causal kernel's key blocks within the 1024 keys timed."""
    rates = cluster.attention
    assert rates is not None and 0.5 < rates.flop_scale < 8 and rates.score_s < 1e-7
    assert 0 <= rates.causal_block <= 1024


def _attention_call(batch: int, heads: int, length: int, head_dim: int, causal: bool) -> Callable[[], None]:
    """Attention's forward and backward at one shape, as a call to time."""
    q, k, v = (torch.randn(batch, heads, length, head_dim, requires_grad=True) for _ in range(3))
    return lambda: (
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
    )


def _attention_ratios(cluster: Cluster, shapes: list[tuple[int, int, int, int, bool]]) -> list[float]:
    """Measured over predicted seconds of attention's forward and backward at each of ``shapes``
    (batch, heads, length, head dim, causal), on one thread as the calibrating rank computed.

    The prices are those of the rates :func:`attention_rates` fits, as calibrate does, to calibrate's
    three calls (:data:`_ATTENTION`'s shape at head dims 64 and 128, and at 64 under the causal mask),
    timed here in the same rounds as ``shapes`` (two of warm-up, then seven), so that the ratios are
    the cost model's whatever the host's speed: a host slower or faster than while calibrate ran, or
    a stretch of it within the rounds, moves the fitted prices and the runs alike. Each call is timed
    in this process's CPU seconds, which the host's other work does not add to as it adds to the
    wall time of a process waiting for a core."""
    batch, heads, length = _ATTENTION["cpu"]
    fitted = [
        (batch, heads, length, 64, False),
        (batch, heads, length, 128, False),
        (batch, heads, length, 64, True),
    ]
    steps = [_attention_call(*shape) for shape in [*fitted, *shapes]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times: list[list[float]] = [[] for _ in steps]
        for round_ in range(9):
            for step, timed in zip(steps, times):
                seconds = timeit.timeit(step, number=1, timer=time.process_time)
                if round_ >= 2:
                    timed.append(seconds)
    finally:
        torch.set_num_threads(threads)
    narrow, wide, causal, *measured = (statistics.median(t) for t in times)
    rates = attention_rates((narrow, wide, causal), cluster.peak_flops["float32"])
    model, ratios = CostModel({"x": 1}, replace(cluster, attention=rates)), []
    for (*shape, causal_mask), seconds in zip(shapes, measured):
        scores = math.prod(shape[:3]) * shape[2]
        attention = (scores, shape[2] if causal_mask else 0)
        predicted = model.op_time(4 * scores * shape[3], 0, torch.float32, grad=True, attention=attention)
        ratios.append(seconds / predicted)
    return ratios


def _check_calibrated(path: Path, devices_per_node: int, threads: int) -> None:
    """The file is this machine's, with both links and all four kinds measured on ranks computing
    on ``threads`` threads each, and plan takes it."""
    cluster = get_cluster(str(path))
    assert cluster.measured_on == this_machine() and cluster.name == "calibrated"
    assert cluster.threads_per_rank == threads
    assert set(cluster.peak_flops) == {"float32", "bfloat16", "float16"}
    assert cluster.devices_per_node == devices_per_node
    assert cluster.op_overhead_s > 0 and cluster.optimizer_tensor_s > 0
    # a recompute region's unit (an op or a tensor it saves): the relaunch, the checkpoint policy's
    # dispatch and hooks, some 10 plain ops
    assert cluster.recompute_unit_s > cluster.op_overhead_s and not cluster.asynchronous
    # measured (its order against the policy's figure holds on a steady host: the one-device test;
    # ranks outnumbering cores have read it above, the paired calls' waits for a core dominating)
    assert cluster.checkpoint_unit_s > 0
    _check_attention(cluster)
    timed = {*TIMED_FUNCTIONS, *(f"{name}_backward" for name in TIMED_BACKWARD)}
    assert set(cluster.function_rates) == timed and min(cluster.function_rates.values()) > 0
    for link in (cluster.intra_node, cluster.inter_node):
        assert set(link.collectives) == set(CollectiveKind) and link.bandwidth_Bps > 0
        assert all(k.latency_s >= 0 and k.bandwidth_Bps > 0 for k in link.collectives.values())
    model, args = gpt.build()
    assert autopar.plan(model, args, {"dp": 2, "tp": 2}, cluster=str(path)).cluster["name"] == "calibrated"


def test_calibrate_refuses_a_torchrun_world_with_gpus(monkeypatch, capsys):
    """It times CPU ranks over gloo: on GPUs it would write the CPUs' rates as theirs."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert main(["calibrate", "-o", "unused.json"]) != 0
    assert "this world has GPUs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cuda"], "this machine has no CUDA device"),
        (["--device", "tpu"], "is not a torch device such as cuda or cuda:1"),
        (["--device", "meta"], "calibrate times cuda or cpu devices"),
        (["--links", "h100"], "give --device too"),
        (["--device", "cpu", "--ranks", "2"], "without --ranks, and not under torchrun"),
        (["--device", "cpu", "--links", "nvlink"], "presets are"),
    ],
)
def test_calibrating_one_device_checks_its_options(monkeypatch, capsys, args, message):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["calibrate", *args, "-o", "unused.json"]) != 0
    assert message in capsys.readouterr().err


@pytest.mark.calibration
def test_calibrate_times_one_device_with_a_presets_links(tmp_path: Path, capsys):
    """``--device``: what a rank computes with is timed on the device (the CPU here, a GPU where
    there is one, as bench/fidelity_gpu.py does), the links are the named preset's."""
    path = tmp_path / "cluster.json"
    assert main(["calibrate", "--device", "cpu", "--links", "h100", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no collectives to time: the links, devices per node and stragglers are the h100 preset's" in out
    cluster, preset = get_cluster(str(path)), get_cluster("h100")
    assert cluster.measured_on == this_machine() and cluster.name == "calibrated"
    assert (cluster.intra_node, cluster.inter_node) == (preset.intra_node, preset.inter_node)
    assert cluster.devices_per_node == preset.devices_per_node
    assert set(cluster.peak_flops) == {"float32", "bfloat16", "float16"}
    assert cluster.peak_flops["float32"] < preset.peak_flops["float32"] / 100  # the CPU's, not the H100's
    assert cluster.recompute_unit_s > cluster.op_overhead_s > 0 and not cluster.asynchronous
    assert 0 < cluster.checkpoint_unit_s < cluster.recompute_unit_s
    assert "attention at" in out and "causal blocks of" in out
    _check_attention(cluster)
    # attention as the plan prices it and as it runs, at rates fitted as calibrate fits them: the shape
    # timed, and others whose prices extrapolate the fit: more heads, and a causal sequence twice as
    # long, whose key blocks the kernel skips (docs/cost_model.md)
    timed, heads, causal = _attention_ratios(
        cluster, [(1, 2, 1024, 64, False), (1, 4, 1024, 64, False), (1, 2, 2048, 64, True)]
    )
    assert 0.5 < timed < 1.7
    assert 0.8 < heads / timed < 1.25
    assert 0.8 < causal / timed < 1.25
    model, args = gpt.build()
    assert autopar.plan(model, args, {"dp": 2}, cluster=str(path)).cluster["name"] == "calibrated"


@pytest.mark.calibration
def test_calibrate_measures_this_machine_into_a_file(tmp_path: Path, capsys):
    path = tmp_path / "cluster.json"
    assert main(["calibrate", "--ranks", "2", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"cluster written to {path}" in out
    assert "inter_node not measured (one node): it repeats the intra_node figures" in out
    _check_calibrated(path, 1 << 20, threads_per_rank(2))


@pytest.mark.calibration
def test_calibrate_under_torchrun_measures_each_node_level(tmp_path: Path):
    """Two torchrun "nodes" of 2 ranks each on this host: links inside and across them."""
    path, port = tmp_path / "cluster.json", free_port()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k)]
            + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
            + ["-m", "autopar.tools.cli", "calibrate", "-o", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # one thread a rank, as torchrun gives several ranks per node by default: ranks whose
            # threads outnumber the cores slow calibrate's many small ops, the recompute regions'
            # most (that calibrate keeps the launch's threads: the test after this one)
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for k in (0, 1)
    ]
    (out0, err0), (out1, err1) = (node.communicate(timeout=300) for node in nodes)
    assert [node.returncode for node in nodes] == [0, 0], err0 + err1
    assert f"cluster written to {path}" in out0 and "not measured" not in out0
    assert "intra_node, groups of 2" in out0 and "inter_node, groups of 2" in out0
    assert out1 == ""  # ranks other than 0 exit quietly
    _check_calibrated(path, 2, 1)


def test_calibrate_under_torchrun_computes_on_the_launchs_threads(monkeypatch):
    """Each rank times what it computes on the threads the launch gave it (OMP_NUM_THREADS), as
    the training run it launches the same way computes, not on calibrate's share of the cores."""
    from autopar.tools import calibrate

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    measured, launched = [], threads_per_rank(2) + 1  # not calibrate's share of this host
    monkeypatch.setattr(torch, "get_num_threads", lambda: launched)
    monkeypatch.setattr(calibrate, "init_restartable_process_group", lambda backend: None)
    monkeypatch.setattr(calibrate.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(calibrate, "_measure_world", lambda *given: measured.append(given))
    calibrate._measured_under_torchrun()
    assert measured == [(2, launched)]
