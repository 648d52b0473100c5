"""Run a function on several local ranks with a process group: for tests, benchmarks and demos.

``torchrun`` is the way to launch real jobs; :func:`spawn` is for code that wants N
ranks on this machine from inside one Python call (a test, a benchmark).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str, backend: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)  # ranks share the machine's cores
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(*args)
        torch.save({"ok": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        torch.save({"error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is saved. Leave without the interpreter's finalisation: a gloo worker thread
    # still holding a finished collective's tensors (the group object outlives
    # destroy_process_group while anything references it) aborts the process when it
    # releases them after Python is torn down ("terminate called without an active
    # exception", SIGABRT, seen once in CI after every rank had saved its result).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes with an initialised process group.

    ``fn`` must be importable (a module-level function). Returns each rank's result;
    if any rank fails, raises ``RuntimeError`` with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, free_port(), fn, args, out_dir, backend),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        failure = None
        try:
            while not ctx.join():
                pass
        except mp.ProcessRaisedException as exc:
            failure = exc
        except mp.ProcessExitedException as exc:
            failure = exc
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            record = torch.load(path, weights_only=False) if os.path.exists(path) else {"error": "no result"}
            if "error" in record:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{record['error']}") from failure
            results.append(record["ok"])
        if failure is not None:
            raise RuntimeError(str(failure)) from failure
        return results


def init_restartable_process_group(backend: str = "gloo") -> None:
    """``init_process_group(backend)`` for a script ``torchrun --max-restarts`` may restart.

    torchrun's agent keeps one store across restarts; a restarted rank reading it may find the
    address a dead rank of the attempt before left there and fail to connect (gloo's
    "connectFullMesh failed ... Connection refused"). Here each attempt
    (``TORCHELASTIC_RESTART_COUNT``) sees the store under a prefix of its own.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)  # rank 0 hosts a fresh store on each attempt
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"autopar/attempt-{attempt}/", agent)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
