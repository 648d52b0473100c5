"""The memory search: the fastest plan that fits the memory budget, over ZeRO stages and recompute.

:func:`memory_choices` lists the candidates (a ZeRO stage and the modules recomputed);
:func:`memory_search` solves them by the ILP (:mod:`autopar.planning.search.solver`, with the memory
terms of :mod:`autopar.planning.search.memory_tables`), pruning by bounds, and evaluates each
solve (:func:`~autopar.planning.assembly.assemble.evaluate_plan`), whose exact memory decides whether
it fits; :func:`record` writes the report of the plan it returns, once; :func:`no_fit` is the error
naming the least memory reached when none fits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from autopar.capture.export import Captured, repeated_blocks
from autopar.ir.errors import MemoryFitError, PlanError
from autopar.ir.options import FULL, SELECTIVE, Memory
from autopar.ir.plan import Plan, SolverReport
from autopar.planning.assembly.assemble import Evaluated, PlanSetting, evaluate_plan, record_plan
from autopar.planning.graph.edge_costs import CostTables
from autopar.planning.graph.strategy_graph import StrategyGraph
from autopar.planning.memory.model import MemoryChoice
from autopar.planning.pipeline.stage_split import PipelineFitError
from autopar.planning.search.memory_tables import MemoryTerms, summed_pairs
from autopar.planning.search.solver import SolverClock, SolverStats, SolverTimeout, StrategyILP


class Found(NamedTuple):
    """The plan a memory search returns, evaluated, and the ILP solved for it: its costs price the
    alternatives the plan's report lists (None for a plan of least memory, whose report lists none)."""

    evaluated: Evaluated
    ilp: StrategyILP | None


class _Solved(NamedTuple):
    evaluated: Evaluated
    stats: SolverStats
    ilp: StrategyILP

    @property
    def plan(self) -> Plan:
        """The plan evaluated, without its report."""
        return self.evaluated.plan

    @property
    def assignment(self) -> Mapping[str, int]:
        """The strategy per root the solve picked."""
        return self.evaluated.assignment


class _Unfit(NamedTuple):
    """A solve no split into pipeline stages fits the budget with: the least a rank holds under
    the split holding least (``peak``)."""

    assignment: dict[str, int]
    peak: float


@dataclass(frozen=True, kw_only=True)
class Search:
    """What every candidate of the memory search is solved and evaluated with: the setting
    (whose ``budget`` is the bytes per device a plan must fit), the ILP's cost tables and
    each candidate's memory terms, the solver's time left (``time_limit`` shared by every
    solve) and its seed."""

    setting: PlanSetting
    tables: CostTables
    terms: MemoryTerms
    clock: SolverClock
    seed: int
    # a step another plan reaches (the automatic mesh's best so far): none slower is wanted
    cutoff_s: float = math.inf
    tried: list[Evaluated] = field(default_factory=list)  # plans that did not fit
    # solves whose split into pipeline stages did not fit, evaluated without a budget if needed
    unevaluated: list[tuple[MemoryChoice, dict[str, int], SolverReport]] = field(default_factory=list)
    # solves without a limit, per choice
    unlimited: dict[tuple, _Solved | _Unfit | None] = field(default_factory=dict)
    # the last solve's strategy per root: the next solve's hint (see StrategyILP._hint)
    last: dict[str, int] = field(default_factory=dict)
    # choices a solve of which under a limit found no plan in its share of the time
    timed_out: list[MemoryChoice] = field(default_factory=list)


# CP-SAT works in integer units: objectives and bounds agree to about this fraction
_ROUNDING = 1e-6


