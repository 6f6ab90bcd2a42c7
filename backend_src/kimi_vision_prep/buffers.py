"""Large buffers without the page-fault tax, and without touching the caller's malloc settings.

With glibc's defaults a fresh 37 MiB ``pixel_values`` or 36 MiB decoded photo is a fresh
``mmap``: every 4 KiB page faults on first touch. Filling 39 MiB costs ~25 ms that way and ~4 ms
in memory touched before, on this project's 2-core VM (BENCHMARKS.md's history); transparent huge pages do
not help there (``MADV_HUGEPAGE`` measured the same: the VM hands out none). So large buffers are
reused, in two bounded ways:

* **Scratch** (:func:`scratch`): buffers that never leave a pipeline call (the decoded pixels on
  the libjpeg and simplejpeg routes, the resize passes) come from a per-thread arena inside a
  :func:`scratch_scope`. The i-th request of a scope gets the arena's i-th buffer, grown when too
  small, so the next image's requests land on pages already faulted in; a nested scope is a
  frame, whose buffers the next requests of the enclosing scope reuse. Outside a scope
  :func:`scratch` is :func:`empty_output`: a public op never returns arena memory (pixels that
  leave a call reuse recycled blocks instead while the recycle cap allows). A served model's
  execute is one scope (``kimi_vision_server/models/contract.py``): its outputs may be arena memory there, as the
  stub copies them into its shared memory before it executes again.
* **Outputs** (:func:`empty_output`): arrays handed to the caller are the caller's, but a large
  one's block goes back to a process-wide free list when the array and every view of it are gone,
  and the next output of a fitting size reuses it.

Caps (:func:`configure_buffers`): each thread's arena holds at most ``scratch_cap_bytes``
(default :data:`DEFAULT_SCRATCH_CAP_BYTES`), the free list at most ``recycle_cap_bytes``
(default :data:`DEFAULT_RECYCLE_CAP_BYTES`); a request beyond a cap gets a plain ``np.empty``.
:func:`buffer_stats` reports what is held.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod

import numpy as np

DEFAULT_SCRATCH_CAP_BYTES = 128 << 20  # a 12 MP photo (36 MiB) and its two resize passes
DEFAULT_RECYCLE_CAP_BYTES = 128 << 20  # three of the largest K2.5 pixel_values (37 MiB each)
RECYCLE_MIN_BYTES = 1 << 20  # smaller arrays: malloc's heap serves them without faults
_BLOCK_GRAIN = 1 << 20  # recycled blocks are whole MiB, so near sizes share blocks


@dataclass
class _Caps:
    scratch_bytes: int = DEFAULT_SCRATCH_CAP_BYTES
    recycle_bytes: int = DEFAULT_RECYCLE_CAP_BYTES


_caps = _Caps()


def configure_buffers(*, scratch_cap_bytes: int | None = None, recycle_cap_bytes: int | None = None) -> None:
    """Set the caps (bytes; 0 turns that reuse off); later requests follow them. A lowered recycle
    cap drops free blocks at once, a lowered scratch cap a thread's arena when it next opens a scope."""
    for value in (scratch_cap_bytes, recycle_cap_bytes):
        if value is not None and value < 0:
            raise ValueError(f"caps must be >= 0, got {value}")
    if scratch_cap_bytes is not None:
        _caps.scratch_bytes = scratch_cap_bytes
    if recycle_cap_bytes is not None:
        _caps.recycle_bytes = recycle_cap_bytes
        _free_list.trim()


# -- scratch: per-thread arenas -------------------------------------------------------------------


