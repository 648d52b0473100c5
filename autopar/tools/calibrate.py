"""Calibration: time this host, or a torchrun world, with gloo ranks all running at once.

Run by ``autopar calibrate -o cluster.json`` (a cluster file that ``plan``/``compile`` take as
``cluster="cluster.json"``; :func:`run_calibrate`) and by ``bench/calibrate_cpu_gloo.py`` (the
``cpu-gloo`` preset's constants; :func:`measure_cpu_gloo`), never at plan time: every rank must
compute the same plan from the same figures. Both run :func:`_measure_world` on every rank: under
torchrun on its world, otherwise on ranks spawned on this host.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.ir.errors import OptionError
from autopar.ir.options import dtype_name
from autopar.ir.plan import CollectiveKind
from autopar.planning.cost import ONE_HOST, Cluster, LinkSpec, ring_terms, this_machine
from autopar.tools.launch import init_restartable_process_group, spawn

_MEASURED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MATMUL_N = 2048
_MEMORY_NUMEL = 1 << 25  # 128 MiB per fp32 tensor: far beyond any cache
# 1 KiB .. 16 MiB input per rank: the small ones fix latency, the large ones bandwidth; larger
# buffers add little to the fit but seconds to a run (an all_gather's output is n times its input).
_COLLECTIVE_BYTES = tuple(1 << k for k in range(10, 25, 2))
# The cluster's link fields, innermost first; a world is split into groups for each.
LEVELS = ("intra_node", "inter_node")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


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


def _collective_call(
    kind: CollectiveKind, nbytes: int, group: dist.ProcessGroup, n: int
) -> tuple[int, Callable[[], object]]:
    """``(B, call)``: a call running ``kind`` over ``group`` (``n`` ranks) on an fp32 input of B
    bytes per rank, B as ``Collective.bytes`` means it, and the runtime's own calls
    (``autopar/runtime/collectives.py``). B is ``nbytes`` rounded down to whole pieces of n."""
    x = torch.zeros(nbytes // 4 // n * n)
    if kind == CollectiveKind.ALL_GATHER:
        out = x.new_empty(n * x.numel())
        return x.nbytes, lambda: dist.all_gather_single(out, x, group=group)
    if kind == CollectiveKind.REDUCE_SCATTER:
        out = x.new_empty(x.numel() // n)
        return x.nbytes, lambda: dist.reduce_scatter_single(out, x, group=group)
    if kind == CollectiveKind.ALL_TO_ALL:
        out = torch.empty_like(x)
        return x.nbytes, lambda: dist.all_to_all_single(out, x, group=group)
    return x.nbytes, lambda: dist.all_reduce(x, group=group)


def _collective_samples(group: dist.ProcessGroup, n: int) -> dict[str, list[tuple[int, float]]]:
    """``{kind: [(B, seconds), ...]}`` of every collective kind over ``group`` at every size.

    Every rank of the world calls this at once, each on its own group of the level, so the
    world barrier before each timing starts all groups together, as they would run in a step.
    """
    samples: dict[str, list[tuple[int, float]]] = {}
    for kind in CollectiveKind:
        samples[kind.value] = []
        for nbytes in _COLLECTIVE_BYTES:
            size, call = _collective_call(kind, nbytes, group, n)
            dist.barrier()
            samples[kind.value].append((size, _median_seconds(call, 25 if nbytes < 1 << 22 else 7)))
    return samples


def _level_groups(world: int, per_node: int) -> dict[str, list[list[int]]]:
    """The rank groups each node level is measured on, levels of one rank left out: the ranks of
    each node (``intra_node``), and the ranks of one local index on every node (``inter_node``).
    Ranks are numbered node by node, as torchrun numbers them."""
    groups = {
        "intra_node": [list(range(k, k + per_node)) for k in range(0, world, per_node)],
        "inter_node": [list(range(i, world, per_node)) for i in range(per_node)],
    }
    return {level: g for level, g in groups.items() if len(g[0]) > 1}


def _measure_world(per_node: int) -> dict[str, Any] | None:
    """Measure from every rank of an initialised gloo world of nodes of ``per_node`` ranks each.

    All ranks time compute and memory at once, each with its node's share of the cores, as they
    contend in a real run; then collectives on each level's groups (:func:`_level_groups`). Rank
    0 returns the slowest rank's figures (:func:`_slowest`), the others None.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    mine: dict[str, Any] = {
        "peak_flops": {dtype_name(dtype): _matmul_flops(dtype) for dtype in _MEASURED_DTYPES},
        "memory_bandwidth_Bps": _memory_bandwidth(),
        "memory_bytes": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // per_node,
        "host": this_machine(),
        "ranks": {},
        "links": {},
    }
    for level, groups in _level_groups(world, per_node).items():
        # every rank creates every group of the level, in the same order, as new_group requires
        group, _ = dist.new_subgroups_by_enumeration(groups)
        mine["ranks"][level] = len(groups[0])
        mine["links"][level] = _collective_samples(group, len(groups[0]))
    everyone: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    return _slowest(everyone) if everyone is not None else None


