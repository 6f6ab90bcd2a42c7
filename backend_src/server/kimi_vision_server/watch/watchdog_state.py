"""What the stub watchdog knows of a running tritonserver's stubs, and its counters.

Shared by the watchdog's scans (:mod:`.watchdog`) and its recovery (:mod:`.recovery`), always
under the watchdog's lock.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from .stub_activity import Progress
from .stub_scan import StubProcess

StubIdentity = tuple[int, int]  # StubProcess.identity: its pid and start time


@dataclass
class PendingRecovery:
    """A model with a dead stub, waiting for (another attempt at) its reload; ``replaced``: the
    live stubs its reloads retired."""

    detected_at: float
    attempts: int = 0
    next_attempt_at: float = 0.0
    replaced: dict[StubIdentity, StubProcess] = field(default_factory=dict)


@dataclass
class ReplacedStub:
    """A live stub of a version a completed recovery replaced: its CPU time at the last scan, and
    when a scan last saw it grow by more than :data:`.recovery.IDLE_TICKS_PER_SCAN`."""

    cpu_ticks: int
    busy_at: float


@dataclass
class ServerState:
    """What the watchdog knows of the running tritonserver's stubs (begun anew with each server)."""

    known: dict[StubIdentity, StubProcess] = field(default_factory=dict)  # live stubs seen
    handled: set[StubIdentity] = field(default_factory=set)  # dead or retired stubs, not watched
    pending: dict[str, PendingRecovery] = field(default_factory=dict)
    recovering: str | None = None
    replaced: dict[StubIdentity, ReplacedStub] = field(default_factory=dict)  # ended once idle
    progress: dict[StubIdentity, Progress] = field(default_factory=dict)  # watched stubs, to find stuck ones
    pinned: set[str] = field(default_factory=set)  # models reloaded: a replaced version may never unload
    started_at: float = field(default_factory=time.monotonic)
    live_seen: bool = False  # it answered /v2/health/live: it started, whatever exits later is no start-up failure

    def learn(self, stubs: list[StubProcess]) -> None:
        """Watch the live stubs not watched yet, but retired ones."""
        for stub in stubs:
            if not stub.zombie and stub.identity not in self.handled:
                self.known[stub.identity] = stub


@dataclass
class WatchdogState(ServerState):
    """:class:`ServerState` and the counters, kept across the servers the watchdog starts again."""

    deaths: Counter[str] = field(default_factory=Counter)
    stuck: Counter[str] = field(default_factory=Counter)
    recoveries: Counter[str] = field(default_factory=Counter)
    replaced_ended: Counter[str] = field(default_factory=Counter)
    stalled_loads: Counter[str] = field(default_factory=Counter)
    server_restarts: int = 0
    quick_exits: int = 0  # servers in a row that exited within SERVER_QUICK_EXIT_S of their start
    last_round_at: float | None = None

    def new_server(self) -> None:
        """Forget the stubs of a server that exited; keep the counters."""
        for name, value in vars(ServerState()).items():
            setattr(self, name, value)
