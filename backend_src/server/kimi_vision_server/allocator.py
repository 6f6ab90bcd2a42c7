"""malloc settings for processes that preprocess images all day (one source of truth).

**tritonserver's allocator** (:func:`server_allocator_env`). Each float32 answer of a 12 MP photo
(37 MiB) passes through buffers tritonserver allocates per request: the ensemble's copy of a
step's output, then the response. Above glibc's largest mmap threshold (32 MiB) each is a fresh
``mmap`` whose pages fault in anew, so the float32 ensembles spent ~20 ms a request there. Triton's
docs suggest preloading jemalloc or tcmalloc; with jemalloc (``oversize_threshold:0``, below)
tritonserver reuses those pages. Measured on this 2-core host (BENCHMARKS.md at a3ec8cb):
- compute_output of ``kimi_k25_vision`` + shm fell from 32-44 to 18-31 ms a request;
- its perf_analyzer throughput rose 20% (the median over four A/B runs);
- the uint8 wires lost 4%;
- the peak PSS under load stayed where glibc's was.

The stubs keep glibc's malloc (their uint8 wire measured slower with jemalloc in every process).
The embedded Python backend starts them through a wrapper that removes what
:data:`SERVER_ONLY_ENV` lists (``kimi_vision_server/triton_install.py``). ``LD_PRELOAD=`` (empty) keeps
glibc's malloc in tritonserver too.

**glibc's retention** (:func:`allocator_env`, :func:`keep_large_buffers`). By default glibc
serves allocations above a threshold (dynamic, at most 32 MiB) with a fresh ``mmap`` and unmaps
them on free, and it trims freed memory at the top of the heap back to the
kernel. A 16384-patch ``pixel_values`` is 37 MiB and a decoded 12 MP photo 36 MiB, so every such
request page-faults its buffers in anew: on a 2-core VM that alone swung the
patchify of one image between 4 and 63 ms (BENCHMARKS.md's history). With the thresholds below, buffers up
to 256 MiB come from the heap and are reused, and up to 512 MiB of free heap top is kept.

The cost: a process keeps its peak heap (about one batch of its largest requests) instead of
returning it between requests. These are process-wide settings, so the library never applies
them on import, and the launcher no longer passes them (under load they cost ~250-930 MiB of
PSS; the gain ranged from none to +20% in requests/s, and +35-50% in float32 perf_analyzer
throughput in one A/B: BENCHMARKS.md at 8883d91). An
operator may put :func:`allocator_env` into the launcher's environment: the stubs get it, and
tritonserver too where it runs with glibc's malloc (``benchmarks/bench_load_memory.py`` measures
that as its "retention" row), and a process
dedicated to preprocessing may call :func:`keep_large_buffers` once at startup (``kimi-prep
bench-local --keep-large-buffers``). In process the library does not need them:
:mod:`.buffers` reuses its large buffers itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Mapping

MMAP_THRESHOLD_BYTES = 256 << 20
TRIM_THRESHOLD_BYTES = 512 << 20
# mallopt parameter numbers (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


# jemalloc 5 serves allocations above its oversize_threshold (8 MiB) from an arena it purges at
# once, so a 37 MiB buffer would fault in anew each time; at 0 they come from the ordinary arenas,
# whose freed pages go back to the kernel after 10 s (dirty_decay_ms), by a background thread also
# while the server idles.
JEMALLOC = "jemalloc"
JEMALLOC_CONF = "oversize_threshold:0,background_thread:true"
# Names, space-separated, of tritonserver's environment entries its Python stubs do not inherit.
SERVER_ONLY_ENV = "KIMI_PREP_SERVER_ONLY_ENV"


def server_allocator_env(environ: Mapping[str, str]) -> dict[str, str]:
    """tritonserver's malloc: jemalloc (``LD_PRELOAD`` of ``libjemalloc.so.2``, :data:`JEMALLOC_CONF`)
    where the dynamic linker finds it; {} where it does not, or where ``environ`` (the operator's)
    sets ``LD_PRELOAD`` or ``MALLOC_CONF`` itself: ``LD_PRELOAD=`` (empty) keeps glibc's."""
    if "LD_PRELOAD" in environ or "MALLOC_CONF" in environ:
        return {}
    library = ctypes.util.find_library(JEMALLOC)
    if library is None or not library.startswith("libjemalloc.so.2"):  # 5.x: oversize_threshold
        return {}
    return {"LD_PRELOAD": library, "MALLOC_CONF": JEMALLOC_CONF}


def describe_server_allocator(env: Mapping[str, str]) -> str:
    """One line for the start log: which malloc tritonserver (started with ``env``) and its stubs run with."""
    if SERVER_ONLY_ENV not in env:
        return "malloc: what the environment sets (a tritonserver of its own: its stubs inherit it)"
    if "LD_PRELOAD" in env[SERVER_ONLY_ENV].split():
        preload, conf = env["LD_PRELOAD"], env["MALLOC_CONF"]
        return f"malloc: jemalloc in tritonserver ({preload}, MALLOC_CONF={conf}), glibc's in the stubs"
    if "LD_PRELOAD" in env or "MALLOC_CONF" in env:
        return "malloc: the operator's LD_PRELOAD / MALLOC_CONF, in tritonserver and the stubs"
    return "malloc: glibc's (no libjemalloc.so.2 found: Debian's libjemalloc2 gives tritonserver jemalloc)"


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
