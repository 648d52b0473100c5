"""The per-axis steps of a layout change, in an order that respects nested splits.

A redistribution changes each mesh axis with one op (a :class:`StepKind`). One tensor dim
may be split over several axes; as in DTensor the outer (earlier) axis takes the outer
split, so an op on axis ``a`` that splits, gathers or moves dim ``d`` is right only when no
inner axis (``b > a``) splits ``d`` at that moment: the op treats its own split as the
innermost. :func:`plan_steps` orders the steps so that this always holds, unwinding an
inner split (an extra ``all_gather``, then a ``slice`` to redo it) where no order can.
:func:`walk` replays the steps: the layout around each and the gradient's as each
backward receives it, which both the cost model and the lowering read.

Layouts here are *states*, one per axis (:func:`axis_states`): the sharded dim, ``"dxk"`` (dim
``d`` strided in ``k`` parts), ``"R"``, ``"P"`` (partial sums) or ``"M"`` (partial maxima);
plain values compare in nanoseconds, and the planner prices ~1e5 layout pairs. Partial
maxima come only from a maximum over a split dim and only go out by an ``all_reduce`` (of
the maximum): nothing consumes them. A strided shard comes from whole data (``slice``) or
partial sums (``reduce_scatter``) and goes to whole data (``all_gather``), each reordering
its parts; to or from any other split it passes through whole data. Strided shards are
never nested with another split of their dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from enum import StrEnum
from typing import NamedTuple

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.ir.layout import Layout, format_layout
from autopar.ir.plan import CollectiveKind
from autopar.ir.strided import is_split, parts_of, strided

State = int | str  # one axis's placement: the sharded dim, "dxk" (strided), "R", "P" or "M"
States = tuple[State, ...]
Step = tuple[int, "StepKind"]  # (mesh axis index, kind)


class StepKind(StrEnum):
    """One op of a redistribution on one mesh axis (``CostModel.steps``, ``CostModel.edge_steps``).

    Declared in the order :func:`plan_steps` prefers to issue them: slices shrink the data
    first, then collectives from shrinking to growing, then moves into Partial, which are
    free but (Shard -> Partial) regrow the local buffer, so they must not inflate any
    collective. ``grad_all_reduce`` (identity forward, all-reduce backward) is never
    sorted: only ``CostModel.edge_steps`` issues it, before all the others.
    """

    SLICE = "slice"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    TO_PARTIAL = "to_partial"
    GRAD_ALL_REDUCE = "grad_all_reduce"

    def __repr__(self) -> str:  # messages show the plain string
        return repr(self.value)


ISSUE_ORDER = {kind: i for i, kind in enumerate(StepKind)}

# Per forward step kind, the collective its backward issues (None: local or nothing) when the
# gradient reaches it whole, and when as partial sums (see :func:`walk`): the autograd formulas
# of autopar.runtime.collectives. A gradient comes as partial sums only to a step that leaves
# its axis Replicate (all_reduce, all_gather, grad_all_reduce).
BACKWARD: dict[StepKind, tuple[CollectiveKind | None, CollectiveKind | None]] = {
    StepKind.SLICE: (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_GATHER),
    StepKind.REDUCE_SCATTER: (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_GATHER),
    StepKind.ALL_TO_ALL: (CollectiveKind.ALL_TO_ALL, CollectiveKind.ALL_TO_ALL),
    StepKind.ALL_REDUCE: (None, CollectiveKind.ALL_REDUCE),
    StepKind.ALL_GATHER: (None, CollectiveKind.REDUCE_SCATTER),
    StepKind.TO_PARTIAL: (None, None),
    StepKind.GRAD_ALL_REDUCE: (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_REDUCE),
}


@functools.lru_cache(maxsize=1 << 12)
def axis_states(layout: Layout) -> States:
    """Each placement as a plain value: the sharded dim, ``"dxk"`` (strided), ``"R"``, ``"P"`` (a
    sum) or ``"M"`` (a max)."""
    states: list[State] = []
    for p in layout:
        if is_split(p):
            states.append(p.dim if parts_of(p) == 1 else f"{p.dim}x{parts_of(p)}")
        elif isinstance(p, Partial):
            states.append("M" if p.reduce_op == "max" else "P")
        elif isinstance(p, Replicate):
            states.append("R")
        else:
            raise TypeError(f"unsupported placement {p!r}")
    return tuple(states)


def to_layout(states: States) -> Layout:
    """Inverse of :func:`axis_states`."""
    named = {"R": Replicate(), "P": Partial(), "M": Partial("max")}
    return tuple(
        named.get(s) or strided(*map(int, s.split("x"))) if isinstance(s, str) else Shard(s) for s in states
    )


def split_dim(state: State) -> int | None:
    """The tensor dim a state splits (plain or strided), None if it splits none."""
    if isinstance(state, int):
        return state
    return int(state.split("x")[0]) if "x" in state else None


def _strided(state: State) -> bool:
    return isinstance(state, str) and "x" in state


def step_kind(src: State, dst: State) -> StepKind | None:
    """Step kind turning one axis's state ``src`` into ``dst``, None if nothing to do.

    A partial maximum is only ever reduced (``all_reduce``); :func:`plan_steps` reduces it
    first where it is to become anything else.
    """
    if src == dst:
        return None
    if dst == "M":
        raise ValueError("no step makes a partial maximum: nothing consumes one")
    if src == "M":
        return StepKind.ALL_REDUCE
    if dst == "P":
        return StepKind.TO_PARTIAL
    if src == "P":
        return StepKind.REDUCE_SCATTER if split_dim(dst) is not None else StepKind.ALL_REDUCE
    if src == "R":
        return StepKind.SLICE
    return StepKind.ALL_TO_ALL if split_dim(dst) is not None else StepKind.ALL_GATHER


def _through_whole(src: State, dst: State) -> StepKind | None:
    """The step that first makes ``src`` whole on its way to ``dst``, where no one step goes
    (a partial maximum to anything but whole; a strided shard to or from another split)."""
    if src == dst:
        return None
    if src == "M" and dst != "R":
        return StepKind.ALL_REDUCE
    if _strided(src) and dst != "R" or _strided(dst) and split_dim(src) is not None:
        return StepKind.ALL_GATHER
    return None


def _touched(src: State, dst: State) -> set[int]:
    """The tensor dims whose split a step from ``src`` to ``dst`` changes on its axis."""
    return {d for s in (src, dst) if (d := split_dim(s)) is not None}


def plan_steps(src: States, dst: States, order: Callable[[tuple[StepKind, int]], object]) -> tuple[Step, ...]:
    """The steps turning ``src`` into ``dst``, each leaving no inner axis splitting a dim it changes.

    Steps run in the cheapest order, ``order`` being the sort key of ``(kind, axis)``, as
    far as nesting allows: a step waits while an inner axis still splits a dim it changes
    (that axis's own step, leaving the dim, goes first), or while an outer axis has yet to
    change the dim it enters (entering goes outer axis first). When every step waits
    (``RS(0) -> S(0)S(0)``: an unchanged inner split in the way; ``S(0)S(1) -> S(1)S(0)``:
    each waits for the other), the outermost one unwinds the inner splits in its way, an
    ``all_gather`` each, innermost first, and runs; an unwound axis then goes from Replicate
    to its target like any other (a ``slice`` redoes the split). Every step is one of
    :func:`step_kind`'s; all but unwinding all_gathers take their axis to its target.
    """
    current = list(src)
    pending = {
        a: k
        for a, (p, q) in enumerate(zip(src, dst))
        if (k := _through_whole(p, q) or step_kind(p, q)) is not None
    }

    def in_the_way(a: int) -> list[int]:  # inner axes splitting a dim the step on a changes
        dims = _touched(current[a], dst[a])
        return [b for b in range(a + 1, len(current)) if split_dim(current[b]) in dims]

    def waits_for_outer(b: int) -> bool:  # b enters a dim that an outer axis has yet to change
        return any(a < b and split_dim(dst[b]) in _touched(current[a], dst[a]) for a in pending)

    out: list[Step] = []
    while pending:
        ready = [a for a in pending if not in_the_way(a) and not waits_for_outer(a)]
        if ready:
            a = min(ready, key=lambda a: order((pending[a], a)))
        else:
            a = min(pending)  # no pending step is outer to it, so only inner splits stop it
            for b in reversed(in_the_way(a)):
                out.append((b, StepKind.ALL_GATHER))
                current[b] = "R"
                pending.pop(b, None)
                if (kind := step_kind("R", dst[b])) is not None:
                    pending[b] = kind
        out.append((a, pending.pop(a)))
        if _through_whole(current[a], dst[a]):  # whole now, then on like an unwound axis
            current[a] = "R"
            if (kind := step_kind("R", dst[a])) is not None:
                pending[a] = kind
        else:
            current[a] = dst[a]
    return tuple(out)


class Walked(NamedTuple):
    """One step with the states around it (:func:`walk`)."""

    axis: int
    kind: StepKind
    before: States  # the value's, before the step
    after: States  # the value's, after it
    grad: States  # the gradient's where the step's backward receives it


def walk(have: States, need: States, grad_need: States, steps: tuple[Step, ...]) -> tuple[Walked, ...]:
    """Each of ``steps`` (from ``have`` to ``need``) with the states around it.

    A step takes its axis to ``need``'s state, except an all_gather, which may unwind a
    split on the way, and an all_reduce, which may reduce a partial maximum on the way
    (both leave Replicate), and a ``grad_all_reduce``, which keeps it. Backward runs
    the steps' adjoints in reverse from a gradient laid out ``grad_need``; on an axis that a
    later step changes, the gradient reaching a step is laid out as that later step's
    backward leaves it: like the value between the two (Partial read as Replicate, the
    gradient of a sum being whole). So only an axis's last step can receive partial sums.
    """
    walked, current = [], have
    for axis, kind in steps:
        after = list(current)
        if kind != StepKind.GRAD_ALL_REDUCE:
            after[axis] = "R" if kind in (StepKind.ALL_GATHER, StepKind.ALL_REDUCE) else need[axis]
        walked.append((axis, kind, current, tuple(after)))
        current = tuple(after)
    last = {axis: i for i, (axis, _) in enumerate(steps)}

    def grad(i: int, after: States) -> States:
        return tuple(
            ("R" if s == "P" else s) if last.get(b, -1) > i else g
            for b, (s, g) in enumerate(zip(after, grad_need))
        )

    return tuple(Walked(*w, grad(i, w[3])) for i, w in enumerate(walked))


class EdgeStep(NamedTuple):
    """One op of an edge as the lowering issues it (``CostModel.edge_plan``)."""

    axis: int
    kind: StepKind
    before: Layout  # the value's layout before the op
    after: Layout  # and after it
    grad: Placement  # the gradient's placement on ``axis`` where the op's backward receives it


def step_problem(have: Layout, need: Layout, grad_need: Layout, steps: tuple[EdgeStep, ...]) -> str | None:
    """What is wrong with ``steps`` as the ops of an edge from ``have`` to ``need``, None if nothing.

    Each step must be the op its kind is (:func:`walk`'s replay: the layout after it, the gradient's
    placement its backward receives), the change it makes on its axis must be :func:`step_kind`'s,
    and no inner axis may split a dim the step changes at that moment (the nesting rule
    :func:`plan_steps` keeps). Steps read from a plan edited by hand are checked so: a step the
    runtime would lower to the wrong collective or the wrong backward is refused, not run.
    """
    replayed = walk(
        axis_states(have), axis_states(need), axis_states(grad_need), tuple((s.axis, s.kind) for s in steps)
    )
    for i, (step, w) in enumerate(zip(steps, replayed)):
        a, what = step.axis, f"step {i} ({step.kind} on axis {step.axis})"
        if step.kind != StepKind.GRAD_ALL_REDUCE and step_kind(w.before[a], w.after[a]) != step.kind:
            return f"{what} does not turn {_named(w.before[a])} into {_named(w.after[a])}"
        if (to_layout(w.before), to_layout(w.after)) != (tuple(step.before), tuple(step.after)):
            before, after = format_layout(to_layout(w.before)), format_layout(to_layout(w.after))
            return f"{what} leads from {before} to {after}"
        if to_layout(w.grad)[a] != step.grad:
            return f"{what} receives a {_named(w.grad[a])} gradient, not {format_layout((step.grad,))}"
        dims = _touched(w.before[a], w.after[a])
        inner = [b for b in range(a + 1, len(w.before)) if split_dim(w.before[b]) in dims]
        if step.kind != StepKind.GRAD_ALL_REDUCE and inner:
            return f"{what} changes a dim that inner axis {inner[0]} splits"
    return None


def _named(state: State) -> str:
    """One axis's state as layouts are written (``S(0)``, ``R``, ``P``)."""
    return format_layout(to_layout((state,)))
