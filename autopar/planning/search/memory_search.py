"""The memory search: the fastest plan that fits the memory budget, over ZeRO stages and recompute.

:func:`memory_choices` lists the candidates (a ZeRO stage and the modules recomputed);
:func:`memory_search` solves them by the ILP (:mod:`autopar.planning.search.solver`, with the memory
terms of :mod:`autopar.planning.search.memory_tables`), pruning by bounds, and evaluates each
solve (:func:`~autopar.planning.assembly.assemble.evaluate_plan`), whose exact memory decides whether
it fits; :func:`record` writes the report of the plan it returns, once; :func:`no_fit` is the error
naming the least memory reached when none fits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from autopar.capture.export import Captured, repeated_blocks
from autopar.ir.errors import MemoryFitError, PlanError
from autopar.ir.options import FULL, FULL_COMM, SELECTIVE, Memory
from autopar.ir.plan import Plan, SolverReport
from autopar.planning.assembly.assemble import Evaluated, PlanSetting, evaluate_plan, record_plan
from autopar.planning.graph.edge_costs import CostTables, ParameterGathers, parameter_gathers
from autopar.planning.graph.strategy_graph import StrategyGraph
from autopar.planning.memory.model import MemoryChoice
from autopar.planning.pipeline.stage_split import PipelineFitError
from autopar.planning.search.forked import SharedMinimum
from autopar.planning.search.memory_tables import MemoryTerms, summed_pairs
from autopar.planning.search.solver import (
    LaunchFloor,
    SolverClock,
    SolverStats,
    SolverTimeout,
    StrategyILP,
    Window,
)


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
    # a step another plan reaches (the automatic mesh's best so far, which falls while this
    # search runs when other meshes are planned beside it): none slower is wanted
    cutoff: SharedMinimum = field(default_factory=SharedMinimum)
    tried: list[Evaluated] = field(default_factory=list)  # plans that did not fit
    # solves whose split into pipeline stages did not fit, evaluated without a budget if needed
    unevaluated: list[tuple[MemoryChoice, dict[str, int], SolverReport]] = field(default_factory=list)
    # solves without a limit, per choice
    unlimited: dict[tuple, _Solved | _Unfit | None] = field(default_factory=dict)
    # the last solve's strategy per root: the next solve's hint (see StrategyILP._hint)
    last: dict[str, int] = field(default_factory=dict)

    @functools.cached_property
    def gathers(self) -> ParameterGathers:
        """The strategies of the graph that gather a parameter in forward, found the first time a
        solve is checked for them (a frozen dataclass's cached property: set once, here)."""
        return parameter_gathers(self.setting.graph)

    @property
    def cutoff_s(self) -> float:
        """The best step another plan reaches now (inf: none)."""
        return self.cutoff.seconds

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
    factor = _step_factor(search.setting, first)
    _check_cutoff(search, base, factor)  # every choice's objective is at least base
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
        if _hopeless(search, ordered[0][1], _least_choices(choices), ways=len(ordered)):
            return None, True
    best = _fastest_fitting(search, ordered, not pipelined, margin, factor)
    if best is None and pipelined:
        best = _fastest_fitting(search, ordered, True, 0.0, factor)
    if best is None:
        # the plan of least estimated memory (the error's candidate) is a plan too, when it fits:
        # the solves of faster ones may have run out of time, or their estimates missed a stage's
        for choice in _least_choices(choices):
            least = _least_of(search, choice)
            if _fits(search, least.plan):
                return Found(least, None), True
        return None, True
    return Found(best.evaluated, best.ilp), True


def _least_choices(choices: list[MemoryChoice]) -> list[MemoryChoice]:
    """The choices that may hold least: the last (the most ZeRO and recompute) and, where it
    recomputes blocks keeping only their inputs (``full-comm``), the same blocks under ``full``,
    which keeps its collectives' outputs but, where the layouts of least memory gather inside a
    block, may peak lower while it recomputes."""
    last = choices[-1]
    if set(last.recompute.values()) != {FULL_COMM}:
        return [last]
    return [last] + [
        c for c in choices if c.zero == last.zero and c.recompute == dict.fromkeys(last.recompute, FULL)
    ]


def _hopeless(search: Search, likeliest: MemoryChoice, leasts: list[MemoryChoice], ways: int) -> bool:
    """Under a pipeline, whether no choice can fit: neither the fastest plan of the choice
    ``likeliest`` to fit (solved first with a ``ways``-th of the time left, as the search would,
    and kept for it) nor the plan of least estimated memory of any choice in ``leasts``
    (:func:`_least_choices`) fits. Those take a solve and an evaluation each, spent only where the
    first fails."""
    found = _solve_choice(search, likeliest, constrained=False, ways=ways)
    if found is not None and _fits(search, found.plan):
        return False
    return not any(_fits(search, _least_of(search, c).plan) for c in leasts)


def _fastest_fitting(
    search: Search, ordered: list[tuple[float, MemoryChoice]], constrained: bool, margin: float, factor: float
) -> _Solved | None:
    """The fastest plan that fits of the choices in ``ordered`` (``(bound, choice)``, see
    :func:`memory_search`), each solved with the budget in the ILP or not (``constrained``),
    but for those whose bound cannot beat the best objective found; a :class:`PlanError` once a
    choice's bound, as a step (times ``factor``, :func:`_step_factor`), reaches the cutoff
    (another mesh's step, found while this one was searched: the later choices' bounds are higher)."""
    best: _Solved | None = None
    for i, (bound, choice) in enumerate(ordered):
        if best is not None and bound >= best.stats.objective * (1 - _ROUNDING):
            continue
        _check_cutoff(search, bound, factor)
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


def _check_cutoff(search: Search, bound: float, factor: float) -> None:
    """A :class:`PlanError` where an ILP objective of at least ``bound`` is, as a step (``bound``
    times ``factor``, :func:`_step_factor`), no faster than the cutoff (another plan's step)."""
    if bound * factor >= search.cutoff_s:
        raise PlanError(
            f"no plan on mesh {search.setting.mesh} beats {search.cutoff_s * 1e3:.1f} ms, a step another "
            f"plan reaches: the least its ILP's objective can be is {bound * 1e3:.1f} ms, a step of "
            f"{bound * factor * 1e3:.1f} ms where its plans hide as much as its fastest"
        )


def memory_choices(captured: Captured, memory: Memory) -> list[MemoryChoice]:
    """The candidates, the options as given first and least memory last: every ZeRO stage
    (unless ``memory.zero`` fixes one) with the annotated recompute or, when no module is
    annotated ``recompute``, no / selective / full / full-comm recompute of every repeated block
    (full-comm keeps the least: a block's input alone, its collectives run again)."""
    annotated = dict(captured.annotations.recompute)
    zeros = [memory.zero] if memory.zero is not None else [0, 1, 2, 3]
    recomputes: list[Mapping[str, str]] = [annotated]
    blocks = repeated_blocks(captured.graph)
    if not annotated and blocks:
        recomputes += [dict.fromkeys(blocks, p) for p in (SELECTIVE, FULL, FULL_COMM)]
    return [MemoryChoice(zero=z, recompute=r) for r in recomputes for z in zeros]


class Variant(NamedTuple):
    """How a solve departs from the plain ILP of its choice: strategies it leaves out (those that
    gather a parameter in forward) and the launches its step takes at least (the ILP's
    ``(launches)`` term); see :func:`_alternatives`."""

    excluded: ParameterGathers | None = None
    launch_floor: LaunchFloor | None = None
    window: Window | None = None
    most_s: float = math.inf  # the solve's deterministic seconds at most (besides the clock's share)


PLAIN = Variant()  # the ILP of the choice as it is


def _ilp(
    search: Search, choice: MemoryChoice, limit: float | None = None, variant: Variant = PLAIN
) -> StrategyILP:
    """The strategy ILP of ``choice``: the cost tables plus its memory terms, its bytes at most
    ``limit``, as ``variant`` departs from it."""
    node_costs, pair_costs, constant = search.tables[:3]
    extra = search.terms.of(choice)
    costs = {r: c + extra.seconds[r] for r, c in node_costs.items()}
    seconds = constant + extra.seconds_constant
    pairs = summed_pairs(pair_costs, extra.seconds_pairs)
    return StrategyILP(
        costs,
        pairs,
        seconds,
        extra.rows(),
        limit,
        dict(search.last),
        variant.excluded,
        variant.launch_floor,
        variant.window,
    )


def _solve_choice(
    search: Search, choice: MemoryChoice, constrained: bool, ways: int = 1, margin: float = 0.0
) -> _Solved | None:
    """The fastest plan under ``choice`` that fits the budget (with its ILP's report and
    assignment), or None.

    ``constrained`` puts the budget less ``margin`` into the ILP (without the margin again
    when that has no solution); each solve takes a ``ways``-th of the solver time left (the
    candidates still to solve share it). Its memory estimate is per node (see
    :mod:`autopar.planning.search.memory_tables`; under a pipeline, the share of the rank holding most);
    the plan's figure is exact (:mod:`autopar.planning.memory.model`, the largest pipeline rank's
    under a pipeline, or the least a split into stages reaches where none fits). Where it exceeds the
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


def _step_factor(setting: PlanSetting, solved: _Solved | None) -> float:
    """What turns an ILP objective into the least step it can take: the objective prices one
    microbatch of every stage, so a step of ``m`` microbatches over ``p`` pipeline ranks takes at
    least ``m / p`` of it on its busiest rank (``m`` accumulated without a pipeline, ``p`` 1), less
    what it hides: the evaluated plan of ``solved`` gives its step over its objective, at most
    ``m / p``, below where the step hides communication or launches behind compute, which the
    objective counts in full (docs/automatic_mesh.md: by how much on Llama-3-8B). A cutoff
    compared with the objective alone could drop a mesh whose step would have won, or, under a
    pipeline, never drop one."""
    pipeline = setting.pipeline
    scale = setting.accumulation if pipeline is None else pipeline.microbatches / pipeline.size(setting.mesh)
    if solved is None or solved.stats.objective <= 0:
        return scale
    return min(scale, solved.plan.step_time_s / solved.stats.objective)


def _fits(search: Search, plan: Plan) -> bool:
    """Whether ``plan``'s exact bytes per device (under a pipeline, its largest rank's: every stage
    the rank runs) fit the budget."""
    return plan.peak_memory_bytes <= search.setting.budget


def _peak(solved: _Solved | _Unfit) -> float:
    """The bytes per device of a solve: its plan's, or what its least split into stages holds."""
    return solved.plan.peak_memory_bytes if isinstance(solved, _Solved) else solved.peak


