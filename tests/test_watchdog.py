"""The stub watchdog's bookkeeping, one scan at a time: which stub exits are deaths.

tests/test_faults.py kills real stubs of a real tritonserver; whether the replaced version's
surviving stub ends before or after the watchdog's next scan is up to tritonserver's timing there.
Here the scans and tritonserver's answers are scripted, so each order is taken for certain.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import pytest

from kimi_vision_server import watchdog
from kimi_vision_server.watchdog import READY, StubProcess, StubWatchdog

MODEL = "kimi_k25_decode"


class ScriptedServer:
    """What the watchdog reads of tritonserver: its stub processes and its repository API. A load
    starts ``instances`` stubs of the model; nothing else changes unless a test says so."""

    def __init__(self, instances: int) -> None:
        self.instances = instances
        self.pids = itertools.count(4_000_000)  # beyond pid_max: /proc has none of them
        self.stubs: dict[int, StubProcess] = {}
        self.states = {MODEL: READY}
        self.loads: list[str] = []
        self.pid = 1  # the process the watchdog watches: always running
        self.start()

    def start(self) -> list[int]:
        pids = [next(self.pids) for _ in range(self.instances)]
        for index, pid in enumerate(pids):
            self.stubs[pid] = StubProcess(pid, pid, MODEL, f"{MODEL}_0_{index}", zombie=False)
        return pids

    def kill(self, pid: int) -> None:
        """SIGKILL: tritonserver does not reap its dead stub, a zombie stays."""
        self.stubs[pid] = dataclasses.replace(self.stubs[pid], zombie=True)

    def work(self, pid: int, ticks: int) -> None:
        """The stub uses ``ticks`` clock ticks of CPU."""
        self.stubs[pid] = dataclasses.replace(self.stubs[pid], cpu_ticks=self.stubs[pid].cpu_ticks + ticks)

    def end(self, pid: int) -> None:
        """A stub that exits and is reaped (its version unloaded)."""
        del self.stubs[pid]

    # -- the process and repository API the watchdog calls --

    def poll(self) -> None:
        return None

    def model_states(self) -> dict[str, str]:
        return dict(self.states)

    def unload(self, model: str) -> None:
        self.states[model] = "UNLOADING"

    def wait_not_ready(self, model: str) -> None:
        assert self.states[model] != READY

    def load(self, model: str) -> None:
        self.loads.append(model)
        self.start()
        self.states[model] = READY


REPLACED_IDLE_S = 0.2


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> tuple[ScriptedServer, StubWatchdog]:
    server = ScriptedServer(instances=2)
    monkeypatch.setattr(watchdog, "stub_processes", lambda pid: list(server.stubs.values()))
    monkeypatch.setattr(watchdog, "end_process", server.kill)
    guard = StubWatchdog(server, "127.0.0.1:1", replaced_idle_s=REPLACED_IDLE_S)  # type: ignore[arg-type]
    guard.repository = server  # type: ignore[assignment]
    return server, guard


def counts(guard: StubWatchdog) -> dict[str, Any]:
    return {name: values.get(MODEL, 0) for name, values in guard.counters().items() if name != "replaced_stubs_ended"}


def ended(guard: StubWatchdog) -> int:
    return guard.counters()["replaced_stubs_ended"].get(MODEL, 0)


def kill_the_first_stub(server: ScriptedServer, guard: StubWatchdog) -> tuple[int, int]:
    """Both stubs learned, the first killed, a scan: its death and its model's reload (two new
    stubs, unless the reload fails). Returns (the killed stub's pid, the survivor's)."""
    first, survivor = sorted(server.stubs)
    guard.poll_once()
    server.kill(first)
    guard.poll_once()
    return first, survivor


def test_the_replaced_versions_surviving_stub_ending_after_a_scan_is_no_death(scripted) -> None:
    server, guard = scripted
    _, survivor = kill_the_first_stub(server, guard)
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}
    guard.poll_once()  # the old version still unloading: its survivor still runs
    server.end(survivor)  # it unloads
    guard.poll_once()
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}
    assert server.loads == [MODEL]
    assert guard.readiness()[1] != f"recovering from a dead stub: {MODEL}"


def test_a_stub_of_the_reloaded_version_killed_next_is_recovered(scripted) -> None:
    server, guard = scripted
    first, survivor = kill_the_first_stub(server, guard)
    new_first = min(pid for pid, stub in server.stubs.items() if pid not in (first, survivor))
    guard.poll_once()
    server.end(survivor)
    server.kill(new_first)
    guard.poll_once()
    assert counts(guard) == {"stub_deaths": 2, "recoveries": 2}
    assert server.loads == [MODEL, MODEL]


def test_a_new_stub_killed_and_reaped_before_the_next_scan_is_a_death(scripted) -> None:
    server, guard = scripted
    first, survivor = kill_the_first_stub(server, guard)
    new_first = min(pid for pid in server.stubs if pid not in (first, survivor))
    server.end(new_first)  # killed and reaped before that scan
    guard.poll_once()
    assert counts(guard) == {"stub_deaths": 2, "recoveries": 2}


def test_a_replaced_versions_stub_that_never_ends_is_ended_once_idle(scripted) -> None:
    """A request reached the dead stub: the old version never unloads and its survivor would run
    on. It finishes what it had (its CPU time grows), then, idle for ``replaced_idle_s``, it is
    ended; that is neither a death nor a reload, and the new version's stubs are left alone."""
    server, guard = scripted
    first, survivor = kill_the_first_stub(server, guard)
    new = sorted(pid for pid in server.stubs if pid not in (first, survivor))
    for _ in range(3):  # still busy with the requests it had: not ended however long
        server.work(survivor, ticks=20)
        time.sleep(REPLACED_IDLE_S)
        guard.poll_once()
        assert not server.stubs[survivor].zombie
    server.work(survivor, ticks=1)  # its health thread: idle
    guard.poll_once()
    time.sleep(REPLACED_IDLE_S)
    guard.poll_once()
    assert server.stubs[survivor].zombie, "the idle survivor of the replaced version was ended"
    assert ended(guard) == 1
    guard.poll_once()
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}
    assert server.loads == [MODEL]
    assert not any(server.stubs[pid].zombie for pid in new)


def test_a_replaced_versions_stub_that_ends_by_itself_is_not_ended_again(scripted) -> None:
    server, guard = scripted
    _, survivor = kill_the_first_stub(server, guard)
    server.end(survivor)  # its version unloaded
    guard.poll_once()
    time.sleep(REPLACED_IDLE_S)
    guard.poll_once()
    assert ended(guard) == 0
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_a_stub_retired_by_a_failed_reload_is_left_alone(scripted, monkeypatch) -> None:
    """The unload was refused: the old version still serves, and its stubs are not ended while the
    recovery has not completed."""
    server, guard = scripted

    def refused(model: str) -> None:
        raise watchdog.RepositoryError("POST unload: HTTP 503")

    monkeypatch.setattr(server, "unload", refused)
    _, survivor = kill_the_first_stub(server, guard)  # the death; its reload fails
    time.sleep(REPLACED_IDLE_S)
    guard.poll_once()
    assert not server.stubs[survivor].zombie
    assert ended(guard) == 0
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 0}
