"""``autopar.compile``: from a model, a mesh and a plan to a module that trains on the mesh.

Called on every rank (under ``torchrun`` or spawned processes) with a real, named
``DeviceMesh``. The model is captured once; without a plan it is planned (the same
plan on every rank: the solver is deterministic); then the passes in
``autopar.passes.PIPELINE`` turn the captured graph into the per-rank program, and
:class:`~autopar.runtime.DistributedModule` runs it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar import collectives
from autopar.capture import Captured, capture
from autopar.cost import Cluster, CostModel
from autopar.errors import CompileError
from autopar.mesh import MeshSpec
from autopar.planner import plan_captured
from autopar.plans import Plan
from autopar.printing import format_graph


@dataclass
class PassContext:
    """What every pass may read; passes record results here as documented in their docstrings."""

    mesh: MeshSpec
    plan: Plan
    cost: CostModel
    captured: Captured
    axis_keys: dict[str, str] = field(default_factory=dict)  # mesh axis -> the collectives' name for it
    grad_reductions: dict[str, tuple[str, ...]] = field(default_factory=dict)  # param placeholder -> axes
    snapshots: dict[str, str] = field(default_factory=dict)  # pass name -> graph printed after it


def compile(  # noqa: A001 - the public name mirrors torch.compile
    model: torch.nn.Module,
    mesh: Any,
    example_args: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    plan: Plan | None = None,
    cluster: str | Cluster | None = None,
    time_limit: float = 30.0,
    seed: int = 0,
) -> torch.nn.Module:
    """Compile ``model`` for ``mesh`` (a ``DeviceMesh`` with axis names); see the module docstring.

    ``example_args``/``example_kwargs`` are *global* example inputs (the whole batch).
    Returns a :class:`~autopar.runtime.DistributedModule` whose parameters are
    DTensors under the original names, each rank holding its piece of the model's
    weights; a model built on ``meta`` is initialised by
    :func:`~autopar.runtime.materialize` (``reset_parameters()`` under ``seed``).
    """
    from autopar.passes import PIPELINE
    from autopar.runtime import DistributedModule, materialize

    if not hasattr(mesh, "get_group"):
        raise CompileError(
            "autopar.compile needs a DeviceMesh with axis names (init_device_mesh(..., mesh_dim_names=...)); "
            "to plan without ranks use autopar.plan"
        )
    spec = MeshSpec.of(mesh)
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    model = materialize(model, seed)
    t0 = time.perf_counter()
    captured = capture(model, args, example_kwargs, spec)
    if plan is None:
        plan = plan_captured(
            captured,
            spec,
            cluster=cluster,
            time_limit=time_limit,
            seed=seed,
            capture_s=time.perf_counter() - t0,
        )
    ctx = PassContext(
        spec,
        plan,
        CostModel(spec, Cluster.from_dict(plan.cluster)),
        captured,
        axis_keys=collectives.register_mesh(mesh),
    )
    gm = captured.program.graph_module
    for p in PIPELINE:
        gm = p.run(gm, ctx)
        name = p.__name__.rsplit(".", 1)[-1]
        ctx.snapshots[name] = format_graph(gm.graph, f"after pass {name}")
    gm.graph.lint()
    gm.recompile()
    return DistributedModule(model, mesh, ctx, gm)
