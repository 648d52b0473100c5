"""What a training step spends besides the operators' roofline and the layout changes between them.

Each term is priced from the :class:`~autopar.planning.cost.cluster.Cluster`'s figures, what the
device spends beyond its roofline asked of its
:class:`~autopar.planning.cost.device_model.DeviceModel`, and models what the runtime does
(``docs/cost_model.md``, "The whole step"):

* **op overhead**: every op the program executes costs the device's op overhead (launch and
  dispatch) on top of its roofline time: once in forward, :data:`BACKWARD_OPS_PER_OP` times in
  backward when a gradient flows through it, and its recompute's cost
  (:meth:`~autopar.planning.cost.device_model.DeviceModel.recompute_s`) when a recompute region runs it
  (:func:`op_seconds`); on an asynchronous device (a GPU) the host launches ahead while the device
  computes, and what of the two overlaps is taken off (:func:`launch_queue`);
* **the optimizer step**: a memory-bound update of each rank's optimizer shard, as many passes
  as torch's default optimizer makes (:func:`update_passes`), plus its ops; under
  optimizer offload the gradients' copies to the host, the update there, and the copies back
  (:func:`update_seconds`);
* **gradients**: autograd accumulates each parameter's gradient and the runtime's hook takes it
  at every backward pass, adds a pipeline's later microbatches' gradients to the first's, and
  copies a summed gradient into its bucket (:func:`gradient_seconds`);
* **gradient-sum buckets**: the runtime's :class:`~autopar.runtime.grad_reducer.GradReducer` packs
  gradient sums into buckets (:func:`buckets`, the same packing), pays each collective's latency
  once per bucket, and launches each bucket asynchronously as soon as backward completes its
  gradients; only what backward cannot hide is exposed (:func:`bucket_times`);
* **stragglers**: ranks drift apart while they compute, and a synchronous collective waits for
  the last (:meth:`StepTerms.waits`, at the meeting points of :meth:`StepTerms.segments`);
* **pipeline sends**: torch's schedules wait for some sends only after the next microbatch's
  compute (:func:`hidden_sends`).

:func:`whole_step` adds them up for a plan without a pipeline; :mod:`autopar.planning.pipeline.stage_plan`
for each stage and rank. The planner's ILP prices none of them: the plan's prediction does, and
the memory and mesh searches compare plans by it.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from autopar.ir.buckets import pack
from autopar.ir.options import Memory
from autopar.ir.plan import Redistribution
from autopar.planning.cost.cluster import Cluster
from autopar.planning.cost.device_model import (
    OPTIMIZER_OPS_PER_TENSOR,
    DeviceModel,
    RecomputeWork,
    device_model,
)

# A matrix product's backward runs two (the operand's and the weight's gradients); elementwise
# ops run one or two. Each backward op costs what a forward op does.
BACKWARD_OPS_PER_OP = 2
# The share of an op's priced compute that runs in backward: the strategy graph prices an op a
# gradient flows through at three times its forward (its backward computes two products per one).
BACKWARD_SHARE = 2 / 3
FP32_BYTES = 4


def op_seconds(cluster: Cluster, grad: bool, recompute: RecomputeWork | None = None) -> float:
    """Overhead of one op of the program per microbatch: its forward, its backward ops where a
    gradient flows, and where it is recomputed the device's
    :meth:`~autopar.planning.cost.device_model.DeviceModel.recompute_s`."""
    device = device_model(cluster)
    ops = 1 + (BACKWARD_OPS_PER_OP if grad else 0)
    return ops * device.op_overhead_s + (device.recompute_s(recompute) if recompute else 0.0)


def queue_end(jobs: Iterable[tuple[float, float]]) -> float:
    """When the last of ``jobs`` ends: each is ``(ready, seconds)``, run one after another in the
    order given, each once it is ready and the one before it has ended."""
    end = 0.0
    for ready, seconds in jobs:
        end = max(end, ready) + seconds
    return end


def launch_queue(launches: Sequence[tuple[float, float]]) -> float:
    """What of ``launches`` overlaps on an asynchronous device: each is ``(host, device)``
    seconds of one op in the order the host launches them; the host launches op after op, each
    taking its ``host`` seconds, and the device runs each once it is launched and the previous
    one is done (:func:`queue_end`). Returns the sum of every ``host`` and ``device`` less the time
    the last op ends, what ran at the same time: up to the smaller side's sum (a launch-bound queue
    hides all its compute but the last op's, a compute-bound one all its launches but the first)."""
    launched = itertools.accumulate(host for host, _ in launches)
    done = queue_end(zip(launched, (device for _, device in launches)))
    return sum(host + device for host, device in launches) - done