def memory_search(search: Search, choices: list[MemoryChoice]) -> tuple[Found | None, bool]:
    """The fastest plan that fits among ``choices``, and whether the budget had to be searched.

    The first choice solved without the memory constraint is the fastest plan of all: if it
    fits, it wins. Otherwise each choice is solved with the constraint, but only while it
    could still win. The ILP's objective adds each choice's seconds (ZeRO's gathers,
    recompute's forward) to the base costs every choice shares, so a choice can do no
    better than a lower bound of the base optimum (the first solve's bound less the most
    its choice adds) plus the least its own terms add; a choice whose bound is not below
    the best objective found is skipped, as is one whose fewest bytes exceed the budget
    (the constrained ILP would have no solution). Choices are solved by their bound; at equal bounds
    the one adding the fewest seconds to the first solve's layouts first, then the one they fill
    least; of plans equally fast the one solved first wins. Under a pipeline (whose estimate is
    a guess at the stages', see :func:`~autopar.planning.search.memory_tables.stage_shares`) each
    choice's fastest plan is tried first, least estimated memory first, then the ILP bounding the
    estimate. When nothing faster is found, the plan of least estimated memory is the plan if it fits.
    """
    first = _solve_choice(search, choices[0], constrained=False)
    if first is not None and _fits(search, first.plan):
        return Found(first.evaluated, first.ilp), False
    # no bound when no split into pipeline stages fitted the budget
    base = -math.inf if first is None else first.stats.bound - search.terms.most_seconds(choices[0])
    least_step = base * _hidden_share(first)  # every choice's objective is at least base
    if least_step >= search.cutoff_s:
        raise PlanError(
            f"no plan on mesh {search.setting.mesh} beats {search.cutoff_s * 1e3:.1f} ms, a step another "
            f"plan reaches: the least its ILP's objective can be is {base * 1e3:.1f} ms, a step of "
            f"{least_step * 1e3:.1f} ms where its plans hide as much as its fastest"
        )
    # under a pipeline the ILP's estimate is the share of a rank with stages about equal, which a
    # split balancing memory can beat: no choice is skipped by it
    pipelined = search.setting.pipeline is not None
    left = [c for c in choices if pipelined or search.terms.least_bytes(c) <= search.setting.budget]
    # what the ILP's estimate leaves out of the fastest plan's exact figure (values alive only
    # for a while in the forward): a constrained solve first leaves that much of the budget free
    margin = (
        0.0
        if first is None
        else first.plan.peak_memory_bytes - search.terms.bytes_at(choices[0], first.assignment)
    )

    def order(c: MemoryChoice) -> tuple[float, float, float]:
        # by bound; at equal bounds the one adding least to the fastest layouts first (the
        # likeliest to be best, its objective pruning the rest), then the one they fill least
        if first is None:
            return base + search.terms.least_seconds(c), 0.0, 0.0
        added = search.terms.seconds_at(c, first.assignment)
        return base + search.terms.least_seconds(c), added, search.terms.bytes_at(c, first.assignment)

    ordered = [(order(c)[0], c) for c in sorted(left, key=order)]
    if pipelined:
        # each choice's fastest plan first (the estimate is a guess at the stages'), those of the
        # least estimated memory at the first solve's layouts first: the likeliest to fit, whose
        # objectives then skip the choices they beat; when none fits, the ILP bounding the estimate
        solved = search.unlimited[choices[0].key]
        if solved is not None:
            ordered.sort(key=lambda t: search.terms.bytes_at(t[1], solved.assignment))
        if _hopeless(search, ordered[0][1], choices[-1], ways=len(ordered)):
            return None, True
    best = _fastest_fitting(search, ordered, not pipelined, margin)
    if best is None and pipelined:
        best = _fastest_fitting(search, ordered, True, 0.0)
    if best is None:
        # the plan of least estimated memory (the error's candidate) is a plan too, when it fits:
        # the solves of faster ones may have run out of time, or their estimates missed a stage's
        least = _least_of(search, choices[-1])
        return (Found(least, None) if _fits(search, least.plan) else None), True
    return Found(best.evaluated, best.ilp), True


