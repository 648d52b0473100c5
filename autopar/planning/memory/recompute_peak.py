"""The most alive while backward recomputes a region (see ``memory.model.activation_memory``).

:func:`~autopar.planning.memory.model.activation_memory` logs what each recompute region saves,
caches and makes (:class:`RegionLog`) and what the forward keeps on the device
(:class:`KeptOnDevice`); :func:`recompute_peak` replays one region's recomputation from what is
alive when backward reaches it. A model of a hundred regions keeps tens of thousands of values:
what is alive at a region is answered from prefix sums, not by listing them per region.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class RegionLog:
    """What one recompute region keeps and recomputes, by program position."""

    last: int = 0  # its last op
    last_saver: int = -1  # its last op saving a tensor for backward: the recomputation stops there
    # whether that op's output is made before the stop (SavedSpec.output_before_last_pack)
    last_saver_made: bool = False
    saved: dict[tuple, tuple[float, int]] = field(default_factory=dict)  # key -> (bytes, first saver)
    cached: dict[tuple, int] = field(default_factory=dict)  # outputs its policy keeps -> position
    # what its ops allocate: key -> (bytes, position, last use); recomputed, what no op saves lives
    # from its op to its last use, as the region's code drops it
    made: dict[tuple, tuple[float, int, int]] = field(default_factory=dict)


class KeptOnDevice:
    """What the forward keeps on the device for backward (``device``: key -> bytes), each from the
    position of the first op keeping it (``owner``), and what the ``caller`` holds (the program's
    returned values).

    Alive when backward reaches the region ending at position ``last``: what is kept up to it
    (the ops after it kept the rest, and their backward has freed it), and what the caller holds,
    made after the region or not."""

    def __init__(self, device: Mapping[tuple, float], owner: Mapping[tuple, int], caller: set[tuple]) -> None:
        self.device, self.owner, self.caller = device, owner, caller
        by_owner = sorted((owner[k], v) for k, v in device.items() if k not in caller)
        self._positions = [at for at, _ in by_owner]
        self._sums = [0.0, *itertools.accumulate(v for _, v in by_owner)]
        self._held_by_caller = sum(v for k, v in device.items() if k in caller)

    def alive(self, key: tuple, last: int) -> bool:
        return key in self.device and (key in self.caller or self.owner[key] <= last)

    def bytes_alive(self, last: int) -> float:
        return self._held_by_caller + self._sums[bisect.bisect_right(self._positions, last)]


def recompute_peak(log: RegionLog, kept: KeptOnDevice, dead: set[tuple]) -> float:
    """The most alive while backward recomputes a region, from what is alive when it starts
    (:class:`KeptOnDevice`): each recomputed value it saves
    and that is not alive adds its bytes at its first saver (a value the ops after the region
    kept was freed by their backward: the region makes it again), one it does not
    save lives from its op to its last use or the recomputation's end (torch stops it in its last
    saving op, whose own output is made only where autograd packs after the op ran, its outputs
    or statistics, rather than operands before it: the measurements that show it are in
    docs/benchmarks_history.md); a kept output
    that nothing saves for backward (in ``dead``) is freed once the recomputation has used it."""
    adds: dict[int, float] = {}
    frees: dict[int, float] = {}
    for key, (nbytes, at) in log.saved.items():
        if not kept.alive(key, log.last):
            adds[at] = adds.get(at, 0.0) + nbytes
    for key, (nbytes, at, end) in log.made.items():
        made_before_stop = at < log.last_saver or (at == log.last_saver and log.last_saver_made)
        if not kept.alive(key, log.last) and key not in log.saved and made_before_stop:
            adds[at] = adds.get(at, 0.0) + nbytes
            last = min(end, log.last_saver)
            frees[last] = frees.get(last, 0.0) + nbytes
    for key, at in log.cached.items():
        if key in dead and kept.alive(key, log.last) and at <= log.last_saver:
            frees[at] = frees.get(at, 0.0) + kept.device[key]
    peak = running = kept.bytes_alive(log.last)
    for at in sorted(adds.keys() | frees.keys()):
        running += adds.get(at, 0.0)
        peak = max(peak, running)
        running -= frees.get(at, 0.0)
    return peak
