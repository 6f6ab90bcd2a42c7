"""The stub watchdog's bookkeeping, one scan at a time: which stub exits are deaths.

tests/test_faults.py kills real stubs of a real tritonserver; whether the replaced version's
surviving stub ends before or after the watchdog's next scan is up to tritonserver's timing there.
Here the scans and tritonserver's answers are scripted, so each order is taken for certain.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from pathlib import Path
from typing import Any

import pytest
from test_stub_activity import STOPPED_OR_DEADLOCKED, WAITING

from kimi_vision_server import recovery, stub_activity, stub_scan, triton_repository, watchdog
from kimi_vision_server.stub_activity import Activity
from kimi_vision_server.stub_scan import StubProcess
from kimi_vision_server.triton_repository import READY, RepositoryError
from kimi_vision_server.watchdog import StubWatchdog

MODEL = "kimi_k25_decode"


class ScriptedServer:
    """What the watchdog reads of tritonserver: its stub processes and its repository API. A load
    starts ``instances`` stubs of the model, as tritonserver does: after an unload, or where the
    model's version folder in ``repository`` is newer than at the last load (else it keeps the
    instances); nothing else changes unless a test says so."""

    def __init__(self, instances: int, repository: Path | None = None) -> None:
        self.instances = instances
        self.repository = repository
        self.pids = itertools.count(4_000_000)  # beyond pid_max: /proc has none of them
        self.stubs: dict[int, StubProcess] = {}
        self.scheduled: dict[int, int] = {}  # times each stub's threads were put on a CPU, where counted
        self.thread_states: dict[int, str] = {}  # each stub's threads' states (/proc), where not all "S"
        self.frozen: set[int] = set()  # stubs whose cgroup is frozen
        self.states = {MODEL: READY}
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.pid = 1  # the process the watchdog watches: always running
        self.loaded_mtime = self.version_mtime()
        self.start()

    def version_mtime(self) -> int:
        return 0 if self.repository is None else (self.repository / MODEL / "1").stat().st_mtime_ns

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

    def run(self, pid: int) -> None:
        """The stub's threads run (its health thread beats): it was put on a CPU again."""
        self.scheduled[pid] = self.scheduled.get(pid, 0) + 3

    def hold(self, pid: int, states: str, frozen: bool = False) -> None:
        """The stub's threads are in ``states`` (one letter each, as /proc shows them) from now on,
        its cgroup frozen or not."""
        self.thread_states[pid] = states
        self.frozen.discard(pid)
        if frozen:
            self.frozen.add(pid)

    def activity(self, pid: int) -> Activity | None:
        """What /proc tells of the stub's threads: None where the kernel keeps no count."""
        if pid not in self.scheduled:
            return None
        return Activity(self.scheduled[pid], self.thread_states.get(pid, "SSS"), pid in self.frozen)

    def end(self, pid: int) -> None:
        """A stub that exits and is reaped (its version unloaded)."""
        del self.stubs[pid]

    # -- the process and repository API the watchdog calls --

    def poll(self) -> None:
        return None

    def model_states(self) -> dict[str, str]:
        return dict(self.states)

    def unload(self, model: str) -> None:
        self.unloads.append(model)
        self.states[model] = "UNLOADING"

    def wait_not_ready(self, model: str) -> None:
        assert self.states[model] != READY

    def load(self, model: str) -> None:
        self.loads.append(model)
        if self.states[model] != READY or self.version_mtime() > self.loaded_mtime:
            self.start()
        self.loaded_mtime = self.version_mtime()
        self.states[model] = READY


REPLACED_IDLE_S = 0.2
STUCK_AFTER_S = 0.2


def watched(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch, **settings: float) -> StubWatchdog:
    """A watchdog of ``server`` (``settings``: more of its keyword arguments): its scans, kills and
    repository calls go to the script."""
    monkeypatch.setattr(stub_scan, "stub_processes", lambda pid: list(server.stubs.values()))
    monkeypatch.setattr(stub_scan, "end_process", server.kill)
    monkeypatch.setattr(stub_activity, "read_activity", server.activity)
    monkeypatch.setattr(watchdog, "TritonRepository", lambda *args, **kwargs: server)
    return StubWatchdog(
        server,  # type: ignore[arg-type]
        "127.0.0.1:1",
        model_repository=server.repository,
        replaced_idle_s=REPLACED_IDLE_S,
        stuck_after_s=STUCK_AFTER_S,
        **settings,
    )


def repository_of(folder: Path) -> Path:
    """A model repository holding :data:`MODEL` with a version folder ``1``."""
    (folder / MODEL / "1").mkdir(parents=True)
    return folder


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> tuple[ScriptedServer, StubWatchdog]:
    server = ScriptedServer(instances=2)
    return server, watched(server, monkeypatch)


def counts(guard: StubWatchdog) -> dict[str, Any]:
    """Deaths and recoveries of :data:`MODEL`, and its stalled loads where there were any."""
    counters = guard.counters()
    stalled = {"stalled_loads": counters["stalled_loads"][MODEL]} if MODEL in counters["stalled_loads"] else {}
    deaths, recoveries = counters["stub_deaths"].get(MODEL, 0), counters["recoveries"].get(MODEL, 0)
    return {"stub_deaths": deaths, "recoveries": recoveries} | stalled


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
        raise RepositoryError("POST unload: HTTP 503")

    monkeypatch.setattr(server, "unload", refused)
    _, survivor = kill_the_first_stub(server, guard)  # the death; its reload fails
    time.sleep(REPLACED_IDLE_S)
    guard.poll_once()
    assert not server.stubs[survivor].zombie
    assert ended(guard) == 0
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 0}


