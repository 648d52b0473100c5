"""The options a user passes to ``plan``/``compile``: :class:`PlanOptions`, holding :class:`Memory`,
:class:`Pipeline` and :class:`MixedPrecision`, and the recompute policies.

Plain frozen data, checked when built; the planner, the passes and the runtime read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from autopar.ir.arguments import check_bool, check_instance, check_int, check_number, is_int
from autopar.ir.errors import OptionError, PlanError
from autopar.ir.mesh import MeshSpec
from autopar.ir.updates import Update, check_update_kind


class RecomputePolicy(StrEnum):
    """What a recompute region keeps for backward: ``full`` keeps only its inputs and the outputs
    of its collectives (backward communicates no more than without recompute); ``selective`` also
    keeps the outputs of matrix products and attention (:data:`autopar.ir.ops.SELECTIVE_SAVES`);
    ``full-comm`` keeps only its inputs and runs its collectives again in backward (MindSpore's
    ``mp_comm_recompute``, Megatron-LM's full recompute)."""

    FULL = "full"
    SELECTIVE = "selective"
    FULL_COMM = "full-comm"

    def __repr__(self) -> str:  # messages and printed programs show the plain string
        return repr(self.value)


FULL, SELECTIVE, FULL_COMM = RecomputePolicy.FULL, RecomputePolicy.SELECTIVE, RecomputePolicy.FULL_COMM
POLICIES = tuple(p.value for p in RecomputePolicy)


def uses_policy(policy: str, autopar_ops: bool) -> bool:
    """Whether a recompute region of ``policy`` runs under the selective checkpoint's policy: a
    selective one always (it keeps products), a full one where it has ``autopar_ops`` (it keeps
    collectives' outputs and gathers regathers again); a full region of plain ops, and a
    ``full-comm`` one, recompute every op, as plain checkpointing does
    (``autopar.passes.apply_recompute``)."""
    return policy == SELECTIVE or (policy == FULL and autopar_ops)


@dataclass(frozen=True)
class Memory:
    """How a plan holds its state; the bytes each choice costs are in :mod:`autopar.planning.memory.model`.

    ``zero``: the ZeRO stage (0: none; 1: optimizer state split over each parameter's
    data-parallel axis; 2: gradients reduce-scattered too; 3: parameters split too,
    all-gathered just in time in forward and again in backward). ``None`` lets the
    planner choose under a ``memory_budget`` (0 without one).
    ``zero_threshold``: parameters smaller than this many bytes (per rank) stay whole.
    ``optimizer_states``: fp32 values the optimizer keeps per parameter element
    (AdamW 2, SGD with momentum 1, plain SGD 0).
    ``offload_optimizer``: the optimizer state, an fp32 master copy of the (ZeRO) shard
    and its gradient live on the host; the update runs there.
    ``offload_activations``: tensors saved for backward go to host memory
    (``torch.autograd.graph.save_on_cpu``); recompute regions still recompute.
    """

    zero: int | None = None
    zero_threshold: int = 0
    optimizer_states: int = 2
    offload_optimizer: bool = False
    offload_activations: bool = False

    def __post_init__(self) -> None:
        if self.zero is not None and (not is_int(self.zero) or self.zero not in (0, 1, 2, 3)):
            raise OptionError(f"Memory(zero=...) is a ZeRO stage 0, 1, 2 or 3 (or None), got {self.zero!r}")
        check_int(self.zero_threshold, "Memory(zero_threshold=...) (bytes per rank)")
        check_int(self.optimizer_states, "Memory(optimizer_states=...) (fp32 values per parameter element)")
        check_bool(self.offload_optimizer, "Memory(offload_optimizer=...)")
        check_bool(self.offload_activations, "Memory(offload_activations=...)")


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Pipeline:
    """How to pipeline: ``microbatches`` per step, the ``schedule``, stages per rank, the mesh axis.

    ``schedule`` is ``"gpipe"`` (all forwards, then all backwards: ``m`` microbatches
    in flight), ``"1f1b"`` (one forward, one backward in steady state: at most ``p``
    in flight; needs ``m >= p``) or ``"interleaved-1f1b"`` (``virtual_stages >= 2``
    stages per rank, looping: the bubble shrinks by that factor). The number of stages
    is ``size(axis) × virtual_stages``.
    """

    microbatches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    axis: str = "pp"

    def __post_init__(self) -> None:
        for name in ("microbatches", "virtual_stages"):
            check_int(getattr(self, name), f"Pipeline({name}=...)", minimum=1)
        if self.schedule not in SCHEDULES:
            raise OptionError(f"Pipeline: unknown schedule {self.schedule!r}; schedules are {SCHEDULES}")
        if not isinstance(self.axis, str):
            raise OptionError(f"Pipeline(axis=...) is the name of a mesh axis, got {self.axis!r}")
        if self.schedule == "interleaved-1f1b" and self.virtual_stages < 2:
            raise OptionError(
                "Pipeline: 'interleaved-1f1b' needs virtual_stages >= 2 (stages per rank); "
                "with one stage per rank use '1f1b'"
            )
        if self.schedule != "interleaved-1f1b" and self.virtual_stages != 1:
            raise OptionError(
                f"Pipeline: schedule {self.schedule!r} runs one stage per rank; virtual_stages="
                f"{self.virtual_stages} needs schedule='interleaved-1f1b'"
            )

    def size(self, mesh: MeshSpec) -> int:
        """Ranks along the pipeline axis (``p``)."""
        return mesh.axis_sizes[mesh.axis_index(self.axis)]

    def stages(self, mesh: MeshSpec) -> int:
        return self.size(mesh) * self.virtual_stages

    def stage_mesh(self, mesh: MeshSpec) -> MeshSpec:
        """The mesh each stage is sharded over: ``mesh`` without the pipeline axis.

        Checks that the axis exists, comes first and is not the only one, and that the
        schedule can run ``microbatches`` over the stages.
        """
        if self.axis not in mesh.axis_names:
            raise PlanError(
                f"the pipeline axis {self.axis!r} is not an axis of mesh {mesh}; name one axis "
                f"{self.axis!r} or pass Pipeline(axis=...)"
            )
        if mesh.axis_names[0] != self.axis:
            raise PlanError(
                f"the pipeline axis {self.axis!r} must be the first (outermost) axis of the mesh, "
                f"got mesh {mesh}; put it first, e.g. ({self.axis}, dp, tp)"
            )
        if mesh.ndim == 1:
            raise PlanError(
                f"mesh {mesh} has only the pipeline axis; each stage needs a mesh of its own: add a "
                f"data axis of size 1, e.g. init_device_mesh('cpu', ({mesh.size}, 1), "
                f"mesh_dim_names=('{self.axis}', 'dp'))"
            )
        p, m, stages = self.size(mesh), self.microbatches, self.stages(mesh)
        if self.schedule == "1f1b" and m < p:
            raise PlanError(
                f"schedule '1f1b' needs at least as many microbatches as stages: {m} microbatches "
                f"for {p} stages (use more microbatches, or schedule 'gpipe')"
            )
        rounds = max(1, m // p)
        if self.schedule == "interleaved-1f1b" and m % rounds:
            raise PlanError(
                f"schedule 'interleaved-1f1b' runs microbatches in rounds of {p} (the pipeline size); "
                f"{m} microbatches is not a multiple of its {rounds} rounds: use a multiple of {p}"
            )
        if stages < 2 and p < 2:
            raise PlanError(f"pipeline axis {self.axis!r} has size 1: there is nothing to pipeline")
        return MeshSpec(mesh.axis_names[1:], mesh.axis_sizes[1:])

    def in_flight(self, p: int, rank: int) -> int:
        """Most microbatch-stages rank ``rank`` holds at once: forwarded, not yet backwarded.

        GPipe: every microbatch of every local stage. 1F1B: ``p - rank`` (warm-up
        forwards plus one). Interleaved 1F1B: torch's warm-up count
        ``(v - 1) * m_round + 2 (p - 1 - rank)`` plus one, capped at ``v * m``.
        """
        m, v = self.microbatches, self.virtual_stages
        if self.schedule == "gpipe":
            return m * v
        if self.schedule == "1f1b":
            return min(m, p - rank)
        per_round = m // max(1, m // p)
        return min((v - 1) * per_round + 2 * (p - 1 - rank) + 1, m * v)

    def bubble_fraction(self, p: int) -> float:
        """Idle share of a step with balanced stages: ``((p-1)/v) / (m + (p-1)/v)``.

        For one stage per rank this is ``(p-1)/(m+p-1)``; interleaving divides the
        idle time by ``v``.
        """
        idle = (p - 1) / self.virtual_stages
        return idle / (self.microbatches + idle)


#: The dtypes a :class:`MixedPrecision` field may name, by their names in plans.
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in a lower precision with fp32 master weights (FSDP2's ``MixedPrecisionPolicy``).

    The model's floating parameters stay in their dtype (fp32: the master weights the
    optimizer updates, its state fp32 too); the compiled program casts each to
    ``param_dtype`` where it is read, and floating inputs too, so every op computes in
    ``param_dtype``; gradients flow back through the casts and reach the parameters in their
    own dtype. Their data-parallel sums (and ZeRO-2's reduce-scatters) run in ``reduce_dtype``
    (None: the parameter's own dtype), each gradient cast to it and the sum back. Floating
    outputs are cast to ``output_dtype``, so a loss computed from them (``train_step``'s
    ``loss_fn``) is computed and returned in fp32. Capture traces the model with
    ``param_dtype`` parameters, so code that reads a dtype (``x.to(hidden.dtype)``) sees the
    compute dtype, as it would under FSDP2.
    """

    param_dtype: torch.dtype = torch.bfloat16
    output_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "output_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in PRECISIONS.values() and not (name == "reduce_dtype" and value is None):
                raise OptionError(
                    f"MixedPrecision({name}=...) is one of torch.float32, torch.bfloat16 and "
                    f"torch.float16{' (or None)' if name == 'reduce_dtype' else ''}, got {value!r}"
                )

    def to_dict(self) -> dict[str, str | None]:
        reduce = None if self.reduce_dtype is None else dtype_name(self.reduce_dtype)
        names = (dtype_name(self.param_dtype), dtype_name(self.output_dtype))
        return {"param_dtype": names[0], "output_dtype": names[1], "reduce_dtype": reduce}

    @classmethod
    def from_dict(cls, d: dict[str, str | None]) -> MixedPrecision:
        reduce = d.get("reduce_dtype")
        return cls(
            param_dtype=PRECISIONS[d["param_dtype"]],
            output_dtype=PRECISIONS[d["output_dtype"]],
            reduce_dtype=None if reduce is None else PRECISIONS[reduce],
        )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how plans and ``Cluster.peak_flops`` name a dtype."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PlanOptions:
    """What ``autopar.plan`` and ``autopar.compile`` share, checked once when built and passed whole
    to the planner, the automatic mesh, lazy compilation and the update modes.

    Args:
        cluster: a preset name (None: ``"cpu-gloo"``), a cluster file (``.json``) or an
            ``autopar.Cluster``; the planner resolves it (``autopar.planning.cost.model.get_cluster``).
        time_limit: seconds of solver time per solve (wall clock and CP-SAT's deterministic seconds).
        seed: the solver's seed: the same seed gives the same plan.
        pipeline: a pipeline over one mesh axis, or None.
        memory: ZeRO, the optimizer's state and offload (None: the planner's default, ``Memory()``).
        memory_budget: bytes per device the plan must fit in (None: the cluster's memory).
        precision: mixed precision, or None (the model's own dtypes).
        workers: processes the automatic mesh plans its candidates in (None: one per usable CPU, at
            most 8).
        check_ids: whether vocab-parallel lookups check their ids' range (``IndexRangeError``).
        update: an update mode (``autopar.ParameterServer``, ``Async``, ``Hybrid``), or None: the
            synchronous all-reduce.
        accumulation: microbatches whose gradients a step accumulates without a pipeline, each one
            forward and backward, then one gradient sum and one optimizer step; None: the planner
            chooses (1 unless the batch does not fit, ``autopar.planning.search.accumulation``).
            A pipeline's microbatches already accumulate: with ``pipeline`` it is refused, as with
            ``update``.

    Raises:
        OptionError: naming the option and what it takes, for a value of the wrong kind or range.
    """

    cluster: Any = None  # str | os.PathLike | autopar.Cluster | None: a planning type, resolved there
    time_limit: float = 30.0
    seed: int = 0
    pipeline: Pipeline | None = None
    memory: Memory | None = None
    memory_budget: float | None = None
    precision: MixedPrecision | None = None
    workers: int | None = None
    check_ids: bool = True
    update: Update | None = None
    accumulation: int | None = None

    def __post_init__(self) -> None:
        check_number(self.time_limit, "time_limit", unit="seconds of solver time")
        check_int(self.seed, "seed")
        if self.pipeline is not None:
            check_instance(self.pipeline, Pipeline, "pipeline", "an autopar.Pipeline(...)")
        if self.memory is not None:
            check_instance(self.memory, Memory, "memory", "autopar.Memory(...)")
        if self.memory_budget is not None:
            check_number(self.memory_budget, "memory_budget", unit="bytes per device, such as 40 * 2**30")
        if self.precision is not None:
            check_instance(self.precision, MixedPrecision, "precision", "autopar.MixedPrecision(...)")
        if self.workers is not None:
            check_int(self.workers, "workers", minimum=1)
        check_bool(self.check_ids, "compile(check_ids=...)")
        if self.update is not None:
            check_update_kind(self.update)
        if self.accumulation is not None:
            check_accumulation(self.accumulation, self.pipeline, self.update)


def check_accumulation(accumulation: int, pipeline: Pipeline | None, update: Update | None) -> None:
    """Raise :class:`OptionError` unless ``accumulation`` is a count of microbatches a step can
    accumulate: an int of at least 1, without a pipeline (whose microbatches accumulate already) and
    without an update mode (whose units exchange after every backward pass)."""
    check_int(accumulation, "accumulation (microbatches per step)", minimum=1)
    if pipeline is not None:
        raise OptionError(
            f"accumulation={accumulation} with pipeline={pipeline}: a pipeline's microbatches already "
            f"accumulate their gradients; give Pipeline(microbatches=...) alone"
        )
    if update is not None:
        raise OptionError(
            f"accumulation={accumulation} with update={update!r}: the update modes exchange after every "
            "backward pass; leave accumulation unset"
        )
