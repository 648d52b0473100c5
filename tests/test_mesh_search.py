"""The automatic mesh (``autopar.plan(model, args, N)``): the search's choice equals the best of
planning every candidate mesh by hand, ``compile(model, N)`` builds the chosen mesh over the
process group, and bad device counts are refused."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import CompileError, OptionError
from autopar.planning.cost.model import get_cluster
from autopar.planning.search.mesh_search import candidate_meshes
from autopar.tools.fake_ranks import fake_world
from examples import gpt


def test_the_search_chooses_what_planning_every_mesh_by_hand_chooses():
    torch.manual_seed(0)
    model, args = gpt.build(batch_size=8, n_layers=4)
    searched = autopar.plan(model, args, 4, cluster="fast-links", workers=2)  # forked where Linux
    here = autopar.plan(model, args, 4, cluster="fast-links", workers=1)
    assert here.device_mesh_spec == searched.device_mesh_spec and here.step_time_s == searched.step_time_s
    for a, b in zip(searched.mesh_candidates, here.mesh_candidates, strict=True):
        # which the bound skips depends on which plans ended first; a mesh planned in both is alike
        # but for the seconds its planning took
        alike = {k: v for k, v in a.items() if k != "plan_s"} == {k: v for k, v in b.items() if k != "plan_s"}
        assert a["mesh"] == b["mesh"] and ("step_s" not in a or "step_s" not in b or alike)
    meshes = candidate_meshes(4, get_cluster("fast-links"), 4, 8, None)
    schedules = {(tuple(m.items()), p and (p.schedule, p.microbatches, p.virtual_stages)) for m, p in meshes}
    # with no annotation naming an axis, meshes of one shape are one candidate (dp before tp)
    searched_meshes = candidate_meshes(4, get_cluster("fast-links"), 4, 8, None, names_matter=False)
    dropped = [m for m in meshes if m not in searched_meshes]
    assert dropped == [c for c in meshes if c[0] in (dict(tp=4), dict(pp=2, tp=2))] and len(dropped) == 3
    assert schedules == {
        ((("dp", 4),), None),
        ((("dp", 2), ("tp", 2)), None),
        ((("tp", 4),), None),
        ((("pp", 2), ("dp", 2)), ("1f1b", 8, 1)),
        ((("pp", 2), ("dp", 2)), ("interleaved-1f1b", 8, 2)),  # 4 blocks: two stages per rank
        ((("pp", 2), ("tp", 2)), ("1f1b", 8, 1)),
        ((("pp", 2), ("tp", 2)), ("interleaved-1f1b", 8, 2)),
        ((("pp", 4), ("dp", 1)), ("1f1b", 8, 1)),  # a stage needs a mesh of its own
    }
    by_hand = {}
    for sizes, pipeline in meshes:  # every candidate, those the bound skipped too
        plan = autopar.plan(model, args, sizes, cluster="fast-links", pipeline=pipeline)
        by_hand[(tuple(sizes.items()), pipeline)] = plan.step_time_s
    assert searched.step_time_s == pytest.approx(min(by_hand.values()), rel=1e-9)
    rows = searched.mesh_candidates
    assert len(rows) == len(searched_meshes) and sum(r["outcome"] == "chosen" for r in rows) == 1
    skipped = [r for r in rows if r["outcome"].startswith("not planned")]
    assert all(r["bound_s"] >= searched.step_time_s for r in skipped)
    assert autopar.Plan.from_dict(searched.to_dict()).mesh_candidates == rows
    said = f"mesh chosen from {len(searched_meshes)} candidates for 4 devices in "
    assert any(w.startswith(said) for w in searched.warnings)


def test_compile_with_a_device_count_builds_the_chosen_mesh():
    torch.manual_seed(0)
    model, args = gpt.build()
    with fake_world(4):
        dmodel = autopar.compile(model, 4, args, cluster="fast-links")
        assert dmodel.device_mesh.size() == 4
        assert tuple(dmodel.device_mesh.mesh_dim_names) == dmodel.plan.device_mesh_spec.axis_names
        with pytest.raises(CompileError, match=r"asks for 8 devices, but the process group has 4 ranks"):
            autopar.compile(model, 8, args)
    with pytest.raises(CompileError, match="builds its mesh over the process group"):
        autopar.compile(model, 4, args)


@pytest.mark.parametrize("devices", [0, -4, 2.5])
def test_a_bad_device_count_is_refused(devices):
    model, args = gpt.build()
    with pytest.raises(OptionError):
        autopar.plan(model, args, devices)


def test_a_device_count_no_mesh_of_the_annotations_can_have_is_refused_mesh_by_mesh():
    model, args = gpt.build(batch_size=8)
    gpt.annotate(model, "dp-tp")  # needs axes dp and tp: 7 devices make one axis only
    with pytest.raises(autopar.PlanError, match="no mesh of 7 devices has a plan: ") as e:
        autopar.plan(model, args, 7)
    assert "dp=7: no plan: " in str(e.value) and "unknown mesh axis 'tp'" in str(e.value)


def test_a_search_where_nothing_fits_names_the_closest_mesh():
    model, args = gpt.build()
    with pytest.raises(
        autopar.MemoryFitError, match=r"no mesh of 4 devices has a plan that fits; the closest, "
    ) as e:
        autopar.plan(model, args, 4, memory_budget=10_000)
    # below what the state alone takes per device: refused before any solve, with that bound
    assert "holds at least" in str(e.value) and (bound := e.value.least_bytes) > 10_000
    with pytest.raises(autopar.MemoryFitError, match=r"the closest, .*: no plan fits") as e:
        autopar.plan(model, args, 4, memory_budget=bound + 1)  # planned, and none fits
    assert "least memory" in str(e.value) and e.value.least_bytes > bound


def test_a_capture_is_reused_across_meshes_unless_an_annotation_is_lowered_onto_one():
    from autopar.ir.mesh import MeshSpec
    from autopar.planning.planner import capture_for
    from autopar.planning.search.mesh_search import mesh_free

    model, args = gpt.build()
    one = MeshSpec.of({"dp": 1, "tp": 1})
    assert mesh_free(capture_for(model, args, None, one, None))  # block-boundary points pin nothing
    autopar.shard(model.blocks[0].mlp, in_strategy=(("dp", None, None),))
    assert not mesh_free(capture_for(model, args, None, one, None))
