"""Notice dead Python-backend stubs and reload their models; the health behind ``/readyz``.

tritonserver 2.51 does not restart a Python backend stub that died (segfault, OOM kill,
``kill -9``): the model stays ``READY`` in every health endpoint while each request to it fails
with ``Stub process '<instance>' is not healthy``, and a ``load`` of an unchanged model keeps its
instances, the dead one too. A ``load`` after the model's version folder changed (its mtime, which
Triton compares with the one it read at the last load) loads a new version in the background
while the old one serves, then swaps them and the ensembles composing the model; an ``unload``
then ``load`` also starts fresh stubs, but the model and its ensembles answer ``NOT_FOUND`` until
the load completes.

:class:`StubWatchdog` runs in the launcher process, next to the tritonserver it started:

- every ``interval_s`` it lists the server's ``triton_python_backend_stub`` children (their argv
  carries the model file and the instance name, e.g. ``kimi_k25_decode_0_0``). A stub that became
  a zombie (the server does not reap it) or vanished while its model is still ``READY`` is dead;
  stubs of a model the repository reports as not ``READY`` are being (un)loaded on purpose and
  are left alone;
- a model with a dead stub is reloaded, one reload at a time, retried with exponential backoff
  until it succeeds. Where another of its instances lives: its version folders' mtime set to now
  and a ``load``, so that instance goes on serving until the new version is ready (where the
  folders cannot be changed, a read-only repository, or the load started no new stub: logged, and
  as below). Where none does, an ``unload`` and a ``load``: requests then fail at once with
  ``NOT_FOUND``, where in a background load each would wait 1 s at the dead stub, and the model
  heals later (docs/faults.md). Then a load of any model that was ready before and is not now.
  Every stub of the old version is retired when the reload begins: the stubs of its live
  instances (a model with several) end as it unloads, and that is not a death;
- the old version does not always unload: each request the Python backend hands to a stub gets a
  response factory (``TRITONBACKEND_ResponseFactoryNew`` in ``python_be.cc``), which keeps its
  model loaded while it lives, and when the stub is dead ``ProcessRequests`` returns on the
  failed receive before deleting it. So once a request reached the dead stub the old version
  stays ``UNLOADING`` for good, and its live instances' stubs would run until the server stops.
  After a recovery, each such stub is ended once it has been idle for ``replaced_idle_s`` (no
  more than a clock tick of CPU a scan: it finishes the requests it had first, and no new one
  reaches a version being unloaded);
- a load is bounded: the Python backend waits for a new stub's ``initialize`` for as long as the
  stub's health thread beats, so a stub stuck there would hold the load, and the watchdog, for
  good. A load still running ``load_stall_s`` after it began has the stubs it started write their
  Python stacks to the server's log (SIGUSR1, :func:`~.contract.triton_python_model`) and ends
  them: the load fails, and is tried again after the backoff;
- a tritonserver that exits by itself after it started serving (the Python backend aborts it
  when it finds a lock a dead stub held, docs/faults.md) is started again with the same command
  line (``restart``, from the launcher: it ends the stubs and removes the shared memory the old
  one left first), at once, or after the backoff where the last one also exited within
  :data:`SERVER_QUICK_EXIT_S` of its start; one that exits cleanly (code 0), or with an error
  code before it answered ``/v2/health/live`` (a start-up failure), is not;
- a stub that no longer runs at all (stopped, frozen: none of its threads put on a CPU for
  ``stuck_after_s``) is stuck: the Python backend's health check already calls it "not healthy"
  (its health thread beats every 300 ms, in C++, whatever the model's Python code is doing), so
  every request it takes fails. The watchdog ends it (SIGKILL) and reloads its model as for a dead
  one. A stub that is slow but working (a long decode, a long video) keeps its health thread
  running and is never taken for stuck;
- ``kimi_prep_stub_deaths_total{model}``, ``kimi_prep_stuck_stubs_total{model}``, ``kimi_prep_recoveries_total{model}``,
  ``kimi_prep_replaced_stubs_ended_total{model}``, ``kimi_prep_stalled_loads_total{model}`` and
  ``kimi_prep_server_restarts_total`` count deaths, completed recoveries, the stubs ended so, the
  loads ended for stalling and the servers started again;
  :meth:`StubWatchdog.readiness` is false while a stub is known dead or its recovery is in progress.

Process scanning is used instead of canary requests: it sees every crash within one interval,
costs nothing per request and never mistakes a slow or overloaded model for a dead one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
READY = "READY"
UNLOADED = "UNLOADED"  # an operator's explicit unload (Triton: UNAVAILABLE, reason "unloaded")


def _state(entry: dict[str, str]) -> str:
    state = entry.get("state", "UNAVAILABLE")
    return UNLOADED if state == "UNAVAILABLE" and entry.get("reason") == "unloaded" else state


PROC = Path("/proc")

log = logging.getLogger(__name__)


class RepositoryError(RuntimeError):
    """A repository API call of tritonserver failed or timed out."""


# -- the stub processes --------------------------------------------------------------------------


@dataclass(frozen=True)
class StubProcess:
    """One ``triton_python_backend_stub`` child of the server."""

    pid: int
    start_ticks: int  # with pid, identifies the process across pid reuse
    model: str
    instance: str
    zombie: bool
    cpu_ticks: int = 0  # user + system CPU time so far, in clock ticks
    state: str = "S"  # /proc's one-letter state: R running, S sleeping, T stopped, Z zombie...

    @property
    def identity(self) -> tuple[int, int]:
        return self.pid, self.start_ticks


def _stat_fields(pid_dir: Path) -> list[str]:
    """Fields of ``/proc/<pid>/stat`` after the command name: state is [0], ppid [1], pgrp [2],
    utime [11], stime [12], starttime [19]."""
    stat = (pid_dir / "stat").read_text()
    return stat.rsplit(")", 1)[1].split()


def times_scheduled(pid: int) -> int | None:
    """How often the threads of ``pid`` have been put on a CPU so far: the sum of their timeslice
    counts (the third field of ``/proc/<pid>/task/<tid>/schedstat``); None where the process is
    gone or the kernel keeps no such count. A live stub's count grows at least every 300 ms (its
    health thread wakes then); a stopped or frozen one's does not."""
    total, read = 0, 0
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[2])
            read += 1
        except FileNotFoundError:  # a thread that ended meanwhile, or no schedstat at all
            continue
        except (OSError, IndexError, ValueError):
            return None
    return total if read else None


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None when no such process is visible."""
    try:
        return int(_stat_fields(PROC / str(pid))[19])
    except (OSError, IndexError, ValueError):
        return None


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``; None when no such process is visible."""
    try:
        return int(_stat_fields(PROC / str(pid))[1])
    except (OSError, IndexError, ValueError):
        return None


