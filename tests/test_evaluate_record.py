"""The searches evaluate candidates without writing their report; the report is written once, for the
plan returned, and is the one a direct record of the same solve writes."""

from __future__ import annotations

import pickle

import pytest
import torch

import autopar
from autopar.capture.export import Captured
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import PlanOptions
from autopar.planning import planner
from autopar.planning.assembly import assemble
from autopar.planning.assembly.assemble import evaluate_plan, record_plan
from autopar.planning.planner import capture_for, evaluate_captured
from autopar.planning.search import memory_search
from examples import gpt

DP4 = MeshSpec.of({"dp": 4})


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the program's rendering (``format_graph``) and of the memory search's evaluations."""
    calls = {"rendered": 0, "evaluated": 0}
    render, evaluate = assemble.format_graph, memory_search.evaluate_plan

    def rendering(*args, **kwargs):
        calls["rendered"] += 1
        return render(*args, **kwargs)

    def evaluating(*args, **kwargs):
        calls["evaluated"] += 1
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(assemble, "format_graph", rendering)
    monkeypatch.setattr(memory_search, "evaluate_plan", evaluating)
    return calls


def _captured() -> Captured:
    torch.manual_seed(0)
    model, args = gpt.build(batch_size=8, n_layers=2)
    return capture_for(model, args, None, DP4, None)


def test_a_memory_search_renders_only_the_plan_it_returns(counted, monkeypatch):
    captured = _captured()
    budget = 0.5 * evaluate_captured(captured, DP4, deterministic=True).peak_memory_bytes
    recorded = []
    write = planner.record
    monkeypatch.setattr(
        planner, "record", lambda search, found: recorded.append((search, found)) or write(search, found)
    )
    counted.update(rendered=0, evaluated=0)
    planned = evaluate_captured(captured, DP4, PlanOptions(memory_budget=budget), deterministic=True)
    assert counted["rendered"] == 0 and counted["evaluated"] > 1  # several choices evaluated, none rendered
    plan = planned.record()
    assert planned.record() is plan and counted["rendered"] == 1  # written once, on the first call
    assert plan.memory.chosen and plan.peak_memory_bytes <= budget
    assert plan.code and plan.alternatives and plan.axis_roles
    # the plan returned is what a direct evaluation and record of its solve writes
    ((search, found),) = recorded
    again = evaluate_plan(search.setting, found.evaluated.choice, found.evaluated.assignment, plan.solver)
    direct = record_plan(search.setting, again, (found.ilp.node_costs, found.ilp.pair_costs)).to_dict()
    # the planner adds to the record: the search's choice, warnings of its own, the lowering record
    assert plan.warnings[: len(direct["warnings"])] == direct["warnings"]
    direct["memory"]["chosen"], direct["warnings"] = True, plan.warnings
    assert direct == {**plan.to_dict(), "lowering": None}


def test_a_planned_candidate_goes_to_another_process_recorded(counted):
    planned = evaluate_captured(_captured(), DP4, deterministic=True)
    assert counted["rendered"] == 0
    copy = pickle.loads(pickle.dumps(planned))  # what a forked child sends back
    assert counted["rendered"] == 1 and copy._context is None
    assert copy.record().to_dict() == planned.record().to_dict() and counted["rendered"] == 1


def test_a_mesh_search_renders_only_the_plan_it_chooses(counted):
    torch.manual_seed(0)
    model, args = gpt.build(batch_size=8, n_layers=2)
    plan = autopar.plan(model, args, 4, cluster="fast-links", workers=1)
    planned = [r for r in plan.mesh_candidates if "step_s" in r]
    assert len(planned) > 1 and counted["rendered"] == 1
    chosen = next(r for r in planned if r["outcome"] == "chosen")
    assert chosen["step_s"] == plan.step_time_s and chosen["memory_bytes"] == plan.peak_memory_bytes
