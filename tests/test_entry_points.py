"""The entry points: one frozen options object, checked once; ``autopar.plan`` and ``autopar.compile``
as keyword wrappers over functions that each return one type; update modes reached through their
registries, not branches."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar import compiler
from autopar.ir.options import PlanOptions
from autopar.planning import entry_points
from autopar.planning.cost.model import get_cluster
from autopar.runtime.module import DistributedModule
from autopar.tools.fake_ranks import fake_world
from examples.mlp import build

BAD = [
    ({"time_limit": 0}, r"time_limit must be a number above 0 \(seconds of solver time\), got 0"),
    ({"time_limit": math.nan}, "got nan"),
    ({"seed": 1.5}, "seed must be an int >= 0, got 1.5"),
    ({"pipeline": 4}, "pipeline must be an autopar.Pipeline"),
    ({"memory": {"zero": 2}}, "memory must be autopar.Memory"),
    ({"memory_budget": "40GB"}, r"memory_budget must be a number above 0 \(bytes per device"),
    ({"precision": "bf16"}, "precision must be autopar.MixedPrecision"),
    ({"workers": 0}, "workers must be an int >= 1, got 0"),
    ({"check_ids": 1}, r"compile\(check_ids=...\) must be True or False, got 1"),
    ({"update": "async"}, r"update=... is autopar.ParameterServer\(...\)"),
]


@pytest.mark.parametrize(("given", "message"), BAD, ids=[next(iter(g)) for g, _ in BAD])
def test_the_options_refuse_a_bad_value_in_the_words_of_the_entry_points(given, message):
    with pytest.raises(autopar.OptionError, match=message):
        PlanOptions(**given)


def test_the_options_are_frozen():
    options = PlanOptions(time_limit=5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.time_limit = 1.0  # type: ignore[misc]
    assert dataclasses.replace(options, seed=3).seed == 3 and options.seed == 0


class _Recorder:
    """An update mode's planner and compiler that records what it was handed."""

    def __init__(self) -> None:
        self.options: PlanOptions | None = None

    def plan(self, model, example_args, mesh, example_kwargs, options):
        self.options = options
        return "planned"

    def compile(self, model, mesh, example_args, example_kwargs, options, plan):
        self.options = options
        return "compiled"


# a value of every option other than its default, as each entry point takes it
GIVEN = {
    "time_limit": 7.0,
    "seed": 3,
    "pipeline": autopar.Pipeline(4),
    "memory": autopar.Memory(zero=1),
    "memory_budget": 2.0**30,
    "precision": autopar.MixedPrecision(),
    "update": autopar.Async(staleness=2),
}


def _keywords(entry) -> set[str]:
    return {p.name for p in inspect.signature(entry).parameters.values() if p.kind is p.KEYWORD_ONLY}


def test_every_keyword_of_plan_reaches_the_options(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setitem(entry_points.UPDATE_PLANNERS, autopar.Async, recorder)
    model, args = build()
    given = {**GIVEN, "cluster": "fast-links", "workers": 2}
    # accumulation is refused beside a pipeline and an update mode: tests/test_accumulation.py plans with it
    assert _keywords(autopar.plan) == {*given, "example_kwargs", "accumulation"}
    assert autopar.plan(model, args, {"dp": 2}, **given) == "planned"
    options = recorder.options
    assert options == PlanOptions(**{**given, "cluster": get_cluster("fast-links")})


def test_every_keyword_of_compile_reaches_the_options(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setitem(compiler.UPDATE_COMPILERS, autopar.Async, recorder)
    model, args = build()
    given = {**GIVEN, "cluster": "fast-links", "check_ids": False}
    assert _keywords(autopar.compile) == {*given, "example_kwargs", "plan", "accumulation"}
    assert autopar.compile(model, None, args, **given) == "compiled"
    assert recorder.options == PlanOptions(**given)


def test_a_subclass_of_an_update_mode_finds_its_handlers():
    class Slow(autopar.Async):
        pass

    assert entry_points.update_planner(Slow()) is entry_points.UPDATE_PLANNERS[autopar.Async]
    assert compiler.update_compiler(Slow()) is compiler.UPDATE_COMPILERS[autopar.Async]


def test_each_branch_returns_the_type_it_always_did():
    model, args = build()
    options = {"cluster": "fast-links", "time_limit": 5.0}
    assert isinstance(autopar.plan(model, args, {"dp": 2}, **options), autopar.Plan)
    updated = autopar.plan(model, args, {"dp": 2}, update=autopar.ParameterServer(), **options)
    assert isinstance(updated, autopar.Plan) and updated.update["mode"] == "parameter server (1)"
    searched = autopar.plan(model, args, 2, workers=1, **options)
    assert isinstance(searched, autopar.Plan) and searched.mesh_candidates
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        assert type(autopar.compile(model, mesh, args, **options)) is DistributedModule
        lazy = autopar.compile(model, mesh, **options)
        assert isinstance(lazy, compiler.CompiledOnFirstCall) and lazy.compiled is None
        lazy(*args)
        assert type(lazy.compiled) is DistributedModule
    with pytest.raises(autopar.CompileError, match="needs the workers' DeviceMesh"):
        autopar.compile(model, {"dp": 2}, args, update=autopar.Async())


def test_a_module_compiles_its_losses_through_the_named_interface():
    model, (x, target) = build()
    with fake_world(1):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        dmodel = autopar.compile(model, mesh, (x,), cluster="fast-links", check_ids=False)
        assert dmodel._compile_loss == compiler.ProgramLosses(check_ids=False)
        loss = dmodel.train_step(x, target, torch.nn.functional.mse_loss)
        assert loss.dim() == 0 and len(dmodel.loss_programs) == 1
