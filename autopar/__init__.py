"""autopar: a declarative auto-parallel compiler for PyTorch.

Annotate a few modules in MindSpore's style (or none), then plan::

    plan = autopar.plan(model, example_args, {"dp": 2, "tp": 4})
    print(plan.summary())
"""

from autopar.annotations import constrain, pipeline_stage, recompute, shard
from autopar.cost import Cluster, LinkSpec, get_cluster
from autopar.errors import AnnotationError, AutoparError, CaptureError, PlanError
from autopar.mesh import MeshSpec
from autopar.planner import plan
from autopar.plans import Plan, load_plan

__all__ = [
    "AnnotationError",
    "AutoparError",
    "CaptureError",
    "Cluster",
    "LinkSpec",
    "MeshSpec",
    "Plan",
    "PlanError",
    "constrain",
    "get_cluster",
    "load_plan",
    "pipeline_stage",
    "plan",
    "recompute",
    "shard",
]
