"""A step under each update mode, from a synchronous plan and how much slower each replica runs.

Priced from the synchronous plan's :class:`~autopar.ir.plan.Prediction` (its compute, the waits for
stragglers :mod:`autopar.planning.cost.step_overheads` prices from ``Cluster.straggler_s``, its gradient
sums and optimizer step) and ``slowdowns``, one factor per replica of the data-parallel axis (1:
nominal; 3: three times slower, a persistent straggler):

* **sync**: every step lasts as long as the slowest replica's compute, plus the plan's
  communication and waits; the servers play no part;
* **units** (``ParameterServer``, ``Async``, ``Hybrid``): a unit's clock is its slowest replica's
  compute, the in-group all-reduce (``Hybrid``), and its exchange with the servers (its pieces out
  and back over the servers' links, which carry every unit's exchange; the servers' optimizer
  steps). With staleness 0 the units wait for each other every clock, as under sync; with a bound
  ``s >= 1`` the random drift ``wait_s`` prices is absorbed by the slack, but a *persistent*
  straggler still sets every unit's pace in the long run (a unit can never be more than ``s``
  clocks ahead of it); unbounded, each unit runs at its own pace.

:func:`compare_updates` tabulates them (``autopar plan --stragglers``); :func:`with_update` adds
one to a plan (``autopar.plan(..., update=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.ir.errors import OptionError
from autopar.ir.plan import Plan
from autopar.ir.updates import Async, Hybrid, ParameterServer, Update
from autopar.planning.cost.cluster import Cluster


@dataclass(frozen=True)
class UpdateCost:
    """One mode's prediction: ``clock_s`` per unit (in the order of the units), ``samples_per_s`` of
    the whole job, and ``wait_s`` the slowest unit's waits per clock (for the others, or drift)."""

    mode: str
    clock_s: tuple[float, ...]
    samples_per_s: float
    wait_s: float


def predict_update(
    plan: Plan, update: Update | None, slowdowns: Sequence[float], batch: int, cluster: Cluster | None = None
) -> UpdateCost:
    """``update``'s step (None: synchronous) for ``plan``, a synchronous plan over its data-parallel
    axis, with replica ``i`` running ``slowdowns[i]`` times slower; ``batch`` samples per step."""
    cluster = cluster or Cluster.from_dict(plan.cluster)
    p, spec = plan.prediction, plan.mesh_spec
    axis = "dp" if update is None else update.axis
    replicas = spec.axis_sizes[spec.axis_index(axis)] if axis in spec.axis_names else 1
    if len(slowdowns) != replicas or min(slowdowns) < 1:
        raise OptionError(
            f"stragglers: one slowdown >= 1 per replica of {axis!r} ({replicas}), got {list(slowdowns)}"
        )
    work = p.compute_s + p.overhead_s  # one replica's own computing, which a straggler stretches
    if update is None:
        clock = p.step_time_s + work * (max(slowdowns) - 1)
        waits = p.wait_s + work * (max(slowdowns) - min(slowdowns))
        return UpdateCost("sync", (clock,), batch / clock, waits)
    units = update.units(replicas)
    group = replicas // units
    ranks = spec.size // replicas  # ranks of one replica (tensor parallelism inside it)
    link = (
        cluster.intra_node if spec.size + update.servers <= cluster.devices_per_node else cluster.inter_node
    )
    pieces = p.param_bytes * ranks  # one replica's parameters (the pieces of its ranks)
    # every unit's pieces go out and come back through the servers' links; the servers step once per
    # clock (bound 0) or once per unit's push, over their share
    per_unit = 2 * pieces / (update.servers * link.bandwidth_Bps) + 2 * link.latency_s
    steps = 1 if update.bound == 0 else units
    server_s = units * per_unit + steps * p.optimizer_s * ranks / update.servers
    in_group = _gradient_sums(plan) if group > 1 else 0.0
    own = [max(slowdowns[u * group : (u + 1) * group]) * work for u in range(units)]
    clocks = [c + in_group + per_unit for c in own]
    if update.bound is None:  # each at its own pace, unless the servers are the bottleneck
        rate = min(sum(1 / c for c in clocks), 1 / max(server_s / units, 1e-12))
        return UpdateCost(_name(update), tuple(clocks), rate * batch / units, 0.0)
    drift = p.wait_s if update.bound == 0 else 0.0  # the slack absorbs random drift
    clock = max(max(clocks), server_s) + drift
    return UpdateCost(_name(update), (clock,) * units, batch / clock, clock - min(clocks))


def with_update(plan: Plan, update: Update) -> Plan:
    """``plan`` (synchronous, on the workers' mesh) with ``Plan.update`` set: ``update``'s name, its
    slowest unit's clock and its samples per second over sync's, every replica at the same speed."""
    spec = plan.mesh_spec
    replicas = [1.0] * spec.axis_sizes[spec.axis_index(update.axis)]
    sync, mode = (predict_update(plan, u, replicas, 1) for u in (None, update))
    plan.update = {
        "mode": mode.mode,
        "clock_s": max(mode.clock_s),
        "vs_sync": mode.samples_per_s / sync.samples_per_s,
    }
    return plan


def _gradient_sums(plan: Plan) -> float:
    """Seconds of the plan's gradient sums left exposed (the group's all-reduce under ``Hybrid``)."""
    return max(0.0, plan.prediction.comm_s - plan.prediction.hidden_comm_s)


def _name(update: Update) -> str:
    bound = "unbounded" if update.bound is None else f"staleness {update.bound}"
    if isinstance(update, Hybrid):
        return f"hybrid {update.groups} groups, {bound}"
    if isinstance(update, Async):
        return f"async, {bound}"
    return f"parameter server ({update.servers})"


def compare_updates(plan: Plan, slowdowns: Sequence[float], batch: int, servers: int = 1) -> str:
    """A table of sync, parameter server, async (staleness 0, 1, 2, unbounded) and hybrid (2 groups
    where the replicas split evenly) for ``plan`` under ``slowdowns``."""
    modes: list[Update | None] = [None, ParameterServer(servers)]
    modes += [Async(staleness=s, servers=servers) for s in (0, 1, 2, None)]
    if len(slowdowns) % 2 == 0 and len(slowdowns) > 2:
        modes += [Hybrid(groups=2, staleness=s, servers=servers) for s in (1, None)]
    rows = [predict_update(plan, m, slowdowns, batch) for m in modes]
    base = rows[0].samples_per_s
    lines = [f"update modes, replicas slowed {list(slowdowns)}, {batch} samples per step:"]
    lines += [f"  {'mode':<32} {'slowest clock':>14} {'samples/s':>11} {'vs sync':>8}"]
    for r in rows:
        clock = max(r.clock_s) * 1e3
        lines.append(
            f"  {r.mode:<32} {clock:>11.2f} ms {r.samples_per_s:>11.1f} {r.samples_per_s / base:>7.2f}x"
        )
    return "\n".join(lines)
