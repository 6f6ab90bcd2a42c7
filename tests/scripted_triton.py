"""A scripted tritonserver for the stub watchdog's tests: its stub processes, what /proc tells of
their threads, and its repository API, each changed only where a test says so.

tests/test_faults.py drives the watchdog against a real tritonserver, where the order of events is
up to tritonserver's timing; with this script each order is taken for certain
(tests/test_watchdog.py: deaths and recoveries; tests/test_stuck_stubs.py: stuck or waiting).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kimi_vision_server.watch import stub_activity, stub_scan, watchdog
from kimi_vision_server.watch.stub_activity import Activity
from kimi_vision_server.watch.stub_scan import StubProcess
from kimi_vision_server.watch.triton_repository import READY
from kimi_vision_server.watch.watchdog import StubWatchdog

MODEL = "kimi_k25_decode"


class ScriptedServer:
    """What the watchdog reads of tritonserver: its stub processes (and what /proc tells of their
    threads), its repository API and its model's failed requests on the metrics port. A load
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
        # The model's failed requests by Triton's reason (nv_inference_request_failure): BACKEND where
        # the backend failed one (a stub not healthy), REJECTED / CANCELED where its queue let one go.
        # An error a model instance answers (a refused image) is a success to Triton: none of these.
        self.failures: Counter[str] = Counter()
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

    def backend_failures(self, model: str) -> int:
        return self.failures["BACKEND"]

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
        "127.0.0.1:2",
        model_repository=server.repository,
        replaced_idle_s=REPLACED_IDLE_S,
        stuck_after_s=STUCK_AFTER_S,
        **settings,
    )


def repository_of(folder: Path) -> Path:
    """A model repository holding :data:`MODEL` with a version folder ``1``."""
    (folder / MODEL / "1").mkdir(parents=True)
    return folder


def scripted_pair(monkeypatch: pytest.MonkeyPatch) -> tuple[ScriptedServer, StubWatchdog]:
    """A server of two instances and its watchdog (each test module's ``scripted`` fixture)."""
    server = ScriptedServer(instances=2)
    return server, watched(server, monkeypatch)


def counts(guard: StubWatchdog) -> dict[str, Any]:
    """Deaths and recoveries of :data:`MODEL`, and its stalled loads where there were any."""
    counters = guard.counters()
    stalled = {"stalled_loads": counters["stalled_loads"][MODEL]} if MODEL in counters["stalled_loads"] else {}
    deaths, recoveries = counters["stub_deaths"].get(MODEL, 0), counters["recoveries"].get(MODEL, 0)
    return {"stub_deaths": deaths, "recoveries": recoveries} | stalled


def stuck(guard: StubWatchdog) -> int:
    return guard.counters()["stuck_stubs"].get(MODEL, 0)
