"""The automatic mesh: from a number of devices to the fastest mesh, pipeline and memory plan.

``autopar.plan(model, args, 64)`` searches what a user would otherwise choose by hand:

Enumerated
    every way to write the device count as ``pp × dp × tp`` with ``tp`` at most the
    cluster's devices per node (tensor parallelism stays on the fast links) and ``pp`` at
    most the model's repeated blocks; for ``pp > 1`` a 1F1B pipeline of ``4·pp``
    microbatches, or ``2·pp`` or ``pp`` when that does not divide the batch (more
    microbatches, a smaller bubble), and the interleaved 1F1B of as many microbatches with
    two stages per rank when the model has at least ``2·pp`` blocks (half the bubble, more
    sends and more microbatches in flight); or the ``Pipeline`` the user gave. GPipe is not
    enumerated: its bubble is 1F1B's and it keeps every microbatch in flight. Axes are
    ordered ``pp, dp, tp``: tensor parallelism innermost, on the links within a node.
Pruned
    candidates are planned in the order of a lower bound of their step: the whole model's
    compute spread perfectly over every device, times the pipeline's
    ``(m + (pp − 1) / v) / m`` for a pipeline of ``m`` microbatches and ``v`` stages per
    rank (its bubble). A candidate
    whose bound is not below the best predicted step found is not planned: it cannot win.
Decided by the ILP
    for each candidate planned, every op's layout on its mesh (which axis splits the batch,
    the sequence, heads or hidden), the ZeRO stage and recompute under the memory budget
    (:func:`autopar.planning.planner.plan_captured`), each candidate with the whole
    ``time_limit``: a candidate solved in less time may be planned far from its best and
    lose for that alone.

The plan returned is the fastest that fits; ``plan.mesh_candidates`` lists every candidate
with its predicted step and memory, or why it was not planned. A capture is made once per
microbatch shape and reused by every mesh when the model's annotations do not depend on the
mesh (no ``shard`` annotations, no ``constrain`` calls); otherwise once per candidate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.capture.constraint_op import parse_constraint_spec
from autopar.capture.export import Captured, repeated_blocks
from autopar.ir.errors import AnnotationError, MemoryFitError, OptionError, PlanError
from autopar.ir.mesh import MeshSpec
from autopar.ir.ops import LAYOUT_CONSTRAINT
from autopar.ir.options import Pipeline
from autopar.ir.plan import Plan
from autopar.planning.cost import Cluster, CostModel
from autopar.planning.strategy_graph import build_strategy_graph

Capture = Callable[[MeshSpec, Pipeline | None], Captured]
PlanCaptured = Callable[[Captured, MeshSpec, Pipeline | None, float], Plan]


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh the search considers, with its pipeline (None: none) and step lower bound."""

    sizes: dict[str, int]
    pipeline: Pipeline | None
    bound_s: float

    def describe(self) -> str:
        mesh = "×".join(f"{a}={n}" for a, n in self.sizes.items())
        if self.pipeline is None:
            return mesh
        p = self.pipeline
        return f"{mesh}, {p.schedule} m={p.microbatches}" + (
            f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""
        )


