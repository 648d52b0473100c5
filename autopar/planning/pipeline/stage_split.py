"""Where to cut a pipelined model: the contiguous split of its units into stages.

:func:`partition` splits units (repeated blocks, or top-level modules) into stages given
each unit's seconds and bytes (:class:`UnitCosts`); :mod:`autopar.planning.pipeline.stage_plan`
measures the units and plans the schedule around the split.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from autopar.ir.errors import PlanError
from autopar.ir.options import Pipeline
from autopar.planning.pipeline.in_flight import stage_flights


class PipelineFitError(PlanError):
    """No split of the model into pipeline stages fits the memory per device; ``least_bytes``
    is the least a rank holds under the split holding least."""

    def __init__(self, message: str, least_bytes: float) -> None:
        super().__init__(message)
        self.least_bytes = least_bytes


@dataclass(frozen=True)
class UnitCosts:
    """Per unit: seconds of one microbatch (forward and backward), bytes of memory
    that do not scale with microbatches in flight (parameters, gradients, optimizer
    state), and activation bytes of one microbatch; per cut ``i`` (before unit ``i``)
    the seconds of sending what crosses it, forward and backward. ``copied_bytes`` maps units
    (in order) to bytes every stage holding any of them holds once: constant buffers those
    units read, which each such stage has a copy of; they are in no unit's ``fixed_bytes``."""

    seconds: list[float]
    fixed_bytes: list[float]
    activation_bytes: list[float]
    cut_seconds: list[float]
    copied_bytes: Mapping[tuple[int, ...], float] = field(default_factory=dict)


def partition(costs: UnitCosts, pipeline: Pipeline, p: int, memory_bytes: float) -> list[int]:
    """Stage of each unit: the contiguous split minimising ``Σ t_s + (m − 1) max t_s`` whose
    every pipeline rank fits in ``memory_bytes``.

    ``t_s`` is a stage's unit seconds plus the cuts at both its ends. A rank holds its
    ``virtual_stages`` stages' state and their activations at its peak
    (:func:`~autopar.planning.pipeline.in_flight.stage_flights`). The split is searched with each
    stage allowed a share of the memory (:func:`_fastest_split`); with one stage per rank the
    share is all of it, which is exact. A rank of an interleaved schedule shares the memory
    between its stages: first equally, then, the split found summed rank by rank as the schedule
    runs it, in the proportions that split's stages take, each rank's shares scaled to the memory
    (a rank over it gives some up, one under it gets the slack), where no split fit the shares
    from the split nearest to fitting them (:func:`_nearest_split`); :data:`_ROUNDS` times at
    most. A split returned fits every rank; one that only some other sharing reaches is missed.
    Raises :class:`PipelineFitError` when no split is found.
    """
    n, stages = len(costs.seconds), p * pipeline.virtual_stages
    if n < stages:
        raise PlanError(
            f"the model has {n} pipeline units (repeated blocks, or top-level modules without them) "
            f"for {stages} stages; use fewer stages or annotate modules with pipeline_stage"
        )
    shares = [memory_bytes / pipeline.virtual_stages] * stages
    for _ in range(1 if pipeline.virtual_stages == 1 else _ROUNDS):
        table = _StageTable(costs, pipeline, p, shares)
        cuts = _fastest_split(table, pipeline.microbatches, stages)
        fastest = cuts is not None
        cuts = cuts if fastest else _nearest_split(costs, pipeline, p, shares)
        ranks = table.rank_bytes(cuts)
        if fastest and max(ranks) <= memory_bytes:
            out, start = [], 0
            for s, stop in enumerate(cuts):
                out += [s] * (stop - start)
                start = stop
            return out
        # a rank holding nothing fits whatever its stages take
        scale = [memory_bytes / r if r else 0.0 for r in ranks]
        bounds = itertools.pairwise([0, *cuts])
        shares = [table.memory(i, j, s) * scale[s % p] or memory_bytes for s, (i, j) in enumerate(bounds)]
    raise _no_split(costs, pipeline, p, memory_bytes)


# how many sharings of a rank's memory between its stages partition tries under interleaving
_ROUNDS = 6


