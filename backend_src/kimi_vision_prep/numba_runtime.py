"""Process-wide numba settings shared by every CPU kernel of the package.

numba's workqueue threading layer (the portable default) must not be entered by two threads at
once; :data:`numba_lock` keeps concurrent callers (Triton instances run in separate processes, but
library users may use threads) safe without requiring TBB. Every call of a ``parallel=True``
kernel goes through :func:`parallel_kernel`, which holds it while the active layer is workqueue
(or not chosen yet). A process that picks a thread-safe layer itself (``NUMBA_THREADING_LAYER=omp``
or ``tbb``: the library never changes it, it is process-wide) runs kernels of several threads at
once: ``preprocess_batch`` on 2 cores measured 1.6-2.0x single-thread with omp against 1.2-1.5x
with workqueue (BENCHMARKS.md's history).

numba compiles one specialisation per argument layout and writability, so every kernel input
passes through :func:`kernel_input`: whatever a caller hands in (a writable array, Pillow's
read-only view, a Triton input tensor), the kernels see one signature, warmed up once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numba
import numpy as np

numba_lock = threading.Lock()

# Below this many output elements a kernel runs on the calling thread only: waking the worker
# threads costs tens of microseconds on an idle machine and milliseconds on a busy one, more than
# such a job takes serially.
SERIAL_WORK_LIMIT = 1 << 18


def set_num_threads(n: int) -> None:
    """numba threads used by the CPU kernels of this process (clamped to ``1..NUMBA_NUM_THREADS``)."""
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


@contextlib.contextmanager
def kernel_threads(n: int) -> Iterator[None]:
    """The calling thread's kernels on ``n`` numba threads (clamped as in :func:`set_num_threads`)
    for the block, its own setting restored after."""
    threads = numba.get_num_threads()
    set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(threads)


def kernel_input(array: np.ndarray) -> np.ndarray:
    """``array`` as a C-contiguous, read-only view (a copy only when it is not contiguous)."""
    view = np.ascontiguousarray(array).view()
    view.setflags(write=False)
    return view


THREAD_SAFE_LAYERS = frozenset({"omp", "tbb"})


def kernel_lock() -> contextlib.AbstractContextManager[Any]:
    """:data:`numba_lock`, or nothing once the active threading layer is thread-safe (numba
    picks the layer at the first parallel launch; until then the lock is taken)."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        return numba_lock
    return contextlib.nullcontext() if layer in THREAD_SAFE_LAYERS else numba_lock


@contextlib.contextmanager
def parallel_kernel(work: int) -> Iterator[None]:
    """Run a ``parallel=True`` kernel call producing ``work`` elements under :func:`kernel_lock`;
    small jobs run single-threaded (``numba.set_num_threads`` is per calling thread)."""
    with kernel_lock():
        if work >= SERIAL_WORK_LIMIT:
            yield
            return
        threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            yield
        finally:
            numba.set_num_threads(threads)