def _slowest(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's figures as one: the slowest rank's, since a step of ranks running the same
    program waits for the last; ``hosts`` lists each rank's host and ``world`` counts them."""
    first = per_rank[0]
    links = {
        level: {kind: _slowest_times(r["links"][level][kind] for r in per_rank) for kind in samples}
        for level, samples in first["links"].items()
    }
    return {
        "peak_flops": {d: min(r["peak_flops"][d] for r in per_rank) for d in first["peak_flops"]},
        "memory_bandwidth_Bps": min(r["memory_bandwidth_Bps"] for r in per_rank),
        "memory_bytes": min(r["memory_bytes"] for r in per_rank),
        "hosts": [r["host"] for r in per_rank],
        "world": len(per_rank),
        "ranks": first["ranks"],
        "links": links,
    }


def _slowest_times(per_rank: Iterable[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Each size's slowest time over the ranks' ``(B, seconds)`` lists (every rank timed the same
    sizes in the same order)."""
    return [(row[0][0], max(t for _, t in row)) for row in zip(*per_rank)]


def fit_ring(kind: CollectiveKind | str, samples: Sequence[tuple[int, float]], n: int) -> LinkSpec:
    """The link whose ring formula for ``kind`` over ``n`` ranks (:func:`ring_terms`: time =
    hops alpha + share B/beta) best fits the ``(B, seconds)`` samples.

    Least squares on relative error, so microsecond small-message times weigh as much as the
    large ones that fix the bandwidth; a negative latency is clamped to 0. Samples that lie on
    such a formula are reproduced exactly by ``CostModel.collective_time``.
    """
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
        raise RuntimeError(f"{kind} time does not grow with size, cannot fit bandwidth: {samples}")
    hops, share = ring_terms(CollectiveKind(kind), n)
    return LinkSpec(latency_s=max(c0, 0.0) / hops, bandwidth_Bps=share / c1)


def _fit_link(samples: dict[str, list[tuple[int, float]]], n: int) -> LinkSpec:
    """Each kind's own fit; the link's general figures are all_reduce's (the gradient sums'), which
    price what has no kind of its own (pipeline sends, the order of steps)."""
    kinds = {kind: fit_ring(kind, s, n) for kind, s in samples.items()}
    general = kinds[CollectiveKind.ALL_REDUCE]
    return LinkSpec(general.latency_s, general.bandwidth_Bps, kinds)


def _cluster(
    measured: dict[str, Any], devices_per_node: int, name: str, measured_on: str
) -> tuple[Cluster, list[str]]:
    """The cluster of :func:`_slowest`'s figures, and notes on what was not measured: a level
    with one rank per group (one node, or one rank per node) repeats the other level's link."""
    links = {level: _fit_link(s, measured["ranks"][level]) for level, s in measured["links"].items()}
    notes = []
    for level, other in (LEVELS, LEVELS[::-1]):
        if level not in links:
            links[level] = links[other]
            why = "one node" if level == "inter_node" else "one rank per node"
            notes.append(f"{level} not measured ({why}): it repeats the {other} figures")
    cluster = Cluster(
        name=name,
        peak_flops=measured["peak_flops"],
        memory_bandwidth_Bps=measured["memory_bandwidth_Bps"],
        memory_bytes=measured["memory_bytes"],
        devices_per_node=devices_per_node,
        measured_on=measured_on,
        **links,
    )
    return cluster, notes


def measure_cpu_gloo(world_size: int = 2, name: str = "cpu-gloo", measured_on: str = "") -> Cluster:
    """Measure this host as a cluster called ``name`` of ``world_size`` ranks (takes ~half a minute).

    Spawns ``world_size`` gloo processes on 127.0.0.1, each with an equal share of the cores, and
    runs :func:`_measure_world` on them as one node; every mesh axis stays inside it
    (``devices_per_node`` is ``ONE_HOST``). ``measured_on`` names the machine in a cluster file
    (see :func:`autopar.planning.cost.load_cluster`).
    """
    return _cluster(_spawned(world_size), ONE_HOST, name, measured_on)[0]


def _spawned(world_size: int) -> dict[str, Any]:
    if world_size < 2:
        raise OptionError(f"measuring collectives needs at least 2 ranks, got {world_size}")
    # spawn re-raises a failed rank's error here, so a crash never hangs the caller.
    return spawn(_measure_world, world_size, world_size)[0]


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun started (its world is then the one measured)."""
    return all(name in os.environ for name in _TORCHRUN_ENV)


def _measured_under_torchrun() -> dict[str, Any] | None:
    """:func:`_measure_world` on torchrun's world, nodes of ``LOCAL_WORLD_SIZE`` ranks; None off rank 0."""
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if world < 2 or world % per_node:
        raise OptionError(
            f"calibrate needs at least 2 ranks in nodes of equal size, got {world} ranks, {per_node} per node"
        )
    init_restartable_process_group("gloo")
    try:
        return _measure_world(per_node)
    finally:
        dist.destroy_process_group()


def run_calibrate(path: str, ranks: int | None) -> str:
    """``autopar calibrate``: measure, write the cluster (named ``calibrated``) to ``path`` as JSON,
    and return what to print; "" on every rank but 0 under torchrun, which writes nothing.

    Under torchrun (:func:`under_torchrun`) its world is measured and ``devices_per_node`` is
    ``LOCAL_WORLD_SIZE``; ``ranks``, if given, must be its world size. Otherwise ``ranks``
    (default 2) gloo ranks are spawned on this host, as one node. The file is marked as measured
    on this host (``measured_on``), unless the ranks ran on several hosts: then it is left empty,
    so that every host of the world can load it.
    """
    if under_torchrun():
        if ranks not in (None, int(os.environ["WORLD_SIZE"])):
            raise OptionError(f"--ranks {ranks} under torchrun, whose world has {os.environ['WORLD_SIZE']}")
        measured, devices_per_node = _measured_under_torchrun(), int(os.environ["LOCAL_WORLD_SIZE"])
        if measured is None:
            return ""
    else:
        measured, devices_per_node = _spawned(2 if ranks is None else ranks), ONE_HOST
    hosts = sorted(set(measured["hosts"]))
    cluster, notes = _cluster(measured, devices_per_node, "calibrated", hosts[0] if len(hosts) == 1 else "")
    if len(hosts) > 1:
        notes.append(f"measured on {len(hosts)} hosts: measured_on is left empty so each can load the file")
    Path(path).write_text(json.dumps(cluster.to_dict(), indent=1))
    return _report(cluster, measured, notes, path)


def _report(cluster: Cluster, measured: dict[str, Any], notes: list[str], path: str) -> str:
    flops = ", ".join(f"{d} {f / 1e9:.1f}" for d, f in cluster.peak_flops.items())
    nodes = "one node" if cluster.devices_per_node == ONE_HOST else f"nodes of {cluster.devices_per_node}"
    lines = [
        f"{measured['world']} ranks at once ({nodes}) on {', '.join(sorted(set(measured['hosts'])))}: "
        f"GFLOP/s per rank {flops}; memory {cluster.memory_bandwidth_Bps / 1e9:.2f} GB/s"
    ]
    for level, ranks in measured["ranks"].items():
        kinds = "; ".join(
            f"{kind} {link.latency_s * 1e6:.0f} us {link.bandwidth_Bps / 1e9:.2f} GB/s"
            for kind, link in getattr(cluster, level).collectives.items()
        )
        lines.append(f"{level}, groups of {ranks}: {kinds}")
    return "\n".join([*lines, *notes, f"cluster written to {path}"])
