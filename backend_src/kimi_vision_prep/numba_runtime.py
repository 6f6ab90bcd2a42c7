"""Process-wide numba settings shared by every CPU kernel of the package.

numba's workqueue threading layer (the portable default) must not be entered by two threads at
once; :data:`numba_lock` keeps concurrent callers (Triton instances run in separate processes, but
library users may use threads) safe without requiring TBB. Every call of a ``parallel=True``
kernel holds it, directly or through :func:`parallel_kernel`.

numba compiles one specialisation per argument layout and writability, so every kernel input
passes through :func:`kernel_input`: whatever a caller hands in (a writable array, Pillow's
read-only view, a Triton input tensor), the kernels see one signature, warmed up once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

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


def kernel_input(array: np.ndarray) -> np.ndarray:
    """``array`` as a C-contiguous, read-only view (a copy only when it is not contiguous)."""
    view = np.ascontiguousarray(array).view()
    view.setflags(write=False)
    return view


@contextlib.contextmanager
def parallel_kernel(work: int) -> Iterator[None]:
    """Hold :data:`numba_lock` around a ``parallel=True`` kernel call producing ``work`` elements;
    small jobs run single-threaded (``numba.set_num_threads`` is per calling thread)."""
    with numba_lock:
        if work >= SERIAL_WORK_LIMIT:
            yield
            return
        threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            yield
        finally:
            numba.set_num_threads(threads)
