"""Pipeline schedules on gloo ranks: predicted against measured bubble, step time and activation memory.

Usage, from the repository root::

    python bench/pipeline.py [--ranks 2] [--microbatches 2,4,8] [--schedules gpipe,1f1b,interleaved-1f1b]
                             [--steps 4] [--json out.json] [model size options]

The script spawns ``--ranks`` gloo processes (one thread each) on a mesh ``pp=ranks × dp=1`` and,
for every schedule and microbatch count, compiles the example GPT with ``autopar.compile(...,
pipeline=...)`` (stages chosen by the planner; two per rank for ``interleaved-1f1b``) and times
``dmodel.train_step`` (forward and backward of every microbatch, gradient sums included; not the
optimizer step) over ``--steps`` steps after one warm-up step. The microbatch size is fixed
(``--microbatch-size``), so the global batch grows with the microbatch count and every microbatch
costs the same.

Measured, per rank, by wrapping its ``PipelineStage``s' ``forward_one_chunk`` and
``backward_one_chunk``:

* *busy*: seconds spent computing forwards and backwards; the bubble is ``1 - busy / step``;
* *in flight*: the most microbatch-stages forwarded and not yet backwarded at once;
* *activation memory*: the bytes of the tensors each microbatch's forward saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``; storages counted once, parameters excluded),
  held from its forward until its backward; the peak over the step of the sum over microbatches
  in flight.

Predicted: the plan's bubble ``((p-1)/v) / (m + (p-1)/v)``, its step time, and per rank the sum
over its stages of the activation bytes of one microbatch times the microbatches in flight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Run as a plain script from a checkout (and in spawned ranks, which re-import this file).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.tools.launch import spawn  # noqa: E402
from examples import gpt  # noqa: E402


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Meter:
    """Busy time, microbatches in flight and saved activation bytes of one rank's stages."""

    def __init__(self, stages: list[Any], params: list[torch.Tensor]) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.busy = 0.0
        self.live_bytes = self.peak_bytes = 0
        self.in_flight = self.peak_in_flight = 0
        self.saved: dict[tuple[int, int], int] = {}
        self.per_microbatch: dict[int, int] = {}  # stage -> saved bytes of one microbatch
        for stage in stages:
            self._wrap(stage)

    def reset(self) -> None:
        self.busy = 0.0
        self.peak_bytes = self.live_bytes
        self.peak_in_flight = self.in_flight

    def _wrap(self, stage: Any) -> None:
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def timed_forward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            storages: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.param_storages:
                    storages[storage.data_ptr()] = storage.nbytes()
                return t

            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward(chunk, *args, **kwargs)
            self.busy += time.perf_counter() - start
            nbytes = sum(storages.values())
            self.per_microbatch[stage.stage_index] = nbytes
            self.saved[stage.stage_index, chunk] = nbytes
            self.live_bytes += nbytes
            self.in_flight += 1
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            return out

        def timed_backward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = backward(chunk, *args, **kwargs)
            self.busy += time.perf_counter() - start
            self.live_bytes -= self.saved.pop((stage.stage_index, chunk))
            self.in_flight -= 1
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = timed_forward, timed_backward


def run_case(config: gpt.GPTConfig, schedule: str, m: int, microbatch_size: int, steps: int) -> dict:
    """On every rank: compile, warm up, time ``steps`` training steps; this rank's figures."""
    from torch.distributed.device_mesh import init_device_mesh

    p = dist.get_world_size()
    mesh = init_device_mesh("cpu", (p, 1), mesh_dim_names=("pp", "dp"))
    v = 2 if schedule == "interleaved-1f1b" else 1
    torch.manual_seed(0)
    model, (idx, targets) = gpt.build(config, batch_size=m * microbatch_size)
    dmodel = autopar.compile(model, mesh, (idx,), pipeline=autopar.Pipeline(m, schedule, v))
    meter = Meter(dmodel.pipeline.stages, [q.to_local() for q in dmodel.parameters()])
    optimizer = torch.optim.SGD(dmodel.parameters(), lr=1e-3)
    times, busy, bytes_peak, flight_peak = [], [], [], []
    for step in range(steps + 1):
        dist.barrier()
        meter.reset()
        start = time.perf_counter()
        dmodel.train_step((idx,), targets, loss_fn)
        elapsed = time.perf_counter() - start
        optimizer.step()
        optimizer.zero_grad()
        if step:  # the first step warms up (and compiles the loss)
            times.append(elapsed)
            busy.append(meter.busy)
            bytes_peak.append(meter.peak_bytes)
            flight_peak.append(meter.peak_in_flight)
    rank = mesh.get_local_rank("pp")
    pp = dmodel.plan.pipeline
    mine = pp.rank_stages(rank)
    return {
        "schedule": schedule,
        "microbatches": m,
        "rank": rank,
        "stages": [s.index for s in mine],
        "step_s": statistics.median(times),
        "busy_s": statistics.median(busy),
        "peak_in_flight": max(flight_peak),
        "peak_activation_bytes": max(bytes_peak),
        "microbatch_activation_bytes": sum(meter.per_microbatch.values()),
        "predicted": {
            "bubble": pp.bubble_fraction,
            "step_s": pp.step_time_s,
            "in_flight": round(sum(s.in_flight for s in mine)),
            "peak_activation_bytes": sum(s.peak_activation_bytes for s in mine),
            "microbatch_activation_bytes": sum(s.activation_bytes for s in mine),
        },
    }


def run_all(config: gpt.GPTConfig, cases: list[tuple[str, int]], microbatch_size: int, steps: int) -> list:
    torch.set_num_threads(1)
    return [run_case(config, schedule, m, microbatch_size, steps) for schedule, m in cases]


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(results: list[list[dict]]) -> list[str]:
    """Markdown rows: one per case and rank."""
    lines = [
        "| schedule | m | rank | bubble pred. | bubble meas. | step ms pred. | step ms meas. "
        "| in flight pred./meas. | activations MiB per microbatch pred./meas. | peak MiB pred./meas. |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in zip(*results):
        for r in case:
            pred = r["predicted"]
            bubble = 1 - r["busy_s"] / r["step_s"]
            lines.append(
                f"| {r['schedule']} | {r['microbatches']} | {r['rank']} | {pred['bubble']:.1%} "
                f"| {bubble:.1%} | {pred['step_s'] * 1e3:.0f} | {r['step_s'] * 1e3:.0f} "
                f"| {pred['in_flight']} / {r['peak_in_flight']} "
                f"| {_mib(pred['microbatch_activation_bytes'])} / {_mib(r['microbatch_activation_bytes'])} "
                f"| {_mib(pred['peak_activation_bytes'])} / {_mib(r['peak_activation_bytes'])} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    config = gpt.GPTConfig(a.vocab_size, a.seq_len, a.d_model, a.n_heads, a.n_layers, a.d_ff)
    cases = [(s, int(m)) for s in a.schedules.split(",") for m in a.microbatches.split(",")]
    results = spawn(run_all, a.ranks, config, cases, a.microbatch_size, a.steps)
    print(f"GPT {config}, microbatch size {a.microbatch_size}, {a.ranks} gloo ranks (pp={a.ranks} x dp=1)")
    print("\n".join(report(results)))
    if a.json:
        config_json = {**vars(a), "json": str(a.json)}
        a.json.write_text(json.dumps({"config": config_json, "results": results}, indent=1))


if __name__ == "__main__":
    main()
