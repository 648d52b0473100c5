"""On a CPU mesh the compiled module keeps freed host memory: a step's activations do not page-fault
back in every step, and the user's own allocator settings are left alone."""

from __future__ import annotations

import platform
import resource

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime.host_memory import keep_freed_host_memory
from examples import gpt

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)


def _faults_churning(megabytes: int, rounds: int) -> int:
    """Minor page faults while a tensor of ``megabytes`` is allocated, filled and freed ``rounds`` times."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        torch.ones(megabytes << 18)  # 4-byte elements
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_a_cpu_mesh_keeps_freed_memory_so_steps_do_not_page_fault(fake_process_group):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model, args = gpt.build(batch_size=4)
    dmodel = autopar.compile(model, mesh, args, cluster="fast-links")
    assert dmodel.host_memory == "kept"
    _faults_churning(64, 5)  # the heap grows to hold it
    # where freed memory goes back to the system, every round of 64 MiB faults its 16,384 pages;
    # kept, all but a few rounds fault none (0 to 4 of 20 measured in a test process)
    assert _faults_churning(64, 20) < 10 * 16384


@pytest.mark.parametrize(
    "env, why",
    [
        ({"AUTOPAR_KEEP_HOST_MEMORY": "0"}, "AUTOPAR_KEEP_HOST_MEMORY=0"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "the user's malloc settings (MALLOC_TRIM_THRESHOLD_)"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "the user's malloc settings (GLIBC_TUNABLES)"),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "jemalloc preloaded"),
    ],
)
def test_the_users_allocator_choices_are_left_alone(monkeypatch: pytest.MonkeyPatch, env, why):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert keep_freed_host_memory.__wrapped__() == why
