"""kimi_vision_client.processors.thread_clients without a server: a thread's client is kept for its calls,
never closed under a call, closed once its thread ends, and replaced after close(). The clients are
stand-ins that record being closed (what closing them does is tests/test_remote_*.py's)."""

from __future__ import annotations

import threading
import time

import pytest

from kimi_vision_client.processors.thread_clients import ThreadClients
from kimi_vision_client.transport.deadline import Deadline

FAILSAFE_S = 60.0


class Client:
    """A stand-in for a KimiVisionClient: its bytes, and whether (and how often) it was closed."""

    def __init__(self) -> None:
        self.output_bytes_received = 0
        self.closed = 0

    def close(self, deadline: Deadline) -> None:
        self.closed += 1


def pool() -> tuple[ThreadClients, list[Client]]:
    made: list[Client] = []

    def make(deadline: Deadline) -> Client:
        made.append(Client())
        return made[-1]

    return ThreadClients(make), made  # type: ignore[arg-type]


def until(condition: object, what: str) -> None:
    """Wait for ``condition()`` (a closer thread's work), failing after the failsafe."""
    give_up = time.monotonic() + FAILSAFE_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < give_up, what
        time.sleep(0.01)


def test_a_thread_keeps_its_client_and_gets_a_new_one_after_close() -> None:
    clients, made = pool()
    with clients.use(Deadline.after(5)) as first:
        first.output_bytes_received = 10
    with clients.use(Deadline.after(5)) as again:
        assert again is first
    clients.close(Deadline.after(5))
    assert first.closed == 1
    with clients.use(Deadline.after(5)) as after:
        assert after is not first and after.closed == 0
        after.output_bytes_received = 5
    assert len(made) == 2 and clients.output_bytes_received == 15


def test_close_leaves_a_client_in_use_to_its_call_and_closes_it_after() -> None:
    clients, made = pool()
    inside, leave = threading.Event(), threading.Event()

    def call() -> None:
        with clients.use(Deadline.after(5)):
            inside.set()
            leave.wait(FAILSAFE_S)

    caller = threading.Thread(target=call)
    caller.start()
    assert inside.wait(FAILSAFE_S)
    clients.close(Deadline.after(5))
    assert made[0].closed == 0  # in use: never closed under its call
    leave.set()
    caller.join(FAILSAFE_S)
    until(lambda: made[0].closed == 1, "the client was not closed once its call was done")
    assert clients.clients == []


@pytest.mark.parametrize("calls_after", [True, False], ids=["next-use", "close"])
def test_a_client_is_closed_once_its_thread_ends(calls_after: bool) -> None:
    """At the pool's next use by another thread (in a thread of its own), or at close()."""
    clients, made = pool()

    def call() -> None:
        with clients.use(Deadline.after(5)) as client:
            client.output_bytes_received = 7

    worker = threading.Thread(target=call)
    worker.start()
    worker.join(FAILSAFE_S)
    if calls_after:
        with clients.use(Deadline.after(5)):
            pass
        until(lambda: made[0].closed == 1, "the ended thread's client was not closed")
    else:
        clients.close(Deadline.after(5))
        assert made[0].closed == 1
    assert clients.output_bytes_received == 7 and made[0].closed == 1
