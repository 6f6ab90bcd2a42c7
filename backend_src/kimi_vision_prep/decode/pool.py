"""A bounded, thread-safe pool of nvImageCodec decoders.

One nvImageCodec ``Decoder`` shared by two threads crashes the process or returns wrong pixels
(measured on the corpus), so every concurrent caller borrows its own. The pool holds at most
``cap`` decoders per process and device (each one owns scratch buffers and, on a GPU, device
memory), creates them lazily under a lock, reuses the most recently returned one first (LIFO keeps
the warm one hot), and drops a decoder whose call raised, since its internal state is unknown.
A caller that finds all ``cap`` decoders busy waits up to ``timeout_s`` and then gets
:class:`DecoderBusyError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from kimi_vision_common.errors import DecoderBusyError

T = TypeVar("T")


class DecodePool(Generic[T]):
    """At most ``cap`` objects made by ``factory``, lent one caller at a time."""

    def __init__(self, factory: Callable[[], T], cap: int = 2, timeout_s: float = 30.0, name: str = "decoder") -> None:
        if cap < 1:
            raise ValueError(f"decoder pool cap must be >= 1, got {cap}")
        self._factory = factory
        self.cap = cap
        self.timeout_s = timeout_s
        self.name = name
        self._idle: list[T] = []  # LIFO stack
        self._created = 0
        self._discarded = 0
        self._cond = threading.Condition()

    @property
    def created(self) -> int:
        """Decoders alive now (idle or lent)."""
        return self._created

    @property
    def discarded(self) -> int:
        return self._discarded

    @property
    def idle(self) -> int:
        return len(self._idle)

    def _take(self) -> T | None:
        """Pop an idle decoder, or reserve a slot for a new one (returns None). Lock held."""
        if self._idle:
            return self._idle.pop()
        self._created += 1
        return None

    @contextmanager
    def borrow(self) -> Iterator[T]:
        """Lend a decoder for the ``with`` block; discard it if the block raises."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._idle or self._created < self.cap, timeout=self.timeout_s)
            if not ok:
                raise DecoderBusyError(
                    f"all {self.cap} {self.name}s busy for {self.timeout_s:g} s; raise the pool cap or add instances"
                )
            item = self._take()
        if item is None:
            try:
                item = self._factory()
            except BaseException:
                with self._cond:
                    self._created -= 1
                    self._cond.notify()
                raise
        try:
            yield item
        except BaseException:
            with self._cond:
                self._created -= 1
                self._discarded += 1
                self._cond.notify()
            raise
        with self._cond:
            self._idle.append(item)
            self._cond.notify()
