"""Running this rank's pipeline stages with ``torch.distributed.pipelining``.

Each :class:`StageProgram` (made by the ``split_stages`` pass) becomes a ``PipelineStage`` on the
pipeline axis's process group, its inputs and outputs declared up front from the
plan (static metadata: nothing is inferred at run time). The schedule is torch's:
``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``, with stage ``s`` on
pipeline coordinate ``s % p``. Collectives inside a stage run over the stage mesh
(dp, tp, ...), whose ranks share one pipeline coordinate and so run the same
schedule in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from autopar.ir.options import Pipeline
from autopar.ir.printing import format_graph
from autopar.runtime.program_errors import naming_the_source


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """A tensor crossing into or out of a stage, as one rank holds it."""

    name: str
    shape: tuple[int, ...]  # local
    dtype: torch.dtype
    requires_grad: bool


@dataclass(kw_only=True)
class StageProgram:
    """One pipeline stage's program: ``forward(*received, *state) -> tuple(sent)``.

    ``received`` are the user inputs for stage 0, else what the previous stage sends;
    ``sent`` what later stages read (the model's user outputs for the last stage); only
    tensors cross stages. ``state`` names the placeholders of the whole per-rank program
    (parameters, buffers, constants) the stage reads, in the order they are passed. A constant
    buffer may be in several stages' state: every rank running one of them holds a copy, and a
    rank running two passes both the one tensor it holds (nothing writes it).
    """

    index: int
    program: torch.fx.GraphModule
    received: list[Boundary]
    sent: list[Boundary]
    state: list[str]

    @property
    def code(self) -> str:
        """The stage's program as Python."""
        return format_graph(self.program.graph, f"Constructed by split_stages: stage {self.index}")


class _StageModule(torch.nn.Module):
    """One stage's program with this rank's parameters, buffers and constants bound."""

    def __init__(self, program: torch.fx.GraphModule, state: list[Any]) -> None:
        super().__init__()
        self.program = program
        self.state = state  # plain local leaves, shared with the DTensor parameters

    def forward(self, *received: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with naming_the_source():
            return tuple(self.program(*received, *self.state))


def device_of(device_type: str) -> torch.device:
    """The device this rank computes on for a mesh of ``device_type`` (what its stages run on)."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _examples(boundaries: Sequence[Boundary], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.empty(b.shape, dtype=b.dtype, device=device, requires_grad=b.requires_grad) for b in boundaries
    )


class PipelineRuntime:
    """This rank's stages and the schedules that run them (one per loss function)."""

    def __init__(
        self,
        stages: Sequence[StageProgram],
        n_stages: int,
        pipeline: Pipeline,
        group: dist.ProcessGroup,
        states: Sequence[list[Any]],
        device: torch.device,
    ) -> None:
        self.pipeline = pipeline
        self.group = group
        self.programs = list(stages)
        self.stages = [
            PipelineStage(
                _StageModule(st.program, state),
                st.index,
                n_stages,
                device,
                input_args=_examples(st.received, device),
                output_args=_examples(st.sent, device),
                group=group,
            )
            for st, state in zip(stages, states)
        ]
        self.first = any(st.is_first for st in self.stages)
        self.last = any(st.is_last for st in self.stages)
        self.last_rank = (n_stages - 1) % dist.get_world_size(group)
        self._schedules: dict[Any, Any] = {}

    def _schedule(self, key: Any, loss: Callable) -> Any:
        schedule = self._schedules.get(key)
        if schedule is None:
            m = self.pipeline.microbatches
            # loss() already weighs each microbatch by 1/m: no rescaling of gradients by torch
            if self.pipeline.schedule == "interleaved-1f1b":
                schedule = ScheduleInterleaved1F1B(self.stages, m, loss_fn=loss, scale_grads=False)
            else:
                single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.pipeline.schedule]
                schedule = single(self.stages[0], m, loss_fn=loss, scale_grads=False)
            self._schedules[key] = schedule
        return schedule

    def step(
        self, inputs: Sequence[torch.Tensor], target: torch.Tensor, loss: Callable, key: Any
    ) -> torch.Tensor:
        """One step over all microbatches; the summed loss, on every rank of the pipeline.

        ``inputs`` are this rank's pieces of the microbatches, concatenated along dim 0
        (only the first stage reads them), ``target`` likewise (only the last stage);
        ``key`` identifies ``loss`` for the schedule cache.
        """
        schedule = self._schedule(key, loss)
        losses: list[torch.Tensor] = []
        schedule.step(
            *(inputs if self.first else ()),
            target=target if self.last else None,
            losses=losses if self.last else None,
            return_outputs=False,
        )
        total = torch.stack(losses).sum().detach() if self.last else torch.zeros((), dtype=torch.float32)
        dist.broadcast(total, group=self.group, group_src=self.last_rank)
        return total