@dataclass(frozen=True)
class OptimizerWork:
    """What the optimizer steps for one parameter on one rank: ``elements`` of its shard (the whole
    local parameter without ZeRO), held in ``itemsize`` bytes each, as is its gradient."""

    elements: float
    itemsize: int


def update_passes(states: int) -> tuple[int, int]:
    """Passes over each element that torch's default optimizer with ``states`` fp32 states per
    element makes (its for-loop and foreach implementations move the same bytes): (reads plus
    writes of the parameter and its gradient, reads plus writes of the states). Counted from
    torch's code: SGD reads the parameter and the gradient and writes the parameter (3, 0); with
    momentum it also decays the parameter (weight decay) and moves its buffer (6, 5); Adam/AdamW
    decays the parameter, lerps the first moment, scales and accumulates the second, builds the
    denominator in three passes (square root, division, epsilon) and applies it (6, 14). More
    states cost Adam's 7 passes each. A ``fused=True`` optimizer makes fewer: the model prices
    torch's default."""
    return {0: (3, 0), 1: (6, 5), 2: (6, 14)}.get(states, (6, 7 * states))


def update_seconds(work: OptimizerWork, cluster: Cluster, memory: Memory) -> float:
    """Seconds of the optimizer step for one parameter (0 for one it does not step).

    On the device, the update makes :func:`update_passes` over the parameter and gradient
    (``work.itemsize`` bytes each) and the ``memory.optimizer_states`` fp32 states, at
    ``memory_bandwidth_Bps``. Offloaded, the gradient is copied to an fp32 host copy, the update
    runs there on fp32 values (at ``host_memory_bandwidth_Bps``) and the parameter is copied back
    (:meth:`~autopar.planning.cost.device_model.DeviceModel.host_copy_s`). Each tensor the optimizer
    touches also costs its ops' overhead: on the device, where it steps DTensors (parameters or ZeRO
    shards), the device's
    :attr:`~autopar.planning.cost.device_model.DeviceModel.optimizer_tensor_s`; on the host copies of
    offload, :data:`OPTIMIZER_OPS_PER_TENSOR` host ops.
    """
    if work.elements <= 0:
        return 0.0
    device = device_model(cluster)
    e, item = work.elements, work.itemsize
    values, states = update_passes(memory.optimizer_states)
    if not memory.offload_optimizer:
        per_tensor = device.optimizer_tensor_s
        return e * (values * item + states * FP32_BYTES) / cluster.memory_bandwidth_Bps + per_tensor
    host_update = e * FP32_BYTES * (values + states) / device.host_update_Bps
    copies = device.host_copy_s(e * item, e * FP32_BYTES) + device.host_copy_s(e * FP32_BYTES, e * item)
    host_ops = OPTIMIZER_OPS_PER_TENSOR * device.host_op_s
    return copies + host_update + host_ops + 2 * cluster.op_overhead_s  # the two copies are ops too


def gradient_seconds(leaf_bytes: float, passes: int, summed: bool, cluster: Cluster) -> float:
    """Seconds one parameter's gradient (``leaf_bytes`` on this rank, before any ZeRO split) costs
    the runtime in a step of ``passes`` backward passes (a pipeline's microbatches, or those a
    step accumulates without one):
    autograd's accumulation and :class:`~autopar.runtime.grad_reducer.GradReducer`'s hook at
    every pass (an op each); at every pass after the first, adding the new gradient to the last
    (reading both, writing the sum: an op); and, where it is summed, copying it into its bucket
    (reading it, writing the bucket: an op)."""
    op, bandwidth = cluster.op_overhead_s, cluster.memory_bandwidth_Bps
    accumulate = (passes - 1) * (3 * leaf_bytes / bandwidth + op)
    bucket = 2 * leaf_bytes / bandwidth + op if summed else 0.0
    return 2 * passes * op + accumulate + bucket