def killed_by(number: int) -> str:
    """``killed by SIGABRT (6)``, or ``killed by signal N`` for a number with no name."""
    try:
        return f"killed by {signal.Signals(number).name} ({number})"
    except ValueError:
        return f"killed by signal {number}"


def describe_exit(code: int) -> str:
    """A Popen return code in words: ``killed by SIGABRT (6)`` or ``exit code 1``."""
    return f"exit code {code}" if code >= 0 else killed_by(-code)


def death_cause(pid: int) -> str:
    """Why a stub is gone, as far as ``/proc`` still tells: a zombie's wait status (``exit_code``,
    field 52 of ``/proc/<pid>/stat``) as a signal or an exit code; else gone (already reaped)."""
    try:
        fields = _stat_fields(PROC / str(pid))
    except (OSError, IndexError):
        return "gone (reaped by tritonserver)"
    if fields[0] != "Z" or len(fields) < 50:
        return "gone (its pid is another process now)" if fields[0] != "Z" else "a zombie"
    status = int(fields[49])
    if os.WIFSIGNALED(status):
        return f"a zombie, {killed_by(os.WTERMSIG(status))}"
    return f"a zombie, exited with code {os.WEXITSTATUS(status)}"


def stub_from_argv(pid: int, fields: list[str], argv: list[str]) -> StubProcess | None:
    """A model instance's stub from its argv: ``stub <repo>/<model>/<version>/model.py <shm region> ...
    <instance name> ...``. None for other processes and for the short-lived stub that completes a
    model's config while it loads (its instance name is the model's name), which a tritonserver
    started without the launcher's ``--disable-auto-complete-config`` runs."""
    if len(argv) < 9 or not argv[0].endswith(STUB_BINARY):
        return None
    model, instance = Path(argv[1]).parents[1].name, argv[8]
    if instance == model:
        return None
    cpu_ticks = int(fields[11]) + int(fields[12])
    return StubProcess(
        pid, int(fields[19]), model, instance, zombie=fields[0] == "Z", cpu_ticks=cpu_ticks, state=fields[0]
    )


