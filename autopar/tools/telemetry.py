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
coordinate on the pipeline axis hold the same stages). Each figure sits beside the plan's
prediction for it, the compiled losses' included (under a pipeline: each pipeline rank's memory,
all its stages, and no bytes). MFU is against the plan's cluster
peak for the compute dtype: on CPU the ``cpu-gloo`` preset's, calibrated by
``bench/calibrate_cpu_gloo.py`` with one core per rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from autopar.ir.arguments import check_bool, check_instance, check_int, check_number, plain_number
from autopar.ir.errors import CollectiveMismatchError, OptionError
from autopar.runtime import collectives
from autopar.runtime.checkpoint_files import path_problem
from autopar.runtime.module import DistributedModule
from autopar.runtime.optimizer import held_bytes
from autopar.runtime.ranks import gathered
from autopar.tools.activation_meter import ActivationMeter


class StepMeter:
    """Measures training steps of a compiled module; see the module docstring.

    Every rank constructs it and enters :meth:`step` at every step: it communicates. A rank that
    waits longer than ``timeout_s`` for the others to enter a step (or to construct the meter)
    raises :class:`~autopar.ir.errors.CollectiveMismatchError` instead of waiting for the process
    group's timeout (30 minutes by default): the ranks meet on a gloo group of their own whose
    collectives time out after ``timeout_s`` (none under torch's fake backend, where one process
    plays one rank). Raise it where ranks do unequal work between steps (rank 0 alone evaluating).
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
        timeout_s: float = 60.0,
    ) -> None:
        """Checks every argument before any step, on every rank alike.

        Args:
            module: the module ``autopar.compile`` returned (a ``DistributedModule``).
            optimizer: its optimizer (``module.optimizer(...)``), or None: the state is then the
                parameters and gradients alone.
            tokens: how many tokens one step processes (an int >= 1, a numpy integer too), for the
                throughput.
            samples: how many samples one step processes instead (not both).
            jsonl: a file each step is appended to as one JSON line (first rank only): its folder
                must exist and be writable (it is opened for appending here).
            echo: print each step's line (first rank only).
            timeout_s: seconds a rank waits for the others in :meth:`step` (and here) before it
                raises :class:`~autopar.ir.errors.CollectiveMismatchError`; a number above 0.
        """
        tokens, samples, timeout_s = (plain_number(v) for v in (tokens, samples, timeout_s))
        _check_arguments(module, optimizer, tokens, samples, jsonl, echo, timeout_s)
        if not dist.is_initialized():
            raise OptionError(
                "StepMeter measures a compiled module on every rank of its process group, but there is "
                "none: call torch.distributed.init_process_group(...) before compiling and measuring"
            )
        self.module, self.optimizer = module, optimizer
        self.unit, self.count = ("tokens", tokens) if tokens is not None else ("samples", samples)
        self.jsonl = Path(jsonl) if jsonl is not None else None
        self.echo = echo
        self.timeout_s = timeout_s
        self._group = self._meeting_group()
        self._failed: str | None = None  # why a meeting failed (its group is closed for good then)
        self._agree(_unwritable(self.jsonl) if dist.get_rank() == 0 else None)
        self.steps = 0
        self.flops: float | None = None  # every rank's, per step (counted on the profile step)
        self.activations = 0  # this rank's activation peak (profile step, CPU)
        self.state = 0  # this rank's parameters, gradients and optimizer state at their largest
        self.records: list[dict[str, Any]] = []
        self._inside = False  # within a step()

    def _meeting_group(self) -> Any:
        """The gloo group the ranks meet on, with the meter's timeout; None under the fake backend."""
        if dist.get_backend() == "fake":
            return None
        try:
            return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise CollectiveMismatchError(
                f"StepMeter(): not every rank constructed the meter within {self.timeout_s:g} s; every rank "
                "must construct it (and then enter step() at every step)"
            ) from e

    def _agree(self, problem: str | None) -> None:
        """Raise ``problem`` (found by the first rank) as an OptionError on every rank."""
        if self._group is not None:
            verdict = [problem]
            dist.broadcast_object_list(verdict, src=0, group=self._group)
            problem = verdict[0]
        if problem is not None:
            raise OptionError(problem)

    def _meet(self) -> None:
        """Wait up to ``timeout_s`` for every rank to enter this step; raise naming the ranks missing."""
        if self._failed is not None:
            raise CollectiveMismatchError(
                f"StepMeter.step() cannot meet the other ranks after an earlier failure ({self._failed}); "
                "construct a new meter on every rank"
            )
        if self._group is None:
            return
        try:
            dist.monitored_barrier(
                self._group, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True
            )
        except RuntimeError as e:
            # the first rank watches the others and names the ranks missing; another rank knows only
            # that the first rank did not answer
            missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
            ranks = missing.group(1).strip() if missing else ""
            who = (
                f"rank{'s' if ',' in ranks else ''} {ranks} did not enter"
                if ranks
                else "not every rank entered"
            )
            self._failed = (
                f"StepMeter.step(): {who} step {self.steps} within {self.timeout_s:g} s; every rank must "
                "call step() at every step"
            )
            raise CollectiveMismatchError(self._failed) from e

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Measure the training step run inside (every rank must use it: it communicates). Steps do not
        nest: a step() entered inside another of the same meter is an
        :class:`~autopar.ir.errors.OptionError`."""
        if self._inside:
            raise OptionError(
                f"StepMeter.step() was entered inside step {self.steps} of the same meter: steps do not "
                "nest; wrap each training step in one `with meter.step():`"
            )
        self._inside = True
        try:
            yield from self._measured()
        finally:
            self._inside = False

    def _measured(self) -> Iterator[None]:
        """The body of :meth:`step`: meet the other ranks, measure what runs at the yield, report."""
        self._meet()
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
            memory_plan = [plan.pipeline.rank_memory_bytes(r) for r in range(plan.pipeline.size)]
        else:  # the model's program, then the loss's
            predicted = plan.step_time_s + sum(p.step_time_s for p in losses)
            moved_plan = plan.prediction.comm_bytes + sum(p.comm_bytes for p in losses)
            memory_plan = [plan.prediction.memory_bytes + sum(p.activation_bytes for p in losses)]
        memories = gathered(memory) if memory is not None else None
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


def _check_arguments(
    module: Any, optimizer: Any, tokens: Any, samples: Any, jsonl: Any, echo: Any, timeout_s: Any
) -> None:
    """StepMeter's arguments, as its ``__init__`` documents them (the file's folder apart)."""
    if not isinstance(module, DistributedModule):
        swapped = "; the module comes first: StepMeter(dmodel, optimizer)"
        raise OptionError(
            f"StepMeter(module) measures the module autopar.compile returned (a DistributedModule), got "
            f"{type(module).__name__}{swapped if isinstance(module, torch.optim.Optimizer) else ''}"
        )
    if optimizer is not None:
        what = "the module's optimizer (dmodel.optimizer(...)) or None"
        check_instance(optimizer, torch.optim.Optimizer, "StepMeter(optimizer)", what)
    if tokens is not None and samples is not None:
        raise OptionError(
            f"StepMeter counts tokens or samples, not both: got tokens={tokens!r}, samples={samples!r}"
        )
    for name, count in (("tokens", tokens), ("samples", samples)):
        if count is not None:
            check_int(count, f"StepMeter({name}=...) ({name} per step)", minimum=1)
    if jsonl is not None:
        check_instance(jsonl, (str, os.PathLike), "StepMeter(jsonl=...)", "a path (a str or a Path) or None")
        text = os.fspath(jsonl)
        problem = path_problem(text) if isinstance(text, str) and text else "names no file"
        if problem:
            raise OptionError(f"StepMeter(jsonl={jsonl!r}) {problem}")
    check_bool(echo, "StepMeter(echo=...)")
    check_number(timeout_s, "StepMeter(timeout_s=...)", unit="seconds", below=timedelta.max.total_seconds())


def _unwritable(path: Path | None) -> str | None:
    """Why ``path`` cannot be appended to (None if it can): it is opened for appending, which
    creates it empty where it does not exist."""
    if path is None:
        return None
    try:
        with path.open("a"):
            return None
    except OSError as e:
        folder = "" if path.parent.is_dir() else f": there is no folder {path.parent}"
        return f"StepMeter(jsonl={str(path)!r}) cannot be appended to ({e.strerror}){folder}"
