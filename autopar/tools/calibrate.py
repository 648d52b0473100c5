"""Calibration: time this host, or a torchrun world, with gloo ranks all running at once.

Run by ``autopar calibrate -o cluster.json`` (a cluster file that ``plan``/``compile`` take as
``cluster="cluster.json"``; :func:`run_calibrate`) and by ``bench/calibrate_cpu_gloo.py`` (the
``cpu-gloo`` preset's constants; :func:`measure_cpu_gloo`), never at plan time: every rank must
compute the same plan from the same figures. Both run :func:`_measure_world` on every rank: under
torchrun on its world, otherwise on ranks spawned on this host.
"""

from __future__ import annotations

import json
import math
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
from autopar.planning.cost.model import ONE_HOST, Cluster, LinkSpec, ring_terms, this_machine
from autopar.tools.launch import init_restartable_process_group, spawn
from autopar.tools.rank_speed import (
    MEASURED_DTYPES,
    attention_rates,
    attention_times,
    function_rates,
    matmul_flops,
    median_seconds,
    memory_bandwidth,
    op_overhead,
    optimizer_tensor,
    recompute_overhead,
    transcendentals,
)

_FIT_ROUNDS = 20  # reweightings of fit_ring's least squares (it settles in a few)
_STALLED = 2.0  # a collective this many times slower than its fit stalled (fit_ring leaves it out)
_BURSTS = (2, 8, 32, 128)  # 256 x 256 fp32 products per burst timed for straggling
_BURST_REPEATS = 7  # per round
# the bursts' series, repeated: a wait per burst size is their median. One round's waits, or a
# few rounds', scatter widely on a shared host and move a prediction summing many waits with them
# (the spread measured: docs/cost_model.md, "stragglers")
_BURST_ROUNDS = 12
# 1 KiB .. 16 MiB input per rank: the small ones fix latency, the large ones bandwidth; larger
# buffers add little to the fit but seconds to a run (an all_gather's output is n times its input).
_COLLECTIVE_BYTES = tuple(1 << k for k in range(10, 25, 2))
# The cluster's link fields, innermost first; a world is split into groups for each.
LEVELS = ("intra_node", "inter_node")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _straggling() -> dict[str, Any]:
    """How long a synchronising collective waits for its slowest rank after the ranks compute apart.

    Every rank computes bursts of :data:`_BURSTS` products (short to long beside a scheduler's
    slice on a rank sharing a core), each followed by a one-element all_reduce over the world,
    in :data:`_BURST_ROUNDS` rounds of the whole series; it returns, per round and burst size,
    its typical burst (the median) and the mean span of burst and all_reduce (a step adds spans
    up), and per round the all_reduce's time back to back; :func:`_straggle` turns every rank's
    into the figure.
    """
    a, one = torch.randn(256, 256), torch.zeros(1)
    back_to_back, rounds = [], []
    for _ in range(_BURST_ROUNDS):
        # timed in every round, as the bursts are: once, a slow moment of the host put it above
        # every burst's wait and the calibration priced no stragglers at all
        back_to_back.append(median_seconds(lambda: dist.all_reduce(one), 11))
        bursts = []
        for products in _BURSTS:
            own, spans = [], []
            for _ in range(_BURST_REPEATS):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(products):
                    torch.mm(a, a)
                computed = time.perf_counter()
                dist.all_reduce(one)
                own.append(computed - start)
                spans.append(time.perf_counter() - start)
            bursts.append((statistics.median(own), statistics.mean(spans)))
        rounds.append(bursts)
    return {"back_to_back": back_to_back, "rounds": rounds}


def _straggle(per_rank: list[dict[str, Any]]) -> tuple[float, float]:
    """``(Cluster.straggler_base_s, Cluster.straggler_s)`` from every rank's :func:`_straggling`:
    a burst's wait is the slowest rank's mean span less its typical burst (what the cost model
    prices) and the all_reduce back to back (what its latency prices), the median over the rounds
    (one round's fit scatters: docs/cost_model.md), each round less its own
    back-to-back time; fitted to ``straggler_base_s + straggler_s * sqrt(burst / 1 s)`` by least
    squares with both figures at least 0 (both 0 where the ranks never wait)."""
    rows = []
    for size in range(len(per_rank[0]["rounds"][0])):
        bursts, waits = [], []
        for round_ in range(len(per_rank[0]["rounds"])):
            timed = [r["rounds"][round_][size] for r in per_rank]
            burst = max(own for own, _ in timed)
            bursts.append(burst)
            b2b = max(r["back_to_back"][round_] for r in per_rank)
            waits.append(max(span for _, span in timed) - burst - b2b)
        rows.append((math.sqrt(statistics.median(bursts)), statistics.median(waits)))
    n, sx, sy = len(rows), sum(x for x, _ in rows), sum(y for _, y in rows)
    sxx, sxy = sum(x * x for x, _ in rows), sum(x * y for x, y in rows)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    base = (sy - slope * sx) / n
    if slope < 0:  # the waits do not grow with the compute before them: a constant
        return max(0.0, sy / n), 0.0
    if base < 0:  # they grow from nothing
        return 0.0, max(0.0, sxy / sxx)
    return base, slope


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
            samples[kind.value].append((size, median_seconds(call, 25 if nbytes < 1 << 22 else 7)))
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