def _solve_within(
    search: Search,
    choice: MemoryChoice,
    limit: float | None,
    ways: int,
    variant: Variant | None = None,
) -> _Solved | _Unfit | None:
    """One solve of ``choice``'s ILP with its bytes at most ``limit``, evaluated (not recorded);
    None when the ILP has no solution, :class:`_Unfit` when no split into pipeline stages fits.
    A plan that does not fit the budget is kept for the error, a stage split that did not
    fit as its solve (evaluated by :func:`no_fit` only if nothing fits). Without a ``variant``
    the plan is weighed against those of :func:`_alternatives`."""
    setting = search.setting
    ilp = _ilp(search, choice, limit, variant or PLAIN)
    clock = search.clock
    try:
        time_limit = min(clock.share(ways), (variant or PLAIN).most_s)
        solved = ilp.solve(time_limit=time_limit, seed=search.seed, wall_limit=clock.wall_share(ways))
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
    solved = _Solved(result, stats, ilp)
    return solved if variant is not None else _alternatives(search, choice, limit, ways, solved)


def _alternatives(
    search: Search, choice: MemoryChoice, limit: float | None, ways: int, free: _Solved
) -> _Solved:
    """``free``, or the plan of the same choice solved as the step runs where the ILP's objective
    departs from the step, if that plan fits wherever ``free`` does and takes a shorter assembled
    step. The objective counts in full what the step hides, so its optimum may be slower:

    * on an asynchronous device whose launches hide a part of the step's compute (a small model on
      GPUs), the plan is solved again with the step's launches as a floor (the ILP's ``(launches)``
      term, the launches taken as the free plan's overhead per microbatch): splitting compute that
      launches hide gains nothing and pays collectives;
    * where the plan gathers a parameter in forward (FSDP-style storage), it is solved again
      without such gathers: gathers in forward are never hidden, while the gradient sums of a
      parameter stored as used overlap backward (Megatron-LM's Table 1, 1.7B row: 2.23 s against
      data parallelism's 1.86 before);
    * where the step hides a share ``h`` of itself behind compute (communication), it is solved
      again for the plan communicating least among those whose objective is within ``1 + h`` of
      the free plan's (the ILP's ``(within)`` term), in at most twice the solver's time the free
      solve took: plans that close rank either way in the step, and the one moving fewest bytes
      waits least.

    The free solve's statistics are kept: its bound holds for every variant. No variant is solved
    under a memory ``limit`` or for a free plan over the budget (then searched under it: plans the
    budget shapes, each variant a solve of seconds on a large model that seldom fits), nor where the
    free plan's step, less all it hides, already reaches the best step another mesh took
    (``search.cutoff_s``): a variant re-ranks plans the step tells apart by what it hides."""
    best = free
    prediction, cluster = free.plan.prediction, search.setting.cluster
    hidden = prediction.hidden_comm_s + prediction.hidden_launch_s
    if (
        limit is not None
        or not _fits(search, free.plan)
        or prediction.step_time_s - hidden >= search.cutoff_s
    ):
        return free
    if cluster.asynchronous and search.setting.pipeline is None and prediction.hidden_launch_s > 0:
        node_costs, compute_constant = search.tables.compute, search.tables.compute_constant
        # the ILP prices one microbatch of those a step accumulates
        floor = LaunchFloor(node_costs, compute_constant, prediction.overhead_s / search.setting.accumulation)
        best = _faster(search, best, _solve_within(search, choice, limit, ways, Variant(launch_floor=floor)))
    if search.gathers.at(best.assignment):
        variant = Variant(excluded=search.gathers)
        best = _faster(search, best, _solve_within(search, choice, limit, ways, variant))
    if prediction.comm_s > 0 and prediction.hidden_comm_s > 0:
        within = free.stats.objective * (1 + prediction.hidden_comm_s / free.plan.step_time_s)
        window = Window(search.tables.compute, within)
        # a refinement of the free plan: at most twice the solver's time that plan took
        variant = Variant(window=window, most_s=2 * free.stats.deterministic_seconds)
        best = _faster(search, best, _solve_within(search, choice, limit, ways, variant))
    return best if best is free else _Solved(best.evaluated, free.stats, best.ilp)


