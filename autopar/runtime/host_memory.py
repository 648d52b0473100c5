"""Host memory kept between steps on CPU meshes, as CUDA's caching allocator keeps device memory.

A training step allocates its activations afresh and frees them by the end of the step. glibc's
malloc serves blocks of 128 KiB and up (a threshold that rises with the blocks freed) from fresh
``mmap`` regions and hands the top of its heap back to the system once more than twice that is
free, so the next step touches new pages, each a page fault the kernel must zero first: a step
whose activations are large (Megatron tensor parallelism, whose activations are whole on every
rank) runs measurably slower (the figures: docs/memory.md). The cost model prices no page faults
(calibration writes into buffers it allocated once), so keeping freed memory is also what makes
its predictions hold on a CPU mesh.

:func:`keep_freed_host_memory` tells glibc's malloc (``mallopt``) to serve blocks up to 1 GiB
from its heap and to keep up to 2 GiB of freed heap: a process's memory then stays at its peak,
as a GPU's does under the caching allocator. It leaves the allocator alone where the user chose:
``AUTOPAR_KEEP_HOST_MEMORY=0``, glibc malloc settings in the environment (``MALLOC_*_`` or
``GLIBC_TUNABLES``), another allocator preloaded, or a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@functools.cache
def keep_freed_host_memory() -> str:
    """Tell glibc's malloc to keep freed memory in this process (once per process); returns
    ``"kept"`` or why it left the allocator alone (see the module docstring)."""
    if os.environ.get("AUTOPAR_KEEP_HOST_MEMORY", "1") == "0":
        return "AUTOPAR_KEEP_HOST_MEMORY=0"
    chosen = [name for name in _USER_SETTINGS if name in os.environ]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"the user's malloc settings ({', '.join(chosen)})"
    preload = os.environ.get("LD_PRELOAD", "")
    other = [name for name in _OTHER_ALLOCATORS if name in preload]
    if other:
        return f"{other[0]} preloaded"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    libc = ctypes.CDLL("libc.so.6")
    for parameter, value in ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        if not libc.mallopt(parameter, value):
            return "mallopt refused"
    return "kept"