class _Arena:
    """One thread's scratch buffers (flat uint8) and the open scope's next index."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []
        self.position: int | None = None  # None outside a scope

    @property
    def held_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers)


_local = threading.local()
_arenas: weakref.WeakSet[_Arena] = weakref.WeakSet()  # for buffer_stats; a thread's arena dies with it
_arenas_lock = threading.Lock()


def _arena() -> _Arena:
    arena = getattr(_local, "arena", None)
    if arena is None:
        arena = _local.arena = _Arena()
        with _arenas_lock:
            _arenas.add(arena)
    return arena


@contextlib.contextmanager
def scratch_scope() -> Iterator[None]:
    """Within it, :func:`scratch` hands out this thread's arena buffers; they are free again when
    the outermost scope exits. A nested scope is a frame: what it hands out is free again when it
    exits (nothing of it may outlive it), what the enclosing scope handed out before it stays."""
    arena = _arena()
    if arena.position is not None:
        entry = arena.position
        try:
            yield
        finally:
            arena.position = entry
        return
    if arena.held_bytes > _caps.scratch_bytes:  # the cap was lowered: none of them is in use now
        arena.buffers.clear()
    arena.position = 0
    try:
        yield
    finally:
        arena.position = None


def scratch(shape: tuple[int, ...], dtype: type | np.dtype = np.uint8) -> np.ndarray:
    """An uninitialised C-contiguous ``(shape, dtype)`` array: inside a :func:`scratch_scope` a
    view of this thread's arena (valid until the scope exits), else :func:`empty_output`."""
    dtype = np.dtype(dtype)
    nbytes = prod(shape) * dtype.itemsize
    arena = _arena()
    index = arena.position
    if index is None:
        return empty_output(shape, dtype)
    replaced = arena.buffers[index].nbytes if index < len(arena.buffers) else 0
    if arena.held_bytes - replaced + max(nbytes, replaced) > _caps.scratch_bytes:
        return np.empty(shape, dtype)
    arena.position = index + 1
    if index == len(arena.buffers):
        arena.buffers.append(np.empty(nbytes, np.uint8))
    elif replaced < nbytes:
        arena.buffers[index] = np.empty(nbytes, np.uint8)
    return arena.buffers[index][:nbytes].view(dtype).reshape(shape)


# -- outputs: a bounded free list of large blocks -------------------------------------------------


class _FreeList:
    """Free flat uint8 blocks by size; :meth:`take` hands one out wrapped in a :class:`_Lease`."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a lease may be released by a collection inside take()
        self._sizes: list[int] = []
        self._blocks: list[np.ndarray] = []

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes)

    def take(self, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` (a free one at most twice as large, else new)."""
        with self._lock:
            i = bisect.bisect_left(self._sizes, nbytes)
            if i < len(self._sizes) and self._sizes[i] <= 2 * nbytes:
                self._sizes.pop(i)
                return self._blocks.pop(i)
        return np.empty(-(-nbytes // _BLOCK_GRAIN) * _BLOCK_GRAIN, np.uint8)

    def give_back(self, block: np.ndarray) -> None:
        with self._lock:
            i = bisect.bisect_left(self._sizes, block.nbytes)
            self._sizes.insert(i, block.nbytes)
            self._blocks.insert(i, block)
            self.trim()

    def trim(self) -> None:
        """Drop the largest free blocks until the held bytes fit the cap."""
        with self._lock:
            while self._sizes and sum(self._sizes) > _caps.recycle_bytes:
                self._sizes.pop()
                self._blocks.pop()


_free_list = _FreeList()


def _after_fork_in_child() -> None:
    """A forked child starts with an empty free list and new locks: another thread of the parent
    may have held a lock, or been between the free list's two updates, when the process forked."""
    global _arenas_lock  # noqa: PLW0603
    _arenas_lock = threading.Lock()
    _free_list.__init__()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Lease:
    """A free-list block lent to one output array (its ``base``): back on the list when the array
    and its views are gone. numpy keeps the ``__array_interface__`` provider as the base."""

    def __init__(self, block: np.ndarray) -> None:
        self._block = block
        self.__array_interface__ = block.__array_interface__

    def __del__(self) -> None:
        _free_list.give_back(self._block)


def empty_output(shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """A new uninitialised C-contiguous array for a caller; a large one reuses a free block."""
    dtype = np.dtype(dtype)
    nbytes = prod(shape) * dtype.itemsize
    if nbytes < RECYCLE_MIN_BYTES or _caps.recycle_bytes == 0:
        return np.empty(shape, dtype)
    flat = np.asarray(_Lease(_free_list.take(nbytes)))
    return flat[:nbytes].view(dtype).reshape(shape)


def buffer_stats() -> dict[str, int]:
    """Bytes held for reuse: ``scratch_bytes`` over ``scratch_threads`` arenas (cap each:
    ``scratch_cap_bytes``), ``recycled_bytes`` free output blocks (cap: ``recycle_cap_bytes``)."""
    with _arenas_lock:
        arenas = list(_arenas)
    return {
        "scratch_threads": len(arenas),
        "scratch_bytes": sum(a.held_bytes for a in arenas),
        "scratch_cap_bytes": _caps.scratch_bytes,
        "recycled_bytes": _free_list.held_bytes,
        "recycle_cap_bytes": _caps.recycle_bytes,
    }
