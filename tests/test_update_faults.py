"""A worker killed under asynchronous training (issue 17): the others run on, the servers keep
their state, and the worker, restarted alone, rejoins where the others are.

Real processes on gloo: 2 workers and 1 server launched as torchrun would (a store outside the
ranks, here this test's own), worker 1 killed by SIGKILL at a clock, then a fresh process for
rank 1 that rejoins through :func:`autopar.rejoin_mesh`.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autopar
from autopar.tools.launch import free_port
from examples import gpt

UPDATE = autopar.Async(staleness=1)
WORKERS = {"dp": 2}
STEPS, DIES_AT = 12, 4


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting from a random start: the next token is the current one plus 1 (quickly learnt)."""
    g = torch.Generator().manual_seed(step)
    idx = (torch.randint(0, 128, (8, 1), generator=g) + torch.arange(32)) % 128
    return idx, (idx + 1) % 128


def _environment(port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def _digest(module: object) -> torch.Tensor:
    """Sums of every parameter and of its magnitude (float64): equal exactly for equal parameters."""
    return torch.stack(
        [torch.stack([t.double().sum(), t.double().abs().sum()]) for t in map(_whole, module.parameters())]
    )


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _train(mesh: object, out: Path, name: str, dies_at: int | None) -> None:
    """Compile under :data:`UPDATE`, train to :data:`STEPS` (or die at ``dies_at``), save what was seen."""
    torch.manual_seed(0)
    model, (idx, _) = gpt.build(batch_size=8)
    dmodel = autopar.compile(model, mesh, (idx,), update=UPDATE)
    if dmodel.is_server:
        result = {"server_log": dmodel.serve()}
    else:
        optimizer = dmodel.optimizer(torch.optim.AdamW, lr=1e-2)
        start, losses, received = dmodel.clock, {}, {dmodel.log[-1][3]: _digest(dmodel)}
        for step in range(dmodel.clock, STEPS):
            if step == dies_at:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = _batch(step)
            losses[step] = dmodel.train_step((x,), y, gpt.loss_fn).item()
            optimizer.step()
            optimizer.zero_grad()
            received[dmodel.log[-1][3]] = _digest(dmodel)
            time.sleep(0.2)  # the job outlasts the restart: the rejoin meets a running worker
        dmodel.close()
        result = {"start": start, "losses": losses, "log": dmodel.log, "received": received}
    torch.save(result, out / f"{name}.pt")
    os._exit(0)  # the job's world lost a rank for good: leave without tearing it down


def _job_rank(rank: int, port: int, out: str) -> None:
    _environment(port)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("job/", store), rank=rank, world_size=3)
    _train(autopar.worker_mesh(UPDATE, WORKERS), Path(out), f"rank{rank}", DIES_AT if rank == 1 else None)


def _restarted(port: int, out: str) -> None:
    _environment(port)
    _train(autopar.rejoin_mesh(UPDATE, WORKERS, rank=1), Path(out), "rejoined", None)


def test_rejoin_mesh_refuses_units_of_several_ranks() -> None:
    with pytest.raises(autopar.OptionError, match="only units of one rank can rejoin"):
        autopar.rejoin_mesh(autopar.Hybrid(groups=2), {"dp": 4}, rank=1)
    with pytest.raises(autopar.OptionError, match=r"rejoin_mesh\(rank=2\)"):
        autopar.rejoin_mesh(UPDATE, WORKERS, rank=2)


@pytest.mark.distributed
def test_a_killed_worker_rejoins_and_the_servers_keep_their_state() -> None:
    port, ctx = free_port(), mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # outlives the ranks
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_job_rank, args=(r, port, out)) for r in range(3)]
        procs.append(ctx.Process(target=_restarted, args=(port, out)))
        for p in procs[:3]:
            p.start()
        try:
            procs[1].join(120)
            assert procs[1].exitcode == -signal.SIGKILL
            procs[3].start()  # rank 1 again, alone, while rank 0 trains on
            for p in (procs[0], procs[2], procs[3]):
                p.join(180)
                assert p.exitcode == 0
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
        first, rejoined, server = (torch.load(Path(out) / f"{n}.pt") for n in ("rank0", "rejoined", "rank2"))
    del store
    log = server["server_log"]
    applies = [e for e in log if e[0] == "apply"]
    # the run went on: worker 0 trained every clock, its updates applied while worker 1 was gone
    assert sorted(first["losses"]) == list(range(STEPS))
    # the restarted worker resumed at the clock the others had reached, not at 0 ...
    assert DIES_AT <= rejoined["start"] < STEPS and sorted(rejoined["losses"]) == list(
        range(rejoined["start"], STEPS)
    )
    # ... on the servers' parameters as they were: every update applied so far is in them
    _clock, _server, stale, version = rejoined["log"][0]
    before = [e for e in applies if e[3] <= version]
    assert version == len(before) >= STEPS // 2 and stale <= 1
    # and they are exactly the parameters worker 0 received at that version (it trained alone
    # meanwhile, so it started a clock on every version then), not the fresh model's. How far
    # they are trained varies with the order of the updates (loss 3.6-4.8 on the first batch).
    assert torch.equal(rejoined["received"][version], first["received"][version])
    torch.manual_seed(0)
    fresh, _ = gpt.build(batch_size=8)
    assert not torch.allclose(rejoined["received"][version], _digest(fresh))
    # the server's versions ran on without a gap or reset, one per push of either incarnation
    assert [e[3] for e in applies] == list(range(1, len(applies) + 1))
    assert len(applies) == STEPS + DIES_AT + (STEPS - rejoined["start"])
    # the staleness bound held throughout
    assert all(e[3] <= 1 for e in log if e[0] == "start")