def _faster(search: Search, best: _Solved, other: _Solved | _Unfit | None) -> _Solved:
    """``other`` where it is a plan that fits wherever ``best`` does and takes a shorter step."""
    if not isinstance(other, _Solved) or _fits(search, other.plan) < _fits(search, best.plan):
        return best
    return other if other.plan.step_time_s < best.plan.step_time_s else best


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
    try:
        assignment, _ = ilp.minimum_memory(seed=search.seed, **limits)
    except PlanError as e:  # the time was spent before it found one: said so, with its bound
        raise _unsolved(search, choice) from e
    clock.spend(ilp)
    report = _report(search.setting.graph, None)
    try:
        least = evaluate_plan(search.setting, choice, assignment, report)
    except PipelineFitError:
        least = evaluate_plan(replace(search.setting, budget=None), choice, assignment, report)
    search.tried.append(least)
    return least


def _unsolved(search: Search, choice: MemoryChoice) -> PlanError:
    """The error where ``time_limit`` was spent before the plan of least memory of ``choice`` was
    solved: what the ILP's estimate of it is at least (:meth:`MemoryTerms.least_bytes`), not a
    solver's "no plan within 0 s". Not a :class:`MemoryFitError`: a plan may fit, none was found."""
    least = search.terms.least_bytes(choice)
    return PlanError(
        f"no plan fitting memory_budget={search.setting.budget / 2**30:.2f} GiB per device on mesh "
        f"{search.setting.mesh} was found: time_limit was spent before the plan of least memory "
        f"(ZeRO-{choice.zero}) was solved, whose estimate is at least {least / 2**30:.2f} GiB; "
        "raise time_limit"
    )


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
    them is reported, under a pipeline with the parts of the pipeline rank holding the most
    (its stages' summed, activations at the rank's peak).
    """
    mesh, budget = search.setting.mesh, search.setting.budget
    spent = search.clock.share() <= 0 or bool(search.timed_out)
    unbounded = replace(search.setting, budget=None)
    search.tried.extend(evaluate_plan(unbounded, c, a, r) for c, a, r in search.unevaluated)
    try:
        for choice in _least_choices(choices):
            _least_of(search, choice)
    except PlanError:  # its solve found nothing in the time left: the closest tried is the answer
        if not search.tried:
            raise
    closest = min(search.tried, key=lambda t: t.plan.peak_memory_bytes)
    least, choice = closest.plan, closest.choice
    where = ""
    if least.pipeline is not None:  # its prediction's bytes are that rank's (Prediction)
        rank = least.pipeline.largest_rank
        stages = ", ".join(str(s.index) for s in least.pipeline.rank_stages(rank))
        where = f" on pipeline rank {rank}, as the rank holds it (stages {stages})"
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
        f"memory{' per rank' if where else ''} reached is {least.peak_memory_bytes / 2**30:.2f} GiB{where} "
        f"({how}; {breakdown}), "
        f"dominated by {top}; use more devices, a smaller batch, or offload"
        + ("; time_limit ran out before every candidate was solved: raise it" if spent else ""),
        least.peak_memory_bytes,
    )
