"""Calibration: :func:`measure_cpu_gloo` times this host with gloo ranks all running at once.

Run by ``autopar calibrate -o cluster.json`` (a cluster file that ``plan``/``compile`` take as
``cluster="cluster.json"``) and by ``bench/calibrate_cpu_gloo.py`` (the ``cpu-gloo`` preset's
constants), never at plan time: every rank must compute the same plan from the same figures.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.ir.options import dtype_name
from autopar.planning.cost import ONE_HOST, Cluster, LinkSpec, this_machine
from autopar.tools.launch import free_port

_MEASURED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MATMUL_N = 2048
_MEMORY_NUMEL = 1 << 25  # 128 MiB per fp32 tensor: far beyond any cache
_ALL_REDUCE_BYTES = tuple(1 << k for k in range(10, 27, 2))  # 1 KiB .. 64 MiB


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    # Median, not min: on a shared 2-core host single calls stall for a scheduler tick
    # (~4 ms) now and then, and the plan should price the typical call, not the luckiest.
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_flops(dtype: torch.dtype) -> float:
    # The largest square up to _MATMUL_N whose product takes under 50 ms: a dtype the CPU has no
    # fast kernel for (fp16 on some: 0.3 GFLOP/s) is timed on a small one rather than for minutes.
    n = 256
    while n < _MATMUL_N and _one_product_seconds(n, dtype) < 0.05:
        n *= 2
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    dist.barrier()
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b), 11)


def _one_product_seconds(n: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return _median_seconds(lambda: torch.mm(a, b), 1, warmup=0)


def _memory_bandwidth() -> float:
    x, y, out = (torch.rand(_MEMORY_NUMEL) for _ in range(3))
    dist.barrier()
    # add reads two buffers and writes one
    return 3 * x.nbytes / _median_seconds(lambda: torch.add(x, y, out=out), 11)


def _all_reduce_seconds(nbytes: int) -> float:
    buf = torch.zeros(nbytes // 4)
    dist.barrier()
    return _median_seconds(lambda: dist.all_reduce(buf), 25 if nbytes < 1 << 24 else 7)


def _measure_rank(rank: int, world_size: int, port: int, out_path: str) -> None:
    """One calibration rank. All ranks time compute and memory together, as they would
    contend in a real run; rank 0 writes its figures and the all_reduce timings as JSON."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        measured = {
            "peak_flops": {dtype_name(dtype): _matmul_flops(dtype) for dtype in _MEASURED_DTYPES},
            "memory_bandwidth_Bps": _memory_bandwidth(),
            "all_reduce": [(nbytes, _all_reduce_seconds(nbytes)) for nbytes in _ALL_REDUCE_BYTES],
        }
        if rank == 0:
            Path(out_path).write_text(json.dumps(measured))
    finally:
        dist.destroy_process_group()


def _fit_ring_all_reduce(samples: list[tuple[int, float]], world_size: int) -> LinkSpec:
    """Fit t = 2(n-1) alpha + 2(n-1)/n B/beta to (B, t) samples.

    Least squares on relative error, so microsecond small-message times weigh as much
    as the large ones that fix the bandwidth.
    """
    n = world_size
    # t = c0 + c1 * B; minimise sum ((c0 + c1 B) / t - 1)^2 via the 2x2 normal equations.
    rows = [(1 / t, b / t) for b, t in samples]
    s00 = sum(u * u for u, _ in rows)
    s01 = sum(u * v for u, v in rows)
    s11 = sum(v * v for _, v in rows)
    r0 = sum(u for u, _ in rows)
    r1 = sum(v for _, v in rows)
    det = s00 * s11 - s01 * s01
    c0 = (r0 * s11 - r1 * s01) / det
    c1 = (r1 * s00 - r0 * s01) / det
    if c1 <= 0:
        raise RuntimeError(f"all_reduce time does not grow with size, cannot fit bandwidth: {samples}")
    return LinkSpec(latency_s=max(c0, 0.0) / (2 * (n - 1)), bandwidth_Bps=2 * (n - 1) / n / c1)


def measure_cpu_gloo(world_size: int = 2, name: str = "cpu-gloo", measured_on: str = "") -> Cluster:
    """Measure this host as a cluster called ``name`` of ``world_size`` ranks (takes ~a minute).

    Spawns ``world_size`` gloo processes on 127.0.0.1, each with an equal share of the
    cores. FLOP/s per dtype come from square matmuls (2048, or smaller for a dtype slow on this
    CPU), memory bandwidth from a 128 MiB
    fp32 add (3 buffers moved), both with every rank busy; the link from all_reduce at
    1 KiB..64 MiB fitted to the ring model. Memory per device is physical RAM / world_size.
    ``measured_on`` names the machine in a cluster file (see :func:`autopar.planning.cost.load_cluster`).
    """
    if world_size < 2:
        raise ValueError(f"measuring collectives needs world_size >= 2, got {world_size}")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "measured.json")
        # spawn re-raises a failed rank's exception here, so a crash never hangs the caller.
        mp.spawn(_measure_rank, args=(world_size, free_port(), out_path), nprocs=world_size)
        measured = json.loads(Path(out_path).read_text())
    link = _fit_ring_all_reduce(measured["all_reduce"], world_size)
    return Cluster(
        name=name,
        peak_flops=measured["peak_flops"],
        memory_bandwidth_Bps=measured["memory_bandwidth_Bps"],
        memory_bytes=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // world_size,
        devices_per_node=ONE_HOST,
        intra_node=link,
        inter_node=link,
        measured_on=measured_on,
    )


def write_cluster_file(path: str, ranks: int) -> Cluster:
    """``autopar calibrate``: measure this host with ``ranks`` gloo ranks at once and write the
    cluster (named ``calibrated``, marked as this machine's) to ``path`` as JSON."""
    cluster = measure_cpu_gloo(ranks, name="calibrated", measured_on=this_machine())
    Path(path).write_text(json.dumps(cluster.to_dict(), indent=1))
    return cluster