def candidate_meshes(
    devices: int, cluster: Cluster, blocks: int, batch: int | None, pipeline: Pipeline | None
) -> list[tuple[dict[str, int], Pipeline | None]]:
    """Every ``pp × dp × tp`` split of ``devices`` the search plans (see the module docstring)."""
    out: list[tuple[dict[str, int], Pipeline | None]] = []
    for tp in _divisors(devices):
        if tp > cluster.devices_per_node:
            continue
        for pp in _divisors(devices // tp):
            sizes = _without_ones({"pp": pp, "dp": devices // tp // pp, "tp": tp})
            if pp == 1:
                out.append((sizes, None))
            elif pp <= blocks:
                out += [(sizes, p) for p in _pipelines(pp, blocks, batch, pipeline)]
    return out


def _without_ones(sizes: dict[str, int]) -> dict[str, int]:
    """The axes of more than one device (``dp`` alone for one device, and beside a pipeline
    axis that holds every device, as each stage needs a mesh): the names a user would write
    (the planner merges a size-1 axis into its neighbour anyway)."""
    kept = {a: n for a, n in sizes.items() if n > 1}
    return kept if set(kept) - {"pp"} else {**kept, "dp": 1}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pipelines(pp: int, blocks: int, batch: int | None, given: Pipeline | None) -> list[Pipeline]:
    if given is not None:
        return [given]
    counts = [m for m in (4 * pp, 2 * pp, pp) if batch is not None and batch % m == 0]
    if not counts:
        return []
    one = Pipeline(counts[0], "1f1b")
    return [one, Pipeline(counts[0], "interleaved-1f1b", 2)] if blocks >= 2 * pp else [one]


def whole_compute_s(captured: Captured, one: MeshSpec, cluster: Cluster) -> float:
    """Seconds of the whole model's forward and backward on one device of ``cluster``
    (``captured`` was captured for ``one``, a mesh of one device, whose axes its annotations name)."""
    g = build_strategy_graph(captured, one, CostModel(one, cluster))
    return sum(float(c.compute[0]) for c in g.choices.values() if c.compute is not None)


def mesh_free(captured: Captured) -> bool:
    """Whether the capture is the same on every mesh: no annotation lowered onto one."""
    a = captured.annotations
    # autopar's own free points at block boundaries pin no layout; a user's constraint does
    constrained = any(
        str(n.target) == LAYOUT_CONSTRAINT and parse_constraint_spec(n.args[1])[0] is not None
        for n in captured.graph.nodes
    )
    return not (a.parameter_layouts or a.parameter_rows or constrained)


def search_meshes(
    devices: int,
    cluster: Cluster,
    batch: int | None,
    pipeline: Pipeline | None,
    capture: Capture,
    plan_captured: PlanCaptured,
    time_limit: float,
) -> Plan:
    """The fastest plan over :func:`candidate_meshes` (see the module docstring)."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise OptionError(f"mesh as a device count must be a positive int, got {devices!r}")
    t0 = time.perf_counter()
    one = MeshSpec.of({"dp": 1, "tp": 1})
    whole = capture(one, None)
    reuse = mesh_free(whole)
    compute = whole_compute_s(whole, one, cluster)
    meshes = candidate_meshes(devices, cluster, len(repeated_blocks(whole.graph)), batch, pipeline)
    if pipeline is not None and pipeline.axis != "pp":
        raise OptionError(
            f"with a device count the pipeline axis is called 'pp', got Pipeline(axis={pipeline.axis!r})"
        )
    candidates = sorted(
        (MeshCandidate(sizes, p, compute / devices * _bubble(sizes, p, cluster)) for sizes, p in meshes),
        key=lambda c: c.bound_s,
    )
    captures: dict[int | None, Captured] = {None: whole}
    best: Plan | None = None
    rows: list[dict[str, Any]] = []
    for c in candidates:
        row: dict[str, Any] = {"mesh": c.describe(), "bound_s": c.bound_s}
        rows.append(row)
        if best is not None and c.bound_s >= best.step_time_s:
            row["outcome"] = f"not planned: its bound {c.bound_s * 1e3:.1f} ms is not below the best step"
            continue
        key = None if c.pipeline is None else c.pipeline.microbatches
        mesh = MeshSpec.of(c.sizes)
        try:
            if not reuse or key not in captures:
                captures[key] = capture(mesh, c.pipeline)
            found = plan_captured(captures[key], mesh, c.pipeline, time_limit)
        except MemoryFitError as e:
            row.update(outcome=f"no plan fits: the least memory reached is {e.least_bytes / 2**30:.2f} GiB")
            row["least_bytes"], row["error"] = e.least_bytes, str(e)
            continue
        except (PlanError, AnnotationError) as e:  # this mesh cannot run the model as annotated, say
            row["outcome"] = f"no plan: {e}"
            continue
        row.update(step_s=found.step_time_s, memory_bytes=found.peak_memory_bytes, outcome="planned")
        if best is None or found.step_time_s < best.step_time_s:
            best = found
    if best is None and not any("least_bytes" in r for r in rows):
        raise PlanError(
            f"no mesh of {devices} devices has a plan: "
            + "; ".join(f"{r['mesh']}: {r['outcome']}" for r in rows)
        )
    if best is None:
        closest = min((r for r in rows if "least_bytes" in r), key=lambda r: r["least_bytes"])
        raise MemoryFitError(
            f"no mesh of {devices} devices has a plan that fits; the closest, {closest['mesh']}: "
            f"{closest['error']}",
            closest["least_bytes"],
        )
    chosen = best.device_mesh_spec
    for row, c in zip(rows, candidates):
        if MeshSpec.of(c.sizes) == chosen and row.get("step_s") == best.step_time_s:
            row["outcome"] = "chosen"
    best.mesh_candidates = rows
    best.warnings.append(
        f"mesh chosen from {len(candidates)} candidates for {devices} devices in "
        f"{time.perf_counter() - t0:.1f} s (plan.mesh_candidates lists them)"
    )
    return best


def _bubble(sizes: dict[str, int], pipeline: Pipeline | None, cluster: Cluster) -> float:
    """The factor a pipeline's bubble puts on a step at the least: ranks sharing a core fill
    each other's bubbles (``Cluster.ranks_per_core``), down to no bubble at all."""
    if pipeline is None:
        return 1.0
    m, p = pipeline.microbatches, sizes["pp"]
    return max((m + (p - 1) / pipeline.virtual_stages) / m / cluster.ranks_per_core, 1.0)
