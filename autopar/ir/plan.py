"""The plan: every node's layout, every redistribution, predictions and warnings.

A :class:`Plan` is plain data (strings and numbers), saved as JSON and read back
with :func:`load_plan`; nothing is pickled. Layouts are stored in the short form of
:func:`autopar.ir.layout.format_layout` (``S(0)R``) and parsed back on demand.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from autopar.ir.errors import PlanError
from autopar.ir.layout import ManualRows, parse_layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import NodeLayouts
from autopar.ir.options import Memory
from autopar.ir.report import render_summary

# 2: pipeline plans; 3: memory plans; 4: the annotations and shapes planned for; 5: the decisions
# lowering applies (Plan.lowering)
FORMAT_VERSION = 5
# formats load_plan reads: a format-4 plan has no lowering record (derived when it is lowered)
READABLE_FORMATS = (4, FORMAT_VERSION)


class ChoiceKind(StrEnum):
    """How the planner chose a node's strategy (``NodeDecision.kind``)."""

    ANCHOR = "anchor"  # a solver variable of its own (matrix products, attention, free layout points)
    FOLLOW = "follow"  # follows its largest non-parameter operand's variable
    INPUT = "input"  # a user input: a variable over every even layout
    PARAM = "param"  # a parameter or buffer: stored in any even layout
    FIXED = "fixed"  # pinned by an annotation or a layout constraint
    FALLBACK = "fallback"  # an op without a sharding rule: replicated, and listed in the plan's warnings
    GETITEM = "getitem"  # one output of a multi-output op
    OUTPUT = "output"  # the graph's output node (needs no strategy)
    ZERO3 = "zero3"  # a parameter ZeRO-3 stores split

    def __repr__(self) -> str:  # printed plans show the plain string
        return repr(self.value)

    @property
    def summarised(self) -> bool:
        """Whether :meth:`Plan.summary` lists nodes of this kind as operators: heavy ops, pinned
        ops and fallbacks decide the plan's layouts; the other kinds follow them or hold data."""
        return self in (ChoiceKind.ANCHOR, ChoiceKind.FIXED, ChoiceKind.FALLBACK)


class CollectiveKind(StrEnum):
    """The collective a :class:`CollectiveStep`, or the cost model's ``Collective``, runs on one mesh axis."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"

    def __repr__(self) -> str:  # printed plans and messages show the plain string
        return repr(self.value)


@dataclass(frozen=True)
class NodeDecision:
    """The strategy chosen for one graph node."""

    name: str
    op: str
    module: str
    kind: ChoiceKind  # a plain string naming one is converted
    operands: tuple[str | None, ...]
    outputs: tuple[str, ...]
    grads: tuple[str | None, ...]  # the layout of the gradient each operand receives
    compute_s: float
    choice: str | None = None  # the solver variable (a node name) this node's strategy follows
    args: tuple[str, ...] = ()  # the nodes whose values are its tensor operands, in order

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ChoiceKind(self.kind))

    def layouts(self) -> NodeLayouts:
        """The decision's layouts as data, as the passes write them on the node."""

        def parsed(items: tuple[str | None, ...]) -> tuple:
            return tuple(None if s is None else parse_layout(s) for s in items)

        return NodeLayouts(
            operands=parsed(self.operands), outputs=parsed(self.outputs), grads=parsed(self.grads)
        )


@dataclass(frozen=True)
class Alternative:
    """One strategy of a solver variable, priced with every other choice as planned.

    ``seconds`` is what the variable's terms of the ILP objective cost under it: the
    compute of every node sharing the variable plus the redistributions between them and
    their neighbours (whose strategies stay as planned).
    """

    operands: tuple[str | None, ...]
    outputs: tuple[str, ...]
    seconds: float
    chosen: bool


@dataclass(frozen=True)
class CollectiveStep:
    """One collective of a redistribution: ``bytes`` is its input buffer on each rank (as in the
    cost model's ``Collective``), ``seconds`` its predicted time."""

    kind: CollectiveKind  # a plain string naming one is converted
    mesh_axes: tuple[str, ...]
    bytes: int
    seconds: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CollectiveKind(self.kind))


@dataclass(frozen=True)
class Redistribution:
    """What turns ``src``'s output into the layout operand ``slot`` of ``dst`` needs."""

    src: str
    dst: str
    slot: int
    module: str
    shape: tuple[int, ...]
    have: str
    need: str
    forward: tuple[CollectiveStep, ...]
    backward: tuple[CollectiveStep, ...]
    seconds: float


