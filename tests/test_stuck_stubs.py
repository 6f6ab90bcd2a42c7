"""The stub watchdog's judgement of stubs that stop running, one scripted scan at a time
(tests/scripted_triton.py): stopped or deadlocked stubs are ended and replaced, waiting ones are
left to run again unless the Python backend failed a request of their model meanwhile
(kimi_vision_server.watch.stub_activity).

tests/test_faults.py stops and freezes stubs of a real tritonserver.
"""

from __future__ import annotations

import inspect
import re
import time
from pathlib import Path

import pytest
from scripted_triton import MODEL, STUCK_AFTER_S, ScriptedServer, counts, scripted_pair, stuck
from test_stub_activity import STOPPED_OR_DEADLOCKED, WAITING

from kimi_vision_server.watch.triton_repository import RepositoryError
from kimi_vision_server.watch.watchdog import StubWatchdog


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> tuple[ScriptedServer, StubWatchdog]:
    return scripted_pair(monkeypatch)


def test_a_stub_that_stops_running_is_ended_and_its_model_reloaded(scripted) -> None:
    """Stopped (SIGSTOP: its threads in state T): they are not put on a CPU again. After
    ``stuck_after_s`` it is ended and its model reloaded as for a dead stub; its exit is no second
    death, and the other stub is left alone."""
    server, guard = scripted
    stopped, running = sorted(server.stubs)
    for pid in (stopped, running):
        server.run(pid)
    guard.poll_once()
    server.hold(stopped, "TTT")
    server.run(running)
    guard.poll_once()
    assert not server.stubs[stopped].zombie and stuck(guard) == 0  # not yet stuck_after_s
    time.sleep(STUCK_AFTER_S)
    server.run(running)
    guard.poll_once()
    assert server.stubs[stopped].zombie, "the stuck stub was ended"
    assert stuck(guard) == 1 and server.loads == [MODEL]
    assert counts(guard) == {"stub_deaths": 0, "recoveries": 1}
    assert not server.stubs[running].zombie
    guard.poll_once()
    assert counts(guard) == {"stub_deaths": 0, "recoveries": 1} and stuck(guard) == 1


@pytest.mark.parametrize("states", STOPPED_OR_DEADLOCKED.values(), ids=list(STOPPED_OR_DEADLOCKED))
def test_a_stub_stopped_or_deadlocked_for_stuck_after_s_is_ended(scripted, states: str) -> None:
    server, guard = scripted
    held, _ = sorted(server.stubs)
    server.run(held)
    guard.poll_once()
    server.hold(held, states)
    guard.poll_once()
    time.sleep(STUCK_AFTER_S)
    guard.poll_once()
    assert server.stubs[held].zombie and stuck(guard) == 1 and server.loads == [MODEL]


