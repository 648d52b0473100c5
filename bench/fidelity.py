"""Fidelity of the cost model: predicted against measured step time of 8 plans on 4 gloo ranks.

Usage, from the repository root::

    autopar calibrate --ranks 4 -o cluster.json        # this machine, 4 ranks running at once
    python bench/fidelity.py --cluster cluster.json [--steps 6]

The example GPT (``gpt.DEMO``: vocabulary 4096, sequence 128, d_model 256, 4 layers), global
batch 16, AdamW, is planned and trained under 8 plans: data parallel, Megatron tensor parallel,
both, ZeRO-3, full recompute, ZeRO-2 with the optimizer offloaded, a 1F1B pipeline, and the
solver's own for dp=2 x tp=2, all compiled first and then stepped in turns. Each plan's
predicted step (``plan.step_time_s``) is printed beside the median measured step (the slowest
rank's, after 2 warm-up steps), with the ratio
and the Spearman rank correlation over the plans. Issue 16 asks for every plan within ±25%
and a correlation of at least 0.9. Last, the host's float32 FLOP/s and memory bandwidth before
and after the run, over the cluster file's: a shared host whose speed moved since the
calibration moves every plan's ratio with it. Beside them, a 1 MiB all-gather over the four
ranks, timed on idle ranks (as calibrate times collectives) and right after a matrix product on
each rank's threads (as a step runs most of its collectives), each as the calibrated time over
the time now: on a 16-core host a rank's compute threads went on spinning after a product, on
the cores gloo's threads then needed, and the plans that communicate most measured up to 2.6x
their time of a minute before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.ir.plan import CollectiveKind  # noqa: E402
from autopar.planning.cost.model import Cluster, get_cluster, ring_terms  # noqa: E402
from autopar.tools.calibrate import threads_per_rank  # noqa: E402
from autopar.tools.launch import spawn  # noqa: E402
from autopar.tools.rank_speed import host_speed  # noqa: E402
from examples import gpt  # noqa: E402

BATCH = 16
# name: mesh, annotation style (None: the solver's), plan options
PLANS: dict[str, tuple[dict[str, int], str | None, dict[str, Any]]] = {
    "data dp4": ({"dp": 4}, "dp", {}),
    "tensor tp4": ({"tp": 4}, "tp", {}),
    "megatron dp2 x tp2": ({"dp": 2, "tp": 2}, "dp-tp", {}),
    "ZeRO-3 dp4": ({"dp": 4}, "dp", {"memory": autopar.Memory(zero=3)}),
    "recompute dp4": ({"dp": 4}, "dp", {"recompute": True}),
    "ZeRO-2 offload dp4": ({"dp": 4}, "dp", {"memory": autopar.Memory(zero=2, offload_optimizer=True)}),
    "pipeline pp2 x dp2": ({"pp": 2, "dp": 2}, None, {"pipeline": autopar.Pipeline(4, "1f1b")}),
    "solver dp2 x tp2": ({"dp": 2, "tp": 2}, None, {}),
}


def _build(name: str, cluster: str) -> tuple[float, Callable[[], None]]:
    """Plan ``name`` on this rank's group: its predicted seconds, and one training step of it."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes, style, options = PLANS[name]
    options = dict(options)
    torch.manual_seed(0)
    model, (idx, targets) = gpt.build(gpt.DEMO, batch_size=BATCH)
    if style is not None:
        gpt.annotate(model, style)
    if options.pop("recompute", False):
        for block in model.blocks:
            autopar.recompute(block, "full")
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    dmodel = autopar.compile(model, mesh, (idx, targets), cluster=cluster, **options)
    optimizer = dmodel.optimizer(torch.optim.AdamW, lr=1e-3)

    def step() -> None:
        dmodel.train_step((idx, targets))  # the model computes its loss
        optimizer.step()
        optimizer.zero_grad()

    return dmodel.plan.step_time_s, step


_PROBE_BYTES = 1 << 20  # one rank's input to the probe's all-gather: a ZeRO-3 gather's size here
_PROBE_PRODUCT = 512  # the side of the matrix product the second probe's gathers follow


