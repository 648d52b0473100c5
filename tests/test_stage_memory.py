"""Memory under a pipeline is what each pipeline rank holds: its stages' parameters, gradients,
optimizer state and in-flight activations, not the whole model's.

The Llama-3.1-405B shape (hidden 16384, 128 heads / 8 kv heads, FFN 53248, vocabulary 128256,
bf16), with 16 of its 126 layers so that the test plans in seconds, on pp=16 x dp=128 x tp=8
(16,384 ranks) with ZeRO-3 and 1 GiB per device, which only parameters split by ZeRO leave room
for: each stage's bytes equal a hand count of its parameters, split over tp x dp, and the no-fit
error names the pipeline rank holding the most with its stages' parts.
"""

from __future__ import annotations

import re

import pytest
import torch

import autopar
from bench.plan_scale import llama

HIDDEN, KV, FFN, VOCAB = 16384, 1024, 53248, 128256
LAYER = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * FFN + 2 * HIDDEN  # attention, MLP, norms
MESH = {"pp": 16, "dp": 128, "tp": 8}


def _plan(budget: float) -> autopar.Plan:
    model = llama("llama-3.1-405b", layers=16)
    ids = torch.zeros(256, 1024, dtype=torch.long, device="meta")
    return autopar.plan(
        model,
        (),
        MESH,
        example_kwargs={"input_ids": ids, "labels": ids},
        cluster="h100",
        pipeline=autopar.Pipeline(16, "1f1b"),
        memory=autopar.Memory(zero=3),
        memory_budget=budget,
        time_limit=10.0,
    )


def test_each_pipeline_stage_holds_its_own_share_of_the_405b_shape():
    plan = _plan(2**30)
    split = MESH["tp"] * MESH["dp"]  # ZeRO-3 stores every parameter split over both
    for stage in plan.pipeline.stages:
        layers = sum(bool(re.fullmatch(r"model\.layers\.\d+", m)) for m in stage.modules)
        params = layers * LAYER
        params += VOCAB * HIDDEN if stage.index == 0 else 0  # the embedding
        params += VOCAB * HIDDEN + HIDDEN if "lm_head" in stage.modules else 0  # the head and final norm
        assert layers == 1
        assert stage.param_bytes == pytest.approx(2 * params / split, rel=0.01), stage.index
        assert stage.grad_bytes == pytest.approx(stage.param_bytes, abs=1024)  # bf16; buffers have none
        assert stage.optimizer_bytes == pytest.approx(8 * params / split, rel=0.01)  # Adam: 2 fp32
    # the plan's memory is the largest pipeline rank's (one stage each under 1F1B), far below the model's
    whole = sum(s.param_bytes + s.grad_bytes + s.optimizer_bytes for s in plan.pipeline.stages)
    largest = max(plan.pipeline.stages, key=lambda s: s.memory_bytes)
    assert plan.peak_memory_bytes == largest.memory_bytes == plan.prediction.memory_bytes
    assert largest.param_bytes + largest.grad_bytes + largest.optimizer_bytes < whole / 8
    with pytest.raises(autopar.PlanError) as error:
        _plan(2**27)  # below the least memory a plan reaches (full recompute: 0.27 GiB)
    message = str(error.value)
    assert "on mesh pp=16×dp=128×tp=8" in message
    rank, stage, params = re.search(
        r"least memory per rank reached is .* on pipeline rank (\d+), as the rank holds it \(stages (\d+)\) "
        r"\(.*parameters ([\d.]+) GiB",
        message,
    ).groups()
    assert rank == stage  # 1F1B: one stage per rank
    assert float(params) < whole / 8 / 2**30
