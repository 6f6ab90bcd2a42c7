"""Process-wide numba settings shared by every CPU kernel of the package.

numba's workqueue threading layer (the portable default) must not be entered by two threads at
once; :data:`numba_lock` keeps concurrent callers (Triton instances run in separate processes, but
library users may use threads) safe without requiring TBB. Every call of a ``parallel=True``
kernel goes through :func:`parallel_kernel`, which holds it while the active layer is workqueue.
A process that picks a thread-safe layer itself (``NUMBA_THREADING_LAYER=omp``
or ``tbb``: the library never changes it, it is process-wide) runs kernels of several threads at
once: ``preprocess_batch`` on 2 cores measured 1.6-2.0x single-thread with omp against 1.2-1.5x
with workqueue (BENCHMARKS.md's history).

numba compiles one specialisation per argument layout and writability, so every kernel input
passes through :func:`kernel_input`: whatever a caller hands in (a writable array, Pillow's
read-only view, a Triton input tensor), the kernels see one signature, warmed up once.

numba's threading layer is started when this module is imported (:func:`start_kernel_threads`;
its OpenMP threads start with the first kernel), their idle workers spinning briefly before they
sleep. A child forked after that runs kernels too (:func:`_after_fork_in_child`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

numba_lock = threading.Lock()

# Below this many output elements a kernel runs on the calling thread only: waking the worker
# threads costs tens of microseconds on an idle machine and milliseconds on a busy one, more than
# such a job takes serially.
SERIAL_WORK_LIMIT = 1 << 18


def set_num_threads(n: int) -> None:
    """numba threads of the calling thread's CPU kernels (clamped to ``1..NUMBA_NUM_THREADS``; 1
    on the thread that forked this process from one using GNU OpenMP, :func:`_after_fork_in_child`)."""
    single = threading.get_ident() == _forked_from_openmp.thread
    numba.set_num_threads(1 if single else max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


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

# GNU libgomp's idle workers (numba's omp layer on Linux) spin 300,000 times after each parallel
# region before they sleep: milliseconds, in which they hold cores that the decoder's band
# threads, not OpenMP threads, need right after. On the 2-core host a 10 MP JPEG decoded just
# after a resize kernel took 18.5 ms against 13.2 ms, and 25 photos one a call 0.48 s against
# 0.43 s with 10,000 spins, as fast as no spinning at all. A short spin rather than none keeps
# torch's CPU ops as fast as before where torch shares this libgomp (imported after this module,
# torch binds the loaded library by its soname): a 256x256 matmul took 200 us either way, 310 us
# with no spin.
IDLE_SPIN_SETTING = ("GOMP_SPINCOUNT", "10000")
# Settings by which a process chose libgomp's idle behaviour itself (read when it loads).
USER_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def start_kernel_threads() -> None:
    """Start numba's threading layer (idempotent) with :data:`IDLE_SPIN_SETTING` in the
    environment while it loads, unless the process set one of :data:`USER_WAIT_SETTINGS`. The
    variable is removed again at once. A libgomp loaded before keeps its own setting (numba's
    threads started by other code, or torch imported first: numba then loads the system's copy
    beside torch's), and a library loading one later sees the environment as it was; a library
    that binds the loaded one (torch imported after this module) shares its setting."""
    try:
        numba.threading_layer()
        return  # already started
    except ValueError:
        pass
    if any(name in os.environ for name in USER_WAIT_SETTINGS):
        numba.get_num_threads()  # starts the layer
        return
    name, value = IDLE_SPIN_SETTING
    os.environ[name] = value
    try:
        numba.get_num_threads()
    finally:
        del os.environ[name]


start_kernel_threads()


@dataclass
class _ForkedFromOpenMP:
    """In a child forked (``os.fork``) after numba's omp layer started in the parent: the thread
    that called fork. None elsewhere."""

    thread: int | None = None


_forked_from_openmp = _ForkedFromOpenMP()


def _after_fork_in_child() -> None:
    """A forked child (a data loader's workers, a server that preloads then forks) inherits the omp
    layer the import started, but not its threads. numba's GNU OpenMP layer then kills the child
    at its first parallel kernel ("fork() called from a process already using GNU OpenMP"): its
    guard compares the parent's pid with the pid recorded when the layer started. Recording the
    child's (numba's own ``launch_threads`` again) lets kernels run: threads the child starts have
    fresh libgomp pools; the thread that forked keeps its parent's pool, whose threads do not
    exist here, so its kernels run on it alone (a team of one uses no pool). :data:`numba_lock` is
    made anew: a thread of the parent may have held it at the fork."""
    global numba_lock  # noqa: PLW0603
    numba_lock = threading.Lock()
    try:
        layer = numba.threading_layer()
    except ValueError:
        return
    if layer != "omp":
        return
    from numba.np.ufunc import omppool

    if omppool.openmp_vendor != "GNU":
        return
    ctypes.CFUNCTYPE(None, ctypes.c_int)(omppool.launch_threads)(numba.config.NUMBA_NUM_THREADS)
    _forked_from_openmp.thread = threading.get_ident()
    numba.set_num_threads(1)


os.register_at_fork(after_in_child=_after_fork_in_child)


def kernel_lock() -> contextlib.AbstractContextManager[Any]:
    """:data:`numba_lock`, or nothing where the threading layer (started at import,
    :func:`start_kernel_threads`) is thread-safe."""
    return contextlib.nullcontext() if numba.threading_layer() in THREAD_SAFE_LAYERS else numba_lock


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


@numba.njit(cache=True, nogil=True, inline="always")
def load_word(row: np.ndarray, i: int) -> np.uint64:
    """uint64 of bytes ``row[i : i + 8]`` of a uint8 array, little-endian (the compiler emits one
    unaligned load)."""
    word = np.uint64(0)
    for k in range(8):
        word |= np.uint64(row[i + k]) << np.uint64(8 * k)
    return word
