"""What the cost model asks of a device beyond its roofline and its links: :class:`DeviceModel`.

Each op's overhead and whether launches overlap compute, the optimizer's cost per tensor, a recompute
region's per op, the waits for stragglers, how much faster a rank computes while ranks sharing its
cores wait, the rates of elementwise functions and transcendentals, and the host's terms of offload.
:func:`device_model` picks :class:`MeasuredDevice` (the CPU-gloo terms ``autopar calibrate`` measures)
for a cluster that sets any of :data:`MEASURED_TERMS`, else :class:`RooflineDevice` (the ``h100`` and
``fast-links`` presets); the measured model answers as the roofline one wherever a term is unset.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from autopar.planning.cost.cluster import Cluster

# Ops torch's for-loop Adam/AdamW runs per parameter tensor (torch's CPU default); a foreach or fused
# optimizer runs fewer. tests/test_step_prediction.py counts them on torch's own optimizer.
OPTIMIZER_OPS_PER_TENSOR = 10

# The Cluster fields only the measured model reads: a cluster setting any (to another value than its
# default) is priced by :class:`MeasuredDevice`.
MEASURED_TERMS = frozenset(
    "straggler_s straggler_base_s ranks_per_core optimizer_tensor_s recompute_op_s recompute_unit_s "
    "checkpoint_unit_s transcendentals_per_s function_rates threads_per_rank".split()
)
_UNSET = {
    f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
    for f in dataclasses.fields(Cluster)
    if f.name in MEASURED_TERMS
}


@dataclass(frozen=True)
class RecomputeWork:
    """What the checkpoint does for one recomputed op: ``units``, one for the op and one per tensor
    autograd saves for it (its hooks pack each in forward and unpack it in backward), under the
    selective checkpoint's policy where ``selective`` (a selective region, or a full one with
    collectives: :func:`~autopar.ir.options.uses_policy`)."""

    units: int
    selective: bool = True


@dataclass(frozen=True)
class DeviceModel(ABC):
    """What the cost model asks of one rank's device besides the roofline and the links, in seconds: the
    op overhead, launches and host terms read the cluster alike in every implementation."""

    cluster: Cluster

    @property
    def op_overhead_s(self) -> float:
        """What one executed op costs besides its roofline time: its launch and dispatch."""
        return self.cluster.op_overhead_s

    @property
    def asynchronous(self) -> bool:
        """Whether the ops' launches overlap their compute (a GPU); False where the host computes."""
        return self.cluster.asynchronous

    @property
    def host_op_s(self) -> float:
        """What an op on the host's tensors costs (offload's update); the device's op where it is the host."""
        host = self.cluster.host_op_overhead_s
        return self.cluster.op_overhead_s if host is None else host

    @property
    def host_update_Bps(self) -> float:
        """The memory bandwidth an offloaded update runs at; the device's where it is the host."""
        return self.cluster.host_memory_bandwidth_Bps or self.cluster.memory_bandwidth_Bps

    def host_copy_s(self, source_bytes: float, target_bytes: float) -> float:
        """One copy between the device and the host: ``source_bytes`` over the host link, or, where
        the device is the host (no ``host_link_Bps``), the source read and the target written.

        Args:
            source_bytes: the bytes copied from.
            target_bytes: the bytes written (another dtype's size where the copy casts).
        """
        if self.cluster.host_link_Bps is not None:
            return source_bytes / self.cluster.host_link_Bps
        return (source_bytes + target_bytes) / self.cluster.memory_bandwidth_Bps

    @property
    @abstractmethod
    def optimizer_tensor_s(self) -> float:
        """What the optimizer step spends per parameter tensor besides moving its bytes."""

    @abstractmethod
    def recompute_s(self, work: RecomputeWork) -> float:
        """What recomputing one op costs besides its compute: its relaunch, the checkpoint's work for it.

        Args:
            work: the checkpoint's units for the op and whether its policy runs.
        """

    @abstractmethod
    def straggler_wait_s(self, stretch_s: float) -> float:
        """What a synchronising collective waits for the slowest rank after ``stretch_s`` of compute.

        Args:
            stretch_s: the compute since the ranks last met, in seconds (> 0).
        """

    @property
    @abstractmethod
    def shared_core_speedup(self) -> float:
        """How many times faster a rank computes while the ranks sharing its cores wait (a pipeline's
        bubble): 1 where each rank has cores of its own."""

    @abstractmethod
    def transcendental_s(self, count: float) -> float:
        """Seconds of ``count`` transcendental values (exp, log, erf...) beyond the products' time.

        Args:
            count: how many values, as a rule counts them.
        """

    @abstractmethod
    def function_s(self, function: str | None, values: float) -> float:
        """Seconds of ``values`` values of the elementwise ``function`` at its timed rate; 0 where untimed.

        Args:
            function: a name of ``TIMED_FUNCTIONS`` (``rules/elementwise.py``), ``<name>_backward``, or None.
            values: how many values the op computes.
        """

    @property
    @abstractmethod
    def threads_per_rank(self) -> int | None:
        """The CPU threads per rank the figures hold for; None where they hold for any."""


