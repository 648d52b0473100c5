r"""The strategy ILP, solved with OR-Tools CP-SAT.

The planner reduces the graph to variables (roots) ``r``, each with ``k_r``
strategies, a cost vector ``c_r`` (compute of every node sharing the variable, plus
redistributions between nodes that share it), and a cost matrix ``R_{uv}`` for every
pair of variables joined by an edge (redistribution forward and backward). Costs are
seconds, scaled to integer nanoseconds for CP-SAT (or coarser units when the
worst-case total would not fit in 52 bits).

Variables
    s_{r,i} \in \{0,1\}          root r takes strategy i
    e_{uv,ij} \in \{0,1\}        edge (u,v) pays entry R'_{uv,ij}  (only where R'_{uv,ij} > 0)

Objective
    min  \sum_r \sum_i (c'_{r,i} + i \epsilon) s_{r,i}  +  \sum_{(u,v)} \sum_{i,j} R'_{uv,ij} e_{uv,ij}

``\epsilon`` is one unit of the integer objective (a nanosecond, or the coarser unit): of
strategies priced alike the first listed wins, so the choice among equal plans (the q, k and
v projections of attention, say) is consistent and does not hang on the search's path. The
terms the ILP leaves out can tell such plans apart by a few percent: a parameter's layouts
list replicated before split, and a gradient sum of a replicated weight overlaps backward
where the gather of a split one does not (preferring the split, least-memory, layouts instead
made the automatic mesh's Llama-3-8B plan slower: docs/benchmarks_history.md, "the solver's
settings").

Constraints
    (one-hot)        \sum_i s_{r,i} = 1                                 for every r
    (edge)           e_{uv,ij} \ge s_{u,i} + s_{v,j} - 1        for every R'_{uv,ij} > 0 or M'_{uv,ij} > 0
    (memory)         m_0 + \sum_r \sum_i m_{r,i} s_{r,i}
                         + \sum_{(u,v)} \sum_{i,j} M'_{uv,ij} e_{uv,ij} \le B   when a budget B is given
    (launches)       y \ge L - C_0 - \sum_r \sum_i C_{r,i} s_{r,i},   y \ge 0            with a launch floor L
    (excluded)       s_{r,i} = 0                             for every i \in X_r
                     s_{u,i} + s_{v,j} \le 1                 for every (i, j) \in X_{uv}
    (within)         objective \le W,   then   min  objective - \sum_r \sum_i C_{r,i} s_{r,i}
                                                             with a window W (the step's resolution)

On an asynchronous device (a GPU) the host launches ops while the device computes, so a step
takes the longer of its launches ``L`` and its compute ``C`` (``C_{r,i}`` of the objective's costs,
``C_0`` of its constant) besides what neither hides: with a launch floor the objective adds ``y``,
what the launches take beyond the compute, and of two plans the one that computes less for no
gain under launches no longer wins (a small model on eight GPUs: splitting its products is free
of launches but pays collectives).

``X`` are strategies and pairs a solve leaves out: the memory search solves again without those
that gather a parameter in forward (FSDP-style storage, ``graph.edge_costs.ParameterGathers``), whose
gathers the step cannot hide while the gradient sums of parameters stored as used overlap
backward, which this objective counts in full; the faster plan of the two by its assembled step wins.

With a window ``W`` (:class:`Window`) the solve looks among the plans whose objective is at most
``W`` for the one that communicates least (the objective less its compute ``C``): two plans whose
objectives differ by less than what the step hides of them can rank either way in the step, and of
such near-equal plans the one moving fewer bytes hides least and waits least (Megatron-LM's Table 1,
39.1B row: the sequence-parallel plan the objective put 0.03% ahead takes a 0.5% longer step than
Megatron's tensor parallel one). The memory search keeps the faster of the two by its assembled step.

``m_{r,i}`` are the bytes per device that choosing strategy i for root r implies
(parameters, gradients, optimizer state and activations of every node sharing the
variable, see :mod:`autopar.planning.memory.model`), ``M_{uv}`` those of a pair (a consumer's
saved copy of its operand redistributed from the producer's layout), reduced like ``R``;
``m_0`` those of fixed nodes; bytes are counted in KiB for CP-SAT. An edge variable of
positive bytes on the left of the budget is pushed to the product too, so both terms share
the edge variables. :meth:`StrategyILP.minimum_memory` solves ``min`` of the memory's left
side instead, for the error that names the least memory any plan needs.

Annotated nodes (constrained activations, annotated parameters) have a single
strategy, so the planner gives them no variable: their edges fold into the cost
vectors of their neighbours and into a constant.

Alpa writes the edge term as the quadratic ``s_u^T R_{uv} s_v`` and linearises it with
one-hot edge variables; here the matrix is first reduced so that its entries are
non-negative and as sparse as possible:
``R_{uv,ij} = a_i + b_j + R'_{uv,ij}`` with ``a_i = \min_j R_{uv,ij}`` and
``b_j = \min_i (R_{uv,ij} - a_i)``; ``a`` moves into ``c_u`` and ``b`` into ``c_v``.
Because every ``R'`` is non-negative and the objective is minimised, ``e_{uv,ij}``
equals ``s_{u,i} s_{v,j}`` at any optimum, so the linearisation is exact with one
constraint per non-zero entry (Alpa's needs a variable for every entry).

Determinism: one search worker, a fixed seed and a *deterministic* time limit, so
every rank computes the same plan from the same graph. Where one process plans (``autopar.plan``,
the first rank of ``autopar.compile``, which sends the plan to the others) the wall clock also
ends the search (:class:`SolverClock`): a deterministic second of CP-SAT can run several wall
seconds on a small host (docs/plans.md), so that limit alone can overrun the user's. A search the limit
stops, on either clock, returns the best plan found with its optimality gap; one the wall clock
stops may return another plan on another run. The search starts from a
hinted plan: the one the caller gives (the memory search's last, for an ILP that differs from
it in a few terms) or each root's cheapest strategy; the same calls give the same hints.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from ortools.sat.python import cp_model

from autopar.ir.errors import PlanError

NANOSECONDS = 1e9
MAX_OBJECTIVE = float(2**52)  # keep CP-SAT's integer objective far from overflow
KIB = 1024.0
Edges = dict[tuple[str, str, int, int], cp_model.IntVar]  # edge variables by (root u, root v, i, j)


class SolverTimeout(PlanError):
    """The time limit ended a solve under a memory budget before it found any plan."""


class MemoryRows(NamedTuple):
    """The memory constraint's bytes: per root and strategy, per pair of roots and strategies, fixed."""

    per_root: dict[str, np.ndarray]
    pairs: dict[tuple[str, str], np.ndarray]
    constant: float

    def at(self, assignment: Mapping[str, int]) -> float:
        """The bytes of the plan picking ``assignment[r]`` for every root."""
        return (
            self.constant
            + sum(float(m[assignment[r]]) for r, m in self.per_root.items())
            + sum(float(m[assignment[u], assignment[v]]) for (u, v), m in self.pairs.items())
        )


