"""Live step telemetry beside the plan's prediction: :class:`StepMeter`.

Wrap each training step (forward, backward, optimizer) in ``meter.step()``::

    meter = StepMeter(dmodel, optimizer, tokens=batch * seq, jsonl="steps.jsonl")
    for batch in batches:
        with meter.step():
            loss = dmodel.train_step(batch, target, loss_fn)
            optimizer.step()
            optimizer.zero_grad()

Every rank measures; the first rank prints one line per step and appends one JSON object per
line to ``jsonl``. Each step reports its wall time (the slowest rank's), tokens (or samples)
per second, the bytes this rank sent into collectives, and model FLOPs utilisation. The first
step is a warm-up (it compiles a ``train_step`` loss on first use); the second is the profile
step: it also counts the FLOPs every rank runs (``torch.utils.flop_counter``, recompute
included) and, on CPU, the activation memory
(:class:`~autopar.tools.activation_meter.ActivationMeter`: storages alive during the
forward), both fixed for a program of static shapes, so later steps run unobserved. Memory
is the state every rank holds after the step (parameters, gradients, optimizer state, measured
from the live tensors) plus that activation peak, or the allocator's peak on CUDA; the line
shows the largest rank's and the JSON every rank's (under a pipeline, the ranks of one
coordinate on the pipeline axis hold one stage each). Each figure sits beside the plan's
prediction for it, the compiled losses' included (under a pipeline: the stages' memory, and
no bytes, which the pipeline plan does not count per rank). MFU is against the plan's cluster
peak for the compute dtype: on CPU the ``cpu-gloo`` preset's, calibrated by
``bench/calibrate_cpu_gloo.py`` with one core per rank.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from autopar.runtime import collectives
from autopar.runtime.optimizer import held_bytes
from autopar.tools.activation_meter import ActivationMeter


class StepMeter:
    """Measures training steps of a compiled module; see the module docstring.

    ``tokens`` (or ``samples``) is how many one step processes, for the throughput; ``jsonl`` a
    file each step is appended to (first rank only); ``echo`` prints the line there too.
    """

    def __init__(
        self,
        module: Any,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        tokens: int | None = None,
        samples: int | None = None,
        jsonl: str | Path | None = None,
        echo: bool = True,
    ) -> None:
        self.module, self.optimizer = module, optimizer
        self.unit, self.count = ("tokens", tokens) if tokens is not None else ("samples", samples)
        self.jsonl = Path(jsonl) if jsonl is not None else None
        self.echo = echo
        self.steps = 0
        self.flops: float | None = None  # every rank's, per step (counted on the profile step)
        self.activations = 0  # this rank's activation peak (profile step, CPU)
        self.state = 0  # this rank's parameters, gradients and optimizer state at their largest
        self.records: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Measure the training step run inside (every rank must use it: it communicates)."""
        # the first step compiles what runs on first use (a train_step loss): its work and its
        # capture's tensors are not the step's, so the second step is the one profiled
        profile = self.steps == 1
        cuda = torch.cuda.is_available() and self.module.device_mesh.device_type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sent = sum(collectives.comm_counts().values())
        counter, meter = FlopCounterMode(display=False), ActivationMeter()
        held: dict[str, int] = {}
        with contextlib.ExitStack() as stack:
            if profile:
                stack.enter_context(counter)
                if not cuda:
                    stack.enter_context(meter)
                if self.optimizer is not None:  # the state is largest as the update starts: gradients too
                    hook = self.optimizer.register_step_pre_hook(lambda *_: held.update(self._held()))
                    stack.callback(hook.remove)
            start = time.perf_counter()
            yield
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        device = "cuda" if cuda else "cpu"  # where the backend reduces (NCCL: on the GPU)
        if profile:
            self.flops = _reduced(float(counter.get_total_flops()), device)
            self.activations = meter.peak if not cuda else 0
            self.state = max(held.get("total", 0), self._held()["total"])
        memory = torch.cuda.max_memory_allocated() if cuda else self.activations + self.state
        memory = memory if cuda or self.flops is not None else None  # measured from the profile step on
        moved = sum(collectives.comm_counts().values()) - sent
        record = self._record(_reduced(seconds, device, dist.ReduceOp.MAX), moved, memory, profile)
        self.records.append(record)
        self.steps += 1
        if dist.get_rank() == 0:
            self._report(record)

    def _held(self) -> dict[str, int]:
        held = held_bytes(self.module, self.optimizer)
        return {"total": held["param"] + held["grad"] + held["optimizer"]}

    def _record(self, seconds: float, moved: int, memory: int | None, profile: bool) -> dict[str, Any]:
        plan, world = self.module.plan, dist.get_world_size()
        losses = [tail.plan.prediction for tail in self.module.loss_programs]
        dtype = plan.precision["param_dtype"] if plan.precision else "float32"
        peaks = plan.cluster["peak_flops"]
        peak = peaks.get(dtype, peaks["float32"]) * world
        if plan.pipeline is not None:
            predicted, moved_plan = plan.step_time_s, None
            memory_plan = [s.memory_bytes for s in plan.pipeline.stages]
        else:  # the model's program, then the loss's
            predicted = plan.step_time_s + sum(p.step_time_s for p in losses)
            moved_plan = plan.prediction.comm_bytes + sum(p.comm_bytes for p in losses)
            memory_plan = [plan.prediction.memory_bytes + sum(p.activation_bytes for p in losses)]
        memories = _gather(memory) if memory is not None else None
        return {
            "step": self.steps,
            "profile": profile,
            "seconds": seconds,
            "predicted_seconds": predicted,
            f"{self.unit}_per_s": self.count / seconds if self.count else None,
            "mfu": self.flops / (seconds * peak) if self.flops else None,
            "predicted_mfu": self.flops / (predicted * peak) if self.flops else None,
            "peak_flops": {"dtype": dtype, "per_rank": peak / world, "cluster": plan.cluster["name"]},
            "moved_bytes": moved,
            "predicted_moved_bytes": moved_plan,
            "memory_bytes": memories,
            "predicted_memory_bytes": memory_plan,
        }

    def _report(self, r: dict[str, Any]) -> None:
        if self.jsonl is not None:
            with self.jsonl.open("a") as f:
                f.write(json.dumps(r) + "\n")
        if not self.echo:
            return
        rate = f", {r[f'{self.unit}_per_s']:,.0f} {self.unit}/s" if self.count else ""
        moved = _mib(r["moved_bytes"]) + (
            f" (plan {_mib(r['predicted_moved_bytes'])})" if r["predicted_moved_bytes"] is not None else ""
        )
        peak = r["peak_flops"]
        mfu = (
            f", MFU {r['mfu']:.1%} (plan {r['predicted_mfu']:.1%}) of {peak['per_rank'] / 1e9:,.0f} GFLOP/s "
            f"{peak['dtype']} per rank ({peak['cluster']})"
            if r["mfu"] is not None
            else ""
        )
        tag = " (warm-up)" if r["step"] == 0 else " (profile)" if r["profile"] else ""
        print(
            f"step {r['step']}{tag}: {r['seconds'] * 1e3:.1f} ms (plan {r['predicted_seconds'] * 1e3:.1f})"
            f"{rate}{mfu}, moved {moved}, memory "
            f"{_mib(max(r['memory_bytes'])) if r['memory_bytes'] else '(from the next step)'} "
            f"(plan {_mib(max(r['predicted_memory_bytes']))})",
            flush=True,
        )


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _reduced(x: float, device: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> float:
    """``x`` reduced over every rank (summed, or by ``op``)."""
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def _gather(x: int) -> list[int]:
    """Every rank's ``x``, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return [int(v) for v in out]