def threads_per_rank(ranks: int) -> int:
    """The threads each of ``ranks`` ranks calibrate spawns on this host computes with: an equal
    share of the cores, at least one (under torchrun a rank keeps the threads it was given)."""
    return max(1, (os.cpu_count() or 1) // ranks)


def _measure_world(per_node: int, threads: int) -> dict[str, Any] | None:
    """Measure from every rank of an initialised gloo world of nodes of ``per_node`` ranks each,
    each rank computing on ``threads`` threads.

    All ranks time compute, memory and the per-op overhead at once, as they contend in a real
    run; then collectives on each level's groups (:func:`_level_groups`), then their waits for
    stragglers. Rank 0 returns the slowest rank's figures (:func:`_slowest`), the others None.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(threads)
    # the memory bandwidth a rank gets moves with what else the host's memory serves, from one
    # minute to the next (docs/cost_model.md): the median of six windows spread over the
    # calibration, one between each of its measurements
    measurements: dict[str, Callable[[], Any]] = {
        "peak_flops": lambda: {dtype_name(dtype): matmul_flops(dtype) for dtype in MEASURED_DTYPES},
        "transcendentals_per_s": transcendentals,
        "attention": attention_times,
        "function_rates": function_rates,
        "op_overhead_s": op_overhead,
        "recompute_unit_s": recompute_overhead,
        "checkpoint_unit_s": lambda: recompute_overhead(selective=False),
        "optimizer_tensor_s": lambda: optimizer_tensor(bandwidths[-1]),
    }
    bandwidths, mine = [], {}
    for name, measure in measurements.items():
        bandwidths.append(memory_bandwidth())
        mine[name] = measure()
    mine.update(
        # one thread each where ranks outnumber cores (above): they take turns on them
        ranks_per_core=max(1.0, per_node / (os.cpu_count() or 1)),
        threads_per_rank=threads,
        memory_bytes=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // per_node,
        host=this_machine(),
        ranks={},
        links={},
    )
    bandwidths.append(memory_bandwidth())
    for level, groups in _level_groups(world, per_node).items():
        # every rank creates every group of the level, in the same order, as new_group requires
        group, _ = dist.new_subgroups_by_enumeration(groups)
        mine["ranks"][level] = len(groups[0])
        mine["links"][level] = _collective_samples(group, len(groups[0]))
    bandwidths.append(memory_bandwidth())
    # last, with the levels' groups in place as a run has its mesh's: timed before them, the waits
    # read well below those of a run and tensor parallelism was priced fast (docs/cost_model.md)
    mine["straggling"] = _straggling()
    mine["memory_bandwidth_Bps"] = statistics.median([*bandwidths, memory_bandwidth()])
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
        "transcendentals_per_s": min(r["transcendentals_per_s"] for r in per_rank),
        "function_rates": {f: min(r["function_rates"][f] for r in per_rank) for f in first["function_rates"]},
        # each call's slowest rank, fitted at the slowest rank's product rate
        "attention": attention_rates(
            tuple(max(r["attention"][i] for r in per_rank) for i in range(3)),
            min(r["peak_flops"]["float32"] for r in per_rank),
        ),
        "op_overhead_s": max(r["op_overhead_s"] for r in per_rank),
        "recompute_unit_s": max(r["recompute_unit_s"] for r in per_rank),
        "checkpoint_unit_s": max(r["checkpoint_unit_s"] for r in per_rank),
        "optimizer_tensor_s": max(r["optimizer_tensor_s"] for r in per_rank),
        "stragglers": _straggle([r["straggling"] for r in per_rank]),
        "ranks_per_core": max(r["ranks_per_core"] for r in per_rank),
        "threads_per_rank": _same([r["threads_per_rank"] for r in per_rank]),
        "memory_bytes": min(r["memory_bytes"] for r in per_rank),
        "hosts": [r["host"] for r in per_rank],
        "world": len(per_rank),
        "ranks": first["ranks"],
        "links": links,
    }


def _same(values: list[int]) -> int | None:
    """The value every rank gave, None where they differ."""
    return values[0] if len(set(values)) == 1 else None


def _slowest_times(per_rank: Iterable[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Each size's slowest time over the ranks' ``(B, seconds)`` lists (every rank timed the same
    sizes in the same order)."""
    return [(row[0][0], max(t for _, t in row)) for row in zip(*per_rank)]


def fit_ring(kind: CollectiveKind | str, samples: Sequence[tuple[int, float]], n: int) -> LinkSpec:
    """The link whose ring formula for ``kind`` over ``n`` ranks (:func:`ring_terms`: time =
    hops alpha + share B/beta) best fits the ``(B, seconds)`` samples.

    Least squares on the error relative to the fitted time, so microsecond small-message times
    weigh as much as the large ones that fix the bandwidth; a negative latency is clamped to 0.
    Relative to the fitted time, not the measured one: a sample that came out fast by chance (on
    ranks sharing cores, a call now and then runs at a lucky moment) would otherwise weigh the
    more the faster it was, and drag the latency down to it. A call that stalled instead (slower
    than one of more bytes, or :data:`_STALLED` times its fit) is left out, down to 3 samples.
    Samples that lie on such a formula are reproduced exactly by ``CostModel.collective_time``.
    """
    kept = sorted(samples)
    while True:
        fit = _fit_relative(kept)
        if fit is not None:
            c0, c1 = fit
            ratio, worst = max((t / (max(c0, 0.0) + c1 * b), i) for i, (b, t) in enumerate(kept))
            if ratio <= _STALLED:
                break
        else:  # time does not grow with size: the call most slower than a larger one stalled
            ratio, worst = max((t / min(u for _, u in kept[i:]), i) for i, (_, t) in enumerate(kept))
        if len(kept) <= 3 or ratio <= 1.0:
            raise RuntimeError(f"{kind} time does not grow with size, cannot fit bandwidth: {samples}")
        del kept[worst]
    hops, share = ring_terms(CollectiveKind(kind), n)
    return LinkSpec(latency_s=max(c0, 0.0) / hops, bandwidth_Bps=share / c1)


def _fit_relative(samples: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """``(c0, c1)`` of t = c0 + c1 B fitted to the samples relative to the fitted time (see
    :func:`fit_ring`); None where the slope comes out not positive."""
    # minimise sum w (c0 + c1 B - t)^2 with w = 1 / fitted^2, reweighting from w = 1 / t^2 (the
    # relative error to the measurement) until the fit settles.
    fitted = [t for _, t in samples]
    for _ in range(_FIT_ROUNDS):
        w = [1 / f**2 for f in fitted]
        s00, s01 = sum(w), sum(wi * b for wi, (b, _) in zip(w, samples))
        s11 = sum(wi * b * b for wi, (b, _) in zip(w, samples))
        r0 = sum(wi * t for wi, (_, t) in zip(w, samples))
        r1 = sum(wi * b * t for wi, (b, t) in zip(w, samples))
        det = s00 * s11 - s01 * s01
        c0, c1 = (r0 * s11 - r1 * s01) / det, (r1 * s00 - r0 * s01) / det
        if c1 <= 0:
            return None
        fitted = [max(c0, 0.0) + c1 * b for b, _ in samples]
    return c0, c1


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
        op_overhead_s=measured["op_overhead_s"],
        recompute_unit_s=measured["recompute_unit_s"],
        checkpoint_unit_s=measured["checkpoint_unit_s"],
        optimizer_tensor_s=measured["optimizer_tensor_s"],
        straggler_base_s=measured["stragglers"][0],
        straggler_s=measured["stragglers"][1],
        ranks_per_core=measured["ranks_per_core"],
        threads_per_rank=measured["threads_per_rank"],
        transcendentals_per_s=measured["transcendentals_per_s"],
        function_rates=measured["function_rates"],
        attention=measured["attention"],
        **links,
    )
    return cluster, notes


def measure_cpu_gloo(world_size: int = 2, name: str = "cpu-gloo", measured_on: str = "") -> Cluster:
    """Measure this host as a cluster called ``name`` of ``world_size`` ranks (takes ~half a minute).

    Spawns ``world_size`` gloo processes on 127.0.0.1, each with an equal share of the cores, and
    runs :func:`_measure_world` on them as one node; every mesh axis stays inside it
    (``devices_per_node`` is ``ONE_HOST``). ``measured_on`` names the machine in a cluster file
    (see :func:`autopar.planning.cost.model.load_cluster`).
    """
    return _cluster(_spawned(world_size), ONE_HOST, name, measured_on)[0]


def _spawned(world_size: int) -> dict[str, Any]:
    if world_size < 2:
        raise OptionError(f"measuring collectives needs at least 2 ranks, got {world_size}")
    # spawn re-raises a failed rank's error here, so a crash never hangs the caller.
    return spawn(_measure_world, world_size, world_size, threads_per_rank(world_size))[0]


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun started (its world is then the one measured)."""
    return all(name in os.environ for name in _TORCHRUN_ENV)


def _measured_under_torchrun() -> dict[str, Any] | None:
    """:func:`_measure_world` on torchrun's world, nodes of ``LOCAL_WORLD_SIZE`` ranks; None off rank 0."""
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.is_available():
        raise OptionError(
            "autopar calibrate times CPU ranks over gloo, and this world has GPUs, whose rates it would not "
            "measure: time one GPU with `autopar calibrate --device cuda -o F` (its links from a preset)"
        )
    if world < 2 or world % per_node:
        raise OptionError(
            f"calibrate needs at least 2 ranks in nodes of equal size, got {world} ranks, {per_node} per node"
        )
    init_restartable_process_group("gloo")
    try:
        # the threads the launcher gave this rank (torchrun: OMP_NUM_THREADS, 1 by default with
        # several ranks per node), with which a training run it launches the same way computes
        return _measure_world(per_node, torch.get_num_threads())
    finally:
        dist.destroy_process_group()


def run_calibrate(path: str, ranks: int | None, device: str | None = None, links: str | None = None) -> str:
    """``autopar calibrate``: measure, write the cluster (named ``calibrated``) to ``path`` as JSON,
    and return what to print; "" on every rank but 0 under torchrun, which writes nothing.

    With ``device`` this process times that one device, its links from the preset ``links``
    (:func:`autopar.tools.calibrate_device.measure_device`; not with ``ranks``, nor under
    torchrun). Under torchrun (:func:`under_torchrun`) its world is measured and
    ``devices_per_node`` is ``LOCAL_WORLD_SIZE``; ``ranks``, if given, must be its world size.
    Otherwise ``ranks`` (default 2) gloo ranks are spawned on this host, as one node. The file
    is marked as measured on this host (``measured_on``), unless the ranks ran on several hosts:
    then it is left empty, so that every host of the world can load it.
    """
    if device is not None or links is not None:
        return _run_one_device(path, ranks, device, links)
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


def _run_one_device(path: str, ranks: int | None, device: str | None, links: str | None) -> str:
    from autopar.tools.calibrate_device import device_report, measure_device

    if device is None:
        raise OptionError("--links names the preset one device's links come from: give --device too")
    if ranks is not None or under_torchrun():
        raise OptionError(
            "--device times one device in this process: without --ranks, and not under torchrun"
        )
    cluster, notes = measure_device(device, links)
    Path(path).write_text(json.dumps(cluster.to_dict(), indent=1))
    return "\n".join([*device_report(cluster, device), *notes, f"cluster written to {path}"])


def _report(cluster: Cluster, measured: dict[str, Any], notes: list[str], path: str) -> str:
    flops = ", ".join(f"{d} {f / 1e9:.1f}" for d, f in cluster.peak_flops.items())
    nodes = "one node" if cluster.devices_per_node == ONE_HOST else f"nodes of {cluster.devices_per_node}"
    threads = cluster.threads_per_rank
    each = f"on {threads} thread{'s' if threads != 1 else ''} each" if threads else "on differing threads"
    hosts = ", ".join(sorted(set(measured["hosts"])))
    lines = [
        f"{measured['world']} ranks at once ({nodes}, {each}) on {hosts}: "
        f"GFLOP/s per rank {flops}; memory {cluster.memory_bandwidth_Bps / 1e9:.2f} GB/s; "
        f"{(cluster.transcendentals_per_s or 0) / 1e9:.2f} G exp/s; G values/s "
        f"{', '.join(f'{f} {rate / 1e9:.2f}' for f, rate in cluster.function_rates.items())}; "
        f"{cluster.op_overhead_s * 1e6:.1f} us per op, {(cluster.recompute_unit_s or 0) * 1e6:.0f} us "
        "per unit of a recompute region (an op or a tensor it saves; "
        f"{(cluster.checkpoint_unit_s or 0) * 1e6:.0f} us without collectives), "
        f"{(cluster.optimizer_tensor_s or 0) * 1e6:.0f} us per tensor of the "
        f"optimizer step; {cluster.attention.describe() if cluster.attention else 'attention not timed'}; "
        f"a collective waits {cluster.straggler_base_s * 1e3:.1f} ms for stragglers, "
        f"and {cluster.straggler_s * 1e3:.1f} ms more after 1 s of compute"
    ]
    for level, ranks in measured["ranks"].items():
        kinds = "; ".join(
            f"{kind} {link.latency_s * 1e6:.0f} us {link.bandwidth_Bps / 1e9:.2f} GB/s"
            for kind, link in getattr(cluster, level).collectives.items()
        )
        lines.append(f"{level}, groups of {ranks}: {kinds}")
    return "\n".join([*lines, *notes, f"cluster written to {path}"])