def _hopeless(search: Search, likeliest: MemoryChoice, least: MemoryChoice, ways: int) -> bool:
    """Under a pipeline, whether no choice can fit: neither the fastest plan of the choice
    ``likeliest`` to fit (solved first with a ``ways``-th of the time left, as the search would,
    and kept for it) nor the plan of least estimated memory of the choice holding ``least`` (the
    most ZeRO and recompute) fits. The second takes a solve and an evaluation of its own, spent
    only where the first fails."""
    found = _solve_choice(search, likeliest, constrained=False, ways=ways)
    if found is not None and _fits(search, found.plan):
        return False
    return not _fits(search, _least_of(search, least).plan)


def _fastest_fitting(
    search: Search, ordered: list[tuple[float, MemoryChoice]], constrained: bool, margin: float
) -> _Solved | None:
    """The fastest plan that fits of the choices in ``ordered`` (``(bound, choice)``, see
    :func:`memory_search`), each solved with the budget in the ILP or not (``constrained``),
    but for those whose bound cannot beat the best objective found."""
    best: _Solved | None = None
    for i, (bound, choice) in enumerate(ordered):
        if best is not None and bound >= best.stats.objective * (1 - _ROUNDING):
            continue
        if search.clock.share() <= 0:
            break  # time_limit spent: the error names it (no_fit)
        # shares as if every choice were solved: what a skipped one leaves goes to the later ones,
        # and a solve whose plan overflows the budget can be solved again (see _solve_choice)
        found = _solve_choice(search, choice, constrained, ways=len(ordered) - i, margin=max(0.0, margin))
        if found is None or not _fits(search, found.plan):
            continue
        if best is None or found.plan.step_time_s < best.plan.step_time_s:
            best = found
    return best


def memory_choices(captured: Captured, memory: Memory) -> list[MemoryChoice]:
    """The candidates, the options as given first and least memory last: every ZeRO stage
    (unless ``memory.zero`` fixes one) with the annotated recompute or, when no module is
    annotated ``recompute``, no / selective / full recompute of every repeated block."""
    annotated = dict(captured.annotations.recompute)
    zeros = [memory.zero] if memory.zero is not None else [0, 1, 2, 3]
    recomputes: list[Mapping[str, str]] = [annotated]
    blocks = repeated_blocks(captured.graph)
    if not annotated and blocks:
        recomputes += [dict.fromkeys(blocks, SELECTIVE), dict.fromkeys(blocks, FULL)]
    return [MemoryChoice(zero=z, recompute=r) for r in recomputes for z in zeros]


def _ilp(search: Search, choice: MemoryChoice, limit: float | None = None) -> StrategyILP:
    """The strategy ILP of ``choice``: the cost tables plus its memory terms, its bytes at most ``limit``."""
    node_costs, pair_costs, constant = search.tables
    extra = search.terms.of(choice)
    costs = {r: c + extra.seconds[r] for r, c in node_costs.items()}
    seconds = constant + extra.seconds_constant
    pairs = summed_pairs(pair_costs, extra.seconds_pairs)
    return StrategyILP(costs, pairs, seconds, extra.rows(), limit, hint=dict(search.last))