def _nearest_split(costs: UnitCosts, pipeline: Pipeline, p: int, shares: list[float]) -> list[int]:
    """The cuts of the split whose stages' bytes take the least largest part of their ``shares``
    (of the memory), whatever their seconds: every stage as fast, the least total is the least
    largest part (:func:`_split_within`)."""
    zeros = [0.0] * len(costs.seconds)
    table = _StageTable(replace(costs, seconds=zeros, cut_seconds=zeros), pipeline, p, shares, bounded=False)
    found = _split_within(table, p * pipeline.virtual_stages, math.inf)
    assert found is not None  # an unbounded table has a split of every n >= stages units
    return found[2]


def _fastest_split(table: _StageTable, m: int, stages: int) -> list[int] | None:
    """The cut positions of the split :func:`partition` picks with each stage fitting the table's
    allowance, None when none does. For a threshold on the slowest stage, a dynamic program finds
    the split with the least total time (then the least largest memory) whose stages are all at
    most that slow and fit (:func:`_split_within`). Whether one exists only grows with the
    threshold, so the least threshold with a split is found by bisection over the stage times;
    larger ones are then tried in increasing order until the threshold alone rules out beating the
    best split found."""
    n = table.n
    limits = sorted({table.seconds(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    splits: dict[float, tuple[float, float, list[int]] | None] = {}  # the bisection's, kept for the scan

    def within(limit: float) -> tuple[float, float, list[int]] | None:
        if limit not in splits:
            splits[limit] = _split_within(table, stages, limit)
        return splits[limit]

    low, high = 0, len(limits)  # the first feasible threshold is in limits[low:high], or none is
    while low < high:
        mid = (low + high) // 2
        if within(limits[mid]) is None:
            low = mid + 1
        else:
            high = mid
    best: tuple[float, float, list[int]] | None = None
    for limit in limits[low:]:
        if best is not None and table.total + (m - 1) * limit >= best[0]:
            break
        found = within(limit)
        if found is None:
            continue
        total, peak, cuts = found
        slowest = max(table.seconds(i, j) for i, j in zip([0, *cuts[:-1]], cuts))
        if best is None or (total + (m - 1) * slowest, peak) < best[:2]:
            best = (total + (m - 1) * slowest, peak, cuts)
    return None if best is None else best[2]


def _no_split(costs: UnitCosts, pipeline: Pipeline, p: int, memory_bytes: float) -> PipelineFitError:
    """The error when no split fits: the smallest stage, and the rank holding the most under the
    split of least largest stage (what a rank holds at least, as near as the split finds it)."""
    n, stages = len(costs.seconds), p * pipeline.virtual_stages
    table = _StageTable(costs, pipeline, p, [memory_bytes] * stages, bounded=False)
    smallest = min(
        table.memory(i, j, s) for s in range(stages) for i in range(n) for j in range(i + 1, n + 1)
    )
    ranks = table.rank_bytes(_nearest_split(costs, pipeline, p, [memory_bytes] * stages))
    rank = max(range(p), key=ranks.__getitem__)
    held = ", ".join(str(s) for s in range(rank, stages, p))
    return PipelineFitError(
        f"no split of the model into {stages} pipeline stages fits in {memory_bytes / 2**30:.2f} GiB "
        f"per device (the smallest stage needs {smallest / 2**30:.2f} GiB; under the split holding "
        f"least, pipeline rank {rank} holds {ranks[rank] / 2**30:.2f} GiB in its stages {held}); use more "
        f"devices, fewer microbatches in flight (schedule '1f1b') or a larger cluster memory",
        ranks[rank],
    )


class _StageTable:
    """Seconds and bytes of a stage holding units ``[i, j)`` as stage ``s`` (prefix sums), and
    the bytes each stage is allowed (``stage_bytes``, its share of its rank's memory; not a bound
    where ``bounded`` is false, only what its part is measured against)."""

    def __init__(
        self, costs: UnitCosts, pipeline: Pipeline, p: int, stage_bytes: list[float], bounded: bool = True
    ) -> None:
        self.n, self.stage_bytes, self.bounded = len(costs.seconds), stage_bytes, bounded
        values = (*costs.seconds, *costs.fixed_bytes, *costs.activation_bytes, *costs.copied_bytes.values())
        if min(values, default=0.0) < 0:
            raise ValueError("a unit's seconds and bytes are never negative (past() relies on it)")
        self.copies = _copies(costs.copied_bytes, self.n)
        self.prefix_t, self.prefix_f, self.prefix_a = ([0.0] for _ in range(3))
        for t, f, a in zip(costs.seconds, costs.fixed_bytes, costs.activation_bytes):
            self.prefix_t.append(self.prefix_t[-1] + t)
            self.prefix_f.append(self.prefix_f[-1] + f)
            self.prefix_a.append(self.prefix_a[-1] + a)
        self.total = self.prefix_t[-1]
        self.cut = [*costs.cut_seconds, 0.0]  # cut[n]: after the last unit, nothing is sent
        self.pipeline, self.p = pipeline, p
        # microbatches each stage holds at its rank's peak, were its stages' activations equal
        self.flight = stage_flights(pipeline, p, [1.0] * (p * pipeline.virtual_stages))

    def seconds(self, i: int, j: int) -> float:
        return self.prefix_t[j] - self.prefix_t[i] + (self.cut[i] if i else 0.0) + self.cut[j]

    def memory(self, i: int, j: int, s: int) -> float:
        held = self.prefix_f[j] - self.prefix_f[i] + (self.copies[i][j] if self.copies else 0.0)
        return held + self.flight[s] * (self.prefix_a[j] - self.prefix_a[i])

    def rank_bytes(self, cuts: list[int]) -> list[float]:
        """Per pipeline rank, what it holds under the split ending its stages at ``cuts``: its
        stages' state, and their activations at its peak (:func:`stage_flights` of their own bytes)."""
        bounds = list(itertools.pairwise([0, *cuts]))
        activations = [self.prefix_a[j] - self.prefix_a[i] for i, j in bounds]
        flights = stage_flights(self.pipeline, self.p, activations)
        ranks = [0.0] * self.p
        for s, (i, j) in enumerate(bounds):
            ranks[s % self.p] += self.memory(i, j, s) + (flights[s] - self.flight[s]) * activations[s]
        return ranks

    def past(self, i: int, j: int, s: int, limit: float) -> bool:
        """Whether stage ``s`` holding units ``[i, j)``, or any more after them, takes longer than
        ``limit`` or does not fit: its units' own seconds (cuts aside) and its bytes only grow with ``j``."""
        return self.prefix_t[j] - self.prefix_t[i] > limit or (
            self.bounded and self.memory(i, j, s) > self.stage_bytes[s]
        )

    def part(self, i: int, j: int, s: int) -> float:
        """What of its share stage ``s`` holding units ``[i, j)`` takes (above 1: more than it)."""
        return self.memory(i, j, s) / self.stage_bytes[s] if self.stage_bytes[s] else math.inf


def _copies(copied_bytes: Mapping[tuple[int, ...], float], n: int) -> list[list[float]]:
    """``table[i][j]``: the copied bytes (:attr:`UnitCosts.copied_bytes`) a stage holding units
    ``[i, j)`` holds, each entry's once if any of its units is among them; no table without any."""
    if not copied_bytes:
        return []
    table = []
    for i in range(n + 1):
        row = [0.0] * (n + 2)
        for units, nbytes in copied_bytes.items():
            first = min((u for u in units if u >= i), default=n)  # held from j = first + 1 on
            row[first + 1] += nbytes
        table.append(list(itertools.accumulate(row[: n + 1])))
    return table


def _split_within(table: _StageTable, stages: int, limit: float) -> tuple[float, float, list[int]] | None:
    """(total seconds, largest part of its share a stage takes, cut positions) of the split into
    ``stages`` whose stages all take at most ``limit`` and fit, with the least total then the
    least largest part (:meth:`_StageTable.part`); None when there is none."""
    n = table.n
    # f[j]: the best (total, peak, cuts) of units [0, j) in the stages so far
    f: dict[int, tuple[float, float, list[int]]] = {0: (0.0, 0.0, [])}
    for s in range(stages):
        row: dict[int, tuple[float, float, list[int]]] = {}
        for i, (total, peak, cuts) in f.items():
            for j in range(i + 1, n - (stages - s - 1) + 1):
                if table.past(i, j, s, limit):
                    break
                t, mem = table.seconds(i, j), table.part(i, j, s)
                if t > limit:  # with the cuts at both ends (past() checked the memory)
                    continue
                cand = (total + t, max(peak, mem), [*cuts, j])
                if j not in row or cand[:2] < row[j][:2]:
                    row[j] = cand
        f = row
    return f.get(n)