def reduce_pairs(
    nodes: Mapping[str, np.ndarray], pairs: Mapping[tuple[str, str], np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[tuple[str, str], np.ndarray]]:
    """Move the row and column minima of every pair matrix into its roots' vectors: the
    rest is non-negative and as sparse as it can be (matrices left all zero are dropped)."""
    out = {r: c.astype(float).copy() for r, c in nodes.items()}
    rests = {}
    for (u, v), m in pairs.items():
        a = m.min(axis=1)
        rest = m - a[:, None]
        b = rest.min(axis=0)
        rest = rest - b[None, :]
        out[u] += a
        out[v] += b
        if (rest > 0).any():
            rests[(u, v)] = rest
    return out, rests


@dataclass
class SolverClock:
    """The solver time left to one plan: its ``time_limit``, shared by every solve planning makes
    (the fastest plan, then the memory search's candidates). ``left`` counts CP-SAT's
    deterministic seconds; ``deadline`` (a :func:`time.monotonic` instant) also ends planning on
    the wall clock, None where several ranks plan the same program apart and must agree (the
    deterministic limit alone makes their searches identical)."""

    left: float
    deadline: float | None = None

    @classmethod
    def starting(cls, time_limit: float, deterministic: bool) -> SolverClock:
        """``time_limit`` seconds from now: deterministic seconds, and wall seconds unless
        ``deterministic``."""
        return cls(time_limit, None if deterministic else time.monotonic() + time_limit)

    def share(self, ways: int = 1) -> float:
        """The deterministic limit of the next solve when ``ways`` solves share what is left (none
        when nothing is, on either clock: a solve that runs out before any solution says so, see
        ``solve``)."""
        wall = self.wall_share(ways)
        return 0.0 if wall is not None and wall <= 0 else max(self.left / ways, 0.0)

    def wall_share(self, ways: int = 1) -> float | None:
        """The wall-clock limit of the next solve, shared like :meth:`share`; None without one."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0) / ways

    def spend(self, ilp: StrategyILP) -> None:
        """Count the deterministic seconds ``ilp``'s solves have used since the last call (the wall
        clock counts itself)."""
        self.left -= ilp.spent
        ilp.spent = 0.0


class LaunchFloor(NamedTuple):
    """The launches ``seconds`` a step takes at least, and the compute per root and strategy (and
    fixed) they hide: the ILP's ``(launches)`` term."""

    compute: Mapping[str, np.ndarray]
    constant: float
    seconds: float

    def beyond(self, assignment: Mapping[str, int]) -> float:
        """What the launches take beyond the compute of the plan picking ``assignment``."""
        compute = self.constant + sum(float(c[assignment[r]]) for r, c in self.compute.items())
        return max(0.0, self.seconds - compute)