def _solve_choice(
    search: Search, choice: MemoryChoice, constrained: bool, ways: int = 1, margin: float = 0.0
) -> _Solved | None:
    """The fastest plan under ``choice`` that fits the budget (with its ILP's report and
    assignment), or None.

    ``constrained`` puts the budget less ``margin`` into the ILP (without the margin again
    when that has no solution); each solve takes a ``ways``-th of the solver time left (the
    candidates still to solve share it). Its memory estimate is per node (see
    :mod:`autopar.planning.search.memory_tables`; under a pipeline, the share of the rank holding most);
    the plan's figure is exact (:mod:`autopar.planning.memory.model`, the largest stage's under a
    pipeline, or the least a split into stages reaches where none fits). Where it exceeds the
    budget, the ILP is solved again with its limit the plan's estimate less the difference (twice
    at most, and only while the exact figure keeps falling). With no limit, ``constrained`` only
    says that a plan that does not fit is None.
    """
    budget = search.setting.budget
    if not constrained:
        key = choice.key
        if key not in search.unlimited:
            search.unlimited[key] = _solve_within(search, choice, None, ways)
        solved = search.unlimited[key]
        return solved if isinstance(solved, _Solved) else None
    limit, least = budget - margin, math.inf  # least: the least exact memory of this choice's solves so far
    for _ in range(3):
        if search.clock.share(ways) <= 0:
            return None
        solved = _solve_within(search, choice, limit, ways)
        if solved is None and limit < budget and least == math.inf:
            limit = budget  # the margin left no solution: the budget itself may
            continue
        if solved is None:
            return None
        if isinstance(solved, _Solved) and _fits(search, solved.plan):
            return solved
        peak = _peak(solved)
        if peak >= least:  # a lower limit did not lower the exact figure: another will not either
            return None
        # lowered from the plan's own estimate, which may sit below the limit: from the limit the
        # ILP could return the same plan
        estimate = search.terms.bytes_at(choice, solved.assignment)
        least, limit = peak, min(limit, estimate) - (peak - budget)
    return None


def _hidden_share(solved: _Solved | None) -> float:
    """What of the ILP's objective the evaluated plan of ``solved`` takes as its step, at most 1:
    below 1 where the step hides communication or launches behind compute, which the objective
    counts in full (docs/automatic_mesh.md: by how much on Llama-3-8B). A cutoff
    compared with the objective alone could drop a mesh whose step would have won."""
    if solved is None or solved.stats.objective <= 0:
        return 1.0
    return min(1.0, solved.plan.step_time_s / solved.stats.objective)


def _fits(search: Search, plan: Plan) -> bool:
    """Whether ``plan``'s exact bytes per device (its largest stage's under a pipeline) fit the budget."""
    return plan.peak_memory_bytes <= search.setting.budget


def _peak(solved: _Solved | _Unfit) -> float:
    """The bytes per device of a solve: its plan's, or what its least split into stages holds."""
    return solved.plan.peak_memory_bytes if isinstance(solved, _Solved) else solved.peak


def _solve_within(
    search: Search, choice: MemoryChoice, limit: float | None, ways: int
) -> _Solved | _Unfit | None:
    """One solve of ``choice``'s ILP with its bytes at most ``limit``, evaluated (not recorded);
    None when the ILP has no solution, :class:`_Unfit` when no split into pipeline stages fits.
    A plan that does not fit the budget is kept for the error, a stage split that did not
    fit as its solve (evaluated by :func:`no_fit` only if nothing fits)."""
    setting = search.setting
    ilp = _ilp(search, choice, limit)
    clock = search.clock
    try:
        solved = ilp.solve(time_limit=clock.share(ways), seed=search.seed, wall_limit=clock.wall_share(ways))
    except SolverTimeout:
        # its share of the time ran out: a candidate solved before may still fit (no_fit says so otherwise)
        search.timed_out.append(choice)
        solved = None
    clock.spend(ilp)
    if solved is None:
        return None
    assignment, stats = solved
    search.last.clear()
    search.last.update(assignment)
    report = _report(setting.graph, stats)
    try:
        result = evaluate_plan(setting, choice, assignment, report)
    except PipelineFitError as error:
        search.unevaluated.append((choice, assignment, report))
        return _Unfit(assignment, error.least_bytes)
    if not _fits(search, result.plan):
        search.tried.append(result)
    return _Solved(result, stats, ilp)


def _report(g: StrategyGraph, stats: SolverStats | None) -> SolverReport:
    """The report of one solve of ``g``'s ILP; with no ``stats``, of the least-memory solve
    (capture time is the planner's to add)."""
    return SolverReport(
        variables=stats.variables if stats else 0,
        constraints=stats.constraints if stats else 0,
        roots=len(g.roots),
        tied_blocks=g.tied_blocks,
        capture_s=0.0,
        build_s=stats.build_seconds if stats else 0.0,
        solve_s=stats.solve_seconds if stats else 0.0,
        gap=stats.gap if stats else 0.0,
        status=stats.status if stats else "MIN_MEMORY",
    )


