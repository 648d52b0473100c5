"""A world of fake ranks in this process: compile and print per-rank programs without real ranks.

torch's ``fake`` process-group backend answers every collective without communicating; its
store lives in torch's testing package (``torch.testing._internal``, a private module). This
module is the one place autopar reaches it, so a move in torch fails here, loudly, and in
every test that compiles on fake ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from autopar.runtime import collectives


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks, this process ``rank``; torn down after."""
    # torch's private testing package is reached only when a fake world is built
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        collectives.forget_meshes()
