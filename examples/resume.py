"""Training that survives a killed rank: checkpoint every few steps, resume from the last one.

Run under ``torchrun --nproc-per-node 2 --max-restarts 1 examples/resume.py --kill-at 3``:
trains the small GPT of ``examples/gpt.py`` with Adam on ``dp=2`` gloo ranks, saving the
whole training state (``autopar.save_checkpoint``: parameters, optimizer state, step, RNG
states, plan) every ``--every`` steps. With ``--kill-at N`` the last rank kills itself with
SIGKILL at step ``N`` of the first attempt; torchrun then restarts every rank, each loads
the last complete checkpoint (``autopar.latest_checkpoint``: a save cut short is skipped;
``autopar.load_checkpoint``) and training goes on from its step. Rank 0 appends ``step loss``
lines to ``--losses``, so the steps redone after the restart appear twice (the later line
counts); their losses equal an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch

import autopar


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of step ``step``: token ids and their targets, the same on every rank and attempt."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.tools.launch import init_restartable_process_group
    from examples import gpt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2, help="save after every this many steps")
    parser.add_argument("--kill-at", type=int, default=-1, help="the last rank dies at this step, once")
    parser.add_argument("--checkpoints", default="checkpoints", help="the checkpoint folder")
    parser.add_argument("--losses", default="losses.txt", help="rank 0 appends 'step loss' lines here")
    a = parser.parse_args()
    init_restartable_process_group("gloo")  # each restart's ranks meet afresh
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model, _ = gpt.build(batch_size=4)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    dmodel = autopar.compile(model, mesh, batch(0), cluster="fast-links")
    optimizer = dmodel.optimizer(torch.optim.Adam, lr=0.01)
    folder = Path(a.checkpoints)
    found = autopar.latest_checkpoint(folder)
    step = autopar.load_checkpoint(found, dmodel, optimizer) if found else 0
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    while step < a.steps:
        if step == a.kill_at and first_attempt and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no cleanup, no goodbye
        loss = dmodel.train_step(batch(step))
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if rank == 0:
            with open(a.losses, "a") as log:
                print(f"{step - 1} {loss.item():.7f}", file=log)
        if step % a.every == 0:
            autopar.save_checkpoint(folder / f"step-{step}", dmodel, optimizer, step=step)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
