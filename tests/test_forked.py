"""Planning calls in forked children (``autopar.planning.search.forked``): results and errors come back
keyed, a child that dies is an error naming its exit code, and one worker runs calls here."""

from __future__ import annotations

import os
import time

import pytest

from autopar.ir.errors import MemoryFitError, PlanError
from autopar.planning.search.forked import ForkedCalls, SharedMinimum, can_fork, default_workers

forking = pytest.mark.skipif(not can_fork(), reason="fork is Linux's")


def _collect(calls: ForkedCalls, n: int) -> dict:
    return dict(calls.next_done() for _ in range(n))


def _raise(error: Exception) -> None:
    raise error


@forking
def test_children_send_back_values_and_errors_by_key():
    parent = os.getpid()
    with ForkedCalls(2) as calls:
        calls.submit("pid", os.getpid)
        calls.submit("fit", lambda: _raise(MemoryFitError("no plan fits", 12345)))
        assert calls.running == 2
        done = _collect(calls, 2)
        calls.submit("bug", lambda: 1 / 0)
        calls.submit("died", lambda: os._exit(3))
        done.update(_collect(calls, 2))
    ok, pid = done["pid"]
    assert ok and pid != parent  # planned in another process
    ok, error = done["fit"]
    assert not ok and isinstance(error, MemoryFitError) and error.least_bytes == 12345
    ok, error = done["bug"]  # a bug keeps its traceback from the child
    assert isinstance(error, ZeroDivisionError) and "1 / 0" in "".join(error.__notes__)
    ok, error = done["died"]
    assert isinstance(error, PlanError) and "ended with exit code 3" in str(error)


def test_one_worker_runs_each_call_here_in_order():
    parent = os.getpid()
    with ForkedCalls(1) as calls:
        for i in range(3):
            calls.submit(i, lambda i=i: (os.getpid(), i))
            assert calls.running == 1 and calls.next_done() == (i, (True, (parent, i)))
    assert 1 <= default_workers() <= 8


@forking
def test_leaving_ends_the_children_still_running():
    with pytest.raises(KeyboardInterrupt), ForkedCalls(2) as calls:
        calls.submit("slow", lambda: time.sleep(60))
        children = [child for _, child in calls._children.values()]
        raise KeyboardInterrupt
    assert not children[0].is_alive()


def _wait_below(least: SharedMinimum, seconds: float) -> float:
    deadline = time.monotonic() + 30
    while least.seconds >= seconds and time.monotonic() < deadline:
        time.sleep(0.01)
    return least.seconds


@forking
def test_a_child_reads_the_least_offered_after_it_started():
    """The automatic mesh's best step, offered by the parent while a candidate is planned in a
    child, is the cutoff the child reads from then on; a higher offer leaves it."""
    least = SharedMinimum()
    with ForkedCalls(2) as calls:
        calls.submit("reader", lambda: _wait_below(least, 5.0))
        least.offer(3.0)
        least.offer(4.0)
        key, (ok, seen) = calls.next_done()
    assert key == "reader" and ok and seen == 3.0 and least.seconds == 3.0