@dataclass(frozen=True)
class GradSum:
    """One parameter's gradient sum, as the runtime buckets it.

    ``group`` is what a bucket shares: the mesh axes summed over and ZeRO-2's split axis (None
    without); ``leaf_bytes`` the parameter's local bytes (what buckets are filled by);
    ``wire_s`` the sum's bandwidth time and ``latency_s`` the latency of its group's collectives,
    paid once per bucket; ``first_use`` the first op that reads the parameter: its gradient is
    complete once backward has run that op's backward.
    """

    param: str
    group: tuple[tuple[int, ...], int | None]
    leaf_bytes: float
    wire_s: float
    latency_s: float
    first_use: str


def buckets(sums: Sequence[GradSum]) -> list[list[GradSum]]:
    """``sums`` (in the order the runtime lists parameters) packed as GradReducer packs them
    (:func:`autopar.ir.buckets.pack`, by ``group`` and ``leaf_bytes``)."""
    return pack(sums, lambda s: s.group, lambda s: s.leaf_bytes)


@dataclass(frozen=True)
class BucketTimes:
    """The buckets of a backward pass: ``latency_s``, what their collectives' latencies add to the
    sums' wire time (once per bucket and axis); ``hidden_s``, how much of all that communication
    runs while backward still computes."""

    latency_s: float
    hidden_s: float


def bucket_times(
    sums: Sequence[GradSum], order: Sequence[str], backward_s: Mapping[str, float]
) -> BucketTimes:
    """The gradient-sum buckets of ``sums`` on the timeline of one backward pass.

    ``order`` lists the ops in forward order and ``backward_s`` each one's seconds in backward (its
    gradient compute, its recompute, the collectives its backward waits for). A bucket is launched
    (asynchronously) when backward has completed its last gradient; buckets run one after another.
    When the last bucket is launched the runtime waits for all of them before backward goes on, so
    the step's backward lasts ``backward + end of the last bucket - its launch``, and everything
    else of the buckets' time is hidden.
    """
    packed = buckets(sums)
    if not packed:
        return BucketTimes(0.0, 0.0)
    position = {name: i for i, name in enumerate(order)}
    # backward seconds run before the backward of op i finishes: the ops from i to the last
    after = [0.0] * (len(order) + 1)
    for i in reversed(range(len(order))):
        after[i] = after[i + 1] + backward_s.get(order[i], 0.0)
    # a use outside ``order`` (none is expected) counts as the first op: complete at the end
    launches = sorted(
        (max(after[position.get(s.first_use, 0)] for s in b), sum(s.wire_s for s in b) + b[0].latency_s)
        for b in packed
    )
    total = sum(seconds for _, seconds in launches)
    exposed = queue_end(launches) - launches[-1][0]
    return BucketTimes(latency_s=sum(b[0].latency_s for b in packed), hidden_s=max(0.0, total - exposed))


def hidden_sends(schedule: str, size: int, rank: int, microbatches: int) -> int:
    """How many of a stage's forward sends (and as many backward sends) torch's schedule waits for
    only after the next microbatch's compute, of ``microbatches`` each (stage on pipeline
    coordinate ``rank`` of ``size``).

    ``1f1b``: the warm-up forwards but the last, and the cool-down backwards but the last
    (``min(m, size - rank) - 1`` each); the sends of the steady phase go with a receive that is
    waited for at once. ``gpipe`` and ``interleaved-1f1b`` wait for sends at the end of a phase or
    step: every send but the last hides behind later compute.
    """
    if schedule == "1f1b":
        return min(microbatches, size - rank) - 1
    return microbatches - 1


@dataclass(frozen=True)
class OpTime:
    """One op of the program, per microbatch: ``compute_s`` its priced compute (forward and
    backward), ``grad`` whether a gradient flows through it, ``recompute_s`` what recomputing it
    costs (``recompute`` its checkpoint's work, :func:`op_seconds`); its operands'
    collectives in forward and backward (``forward_syncs``, ``backward_syncs``: how many, each a
    point where the ranks meet) and the backward ones' seconds. ``runs`` is False for the graph's
    output, which executes nothing but has collectives of its own (a loss summed over ranks)."""

    name: str
    compute_s: float
    grad: bool
    recompute_s: float = 0.0
    recompute: RecomputeWork | None = None  # where recomputed
    forward_syncs: int = 0
    backward_syncs: int = 0
    backward_comm_s: float = 0.0
    runs: bool = True

    @property
    def forward_s(self) -> float:
        """Its forward's compute."""
        return self.compute_s * (1 - BACKWARD_SHARE) if self.grad else self.compute_s

    @property
    def backward_s(self) -> float:
        """Its backward's compute (its recompute included), without the collectives."""
        return (BACKWARD_SHARE * self.compute_s if self.grad else 0.0) + self.recompute_s


