"""Checkpoint and resume: the whole training state saved under one plan and loaded under another,
and a job whose rank is killed restarting from its last checkpoint with the same losses.

One world of 4 gloo ranks trains examples/gpt.py's model with Adam through six plans in turn
(dp=4 with ZeRO-2, dp=2 x tp=2, pp=2 x dp=2, dp=4 with ZeRO-3, dp=2 x tp=2 with the optimizer
on the host, dp=4 with ZeRO-1), each from a fresh model
with other weights that loads the previous plan's checkpoint: every step's loss equals one
device's. examples/resume.py runs under torchrun with a rank killed by SIGKILL mid-training.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.tools.launch import spawn
from examples.resume import batch

REPO = Path(__file__).resolve().parents[1]
PHASES = [
    ("dp=4, ZeRO-2", (4,), ("dp",), {"memory": autopar.Memory(zero=2)}),
    ("dp=2 x tp=2", (2, 2), ("dp", "tp"), {}),
    ("pp=2 x dp=2", (2, 2), ("pp", "dp"), {"pipeline": autopar.Pipeline(2)}),
    ("dp=4, ZeRO-3", (4,), ("dp",), {"memory": autopar.Memory(zero=3)}),
    (
        "dp=2 x tp=2, optimizer on the host",
        (2, 2),
        ("dp", "tp"),
        {"memory": autopar.Memory(offload_optimizer=True)},
    ),
    ("dp=4, ZeRO-1", (4,), ("dp",), {"memory": autopar.Memory(zero=1)}),
]


def _one_device_losses(steps: int) -> list[float]:
    from examples import gpt

    torch.manual_seed(0)
    model, _ = gpt.build(batch_size=4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(steps):
        loss = model(*batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _through_plans(folder: str) -> list[tuple[str, int, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    from examples import gpt

    losses, step = [], 0
    for i, (name, shape, names, options) in enumerate(PHASES):
        torch.manual_seed(10 * i)  # phase 0: the one device's weights; later: others the checkpoint replaces
        model, _ = gpt.build(batch_size=4)
        if "tp" in names:
            gpt.annotate(model, "tp")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dmodel = autopar.compile(model, mesh, batch(0), cluster="fast-links", **options)
        optimizer = dmodel.optimizer(torch.optim.Adam, lr=0.01)
        if i:
            step = autopar.load_checkpoint(f"{folder}/{i - 1}", dmodel, optimizer)
        for _ in range(2):
            loss = dmodel.train_step(batch(step))
            optimizer.step()
            optimizer.zero_grad()
            losses.append((name, step, loss.item()))
            step += 1
        autopar.save_checkpoint(f"{folder}/{i}", dmodel, optimizer, step=step)
    return losses


@pytest.mark.distributed
def test_a_checkpoint_resumes_under_other_plans_with_the_same_losses(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    losses = spawn(_through_plans, 4, str(tmp_path))[0]
    want = _one_device_losses(len(losses))
    assert [step for _, step, _ in losses] == list(range(len(want)))  # no step lost or repeated
    for name, step, loss in losses:
        assert loss == pytest.approx(want[step], abs=1e-5), (name, step)
    # the whole training state is plain data: it loads with weights_only
    dcp_to_torch_save(tmp_path / "5", tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert state["step"] == 12 and state["format"] == 1 and '"mesh": {"dp": 4}' in state["plan"]
    assert {"wte.weight.exp_avg", "wte.weight.exp_avg_sq", "wte.weight.step"} <= set(
        state["optimizer"]["state"]
    )
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.01 and "cpu" in state["rng"]


@pytest.mark.distributed
def test_a_killed_rank_restarts_from_the_last_checkpoint(tmp_path):
    """Rank 1 dies by SIGKILL at step 3 (saved after steps 2 and 4): torchrun restarts both ranks,
    which load step 2's checkpoint and redo step 2; every step's last loss is one device's."""
    losses = tmp_path / "losses.txt"
    # --standalone: a free port of its own; a session of its own, so nothing outlives the test
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # a second restart is allowed: torchrun's restarts themselves fail now and then on a loaded
    # machine (a worker of the new attempt aborting in gloo's setup); each must resume alike
    command += ["--max-restarts", "2", "examples/resume.py", "--kill-at", "3"]
    command += ["--checkpoints", str(tmp_path / "ck"), "--losses", str(losses)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen(
        command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as job:
        try:
            _, stderr = job.communicate(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
    proc = subprocess.CompletedProcess(command, job.returncode, None, stderr)
    assert proc.returncode == 0, proc.stderr[-12000:]
    assert "SIGKILL" in proc.stderr or "Signals.SIGKILL" in proc.stderr or "exitcode: -9" in proc.stderr
    lines = [line.split() for line in losses.read_text().splitlines()]
    steps = [int(s) for s, _ in lines]
    assert steps[:4] == [0, 1, 2, 2] and sorted(set(steps)) == list(range(6)), steps
    for before, after in zip(steps, steps[1:]):
        if after <= before:  # a restart resumes at the last checkpoint (saved every 2 steps): none lost
            assert after == (before + 1) // 2 * 2, steps
    last = {int(s): float(v) for s, v in lines}
    want = _one_device_losses(6)
    for step, loss in last.items():
        assert loss == pytest.approx(want[step], abs=1e-5), step
