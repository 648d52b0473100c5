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
    each candidate has a lower bound of its step (:class:`Bounds`): the whole model's compute,
    the forward that every memory choice recomputes included, spread perfectly over every
    device, times the pipeline's ``(m + (pp − 1) / v) / m`` for a pipeline of ``m``
    microbatches and ``v`` stages per rank (its bubble). Candidates are planned by bound; at
    equal bounds those whose pipeline and tensor axes hold the model's state within the budget
    without ZeRO first, then the least data parallelism first. A candidate whose bound is not
    below the best predicted step found is not planned: it cannot win. One whose memory bound (the model's
    parameters, gradients and optimizer state split over every device) exceeds the budget is
    not planned at all.
    One planned after a step was found gets that step as its cutoff: when its first ILP
    solve's bound, scaled by the share of the objective that solve's plan takes as its step
    (at most 1: a step hides some of what the objective counts), is not below it, its memory
    choices are not searched (already slower), and its outcome says so.
Decided by the ILP
    for each candidate planned, every op's layout on its mesh (which axis splits the batch,
    the sequence, heads or hidden), the ZeRO stage and recompute under the memory budget
    (:func:`autopar.planning.planner.plan_captured`), each candidate with the whole
    ``time_limit`` in CP-SAT's deterministic seconds, so that the host's load does not change a
    mesh's plan: a candidate solved in less time may be planned far from its best and lose for
    that alone.

The plan returned is the fastest that fits; ``plan.mesh_candidates`` lists every candidate
with its predicted step and memory, or why it was not planned. A capture is made once per
microbatch shape and reused by every mesh when the model's annotations do not depend on the
mesh (no ``shard`` annotations, no ``constrain`` calls); otherwise once per candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from autopar.capture.constraint_op import parse_constraint_spec
from autopar.capture.export import Captured, repeated_blocks
from autopar.ir.errors import AnnotationError, MemoryFitError, OptionError, PlanError
from autopar.ir.mesh import MeshSpec
from autopar.ir.ops import LAYOUT_CONSTRAINT
from autopar.ir.options import Memory, Pipeline, PlanOptions
from autopar.ir.plan import Plan
from autopar.planning.cost.device_model import device_model
from autopar.planning.cost.model import Cluster, CostModel
from autopar.planning.graph.strategy_graph import build_strategy_graph
from autopar.planning.search.memory_search import memory_choices
from autopar.planning.search.memory_tables import MemoryTerms


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh the search considers, with its pipeline (None: none) and its lower bounds: of the
    step (``bound_s``) and of the bytes per device (``memory_bound_bytes``) of any plan on it
    (:class:`Bounds`)."""

    sizes: dict[str, int]
    pipeline: Pipeline | None
    bound_s: float
    memory_bound_bytes: float

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

    def row(self) -> dict[str, Any]:
        """The candidate's row of ``plan.mesh_candidates`` before its outcome: the mesh in words and
        as sizes, its pipeline (schedule, microbatches, stages per rank; None without one) and bounds."""
        p = self.pipeline
        pipeline = None
        if p is not None:
            pipeline = {
                "schedule": p.schedule,
                "microbatches": p.microbatches,
                "virtual_stages": p.virtual_stages,
            }
        return {
            "mesh": self.describe(),
            "sizes": dict(self.sizes),
            "pipeline": pipeline,
            "bound_s": self.bound_s,
            "memory_bound_bytes": self.memory_bound_bytes,
        }


@dataclass(frozen=True)
class Bounds:
    """What every plan of the model takes at the least, whatever its mesh, from the strategy graph of
    one device (its only strategy per op): the seconds of its forward, backward and the forward that
    recompute runs again (``compute_s``) and the bytes of its state (parameters, gradients and the
    optimizer's state: ``state_bytes``), each the least over the memory search's choices
    (:func:`memory_choices`: a recompute the annotations fix is in every one).

    A mesh of ``N`` devices spreads them at best evenly, so that :meth:`step_s` and
    :meth:`memory_bytes` bound any of its plans from below (docs/automatic_mesh.md, "The bounds").
    What a step saves for backward is left out of the memory bound: the estimate of one device's is
    no lower bound of a rank's exact figure (the memory model's values alive for a while differ)."""

    compute_s: float
    state_bytes: float

    @classmethod
    def of(cls, whole: Captured, cluster: Cluster, memory: Memory) -> Bounds:
        """The bounds of the model ``whole`` (captured for a mesh of one device, ``{"dp": 1, "tp": 1}``).

        Args:
            whole: the model captured for one device.
            cluster: the hardware its seconds are priced on.
            memory: the memory options its plans are searched under.
        """
        one = MeshSpec.of({"dp": 1, "tp": 1})
        g = build_strategy_graph(whole, one, CostModel(one, cluster))
        compute = sum(float(c.compute[0]) for c in g.choices.values() if c.compute is not None)
        choices = memory_choices(whole, memory)
        state = MemoryTerms(g, memory, (1.0, 0.0))  # the state's bytes alone (activations weigh 0)
        return cls(
            compute_s=compute + min(state.least_seconds(c) for c in choices),
            state_bytes=min(state.least_bytes(c) for c in choices),
        )

    def step_s(self, sizes: dict[str, int], pipeline: Pipeline | None, cluster: Cluster) -> float:
        """A lower bound of any step on the mesh ``sizes`` under ``pipeline``: the compute spread
        evenly over its devices, times the pipeline's bubble (:func:`_bubble`)."""
        return self.compute_s / math.prod(sizes.values()) * _bubble(sizes, pipeline, cluster)

    def memory_bytes(self, devices: int) -> float:
        """A lower bound of the bytes of the device holding most on a mesh of ``devices``: the state
        split over all of them (ZeRO-3 and model parallelism at their most)."""
        return self.state_bytes / devices


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