@dataclass(frozen=True)
class LoweringStep:
    """One op of an edge's redistribution, on one mesh axis, as the lowering issues it."""

    axis: str  # the mesh axis's name
    # a StepKind's value (autopar.ir.redistribution_steps, which imports this module, names them)
    kind: str
    before: str  # the value's layout before the op
    after: str  # and after it
    grad: str  # the gradient's placement on ``axis`` where the op's backward receives it ("P": it sums)


@dataclass(frozen=True)
class EdgeLowering:
    """The layouts of the edge into operand ``slot`` of ``dst`` (``"output"``: the graph's output)
    from ``src``, and the ops that lower it, in forward order (``steps``).

    ``have`` is ``src``'s output layout, ``need`` the layout ``dst`` reads, ``grad_need`` the
    gradient ``dst`` hands back (with the sums the runtime's buckets do instead dropped) and
    ``grad_have`` the layout ``src``'s gradient must have. Run in reverse, the steps' backwards
    turn ``grad_need`` into ``grad_have``.
    """

    src: str
    dst: str
    slot: int
    have: str
    need: str
    grad_need: str
    grad_have: str
    steps: tuple[LoweringStep, ...]


@dataclass(frozen=True)
class Lowering:
    """Every decision the passes apply to the captured graph besides the nodes' layouts.

    ``edges``: every edge whose value or gradient changes layout (in graph order of the
    consumers, then operand slot). ``gradient_sums``: each parameter (or buffer) placeholder
    whose gradient the runtime sums in buckets after backward, with the mesh axes it sums over;
    a parameter not named is summed where its edges say, in the graph. Recompute regions,
    ``(region, policy)`` per node: ``regions`` for the ops of the plan's recompute modules (and
    the ``getitem`` of one), ``gathered`` for an op outside them that reads a ZeRO-3 weight
    gathered (``zero3:<op>``); ``held`` names the ops whose value is a view of a placeholder:
    held anyway, as placeholders are, so collectives from one into a region run again in
    backward instead of being kept.
    """

    edges: tuple[EdgeLowering, ...]
    gradient_sums: dict[str, tuple[str, ...]]
    regions: dict[str, tuple[str, str]]
    gathered: dict[str, tuple[str, str]]
    held: tuple[str, ...]


@dataclass(frozen=True)
class Prediction:
    """Per-rank predictions for one training step: forward, backward and the optimizer step.

    ``step_time_s = compute_s + comm_s + overhead_s + optimizer_s + wait_s - hidden_comm_s -
    hidden_launch_s``: the ops' roofline (recompute included), every collective, the ops' launch
    and dispatch overhead, the optimizer step (with optimizer offload's host copies), the ranks'
    waits for the slowest at synchronising collectives, less the communication that runs while
    backward computes (gradient-sum buckets) and the launch overhead and compute that overlap on
    an asynchronous device (a GPU; see :mod:`autopar.planning.cost.step_overheads`). Plans saved
    before the last five figures existed read them as 0.

    Under a pipeline the prediction is a whole step too: ``step_time_s`` is the schedule's
    (:attr:`PipelinePlan.step_time_s`), the other seconds and ``comm_bytes`` are the busiest
    pipeline rank's over the step (its stages' compute, collectives and sends for every microbatch,
    its gradient sums and optimizer step once; the bytes its collectives move, not its sends, which
    are the stages' ``p2p_bytes``), and ``wait_s`` is what the step takes beyond that
    rank's work (the bubble, the waits for other ranks), so the sum above still holds; the bytes
    are the pipeline rank's holding the most (:meth:`PipelinePlan.rank_memory_bytes`). Pipeline
    plans saved before this contract hold one microbatch of the whole model here.
    """

    step_time_s: float
    compute_s: float
    comm_s: float
    comm_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # the optimizer's fp32 states (see Memory.optimizer_states); 0 when offloaded
    activation_bytes: int  # peak on the device (see autopar.planning.memory.model)
    overhead_s: float = 0.0
    optimizer_s: float = 0.0
    wait_s: float = 0.0
    hidden_comm_s: float = 0.0
    hidden_launch_s: float = 0.0

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """How the plan holds its state and activations (see :mod:`autopar.planning.memory.model`).

    ``zero_splits`` maps each parameter ZeRO splits to ``(mesh axis, dim)``;
    ``recompute`` each recomputed module to its policy; ``chosen`` says whether the
    planner picked the ZeRO stage and recompute to fit ``budget``.
    """

    zero: int
    zero_threshold: int
    optimizer_states: int
    offload_optimizer: bool
    offload_activations: bool
    zero_splits: dict[str, tuple[str, int]]
    recompute: dict[str, str]
    budget: int | None
    chosen: bool
    activation_kept_bytes: int  # held from the end of the forward into the backward
    host_optimizer_bytes: int  # offloaded: fp32 master copies, their gradients, the optimizer state
    host_activation_bytes: int  # offloaded: what autograd saves outside recompute regions
    # FSDP-style storage the solver chose (not ZeRO's): each parameter stored split over the mesh axes
    # its uses gather it over, and the bytes per rank that saves (its state, against whole over them)
    stored_split: dict[str, tuple[str, ...]] = field(default_factory=dict)
    stored_split_bytes: int = 0

    @property
    def options(self) -> Memory:
        """The :class:`~autopar.ir.options.Memory` options this plan was made with, its ZeRO stage fixed."""
        return Memory(
            zero=self.zero,
            zero_threshold=self.zero_threshold,
            optimizer_states=self.optimizer_states,
            offload_optimizer=self.offload_optimizer,
            offload_activations=self.offload_activations,
        )