@pytest.fixture
def with_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ScriptedServer, StubWatchdog]:
    server = ScriptedServer(instances=2, repository=repository_of(tmp_path))
    return server, watched(server, monkeypatch)


def new_stubs(server: ScriptedServer, old: tuple[int, int]) -> list[int]:
    return [pid for pid, stub in server.stubs.items() if pid not in old and not stub.zombie]


def test_a_model_whose_version_folder_can_be_marked_is_reloaded_without_an_unload(with_repository) -> None:
    """Another instance lives: the version folder marked changed, one load starts a new version
    while the old one serves, no unload (during which the model and its ensembles would answer
    NOT_FOUND)."""
    server, guard = with_repository
    old = kill_the_first_stub(server, guard)
    assert server.unloads == [] and server.loads == [MODEL]
    assert len(new_stubs(server, old)) == 2
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_a_read_only_repository_is_reloaded_by_unload_and_load(with_repository, monkeypatch) -> None:
    server, guard = with_repository

    def read_only(folders: list[Path]) -> None:
        raise PermissionError(30, "Read-only file system", str(folders[0]))

    monkeypatch.setattr(recovery, "mark_changed", read_only)
    old = kill_the_first_stub(server, guard)
    assert server.unloads == [MODEL] and server.loads == [MODEL]
    assert len(new_stubs(server, old)) == 2
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_a_load_that_keeps_the_dead_instance_is_followed_by_unload_and_load(with_repository, monkeypatch) -> None:
    """Where tritonserver does not see the folders' change (its load keeps the instances, the dead
    one too), the recovery does not stop there."""
    server, guard = with_repository
    monkeypatch.setattr(recovery, "mark_changed", lambda folders: None)
    old = kill_the_first_stub(server, guard)
    assert server.unloads == [MODEL] and server.loads == [MODEL, MODEL]
    assert len(new_stubs(server, old)) == 2
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_marking_a_folder_changed_moves_its_mtime_past_the_last_one(tmp_path: Path) -> None:
    folder = tmp_path / "1"
    folder.mkdir()
    future = time.time_ns() + 3_600 * 10**9
    os.utime(folder, ns=(future, future))  # a clock that went back since, or a coarse one
    triton_repository.mark_changed([folder])
    assert folder.stat().st_mtime_ns > future
    assert triton_repository.version_folders(tmp_path) == [folder]


def test_a_model_with_no_other_live_instance_is_reloaded_by_unload_and_load(tmp_path: Path, monkeypatch) -> None:
    """With one instance, dead, nothing would serve while a new version loads in the background,
    and each request would wait 1 s at the dead stub: unload (NOT_FOUND at once) and load."""
    server = ScriptedServer(instances=1, repository=repository_of(tmp_path))
    guard = watched(server, monkeypatch)
    (only,) = server.stubs
    guard.poll_once()
    server.kill(only)
    guard.poll_once()
    assert server.unloads == [MODEL] and server.loads == [MODEL]
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_a_load_stuck_in_a_new_stubs_initialize_ends_that_stub_and_is_tried_again(tmp_path: Path, monkeypatch) -> None:
    """The Python backend waits for a new stub's initialize as long as the stub lives: the load
    still running after ``load_stall_s`` has its new stub ended, fails, and the next attempt loads."""
    server = ScriptedServer(instances=1, repository=repository_of(tmp_path))
    monkeypatch.setattr(recovery, "STACKS_WRITTEN_S", 0.0)
    guard = watched(server, monkeypatch, load_stall_s=0.2, initial_backoff_s=0.0)
    loaded = server.load

    def stuck(model: str) -> None:
        """The first load's stub never finishes initialize: the load returns once it is ended."""
        server.loads.append(model)
        (stub,) = server.start()
        while not server.stubs[stub].zombie:
            time.sleep(0.01)
        monkeypatch.setattr(server, "load", loaded)
        raise RepositoryError(f"POST load: HTTP 400: Stub process '{MODEL}_0_0' is not healthy.")

    monkeypatch.setattr(server, "load", stuck)
    (only,) = server.stubs
    guard.poll_once()
    server.kill(only)
    guard.poll_once()  # the death, a reload whose load stalls and fails
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 0, "stalled_loads": 1}
    assert not guard.readiness()[0]
    guard.poll_once()  # the ended stub is no death of a READY model; the next attempt loads
    assert server.unloads == [MODEL, MODEL] and server.loads == [MODEL, MODEL]
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1, "stalled_loads": 1}
    assert [stub.zombie for stub in server.stubs.values()].count(False) == 1


def stuck(guard: StubWatchdog) -> int:
    return guard.counters()["stuck_stubs"].get(MODEL, 0)


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
    """Not put on a CPU for three times ``stuck_after_s``, but waiting: not ended, its model not
    reloaded, one warning that it waits. Stopped then (T), it is stuck ``stuck_after_s`` later."""
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
