"""The plan summary a person reads (``Plan.summary``), rendered at 100 columns for a Llama plan.

Asserts on its lines: what each mesh axis does in words and what it moves, the legend, the
budget in the units given, gradient sums grouped under parameter names, no internal rows, and
every line at most 100 characters; ``verbose`` brings the hidden rows back.
"""

from __future__ import annotations

import re

import torch

import autopar
from tests import zoo_models


def _llama_plan(**options: object) -> autopar.Plan:
    model, _, kwargs = zoo_models.build("llama")
    ids = torch.randint(0, zoo_models.VOCAB, (8, 64))  # a batch worth splitting
    kwargs = {**kwargs, "input_ids": ids, "labels": ids}
    return autopar.plan(model, (), {"dp": 2, "tp": 2}, example_kwargs=kwargs, **options)


def test_a_llama_plan_reads_at_100_columns():
    plan = _llama_plan(memory_budget=80 * 10**9)
    text = plan.summary(100)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines)
    axes = [line for line in lines if line.startswith("axis ")]
    assert [line.split(":")[0] for line in axes] == ["axis dp (2)", "axis tp (2)"]
    assert all(" splits " in line and "; moves " in line and line.endswith("per rank") for line in axes)
    roles = {name: role for name, role in plan.axis_roles.items()}
    assert set(roles) == {"dp", "tp"} and all(role.startswith("splits ") for role in roles.values())
    assert any(line.startswith("layouts: one placement per mesh axis") for line in lines)
    assert "fits the budget of 80 GB" in text and "as asked" not in text
    table = text.split("redistributions (bytes per rank)")[1].split("parameters\n")[0]
    assert re.search(r"│ gradient[ a-z]*│ 21 ", table) and "model.embed" in table  # one row, parameter names
    assert "layout_constr" not in text and "p_model_" not in text
    assert " 0 B " not in table
    verbose = plan.summary(160, verbose=True)
    assert "autopar.layout_constr" in verbose and "(gradient sum)" in verbose


def test_a_plan_that_splits_nothing_says_why():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    plan = autopar.plan(model, (torch.randn(2, 4),), {"dp": 2})
    text = plan.summary(100)
    assert "axis dp (2): splits nothing; moves 0 B per rank" in text
    assert "every op runs whole on every rank: at this size splitting would cost more" in text


def test_a_loaded_plan_says_so(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    plan = autopar.plan(model, (torch.randn(2, 4),), {"dp": 2})
    assert "plan loaded from" not in plan.summary(100)
    plan.save(tmp_path / "p.json")
    loaded = autopar.load_plan(tmp_path / "p.json")
    assert f"plan loaded from {tmp_path / 'p.json'}; the solver's line is from when it was made" in (
        loaded.summary(200)
    )
    assert "loaded_from" not in loaded.to_dict()


def test_a_pipelined_plan_names_the_pp_axis_and_its_largest_rank():
    from examples import gpt

    model, args = gpt.build(device="meta")
    plan = autopar.plan(model, args, {"pp": 2, "dp": 2}, pipeline=autopar.Pipeline(2))
    text = plan.summary(100)
    assert "autopar plan on mesh pp=2×dp=2" in text
    top = max(plan.pipeline.stages, key=lambda s: s.memory_bytes)  # 1F1B: one stage per rank
    assert f"memory per rank, largest on pipeline rank {top.rank} (stages {top.index})" in text
    assert "axis pp (2): runs 2 pipeline stages (1f1b)" in text