@dataclass(frozen=True)
class StepTerms:
    """This module's terms for one plan: per op (per microbatch) and per parameter placeholder.

    ``ops`` are in forward order; ``op_s`` is each op's overhead (:func:`op_seconds`), ``update_s``
    each parameter's optimizer step, ``grad_sums`` each summed gradient, in the order the runtime
    lists parameters; ``gradient_s`` what handling each parameter's gradient costs in the whole
    step (:func:`gradient_seconds`); ``device`` the cluster's model (its stragglers, its launches).
    """

    ops: tuple[OpTime, ...]
    op_s: Mapping[str, float]
    update_s: Mapping[str, float]
    grad_sums: Mapping[str, GradSum]
    device: DeviceModel
    gradient_s: Mapping[str, float] = field(default_factory=dict)

    def launches(self, names: Collection[str] | None = None) -> list[tuple[float, float]]:
        """``(host, device)`` seconds of the forward of each op in ``names`` (all when None) in
        order, then of each one's backward in reverse (its recompute included), for
        :func:`launch_queue`: the host's are its overhead (``op_s``: one op forward, the rest
        backward), the device's its compute, and in backward its operands' collectives."""
        ops = [op for op in self._kept(names) if op.name in self.op_s]
        launch = self.device.op_overhead_s
        forward = [(launch, op.forward_s) for op in ops]
        backward = [(self.op_s[op.name] - launch, op.backward_s + op.backward_comm_s) for op in ops]
        return forward + backward[::-1]

    def hidden_launches(self, names: Collection[str] | None = None) -> float:
        """What of the launches and compute of the ops in ``names`` (all when None) overlaps on an
        asynchronous device (:func:`launch_queue`); 0 where the host computes."""
        return launch_queue(self.launches(names)) if self.device.asynchronous else 0.0

    @property
    def recompute_s(self) -> dict[str, float]:
        """What recomputing each recomputed op costs."""
        return {op.name: op.recompute_s for op in self.ops if op.recompute_s}

    def _kept(self, names: Collection[str] | None) -> list[OpTime]:
        return [op for op in self.ops if names is None or op.name in names]

    def bucket_times(self, names: Collection[str] | None = None) -> BucketTimes:
        """:func:`bucket_times` of the backward of the ops and parameters in ``names`` (all when
        None): one pipeline rank's, whose runtime sums its own parameters after its own backward."""
        ops = self._kept(names)
        sums = [s for p, s in self.grad_sums.items() if names is None or p in names]
        backward = {op.name: op.backward_s + op.backward_comm_s for op in ops}
        return bucket_times(sums, [op.name for op in ops], backward)

    def segments(self, names: Collection[str] | None = None) -> tuple[list[float], list[float]]:
        """The compute between consecutive synchronising points of the forward, and of the backward,
        of the ops in ``names`` (all when None), first and last stretch included: where
        :meth:`waits` charges the ranks' drift."""
        ops = self._kept(names)
        forward, backward = [0.0], [0.0]
        for op in ops:  # an op's operands are gathered before it runs
            forward += [0.0] * op.forward_syncs
            forward[-1] += op.forward_s
        for op in reversed(ops):  # its backward runs before its operands' backward collectives
            backward[-1] += op.backward_s
            backward += [0.0] * op.backward_syncs
        return forward, backward

    def waits(self, stretches: Iterable[float]) -> float:
        """What the ranks wait for the slowest at the synchronising points that end ``stretches``
        of compute: the device's
        :meth:`~autopar.planning.cost.device_model.DeviceModel.straggler_wait_s` at each."""
        return sum(self.device.straggler_wait_s(t) for t in stretches if t > 0)