class Window(NamedTuple):
    """The ILP's ``(within)`` term: plans whose objective is at most ``seconds``, the one of least
    objective less its ``compute`` (per root and strategy) chosen among them."""

    compute: Mapping[str, np.ndarray]
    seconds: float


@dataclass(frozen=True)
class SolverStats:
    variables: int
    constraints: int
    build_seconds: float
    solve_seconds: float
    deterministic_seconds: float  # CP-SAT's deterministic time of the solve (the same on every host)
    objective: float  # seconds
    bound: float  # seconds, a lower bound on any plan's cost
    gap: float  # (objective - bound) / objective
    status: str


class StrategyILP:
    """The ILP of the module docstring over ``node_costs`` and ``pair_costs``."""

    def __init__(
        self,
        node_costs: dict[str, np.ndarray],
        pair_costs: dict[tuple[str, str], np.ndarray],
        constant: float = 0.0,
        memory: MemoryRows | None = None,
        budget: float | None = None,
        hint: Mapping[str, int] | None = None,
        excluded: tuple[Mapping[str, np.ndarray], Mapping[tuple[str, str], np.ndarray]] | None = None,
        launch_floor: LaunchFloor | None = None,
        window: Window | None = None,
    ) -> None:
        self.launch_floor = launch_floor
        self.window = window
        self.node_costs = node_costs
        # strategies (per root) and pairs of strategies (per pair of roots) no plan may take: masks
        self.excluded = excluded
        self.pair_costs = pair_costs
        self.constant = constant
        self.memory = memory
        self.budget = budget
        self.hint = hint  # a strategy per root to start the search from (see _hint)
        self.spent = 0.0  # deterministic solver seconds used (read and reset by SolverClock.spend)

    # --- evaluation (also the reference for the exhaustive test) -------------------
    def evaluate(self, assignment: dict[str, int]) -> float:
        """Seconds of the plan that picks ``assignment[r]`` for every root."""
        total = self.constant + sum(float(c[assignment[r]]) for r, c in self.node_costs.items())
        for (u, v), m in self.pair_costs.items():
            total += float(m[assignment[u], assignment[v]])
        return total + (self.launch_floor.beyond(assignment) if self.launch_floor else 0.0)

    def exhaustive(self) -> tuple[dict[str, int], float]:
        """Try every assignment (tiny problems only)."""
        roots = list(self.node_costs)
        best: tuple[dict[str, int], float] | None = None
        for combo in itertools.product(*(range(len(self.node_costs[r])) for r in roots)):
            a = dict(zip(roots, combo))
            cost = self.evaluate(a)
            if best is None or cost < best[1] - 1e-15:
                best = (a, cost)
        assert best is not None, "a problem needs at least one root"
        return best

    # --- model ----------------------------------------------------------------------
    def _choose_one(self, model: cp_model.CpModel, nodes: dict[str, np.ndarray]) -> dict[str, list]:
        """One-hot constraints: every root takes exactly one strategy."""
        s = {}
        for r, c in nodes.items():
            s[r] = [model.NewBoolVar(f"s[{r},{i}]") for i in range(len(c))]
            model.AddExactlyOne(s[r])
        return s

    def _exclusions(self, model: cp_model.CpModel, s: dict[str, list]) -> None:
        """Excluded constraints: no root takes an excluded strategy, no pair an excluded pair."""
        per_root, pairs = self.excluded
        for r, mask in per_root.items():
            for i in np.nonzero(mask)[0]:
                model.Add(s[r][i] == 0)
        for (u, v), mask in pairs.items():
            for i, j in zip(*np.nonzero(mask)):
                model.AddBoolOr([s[u][i].Not(), s[v][j].Not()])

    def _launches(self, model: cp_model.CpModel, s: dict[str, list]) -> cp_model.IntVar:
        """The launches term: ``y``, at least the launch floor less the plan's compute, in units."""
        floor = self.launch_floor
        room = self._int(floor.seconds - floor.constant)
        y = model.NewIntVar(0, max(0, room), "launches_beyond_compute")
        compute = [(self._int(c[i]), s[r][i]) for r, c in floor.compute.items() for i in range(len(c))]
        model.Add(y + sum(w * v for w, v in compute if w > 0) >= room)
        return y

    def _within(
        self, model: cp_model.CpModel, nodes: dict[str, np.ndarray], weights: list, others: list
    ) -> None:
        """The within term: the objective (the roots' ``weights``, in the order of ``nodes``, and the
        ``others``: edge and launch terms, in units) at most the window, and the objective less the
        window's compute minimised."""
        window = self.window
        room = self._int(window.seconds - self.constant)
        model.Add(sum(w * v for w, v in weights + others if w > 0) <= room)
        compute = [self._int(float(window.compute[r][i])) for r, c in nodes.items() for i in range(len(c))]
        less = [(w - k, v) for (w, v), k in zip(weights, compute)]
        model.Minimize(sum(w * v for w, v in less + others if w > 0))

    def _allowed(self, assignment: Mapping[str, int]) -> bool:
        """Whether ``assignment`` takes no excluded strategy or pair."""
        if self.excluded is None:
            return True
        per_root, pairs = self.excluded
        return not any(m[assignment[r]] for r, m in per_root.items()) and not any(
            m[assignment[u], assignment[v]] for (u, v), m in pairs.items()
        )

    def _memory_budget(self, model: cp_model.CpModel, s: dict[str, list], edges: Edges) -> None:
        """Memory constraint: the bytes every choice and pair implies fit the budget (in KiB)."""
        room = int(math.floor((self.budget - self.memory.constant) / KIB))
        model.Add(self._memory_terms(model, s, edges) <= room)

    def _memory_terms(self, model: cp_model.CpModel, s: dict[str, list], edges: Edges) -> object:
        """The memory's left side less its constant, in KiB; a pair's entries on (new or shared) ``edges``."""
        per_root, pairs = reduce_pairs(self.memory.per_root, self.memory.pairs)
        terms = [(_kib(m[i]), s[r][i]) for r, m in per_root.items() for i in np.nonzero(m > 0)[0]]
        for (u, v), m in pairs.items():
            terms += [(_kib(m[i, j]), _edge(model, s, edges, u, v, i, j)) for i, j in zip(*np.nonzero(m))]
        return sum(k * v for k, v in terms if k > 0)

    def minimum_memory(
        self, time_limit: float = 30.0, seed: int = 0, wall_limit: float | None = None
    ) -> tuple[dict[str, int], float]:
        """The choices needing the least memory, and those bytes (the memory objective alone);
        limits as :meth:`solve`'s."""
        model = cp_model.CpModel()
        s = self._choose_one(model, self.node_costs)
        model.Minimize(self._memory_terms(model, s, {}))
        solver = self._solver(time_limit, seed, wall_limit)
        status = self._run(solver, model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise PlanError(
                f"the solver found no least-memory plan within {time_limit:.3g} s of solver time "
                f"({solver.StatusName(status)}); raise time_limit"
            )
        assignment = {r: next(i for i, v in enumerate(vs) if solver.Value(v)) for r, vs in s.items()}
        return assignment, self.memory.at(assignment)

    def _run(self, solver: cp_model.CpSolver, model: cp_model.CpModel) -> int:
        status = solver.Solve(model)
        self.spent += solver.deterministic_time
        return status

    @staticmethod
    def _solver(time_limit: float, seed: int, wall_limit: float | None) -> cp_model.CpSolver:
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = seed
        solver.parameters.max_deterministic_time = time_limit
        if wall_limit is not None:
            solver.parameters.max_time_in_seconds = wall_limit
        # the LP relaxation of every edge constraint: it proves strategy ILPs optimal much sooner
        # than the default level (1), which left some small models at the time limit; presolve
        # finds little to simplify in them and costs large shapes' solves a large share of their
        # time (the figures: docs/benchmarks_history.md, "the solver's settings")
        solver.parameters.linearization_level = 2
        solver.parameters.cp_model_presolve = False
        return solver

    def _scale(self, nodes: dict[str, np.ndarray], pairs: dict) -> float:
        worst = sum(float(c.max()) for c in nodes.values()) + sum(float(m.max()) for m in pairs.values())
        worst += self.launch_floor.seconds if self.launch_floor else 0.0
        return min(NANOSECONDS, MAX_OBJECTIVE / worst) if worst > 0 else NANOSECONDS

    def _edges(
        self, model: cp_model.CpModel, s: dict[str, list], pairs: dict, edges: Edges
    ) -> list[tuple[int, object]]:
        """The objective's edge terms, on ``edges`` wherever the reduced cost is positive."""
        return [
            (self._int(m[i, j]), _edge(model, s, edges, u, v, i, j))
            for (u, v), m in pairs.items()
            for i, j in zip(*np.nonzero(m))
        ]

    def solve(
        self, time_limit: float = 30.0, seed: int = 0, wall_limit: float | None = None
    ) -> tuple[dict[str, int], SolverStats] | None:
        """The cheapest choices and the solver's report; None if no choice fits the memory budget
        (or, with exclusions, none is left). The search stops after ``time_limit`` deterministic
        seconds, or ``wall_limit`` seconds on the wall clock where given, whichever comes first."""
        t0 = time.perf_counter()
        nodes, pairs = reduce_pairs(self.node_costs, self.pair_costs)
        self.scale = self._scale(nodes, pairs)
        model = cp_model.CpModel()
        s = self._choose_one(model, nodes)
        if self.excluded is not None:
            self._exclusions(model, s)
        edges: Edges = {}
        terms = self._edges(model, s, pairs, edges)
        if self.budget is not None:
            self._memory_budget(model, s, edges)
        # + i units: of strategies priced alike, the first wins (see the module docstring)
        weights = [(self._int(c[i]) + i, s[r][i]) for r, c in nodes.items() for i in range(len(c))]
        if self.launch_floor is not None:
            terms.append((1, self._launches(model, s)))
        if self.window is None:
            model.Minimize(sum(w * v for w, v in weights + terms if w > 0))
        else:
            self._within(model, nodes, weights, terms)
        hinted = self._hint(model, s, nodes)
        build = time.perf_counter() - t0
        solver = self._solver(time_limit, seed, wall_limit)
        t1 = time.perf_counter()
        status = self._run(solver, model)
        solve = time.perf_counter() - t1
        if status == cp_model.INFEASIBLE and (self.budget is not None or self.excluded is not None):
            return None
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            assignment = {r: next(i for i, v in enumerate(vs) if solver.Value(v)) for r, vs in s.items()}
        elif status == cp_model.UNKNOWN and self.budget is None and self._allowed(hinted):
            assignment = hinted  # the time limit hit before any solution: the hint is one (see _hint)
        else:
            raise SolverTimeout(
                f"the solver found no plan within {time_limit:.3g} s of solver time "
                f"({solver.StatusName(status)}{', under the memory budget' if self.budget else ''}); "
                f"raise time_limit"
            )
        objective_s = self.evaluate(assignment)
        reduced = sum(float(c[assignment[r]]) for r, c in nodes.items()) + sum(
            float(m[assignment[u], assignment[v]]) for (u, v), m in pairs.items()
        )
        reduced += self.launch_floor.beyond(assignment) if self.launch_floor else 0.0  # y, in the solver's
        most = sum(len(c) - 1 for c in nodes.values())  # the most units the tie-break adds
        bound = (solver.BestObjectiveBound() - most) / self.scale + objective_s - reduced
        proto = model.Proto()
        stats = SolverStats(
            variables=len(proto.variables),
            constraints=len(proto.constraints),
            build_seconds=build,
            solve_seconds=solve,
            deterministic_seconds=solver.deterministic_time,
            objective=objective_s,
            bound=min(bound, objective_s),
            gap=0.0 if objective_s <= 0 else max(0.0, (objective_s - bound) / objective_s),
            status=solver.StatusName(status),
        )
        return assignment, stats

    def _hint(
        self, model: cp_model.CpModel, s: dict[str, list], nodes: dict[str, np.ndarray]
    ) -> dict[str, int]:
        """Hint a strategy per root, and return those choices: ``self.hint`` where it names a
        strategy of every root (the memory search passes its last solve's: the next ILP differs
        in a few terms, and CP-SAT proves it optimal sooner from there), else each root's cheapest
        strategy by its own cost.

        Without a memory budget any one strategy per choice is a plan (the edge variables
        only add cost), so where the time limit runs out before the solver finds one, this
        is the plan returned, its gap against the solver's bound reported.
        """
        given = self.hint or {}
        if all(0 <= given.get(r, -1) < len(vs) for r, vs in s.items()):
            hinted = {r: given[r] for r in s}
        else:
            hinted = {r: int(np.argmin(nodes[r])) for r in s}
        for r, vs in s.items():
            for i, v in enumerate(vs):
                model.AddHint(v, i == hinted[r])
        return hinted

    def _int(self, seconds: float) -> int:
        return max(0, int(math.floor(seconds * self.scale + 0.5)))


def _kib(nbytes: float) -> int:
    return int(math.ceil(nbytes / KIB))


def _edge(
    model: cp_model.CpModel, s: dict[str, list], edges: Edges, u: str, v: str, i: int, j: int
) -> cp_model.IntVar:
    """The edge variable of entry (i, j) of pair (u, v), made with its constraint
    e_ij >= s_ui + s_vj - 1 the first time it is asked for."""
    key = (u, v, i, j)
    if key not in edges:
        e = model.NewBoolVar(f"e[{u},{v},{i},{j}]")
        model.AddBoolOr([s[u][i].Not(), s[v][j].Not(), e])
        edges[key] = e
    return edges[key]
