"""The automatic mesh at scale: the bounds it prunes candidates by hold for every plan made (the
step bound never exceeds a planned step, the memory bound never exceeds a planned peak), what they
prune is counted, a mesh that cannot fit is refused before any solve, every pipelined candidate
records its pipeline, and a memory search whose time ran out says so with its bound."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.capture.export import Captured
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import Memory, Pipeline, PlanOptions
from autopar.planning.cost.model import get_cluster
from autopar.planning.planner import capture_for
from autopar.planning.search.mesh_search import Bounds, MeshSearch
from examples import gpt


def _recomputed_gpt(n_layers: int = 4) -> tuple[gpt.GPT, tuple[torch.Tensor, ...]]:
    """A small GPT on ``meta`` (sizes made up: the plan is priced, never run; large enough that
    compute dominates its steps), every block recomputed: a recompute no plan can drop."""
    model, args = gpt.build(
        batch_size=64, device="meta", n_layers=n_layers, d_model=1024, n_heads=8, seq_len=2048
    )
    for block in model.blocks:
        autopar.recompute(block, "full")
    return model, args


def _by_devices(model: torch.nn.Module, args: tuple, devices: int, **options: object) -> autopar.Plan:
    return autopar.plan(model, args, devices, cluster="a100", precision=autopar.MixedPrecision(), **options)


@pytest.fixture(scope="module")
def searched() -> tuple[gpt.GPT, tuple[torch.Tensor, ...], autopar.Plan]:
    """The small GPT searched for 4 devices, one candidate after another."""
    model, args = _recomputed_gpt()
    return model, args, _by_devices(model, args, 4, workers=1)


def test_the_bounds_hold_for_every_candidate_planned_and_prune_the_rest(searched):
    model, args, plan = searched
    rows = plan.mesh_candidates
    planned = [r for r in rows if "step_s" in r]
    pruned = [r for r in rows if r["outcome"].startswith("not planned: its bound")]
    assert planned and pruned, [(r["mesh"], r["outcome"]) for r in rows]
    for r in planned:  # sound: no plan of a mesh beats its bounds
        assert r["bound_s"] <= r["step_s"] * (1 + 1e-9), r
        assert r["memory_bound_bytes"] <= r["memory_bytes"], r
    tried = [r for r in rows if not r["outcome"].startswith("not planned")]
    said = next(w for w in plan.warnings if w.startswith("mesh chosen from"))
    assert f": {len(tried)} planned, {len(pruned)} not planned by their step bound, 0 by their memory" in said
    # pruned only where it could not have won, checked by planning one by hand
    assert all(r["bound_s"] >= plan.step_time_s for r in pruned)
    skipped = pruned[0]
    p = skipped["pipeline"]
    pipeline = None if p is None else Pipeline(p["microbatches"], p["schedule"], p["virtual_stages"])
    precision = autopar.MixedPrecision()
    by_hand = autopar.plan(
        model, args, skipped["sizes"], cluster="a100", precision=precision, pipeline=pipeline
    )
    assert skipped["bound_s"] <= by_hand.step_time_s and plan.step_time_s <= by_hand.step_time_s


def test_every_pipelined_candidate_records_its_pipeline_and_each_planned_one_its_time(searched):
    plan = searched[2]
    rows = plan.mesh_candidates
    assert any(r["pipeline"] for r in rows) and any(r["pipeline"] is None for r in rows)
    for r in rows:
        assert ("pp" in r["sizes"]) == (r["pipeline"] is not None), r
        if r["pipeline"] is not None:
            p = r["pipeline"]
            assert set(p) == {"schedule", "microbatches", "virtual_stages"}
            assert f"{p['schedule']} m={p['microbatches']}" in r["mesh"]
        assert ("step_s" in r) <= ("plan_s" in r), r
    assert autopar.Plan.from_dict(plan.to_dict()).mesh_candidates == rows


def _whole(model: torch.nn.Module, args: tuple) -> Captured:
    return capture_for(model, args, None, MeshSpec.of({"dp": 1, "tp": 1}), None, autopar.MixedPrecision())


def test_the_step_bound_counts_the_recompute_every_plan_runs():
    model, args = _recomputed_gpt(n_layers=2)
    a100 = get_cluster("a100")
    recomputed = Bounds.of(_whole(model, args), a100, Memory())
    plain_model, _ = gpt.build(
        batch_size=64, device="meta", n_layers=2, d_model=1024, n_heads=8, seq_len=2048
    )
    plain = Bounds.of(_whole(plain_model, args), a100, Memory())
    # a forward again of the blocks, about a third of their forward and backward; without an
    # annotation no recompute is forced (a memory choice without any is searched)
    assert 1.1 * plain.compute_s < recomputed.compute_s < 1.34 * plain.compute_s
    # a bubble of (m + p - 1) / m over the devices' even share; half the idle with two stages per rank
    sizes = {"pp": 2, "dp": 4}
    one_f_one_b, interleaved = Pipeline(4, "1f1b"), Pipeline(4, "interleaved-1f1b", 2)
    assert recomputed.step_s(sizes, one_f_one_b, a100) == pytest.approx(recomputed.compute_s / 8 * 5 / 4)
    assert recomputed.step_s(sizes, interleaved, a100) == pytest.approx(recomputed.compute_s / 8 * 4.5 / 4)
    # the parameters, gradients and optimizer state split over every device: 16 bytes a parameter
    # under MixedPrecision (fp32 master weights and gradients, Adam's two moments)
    parameters = sum(p.numel() for p in model.parameters())
    assert recomputed.state_bytes == pytest.approx(16 * parameters, rel=0.01)
    assert recomputed.memory_bytes(8) == recomputed.state_bytes / 8


def test_a_mesh_that_cannot_fit_is_refused_before_any_solve():
    model, args = _recomputed_gpt(n_layers=2)
    whole, a100 = _whole(model, args), get_cluster("a100")
    bound = MeshSearch.of(4, a100, whole, 64, PlanOptions()).candidates[0].memory_bound_bytes
    assert MeshSearch.of(4, a100, whole, 64, PlanOptions(memory_budget=bound)).left  # fits: planned
    search = MeshSearch.of(4, a100, whole, 64, PlanOptions(memory_budget=bound * 0.99))
    assert not search.left and search.next() is None  # nothing to solve
    for row in search.rows:
        assert row["outcome"].startswith("not planned: no plan fits: every plan holds at least")
        assert row["least_bytes"] == int(bound) and "split over its 4 devices" in row["error"]
    # the error names the closest mesh and its bound
    with pytest.raises(autopar.MemoryFitError, match="no mesh of 4 devices has a plan that fits") as e:
        _by_devices(model, args, 4, workers=1, memory_budget=bound / 2)
    assert "holds at least" in str(e.value) and e.value.least_bytes == int(bound)


def test_meshes_are_planned_by_bound_and_at_equal_bounds_those_holding_the_state_first():
    model, args = _recomputed_gpt()
    whole, a100 = _whole(model, args), get_cluster("a100")
    state = MeshSearch.of(4, a100, whole, 64, PlanOptions()).candidates[0].memory_bound_bytes * 4
    # a budget tp=2 holds the state within without ZeRO (half of it per device) and dp=4 does not
    search = MeshSearch.of(4, a100, whole, 64, PlanOptions(memory_budget=state / 1.5))
    bounds = [c.bound_s for c in search.candidates]
    assert bounds == sorted(bounds) and len(search.left) == len(search.candidates)
    tied = [c.sizes for c in search.candidates if c.bound_s == bounds[0]]
    assert tied[:2] == [{"dp": 2, "tp": 2}, {"dp": 4}]  # the same bound: the one holding the state first
    # the pipeline of four stages last: its bubble
    assert search.candidates[-1].sizes == {"pp": 4, "dp": 1}


def test_a_least_memory_solve_without_time_left_says_so_with_its_bound():
    model, args = gpt.build(batch_size=4)
    with pytest.raises(autopar.PlanError) as e:
        autopar.plan(model, args, {"dp": 2}, memory_budget=10_000, time_limit=1e-6)
    message = str(e.value)
    assert "within 0 s" not in message and not isinstance(e.value, autopar.MemoryFitError)
    assert "time_limit was spent before the plan of least memory (ZeRO-3) was solved" in message
    assert "whose estimate is at least" in message and "raise time_limit" in message