@dataclass(frozen=True)
class StepExtras:
    """The terms of this module in one training step (not pipelined), in seconds."""

    overhead_s: float  # the ops' overhead and the gradients' handling
    optimizer_s: float  # the optimizer step, offload's copies included
    latency_s: float  # the gradient-sum buckets' latency
    hidden_s: float  # communication hidden behind backward
    wait_s: float  # waiting for the slowest rank at synchronising points
    hidden_launch_s: float = 0.0  # op overhead and compute that overlap on an asynchronous device

    @property
    def added_s(self) -> float:
        """What these terms add to the step's compute and communication."""
        return self.overhead_s + self.optimizer_s + self.wait_s - self.hidden_s - self.hidden_launch_s


def whole_step(terms: StepTerms, microbatches: int = 1) -> StepExtras:
    """The extras of a step of the whole program, run on ``microbatches`` accumulated microbatches
    one after another (``terms`` are one microbatch's; ``gradient_s`` the whole step's already).
    The forward's last stretch of compute runs on into the backward, and a microbatch's backward
    into the next one's forward (its gradients stay in the leaves); the last backward's last
    stretch ends where the gradient-sum buckets are waited for, if there are any (launched in the
    last microbatch's backward alone, and hidden behind it alone), and the optimizer step is a
    stretch of its own (ending at ZeRO's first gather or at the end of the step, whose time is the
    slowest rank's); without buckets it runs on into it."""
    forward, backward = terms.segments()
    buckets = terms.bucket_times()
    optimizer = sum(terms.update_s.values())
    one = [*forward[:-1], forward[-1] + backward[0], *backward[1:]]
    stretches = list(one)
    for _ in range(microbatches - 1):
        stretches[-1] += one[0]
        stretches += one[1:]
    if terms.grad_sums:
        stretches.append(optimizer)
    else:
        stretches[-1] += optimizer
    return StepExtras(
        overhead_s=microbatches * sum(terms.op_s.values()) + sum(terms.gradient_s.values()),
        optimizer_s=optimizer,
        latency_s=buckets.latency_s,
        hidden_s=buckets.hidden_s,
        wait_s=terms.waits(stretches),
        hidden_launch_s=microbatches * terms.hidden_launches(),
    )


def program_ops(
    graph: torch.fx.Graph,
    flows: Mapping[torch.fx.Node, bool],
    compute_s: Mapping[str, float],
    recompute_s: Mapping[str, float],
    redistributions: Iterable[Redistribution],
    recompute: Mapping[str, RecomputeWork],
) -> list[OpTime]:
    """The :class:`OpTime` of every op of ``graph`` (``getitem`` picks an output, it runs nothing)
    and of its output, from each one's priced compute, whether a gradient flows through it
    (``flows``), its recompute and the checkpoint's work for it, and the collectives of the redistributions
    into it (a parameter's gradient sum goes to no op)."""
    syncs: dict[str, tuple[int, int, float]] = {}  # op -> its operands' forward, backward collectives
    for r in redistributions:
        f, b, seconds = syncs.get(r.dst, (0, 0, 0.0))
        syncs[r.dst] = (f + len(r.forward), b + len(r.backward), seconds + sum(c.seconds for c in r.backward))
    return [
        OpTime(
            n.name,
            compute_s.get(n.name, 0.0),
            bool(flows.get(n)),
            recompute_s.get(n.name, 0.0),
            recompute.get(n.name),
            *syncs.get(n.name, (0, 0, 0.0)),
            runs=n.op != "output",
        )
        for n in graph.nodes
        if (n.op == "call_function" and n.target is not operator.getitem) or n.op == "output"
    ]


def step_terms(
    ops: Sequence[OpTime],
    update_s: Mapping[str, float],
    grad_sums: Mapping[str, GradSum],
    cluster: Cluster,
    gradient_s: Mapping[str, float],
) -> StepTerms:
    """The :class:`StepTerms` of ``ops`` (in forward order) and of the parameters' updates, sums and
    gradients."""
    return StepTerms(
        ops=tuple(ops),
        op_s={op.name: op_seconds(cluster, op.grad, op.recompute) for op in ops if op.runs},
        update_s=dict(update_s),
        grad_sums=dict(grad_sums),
        device=device_model(cluster),
        gradient_s=dict(gradient_s),
    )
