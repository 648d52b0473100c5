"""A recommender's embedding tables split in rows the user chooses (MindSpore's ``manual_split``).

A DLRM-style model: a user table and an item table looked up by id, their embeddings fed to
an MLP that scores the pair. :func:`annotate` splits the user table over mesh axis ``tp``
with ``autopar.ManualSplit``: rank ``c`` of ``tp`` holds ``USER_ROWS[c]`` consecutive rows
(say, the users its shard of the data serves most); the item table is split by an axis name
(DTensor's pieces, uneven here). Each rank looks up the ids that fall in its rows; the
others are masked and the partial embeddings summed over ``tp``.

Run under ``torchrun --nproc-per-node 4 examples/recommender.py``: compiles for
``dp=2 x tp=2`` gloo ranks, trains a few Adam steps, prints the loss next to one device's
and checks that ``state_dict()`` gives the tables in their model's shape. Without
``torchrun`` it prints the plan (no ranks needed).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import autopar

USERS, ITEMS, WIDTH = 1000, 301, 16
USER_ROWS = (700, 300)  # the user table's rows on tp rank 0 and 1
PADDING = 0  # user id 0: an unknown user, whose row is never trained


class Recommender(nn.Module):
    """Scores (user, item) pairs: a user's history of item ids and the candidate item."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(USERS, WIDTH, padding_idx=PADDING)
        self.items = nn.Embedding(ITEMS, WIDTH)
        self.score = nn.Sequential(nn.Linear(3 * WIDTH, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, user: torch.Tensor, history: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        features = torch.cat([self.users(user), self.items(history).mean(1), self.items(item)], -1)
        return self.score(features).squeeze(-1)


def build(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """The model, a batch of (user, history of 5 items, candidate item) and click labels."""
    model = Recommender()
    user = torch.randint(0, USERS, (batch,))
    user[0] = PADDING
    history, item = torch.randint(0, ITEMS, (batch, 5)), torch.randint(0, ITEMS, (batch,))
    return model, (user, history, item), torch.randint(0, 2, (batch,)).float()


def annotate(model: Recommender) -> None:
    """The user table in :data:`USER_ROWS` over ``tp``; the item table by DTensor's pieces."""
    autopar.shard(model.users, parameter_plan={"weight": (autopar.ManualSplit("tp", USER_ROWS), None)})
    autopar.shard(model.items, parameter_plan={"weight": ("tp", None)})


def main() -> None:
    """The demo (see the module docstring)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, inputs, clicks = build()
    reference = copy.deepcopy(model)
    annotate(model)
    if "RANK" not in os.environ:
        print(autopar.plan(model, inputs, {"dp": 2, "tp": 2}, cluster="fast-links").summary())
        return
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    dmodel = autopar.compile(model, mesh, inputs, cluster="fast-links")
    loss_fn = nn.BCEWithLogitsLoss()
    optimizer = torch.optim.Adam(dmodel.parameters(), lr=0.01)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(3):
        loss = dmodel.train_step(inputs, clicks, loss_fn)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = loss_fn(reference(*inputs), clicks)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.5f} (one device: {ref_loss.item():.5f})")
    state = dmodel.state_dict()  # each table in its model's shape, whatever rows a rank holds
    torch.testing.assert_close(state["users.weight"].full_tensor(), reference.users.weight)
    if dist.get_rank() == 0:
        held, saved = tuple(dmodel.users.weight.to_local().shape), tuple(state["users.weight"].shape)
        print(f"users.weight: {held} held per rank (padded to the largest rows), {saved} saved")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
