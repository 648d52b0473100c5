"""Planning calls run side by side in forked child processes.

The automatic mesh plans dozens of candidate meshes, each on one core: CP-SAT runs with one
worker (deterministic) and the rest is Python. :class:`ForkedCalls` runs such calls in
children forked from this process, at most ``workers`` at once, so a child starts with every
capture and cache the parent holds (nothing is pickled on the way in) and only its result,
or its exception, is pickled back. With one worker, or where ``fork`` is not available
(Windows, and macOS where forking a process that has loaded torch is unsafe), each call
runs here, at once, and the results come back in the same order.

A child runs nothing but its call and leaves through ``os._exit`` (multiprocessing's fork
start method), so the parent's process group, open files and exit handlers are left alone.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from autopar.ir.errors import AutoparError, PlanError

# Each child copies the pages of the parent it writes to (docs/automatic_mesh.md: a large model's
# capture makes them many): more than this many at once is seldom faster and can exhaust a large
# host's memory.
DEFAULT_MAX_WORKERS = 8

Outcome = tuple[bool, Any]  # (True, the call's value) or (False, the exception it raised)


def default_workers() -> int:
    """The CPUs this process may run on, at most :data:`DEFAULT_MAX_WORKERS`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, DEFAULT_MAX_WORKERS))


def can_fork() -> bool:
    """Whether calls can run in forked children here (Linux)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


class SharedMinimum:
    """The least of the seconds offered so far, in memory shared with the children forked after it
    was made: the parent offers, a child reads the value of the moment (the automatic mesh's best
    step, which a candidate planned in a child stops at)."""

    def __init__(self, seconds: float = math.inf) -> None:
        self._value = multiprocessing.RawValue("d", seconds)  # one double: written whole, read whole

    @property
    def seconds(self) -> float:
        return self._value.value

    def offer(self, seconds: float) -> None:
        """Keep ``seconds`` if it is below the least so far."""
        if seconds < self._value.value:
            self._value.value = seconds


class ForkedCalls:
    """Calls keyed by the caller, run in at most ``workers`` forked children at once.

    :meth:`submit` starts one (or, with one worker, runs it here); :meth:`next_done` waits for
    one to end and returns its key and :data:`Outcome`; :attr:`seconds` holds each ended call's
    wall seconds, from its start to its outcome. Use it as a context manager: leaving it ends
    every child still running (on an error or an interrupt in the parent).
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers if can_fork() else 1
        self._children: dict[Connection, tuple[object, multiprocessing.process.BaseProcess]] = {}
        self._done: list[tuple[object, Outcome]] = []  # run here, not yet collected
        self._started: dict[object, float] = {}
        self.seconds: dict[object, float] = {}

    def __enter__(self) -> ForkedCalls:
        return self

    def __exit__(self, *exc: object) -> None:
        for conn, (_, child) in self._children.items():
            child.kill()
            child.join()
            conn.close()
        self._children.clear()

    @property
    def running(self) -> int:
        """Calls submitted and not yet collected by :meth:`next_done`."""
        return len(self._children) + len(self._done)

    def submit(self, key: object, call: Callable[[], Any]) -> None:
        """Start ``call`` (at most :attr:`workers` may be running; see :attr:`running`)."""
        self._started[key] = time.perf_counter()
        if self.workers == 1:
            self._done.append((key, _outcome(call)))
            self.seconds[key] = time.perf_counter() - self._started.pop(key)
            return
        fork = multiprocessing.get_context("fork")
        receive, send = fork.Pipe(duplex=False)
        child = fork.Process(target=_child, args=(call, send), daemon=True)
        child.start()
        send.close()  # the child's end: the parent's copy would keep the pipe open after the child died
        self._children[receive] = (key, child)

    def next_done(self) -> tuple[object, Outcome]:
        """The key and outcome of a call that has ended (the first submitted, with one worker)."""
        if self._done:
            return self._done.pop(0)
        conn = wait(list(self._children))[0]
        key, child = self._children.pop(conn)
        try:
            outcome = conn.recv()
        except EOFError:  # killed (out of memory, say) before it could answer
            child.join()
            outcome = (False, PlanError(f"the process planning it ended with exit code {child.exitcode}"))
        conn.close()
        child.join()
        self.seconds[key] = time.perf_counter() - self._started.pop(key)
        return key, outcome


def _outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return True, call()
    except Exception as e:  # handed to the caller, who raises it or records it
        return False, e


def _child(call: Callable[[], Any], send: Connection) -> None:
    ok, value = _outcome(call)
    if not ok and not isinstance(value, AutoparError):  # a bug: keep where it happened
        value.add_note("".join(traceback.format_exception(value)))
    try:
        send.send((ok, value))
    except Exception as e:  # a value or an exception that does not pickle
        send.send((False, PlanError(f"the planning process could not send its result back: {e!r}")))
    send.close()