def _gather_speeds(calibrated: Cluster) -> tuple[float, float]:
    """The calibrated time of a 1 MiB all-gather over the world over its median time now (the
    slowest rank's): on idle ranks, and each call right after a matrix product."""
    world = dist.get_world_size()
    x = torch.zeros(_PROBE_BYTES // 4)
    out, a = x.new_empty(world * x.numel()), torch.randn(_PROBE_PRODUCT, _PROBE_PRODUCT)
    link = calibrated.intra_node.for_collective(CollectiveKind.ALL_GATHER)
    hops, share = ring_terms(CollectiveKind.ALL_GATHER, world)
    predicted = hops * link.latency_s + share * _PROBE_BYTES / link.bandwidth_Bps
    speeds = []
    for product in (False, True):
        times = []
        for _ in range(17):
            dist.barrier()
            if product:
                torch.mm(a, a)
            t0 = time.perf_counter()
            dist.all_gather_single(out, x)
            times.append(time.perf_counter() - t0)
        slowest = torch.tensor(statistics.median(times[2:]))
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        speeds.append(predicted / slowest.item())
    return speeds[0], speeds[1]


def _world(cluster: str, steps: int, names: list[str]) -> dict[str, Any]:
    """``plans``: (predicted, measured median) seconds of every plan; ``host``: the host's float32
    FLOP/s and memory bandwidth (:func:`host_speed`) and its all-gathers' speed
    (:func:`_gather_speeds`) before and after, over the cluster's. The
    plans take turns, one step each per round, so that the machine's speed drifting during the
    run (other work on the host) slows every plan alike instead of the plans measured while it
    lasts; the host's speed says whether it drifted since the calibration."""
    torch.set_num_threads(threads_per_rank(4))  # as the calibration's ranks computed
    calibrated = get_cluster(cluster)
    nominal = (calibrated.peak_flops["float32"], calibrated.memory_bandwidth_Bps)
    before = (*host_speed(), *_gather_speeds(calibrated))
    built = {name: _build(name, cluster) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(steps + 2):
        for name, (_, step) in built.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            elapsed = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_ >= 2:  # two warm-up steps each
                times[name].append(elapsed.item())
    after = (*host_speed(), *_gather_speeds(calibrated))
    kinds = ("float32 FLOP/s", "memory bandwidth", "all-gather", "all-gather after a product")
    nominal += (1.0, 1.0)  # the gathers' speeds are over the calibrated times already
    return {
        "plans": {name: (built[name][0], statistics.median(times[name])) for name in names},
        "host": {kind: [speed[i] / nominal[i] for speed in (before, after)] for i, kind in enumerate(kinds)},
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (no ties expected)."""

    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0] * len(v)
        for r, i in enumerate(order):
            out[i] = r
        return out

    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def chosen_plans(parser: argparse.ArgumentParser, given: str | None, plans: list[str]) -> list[str]:
    """The plans ``--plans`` names (comma-separated; all of ``plans`` when not given), or the
    parser's error naming those that are not plans."""
    names = plans if given is None else [n.strip() for n in given.split(",")]
    if unknown := sorted(set(names) - set(plans)):
        parser.error(f"unknown plans {unknown}; the plans are {plans}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="cpu-gloo", help="a preset or a file from autopar calibrate")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per plan")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--plans", help="comma-separated names of PLANS to run (default: all)")
    a = parser.parse_args()
    found = spawn(_world, 4, a.cluster, a.steps, chosen_plans(parser, a.plans, list(PLANS)))[0]
    results = found["plans"]
    print(f"| plan | predicted ms | measured ms | measured / predicted |  (cluster {a.cluster})")
    print("| --- | --- | --- | --- |")
    for name, (predicted, measured) in results.items():
        print(f"| {name} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | {measured / predicted:.2f} |")
    if len(results) > 1:  # a rank correlation needs two plans
        pred, meas = zip(*results.values())
        print(f"Spearman rank correlation: {spearman(list(pred), list(meas)):.2f}")
    drift = ", ".join(f"{kind} {b:.2f}x before, {e:.2f}x after" for kind, (b, e) in found["host"].items())
    print(f"the host against the cluster's figures: {drift}")
    if a.json:
        a.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
