"""The cost model: how long compute and communication take on a cluster.

All times are in seconds, all sizes in bytes, bandwidths in bytes per second.

Compute follows a roofline: ``max(flops / peak_flops[dtype] + the transcendentals' seconds,
bytes / memory_bandwidth)``, the transcendentals and timed functions priced by the cluster's
:class:`~autopar.planning.cost.device_model.DeviceModel`; on a GPU preset its
:class:`~autopar.planning.cost.efficiency.Efficiency` adds each kernel's floor and prices fused attention.
Communication follows the ring alpha-beta model, one mesh axis at a time, with the
link (latency alpha, per-rank one-direction bandwidth beta) of that axis: inside a
node or across nodes (as many adapters wide as the ring has ranks on a node, up to
``nics_per_node``). :meth:`CostModel.redistribute` turns a layout change into the collectives
DTensor would issue and prices them. ``docs/cost_model.md`` has the maths.

The hardware's figures are :class:`~autopar.planning.cost.cluster.Cluster`'s. Presets come from
:func:`get_cluster`. ``"cpu-gloo"`` holds constants measured once by
``bench/calibrate_cpu_gloo.py`` (which calls :func:`autopar.tools.calibrate.measure_cpu_gloo`);
presets never measure when read, because every rank must compute the same plan.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.ir.errors import OptionError
from autopar.ir.layout import Layout, piece_size
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import dtype_name
from autopar.ir.plan import CollectiveKind
from autopar.ir.redistribution_steps import (
    BACKWARD,
    ISSUE_ORDER,
    EdgeStep,
    State,
    StepKind,
    Walked,
    axis_states,
    plan_steps,
    split_dim,
    to_layout,
    walk,
)
from autopar.planning.cost.cluster import FALLBACK_DTYPE, ONE_HOST, Cluster, LinkSpec
from autopar.planning.cost.device_model import device_model
from autopar.planning.cost.efficiency import Efficiency


def ring_terms(kind: CollectiveKind, n: int) -> tuple[int, float]:
    """``(hops, share)`` of ``kind``'s ring formula over ``n`` ranks: it takes
    ``hops * alpha + share * B / beta`` (see :meth:`CostModel.collective_time`). Calibration fits
    each kind to these same terms, so a fitted kind reproduces its measurements."""
    if kind == CollectiveKind.ALL_GATHER:
        return n - 1, n - 1
    hops, share = n - 1, (n - 1) / n
    return (2 * hops, 2 * share) if kind == CollectiveKind.ALL_REDUCE else (hops, share)


def spanning(link: LinkSpec, wide: int, ceiling: float) -> LinkSpec:
    """``link`` crossed ``wide`` adapters at once (a ring with that many ranks on each node, each with its
    own adapter), its bandwidth and every collective's own at most ``ceiling`` (the node's inside link).

    Args:
        link: one adapter's figures (``Cluster.inter_node``).
        wide: adapters the ring's channels cross nodes through at once.
        ceiling: bytes per second a rank's ring moves inside the node.
    """

    def wider(spec: LinkSpec) -> LinkSpec:
        return LinkSpec(spec.latency_s, min(ceiling, wide * spec.bandwidth_Bps))

    return LinkSpec(
        link.latency_s,
        min(ceiling, wide * link.bandwidth_Bps),
        {kind: wider(spec) for kind, spec in link.collectives.items()},
    )


_PRESETS: dict[str, Cluster] = {
    # This development machine's two gloo ranks, measured once by bench/calibrate_cpu_gloo.py (each
    # figure the median of three runs; docs/cost_model.md, "Presets", has the runs, date and machine).
    "cpu-gloo": Cluster(
        name="cpu-gloo",
        peak_flops={"float32": 132e9, "bfloat16": 838e9, "float16": 144e9},
        memory_bandwidth_Bps=15.1e9,
        memory_bytes=12_638_255_104,  # physical RAM / 2 ranks
        devices_per_node=ONE_HOST,
        intra_node=LinkSpec(latency_s=211e-6, bandwidth_Bps=1.28e9),
        inter_node=LinkSpec(latency_s=211e-6, bandwidth_Bps=1.28e9),
        op_overhead_s=3.34e-6,
        straggler_s=9.15e-3,
    ),
    # Nodes of 8 H100-80GB SXM5 (DGX H100): the rates its kernels reach (a large bf16 product, torch's
    # elementwise kernels, NCCL's bus bandwidth), not the datasheet's peaks, and how smaller kernels fall
    # below them; docs/cost_model.md, "Presets", gives each figure, the vendor's beside it, and its source.
    # A GPU runs its kernels after their launch returns (asynchronous); no stragglers are known.
    "h100": Cluster(
        name="h100",
        peak_flops={"float32": 51.5e12, "bfloat16": 780e12, "float16": 780e12},
        memory_bandwidth_Bps=2.4e12,
        memory_bytes=80_000_000_000,
        devices_per_node=8,
        intra_node=LinkSpec(latency_s=3e-6, bandwidth_Bps=370e9),
        inter_node=LinkSpec(latency_s=10e-6, bandwidth_Bps=45e9),
        op_overhead_s=5e-6,
        asynchronous=True,
        host_link_Bps=64e9,
        host_memory_bandwidth_Bps=76.8e9,
        # torch's flash kernels are FlashAttention-2's, which Hopper runs far below its product rate
        efficiency=Efficiency(kernel_floor_s=6e-6, attention_fraction=0.45),
        nics_per_node=8,
    ),
    # Nodes of 8 A100-80GB SXM4 (DGX A100): NVLink 3 and eight 200 Gb/s HDR InfiniBand adapters per
    # node; achievable rates as for h100, docs/cost_model.md, "Presets", gives each figure and source.
    "a100": Cluster(
        name="a100",
        peak_flops={"float32": 16.8e12, "bfloat16": 268e12, "float16": 268e12},
        memory_bandwidth_Bps=1.63e12,
        memory_bytes=80_000_000_000,
        devices_per_node=8,
        intra_node=LinkSpec(latency_s=3e-6, bandwidth_Bps=230e9),
        inter_node=LinkSpec(latency_s=10e-6, bandwidth_Bps=22.5e9),
        op_overhead_s=5e-6,
        asynchronous=True,
        host_link_Bps=32e9,
        host_memory_bandwidth_Bps=50e9,
        efficiency=Efficiency(kernel_floor_s=6e-6, attention_fraction=0.7),
        nics_per_node=8,
    ),
    # Not a machine: slow compute and fast links, so that splitting pays even for the tiny
    # models of tests and benchmarks, whose plans then exercise real communication (with the
    # measured cpu-gloo figures the solver keeps such models on one rank). No op overhead and no
    # stragglers, so that its predictions are the operators' and collectives' alone.
    "fast-links": Cluster(
        name="fast-links",
        peak_flops={"float32": 1e9},
        memory_bandwidth_Bps=1e10,
        memory_bytes=10**10,
        devices_per_node=8,
        intra_node=LinkSpec(latency_s=1e-6, bandwidth_Bps=1e10),
        inter_node=LinkSpec(latency_s=1e-6, bandwidth_Bps=1e10),
    ),
}


def get_cluster(name: str | os.PathLike) -> Cluster:
    """The preset called ``name``, or the cluster file at path ``name`` (``.json``, written by
    ``autopar calibrate``: see :func:`load_cluster`); an
    :class:`~autopar.ir.errors.OptionError` lists the presets otherwise.

    Args:
        name: a preset's name (in its case), or a path (a string or ``os.PathLike``) ending in ``.json``.
    """
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if isinstance(name, str) and name.endswith(".json"):
        return load_cluster(name)
    if not isinstance(name, str) or name not in _PRESETS:
        case = [p for p in _PRESETS if isinstance(name, str) and p.lower() == name.lower()]
        raise OptionError(
            f"cluster must be a preset name, a cluster file (.json, from autopar calibrate) or an "
            f"autopar.Cluster, got {name!r}; presets are {sorted(_PRESETS)}"
            + (f" (names are case-sensitive: did you mean {case[0]!r}?)" if case else "")
        )
    return _PRESETS[name]


def this_machine() -> str:
    """How a cluster file names the machine it was measured on: the host name."""
    return socket.gethostname()


def _once_each(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys are distinct (``json`` keeps the last of a key given twice)."""
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"key {twice[0]!r} is given twice in one object; give each field once")
    return dict(pairs)


