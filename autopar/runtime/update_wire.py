"""What workers and parameter servers say to each other, over one gloo pair group per (server, worker).

Each worker rank talks to each server over a two-rank ``ProcessGroupGloo`` (server rank 0, worker
rank 1) built from the launcher's store under a prefix naming the worker's *incarnation* (how
many times that rank has joined): a killed worker breaks only its own pairs, and its restart
meets the servers in fresh groups without disturbing anyone else's. Messages are a header
(:data:`HEADER` int64 values: kind, clock, two numbers), then tensors flattened per dtype, and
occasionally a pickled object (the optimizer to build, the pieces a rank holds).
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

JOIN, PUSH, SAVE, DONE = range(4)  # message kinds a worker sends
HEADER = 4
PREFIX = "autopar/update/"
# How long one pair operation may wait. A server waits for a worker's next push as long as that
# worker computes (a straggler included), so this is generous; a dead worker is noticed sooner,
# by its closed connection.
PAIR_TIMEOUT = datetime.timedelta(minutes=30)

PieceKey = tuple[str, tuple[int, ...]]  # (parameter fqn, coordinates of the piece on its split axes)


def launcher_store(generation: int | None) -> dist.Store:
    """A client of the store the launcher (torchrun, or rank 0 of an ``env://`` job) serves at
    ``MASTER_ADDR:MASTER_PORT``, under :data:`PREFIX` and ``generation`` (how many modules this job
    compiled under an update mode before: each one's workers and servers meet apart; None: the
    keys of no module, such as a restarted rank's own group)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = "job" if generation is None else generation
    return dist.PrefixStore(f"{PREFIX}{where}/", dist.TCPStore(host, port, is_master=False))


def pair_group(store: dist.Store, server: int, worker: int, incarnation: int, on_server: bool) -> Any:
    """The two-rank gloo group of ``server`` and ``worker``'s ``incarnation`` (blocks until both
    sides build it)."""
    prefixed = dist.PrefixStore(f"pair/{server}/{worker}/{incarnation}/", store)
    return dist.ProcessGroupGloo(prefixed, 0 if on_server else 1, 2, PAIR_TIMEOUT)


def join_key(worker: int, incarnation: int) -> str:
    """The store key a worker sets when its ``incarnation`` is ready to meet the servers."""
    return f"join/{worker}/{incarnation}"


def send_header(pg: Any, peer: int, kind: int, clock: int = 0, a: int = 0, b: int = 0) -> None:
    pg.send([torch.tensor([kind, clock, a, b], dtype=torch.int64)], peer, 0).wait()


def recv_header(pg: Any, peer: int) -> list[int]:
    header = torch.zeros(HEADER, dtype=torch.int64)
    pg.recv([header], peer, 0).wait()
    return header.tolist()


def send_object(pg: Any, peer: int, obj: object) -> None:
    """``obj`` pickled: its length, then its bytes (the peer must :func:`recv_object`)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    pg.send([torch.tensor([data.numel()], dtype=torch.int64)], peer, 0).wait()
    pg.send([data], peer, 0).wait()


def recv_object(pg: Any, peer: int) -> Any:
    """What :func:`send_object` sent. Only ever between ranks of one job (the optimizer class and
    options a worker chose, the pieces it holds), so unpickling trusts its peer."""
    size = torch.zeros(1, dtype=torch.int64)
    pg.recv([size], peer, 0).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    pg.recv([data], peer, 0).wait()
    return pickle.loads(data.numpy().tobytes())


Like = Sequence[tuple[tuple[int, ...], torch.dtype]]  # (shape, dtype) of each tensor, in order


def send_tensors(pg: Any, peer: int, tensors: Sequence[torch.Tensor]) -> None:
    """``tensors`` in one message per dtype (the peer knows their shapes and dtypes)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    for group in by_dtype.values():
        pg.send([torch.cat(group)], peer, 0).wait()


def recv_tensors(pg: Any, peer: int, like: Like) -> list[torch.Tensor]:
    """The tensors :func:`send_tensors` sent, shaped and typed as ``like``."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_shape, dtype) in enumerate(like):
        by_dtype.setdefault(dtype, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(like)
    for dtype, indices in by_dtype.items():
        sizes = [math.prod(like[i][0]) for i in indices]
        flat = torch.empty(sum(sizes), dtype=dtype)
        pg.recv([flat], peer, 0).wait()
        for i, piece in zip(indices, flat.split(sizes)):
            out[i] = piece.view(like[i][0])
    return out  # type: ignore[return-value]
