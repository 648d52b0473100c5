"""What the runtime runs: a program lowered for one rank and the facts about it the compiler knows.

The compiler (:func:`autopar.compiler.build_module`) builds a :class:`LoweredProgram` from
what the passes recorded; the runtime reads nothing else of the compiler, so running a
program never needs the passes or the planner.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.export.graph_signature import InputKind

from autopar.ir.plan import Plan
from autopar.runtime.pipeline_runtime import StageProgram


@dataclass(frozen=True, kw_only=True)
class LoweredProgram:
    """A model lowered for one rank under ``plan``, for :class:`~autopar.runtime.module.DistributedModule`.

    ``program`` takes the flat inputs ``exported``'s graph signature names (parameters,
    buffers, constants, then user inputs), local pieces each, and returns its outputs;
    every collective is inside it. Under a pipeline ``stages`` splits it, one program
    per stage; otherwise ``stages`` is None.
    """

    program: torch.fx.GraphModule
    plan: Plan
    exported: torch.export.ExportedProgram  # the captured program: signature, constants, pytree specs
    aliases: Mapping[str, list[str]]  # parameter or buffer name -> every name it has in the model
    axis_keys: Mapping[str, str]  # mesh axis -> the name the collectives know it by
    grad_reductions: Mapping[str, tuple[str, ...]]  # parameter placeholder -> axis keys its grad sums over
    stages: tuple[StageProgram, ...] | None
    snapshots: Mapping[str, str]  # pass name -> the graph printed after it
    number_outputs: tuple[int, ...] = ()  # user output leaves the model returns as Python numbers

    def state_names(self, placeholders: Iterable[str]) -> set[str]:
        """Every name in the model (tied weights have several) of the parameters and buffers
        that ``placeholders`` of the program stand for."""
        wanted = set(placeholders)
        return {
            alias
            for s in self.exported.graph_signature.input_specs
            if s.arg.name in wanted and s.kind in (InputKind.PARAMETER, InputKind.BUFFER)
            for alias in self.aliases.get(s.target, [s.target])
        }
