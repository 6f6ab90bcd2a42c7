"""One :class:`~.client.KimiVisionClient` per thread (a client is not thread safe), let go safely.

- A thread's client is made on its first use (:meth:`ThreadClients.use`) and kept for its next
  calls. When the thread ends, its client is closed (its shared-memory regions unregistered) in a
  thread of its own, at the next use of the pool by any thread or at :meth:`ThreadClients.close`:
  never on a caller's time.
- :meth:`ThreadClients.close` closes the clients no thread is using now; one in use is closed by
  its thread when its call is done, never under it (its regions may be being read).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .client import CLOSE_DEADLINE_S, KimiVisionClient
from .deadline import Deadline


@dataclass
class _Held:
    """A thread's client: whether a call is using it, whether it is to be closed after that call."""

    client: KimiVisionClient
    busy: bool = False
    closing: bool = False


class ThreadClients:
    """The clients of the threads that use one processor; ``make(deadline)`` makes a client within
    ``deadline``. Attributes: :attr:`output_bytes_received`, every client's, the closed ones' too."""

    def __init__(self, make: Callable[[Deadline], KimiVisionClient]) -> None:
        self._make = make
        self._local = threading.local()
        self._lock = threading.Lock()
        self._held: list[_Held] = []  # every live thread's
        self._ended: list[_Held] = []  # those of threads that ended, to close
        self._closed_bytes = 0

    @contextlib.contextmanager
    def use(self, deadline: Deadline) -> Iterator[KimiVisionClient]:
        """This thread's client, made within ``deadline`` on first use, for one call."""
        self._close_ended()
        held = getattr(self._local, "held", None)
        if held is None or held.closing:
            held = _Held(self._make(deadline))
            with self._lock:
                self._held.append(held)
            weakref.finalize(self._local_holder(held), self._thread_ended, held)
        held.busy = True
        try:
            yield held.client
        finally:
            with self._lock:
                held.busy = False
                closing = held.closing
            if closing:
                self._close_now([held])

    def _local_holder(self, held: _Held) -> object:
        """A token kept in this thread's locals: dropped (and finalized) as the thread ends."""
        token = _Token(held)
        self._local.held, self._local.token = held, token
        return token

    def _thread_ended(self, held: _Held) -> None:
        """``held``'s thread ended (called as it ends: nothing slow here)."""
        with self._lock:
            if held in self._held:
                self._held.remove(held)
                self._ended.append(held)

    def _close_ended(self) -> None:
        """Close the clients of threads that ended, in a thread of its own."""
        with self._lock:
            ended, self._ended = self._ended, []
        if ended:
            closer = threading.Thread(target=self._close_now, args=(ended,), name="kimi-vision-client", daemon=True)
            closer.start()

    def _close_now(self, held: list[_Held]) -> None:
        for each in held:
            with contextlib.suppress(Exception):  # a server that is gone takes its registrations with it
                each.client.close(Deadline.after(CLOSE_DEADLINE_S))
            with self._lock:
                self._closed_bytes += each.client.output_bytes_received
                if each in self._held:
                    self._held.remove(each)

    @property
    def clients(self) -> list[KimiVisionClient]:
        """The clients of the threads that use the pool now (for inspection)."""
        with self._lock:
            return [held.client for held in self._held]

    @property
    def output_bytes_received(self) -> int:
        with self._lock:
            return self._closed_bytes + sum(held.client.output_bytes_received for held in self._held)

    def close(self, deadline: Deadline) -> None:
        """Close every client no call is using now, within ``deadline``; the others when their calls
        are done."""
        with self._lock:
            idle = [held for held in [*self._held, *self._ended] if not held.busy]
            for held in self._held:
                held.closing = held.busy
            self._held = [held for held in self._held if held.busy]
            self._ended = []
        for held in idle:
            with contextlib.suppress(Exception):  # a server that is gone takes its registrations with it
                held.client.close(deadline)
            with self._lock:
                self._closed_bytes += held.client.output_bytes_received


@dataclass
class _Token:
    """What a thread's locals hold so that the thread's end is seen (its finalizer runs)."""

    held: _Held