def _least_of(search: Search, choice: MemoryChoice) -> Evaluated:
    """:func:`_least_memory` of ``choice``, solved once per search."""
    for tried in search.tried:
        if tried.choice is choice and tried.plan.solver.status == "MIN_MEMORY":
            return tried
    return _least_memory(search, choice)


def _least_memory(search: Search, choice: MemoryChoice) -> Evaluated:
    """The plan of ``choice`` minimising the ILP's memory estimate (recorded as tried), split into
    pipeline stages within the budget where a split fits."""
    ilp = _ilp(search, choice)
    clock = search.clock
    limits = {"time_limit": clock.share(), "wall_limit": clock.wall_share()}
    assignment, _ = ilp.minimum_memory(seed=search.seed, **limits)
    clock.spend(ilp)
    report = _report(search.setting.graph, None)
    try:
        least = evaluate_plan(search.setting, choice, assignment, report)
    except PipelineFitError:
        least = evaluate_plan(replace(search.setting, budget=None), choice, assignment, report)
    search.tried.append(least)
    return least


def record(search: Search, found: Found) -> Plan:
    """The plan ``found`` with its report (:func:`~autopar.planning.assembly.assemble.record_plan`):
    written once, for the plan the search returns.

    Args:
        search: the memory search that found it.
        found: what :func:`memory_search` returned.
    """
    costs = None if found.ilp is None else (found.ilp.node_costs, found.ilp.pair_costs)
    return record_plan(search.setting, found.evaluated, costs)


def no_fit(search: Search, choices: list[MemoryChoice]) -> MemoryFitError:
    """The error when no plan fits: the least memory reached and what dominates it.

    Candidates: the plans the search evaluated that did not fit, and the last (least
    memory) choice's plan minimising the ILP's memory estimate; the least exact figure among
    them is reported, under a pipeline with the parts of the stage holding the most.
    """
    mesh, budget = search.setting.mesh, search.setting.budget
    spent = search.clock.share() <= 0 or bool(search.timed_out)
    unbounded = replace(search.setting, budget=None)
    search.tried.extend(evaluate_plan(unbounded, c, a, r) for c, a, r in search.unevaluated)
    _least_of(search, choices[-1])
    closest = min(search.tried, key=lambda t: t.plan.peak_memory_bytes)
    least, choice = closest.plan, closest.choice
    where = ""
    if least.pipeline is not None:
        stage = max(least.pipeline.stages, key=lambda s: s.memory_bytes)
        where = f" on pipeline stage {stage.index}"
        held = (stage.param_bytes, stage.grad_bytes, stage.optimizer_bytes, stage.peak_activation_bytes)
    else:
        p = least.prediction
        held = (p.param_bytes, p.grad_bytes, p.optimizer_bytes, p.activation_bytes)
    parts = dict(zip(("parameters", "gradients", "optimizer state", "activations"), held))
    top = max(parts, key=parts.get)
    how = f"ZeRO-{choice.zero}" + (
        f", recompute of {len(choice.recompute)} modules ({next(iter(choice.recompute.values()))})"
        if choice.recompute
        else ""
    )
    breakdown = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items())
    return MemoryFitError(
        f"no plan fits memory_budget={budget / 2**30:.2f} GiB per device on mesh {mesh}: the least "
        f"memory reached is {least.peak_memory_bytes / 2**30:.2f} GiB{where} ({how}; {breakdown}), "
        f"dominated by {top}; use more devices, a smaller batch, or offload"
        + ("; time_limit ran out before every candidate was solved: raise it" if spent else ""),
        least.peak_memory_bytes,
    )
