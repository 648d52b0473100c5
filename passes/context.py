"""The context every pass of :data:`autopar.passes.PASS_ORDER` receives: ``run(gm, ctx) -> gm``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autopar.capture.export import Captured
from autopar.ir.errors import PlanError
from autopar.ir.mesh import MeshSpec
from autopar.ir.plan import Lowering, Plan
from autopar.runtime.pipeline_runtime import StageProgram


@dataclass(kw_only=True)
class PassContext:
    """What every pass may read; passes record results here as documented in their docstrings.

    Built by :func:`autopar.compiler.lower`, which hands what the runtime needs on to it
    (:class:`~autopar.runtime.lowered.LoweredProgram`). The passes apply what the plan decided,
    its node decisions and its lowering record (:attr:`lowering`); none of them plans.
    """

    mesh: MeshSpec  # the mesh layouts refer to: one stage's under a pipeline
    device: torch.device  # the device this rank computes on
    plan: Plan  # with its lowering record (the compiler records one on a plan saved without)
    captured: Captured
    axis_keys: dict[str, str] = field(default_factory=dict)  # mesh axis -> the collectives' name for it
    # this rank's coordinate on each mesh axis: the pieces of dims split unevenly differ per rank
    # (None: the largest piece, as the planner prices)
    coordinates: tuple[int, ...] | None = None
    # lookups into a split dim check their ids' range first (localize_lookups, autopar.check_ids)
    check_ids: bool = True
    grad_reductions: dict[str, tuple[str, ...]] = field(default_factory=dict)  # param placeholder -> axes
    snapshots: dict[str, str] = field(default_factory=dict)  # pass name -> graph printed after it
    stages: list[StageProgram] | None = None  # under a pipeline: one per stage (split_stages)

    @property
    def lowering(self) -> Lowering:
        """The plan's record of what the passes apply beyond the nodes' layouts."""
        if self.plan.lowering is None:
            raise PlanError(
                "the plan has no lowering record (plan format 4): autopar.compiler.lower records one "
                "before it runs the passes"
            )
        return self.plan.lowering
