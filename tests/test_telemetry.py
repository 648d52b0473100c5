"""``StepMeter`` (autopar.tools.telemetry): each step measured beside the plan's prediction.

On a fake world of 4 ranks (collectives answer without communicating, but autopar counts the
bytes it sends into them): the bytes moved per step must equal the plan's prediction for the
model and its compiled loss, the profile step counts FLOPs and memory, and every step is one
JSON object in the file. Real gloo ranks run the same meter in the demo (``examples/gpt.py``;
its output is in ``docs/telemetry.md``).
"""

from __future__ import annotations

import json

import torch

import autopar
from autopar.tools.fake_ranks import fake_world
from autopar.tools.telemetry import StepMeter
from examples import gpt


def test_steps_are_measured_beside_the_plans_prediction(tmp_path, capsys):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, (idx, targets) = gpt.build()
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dmodel = autopar.compile(model, mesh, (idx,), precision=autopar.MixedPrecision())
        optimizer = dmodel.optimizer(torch.optim.AdamW, lr=1e-3)
        meter = StepMeter(dmodel, optimizer, tokens=idx.numel(), jsonl=tmp_path / "steps.jsonl")
        for _ in range(3):
            with meter.step():
                dmodel.train_step((idx,), targets, gpt.loss_fn)
                optimizer.step()
                optimizer.zero_grad()
    warm_up, profile, last = (
        json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()
    )
    loss = dmodel.loss_programs[0].plan.prediction
    assert last["predicted_moved_bytes"] == dmodel.plan.prediction.comm_bytes + loss.comm_bytes
    assert (
        warm_up["moved_bytes"]
        == profile["moved_bytes"]
        == last["moved_bytes"]
        == last["predicted_moved_bytes"]
    )
    assert warm_up["mfu"] is None and warm_up["memory_bytes"] is None and profile["profile"]
    assert 0 < last["mfu"] < 1 and last["peak_flops"] == {
        "dtype": "bfloat16",
        "per_rank": 838e9,
        "cluster": "cpu-gloo",
    }
    assert last["tokens_per_s"] == idx.numel() / last["seconds"]
    # parameters, gradients and AdamW's state measured from the live tensors, activations by the meter
    predicted = dmodel.plan.prediction
    state = predicted.param_bytes + predicted.grad_bytes + predicted.optimizer_bytes
    assert state < last["memory_bytes"][0] < 2 * last["predicted_memory_bytes"][0]
    out = capsys.readouterr().out
    assert "step 0 (warm-up): " in out and "step 1 (profile): " in out
    assert "of 838 GFLOP/s bfloat16 per rank (cpu-gloo)" in out
