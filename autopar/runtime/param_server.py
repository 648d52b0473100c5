"""The parameter server: one server rank's share of the parameters, its optimizer, the clocks.

A server holds the pieces of the parameters assigned to it (one per distinct piece a unit's
ranks hold: under tensor parallelism, one per split coordinate) and one optimizer over them.
Workers are grouped in *units* (a replica, or a group of replicas under ``Hybrid``) that count
their steps, *clocks*, apart; :class:`Clocks` decides when a unit's gradient is applied and when
a unit may start its next clock (stale-synchronous parallel, ``docs/update_modes.md``):

* a unit may start clock ``c`` once every live unit's updates of clocks ``<= c - 1 - bound`` are
  applied (``bound`` is the staleness; None: never waits);
* with ``bound == 0`` the gradients of a clock are summed, in unit order, once every live unit
  pushed it, and applied as one optimizer step: exactly the synchronous all-reduce step;
* otherwise each unit's gradient is applied on arrival, as one optimizer step of its own.

Every gradient is scaled by ``1/units`` (each unit's is the mean over its share of the batch),
so that a clock's updates add up to the synchronous step's gradient. One thread per worker rank
talks to it (:func:`serve`); the state is guarded by one condition variable.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from autopar.runtime import update_wire as wire


@dataclasses.dataclass
class Clocks:
    """Stale-synchronous bookkeeping of ``units`` units with staleness ``bound`` (None: unbounded).

    ``applied[u]`` is the last clock of unit ``u`` whose update is applied (-1: none yet);
    ``live`` the units that count (a dead unit stops holding the others back until it rejoins).
    """

    units: int
    bound: int | None
    applied: list[int] = dataclasses.field(default_factory=list)
    live: set[int] = dataclasses.field(default_factory=set)
    pending: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # bound 0: clock -> units in

    def __post_init__(self) -> None:
        self.applied = self.applied or [-1] * self.units
        self.live = self.live or set(range(self.units))  # every unit counts from the start

    def complete(self) -> int:
        """The last clock every live unit's update is applied through (-1 before any)."""
        pool = self.live or set(range(self.units))
        return min(self.applied[u] for u in pool)

    def staleness(self, clock: int) -> int:
        """Clocks of updates that a unit starting ``clock`` now misses from some unit."""
        return max(0, clock - 1 - self.complete())

    def may_start(self, clock: int) -> bool:
        """Whether a unit may start ``clock`` (compute on the parameters as they are now)."""
        return self.bound is None or self.staleness(clock) <= self.bound

    def arrive(self, unit: int, clock: int) -> list[tuple[int, list[int]]]:
        """Unit ``unit`` pushed ``clock``: the ``(clock, units)`` batches to apply now, in order."""
        if self.bound != 0:
            return [(clock, [unit])]
        self.pending.setdefault(clock, set()).add(unit)
        return self._ready()

    def _ready(self) -> list[tuple[int, list[int]]]:
        ready = []
        for clock in sorted(self.pending):
            if not self.live <= self.pending[clock]:
                break
            ready.append((clock, sorted(self.pending.pop(clock))))
        return ready

    def mark_applied(self, clock: int, units: list[int]) -> None:
        for u in units:
            self.applied[u] = max(self.applied[u], clock)

    def join(self, unit: int) -> int:
        """Unit ``unit`` (re)joins: the clock it resumes at. A rejoining unit skips to where the
        others are, so that it holds nobody back (its missed clocks are lost, not waited for)."""
        others = [self.applied[u] for u in self.live if u != unit]
        if others:
            self.applied[unit] = max(self.applied[unit], min(others))
        self.live.add(unit)
        return self.applied[unit] + 1

    def leave(self, unit: int) -> list[tuple[int, list[int]]]:
        """Unit ``unit`` died or finished: the batches its absence completes."""
        self.live.discard(unit)
        for units in self.pending.values():
            units.discard(unit)
        return self._ready() if self.bound == 0 and self.live else []


