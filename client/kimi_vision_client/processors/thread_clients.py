"""One :class:`~kimi_vision_client.client.KimiVisionClient` per thread (a client is not thread
safe), let go safely.

- A thread's client is made on its first use (:meth:`ThreadClients.use`) and kept for its next
  calls. When the thread ends, its client is closed (its shared-memory regions unregistered) in a
  thread of its own, started at the next use of the pool by any thread or at
  :meth:`ThreadClients.close`: never on a caller's time.
- :meth:`ThreadClients.close` closes the clients no call is using now, and retires the others: each
  is closed, in a thread of its own, once its call is done (never under a call: its regions may be
  being read). A thread's next call after :meth:`ThreadClients.close` gets a new client.

Whether a client is in use and whether it is retired change together, under one lock: a call
takes its client (:meth:`ThreadClients.use`) and :meth:`ThreadClients.close` chooses what to close
in one step each.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..client import CLOSE_DEADLINE_S, KimiVisionClient
from ..transport.deadline import Deadline


@dataclass(eq=False)
class _Held:
    """A thread's client: whether a call is using it, whether it is retired (closed once idle)."""

    client: KimiVisionClient
    busy: bool = False
    retired: bool = False


class ThreadClients:
    """The clients of the threads that use one processor; ``make(deadline)`` makes a client within
    ``deadline``. Attributes: :attr:`output_bytes_received`, every client's, the closed ones' too."""

    def __init__(self, make: Callable[[Deadline], KimiVisionClient]) -> None:
        self._make = make
        self._local = threading.local()
        self._lock = threading.Lock()
        self._held: list[_Held] = []  # every client not closed yet: live threads', retired, ended
        self._closed_bytes = 0

    @contextlib.contextmanager
    def use(self, deadline: Deadline) -> Iterator[KimiVisionClient]:
        """This thread's client, made within ``deadline`` where it has none (or its last was
        retired), for one call."""
        self._close_in_background(self._take_idle_retired())
        held = self._take_own()
        if held is None:
            held = _Held(self._make(deadline), busy=True)
            with self._lock:
                self._held.append(held)
            self._local.held, self._local.token = held, _Token(held)
            weakref.finalize(self._local.token, self._thread_ended, held)
        try:
            yield held.client
        finally:
            with self._lock:
                held.busy = False
            self._close_in_background(self._take_idle_retired())

    def _take_own(self) -> _Held | None:
        """This thread's client, marked busy, where it has one that is not retired."""
        held = getattr(self._local, "held", None)
        with self._lock:
            if held is None or held.retired:
                return None
            held.busy = True
            return held

    def _thread_ended(self, held: _Held) -> None:
        """``held``'s thread ended (called as it ends: nothing slow here): its client is retired."""
        with self._lock:
            held.retired = True

    def _take_idle_retired(self) -> list[_Held]:
        """The retired clients no call is using, out of the pool (to be closed)."""
        with self._lock:
            idle = [held for held in self._held if held.retired and not held.busy]
            self._held = [held for held in self._held if held not in idle]
            self._closed_bytes += sum(held.client.output_bytes_received for held in idle)  # none arrive after
        return idle

    def _close_in_background(self, held: list[_Held]) -> None:
        if held:
            closer = threading.Thread(target=self._close, args=(held, None), name="kimi-vision-client", daemon=True)
            closer.start()

    def _close(self, held: list[_Held], deadline: Deadline | None) -> None:
        """Close ``held``'s clients, within ``deadline`` (None: :data:`CLOSE_DEADLINE_S` each)."""
        for each in held:
            with contextlib.suppress(Exception):  # a server that is gone takes its registrations with it
                each.client.close(deadline or Deadline.after(CLOSE_DEADLINE_S))

    @property
    def clients(self) -> list[KimiVisionClient]:
        """The clients not closed yet (for inspection)."""
        with self._lock:
            return [held.client for held in self._held]

    @property
    def output_bytes_received(self) -> int:
        with self._lock:
            return self._closed_bytes + sum(held.client.output_bytes_received for held in self._held)

    def close(self, deadline: Deadline) -> None:
        """Retire every client: those no call is using are closed now, within ``deadline``; the
        others once their calls are done."""
        with self._lock:
            for held in self._held:
                held.retired = True
        self._close(self._take_idle_retired(), deadline)


@dataclass(eq=False)
class _Token:
    """What a thread's locals hold so that the thread's end is seen (its finalizer runs)."""

    held: _Held
