"""autopar: a declarative auto-parallel compiler for PyTorch.

Annotate a few modules in MindSpore's style (or none), then plan::

    plan = autopar.plan(model, example_args, {"dp": 2, "tp": 4})
    print(plan.summary())

or, on every rank of a job with a named ``DeviceMesh``, compile and train::

    dmodel = autopar.compile(model, mesh, example_args)
    loss = dmodel(*dmodel.shard_inputs(*batch)[0])
"""

from autopar.capture.annotations import pipeline_stage, recompute, shard
from autopar.capture.hooks import constrain
from autopar.capture.strategies import ManualSplit, Parts
from autopar.compiler import compile
from autopar.ir.errors import (
    AnnotationError,
    AutoparError,
    CaptureError,
    CheckpointError,
    CollectiveMismatchError,
    CompileError,
    IndexRangeError,
    InitializationError,
    MemoryFitError,
    OptionError,
    PlanError,
    ShapeError,
)
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import Memory, MixedPrecision, Pipeline
from autopar.ir.plan import Plan, load_plan
from autopar.ir.updates import Async, Hybrid, ParameterServer
from autopar.planning.cost.model import Cluster, LinkSpec, get_cluster
from autopar.planning.entry_points import plan
from autopar.runtime.async_updates import rejoin_mesh, worker_mesh
from autopar.runtime.checkpoint_files import latest_checkpoint
from autopar.runtime.loss_scaler import LossScaler
from autopar.runtime.training_state import load_checkpoint, save_checkpoint

__all__ = [
    "AnnotationError",
    "Async",
    "Hybrid",
    "ParameterServer",
    "rejoin_mesh",
    "worker_mesh",
    "AutoparError",
    "CaptureError",
    "CheckpointError",
    "Cluster",
    "CollectiveMismatchError",
    "CompileError",
    "IndexRangeError",
    "InitializationError",
    "OptionError",
    "LinkSpec",
    "LossScaler",
    "MemoryFitError",
    "Memory",
    "ManualSplit",
    "MixedPrecision",
    "Parts",
    "MeshSpec",
    "Plan",
    "Pipeline",
    "PlanError",
    "ShapeError",
    "compile",
    "constrain",
    "get_cluster",
    "latest_checkpoint",
    "load_checkpoint",
    "load_plan",
    "pipeline_stage",
    "plan",
    "recompute",
    "save_checkpoint",
    "shard",
]
