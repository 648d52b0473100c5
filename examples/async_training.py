"""Train the example GPT with parameter servers and asynchronous updates.

``PYTHONPATH=. torchrun --nproc-per-node 5 examples/async_training.py`` (from the repository's root:
it imports ``examples.gpt``) runs 4 workers and 1 server: the workers
train :data:`examples.gpt.TINY` with ``Async(staleness=2)`` (``--mode ps``, ``async``, ``hybrid``;
``--staleness``, ``--servers``), the server holds the parameters and AdamW's state, and the run ends
with the server's state saved (``--checkpoint``). See ``docs/update_modes.md``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import autopar
from examples import gpt


def main() -> None:
    """Compile on every rank; servers serve, workers train and print their loss and staleness."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ps", "async", "hybrid"), default="async")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint", help="a folder for the servers' state at the end")
    a = parser.parse_args()
    dist.init_process_group("gloo")
    update = {
        "ps": autopar.ParameterServer(servers=a.servers),
        "async": autopar.Async(staleness=a.staleness, servers=a.servers),
        "hybrid": autopar.Hybrid(groups=2, staleness=a.staleness, servers=a.servers),
    }[a.mode]
    workers = dist.get_world_size() - a.servers
    mesh = autopar.worker_mesh(update, {"dp": workers})  # the first ranks; the last serve
    torch.manual_seed(0)
    model, (idx, _) = gpt.build(batch_size=4 * workers)
    dmodel = autopar.compile(model, mesh, (idx,), update=update)
    if dmodel.is_server:
        log = dmodel.serve(resume=None)
        print(f"server rank {dist.get_rank()}: {sum(e[0] == 'apply' for e in log)} optimizer steps")
    else:
        optimizer = dmodel.optimizer(torch.optim.AdamW, lr=2e-3)
        for step in range(dmodel.clock, a.steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, gpt.TINY.vocab_size, idx.shape, generator=g)
            loss = dmodel.train_step((x,), torch.roll(x, -1, 1), gpt.loss_fn)
            optimizer.step()
            optimizer.zero_grad()
            if step % 5 == 0 or step == a.steps - 1:
                stale = dmodel.log[-1][2]
                print(f"worker {dist.get_rank()} step {step}: loss {loss.item():.4f}, staleness {stale}")
        if a.checkpoint:
            dmodel.save_checkpoint(a.checkpoint)
        dmodel.close()
    dist.destroy_process_group()


if __name__ == "__main__" and "RANK" in os.environ:
    main()
elif __name__ == "__main__":
    print("run under torchrun: PYTHONPATH=. torchrun --nproc-per-node 5 examples/async_training.py")