@dataclass(frozen=True)
class SolverReport:
    variables: int
    constraints: int
    roots: int
    tied_blocks: int
    capture_s: float
    build_s: float
    solve_s: float
    gap: float
    status: str


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: where it runs, what it holds, and its predicted cost.

    Seconds and collective bytes are per microbatch (forward and backward) except the
    gradient sums, once per step. ``p2p_bytes`` is what the stage receives and sends
    per microbatch (activations forward, their gradients backward).
    """

    index: int
    rank: int  # coordinate on the pipeline axis
    modules: tuple[str, ...]  # the units (blocks, top-level modules) it runs, in order
    seconds: float
    p2p_seconds: float
    grad_sum_seconds: float
    comm_bytes: int
    grad_sum_bytes: int
    p2p_bytes: int
    param_bytes: int  # its parameters and buffers
    grad_bytes: int
    optimizer_bytes: int  # Adam: two fp32 moments per parameter element
    activation_bytes: int  # one microbatch
    # microbatches whose activations the stage holds when its rank holds the most (its own count
    # may peak higher at another moment: autopar.planning.pipeline.in_flight)
    in_flight: float

    @property
    def peak_activation_bytes(self) -> int:
        return int(self.activation_bytes * self.in_flight)

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.peak_activation_bytes


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline part of a plan; :attr:`Plan.mesh` is then the mesh of one stage."""

    axis: str
    size: int  # ranks on the pipeline axis
    schedule: str
    microbatches: int
    virtual_stages: int
    automatic: bool  # stages chosen by the planner, not annotated
    stages: tuple[StagePlan, ...]
    node_stages: dict[str, int]  # graph node -> stage
    bubble_fraction: float  # ((p-1)/v) / (m + (p-1)/v)
    step_time_s: float

    def rank_stages(self, rank: int) -> tuple[StagePlan, ...]:
        """The stages pipeline coordinate ``rank`` runs (``virtual_stages`` of them)."""
        return tuple(s for s in self.stages if s.rank == rank)

    def rank_memory_bytes(self, rank: int) -> int:
        """Bytes pipeline coordinate ``rank`` holds at its peak: all its stages' state, and their
        activations at the moment the rank holds the most (each stage's ``in_flight``)."""
        return sum(s.memory_bytes for s in self.rank_stages(rank))

    @property
    def largest_rank(self) -> int:
        """The pipeline coordinate holding the most (the first of them)."""
        return max(range(self.size), key=self.rank_memory_bytes)


