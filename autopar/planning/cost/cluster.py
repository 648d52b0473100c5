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
from autopar.planning.cost.efficiency import Efficiency
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
    """One network link: per-message latency and per-rank bandwidth in one direction, priced by the ring
    alpha-beta model; :meth:`for_collective` picks a collective kind's own figures where it has them.
    Measured by ``autopar calibrate`` (a cluster file), or a preset's (NCCL's bus bandwidth on a GPU's)."""

    latency_s: float  # alpha: seconds per message
    bandwidth_Bps: float  # beta: bytes per second one rank sends in one direction
    # Figures of a collective kind's own (keyed by CollectiveKind or its value), fitted to its ring formula
    # by calibrate, else the link's; read-only, out of the hash (equality compares them); empty: none.
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
    twice them), ``peak`` the dtype's product rate, ``scores`` the query-key pairs. Under the implicit
    causal mask a kernel skips the blocks of keys wholly after its block of queries: a fraction
    ``(1 + causal_block / length) / 2`` of the pairs is computed (at most 1). ``docs/cost_model.md``
    has the figures measured.
    """

    # What the kernel's products cost over the dtype's product rate (>= 1): its backward recomputes
    # the scores, and its small blocks run below a large product's rate.
    flop_scale: float
    score_s: float  # seconds a query-key pair costs besides its products (its exp, the softmax's share)
    causal_block: float  # keys per block the kernel skips whole under the causal mask

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
    """The hardware the plan runs on: one rank's device, its links and its host.

    Every per-device figure is for one rank. ``autopar calibrate`` measures them into a cluster file
    (``docs/cost_model.md``, "Your machine"); the GPU presets hold the rates their kernels reach at
    their best and an ``efficiency`` for the rest (:mod:`~autopar.planning.cost.efficiency`), each
    sourced in "Presets" there beside the datasheet's. The roofline figures and the links price ops
    and collectives (:class:`~autopar.planning.cost.model.CostModel`); every other
    term is read through the cluster's device model
    (:func:`~autopar.planning.cost.device_model.device_model`), which prices the CPU-gloo terms only
    where the cluster sets them. A file written before a figure existed reads its default. The
    mappings (``peak_flops``, ``function_rates``) are stored read-only and left out of the hash
    (equality compares them), so a Cluster can key caches.

    Every field is checked as given, nothing converted: a count is an int (not a bool or a float),
    a figure a finite int or float in its range, a flag a bool, a table's keys known ones; anything
    else is an :class:`~autopar.ir.errors.OptionError` naming the cluster, the field and what it takes.
    """

    name: str
    # FLOP/s of matrix products per dtype, keyed by torch's dtype names ("bfloat16", not "bf16": see
    # dtype_name); must hold "float32", the fallback for dtypes it does not list.
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bandwidth_Bps: float  # bytes per second one rank reads and writes: every op's floor
    memory_bytes: int  # bytes of memory per device: the default memory budget
    # Ranks per node: a mesh axis whose ranks span more crosses nodes; ONE_HOST where all share one host.
    devices_per_node: int
    intra_node: LinkSpec  # the link between ranks of one node
    inter_node: LinkSpec  # the link between nodes
    measured_on: str = ""  # the host `autopar calibrate` measured (a cluster file's); "" for presets
    # Seconds one executed op costs besides its roofline time (launch, dispatch, autograd's
    # bookkeeping): calibrate's, a preset's assumed; 0: none.
    op_overhead_s: float = 0.0
    # Seconds a synchronising collective waits for the slowest rank after 1 s of compute apart, after t
    # seconds straggler_s * sqrt(t) (the ranks drift like a random walk): calibrate's; 0: none.
    straggler_s: float = 0.0
    # Seconds every such wait adds however short the compute before it (ranks sharing cores: the last
    # to arrive waits for a core): calibrate's; 0: none.
    straggler_base_s: float = 0.0
    # Ranks sharing a core where a host runs more ranks than cores (4 on 2: 2), so a rank whose neighbours
    # wait runs up to that many times faster: calibrate's (ranks over os.cpu_count()); 1: cores of its own.
    ranks_per_core: float = 1.0
    # Bytes per second one rank copies to or from host memory, one direction (optimizer offload's
    # copies; a GPU's PCIe link): calibrate --device's or a preset's; None where the device is the host.
    host_link_Bps: float | None = None
    # Bytes per second of host memory one rank's share of the host gets (the offloaded update):
    # calibrate --device's or a preset's; None where the device is the host (memory_bandwidth_Bps).
    host_memory_bandwidth_Bps: float | None = None
    # Exp, log or erf values one rank computes per second (on a CPU far fewer than its FLOP/s):
    # calibrate's; None where they are no limit (a GPU's special function units keep up with memory).
    transcendentals_per_s: float | None = None
    # Seconds the optimizer step spends per parameter tensor besides moving its bytes (torch's AdamW on
    # DTensor parameters, each op through DTensor's dispatch): calibrate's; None: its ops' op_overhead_s.
    optimizer_tensor_s: float | None = None
    # Values per second one rank computes of each elementwise function calibrate timed (TIMED_FUNCTIONS,
    # "<name>_backward" for a backward), pricing those ops instead of their transcendentals; empty: none.
    function_rates: Mapping[str, float] = field(default_factory=dict, hash=False)
    # Seconds one op of a recompute region costs besides its own overhead (its relaunch, the policy's
    # dispatch): files calibrated before recompute_unit_s; None: one op_overhead_s.
    recompute_op_s: float | None = None
    # Seconds per unit of a recompute region under the selective policy, an op one unit and one per tensor
    # autograd saves for it (packed and unpacked): calibrate's; replaces recompute_op_s; None: that prices.
    recompute_unit_s: float | None = None
    # Seconds per unit of a full region without collectives, which runs under plain checkpointing (no
    # policy to consult): calibrate's; None: recompute_unit_s.
    checkpoint_unit_s: float | None = None
    # Whether the device runs an op after its launch returns (a GPU): the host launches ahead and the
    # ops' overhead overlaps their compute. False where the host computes (CPU ranks).
    asynchronous: bool = False
    # Seconds an op on the host's tensors costs (offload's update on the host): calibrate --device's;
    # None where the host is the device (op_overhead_s).
    host_op_overhead_s: float | None = None
    # CPU threads each rank computed on when calibrate measured it, whose rates hold for as many (a plan
    # made on another number says so); None where not recorded (presets, one device's file, ranks apart).
    threads_per_rank: int | None = None
    # How a fused attention kernel runs, timed by calibrate; None: its products at peak_flops and an exp
    # per score, forward and backward, at transcendentals_per_s.
    attention: AttentionRates | None = None
    # How a GPU's kernels fall below the figures above by shape (a small product, flash attention): the
    # GPU presets'; None: every kernel at the figures (CPU presets, calibrate's files).
    efficiency: Efficiency | None = None
    # Network adapters of a node, each a rank's own inter_node link (a DGX's eight): a collective whose
    # ring has g ranks on each node crosses nodes over min(g, nics_per_node) of them at once; None: one
    # inter_node link per ring, however many of its ranks share a node.
    nics_per_node: int | None = None

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
        if self.efficiency is not None:
            check_instance(self.efficiency, Efficiency, f"{owner}: efficiency", "an Efficiency or None")
        if self.nics_per_node is not None:
            check_int(self.nics_per_node, f"{owner}: nics_per_node (or None)", minimum=1)

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
            "efficiency": None if self.efficiency is None else self.efficiency.to_dict(),
            "nics_per_node": self.nics_per_node,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """The cluster :meth:`to_dict` wrote; every field with a default (each added since the first
        files) is optional, so files written before it still load.

        Nothing is converted: a field of another type than the constructor takes (``"false"`` for
        ``asynchronous``, ``2.5`` devices per node), a non-finite figure or an unknown key (at any
        level: ``"bf16"`` among ``peak_flops``) is an :class:`~autopar.ir.errors.OptionError` naming
        the field and what it takes (the nearest known key for an unknown one).
        """
        missing = [name for name in _REQUIRED if isinstance(data, Mapping) and name not in data]
        if missing:
            raise OptionError(f"cluster lacks {missing[0]!r}: {_REQUIRED[missing[0]]}")
        check_keys(data, "cluster", _fields(cls), required=_required(cls))
        links = {link: LinkSpec.from_dict(data[link], link) for link in ("intra_node", "inter_node")}
        attention, efficiency = data.get("attention"), data.get("efficiency")
        rates = None if attention is None else AttentionRates.from_dict(attention)
        kernels = None if efficiency is None else Efficiency.from_dict(efficiency)
        cluster = cls(**{**data, **links, "attention": rates, "efficiency": kernels})
        check_physical(cluster)
        return cluster


# The bounds of a real machine's figures, past which a cluster file most likely gave another unit: no
# link or memory the planner prices moves under 100 kB/s (25 meant as GB/s is 25 B/s), no link waits a
# second a message (3 meant as microseconds), no device holds under a MiB (80 meant as GB), and none
# computes under a thousandth of a FLOP per byte its memory moves (312 meant as TFLOP/s).
_LEAST_BANDWIDTH_BPS = 1e5
_MOST_LATENCY_S = 1.0
_LEAST_MEMORY_BYTES = 1 << 20
_LEAST_FLOPS_PER_BYTE = 1e-3


def check_physical(cluster: Cluster) -> None:
    """Refuse a cluster file's figure that no machine has (most likely one in another unit), naming the
    field, its value and what it takes; :meth:`Cluster.from_dict` checks every file it reads.

    Args:
        cluster: the cluster as read, each figure already checked for its type and sign.
    """
    owner = f"cluster {cluster.name!r}"
    rates = {
        "memory_bandwidth_Bps": cluster.memory_bandwidth_Bps,
        "host_link_Bps": cluster.host_link_Bps,
        "host_memory_bandwidth_Bps": cluster.host_memory_bandwidth_Bps,
    }
    for name in ("intra_node", "inter_node"):
        link = getattr(cluster, name)
        specs = {name: link, **{f"{name}.collectives.{k.value}": v for k, v in link.collectives.items()}}
        for where, spec in specs.items():
            rates[f"{where}.bandwidth_Bps"] = spec.bandwidth_Bps
            if spec.latency_s > _MOST_LATENCY_S:
                raise OptionError(
                    f"{owner}: {where}.latency_s is {spec.latency_s:g} seconds per message, above a second: "
                    "latencies are in seconds (3 microseconds is 3e-6)"
                )
    for name, rate in rates.items():
        if rate is not None and rate < _LEAST_BANDWIDTH_BPS:
            raise OptionError(
                f"{owner}: {name} is {rate:g} bytes per second, slower than any machine's "
                f"({_LEAST_BANDWIDTH_BPS:g}): bandwidths are in bytes per second (25 GB/s is 25e9)"
            )
    if cluster.memory_bytes < _LEAST_MEMORY_BYTES:
        raise OptionError(
            f"{owner}: memory_bytes is {cluster.memory_bytes} bytes per device, less than a MiB: memory is "
            "in bytes, an integer (80 GB is 80000000000)"
        )
    for dtype, peak in cluster.peak_flops.items():
        if peak < _LEAST_FLOPS_PER_BYTE * cluster.memory_bandwidth_Bps:
            raise OptionError(
                f"{owner}: peak_flops[{dtype!r}] is {peak:g} FLOP/s against memory_bandwidth_Bps "
                f"{cluster.memory_bandwidth_Bps:g} bytes per second, under a thousandth of a FLOP a byte: "
                "peaks are in FLOP/s (312 TFLOP/s is 312e12)"
            )


# What a cluster file must give, in words: a missing one's error says what it takes.
_REQUIRED = {
    "name": "a name for the cluster (a string)",
    "peak_flops": 'FLOP/s of matrix products per dtype, e.g. {"float32": 19.5e12, "bfloat16": 312e12}',
    "memory_bandwidth_Bps": "bytes per second one rank reads and writes (2 TB/s is 2e12)",
    "memory_bytes": "bytes of memory per device, an integer (80 GB is 80000000000)",
    "devices_per_node": "ranks per node, an integer",
    "intra_node": 'the link inside a node: {"latency_s": seconds a message, "bandwidth_Bps": bytes a second}',
    "inter_node": 'the link between nodes: {"latency_s": seconds a message, "bandwidth_Bps": bytes a second}',
}


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
