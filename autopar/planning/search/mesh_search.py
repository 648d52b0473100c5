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
    ordered ``pp, dp, tp``: tensor parallelism innermost, on the links within a node. Where
    no annotation names an axis, meshes of the same sizes are one candidate.
Pruned
    candidates are planned in the order of a lower bound of their step: the whole model's
    compute spread perfectly over every device, times the pipeline's
    ``(m + (pp − 1) / v) / m`` for a pipeline of ``m`` microbatches and ``v`` stages per
    rank (its bubble); at equal bounds, the least data parallelism first. A candidate
    whose bound is not below the best predicted step found is not planned: it cannot win.
    One planned after a step was found gets that step as its cutoff: when its first ILP
    solve's bound, scaled by the share of the objective that solve's plan takes as its step
    (at most 1: a step hides some of what the objective counts), is not below it, its memory
    choices are not searched (already slower), and its outcome says so.
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

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.capture.constraint_op import parse_constraint_spec
from autopar.capture.export import Captured, gradient_flow, repeated_blocks
from autopar.ir.errors import AnnotationError, MemoryFitError, OptionError, PlanError
from autopar.ir.mesh import MeshSpec
from autopar.ir.ops import LAYOUT_CONSTRAINT
from autopar.ir.options import Pipeline
from autopar.ir.plan import Plan
from autopar.planning.cost.model import Cluster, CostModel
from autopar.planning.graph.strategy_graph import build_strategy_graph
from autopar.planning.memory.saved_tensors import measure_saved
from autopar.planning.search.forked import ForkedCalls

Capture = Callable[[MeshSpec, Pipeline | None], Captured]
# (capture, mesh, pipeline, time_limit, cutoff: the best step found so far or None) -> plan
PlanCaptured = Callable[[Captured, MeshSpec, Pipeline | None, float, float | None], Plan]


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh the search considers, with its pipeline (None: none) and step lower bound."""

    sizes: dict[str, int]
    pipeline: Pipeline | None
    bound_s: float

    @property
    def shape(self) -> int | None:
        """What a reused capture of the model depends on: its microbatches (None: no pipeline)."""
        return None if self.pipeline is None else self.pipeline.microbatches

    def describe(self) -> str:
        mesh = "×".join(f"{a}={n}" for a, n in self.sizes.items())
        if self.pipeline is None:
            return mesh
        p = self.pipeline
        return f"{mesh}, {p.schedule} m={p.microbatches}" + (
            f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""
        )


def candidate_meshes(
    devices: int,
    cluster: Cluster,
    blocks: int,
    batch: int | None,
    pipeline: Pipeline | None,
    names_matter: bool = True,
) -> list[tuple[dict[str, int], Pipeline | None]]:
    """Every ``pp × dp × tp`` split of ``devices`` the search plans (see the module docstring).

    Where no annotation names an axis (``names_matter`` False), meshes of the same sizes in
    the same order are one candidate, listed under the first name (``pp=8×dp=8``, not also
    ``pp=8×tp=8``; ``dp=4``, not also ``tp=4``): the cost model knows an axis by its place
    and size alone, so both would plan alike."""
    out: list[tuple[dict[str, int], Pipeline | None]] = []
    for tp in _divisors(devices, cluster.devices_per_node):
        for pp in _divisors(devices // tp, max(blocks, 1)):
            sizes = _without_ones({"pp": pp, "dp": devices // tp // pp, "tp": tp})
            if pp == 1:
                out.append((sizes, None))
            elif pp <= blocks:
                out += [(sizes, p) for p in _pipelines(pp, blocks, batch, pipeline)]
    if names_matter:
        return out
    seen: set[tuple[tuple[int, ...], Pipeline | None]] = set()
    once = []
    for sizes, p in out:
        if (tuple(sizes.values()), p) not in seen:
            seen.add((tuple(sizes.values()), p))
            once.append((sizes, p))
    return once


def _without_ones(sizes: dict[str, int]) -> dict[str, int]:
    """The axes of more than one device (``dp`` alone for one device, and beside a pipeline
    axis that holds every device, as each stage needs a mesh): the names a user would write
    (the planner merges a size-1 axis into its neighbour anyway)."""
    kept = {a: n for a, n in sizes.items() if n > 1}
    return kept if set(kept) - {"pp"} else {**kept, "dp": 1}


def _divisors(n: int, most: int) -> list[int]:
    """The divisors of ``n`` up to ``most``: tried up to ``most`` only, so a count of 10**20 devices
    costs no more than one of 64."""
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


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
    workers: int = 1,
) -> Plan:
    """The fastest plan over :func:`candidate_meshes` (see the module docstring), the candidates
    planned in up to ``workers`` processes at once (:class:`~autopar.planning.search.forked.ForkedCalls`)."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise OptionError(f"mesh as a device count must be a positive int, got {devices!r}")
    t0 = time.perf_counter()
    one = MeshSpec.of({"dp": 1, "tp": 1})
    whole = capture(one, None)
    reuse = mesh_free(whole)
    compute = whole_compute_s(whole, one, cluster)
    blocks = len(repeated_blocks(whole.graph))
    meshes = candidate_meshes(devices, cluster, blocks, batch, pipeline, names_matter=not reuse)
    if pipeline is not None and pipeline.axis != "pp":
        raise OptionError(
            f"with a device count the pipeline axis is called 'pp', got Pipeline(axis={pipeline.axis!r})"
        )
    candidates = sorted(
        (MeshCandidate(sizes, p, compute / devices * _bubble(sizes, p, cluster)) for sizes, p in meshes),
        # at equal bounds the least data parallelism first: it holds the least state per device,
        # likeliest to fit without a memory search, and its step then cuts the others' short
        key=lambda c: (c.bound_s, c.sizes.get("dp", 1)),
    )
    rows: list[dict[str, Any]] = [{"mesh": c.describe(), "bound_s": c.bound_s} for c in candidates]

    def shared(made: Captured) -> Captured:
        # a capture every candidate of its shape plans on: what its ops save is measured here
        # once, before the children fork (each child's cache dies with it)
        if reuse:
            measure_saved(made.graph, gradient_flow(made))
        return made

    captures: dict[int | None, Captured] = {None: shared(whole)}

    attempted: set[int | None] = set()  # shapes captured ahead, or tried

    def captured(c: MeshCandidate) -> Captured:
        # captured here, in this process, so that every later candidate of the same microbatch
        # shape reuses it; the plan may be made in another
        if not reuse or c.shape not in captures:
            captures[c.shape] = shared(capture(MeshSpec.of(c.sizes), c.pipeline))
        return captures[c.shape]

    def planning(c: MeshCandidate, cutoff: float | None) -> Callable[[], Plan]:
        mesh = MeshSpec.of(c.sizes)
        return functools.partial(plan_captured, captured(c), mesh, c.pipeline, time_limit, cutoff)

    def ahead(c: MeshCandidate) -> None:
        # a shape the next candidates need is captured while the children plan (a capture here
        # when a worker is free leaves its core idle: 5 s a shape for Llama-3-8B), where reused
        if reuse and c.shape not in attempted:
            attempted.add(c.shape)
            try:
                captured(c)
            except (PlanError, AnnotationError):  # raised again when the candidate is submitted
                pass

    with ForkedCalls(workers) as calls:
        chosen = _plan_in_order(candidates, rows, calls, planning, ahead)
    if chosen is None and not any("least_bytes" in r for r in rows):
        raise PlanError(
            f"no mesh of {devices} devices has a plan: "
            + "; ".join(f"{r['mesh']}: {r['outcome']}" for r in rows)
        )
    if chosen is None:
        closest = min((r for r in rows if "least_bytes" in r), key=lambda r: r["least_bytes"])
        raise MemoryFitError(
            f"no mesh of {devices} devices has a plan that fits; the closest, {closest['mesh']}: "
            f"{closest['error']}",
            closest["least_bytes"],
        )
    best, index = chosen
    rows[index]["outcome"] = "chosen"
    best.mesh_candidates = rows
    processes = f" on {calls.workers} processes" if calls.workers > 1 else ""
    best.warnings.append(
        f"mesh chosen from {len(candidates)} candidates for {devices} devices in "
        f"{time.perf_counter() - t0:.1f} s{processes} (plan.mesh_candidates lists them)"
    )
    return best