@dataclass
class Plan:
    """A complete parallel plan (see module docstring)."""

    mesh: dict[str, int]
    cluster: dict[str, Any]  # Cluster.to_dict(): the lowering orders collectives by its links
    nodes: list[NodeDecision]
    redistributions: list[Redistribution]
    parameters: dict[str, str]  # fqn -> layout
    inputs: dict[str, str]  # user input placeholder -> layout
    prediction: Prediction
    solver: SolverReport
    code: str  # the captured graph as Python, layouts in comments
    warnings: list[str] = field(default_factory=list)
    pipeline: PipelinePlan | None = None
    memory: MemoryPlan | None = None
    alternatives: dict[str, list[Alternative]] = field(default_factory=dict)  # variable -> its strategies
    source: list[str] | None = None  # the `autopar plan` words that name the model, when it made the plan
    named_layouts: dict[str, str] = field(default_factory=dict)  # node -> vocab-parallel/strided/uneven line
    manual_rows: dict[str, ManualRows] = field(default_factory=dict)  # fqn -> its ManualSplit
    annotations: dict[str, str] = field(default_factory=dict)  # what each annotation asked for, in words
    input_shapes: dict[str, list[int]] = field(default_factory=dict)  # tensor input -> shape planned for
    precision: dict[str, str] | None = None  # MixedPrecision.to_dict() of the plan's compute dtype
    axis_roles: dict[str, str] = field(default_factory=dict)  # mesh axis -> what it splits, in words
    parameter_nodes: dict[str, str] = field(default_factory=dict)  # placeholder -> parameter fqn
    # with a device count for a mesh: every mesh searched (mesh, bound_s, outcome, step_s, memory_bytes)
    mesh_candidates: list[dict[str, Any]] = field(default_factory=list)
    # with update=...: the mode, a unit's clock (slowest unit) and samples/s against sync's, replicas nominal
    update: dict[str, Any] | None = None
    # microbatches a step accumulates without a pipeline (its inputs and activations one microbatch's,
    # one gradient sum and optimizer step per step); 1: the whole batch at once, as plans saved before it
    accumulation: int = 1
    # what the passes apply beyond layouts; None: a format-4 plan, whose record lowering derives
    lowering: Lowering | None = None
    # the file load_plan read it from (not saved): the summary says the solver's line is the saved one
    loaded_from: str | None = field(default=None, compare=False)

    @property
    def mesh_spec(self) -> MeshSpec:
        """The mesh that layouts refer to (one stage's mesh under a pipeline)."""
        return MeshSpec.of(self.mesh)

    @property
    def device_mesh_spec(self) -> MeshSpec:
        """The whole mesh the plan runs on, pipeline axis included."""
        if self.pipeline is None:
            return self.mesh_spec
        return MeshSpec((self.pipeline.axis, *self.mesh), (self.pipeline.size, *self.mesh.values()))

    @property
    def step_time_s(self) -> float:
        """The predicted step: the pipeline schedule's under a pipeline, else the prediction's."""
        return self.pipeline.step_time_s if self.pipeline is not None else self.prediction.step_time_s

    @property
    def peak_memory_bytes(self) -> int:
        """Predicted bytes on the rank holding the most: under a pipeline, the pipeline rank's (all
        its stages, :meth:`PipelinePlan.rank_memory_bytes`)."""
        if self.pipeline is not None:
            return self.pipeline.rank_memory_bytes(self.pipeline.largest_rank)
        return self.prediction.memory_bytes

    @property
    def splits_nothing(self) -> bool:
        """Whether the mesh layouts refer to has more than one device and every node's output,
        parameter and input is whole (``R``) over all its axes: every rank computes everything."""
        layouts = [
            *(lay for n in self.nodes for lay in n.outputs),
            *self.parameters.values(),
            *self.inputs.values(),
        ]
        return self.mesh_spec.size > 1 and all(set(lay) <= {"R"} for lay in layouts)

    @property
    def parameter_casts(self) -> dict[str, str]:
        """Under mixed precision, each cast of a parameter to the compute dtype: node -> placeholder."""
        return {
            n.name: n.args[0]
            for n in self.nodes
            if n.op == "aten._to_copy.default" and n.args and n.args[0] in self.parameter_nodes
        }

    @property
    def parameter_placements(self) -> dict[str, tuple[Placement, ...]]:
        """``{parameter fqn: tuple of DTensor placements, one per mesh axis}``."""
        return {fqn: parse_layout(lay) for fqn, lay in self.parameters.items()}

    def node(self, name: str) -> NodeDecision:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in this plan")

    def summary(self, width: int = 140, verbose: bool = False) -> str:
        """A readable report, ``width`` characters wide: predictions, what each mesh axis does, the
        heavy ops' layouts, the redistributions (``verbose``: every op and redistribution, the
        internal ones and those moving nothing too; see :func:`autopar.ir.report.render_summary`)."""
        return render_summary(self, width, verbose)

    # --- JSON -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("loaded_from")
        return {"format": FORMAT_VERSION, **data}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if "format" not in data:
            kind = (
                " (a cluster file, by its fields: give it as cluster= or --cluster)"
                if "peak_flops" in data
                else ""
            )
            raise PlanError(f"this is not a plan autopar saved: it has no 'format' field{kind}")
        if data["format"] not in READABLE_FORMATS:
            raise PlanError(
                f"plan format {data['format']!r} is not supported (expected {FORMAT_VERSION}, or 4 from "
                "an earlier autopar)"
            )

        def steps(items: list) -> tuple[CollectiveStep, ...]:
            return tuple(
                CollectiveStep(
                    kind=s["kind"], mesh_axes=tuple(s["mesh_axes"]), bytes=s["bytes"], seconds=s["seconds"]
                )
                for s in items
            )

        return cls(
            mesh=dict(data["mesh"]),
            cluster=dict(data["cluster"]),
            nodes=[
                NodeDecision(
                    name=n["name"],
                    op=n["op"],
                    module=n["module"],
                    kind=n["kind"],
                    operands=tuple(n["operands"]),
                    outputs=tuple(n["outputs"]),
                    grads=tuple(n["grads"]),
                    compute_s=n["compute_s"],
                    choice=n.get("choice"),
                    args=tuple(n.get("args", ())),
                )
                for n in data["nodes"]
            ],
            redistributions=[
                Redistribution(
                    src=r["src"],
                    dst=r["dst"],
                    slot=r["slot"],
                    module=r["module"],
                    shape=tuple(r["shape"]),
                    have=r["have"],
                    need=r["need"],
                    forward=steps(r["forward"]),
                    backward=steps(r["backward"]),
                    seconds=r["seconds"],
                )
                for r in data["redistributions"]
            ],
            parameters=dict(data["parameters"]),
            inputs=dict(data["inputs"]),
            prediction=Prediction(**data["prediction"]),
            solver=SolverReport(**data["solver"]),
            code=data["code"],
            warnings=list(data["warnings"]),
            pipeline=_pipeline_from_dict(data["pipeline"]) if data.get("pipeline") else None,
            memory=_memory_from_dict(data["memory"]) if data.get("memory") else None,
            source=data.get("source"),
            named_layouts=dict(data.get("named_layouts", {})),
            manual_rows={fqn: ManualRows(d, tuple(r)) for fqn, (d, r) in data.get("manual_rows", {}).items()},
            annotations=dict(data["annotations"]),
            input_shapes={name: list(shape) for name, shape in data["input_shapes"].items()},
            precision=data.get("precision"),
            axis_roles=dict(data.get("axis_roles", {})),
            parameter_nodes=dict(data.get("parameter_nodes", {})),
            mesh_candidates=[dict(c) for c in data.get("mesh_candidates", [])],
            update=data.get("update"),
            accumulation=int(data.get("accumulation", 1)),
            lowering=_lowering_from_dict(data["lowering"]) if data.get("lowering") is not None else None,
            alternatives={
                root: [
                    Alternative(**{**a, "operands": tuple(a["operands"]), "outputs": tuple(a["outputs"])})
                    for a in alts
                ]
                for root, alts in data.get("alternatives", {}).items()
            },
        )


