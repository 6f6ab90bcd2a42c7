"""glibc malloc settings for processes that preprocess images all day (one source of truth).

By default glibc serves allocations above a threshold (dynamic, at most 32 MiB) with a fresh
``mmap`` and unmaps them on free, and it trims freed memory at the top of the heap back to the
kernel. A 16384-patch ``pixel_values`` is 37 MiB and a decoded 12 MP photo 36 MiB, so every such
request page-faults its buffers in anew: on a 2-core VM that alone swung the
patchify of one image between 4 and 63 ms (BENCHMARKS.md). With the thresholds below, buffers up
to 256 MiB come from the heap and are reused, and up to 512 MiB of free heap top is kept.

The cost: a process keeps its peak heap (about one batch of its largest requests) instead of
returning it between requests. These are process-wide settings, so the library never applies
them on import, and the launcher no longer passes them (under load they cost ~250-930 MiB of
PSS; the gain ranged from none to +20% in requests/s, and +35-50% in float32 perf_analyzer
throughput in one A/B: BENCHMARKS.md, "night"; jemalloc preloaded into tritonserver alone gave
the float32 wire nothing and cost the uint8 wires: "late"). An
operator may put :func:`allocator_env` into tritonserver's environment (and so the stubs';
``benchmarks/bench_load_memory.py`` measures that as its "retention" row), and a process
dedicated to preprocessing may call :func:`keep_large_buffers` once at startup (``kimi-prep
bench-local --keep-large-buffers``). In process the library does not need them:
:mod:`.buffers` reuses its large buffers itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

MMAP_THRESHOLD_BYTES = 256 << 20
TRIM_THRESHOLD_BYTES = 512 << 20
# mallopt parameter numbers (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def allocator_env() -> dict[str, str]:
    """The settings as glibc environment variables, for a child process (e.g. tritonserver)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}


@functools.cache  # process-wide and idempotent: applied once
def keep_large_buffers() -> bool:
    """Apply the settings to this process with ``mallopt``; False where the C library is not glibc."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    mallopt = getattr(ctypes.CDLL(libc_name), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