def _plan_in_order(
    candidates: list[MeshCandidate],
    rows: list[dict[str, Any]],
    calls: ForkedCalls,
    planning: Callable[[MeshCandidate, float | None], Callable[[], Plan]],
    ahead: Callable[[MeshCandidate], None],
) -> tuple[Plan, int] | None:
    """Plan ``candidates`` in their order on ``calls`` (``planning`` gives each one's call, told
    the best step found so far as its cutoff), each only while its bound is below the best step
    found; the fastest plan and its index (of equally fast ones the first), each candidate's
    outcome written on its row of ``rows``. While every worker is busy, ``ahead`` prepares the
    next candidate waiting (its capture)."""
    best: tuple[Plan, int] | None = None
    left = list(range(len(candidates)))
    while left or calls.running:
        while left and calls.running < calls.workers:
            i = left.pop(0)
            bound = candidates[i].bound_s
            if best is not None and bound >= best[0].step_time_s:
                rows[i]["outcome"] = f"not planned: its bound {bound * 1e3:.1f} ms is not below the best step"
                continue
            try:
                calls.submit(i, planning(candidates[i], None if best is None else best[0].step_time_s))
            except (PlanError, AnnotationError) as e:  # its capture: this mesh cannot run the annotations
                _record(rows[i], e)
        waiting = candidates[left[0]] if left else None
        busy = calls.running >= calls.workers > 1
        if busy and waiting and (best is None or waiting.bound_s < best[0].step_time_s):
            ahead(waiting)
        if calls.running:
            i, (ok, found) = calls.next_done()
            _record(rows[i], found)
            if ok and (best is None or (found.step_time_s, i) < (best[0].step_time_s, best[1])):
                best = found, i
    return best


def _record(row: dict[str, Any], found: Plan | BaseException) -> None:
    """Write a candidate's plan, or why it has none, on its ``row``; raise any other error."""
    if isinstance(found, Plan):
        row.update(step_s=found.step_time_s, memory_bytes=found.peak_memory_bytes, outcome="planned")
    elif isinstance(found, MemoryFitError):
        row["outcome"] = f"no plan fits: the least memory reached is {found.least_bytes / 2**30:.2f} GiB"
        row["least_bytes"], row["error"] = found.least_bytes, str(found)
    elif isinstance(found, (PlanError, AnnotationError)):  # this mesh cannot run the model as annotated
        row["outcome"] = f"no plan: {found}"
    else:
        raise found


def _bubble(sizes: dict[str, int], pipeline: Pipeline | None, cluster: Cluster) -> float:
    """The factor a pipeline's bubble puts on a step at the least: ranks sharing a core fill
    each other's bubbles (``Cluster.ranks_per_core``), down to no bubble at all."""
    if pipeline is None:
        return 1.0
    m, p = pipeline.microbatches, sizes["pp"]
    return max((m + (p - 1) / pipeline.virtual_stages) / m / cluster.ranks_per_core, 1.0)