def version_folders(model_folder: Path) -> list[Path]:
    """The version folders (``1``, ``2``, ...) of a model folder of the repository."""
    return sorted(p for p in model_folder.iterdir() if p.is_dir() and p.name.isdigit())


def mark_changed(folders: list[Path]) -> None:
    """Set each folder's mtime later than it was and than now: tritonserver loads a model whose
    version folder is newer than at its last load as a new version."""
    for folder in folders:
        mtime = max(time.time_ns(), folder.stat().st_mtime_ns + 1_000_000_000)  # a 1 s clock too
        os.utime(folder, ns=(mtime, mtime))


def signal_process(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid``; nothing if it has gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def end_process(pid: int) -> None:
    """SIGKILL ``pid``; nothing if it has gone."""
    signal_process(pid, signal.SIGKILL)


def watchdog_thread_name(server_pid: int) -> str:
    """The name of the thread watching tritonserver ``server_pid`` (its stacks are looked up by it)."""
    return f"kimi-prep-stub-watchdog-{server_pid}"


def stub_processes(server_pid: int) -> list[StubProcess]:
    """The Python-backend stubs whose parent is ``server_pid`` (zombies included)."""
    return _stubs_where(lambda fields: int(fields[1]) == server_pid)


def stubs_in_group(pgid: int) -> list[StubProcess]:
    """The Python-backend stubs in process group ``pgid``, whatever their parent (orphans too)."""
    return _stubs_where(lambda fields: int(fields[2]) == pgid)


def _stubs_where(keep: Callable[[list[str]], bool]) -> list[StubProcess]:
    """The stubs whose ``/proc/<pid>/stat`` fields (:func:`_stat_fields`) ``keep`` holds for."""
    stubs = []
    for pid_dir in PROC.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fields = _stat_fields(pid_dir)
            if not keep(fields):
                continue
            argv = [a.decode(errors="replace") for a in (pid_dir / "cmdline").read_bytes().split(b"\0")]
        except (OSError, IndexError, ValueError):  # exited while we looked
            continue
        stub = stub_from_argv(int(pid_dir.name), fields, argv)
        if stub is not None:
            stubs.append(stub)
    return stubs


# -- the repository API --------------------------------------------------------------------------


class TritonRepository:
    """The few HTTP endpoints of tritonserver the watchdog needs; ``headers`` go with every call
    (the admin key of the restricted repository API, :mod:`.access`)."""

    def __init__(self, http_url: str, load_timeout_s: float = 600.0, headers: dict[str, str] | None = None) -> None:
        self.base = f"http://{http_url}/v2"
        self.load_timeout_s = load_timeout_s
        self.headers = dict(headers or {})

    def _post(self, path: str, timeout_s: float) -> bytes:
        request = urllib.request.Request(f"{self.base}{path}", data=b"{}", method="POST", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise RepositoryError(f"POST {path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise RepositoryError(f"POST {path}: {exc}") from None

    def index(self) -> list[dict[str, str]]:
        """tritonserver's repository index: ``name``, ``state`` and ``reason`` of every model."""
        return list(json.loads(self._post("/repository/index", timeout_s=10) or b"[]"))

    def model_states(self) -> dict[str, str]:
        """``{model: state}`` of every model in the repository (READY, LOADING, UNLOADING, UNAVAILABLE;
        UNLOADED for one an operator unloaded through the repository API)."""
        return {entry["name"]: _state(entry) for entry in self.index()}

    def server_ready(self) -> bool:
        return self._health("ready")

    def server_live(self) -> bool:
        return self._health("live")

    def _health(self, which: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/health/{which}", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def unload(self, model: str) -> None:
        self._post(f"/repository/models/{model}/unload", timeout_s=60)

    def load(self, model: str) -> None:
        self._post(f"/repository/models/{model}/load", timeout_s=self.load_timeout_s)

    def wait_not_ready(self, model: str, timeout_s: float = 60.0) -> None:
        """Until ``model`` left ``READY`` (its unload began)."""
        deadline = time.monotonic() + timeout_s
        while self.model_states().get(model) == READY:
            if time.monotonic() > deadline:
                raise RepositoryError(f"{model} still READY {timeout_s:g} s after its unload")
            time.sleep(0.05)


# -- the watchdog --------------------------------------------------------------------------------


@dataclass
class PendingRecovery:
    """A model with a dead stub, waiting for (another attempt at) its reload; ``replaced``: the
    live stubs its reloads retired."""

    detected_at: float
    attempts: int = 0
    next_attempt_at: float = 0.0
    replaced: dict[tuple[int, int], StubProcess] = field(default_factory=dict)


@dataclass
class Progress:
    """A watched stub's :func:`times_scheduled` at the last scan, and when a scan last saw it grow."""

    scheduled: int
    changed_at: float


@dataclass
class ReplacedStub:
    """A live stub of a version a completed recovery replaced: its CPU time at the last scan, and
    when a scan last saw it grow by more than :data:`IDLE_TICKS_PER_SCAN`."""

    cpu_ticks: int
    busy_at: float


# CPU a replaced stub may use in one scan and still count as idle: its health thread wakes every
# 300 ms, and a clock tick (10 ms) is charged now and then to whatever runs when it fires.
IDLE_TICKS_PER_SCAN = 1
# A tritonserver that exits this soon after its start, and the last one did too, is started again
# after a backoff (the watchdog's initial_backoff_s, doubling up to max_backoff_s), not at once.
SERVER_QUICK_EXIT_S = 60.0
# Time a stub ending for a stalled load is given to write its Python stacks (faulthandler, SIGUSR1).
STACKS_WRITTEN_S = 1.0


@dataclass
class ServerState:
    """What the watchdog knows of the running tritonserver's stubs (begun anew with each server)."""

    known: dict[tuple[int, int], StubProcess] = field(default_factory=dict)  # live stubs seen
    handled: set[tuple[int, int]] = field(default_factory=set)  # dead or retired stubs, not watched
    pending: dict[str, PendingRecovery] = field(default_factory=dict)
    recovering: str | None = None
    replaced: dict[tuple[int, int], ReplacedStub] = field(default_factory=dict)  # ended once idle
    progress: dict[tuple[int, int], Progress] = field(default_factory=dict)  # watched stubs, to find stuck ones
    pinned: set[str] = field(default_factory=set)  # models reloaded: a replaced version may never unload
    started_at: float = field(default_factory=time.monotonic)
    live_seen: bool = False  # it answered /v2/health/live: it started, whatever exits later is no start-up failure


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


class StubWatchdog:
    """Thread watching the stubs of ``process`` (a running tritonserver) and reloading their models."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        http_url: str,
        *,
        model_repository: Path | None = None,
        interval_s: float = 0.5,
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        replaced_idle_s: float = 10.0,
        load_stall_s: float = 120.0,
        stuck_after_s: float = 2.0,
        headers: dict[str, str] | None = None,
        restart: Callable[[subprocess.Popen[bytes]], subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.process = process
        self.repository = TritonRepository(http_url, headers=headers)
        self.model_repository = model_repository
        self.interval_s = interval_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.replaced_idle_s = replaced_idle_s
        self.load_stall_s = load_stall_s
        self.stuck_after_s = stuck_after_s
        self.restart = restart
        self._state = WatchdogState()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=watchdog_thread_name(process.pid), daemon=True)

    def start(self) -> StubWatchdog:
        self._thread.start()
        return self

    def stand_down(self) -> None:
        """The server is being stopped on purpose: stop watching now (its stubs exiting is expected,
        not a fault to report); safe from a signal handler."""
        self._stopped.set()

    def stop(self) -> None:
        self.stand_down()
        if self._thread.is_alive():
            self._thread.join(timeout=self.repository.load_timeout_s)

    def watching(self) -> bool:
        """Whether the watchdog still runs: while it does, a server that exited by itself is started
        again (one that exited cleanly, code 0, ends it)."""
        return self._thread.is_alive()

    def __enter__(self) -> StubWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the probes read --

    def counters(self) -> dict[str, dict[str, int]]:
        """``{"stub_deaths": {model: n}, "stuck_stubs": {model: n}, "recoveries": {model: n},
        "replaced_stubs_ended": {model: n}, "stalled_loads": {model: n}, "server_restarts": {"": n}}``
        ("": no label)."""
        with self._lock:
            return {
                "stub_deaths": dict(self._state.deaths),
                "stuck_stubs": dict(self._state.stuck),
                "recoveries": dict(self._state.recoveries),
                "replaced_stubs_ended": dict(self._state.replaced_ended),
                "stalled_loads": dict(self._state.stalled_loads),
                "server_restarts": {"": self._state.server_restarts},
            }

    def pinned_versions(self) -> list[str]:
        """The models reloaded after a stub died: a replaced version of theirs never unloads where a
        request reached the dead stub, and stopping the server would wait its whole exit timeout
        for it (docs/faults.md)."""
        with self._lock:
            return sorted(self._state.pinned)

    def readiness(self) -> tuple[bool, str]:
        """(ready, why not): watching, no stub known dead, no reload in progress, every model READY."""
        if self.process.poll() is not None:
            return False, f"tritonserver exited with code {self.process.returncode}"
        with self._lock:
            broken = sorted({*self._state.pending, *([self._state.recovering] if self._state.recovering else [])})
            last_round = self._state.last_round_at
        if broken:
            return False, f"recovering from a dead or stuck stub: {', '.join(broken)}"
        if last_round is None or time.monotonic() - last_round > max(10.0, 20 * self.interval_s):
            return False, "the stub watchdog is not scanning"
        if not self.repository.server_ready():
            return False, "tritonserver is not ready"
        try:
            states = self.repository.model_states()
        except RepositoryError as exc:
            return False, str(exc)
        # An explicit unload takes the model out of the set the server is meant to serve (a load puts
        # it back); any other state than READY is a reason not to be ready.
        not_ready = sorted(f"{name} {state}" for name, state in states.items() if state not in (READY, UNLOADED))
        return (False, f"models not ready: {', '.join(not_ready)}") if not_ready else (True, "ready")

    # -- the loop --

    def _run(self) -> None:
        while not self._stopped.is_set():
            if self.process.poll() is not None and not self._start_server_again():
                return
            try:
                self.poll_once()
                if not self._state.live_seen and self.repository.server_live():
                    with self._lock:
                        self._state.live_seen = True
            except Exception:  # the watchdog must outlive any surprise; the next round tries again
                log.exception("stub watchdog round failed")
            with self._lock:
                self._state.last_round_at = time.monotonic()
            self._stopped.wait(self.interval_s)

    def _start_server_again(self) -> bool:
        """tritonserver exited without being asked to: start it again (``restart``; after a backoff
        where the last ones exited soon after their start); False where it exited cleanly (code 0:
        an operator's signal to the server itself), exited with an error code before it answered
        ``/v2/health/live`` (a start-up failure, the launcher's to report), there is no
        ``restart``, or the watchdog stood down meanwhile. A signal always counts as a crash."""
        code = self.process.returncode
        if code == 0 or self.restart is None or (code > 0 and not self._state.live_seen):
            return False
        with self._lock:
            quick = time.monotonic() - self._state.started_at < SERVER_QUICK_EXIT_S
            self._state.quick_exits = self._state.quick_exits + 1 if quick else 0
            repeats = self._state.quick_exits - 1  # the first start again is at once
            delay = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (repeats - 1)) if repeats > 0 else 0
        log.error(
            "tritonserver (pid %d) exited by itself (%s); starting it again%s",
            self.process.pid,
            describe_exit(code),
            f" in {delay:g} s" if delay else "",
        )
        if self._stopped.wait(delay):
            return False
        try:
            process = self.restart(self.process)
        except OSError as exc:
            log.error("starting tritonserver again failed: %s", exc)
            with self._lock:
                self._state.started_at = time.monotonic()  # counts as a quick exit: the next try backs off
            return not self._stopped.wait(self.initial_backoff_s)
        with self._lock:
            self.process = process
            self._state.new_server()
            self._state.server_restarts += 1
        self._thread.name = watchdog_thread_name(process.pid)
        return True

    def poll_once(self) -> None:
        """One round: scan the stubs, record deaths, end replaced stubs that are idle, run the
        reloads that are due."""
        stubs = stub_processes(self.process.pid)
        self._record_deaths(stubs)
        self._end_stuck(stubs)
        self._end_idle_replaced(stubs)
        now = time.monotonic()
        with self._lock:
            due = [model for model, pending in self._state.pending.items() if pending.next_attempt_at <= now]
        for model in due:
            if self._stopped.is_set():
                return
            self._attempt_recovery(model)

    def _dead_stubs(self, stubs: list[StubProcess]) -> list[StubProcess]:
        """Stubs that died since the last round (zombies, or known live ones gone); learns new live ones."""
        seen = {stub.identity for stub in stubs}
        with self._lock:
            self._state.handled &= seen  # a stub gone for good needs no remembering
            self._learn(stubs)
            zombies = [stub for stub in stubs if stub.zombie and stub.identity not in self._state.handled]
            vanished = [stub for identity, stub in self._state.known.items() if identity not in seen]
        return zombies + vanished

    def _learn(self, stubs: list[StubProcess]) -> None:
        """Watch the live stubs not watched yet, but retired ones (the caller holds the lock)."""
        for stub in stubs:
            if not stub.zombie and stub.identity not in self._state.handled:
                self._state.known[stub.identity] = stub

    def _record_deaths(self, stubs: list[StubProcess]) -> None:
        dead = self._dead_stubs(stubs)
        if not dead:
            return
        try:
            states = self.repository.model_states()
        except RepositoryError as exc:  # shutting down, or busy: look again next round
            log.info("stub exit seen but the repository did not answer: %s", exc)
            return
        by_model: dict[str, list[StubProcess]] = {}
        with self._lock:
            for stub in dead:
                self._state.known.pop(stub.identity, None)
                self._state.handled.add(stub.identity)
                by_model.setdefault(stub.model, []).append(stub)
            for model, model_stubs in by_model.items():
                if states.get(model) != READY or model in self._state.pending:
                    continue  # unloading or loading on purpose, or already queued for a reload
                self._state.deaths[model] += len(model_stubs)
                self._state.pending[model] = PendingRecovery(detected_at=time.monotonic())
                instances = ", ".join(
                    f"{stub.instance} (pid {stub.pid}: {death_cause(stub.pid)})" for stub in model_stubs
                )
                log.warning("stub of %s died: %s; reloading the model", model, instances)

    def _stuck_stubs(self, stubs: list[StubProcess]) -> list[StubProcess]:
        """Watched stubs whose threads have not been put on a CPU for ``stuck_after_s`` (those of a
        model already being reloaded are left to the reload)."""
        now = time.monotonic()
        stuck = []
        with self._lock:
            watched = set(self._state.known)
            reloading = {*self._state.pending, self._state.recovering}
            for identity in set(self._state.progress) - watched:
                del self._state.progress[identity]
        for stub in stubs:
            if stub.zombie or stub.identity not in watched or stub.model in reloading:
                continue
            scheduled = times_scheduled(stub.pid)
            if scheduled is None:
                continue
            with self._lock:
                last = self._state.progress.get(stub.identity)
                if last is None or scheduled != last.scheduled:
                    self._state.progress[stub.identity] = Progress(scheduled, now)
                elif now - last.changed_at >= self.stuck_after_s:
                    stuck.append(stub)
        return stuck

    def _end_stuck(self, stubs: list[StubProcess]) -> None:
        """End each stuck stub of a ``READY`` model and queue its model's reload, as for a death."""
        stuck = self._stuck_stubs(stubs)
        if not stuck:
            return
        try:
            states = self.repository.model_states()
        except RepositoryError as exc:
            log.info("a stub is stuck but the repository did not answer: %s", exc)
            return
        for stub in stuck:
            if states.get(stub.model) != READY:
                continue
            with self._lock:
                since = time.monotonic() - self._state.progress[stub.identity].changed_at
                self._state.known.pop(stub.identity, None)
                self._state.progress.pop(stub.identity, None)
                self._state.handled.add(stub.identity)
                self._state.stuck[stub.model] += 1
                self._state.pending.setdefault(stub.model, PendingRecovery(detected_at=time.monotonic()))
            log.warning(
                "stub of %s is stuck: %s (pid %d, state %s) has not run for %.1f s, and the Python backend "
                "fails every request it takes (not healthy); ending it and reloading the model",
                stub.model,
                stub.instance,
                stub.pid,
                stub.state,
                since,
            )
            end_process(stub.pid)

    def _attempt_recovery(self, model: str) -> None:
        with self._lock:
            pending = self._state.pending[model]
            pending.attempts += 1
            self._state.recovering = model
        try:
            self._reload(model)
        except RepositoryError as exc:
            backoff = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (pending.attempts - 1))
            log.error("reload %d of %s failed: %s; next try in %.1f s", pending.attempts, model, exc, backoff)
            with self._lock:
                pending.next_attempt_at = time.monotonic() + backoff
                self._state.recovering = None
            return
        elapsed = time.monotonic() - pending.detected_at
        # The new version's stubs are watched before readiness says ready: one killed before the
        # next scan and reaped by then would otherwise never be seen, its model left half-served.
        stubs = stub_processes(self.process.pid)
        now = time.monotonic()
        with self._lock:
            self._learn(stubs)
            del self._state.pending[model]
            for identity, stub in pending.replaced.items():
                self._state.replaced[identity] = ReplacedStub(stub.cpu_ticks, busy_at=now)
            self._state.recoveries[model] += 1
            self._state.pinned.add(model)
            self._state.recovering = None
        log.warning("%s recovered %.1f s after its stub died (attempt %d)", model, elapsed, pending.attempts)

    def _reload(self, model: str) -> None:
        """A new version of ``model`` loaded in the background where another of its instances
        lives to serve meanwhile (:meth:`_load_in_background`), else by unload and load; then a
        load of every model that was ready before and is not now (ensembles). The model's stubs
        from before, dead or alive, are retired first (:meth:`_retire_stubs_of`)."""
        ready_before = {name for name, state in self.repository.model_states().items() if state == READY}
        self._retire_stubs_of(model)
        with self._lock:
            survivors = bool(self._state.pending[model].replaced)
        if not (survivors and self._load_in_background(model)):
            self.repository.unload(model)
            self.repository.wait_not_ready(model)
            self._load(model)
        states = self.repository.model_states()
        for name in sorted(ready_before - {model}):
            if states.get(name) != READY:
                log.warning("loading %s again (it composes %s)", name, model)
                self._load(name)

    def _load(self, model: str) -> None:
        """``load`` of ``model``, its new stubs ended should it still run after ``load_stall_s``
        (:meth:`_end_stalled_load`): the load then fails (RepositoryError) instead of waiting."""
        finished = threading.Event()
        timer = threading.Timer(self.load_stall_s, self._end_stalled_load, (model, finished))
        timer.daemon = True
        timer.start()
        try:
            self.repository.load(model)
        finally:
            finished.set()
            timer.cancel()

    def _end_stalled_load(self, model: str, finished: threading.Event) -> None:
        """The load of ``model`` has run ``load_stall_s``: the live stubs it started (not retired)
        write their Python stacks to the server's log, then are ended unless the load ``finished``
        meanwhile, so that the Python backend stops waiting for their ``initialize``. They are not
        marked handled: one ended as its load completed after all is a death the next scan sees."""
        with self._lock:
            self._state.stalled_loads[model] += 1
        stalled = self._new_stubs_of(model)
        names = ", ".join(f"{stub.instance} (pid {stub.pid})" for stub in stalled) or "none"
        log.error(
            "the load of %s has not completed in %g s; the stubs it started (%s) write their Python "
            "stacks to the server's log and are ended, so that it fails and is tried again",
            model,
            self.load_stall_s,
            names,
        )
        for stub in stalled:
            signal_process(stub.pid, signal.SIGUSR1)
        if finished.wait(STACKS_WRITTEN_S):
            log.warning("the load of %s completed after all: its stubs are left running", model)
            return
        for stub in stalled:
            end_process(stub.pid)

    def _retire_stubs_of(self, model: str) -> None:
        """Before a reload: ``model``'s stubs now belong to the version being replaced, and none is
        watched from here on. Its live instances' stubs exit when that version is unloaded, which
        is not a death (taken for one, it would set off a second reload)."""
        retired = [stub for stub in stub_processes(self.process.pid) if stub.model == model]
        with self._lock:
            for identity, stub in list(self._state.known.items()):
                if stub.model == model:
                    del self._state.known[identity]
            self._state.handled |= {stub.identity for stub in retired}
            self._state.pending[model].replaced.update({stub.identity: stub for stub in retired if not stub.zombie})

    def _load_in_background(self, model: str) -> bool:
        """Mark ``model``'s version folders changed and load it: True when the load started new
        stubs (the old version served until they were ready); False, logged, where the folders
        cannot be marked or tritonserver kept the old instances."""
        if self.model_repository is None:
            return False
        try:
            mark_changed(version_folders(self.model_repository / model))
        except OSError as exc:
            log.warning("cannot mark %s's version folders changed (%s): reloading it by unload and load", model, exc)
            return False
        self._load(model)
        if self._new_stubs_of(model):
            return True
        log.warning("the load of %s started no new stub (its version folders' change not seen): unload and load", model)
        return False

    def _new_stubs_of(self, model: str) -> list[StubProcess]:
        """``model``'s live stubs that no reload has retired: those its load in progress started."""
        with self._lock:
            retired = set(self._state.handled)
        return [
            stub
            for stub in stub_processes(self.process.pid)
            if stub.model == model and not stub.zombie and stub.identity not in retired
        ]

    def _end_idle_replaced(self, stubs: list[StubProcess]) -> None:
        """End each stub of a replaced version still running ``replaced_idle_s`` after its CPU time
        last grew (its version never unloads, see the module's docstring); forget those that ended."""
        now = time.monotonic()
        current = {stub.identity: stub for stub in stubs}
        idle: list[StubProcess] = []
        with self._lock:
            for identity, replaced in list(self._state.replaced.items()):
                stub = current.get(identity)
                if stub is None or stub.zombie:  # its version unloaded after all
                    del self._state.replaced[identity]
                elif stub.cpu_ticks - replaced.cpu_ticks > IDLE_TICKS_PER_SCAN:
                    replaced.cpu_ticks, replaced.busy_at = stub.cpu_ticks, now
                else:
                    replaced.cpu_ticks = stub.cpu_ticks
                    if now - replaced.busy_at >= self.replaced_idle_s:
                        del self._state.replaced[identity]
                        self._state.replaced_ended[stub.model] += 1
                        idle.append(stub)
        for stub in idle:
            log.warning(
                "ending %s (pid %d) of a replaced version of %s: idle for %g s after the recovery, and "
                "that version never unloads (a request reached its dead stub)",
                stub.instance,
                stub.pid,
                stub.model,
                self.replaced_idle_s,
            )
            end_process(stub.pid)