@pytest.mark.parametrize(("states", "frozen"), WAITING.values(), ids=list(WAITING))
def test_a_waiting_stub_is_left_alone_however_long_and_logged_once(
    scripted, states: str, frozen: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Not put on a CPU for three times ``stuck_after_s``, but waiting, and no request of its model
    failed: not ended, its model not reloaded, one warning that it waits. Stopped then (T), it is
    stuck ``stuck_after_s`` later: the wait did not count."""
    server, guard = scripted
    held, _ = sorted(server.stubs)
    server.run(held)
    guard.poll_once()
    server.hold(held, states, frozen)
    for _ in range(3):
        time.sleep(STUCK_AFTER_S)
        guard.poll_once()
    assert not server.stubs[held].zombie and stuck(guard) == 0 and server.loads == []
    waiting = [record.getMessage() for record in caplog.records if "is waiting, not stuck" in record.getMessage()]
    assert len(waiting) == 1 and server.stubs[held].instance in waiting[0], caplog.text
    server.hold(held, "TTT")
    guard.poll_once()
    time.sleep(STUCK_AFTER_S)
    guard.poll_once()
    assert server.stubs[held].zombie and stuck(guard) == 1


@pytest.mark.parametrize(("states", "frozen"), WAITING.values(), ids=list(WAITING))
def test_a_waiting_stub_is_ended_once_the_backend_failed_a_request_of_its_model_meanwhile(
    scripted, states: str, frozen: bool
) -> None:
    """The Python backend failed a request on it (not healthy): resumed, it would read the freed
    request and crash, so it is ended while it still waits, once it has not run for ``stuck_after_s``."""
    server, guard = scripted
    held, _ = sorted(server.stubs)
    server.run(held)
    guard.poll_once()
    server.hold(held, states, frozen)
    guard.poll_once()  # found not running: its model's backend failures counted from here
    server.failures["BACKEND"] += 1
    guard.poll_once()
    assert not server.stubs[held].zombie  # not yet stuck_after_s
    time.sleep(STUCK_AFTER_S)
    guard.poll_once()
    assert server.stubs[held].zombie and stuck(guard) == 1 and server.loads == [MODEL]


@pytest.mark.parametrize(("states", "frozen"), WAITING.values(), ids=list(WAITING))
def test_a_waiting_stub_is_left_alone_while_its_models_other_instance_refuses_images_and_the_queue_fails_requests(
    scripted, states: str, frozen: bool
) -> None:
    """The model's other instance answers every request meanwhile, refused images among them (a
    success to Triton), and Triton's queue lets requests go (timeouts, cancelled clients): none
    reached the waiting stub, so it is left alone however long it waits. A request the backend
    fails after that (not healthy) gets it ended."""
    server, guard = scripted
    held, serving = sorted(server.stubs)
    for pid in (held, serving):
        server.run(pid)
    guard.poll_once()
    server.hold(held, states, frozen)
    for _ in range(3):
        server.run(serving)  # answering, refused images too: no failure counted
        server.failures.update(REJECTED=2, CANCELED=3)
        time.sleep(STUCK_AFTER_S)
        guard.poll_once()
    assert not server.stubs[held].zombie and stuck(guard) == 0 and server.loads == []
    server.failures["BACKEND"] += 1
    guard.poll_once()
    assert server.stubs[held].zombie and stuck(guard) == 1 and not server.stubs[serving].zombie


def test_readiness_is_false_from_a_stuck_stub_until_its_model_is_reloaded(scripted, monkeypatch) -> None:
    server, guard = scripted
    stopped, _ = sorted(server.stubs)
    server.run(stopped)
    server.hold(stopped, "TTT")
    failing = []

    def load_fails(model: str) -> None:
        failing.append(model)
        raise RepositoryError("the load failed")

    monkeypatch.setattr(server, "load", load_fails)
    guard.poll_once()
    time.sleep(STUCK_AFTER_S)
    guard.poll_once()
    assert failing == [MODEL] and stuck(guard) == 1
    ready, why = guard.readiness()
    assert not ready and MODEL in why and "stuck" in why


def test_a_slow_but_working_stub_is_never_taken_for_stuck(scripted) -> None:
    """A long decode keeps the stub's health thread beating: its threads are put on a CPU every
    scan, however long the request takes."""
    server, guard = scripted
    busy, _ = sorted(server.stubs)
    for _ in range(5):
        server.run(busy)
        server.work(busy, ticks=50)
        guard.poll_once()
        time.sleep(STUCK_AFTER_S)
    assert stuck(guard) == 0 and not server.stubs[busy].zombie and server.loads == []


def test_an_uncounted_stub_is_never_taken_for_stuck(scripted) -> None:
    """Where the kernel keeps no count (no schedstat), nothing is judged stuck."""
    server, guard = scripted
    for _ in range(3):
        guard.poll_once()
        time.sleep(STUCK_AFTER_S)
    assert stuck(guard) == 0 and server.loads == []


def faults_md() -> str:
    """docs/faults.md with its line breaks folded into spaces."""
    return " ".join((Path(__file__).parents[1] / "docs" / "faults.md").read_text().split())


def as_quoted(message: str) -> str:
    """A log message as docs/faults.md quotes one: any pid N, the time the default's."""
    message = re.sub(r"pid \d+", "pid N", message)
    return re.sub(r"has not run for [\d.]+ s", f"has not run for {DEFAULT_STUCK_AFTER_S:.1f} s", message)


DEFAULT_STUCK_AFTER_S = inspect.signature(StubWatchdog).parameters["stuck_after_s"].default


def test_the_log_lines_faults_md_quotes_are_the_watchdogs(scripted, caplog: pytest.LogCaptureFixture) -> None:
    """The waiting line whole, the stuck line to its ``...``; both with the default ``stuck_after_s``."""
    server, guard = scripted
    stopped, waiting = sorted(server.stubs)
    for pid in (stopped, waiting):
        server.run(pid)
    guard.poll_once()
    server.hold(waiting, "SSS", frozen=True)
    server.hold(stopped, "TTT")
    for _ in range(2):
        guard.poll_once()
        time.sleep(STUCK_AFTER_S)
    guard.poll_once()
    text = faults_md()
    logged = [as_quoted(record.getMessage()) for record in caplog.records]
    (waits,) = [line for line in logged if "is waiting, not stuck" in line]
    (stuck_line,) = [line for line in logged if " is stuck: " in line]
    assert f"(`{waits}`)" in text
    quoted = re.search(r"`(stub of \S+ is stuck: [^`]*) \.\.\.`", text)
    assert quoted is not None and stuck_line.startswith(quoted[1])
    assert f"logged once it has waited {DEFAULT_STUCK_AFTER_S:g} s" in text
