"""The plan: every node's layout, every redistribution, predictions and warnings.

A :class:`Plan` is plain data (strings and numbers), saved as JSON and read back
with :func:`load_plan`; nothing is pickled. Layouts are stored in the short form of
:func:`autopar.ir.layout.format_layout` (``S(0)R``) and parsed back on demand.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from autopar.ir.errors import PlanError
from autopar.ir.layout import parse_layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import Memory

FORMAT_VERSION = 3  # 2: pipeline plans; 3: memory plans

# The destination named by a redistribution that is a parameter's gradient sum (no consumer node).
GRADIENT_SUM = "<gradient sum>"


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


@dataclass(frozen=True)
class NodeDecision:
    """The strategy chosen for one graph node."""

    name: str
    op: str
    module: str
    kind: ChoiceKind
    operands: tuple[str | None, ...]
    outputs: tuple[str, ...]
    grads: tuple[str | None, ...]  # the layout of the gradient each operand receives
    compute_s: float
    choice: str | None = None  # the solver variable (a node name) this node's strategy follows
    args: tuple[str, ...] = ()  # the nodes whose values are its tensor operands, in order


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
    kind: str
    mesh_axes: tuple[str, ...]
    bytes: int
    seconds: float


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
class Prediction:
    """Per-rank predictions for one training step (forward + backward)."""

    step_time_s: float
    compute_s: float
    comm_s: float
    comm_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # the optimizer's fp32 states (see Memory.optimizer_states); 0 when offloaded
    activation_bytes: int  # peak on the device (see autopar.planning.memory)

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """How the plan holds its state and activations (see :mod:`autopar.planning.memory`).

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

    @property
    def options(self) -> Memory:
        """The :class:`~autopar.ir.options.Memory` options this plan was made with, its ZeRO stage fixed."""
        return Memory(
            self.zero,
            self.zero_threshold,
            self.optimizer_states,
            self.offload_optimizer,
            self.offload_activations,
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
    in_flight: float  # microbatches whose activations the stage holds at once, at most

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
    def parameter_placements(self) -> dict[str, tuple[Placement, ...]]:
        """``{parameter fqn: tuple of DTensor placements, one per mesh axis}``."""
        return {fqn: parse_layout(lay) for fqn, lay in self.parameters.items()}

    def node(self, name: str) -> NodeDecision:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in this plan")

    # --- report ---------------------------------------------------------------------
    def summary(self, width: int = 140) -> str:
        """A readable report: predictions, the heavy ops' layouts, every redistribution."""
        from rich.console import Console
        from rich.table import Table

        buf = io.StringIO()
        console = Console(file=buf, width=width, record=False, color_system=None)
        p = self.prediction
        console.print(
            f"autopar plan on mesh {self.mesh_spec} ({self.cluster['name']}): "
            f"predicted step {p.step_time_s * 1e3:.3f} ms "
            f"(compute {p.compute_s * 1e3:.3f} ms, communication {p.comm_s * 1e3:.3f} ms, "
            f"{_bytes(p.comm_bytes)} moved per rank)"
        )
        console.print(
            f"memory per rank: parameters {_bytes(p.param_bytes)}, gradients {_bytes(p.grad_bytes)}, "
            f"optimizer {_bytes(p.optimizer_bytes)}, activations {_bytes(p.activation_bytes)}, "
            f"total {_bytes(p.memory_bytes)}"
        )
        if self.memory is not None:
            _print_memory(console, self.memory)
        ops = Table(title="operators", show_lines=False)
        for col in ("module", "op", "operands", "output", "compute"):
            ops.add_column(col)
        for n in self.nodes:
            if n.kind in ("anchor", "fixed", "fallback"):
                operands = ", ".join(o or "-" for o in n.operands)
                ops.add_row(
                    n.module or "<root>", _short(n.op), operands, ", ".join(n.outputs), _secs(n.compute_s)
                )
        console.print(ops)
        comm = Table(title="redistributions")
        for col in ("module", "tensor", "layouts", "forward", "backward", "bytes", "time"):
            comm.add_column(col)
        for r in self.redistributions:
            steps = [*r.forward, *r.backward]
            comm.add_row(
                r.module or "<root>",
                f"{r.src}->{r.dst}",
                f"{r.have}->{r.need}",
                _steps(r.forward),
                _steps(r.backward),
                _bytes(sum(s.bytes for s in steps)),
                _secs(r.seconds),
            )
        console.print(comm)
        params = Table(title="parameters")
        params.add_column("parameter")
        params.add_column("layout")
        for fqn, lay in self.parameters.items():
            params.add_row(fqn, lay)
        console.print(params)
        s = self.solver
        console.print(
            f"solver: {s.roots} choices ({s.tied_blocks} repeated blocks tied), {s.variables} variables, "
            f"{s.constraints} constraints; capture {s.capture_s:.2f} s, build {s.build_s:.2f} s, "
            f"solve {s.solve_s:.2f} s, gap {s.gap:.2%} ({s.status})"
        )
        if self.pipeline is not None:
            _print_pipeline(console, self.pipeline)
        for w in self.warnings:
            console.print(f"warning: {w}")
        return buf.getvalue()

    # --- JSON -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if data.get("format") != FORMAT_VERSION:
            raise PlanError(
                f"plan format {data.get('format')!r} is not supported (expected {FORMAT_VERSION})"
            )

        def steps(items: list) -> tuple[CollectiveStep, ...]:
            return tuple(
                CollectiveStep(s["kind"], tuple(s["mesh_axes"]), s["bytes"], s["seconds"]) for s in items
            )

        return cls(
            mesh=dict(data["mesh"]),
            cluster=dict(data["cluster"]),
            nodes=[
                NodeDecision(
                    n["name"],
                    n["op"],
                    n["module"],
                    n["kind"],
                    tuple(n["operands"]),
                    tuple(n["outputs"]),
                    tuple(n["grads"]),
                    n["compute_s"],
                    n.get("choice"),
                    tuple(n.get("args", ())),
                )
                for n in data["nodes"]
            ],
            redistributions=[
                Redistribution(
                    r["src"],
                    r["dst"],
                    r["slot"],
                    r["module"],
                    tuple(r["shape"]),
                    r["have"],
                    r["need"],
                    steps(r["forward"]),
                    steps(r["backward"]),
                    r["seconds"],
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
        }
    )


def _pipeline_from_dict(data: dict[str, Any]) -> PipelinePlan:
    return PipelinePlan(
        **{
            **data,
            "stages": tuple(StagePlan(**{**s, "modules": tuple(s["modules"])}) for s in data["stages"]),
            "node_stages": dict(data["node_stages"]),
        }
    )


def _print_pipeline(console: Any, pp: PipelinePlan) -> None:
    from rich.table import Table

    how = "chosen by the planner" if pp.automatic else "annotated"
    console.print(
        f"pipeline over {pp.axis}={pp.size}: {len(pp.stages)} stages ({how}), schedule {pp.schedule}, "
        f"{pp.microbatches} microbatches; predicted step {pp.step_time_s * 1e3:.3f} ms, "
        f"bubble {pp.bubble_fraction:.1%}"
    )
    table = Table(title="pipeline stages (seconds and bytes per microbatch; gradient sums per step)")
    for col in ("stage", "rank", "modules", "time", "p2p", "grad sums", "parameters", "activations", "peak"):
        table.add_column(col)
    for s in pp.stages:
        shown = ", ".join(s.modules) if len(s.modules) <= 3 else f"{s.modules[0]} … {s.modules[-1]}"
        table.add_row(
            str(s.index),
            str(s.rank),
            shown,
            _secs(s.seconds),
            _secs(s.p2p_seconds),
            _secs(s.grad_sum_seconds),
            _bytes(s.param_bytes),
            _bytes(s.activation_bytes),
            f"{_bytes(s.peak_activation_bytes)} (×{s.in_flight:g})",
        )
    console.print(table)


def _print_memory(console: Any, m: MemoryPlan) -> None:
    how = f"chosen to fit {_bytes(m.budget)}" if m.chosen else "as asked"
    budget = f", budget {_bytes(m.budget)}" if m.budget is not None and not m.chosen else ""
    recompute = ", ".join(f"{path} ({policy})" for path, policy in m.recompute.items()) or "none"
    offloaded = (("optimizer", m.offload_optimizer), ("activations", m.offload_activations))
    offload = [what for what, on in offloaded if on]
    console.print(
        f"memory plan ({how}{budget}): ZeRO-{m.zero} ({len(m.zero_splits)} parameters split), "
        f"recompute: {recompute}; offload: {', '.join(offload) or 'none'} "
        f"(host {_bytes(m.host_optimizer_bytes + m.host_activation_bytes)}); "
        f"activations kept {_bytes(m.activation_kept_bytes)}"
    )


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by :meth:`Plan.save`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read plan {path}: {exc}") from None
    try:
        return Plan.from_dict(data)
    except (KeyError, TypeError) as exc:
        raise PlanError(f"{path} is not an autopar plan: missing or malformed field {exc}") from None


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _secs(s: float) -> str:
    return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def _short(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def _steps(steps: tuple[CollectiveStep, ...]) -> str:
    return " + ".join(f"{s.kind}({','.join(s.mesh_axes)})" for s in steps) or "-"
