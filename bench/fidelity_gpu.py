"""Fidelity of the cost model on one GPU: predicted against measured step time of one-device plans.

Usage, from the repository root, on a machine with a CUDA GPU::

    python bench/fidelity_gpu.py [--steps 8] [--json out.json] [--plans "fp32 b16,bf16 b64"]

The device is timed first as ``autopar calibrate --device cuda`` times it
(:func:`autopar.tools.calibrate_device.device_cluster`, :mod:`autopar.tools.rank_speed` on the
GPU: product FLOP/s per dtype, memory bandwidth, exp and the elementwise functions' rates, the
overhead of an op, of a recompute region's unit (an op or a tensor it saves) and of an optimizer
tensor, the copies to and from the host, the host's memory bandwidth and op overhead) into an
asynchronous cluster whose
links are the ``h100`` preset's: one GPU has no link to time, and a one-device plan sends nothing
over one.
Then the example GPT is planned, compiled on a mesh of that one device (an NCCL world of one) and
trained under every plan of :data:`PLANS` (two model sizes; fp32 or bf16 mixed precision;
recompute; the optimizer offloaded to the host). Each plan's steps are timed in a row, as a
training loop runs them (the median of ``--steps`` after two warm-ups), and again with the plans
taking turns one step each, which leaves each step's host caches cold: on an H100 host the
launch-bound fp32 b16 step took 14.8 ms in a row and 21.7 ms in turns. The host's per-op cost is
timed again before and after the steps (it moved 2x within seconds on such hosts, and with it
every launch-bound step) and printed beside the calibration's; it is also timed after each
round of a plan's steps, and the plan predicted again with every figure the host's dispatch sets
scaled to it (:func:`at_host_speed`). Each plan's predicted step
under the measured cluster and under the ``h100`` preset (vendor peaks) is printed beside the
measured steps, with the ratios and the Spearman rank correlation, and its first loss beside the
plain model's on the same device (the compiled program must compute what the model does).
``--device cpu`` runs the same on a gloo world of
one, to try the script where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.planning.cost.model import Cluster, get_cluster  # noqa: E402
from autopar.tools import rank_speed  # noqa: E402
from autopar.tools.calibrate_device import LINKS_FROM, device_cluster  # noqa: E402
from autopar.tools.launch import spawn  # noqa: E402
from bench.fidelity import chosen_plans, spearman  # noqa: E402
from examples import gpt  # noqa: E402

# 8 layers of width 1024 over 1024 tokens: some 160M parameters, a step of a few TFLOP, so that
# the GPU's arithmetic rather than the launch of its kernels sets the pace
WIDE = gpt.GPTConfig(vocab_size=32000, seq_len=1024, d_model=1024, n_heads=16, n_layers=8, d_ff=4096)
BF16 = {"precision": autopar.MixedPrecision(torch.bfloat16)}
# name: model, global batch, options (``recompute``: every block's, in full)
PLANS: dict[str, tuple[gpt.GPTConfig, int, dict[str, Any]]] = {
    "fp32 b16": (gpt.DEMO, 16, {}),
    "fp32 b64": (gpt.DEMO, 64, {}),
    "recompute b64": (gpt.DEMO, 64, {"recompute": True}),
    "bf16 b64": (gpt.DEMO, 64, BF16),
    "offloaded optimizer b16": (gpt.DEMO, 16, {"memory": autopar.Memory(offload_optimizer=True)}),
    "wide fp32 b8": (WIDE, 8, {}),
    "wide bf16 b8": (WIDE, 8, BF16),
    "wide bf16 recompute b8": (WIDE, 8, {**BF16, "recompute": True}),
}


def _build(name: str, cluster: Cluster, device: str) -> dict[str, Any]:
    """Plan and compile ``name``: its predictions, the plain model's first loss and the compiled
    one's, and a function running one training step."""
    from torch.distributed.device_mesh import init_device_mesh

    config, batch, options = PLANS[name]
    options = dict(options)
    recompute = options.pop("recompute", False)

    def model_and_batch() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(0)
        model, batch_ = gpt.build(config, batch_size=batch)
        if recompute:
            for block in model.blocks:
                autopar.recompute(block, "full")
        return model, batch_

    def predict(at: Cluster | str) -> float:
        fresh, _ = model_and_batch()
        return autopar.plan(fresh, (idx, targets), {"dp": 1}, cluster=at, **options).step_time_s

    model, (idx, targets) = model_and_batch()
    plain_loss = _plain_loss(model, idx, targets, device, options.get("precision"))
    preset = predict("h100")
    model, _ = model_and_batch()
    mesh = init_device_mesh(torch.device(device).type, (1,), mesh_dim_names=("dp",))
    dmodel = autopar.compile(model, mesh, (idx, targets), cluster=cluster, **options)
    optimizer = dmodel.optimizer(torch.optim.AdamW, lr=1e-3)
    inputs = (idx.to(device), targets.to(device))

    def step() -> float:
        loss = dmodel.train_step(inputs)  # the model computes its loss
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    first = step()
    return {
        "predicted": dmodel.plan.step_time_s,
        "preset": preset,
        "losses": (plain_loss, first),
        "step": step,
        "predict": predict,
    }


