"""The hardware a plan is priced for: :class:`Cluster`, its links (:class:`LinkSpec`), as JSON.

Every per-device figure is for one rank; times are in seconds, sizes in bytes, bandwidths in bytes
per second. :mod:`autopar.planning.cost.model` holds the presets and prices compute and communication
with these figures; ``autopar calibrate`` (:mod:`autopar.tools.calibrate`) measures them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from autopar.ir.arguments import check_bool, check_instance, check_int, check_keys, check_number
from autopar.ir.errors import OptionError
from autopar.ir.options import dtype_name
from autopar.ir.plan import CollectiveKind
from autopar.rules.elementwise import TIMED_BACKWARD, TIMED_FUNCTIONS

# Dtypes without an entry of their own in ``Cluster.peak_flops`` are priced as this one.
FALLBACK_DTYPE = "float32"

# ``Cluster.devices_per_node`` when all ranks share one host (cpu-gloo): no mesh axis ever crosses a node.
ONE_HOST = 1 << 20

# The keys ``Cluster.peak_flops`` takes: torch's dtype names. Other names in use for them (torch's
# aliases such as ``half``, and the short forms ``bf16``, ``fp16``...) are refused, naming the dtype,
# as a misspelt key would otherwise price its dtype at the fallback's peak without a word. TF32 is
# no dtype: the float32 products a GPU runs on its TF32 units.
DTYPES = frozenset(dtype_name(d) for d in vars(torch).values() if isinstance(d, torch.dtype))
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "tf32": "float32",
    "fp64": "float64",
    **{alias: dtype_name(d) for alias, d in vars(torch).items() if isinstance(d, torch.dtype)},
}
# The keys ``Cluster.function_rates`` takes: the functions calibrate times, forward and backward.
FUNCTIONS = frozenset(TIMED_FUNCTIONS) | {f"{name}_backward" for name in TIMED_BACKWARD}


@dataclass(frozen=True)
class LinkSpec:
    """One network link: per-message latency and per-rank bandwidth in one direction.

    ``collectives`` optionally maps a collective kind (a :class:`CollectiveKind` or its value) to
    figures of its own, fitted to that kind's ring formula by ``autopar calibrate``;
    :meth:`for_collective` picks them, falling back to the link's general figures. It is stored
    read-only and left out of the hash (equality compares it), as ``Cluster.peak_flops`` is.
    """

    latency_s: float
    bandwidth_Bps: float
    collectives: Mapping[CollectiveKind, LinkSpec] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        check_number(self.latency_s, "LinkSpec latency_s", unit="seconds per message", inclusive=True)
        check_number(self.bandwidth_Bps, "LinkSpec bandwidth_Bps", unit="bytes per second, one direction")
        check_keys(self.collectives, "LinkSpec collectives", _KINDS)
        kinds = {CollectiveKind(k): v for k, v in self.collectives.items()}
        if any(not isinstance(v, LinkSpec) or v.collectives for v in kinds.values()):
            raise OptionError(f"a link's per-collective figures must be plain LinkSpecs, got {kinds}")
        object.__setattr__(self, "collectives", MappingProxyType(kinds))

    def for_collective(self, kind: CollectiveKind) -> LinkSpec:
        """The figures that price ``kind``: its own where measured, the link's otherwise."""
        return self.collectives.get(kind, self)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict, without ``collectives`` when there are none (as in files written
        before there were); :meth:`from_dict` reads it back."""
        data: dict[str, Any] = {"latency_s": self.latency_s, "bandwidth_Bps": self.bandwidth_Bps}
        if self.collectives:
            data["collectives"] = {k.value: v.to_dict() for k, v in self.collectives.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "link") -> LinkSpec:
        """The link :meth:`to_dict` wrote; every error names ``where`` it was read (``intra_node``)."""
        check_keys(data, where, _fields(cls), required=_required(cls))
        collectives = check_keys(data.get("collectives", {}), f"{where}.collectives", _KINDS)
        kinds = {k: cls.from_dict(v, f"{where}.collectives.{k}") for k, v in collectives.items()}
        return _built(cls, where, {**data, "collectives": kinds})


@dataclass(frozen=True)
class AttentionRates:
    """How a fused attention kernel (``scaled_dot_product_attention``: flash, memory-efficient, or
    the CPU's blocked kernel) runs on one rank, as ``autopar calibrate`` times it.

    Its forward and backward take ``flop_scale * 3 * flops / peak + score_s * scores``, times the
    causal fraction: ``flops`` the forward's products as the rule counts them (the backward counted
    twice them; the kernels' backward recomputes the scores, and their small blocks run below a
    large product's rate: ``flop_scale`` is what both cost on top, some 1.25 on a CPU), ``peak``
    the dtype's product rate, ``scores`` the query-key pairs, each of which costs ``score_s``
    besides (its exp, the softmax's bookkeeping, forward and backward). Under the implicit causal
    mask a kernel skips the blocks of keys wholly after its block of queries: with blocks of
    ``causal_block`` keys, a fraction ``(1 + causal_block / length) / 2`` of the pairs is computed
    (at most 1; some 512 on a CPU, which computes a 512-long causal sequence whole).
    """

    flop_scale: float
    score_s: float
    causal_block: float

    def __post_init__(self) -> None:
        check_number(self.flop_scale, "AttentionRates flop_scale", unit="times the products' time")
        check_number(self.score_s, "AttentionRates score_s", unit="seconds per score", inclusive=True)
        check_number(self.causal_block, "AttentionRates causal_block", unit="keys", inclusive=True)

    def seconds(self, flops: float, scores: float, causal_length: int, peak: float, grad: bool) -> float:
        """Seconds of one attention call: forward and backward where ``grad``, else the forward (a
        third, as the cost model splits every op). ``causal_length`` is the sequence's length under
        the implicit causal mask, 0 without it."""
        causal = min(1.0, (1 + self.causal_block / causal_length) / 2) if causal_length else 1.0
        both = causal * (self.flop_scale * 3 * flops / peak + self.score_s * scores)
        return both if grad else both / 3

    def describe(self) -> str:
        """The rates in a few words, as ``autopar calibrate`` prints them."""
        return (
            f"attention at {self.flop_scale:.2f}x the products' time, {self.score_s * 1e9:.2f} ns a score, "
            f"causal blocks of {self.causal_block:.0f} keys"
        )

    def to_dict(self) -> dict[str, float]:
        return {"flop_scale": self.flop_scale, "score_s": self.score_s, "causal_block": self.causal_block}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "attention") -> AttentionRates:
        """The rates :meth:`to_dict` wrote; every error names ``where`` they were read."""
        check_keys(data, where, _fields(cls), required=_required(cls))
        return _built(cls, where, data)


@dataclass(frozen=True)
class Cluster:
    """The hardware the plan runs on; every per-device figure is for one rank.

    ``peak_flops`` maps torch's dtype names (``"bfloat16"``, not ``"bf16"``: see :func:`dtype_name`)
    to FLOP/s and must hold ``"float32"``, the fallback for dtypes it does not list. It is stored read-only;
    it is left out of the hash (equality still compares it) so a Cluster can key caches.

    ``op_overhead_s`` is what one executed op costs besides its roofline time (launch and
    dispatch). ``straggler_s`` is how long a synchronising collective waits for the slowest rank
    after the ranks computed apart for one second; after ``t`` seconds it waits
    ``straggler_s * sqrt(t)`` (ranks drift apart like a random walk: on shared cores by the
    scheduler's slices), and ``straggler_base_s`` more at every such wait however short the
    compute before it (ranks sharing cores: the last to arrive waits for a core).
    ``ranks_per_core`` is how many ranks share one core's worth of compute
    where a host runs more ranks than it has cores (4 ranks on 2 cores: 2), else 1: a rank whose
    neighbours wait then runs up to that many times faster. ``autopar calibrate`` measures these;
    a file written before they existed reads 0, 0 and 1. ``transcendentals_per_s`` is how many
    exp, log or erf values per second one rank computes (on a CPU, far fewer than its FLOP/s);
    None where they are no limit (a GPU's special function units keep up with its memory).
    ``optimizer_tensor_s`` is what the optimizer step spends per parameter tensor besides
    moving its bytes: torch's AdamW on the compiled module's DTensor parameters, whose every op
    goes through DTensor's dispatch (0.32-0.38 ms a tensor measured on 4 CPU ranks sharing 2
    cores, three times the overhead of the ten plain ops it runs); None where not measured: ten
    ops' ``op_overhead_s``.
    ``function_rates`` is how many values per second one rank computes of each elementwise
    function calibrate timed (:data:`~autopar.rules.elementwise.TIMED_FUNCTIONS`, and
    ``<name>_backward`` for their backward), which then price those ops instead of their
    transcendental count at ``transcendentals_per_s``; empty where not measured.
    ``recompute_op_s`` is what one op of a recompute region costs besides its forward and
    backward overhead: its second launch, and the selective-checkpoint policy's dispatch of it in
    forward and again when backward recomputes it; None where not measured: one
    ``op_overhead_s``, its relaunch alone. ``recompute_unit_s``, where calibrate measured it,
    prices the same per op and per tensor autograd saves for it (the checkpoint's hooks pack and
    unpack each): an op of the region costs ``recompute_unit_s * (1 + saved tensors)``, so a
    cast or an addition (nothing saved) costs less than a ``linear`` (two) or a layer norm; it
    replaces ``recompute_op_s`` then. On a CPU some 40 us a unit against 4 us for a plain op.
    ``checkpoint_unit_s`` is the unit of a full region without collectives, which the runtime runs
    under plain checkpointing (no policy to consult: some 20 us a unit on a CPU); None where not
    measured: ``recompute_unit_s``.
    ``asynchronous`` says the device runs an op after its launch returns (a GPU): the host then
    launches ahead while the device computes, and the ops' overhead overlaps their compute
    (:func:`~autopar.planning.cost.step_overheads.launch_queue`); False where the host computes (CPU
    ranks), whose overhead adds to the compute.
    ``host_op_overhead_s`` is what an op on the host's tensors costs (optimizer offload's update on
    the host), None where the host is the device: ``op_overhead_s``.
    ``host_link_Bps`` is one rank's bandwidth to host memory, one direction (optimizer offload's
    copies), and ``host_memory_bandwidth_Bps`` the host memory bandwidth one rank's share of the
    host gets (the offloaded update); None for both where the device is the host (CPU ranks):
    a copy is then memory traffic and the host update runs at ``memory_bandwidth_Bps``.
    ``attention`` prices ``scaled_dot_product_attention`` as its fused kernel runs
    (:class:`AttentionRates`); None where not measured: its products at ``peak_flops`` and an exp
    per score forward and backward at ``transcendentals_per_s``.
    ``threads_per_rank`` is how many CPU threads each rank computed with when calibrate measured
    it (``torch.get_num_threads()``): its rates hold for ranks computing on as many, and a plan
    made on a rank computing on another number says so; None where not recorded (presets, one
    device's file, ranks that differed).

    Every field is checked as given, nothing converted: a count is an int (not a bool or a float),
    a figure a finite int or float in its range, a flag a bool, a table's keys known ones; anything
    else is an :class:`~autopar.ir.errors.OptionError` naming the cluster, the field and what it takes.
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bandwidth_Bps: float
    memory_bytes: int
    devices_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    measured_on: str = ""  # the machine `autopar calibrate` measured (a cluster file's); "" for presets
    op_overhead_s: float = 0.0
    straggler_s: float = 0.0
    straggler_base_s: float = 0.0
    ranks_per_core: float = 1.0
    host_link_Bps: float | None = None
    host_memory_bandwidth_Bps: float | None = None
    transcendentals_per_s: float | None = None
    optimizer_tensor_s: float | None = None
    function_rates: Mapping[str, float] = field(default_factory=dict, hash=False)
    recompute_op_s: float | None = None
    recompute_unit_s: float | None = None
    checkpoint_unit_s: float | None = None
    asynchronous: bool = False
    host_op_overhead_s: float | None = None
    threads_per_rank: int | None = None
    attention: AttentionRates | None = None

    def __post_init__(self) -> None:
        check_instance(self.name, str, "a cluster's name", "a string")
        owner = f"cluster {self.name!r}"
        check_keys(self.peak_flops, f"{owner}: peak_flops", DTYPES, aliases=DTYPE_ALIASES)
        check_keys(self.function_rates, f"{owner}: function_rates", FUNCTIONS)
        for table, unit in (("peak_flops", "FLOP/s"), ("function_rates", "values per second")):
            for key, rate in getattr(self, table).items():
                check_number(rate, f"{owner}: {table}[{key!r}]", unit=unit)
            object.__setattr__(self, table, MappingProxyType(dict(getattr(self, table))))
        if FALLBACK_DTYPE not in self.peak_flops:
            raise OptionError(f"{owner}: peak_flops must have a {FALLBACK_DTYPE!r} entry")
        for name, (unit, minimum, inclusive, optional) in _FIGURES.items():
            if getattr(self, name) is not None or not optional:
                check_number(
                    getattr(self, name), f"{owner}: {name}", unit=unit, minimum=minimum, inclusive=inclusive
                )
        check_int(self.memory_bytes, f"{owner}: memory_bytes (bytes per device)", minimum=1)
        check_int(self.devices_per_node, f"{owner}: devices_per_node", minimum=1)
        if self.threads_per_rank is not None:
            check_int(self.threads_per_rank, f"{owner}: threads_per_rank (or None)", minimum=1)
        check_instance(self.measured_on, str, f"{owner}: measured_on", "a host name (a string)")
        check_bool(self.asynchronous, f"{owner}: asynchronous")
        for link in ("intra_node", "inter_node"):
            check_instance(getattr(self, link), LinkSpec, f"{owner}: {link}", "an autopar.LinkSpec")
        if self.attention is not None:
            check_instance(self.attention, AttentionRates, f"{owner}: attention", "AttentionRates or None")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; :meth:`from_dict` reads it back."""
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth_Bps": self.memory_bandwidth_Bps,
            "memory_bytes": self.memory_bytes,
            "devices_per_node": self.devices_per_node,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "measured_on": self.measured_on,
            "op_overhead_s": self.op_overhead_s,
            "straggler_s": self.straggler_s,
            "straggler_base_s": self.straggler_base_s,
            "ranks_per_core": self.ranks_per_core,
            "host_link_Bps": self.host_link_Bps,
            "host_memory_bandwidth_Bps": self.host_memory_bandwidth_Bps,
            "transcendentals_per_s": self.transcendentals_per_s,
            "optimizer_tensor_s": self.optimizer_tensor_s,
            "function_rates": dict(self.function_rates),
            "recompute_op_s": self.recompute_op_s,
            "recompute_unit_s": self.recompute_unit_s,
            "checkpoint_unit_s": self.checkpoint_unit_s,
            "asynchronous": self.asynchronous,
            "host_op_overhead_s": self.host_op_overhead_s,
            "threads_per_rank": self.threads_per_rank,
            "attention": None if self.attention is None else self.attention.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """The cluster :meth:`to_dict` wrote; the figures added since (``op_overhead_s``,
        the stragglers', ``ranks_per_core``, the host's, ``transcendentals_per_s``,
        ``optimizer_tensor_s``, ``function_rates``, ``recompute_op_s``, ``recompute_unit_s``,
        ``checkpoint_unit_s``, ``asynchronous``, ``host_op_overhead_s``, ``threads_per_rank``, ``attention``)
        are optional, so files written before them still load.

        Nothing is converted: a field of another type than the constructor takes (``"false"`` for
        ``asynchronous``, ``2.5`` devices per node), a non-finite figure or an unknown key (at any
        level: ``"bf16"`` among ``peak_flops``) is an :class:`~autopar.ir.errors.OptionError` naming
        the field and what it takes (the nearest known key for an unknown one).
        """
        check_keys(data, "cluster", _fields(cls), required=_required(cls))
        links = {link: LinkSpec.from_dict(data[link], link) for link in ("intra_node", "inter_node")}
        attention = data.get("attention")
        rates = None if attention is None else AttentionRates.from_dict(attention)
        return cls(**{**data, **links, "attention": rates})


# How each figure of a Cluster is checked: its unit, its lowest value, whether that value itself is
# allowed, and whether None is (not measured).
_FIGURES = {
    "memory_bandwidth_Bps": ("bytes per second", 0.0, False, False),
    "op_overhead_s": ("seconds per op", 0.0, True, False),
    "straggler_s": ("seconds", 0.0, True, False),
    "straggler_base_s": ("seconds", 0.0, True, False),
    "ranks_per_core": ("ranks sharing one core", 1.0, True, False),
    "host_link_Bps": ("bytes per second, one direction; or None", 0.0, False, True),
    "host_memory_bandwidth_Bps": ("bytes per second; or None", 0.0, False, True),
    "transcendentals_per_s": ("values per second; or None", 0.0, False, True),
    "optimizer_tensor_s": ("seconds per tensor; or None", 0.0, True, True),
    "recompute_op_s": ("seconds per op; or None", 0.0, True, True),
    "recompute_unit_s": ("seconds per unit; or None", 0.0, True, True),
    "checkpoint_unit_s": ("seconds per unit; or None", 0.0, True, True),
    "host_op_overhead_s": ("seconds per op; or None", 0.0, True, True),
}
_KINDS = frozenset(k.value for k in CollectiveKind)


def _fields(cls: type) -> set[str]:
    """The fields a cluster file may hold for ``cls``."""
    return {f.name for f in dataclasses.fields(cls)}


def _required(cls: type) -> list[str]:
    """The fields of ``cls`` without a default: a file must hold them."""
    unset = dataclasses.MISSING
    return [f.name for f in dataclasses.fields(cls) if f.default is unset and f.default_factory is unset]


def _built(cls: type, where: str, values: Mapping[str, Any]) -> Any:
    """``cls(**values)``, its error prefixed with ``where`` the values were read."""
    try:
        return cls(**values)
    except OptionError as e:
        raise OptionError(f"{where}: {e}") from None
