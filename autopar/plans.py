"""The plan: every node's layout, every redistribution, predictions and warnings.

A :class:`Plan` is plain data (strings and numbers), saved as JSON and read back
with :func:`load_plan`; nothing is pickled. Layouts are stored in the short form of
:func:`autopar.layout.format_layout` (``S(0)R``) and parsed back on demand.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from autopar.errors import PlanError
from autopar.layout import parse_layout
from autopar.mesh import MeshSpec

FORMAT_VERSION = 1


@dataclass(frozen=True)
class NodeDecision:
    """The strategy chosen for one graph node."""

    name: str
    op: str
    module: str
    kind: str  # anchor, follow, input, param, fixed, fallback, getitem
    operands: tuple[str | None, ...]
    outputs: tuple[str, ...]
    grads: tuple[str | None, ...]  # the layout of the gradient each operand receives
    compute_s: float


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
    optimizer_bytes: int  # Adam: two fp32 moments per parameter element
    activation_bytes: int

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


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

    @property
    def mesh_spec(self) -> MeshSpec:
        return MeshSpec.of(self.mesh)

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