def _memory_from_dict(data: dict[str, Any]) -> MemoryPlan:
    return MemoryPlan(
        **{
            **data,
            "zero_splits": {k: (v[0], int(v[1])) for k, v in data["zero_splits"].items()},
            "recompute": dict(data["recompute"]),
            "stored_split": {k: tuple(v) for k, v in data.get("stored_split", {}).items()},
        }
    )


def _lowering_from_dict(data: dict[str, Any]) -> Lowering:
    def region(item: list) -> tuple[str, str]:
        name, policy = item
        return name, policy

    return Lowering(
        edges=tuple(
            EdgeLowering(
                **{**e, "steps": tuple(LoweringStep(**s) for s in e["steps"])},
            )
            for e in data["edges"]
        ),
        gradient_sums={p: tuple(axes) for p, axes in data["gradient_sums"].items()},
        regions={n: region(r) for n, r in data["regions"].items()},
        gathered={n: region(r) for n, r in data["gathered"].items()},
        held=tuple(data["held"]),
    )


def _pipeline_from_dict(data: dict[str, Any]) -> PipelinePlan:
    return PipelinePlan(
        **{
            **data,
            "stages": tuple(StagePlan(**{**s, "modules": tuple(s["modules"])}) for s in data["stages"]),
            "node_stages": dict(data["node_stages"]),
        }
    )


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by :meth:`Plan.save` (format 5, or 4: the lowering record is then made
    when the plan is compiled).

    Args:
        path: the plan's JSON file.

    Raises:
        PlanError: the file cannot be read, is not a plan, or is a plan of another format.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read plan {path}: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path} is not an autopar plan: it holds a {type(data).__name__}, not a saved Plan")
    try:
        plan = Plan.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PlanError(f"{path} is not an autopar plan: missing or malformed field {exc}") from None
    plan.loaded_from = str(path)
    return plan
