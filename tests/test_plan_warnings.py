"""Warnings that explain a plan's figures: ranks sharing cores the cluster gave a core each, and a
plan that splits nothing; and the demo's line saying its predictions are a preset's."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.tools.fake_ranks import fake_world
from examples import gpt, mlp

SHARED = "per core, and this host runs"
SPLITS_NOTHING = "the plan splits no tensor over mesh"


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A host of 2 cores and no torchrun in the environment, whatever machine runs the tests."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return monkeypatch


def _tiny() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A model that plans in a fraction of a second, replicated under cpu-gloo."""
    return mlp.build(n_layers=2)


def _said(plan: autopar.Plan, what: str) -> list[str]:
    return [w for w in plan.warnings if what in w]


def test_four_ranks_of_torchrun_on_two_cores_priced_at_one_each_are_told(two_cores: pytest.MonkeyPatch):
    """torchrun's LOCAL_WORLD_SIZE counts this host's ranks, in a process group or before one."""
    model, args = _tiny()
    two_cores.setenv("LOCAL_WORLD_SIZE", "4")
    with fake_world(4):
        (said,) = _said(autopar.plan(model, args, {"dp": 4}), SHARED)
    assert said.startswith("cluster 'cpu-gloo' prices ranks at 1 per core, and this host runs 2 per core")
    assert "(4 ranks, os.cpu_count() 2)" in said
    assert "run `autopar calibrate` with the ranks launched as the training run" in said
    assert said == _said(autopar.plan(model, args, {"dp": 4}), SHARED)[0]


def test_a_cluster_priced_for_as_many_ranks_per_core_or_on_gpus_is_not(two_cores: pytest.MonkeyPatch):
    model, args = _tiny()
    two_cores.setenv("LOCAL_WORLD_SIZE", "4")
    calibrated = replace(autopar.get_cluster("cpu-gloo"), ranks_per_core=2.0)  # as calibrate measures 4 on 2
    assert not _said(autopar.plan(model, args, {"dp": 4}, cluster=calibrated), SHARED)
    assert not _said(autopar.plan(model, args, {"dp": 4}, cluster="h100"), SHARED)  # not the host's cores
    two_cores.setenv("LOCAL_WORLD_SIZE", "2")  # a core each, as priced
    assert not _said(autopar.plan(model, args, {"dp": 4}), SHARED)


def test_off_ranks_or_on_fake_ranks_without_torchrun_nothing_is_said(two_cores: pytest.MonkeyPatch):
    """``autopar plan`` may plan for any hosts; a fake world is one process, whatever its size."""
    model, args = _tiny()
    assert not _said(autopar.plan(model, args, {"dp": 4}), SHARED)
    with fake_world(4):
        assert not _said(autopar.plan(model, args, {"dp": 4}), SHARED)


def _plan_on_one_core() -> dict[int, list[str]]:
    """On a spawned rank of a host taken to have one core: the core-sharing warnings under
    cpu-gloo with nodes of 2**20 ranks (its own) and of 1."""
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    os.cpu_count = lambda: 1  # this rank's process only
    model, args = _tiny()
    clusters = {n: replace(autopar.get_cluster("cpu-gloo"), devices_per_node=n) for n in (1 << 20, 1)}
    return {n: _said(autopar.plan(model, args, {"dp": 2}, cluster=c), SHARED) for n, c in clusters.items()}


@pytest.mark.distributed
def test_spawned_ranks_without_torchrun_are_the_world_where_the_cluster_has_one_node():
    """Without LOCAL_WORLD_SIZE, ranks of a real process group count as this host's where the
    cluster puts the world on one node (cpu-gloo's), and are unknown where it spreads it over more."""
    from autopar.tools.launch import spawn

    said = spawn(_plan_on_one_core, 2)[0]
    (one_node,) = said[1 << 20]
    assert "this host runs 2 per core (2 ranks, os.cpu_count() 1)" in one_node
    assert said[1] == []


def test_a_tiny_model_kept_whole_on_every_rank_says_why():
    model, args = _tiny()
    plan = autopar.plan(model, args, {"dp": 2, "tp": 2})
    assert plan.splits_nothing
    (said,) = _said(plan, SPLITS_NOTHING)
    assert said.startswith(
        "the plan splits no tensor over mesh dp=2×tp=2: every rank computes the whole model"
    )
    assert "cluster 'cpu-gloo'" in said and "the collectives cost more than the compute they save" in said
    assert "faster links (such as cluster='fast-links')" in said and "larger model or batch" in said
    assert f"warning: {said[:40]}" in plan.summary(200)


def test_a_plan_that_splits_or_runs_on_one_device_does_not():
    model, args = gpt.build()
    split = autopar.plan(model, args, {"dp": 2}, cluster="fast-links")
    assert not split.splits_nothing and not _said(split, SPLITS_NOTHING)
    one = autopar.plan(*_tiny(), {"dp": 1})
    assert not one.splits_nothing and not _said(one, SPLITS_NOTHING)


def test_a_pipeline_whose_stage_mesh_splits_nothing_says_each_rank_computes_its_stage():
    model, args = gpt.build(device="meta")
    plan = autopar.plan(model, args, {"pp": 2, "dp": 2}, pipeline=autopar.Pipeline(2))
    (said,) = _said(plan, SPLITS_NOTHING)
    assert said.startswith(
        "the plan splits no tensor over mesh dp=2: every rank computes the whole of its stage"
    )


def test_the_demo_says_a_presets_predictions_are_not_this_hosts(capsys: pytest.CaptureFixture[str]):
    gpt._say_where_predictions_come_from(None, {"dp": 2, "tp": 2})
    said = capsys.readouterr().out
    assert said.startswith("predictions use the cpu-gloo preset, not this host's figures")
    assert "`autopar calibrate --ranks 4 -o cluster.json` and pass --cluster cluster.json" in said
    assert said.count("\n") == 1
    gpt._say_where_predictions_come_from("fast-links", 8)  # a device count: the mesh searched
    said = capsys.readouterr().out
    assert "the fast-links preset" in said and "--ranks 8 " in said
    gpt._say_where_predictions_come_from("cluster.json", 4)  # calibrate's figures of this host
    assert capsys.readouterr().out == ""