def mesh_free(captured: Captured) -> bool:
    """Whether the capture is the same on every mesh: no annotation lowered onto one."""
    a = captured.annotations
    # autopar's own free points at block boundaries pin no layout; a user's constraint does
    constrained = any(
        str(n.target) == LAYOUT_CONSTRAINT and parse_constraint_spec(n.args[1])[0] is not None
        for n in captured.graph.nodes
    )
    return not (a.parameter_layouts or a.parameter_rows or constrained)


def check_devices(devices: object) -> int:
    """``devices`` if it is a device count the search can lay out: a positive int.

    Args:
        devices: the ``mesh`` given as a number of devices.
    """
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise OptionError(f"mesh as a device count must be a positive int, got {devices!r}")
    return devices


class CandidatePlan(Protocol):
    """A candidate mesh's plan as planning it returns it (:class:`autopar.planning.planner.Planned`):
    the figures candidates are compared by, and :meth:`record` for the plan with its report,
    written once, for the candidate chosen."""

    step_time_s: float
    peak_memory_bytes: int

    def record(self) -> Plan:
        """The plan with its report."""
        ...


@dataclass
class MeshSearch:
    """The automatic mesh as data: the candidates in the order they are planned, each one's row of
    ``plan.mesh_candidates``, and the fastest plan found so far. Its driver
    (:func:`autopar.planning.entry_points.plan_for_devices`) asks it which candidate to plan next
    (:meth:`next`) and tells it what came of each (:meth:`done`); it plans nothing itself.

    ``reuse``: one capture per microbatch shape serves every mesh (:func:`mesh_free`).
    """

    devices: int
    candidates: list[MeshCandidate]
    reuse: bool
    rows: list[dict[str, Any]]
    left: list[int]
    best: tuple[CandidatePlan, int] | None = field(default=None)

    @classmethod
    def of(
        cls, devices: int, cluster: Cluster, whole: Captured, batch: int | None, options: PlanOptions
    ) -> MeshSearch:
        """The candidates for ``devices`` (see the module docstring), sorted by their bounds; those
        whose memory bound exceeds the budget are not planned (their rows say so).

        Args:
            devices: the device count (:func:`check_devices`).
            cluster: the hardware the steps are priced for.
            whole: the model captured for a mesh of one device, ``{"dp": 1, "tp": 1}``.
            batch: the example's batch (dim 0), which a pipeline's microbatches divide; None: unknown.
            options: what the plan was asked with: ``pipeline`` (that of every pipelined candidate, or
                None to enumerate them), ``memory`` and ``memory_budget``.
        """
        pipeline = options.pipeline
        if pipeline is not None and pipeline.axis != "pp":
            raise OptionError(
                f"with a device count the pipeline axis is called 'pp', got Pipeline(axis={pipeline.axis!r})"
            )
        reuse = mesh_free(whole)
        bounds = Bounds.of(whole, cluster, options.memory or Memory())
        blocks = len(repeated_blocks(whole.graph))
        meshes = candidate_meshes(devices, cluster, blocks, batch, pipeline, names_matter=not reuse)
        budget = cluster.memory_bytes if options.memory_budget is None else options.memory_budget

        def order(c: MeshCandidate) -> tuple[float, bool, int]:
            # by bound (the likeliest to win first, so that their steps prune the rest and, read live
            # by the candidates planned beside them, cut their searches short); at equal bounds first
            # the meshes whose pipeline and tensor axes hold the state within the budget without ZeRO
            # (the likeliest to be planned without a memory search), then the least data parallelism
            modelled = c.sizes.get("pp", 1) * c.sizes.get("tp", 1)
            return c.bound_s, bounds.state_bytes / modelled > budget, c.sizes.get("dp", 1)

        candidates = sorted(
            (
                MeshCandidate(sizes, p, bounds.step_s(sizes, p, cluster), bounds.memory_bytes(devices))
                for sizes, p in meshes
            ),
            key=order,
        )
        rows = [c.row() for c in candidates]
        left = []
        for i, c in enumerate(candidates):
            if c.memory_bound_bytes <= budget:
                left.append(i)
                continue
            gib = c.memory_bound_bytes / 2**30
            rows[i].update(
                outcome=f"not planned: no plan fits: every plan holds at least {gib:.3g} GiB per device",
                least_bytes=int(c.memory_bound_bytes),
                error=f"every plan of mesh {c.describe()} holds at least {gib:.3g} GiB per device (the "
                f"parameters, gradients and optimizer state split over its {devices} devices), over "
                f"memory_budget={budget / 2**30:.2f} GiB",
            )
        return cls(devices, candidates, reuse, rows, left)

    @property
    def cutoff_s(self) -> float | None:
        """The best step found so far (None: none yet): a candidate's planning stops at it."""
        return None if self.best is None else self.best[0].step_time_s

    def next(self) -> int | None:
        """The index of the next candidate worth planning, its bound below the best step found;
        each one passed over is marked on its row. None when no candidate is left."""
        while self.left:
            i = self.left.pop(0)
            bound = self.candidates[i].bound_s
            if self.best is not None and bound >= self.best[0].step_time_s:
                outcome = f"not planned: its bound {bound * 1e3:.1f} ms is not below the best step"
                self.rows[i]["outcome"] = outcome
                continue
            return i
        return None

    def waiting(self) -> MeshCandidate | None:
        """The next candidate left if it may still win: worth preparing (capturing) meanwhile."""
        c = self.candidates[self.left[0]] if self.left else None
        return c if c is not None and (self.best is None or c.bound_s < self.best[0].step_time_s) else None

    def done(self, i: int, found: CandidatePlan | BaseException, seconds: float | None = None) -> None:
        """Candidate ``i``'s plan, or why it has none (raised again where it is no reason a mesh
        cannot run the model), and the wall ``seconds`` its planning took where timed (its row's
        ``plan_s``); the fastest plan is kept (of equally fast ones the first)."""
        _record(self.rows[i], found)
        if seconds is not None:
            self.rows[i]["plan_s"] = seconds
        if not isinstance(found, BaseException) and (
            self.best is None or (found.step_time_s, i) < (self.best[0].step_time_s, self.best[1])
        ):
            self.best = found, i

    def chosen(self, elapsed_s: float, workers: int) -> Plan:
        """The fastest plan, its ``mesh_candidates`` the rows; a :class:`PlanError` where no mesh has a
        plan, a :class:`MemoryFitError` naming the closest where none fits."""
        if self.best is None and not any("least_bytes" in r for r in self.rows):
            raise PlanError(
                f"no mesh of {self.devices} devices has a plan: "
                + "; ".join(f"{r['mesh']}: {r['outcome']}" for r in self.rows)
            )
        if self.best is None:
            closest = min((r for r in self.rows if "least_bytes" in r), key=lambda r: r["least_bytes"])
            raise MemoryFitError(
                f"no mesh of {self.devices} devices has a plan that fits; the closest, {closest['mesh']}: "
                f"{closest['error']}",
                closest["least_bytes"],
            )
        best, index = self.best[0].record(), self.best[1]
        self.rows[index]["outcome"] = "chosen"
        best.mesh_candidates = self.rows
        processes = f" on {workers} processes" if workers > 1 else ""
        outcomes = [r["outcome"] for r in self.rows]
        planned = sum(not o.startswith("not planned") for o in outcomes)
        by_step = sum(o.startswith("not planned: its bound") for o in outcomes)
        best.warnings.append(
            f"mesh chosen from {len(self.candidates)} candidates for {self.devices} devices in "
            f"{elapsed_s:.1f} s{processes}: {planned} planned, {by_step} not planned by their step bound, "
            f"{len(outcomes) - planned - by_step} by their memory bound (plan.mesh_candidates lists them)"
        )
        return best


def _record(row: dict[str, Any], found: CandidatePlan | BaseException) -> None:
    """Write a candidate's plan, or why it has none, on its ``row``; raise any other error."""
    if isinstance(found, MemoryFitError):
        row["outcome"] = f"no plan fits: the least memory reached is {found.least_bytes / 2**30:.2f} GiB"
        row["least_bytes"], row["error"] = found.least_bytes, str(found)
    elif isinstance(found, (PlanError, AnnotationError)):  # this mesh cannot run the model as annotated
        row["outcome"] = f"no plan: {found}"
    elif isinstance(found, BaseException):
        raise found
    else:
        row.update(step_s=found.step_time_s, memory_bytes=found.peak_memory_bytes, outcome="planned")


def _bubble(sizes: dict[str, int], pipeline: Pipeline | None, cluster: Cluster) -> float:
    """The factor a pipeline's bubble puts on a step at the least: ranks sharing a core fill
    each other's bubbles (the device's ``shared_core_speedup``), down to no bubble at all."""
    if pipeline is None:
        return 1.0
    m, p = pipeline.microbatches, sizes["pp"]
    return max((m + (p - 1) / pipeline.virtual_stages) / m / device_model(cluster).shared_core_speedup, 1.0)