def at_host_speed(cluster: Cluster, op_s: float) -> Cluster:
    """``cluster`` with the host as fast as an op of ``op_s`` seconds says: every figure the host's
    dispatch sets (an op's overhead, a recompute region's unit, an optimizer tensor's, the host's own
    op) scaled by ``op_s`` over the calibrated op."""
    speed = op_s / cluster.op_overhead_s

    def scaled(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * speed

    return replace(
        cluster,
        op_overhead_s=op_s,
        recompute_op_s=scaled(cluster.recompute_op_s),
        recompute_unit_s=scaled(cluster.recompute_unit_s),
        checkpoint_unit_s=scaled(cluster.checkpoint_unit_s),
        optimizer_tensor_s=scaled(cluster.optimizer_tensor_s),
        host_op_overhead_s=scaled(cluster.host_op_overhead_s),
    )


def _plain_loss(
    model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, device: str, precision: Any
) -> float:
    """The uncompiled model's loss on ``device``, its parameters in the plan's compute dtype (mixed
    precision computes in it from a cast of the fp32 weights)."""
    dtype = torch.float32 if precision is None else precision.param_dtype
    with torch.no_grad():
        return float(model.to(device, dtype)(idx.to(device), targets.to(device)))


def _world(device: str, names: list[str], steps: int) -> dict[str, Any]:
    """Every plan's figures (:func:`_build`) and measured median step, on this world of one."""
    if device != "cpu":
        torch.cuda.set_device(device)
    started = time.perf_counter()
    cluster = device_cluster(device, get_cluster(LINKS_FROM[torch.device(device).type]))
    timed = time.perf_counter() - started
    built, failed = {}, {}
    for name in names:
        try:
            built[name] = _build(name, cluster, device)
        except Exception as error:  # noqa: BLE001 - a plan that fails is reported, the others go on
            failed[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}"
    # the host dispatches ops at a pace that moves 2x within seconds on some hosts: its op timed
    # again around the plans' steps says how far from the calibration's the steps ran
    before = rank_speed.op_overhead(device)
    alone = {name: _median_steps([plan["step"]], steps, device, beside=True) for name, plan in built.items()}
    in_turns, _ = _median_steps([plan["step"] for plan in built.values()], steps, device)
    host_op_s = (before, rank_speed.op_overhead(device))
    rows = {}
    for (name, plan), turns in zip(built.items(), in_turns):
        (measured,), op_s = alone[name]
        rows[name] = {
            **{k: v for k, v in plan.items() if k not in ("step", "predict")},
            "measured": measured,
            "in_turns": turns,
            "host_op_s": op_s,
            "at_host_speed": plan["predict"](at_host_speed(cluster, op_s)),
        }
    return {
        "cluster": cluster.to_dict(),
        "calibration_s": timed,
        "plans": rows,
        "failed": failed,
        "host_op_s": host_op_s,
    }


def _median_steps(
    steps: list[Callable[[], float]], rounds: int, device: str, beside: bool = False
) -> tuple[list[float], float]:
    """The median seconds of each of ``steps`` over ``rounds`` rounds, each round running every
    step once in order, after two rounds of warm-up; and where ``beside``, the median of the host's
    op (:func:`rank_speed.op_overhead`) timed after each round, else 0."""
    times: list[list[float]] = [[] for _ in steps]
    ops: list[float] = []
    for round_ in range(rounds + 2):
        for timed, step in zip(times, steps):
            rank_speed.synchronize(device)
            t0 = time.perf_counter()
            step()  # float(loss) waits for the device
            if round_ >= 2:
                timed.append(time.perf_counter() - t0)
        if beside and round_ >= 2:
            ops.append(rank_speed.op_overhead(device))
    return [statistics.median(t) for t in times], statistics.median(ops) if ops else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="the device timed and trained on (default cuda:0)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per plan")
    parser.add_argument("--plans", help="comma-separated names of PLANS to run (default: all)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    a = parser.parse_args()
    names = chosen_plans(parser, a.plans, list(PLANS))
    backend = "gloo" if a.device == "cpu" else "nccl"
    found = spawn(_world, 1, a.device, names, a.steps, backend=backend)[0]
    _print(found, a.device)
    if a.json:
        a.json.write_text(json.dumps(found, indent=1))


def _print(found: dict[str, Any], device: str) -> None:
    cluster = found["cluster"]
    flops = ", ".join(f"{d} {f / 1e12:.1f}" for d, f in cluster["peak_flops"].items())
    print(
        f"{cluster['name']} on {device}, timed in {found['calibration_s']:.0f} s: TFLOP/s {flops}; memory "
        f"{cluster['memory_bandwidth_Bps'] / 1e9:.0f} GB/s; {cluster['op_overhead_s'] * 1e6:.1f} us per op"
    )
    print(
        "| plan | predicted ms | h100 preset ms | measured ms | ratio | to preset | in turns ms | losses "
        "| host's op beside µs | predicted at that speed ms | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = found["plans"]
    for name, row in rows.items():
        p, h, m, at = row["predicted"], row["preset"], row["measured"], row["at_host_speed"]
        plain, compiled = row["losses"]
        print(
            f"| {name} | {p * 1e3:.2f} | {h * 1e3:.2f} | {m * 1e3:.2f} | {m / p:.2f} | {m / h:.2f} "
            f"| {row['in_turns'] * 1e3:.2f} | {plain:.4f}, {compiled:.4f} | {row['host_op_s'] * 1e6:.1f} "
            f"| {at * 1e3:.2f} | {m / at:.2f} |"
        )
    if len(rows) > 1:
        measured = [r["measured"] for r in rows.values()]
        calibrated = spearman([r["predicted"] for r in rows.values()], measured)
        beside = spearman([r["at_host_speed"] for r in rows.values()], measured)
        print(
            f"Spearman rank correlation: {calibrated:.2f}; at the host's speed beside the steps: {beside:.2f}"
        )
    before, after = (t * 1e6 for t in found["host_op_s"])
    print(f"the host's op: {before:.1f} us before the plans' steps, {after:.1f} after (calibrated above)")
    for name, why in found["failed"].items():
        print(f"FAILED {name}: {why}")


if __name__ == "__main__":
    main()