class ServerCore:
    """One server's state: pieces, optimizer, clocks, the log of updates; see the module docstring.

    ``log`` holds one entry per optimizer step (``("apply", clock, units, version)``) and one per
    parameters handed out (``("start", unit, clock, staleness, version)``): a unit starting
    ``clock`` on parameters that miss ``staleness`` clocks of some unit's updates. ``version``
    counts the optimizer steps applied.
    """

    def __init__(self, index: int, resume: str | Path | None = None) -> None:
        self.index = index
        self.resume = resume
        self.cond = threading.Condition()
        self.pieces: dict[wire.PieceKey, torch.nn.Parameter] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.clocks: Clocks | None = None
        self.version = 0
        self.log: list[tuple] = []
        self.keys_of: dict[int, list[wire.PieceKey]] = {}  # unit -> every key its ranks hold here
        self.arrived: dict[tuple[int, int], dict[wire.PieceKey, torch.Tensor]] = {}
        self.held: dict[tuple[int, int], dict[wire.PieceKey, torch.Tensor]] = {}  # bound 0: pushed
        self.snapshots: dict[tuple[int, int], tuple[list[int], dict[wire.PieceKey, torch.Tensor]]] = {}
        self.finished: set[int] = set()  # worker ranks done
        self.joined: dict[int, set[int]] = {}  # unit -> its ranks (within the unit) joined
        self.starts: dict[int, int] = {}  # unit -> the clock its current incarnation starts at
        self.units = 0  # set by the first join, as are the clocks and the optimizer to build
        self.optimizer_spec: tuple[Any, dict[str, Any]] | None = None

    def join(self, meta: dict[str, Any], initial: dict[wire.PieceKey, torch.Tensor]) -> None:
        """A worker rank joins with ``meta`` (see :mod:`autopar.runtime.async_updates`) and the initial
        values of the pieces it owns; the first values of a piece win (every unit starts alike)."""
        with self.cond:
            for key, value in initial.items():
                self.pieces.setdefault(key, torch.nn.Parameter(value.clone()))
            self.keys_of.setdefault(meta["unit"], [])
            self.joined.setdefault(meta["unit"], set()).add(meta["unit_rank"])
            known = set(self.keys_of[meta["unit"]])
            self.keys_of[meta["unit"]] += [k for k, _, _, _ in meta["keys"] if k not in known]
            if self.clocks is None:
                self.clocks = Clocks(meta["units"], meta["bound"])
                if self.resume is not None:  # the clocks first: the units start where they were
                    saved = torch.load(Path(self.resume) / f"server-{self.index}.pt", weights_only=True)
                    self.clocks.applied, self.version = list(saved["applied"]), saved["version"]
                self.units = meta["units"]
                self.optimizer_spec = meta["optimizer"]
            self.cond.notify_all()

    def _ensure_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            cls, options = self.optimizer_spec
            self.optimizer = cls([self.pieces[k] for k in sorted(self.pieces)], **options)
            if self.resume is not None:
                self._load(self.resume)
        return self.optimizer

    def start(self, unit: int, unit_rank: int, rejoin: bool) -> int:
        """The clock a (re)joining unit starts at: its first rank decides (a rejoining unit skips to
        where the others are), its other ranks wait for that."""
        with self.cond:
            if unit_rank == 0:
                self.starts[unit] = self.clocks.join(unit) if rejoin else self.clocks.applied[unit] + 1
                self.cond.notify_all()
            self.cond.wait_for(lambda: unit in self.starts)
            return self.starts[unit]

    def push(self, unit: int, clock: int, grads: dict[wire.PieceKey, torch.Tensor]) -> None:
        """One rank's gradients of ``clock``; the unit's update counts once all its pieces are in."""
        with self.cond:
            got = self.arrived.setdefault((unit, clock), {})
            got.update(grads)
            if len(got) < len(self.keys_of[unit]):
                return
            self.held[(unit, clock)] = self.arrived.pop((unit, clock))
            self._apply(self.clocks.arrive(unit, clock))
            self.cond.notify_all()

    def _apply(self, batches: list[tuple[int, list[int]]]) -> None:
        optimizer = self._ensure_optimizer()
        for clock, units in batches:
            grads = [self.held.pop((u, clock)) for u in units]
            scale = 1.0 / self.units
            with torch.no_grad():
                for key, p in self.pieces.items():
                    p.grad = sum((g[key] * scale for g in grads if key in g), torch.zeros_like(p))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.version += 1
            self.clocks.mark_applied(clock, units)
            self.log.append(("apply", clock, tuple(units), self.version))

    def lost(self, unit: int) -> None:
        """A rank of ``unit`` died: the unit stops counting until it rejoins; server state stays."""
        with self.cond:
            for key in [k for k in self.arrived if k[0] == unit]:
                del self.arrived[key]
            self._apply(self.clocks.leave(unit))
            self.cond.notify_all()

    def parameters_for(self, unit: int, clock: int, ranks: int, keys: list[wire.PieceKey]) -> tuple:
        """``(staleness, version, values of keys)`` for a rank of ``unit`` to start ``clock``, once it
        may (blocks). Every rank of the unit gets the same version: the first takes a snapshot."""
        with self.cond:
            self.cond.wait_for(lambda: len(self.joined[unit]) == ranks)  # all its pieces are here
            self._ensure_optimizer()
            self.cond.wait_for(lambda: (unit, clock) in self.snapshots or self.clocks.may_start(clock))
            if (unit, clock) not in self.snapshots:
                stale = self.clocks.staleness(clock)
                values = {
                    k: p.detach().clone() for k, p in self.pieces.items() if k in set(self.keys_of[unit])
                }
                self.snapshots[(unit, clock)] = ([ranks, stale, self.version], values)
                self.log.append(("start", unit, clock, stale, self.version))
            info, values = self.snapshots[(unit, clock)]
            info[0] -= 1
            if info[0] == 0:
                del self.snapshots[(unit, clock)]
            return info[1], info[2], [values[k] for k in keys]

    def save(self, folder: str | Path) -> str | None:
        """This server's whole state (pieces, optimizer state, clocks, version) as
        ``folder/server-<index>.pt``, whole or not at all (written beside it, synced, renamed over it);
        why it could not be written (the OS's error), or None."""
        target = Path(folder) / f"server-{self.index}.pt"
        part = target.with_name(target.name + ".part")
        with self.cond:
            state = {
                "pieces": {_name(k): p.detach() for k, p in self.pieces.items()},
                "optimizer": self._ensure_optimizer().state_dict(),
                "applied": list(self.clocks.applied),
                "version": self.version,
            }
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(part, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(part, target)
            except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as RuntimeError
                if part.exists():
                    part.unlink()
                return f"server {self.index} cannot write {target}: {type(exc).__name__}: {exc}"
        return None

    def _load(self, folder: str | Path) -> None:
        state = torch.load(Path(folder) / f"server-{self.index}.pt", weights_only=True)
        with torch.no_grad():
            for key, p in self.pieces.items():
                p.copy_(state["pieces"][_name(key)])
        self.optimizer.load_state_dict(state["optimizer"])


def _name(key: wire.PieceKey) -> str:
    return f"{key[0]}@{','.join(map(str, key[1]))}"


def serve(core: ServerCore, store: Any, workers: int, poll: float = 0.05) -> None:
    """Serve ``workers`` worker ranks (one thread each) until every one has said it is done."""
    threads = [
        threading.Thread(target=_serve_rank, args=(core, store, w, poll), daemon=True) for w in range(workers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _serve_rank(core: ServerCore, store: Any, worker: int, poll: float) -> None:
    """One worker rank's conversation, incarnation after incarnation, until it says it is done.
    When an incarnation dies (its pair's connection closes) or finishes, its unit stops counting."""
    incarnation = 0
    while worker not in core.finished:
        if not store.check([wire.join_key(worker, incarnation + 1)]):
            time.sleep(poll)  # not (re)joined yet: look again
            continue
        incarnation += 1
        pg = wire.pair_group(store, core.index, worker, incarnation, on_server=True)
        seen: dict[str, int] = {}
        try:
            _converse(core, pg, seen)
        except RuntimeError:  # the worker died: only its pair is broken, the server's state stays
            pass
        if "unit" in seen:
            core.lost(seen["unit"])


def _converse(core: ServerCore, pg: Any, seen: dict[str, int]) -> None:
    """Messages of one worker incarnation on its pair group, until DONE; ``seen["unit"]`` its unit."""
    wire.recv_header(pg, 1)  # JOIN
    meta = wire.recv_object(pg, 1)
    owned = [k for k in meta["keys"] if k[3]]
    initial = wire.recv_tensors(pg, 1, [(s, d) for _, s, d, _ in owned])
    core.join(meta, {k[0]: v for k, v in zip(owned, initial)})
    unit = seen["unit"] = meta["unit"]
    clock = core.start(unit, meta["unit_rank"], rejoin=meta["incarnation"] > 1)
    keys = [k for k, _, _, _ in meta["keys"]]
    while True:
        stale, version, values = core.parameters_for(unit, clock, meta["unit_size"], keys)
        wire.send_header(pg, 1, wire.JOIN, clock, stale, version)
        wire.send_tensors(pg, 1, values)
        kind, clock, _, _ = wire.recv_header(pg, 1)
        while kind == wire.SAVE:
            problem = core.save(wire.recv_object(pg, 1))
            wire.send_header(pg, 1, wire.SAVE, clock, problem is not None)
            if problem is not None:
                wire.send_object(pg, 1, problem)
            kind, clock, _, _ = wire.recv_header(pg, 1)
        if kind == wire.DONE:
            core.finished.add(meta["worker"])
            return
        grads = wire.recv_tensors(pg, 1, [(s, d) for _, s, d, _ in owned])
        core.push(unit, clock, {k[0]: g for k, g in zip(owned, grads)})
        clock += 1