def load_cluster(path: str | Path) -> Cluster:
    """The cluster a file written by ``autopar calibrate`` describes.

    A file that is missing, is not JSON or lacks a field, or that was measured on another
    machine (its ``measured_on`` is not this host's name: the figures are that machine's)
    is an :class:`~autopar.ir.errors.OptionError` saying which and what to do.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=_once_each)
    except FileNotFoundError:
        raise OptionError(
            f"cluster file {path} does not exist; measure this machine with `autopar calibrate -o {path}`"
        ) from None
    except IsADirectoryError:
        raise OptionError(f"cluster file {path} is a folder; give the .json file inside it") from None
    except (OSError, ValueError) as e:  # ValueError: JSON's errors and UnicodeDecodeError
        raise OptionError(f"cluster file {path} cannot be read as JSON: {e}") from None
    try:
        cluster = Cluster.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise OptionError(f"cluster file {path} is malformed: missing or bad field {e}") from None
    if cluster.measured_on and cluster.measured_on != this_machine():
        raise OptionError(
            f"cluster file {path} was measured on {cluster.measured_on!r}, not on this machine "
            f"({this_machine()!r}): measure here with `autopar calibrate`, or empty its measured_on "
            "field to plan with another machine's figures"
        )
    return cluster


@dataclass(frozen=True)
class Collective:
    """One collective over one mesh axis.

    ``bytes`` is the size of the collective's INPUT buffer on each rank: for
    ``all_gather`` the local shard (the output is axis-size times larger), for
    ``reduce_scatter`` and ``all_reduce`` the full local buffer, for ``all_to_all`` the
    local buffer. Runtime byte counters are compared against this figure.
    """

    kind: CollectiveKind  # a plain string naming one is converted
    mesh_axes: tuple[str, ...]
    bytes: int

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", CollectiveKind(self.kind))
        except ValueError:
            kinds = sorted(k.value for k in CollectiveKind)
            raise ValueError(f"unknown collective kind {self.kind!r}; expected one of {kinds}") from None
        if self.bytes < 0:
            raise ValueError(f"collective bytes must be >= 0, got {self.bytes}")


# The steps that are collectives in forward, and which collective each is.
_COLLECTIVE_OF = {StepKind(kind.value): kind for kind in CollectiveKind}


class CostModel:
    """Prices compute and communication of one mesh on one cluster.

    ``mesh`` is a :class:`MeshSpec` or anything :meth:`MeshSpec.of` reads, e.g. ``{"dp": 2, "tp": 4}``.
    """

    def __init__(self, mesh: MeshSpec | Mapping[str, int], cluster: Cluster) -> None:
        self.mesh = MeshSpec.of(mesh)
        self.cluster = cluster
        self.device = device_model(cluster)  # what the cluster's device spends beyond the roofline
        self._links = tuple(self._axis_link(i) for i in range(self.mesh.ndim))
        self._rings = tuple(self._ring(i) for i in range(self.mesh.ndim))
        # Per instance so the cache key is just the tensor arguments; the planner asks
        # for the same (src, dst, shape) pairs many times.
        self._redistribute = functools.lru_cache(maxsize=1 << 16)(self._plan_redistribute)
        self._backward = functools.lru_cache(maxsize=1 << 16)(self._plan_backward)
        self._steps = functools.lru_cache(maxsize=1 << 16)(self._plan_steps)

    def _axis_link(self, axis: int) -> LinkSpec:
        inside = math.prod(self.mesh.axis_sizes[axis:]) <= self.cluster.devices_per_node
        return self.cluster.intra_node if inside else self.cluster.inter_node

    def _ring(self, axis: int) -> LinkSpec:
        """The link a collective's ring over ``axis`` runs at: :meth:`link`, except where the ring has g
        ranks on each node, each with its own adapter (``Cluster.nics_per_node``): NCCL then runs a
        channel through each, and the ring crosses nodes min(g, nics) adapters wide (:func:`spanning`)."""
        cluster, sizes = self.cluster, self.mesh.axis_sizes
        stride = math.prod(sizes[axis + 1 :])
        together = min(sizes[axis], max(1, cluster.devices_per_node // stride))
        wide = min(together, cluster.nics_per_node or 1)
        if self._links[axis] is cluster.intra_node or wide == 1:
            return self._links[axis]
        return spanning(cluster.inter_node, wide, cluster.intra_node.bandwidth_Bps)

    def link(self, axis: int) -> LinkSpec:
        """Link between two ranks along mesh axis ``axis`` (an index): what a pipeline's sends take.

        Devices are numbered row-major over the mesh axes, so axis ``i`` stays inside a
        node iff ``prod(axis_sizes[i:]) <= devices_per_node``; otherwise it crosses nodes.
        Collectives over the axis run at :meth:`_ring`'s figures.
        """
        return self._links[axis]

    def collective_time(self, c: Collective, latency: bool = True) -> float:
        """Ring alpha-beta time of ``c``; ``c.mesh_axes`` must name exactly one axis.

        With n ranks on the axis, B = ``c.bytes``, alpha/beta the axis ring's figures (:meth:`_ring`) for
        ``c.kind`` (:meth:`LinkSpec.for_collective`: the kind's own where calibrated, the link's
        otherwise): all_gather (n-1)(alpha + B/beta); reduce_scatter and all_to_all
        (n-1)alpha + (n-1)/n B/beta; all_reduce twice the reduce_scatter time (:func:`ring_terms`).
        n = 1 is free. ``latency=False`` drops the alpha terms: for a collective that travels in
        a bucket with many others (gradient sums), whose latency is paid once per bucket.
        """
        if len(c.mesh_axes) != 1:
            raise ValueError(f"collective_time prices one mesh axis at a time, got {c.mesh_axes}")
        axis = self.mesh.axis_index(c.mesh_axes[0])
        n = self.mesh.axis_sizes[axis]
        if n == 1:
            return 0.0
        link = self._rings[axis].for_collective(c.kind)
        hops, share = ring_terms(c.kind, n)
        alpha, wire = link.latency_s if latency else 0.0, c.bytes / link.bandwidth_Bps
        return hops * alpha + share * wire

    def peak(self, dtype: torch.dtype) -> float:
        """Products' FLOP/s in ``dtype`` (the fallback dtype's where the cluster lists none)."""
        peaks = self.cluster.peak_flops
        return peaks.get(dtype_name(dtype), peaks[FALLBACK_DTYPE])

    def compute_time(
        self,
        flops: float,
        bytes_accessed: float,
        dtype: torch.dtype,
        transcendentals: float = 0.0,
        timed_s: float = 0.0,
    ) -> float:
        """Roofline on one device: ``max(flops / peak + transcendentals' seconds + timed_s,
        bytes_accessed / memory_bandwidth)``; the transcendentals are priced by the device
        (:meth:`~autopar.planning.cost.device_model.DeviceModel.transcendental_s`), ``timed_s`` is
        what functions priced at their calibrated rates take."""
        efficiency, peak = self.cluster.efficiency, self.peak(dtype)
        products = flops / peak if efficiency is None else efficiency.arithmetic_s(flops, peak)
        arithmetic = products + self.device.transcendental_s(transcendentals) + timed_s
        return max(arithmetic, bytes_accessed / self.cluster.memory_bandwidth_Bps)

    def op_time(
        self,
        flops: float,
        bytes_accessed: float,
        dtype: torch.dtype,
        transcendentals: tuple[float, float] = (0.0, 0.0),
        grad: bool = False,
        function: str | None = None,
        attention: tuple[float, int] | None = None,
    ) -> float:
        """One op's forward and, where a gradient flows (``grad``), its backward: twice the
        forward's flops and bytes, and the ``(forward, backward)`` transcendentals its rule counts.
        Where the device timed the elementwise ``function`` the op evaluates (``flops`` values;
        :meth:`~autopar.planning.cost.device_model.DeviceModel.function_s` of ``function`` and of
        ``<function>_backward``), that rate prices the forward, or the backward, instead of its
        transcendentals. A fused attention kernel
        (``attention``: scores and causal length, see ``DimSpec.attention``) is priced by the
        cluster's :class:`~autopar.planning.cost.cluster.AttentionRates` where it has them, its bytes
        still a floor."""
        rates, efficiency = self.cluster.attention, self.cluster.efficiency
        if attention is not None and (rates is not None or efficiency is not None):
            fused = rates.seconds if rates is not None else efficiency.attention_s
            seconds = fused(flops, *attention, self.peak(dtype), grad)
            return max(seconds, (3 if grad else 1) * bytes_accessed / self.cluster.memory_bandwidth_Bps)
        inverse = None if function is None else f"{function}_backward"
        timed_forward = self.device.function_s(function, flops)
        timed_backward = self.device.function_s(inverse, flops)
        forward = 0.0 if timed_forward else transcendentals[0]
        seconds = self.compute_time(flops, bytes_accessed, dtype, forward, timed_forward)
        if not grad:
            return seconds
        backward = 0.0 if timed_backward else transcendentals[1]
        return seconds + self.compute_time(2 * flops, 2 * bytes_accessed, dtype, backward, timed_backward)

    def redistribute(
        self, src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int
    ) -> tuple[tuple[Collective, ...], float]:
        """Collectives (in issue order) and total seconds turning ``src`` into ``dst``.

        ``shape`` is the global shape (assumed divisible by the shardings), ``itemsize``
        bytes per element. Each mesh axis changes independently (see docs/cost_model.md
        for the table); steps run slices first, then reduce_scatters, all_to_alls,
        all_reduces, all_gathers, so data shrinks before it grows, as far as dims split over
        several axes allow (:meth:`steps`). Each collective's bytes is the per-rank local
        size at that moment. Cached; keep arguments hashable.
        """
        return self._redistribute(tuple(src), tuple(dst), tuple(shape), itemsize)

    def _plan_redistribute(
        self, src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int
    ) -> tuple[tuple[Collective, ...], float]:
        if len(src) != self.mesh.ndim or len(dst) != self.mesh.ndim:
            raise ValueError(
                f"layouts need one placement per mesh axis ({self.mesh}), got {len(src)} and {len(dst)}"
            )
        before, after = axis_states(src), axis_states(dst)
        collectives, total = [], 0.0
        # no gradient here: ``walk``'s gradient states are not read, any layout will do
        for step in walk(before, after, after, self.steps(src, dst)):
            local = self._local_bytes(step.before, shape, itemsize)
            total += self._copy_time(step, step.kind, local)
            if step.kind in _COLLECTIVE_OF:
                axis = self.mesh.axis_names[step.axis]
                c = Collective(kind=_COLLECTIVE_OF[step.kind], mesh_axes=(axis,), bytes=local)
                collectives.append(c)
                total += self.collective_time(c)
        return tuple(collectives), total

    def _copy_time(self, step: Walked, kind: StepKind | CollectiveKind, local: int) -> float:
        """Seconds of the runtime's own copies around one op of an edge (``runtime/collectives.py``),
        read and written at memory bandwidth; ``local`` is the op's input bytes on a rank, ``kind``
        the op run (a step's own, or the collective of its backward). An all_reduce clones its input
        (it reduces in place), and so does a grad_all_reduce's identity forward; a gather or
        scatter along a dim other than the first stacks the pieces (the gathered n, the scattered
        input), all_to_all on each side so split. A local slice or to_partial is left free: its
        copy is 1/n of the tensor or a fill, and a price on every layout change that moves nothing
        would give the solver a variable for each (docs/cost_model.md: what that cost the ILP).
        """
        n = self.mesh.axis_sizes[step.axis]
        if n == 1:  # the lowering issues nothing on an axis of one device
            return 0.0
        dims = (split_dim(step.before[step.axis]), split_dim(step.after[step.axis]))
        stacked = sum(1 for d in dims if d not in (None, 0))
        moved = {
            StepKind.ALL_REDUCE: 2 * local,
            StepKind.GRAD_ALL_REDUCE: 2 * local,
            StepKind.ALL_GATHER: 2 * n * local * stacked,
            StepKind.REDUCE_SCATTER: 2 * local * stacked,
            StepKind.ALL_TO_ALL: 2 * local * stacked,
        }.get(StepKind(kind.value), 0)
        return moved / self.cluster.memory_bandwidth_Bps

    def _local_bytes(self, states: tuple[State, ...], shape: tuple[int, ...], itemsize: int) -> int:
        """Bytes one rank holds of a tensor of global ``shape`` split as ``states`` say (the largest
        piece of a dim split unevenly)."""
        local = list(shape)
        for s, n in zip(states, self.mesh.axis_sizes):
            if (d := split_dim(s)) is not None and d < len(local):
                local[d] = piece_size(local[d], n)
        return math.prod(local) * itemsize

    def edge_steps(
        self, have: Layout, need: Layout, grad_need: Layout, grad_have: Layout
    ) -> tuple[tuple[int, StepKind], ...]:
        """The ops an edge lowers to, in forward order: a ``grad_all_reduce`` (identity
        forward, all-reduce backward) on each axis where only the gradient changes, then
        :meth:`steps` from ``have`` to ``need``."""
        only_grad = tuple(
            (a, StepKind.GRAD_ALL_REDUCE)
            for a, (h, n, g, gh) in enumerate(zip(have, need, grad_need, grad_have, strict=True))
            if h == n and g != gh
        )
        return only_grad + self.steps(have, need)

    def edge_plan(
        self, have: Layout, need: Layout, grad_need: Layout, grad_have: Layout
    ) -> tuple[EdgeStep, ...]:
        """:meth:`edge_steps` with the layouts around each step, as the lowering issues them.

        ``before``/``after`` is the value's layout around the step; ``grad`` the gradient's
        placement on the step's axis where the step's backward receives it (Partial: the
        backward must sum it). Run backward from a gradient laid out ``grad_need``, the
        steps' backwards leave it laid out ``grad_have``.
        """
        walked = walk(
            axis_states(have),
            axis_states(need),
            axis_states(grad_need),
            self.edge_steps(have, need, grad_need, grad_have),
        )
        return tuple(
            EdgeStep(w.axis, w.kind, to_layout(w.before), to_layout(w.after), to_layout(w.grad)[w.axis])
            for w in walked
        )

    def backward(
        self,
        have: Layout,
        need: Layout,
        grad_need: Layout,
        grad_have: Layout,
        shape: tuple[int, ...],
        itemsize: int,
    ) -> tuple[tuple[Collective, ...], float]:
        """Collectives (in the order they run) and seconds of an edge's backward.

        Backward runs the adjoints of the forward ops of :meth:`edge_steps` in reverse
        order, starting from a gradient laid out ``grad_need``; each op's backward on its
        axis depends on whether the gradient arrives there as a partial sum (see
        :meth:`edge_plan` and ``passes/lower_collectives.py``). Bytes are the gradient's
        local size at each op. Where the gradient keeps its layout (``grad_need ==
        grad_have``, or no gradient flows) nothing moves.
        """
        return self._backward(
            tuple(have), tuple(need), tuple(grad_need), tuple(grad_have), tuple(shape), itemsize
        )

    def _plan_backward(
        self,
        have: Layout,
        need: Layout,
        grad_need: Layout,
        grad_have: Layout,
        shape: tuple[int, ...],
        itemsize: int,
    ) -> tuple[tuple[Collective, ...], float]:
        if grad_need == grad_have:
            return (), 0.0
        steps = self.edge_steps(have, need, grad_need, grad_have)
        walked = walk(axis_states(have), axis_states(need), axis_states(grad_need), steps)
        collectives, total = [], 0.0
        for step in reversed(walked):
            if step.kind == StepKind.GRAD_ALL_REDUCE:  # its forward's copy, there for the gradient
                total += self._copy_time(step, step.kind, self._local_bytes(step.before, shape, itemsize))
            collective = BACKWARD[step.kind][step.grad[step.axis] == "P"]
            if collective is not None:
                local = self._local_bytes(step.grad, shape, itemsize)
                c = Collective(kind=collective, mesh_axes=(self.mesh.axis_names[step.axis],), bytes=local)
                collectives.append(c)
                total += self.collective_time(c) + self._copy_time(step, collective, local)
        return tuple(collectives), total

    def steps(self, src: Layout, dst: Layout) -> tuple[tuple[int, StepKind], ...]:
        """The per-axis steps turning ``src`` into ``dst``, in the order they run.

        Each step is ``(mesh axis index, kind)``, kind any :class:`StepKind` but
        ``grad_all_reduce``. The lowering issues exactly these, so runtime bytes equal
        the prediction.

        A dim split over several axes is split outer axis first (DTensor's order); the
        order, and where no order works the unwinding of inner splits, is
        :func:`autopar.ir.redistribution_steps.plan_steps`'s.
        """
        return self._steps(axis_states(src), axis_states(dst))

    def _plan_steps(self, src: tuple[State, ...], dst: tuple[State, ...]) -> tuple[tuple[int, StepKind], ...]:
        return plan_steps(src, dst, self._step_order)

    def _step_order(self, step: tuple[StepKind, int]) -> tuple[int, float, int]:
        """Sort key: step kind first, then, within a kind, the cheapest axis order.

        A swap argument on the alpha-beta costs shows reduce_scatters cost least on the
        fastest link first (later, slower hops carry less data) and all_gathers on the
        slowest link first; all_to_all and all_reduce keep the size, so any order costs
        the same. Ties take the inner axis first for reduce_scatters and the outer axis
        first otherwise, so a gather retraces a scatter backwards.
        """
        kind, axis = step
        bandwidth = self._rings[axis].bandwidth_Bps
        if kind == StepKind.REDUCE_SCATTER:
            return (ISSUE_ORDER[kind], -bandwidth, -axis)
        return (ISSUE_ORDER[kind], bandwidth if kind == StepKind.ALL_GATHER else 0.0, axis)
