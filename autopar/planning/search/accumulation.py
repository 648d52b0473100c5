"""Gradient accumulation without a pipeline: how many microbatches a step runs, and their inputs.

A step of ``m`` accumulated microbatches runs forward and backward on each microbatch (dim 0 of
every tensor input cut into ``m`` equal pieces) with the gradients left in the leaves, then sums
the gradients once and steps the optimizer once. The plan is made for one microbatch's shapes,
its gradient sums weighted ``1/m`` in the ILP (which is per microbatch) and the step predicted as
``m`` microbatches plus one sum and one update (:func:`~autopar.planning.cost.step_overheads.whole_step`).

:func:`accumulated` chooses ``m`` where ``PlanOptions.accumulation`` is None: the plan of the
whole batch (``m = 1``) when its fastest memory choice fits, at no cost beyond it; otherwise the
counts dividing the batch, fewest first, each planned with its memory search, until one fits
without searching; the fastest that fits wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import torch
from torch.utils import _pytree as pytree

from autopar.ir.errors import AnnotationError, MemoryFitError, OptionError, PlanError
from autopar.ir.options import PlanOptions
from autopar.planning.pipeline.stage_plan import microbatch


class Outcome(Protocol):
    """What :func:`accumulated` compares plans by (``autopar.planning.planner.Planned``)."""

    step_time_s: float
    searched: bool  # the fastest memory choice did not fit: the memory search chose another


P = TypeVar("P", bound=Outcome)


def batch_of(args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """The largest count every tensor input's dim 0 divides (their gcd), None without such an input
    (keyword inputs that are not a mapping are capture's to refuse, with its words)."""
    keywords = dict(kwargs) if isinstance(kwargs, Mapping) else {}
    sizes = [
        int(t.shape[0])
        for t in pytree.tree_leaves((args, keywords))
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    return math.gcd(*sizes) if sizes else None


def counts(batch: int) -> list[int]:
    """The microbatch counts a batch of ``batch`` can be cut into: its divisors, fewest first."""
    return [m for m in range(1, batch + 1) if batch % m == 0]


def first_microbatch(args: tuple, kwargs: Mapping[str, Any], accumulation: int) -> tuple[tuple, dict]:
    """The first of ``accumulation`` microbatches of the inputs: what a plan accumulating them is
    captured on.

    Raises:
        OptionError: a tensor input's dim 0 is not a multiple of ``accumulation``, naming the input,
            its dim 0 and the counts that divide every input's.
    """
    if accumulation == 1:
        return args, dict(kwargs)
    try:
        return microbatch(args, kwargs, accumulation)
    except PlanError as e:
        batch = batch_of(args, kwargs)
        divides = ", ".join(map(str, counts(batch))) if batch else "none: an input has no dim 0"
        raise OptionError(
            f"accumulation={accumulation}: {e}; the counts that divide every input's dim 0: {divides}"
        ) from None


def accumulated(plan_with: Callable[[PlanOptions], P], batch: int | None, options: PlanOptions) -> P:
    """The plan of ``plan_with``, with the microbatches a step accumulates chosen where
    ``options.accumulation`` is None.

    ``plan_with(o)`` captures and plans under ``o`` (``o.accumulation`` the count, None for 1). A
    count given, or a pipeline (whose microbatches accumulate), plans once. Otherwise the whole
    batch is planned first, and returned when its fastest memory choice fits; else each count that
    divides ``batch`` (fewest first) is planned with its memory search until one fits with its
    fastest memory choice (more microbatches would only add their per-microbatch costs) or the
    annotations cannot split its microbatch (an ``AnnotationError``: a batch dim pinned over more
    ranks than it has rows), and the fastest plan that fits wins (the fewest microbatches of
    equal ones).

    Args:
        plan_with: captures the model for ``o.accumulation`` microbatches and plans it.
        batch: what every tensor input's dim 0 is a multiple of (:func:`batch_of`), None: nothing to cut.
        options: the options to plan under.

    Raises:
        MemoryFitError: no count fits the budget: the error of the most microbatches planned (of
            the count given, where one is), naming the count.
    """
    if options.pipeline is not None or options.update is not None or options.accumulation == 1:
        return plan_with(options)
    if options.accumulation is not None:
        try:
            return plan_with(options)
        except MemoryFitError as e:
            said = f"accumulating {options.accumulation} microbatches per step: {e}"
            raise MemoryFitError(said, e.least_bytes) from None
    best, error = None, None
    for m in counts(batch or 1):
        try:
            planned = plan_with(options if m == 1 else replace(options, accumulation=m))
        except MemoryFitError as e:
            said = f"accumulating {m} microbatches per step, the most tried: {e}"
            error = MemoryFitError(said, e.least_bytes)
            continue
        except AnnotationError:
            if m == 1:
                raise
            break  # the annotations cannot split a microbatch this small, nor any smaller one
        if best is None or planned.step_time_s < best.step_time_s:
            best = planned
        if not planned.searched:
            break
    if best is None:
        raise error
    return best