class RooflineDevice(DeviceModel):
    """A device of vendor figures (a GPU, ``fast-links``): each op costs its overhead and nothing
    else; no stragglers, no shared cores, transcendentals and functions at the roofline's pace."""

    @property
    def optimizer_tensor_s(self) -> float:
        """The ops torch's optimizer runs per tensor, at the op overhead each."""
        return OPTIMIZER_OPS_PER_TENSOR * self.cluster.op_overhead_s

    def recompute_s(self, work: RecomputeWork) -> float:
        """One more op's overhead: its relaunch."""
        return self.cluster.op_overhead_s

    def straggler_wait_s(self, stretch_s: float) -> float:
        """0: the ranks keep pace."""
        return 0.0

    @property
    def shared_core_speedup(self) -> float:
        """1: each rank has its own device."""
        return 1.0

    def transcendental_s(self, count: float) -> float:
        """Nothing: special function units keep up with memory."""
        return 0.0

    def function_s(self, function: str | None, values: float) -> float:
        """0: no function is timed."""
        return 0.0

    @property
    def threads_per_rank(self) -> int | None:
        """None: the figures hold for any."""
        return None


class MeasuredDevice(RooflineDevice):
    """The CPU-gloo terms as ``autopar calibrate`` measures them (``docs/cost_model.md``, "The whole
    step"): each answers as :class:`RooflineDevice` where its figure is unset (a file written before
    it was measured, a GPU's file without stragglers)."""

    @property
    def optimizer_tensor_s(self) -> float:
        """``Cluster.optimizer_tensor_s`` where measured (DTensor's dispatch of each op included)."""
        measured = self.cluster.optimizer_tensor_s
        return super().optimizer_tensor_s if measured is None else measured

    def recompute_s(self, work: RecomputeWork) -> float:
        """``Cluster.recompute_unit_s`` per unit under the policy, ``Cluster.checkpoint_unit_s``
        without it (the policy's figure where that is unset); ``Cluster.recompute_op_s`` per op where
        units are unset (files calibrated before them)."""
        c = self.cluster
        if c.recompute_unit_s is not None:
            plain = c.checkpoint_unit_s
            unit = c.recompute_unit_s if work.selective or plain is None else plain
            return work.units * unit
        return super().recompute_s(work) if c.recompute_op_s is None else c.recompute_op_s

    def straggler_wait_s(self, stretch_s: float) -> float:
        """``straggler_base_s`` at every wait, and ``straggler_s`` after one second of compute,
        growing as its square root (the ranks drift apart like a random walk)."""
        return self.cluster.straggler_base_s + self.cluster.straggler_s * math.sqrt(stretch_s)

    @property
    def shared_core_speedup(self) -> float:
        """``Cluster.ranks_per_core``: a rank whose neighbours wait runs on their share of the cores."""
        return self.cluster.ranks_per_core

    def transcendental_s(self, count: float) -> float:
        """``count`` at ``Cluster.transcendentals_per_s`` where measured."""
        rate = self.cluster.transcendentals_per_s
        return count / rate if rate else 0.0

    def function_s(self, function: str | None, values: float) -> float:
        """``values`` at ``Cluster.function_rates[function]`` where timed."""
        rates = self.cluster.function_rates
        return values / rates[function] if function in rates else 0.0

    @property
    def threads_per_rank(self) -> int | None:
        """``Cluster.threads_per_rank``: the threads calibrate's ranks computed on."""
        return self.cluster.threads_per_rank


def device_model(cluster: Cluster) -> DeviceModel:
    """The model ``cluster``'s figures describe: :class:`MeasuredDevice` where it sets any of
    :data:`MEASURED_TERMS`, else :class:`RooflineDevice`.

    Args:
        cluster: the hardware a plan is priced for.
    """
    measured = any(getattr(cluster, name) != unset for name, unset in _UNSET.items())
    return MeasuredDevice(cluster) if measured else RooflineDevice(cluster)
