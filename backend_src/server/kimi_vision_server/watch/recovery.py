"""The stub watchdog's recovery: reload each model whose stub died or was stuck, and end what the
replaced version leaves running.

tritonserver 2.51 does not restart a Python backend stub that died: the model stays ``READY``
while each request to it fails with ``Stub process '<instance>' is not healthy``, and a ``load``
of an unchanged model keeps its instances, the dead one too. A ``load`` after the model's version
folder changed (its mtime, which Triton compares with the one it read at the last load) loads a
new version in the background while the old one serves, then swaps them and the ensembles
composing the model; an ``unload`` then ``load`` also starts fresh stubs, but the model and its
ensembles answer ``NOT_FOUND`` until the load completes. So :class:`ModelRecovery`:

- reloads a model queued by the watchdog, one reload at a time, retried with exponential backoff
  until it succeeds. Where another of its instances lives: its version folders' mtime set to now
  and a ``load``, so that instance goes on serving until the new version is ready (where the
  folders cannot be changed, a read-only repository, or the load started no new stub: logged, and
  as below). Where none does, an ``unload`` and a ``load``: requests then fail at once with
  ``NOT_FOUND``, where in a background load each would wait 1 s at the dead stub, and the model
  heals later (docs/faults.md). Then a load of any model that was ready before and is not now.
  Every stub of the old version is retired when the reload begins: the stubs of its live
  instances (a model with several) end as it unloads, and that is not a death;
- ends the stubs of a replaced version once idle. That version does not always unload: each
  request the Python backend hands to a stub gets a response factory
  (``TRITONBACKEND_ResponseFactoryNew`` in ``python_be.cc``), which keeps its model loaded while
  it lives, and when the stub is dead ``ProcessRequests`` returns on the failed receive before
  deleting it. So once a request reached the dead stub the old version stays ``UNLOADING`` for
  good, and its live instances' stubs would run until the server stops. After a recovery, each
  such stub is ended once it has been idle for ``replaced_idle_s`` (no more than a clock tick of
  CPU a scan: it finishes the requests it had first, and no new one reaches a version being
  unloaded);
- bounds each load: the Python backend waits for a new stub's ``initialize`` for as long as the
  stub's health thread beats, so a stub stuck there would hold the load, and the watchdog, for
  good. A load still running ``load_stall_s`` after it began has the stubs it started write their
  Python stacks to the server's log (SIGUSR1, :func:`~.contract.triton_python_model`) and ends
  them: the load fails, and is tried again after the backoff.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import stub_scan
from .triton_repository import READY, RepositoryError, TritonRepository, mark_changed, version_folders
from .watchdog_state import ReplacedStub, WatchdogState

log = logging.getLogger("kimi_vision_server.recovery")  # fixed: log lines and logging configs key on it

# CPU a replaced stub may use in one scan and still count as idle: its health thread wakes every
# 300 ms, and a clock tick (10 ms) is charged now and then to whatever runs when it fires.
IDLE_TICKS_PER_SCAN = 1
# Time a stub ending for a stalled load is given to write its Python stacks (faulthandler, SIGUSR1).
STACKS_WRITTEN_S = 1.0


@dataclass(frozen=True)
class RecoveryTimes:
    """The recovery's timings, in seconds: the reload backoff (``initial_backoff_s`` doubling up to
    ``max_backoff_s``), how long a replaced stub idles before it is ended, and how long a load may
    run before its new stubs are ended (module docstring); the defaults are
    :class:`~.watchdog.StubWatchdog`'s."""

    initial_backoff_s: float
    max_backoff_s: float
    replaced_idle_s: float
    load_stall_s: float


class ModelRecovery:
    """Reloads the models the watchdog queued in ``state.pending`` (module docstring), from the
    watchdog's thread and under its ``lock``; ``server_pid`` gives the running tritonserver's pid
    (the watchdog starts a new one after a crash)."""

    def __init__(
        self,
        repository: TritonRepository,
        state: WatchdogState,
        lock: threading.Lock,
        server_pid: Callable[[], int],
        *,
        model_repository: Path | None,
        times: RecoveryTimes,
    ) -> None:
        self.repository = repository
        self.model_repository = model_repository
        self.times = times
        self._state = state
        self._lock = lock
        self._server_pid = server_pid

    def _stubs(self) -> list[stub_scan.StubProcess]:
        return stub_scan.stub_processes(self._server_pid())

    def run_due(self, stopped: threading.Event) -> None:
        """The reloads whose time has come, one after the other, until ``stopped``."""
        now = time.monotonic()
        with self._lock:
            due = [model for model, pending in self._state.pending.items() if pending.next_attempt_at <= now]
        for model in due:
            if stopped.is_set():
                return
            self._attempt(model)

    def _attempt(self, model: str) -> None:
        with self._lock:
            pending = self._state.pending[model]
            pending.attempts += 1
            self._state.recovering = model
        try:
            self._reload(model)
        except RepositoryError as exc:
            backoff = min(self.times.max_backoff_s, self.times.initial_backoff_s * 2 ** (pending.attempts - 1))
            log.error("reload %d of %s failed: %s; next try in %.1f s", pending.attempts, model, exc, backoff)
            with self._lock:
                pending.next_attempt_at = time.monotonic() + backoff
                self._state.recovering = None
            return
        elapsed = time.monotonic() - pending.detected_at
        # The new version's stubs are watched before readiness says ready: one killed before the
        # next scan and reaped by then would otherwise never be seen, its model left half-served.
        stubs = self._stubs()
        now = time.monotonic()
        with self._lock:
            self._state.learn(stubs)
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
        timer = threading.Timer(self.times.load_stall_s, self._end_stalled_load, (model, finished))
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
            self.times.load_stall_s,
            names,
        )
        for stub in stalled:
            stub_scan.signal_process(stub.pid, signal.SIGUSR1)
        if finished.wait(STACKS_WRITTEN_S):
            log.warning("the load of %s completed after all: its stubs are left running", model)
            return
        for stub in stalled:
            stub_scan.end_process(stub.pid)

    def _retire_stubs_of(self, model: str) -> None:
        """Before a reload: ``model``'s stubs now belong to the version being replaced, and none is
        watched from here on. Its live instances' stubs exit when that version is unloaded, which
        is not a death (taken for one, it would set off a second reload)."""
        retired = [stub for stub in self._stubs() if stub.model == model]
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

    def _new_stubs_of(self, model: str) -> list[stub_scan.StubProcess]:
        """``model``'s live stubs that no reload has retired: those its load in progress started."""
        with self._lock:
            retired = set(self._state.handled)
        return [
            stub for stub in self._stubs() if stub.model == model and not stub.zombie and stub.identity not in retired
        ]

    def end_idle_replaced(self, stubs: list[stub_scan.StubProcess]) -> None:
        """End each stub of a replaced version still running ``replaced_idle_s`` after its CPU time
        last grew (its version never unloads, see the module's docstring); forget those that ended."""
        now = time.monotonic()
        current = {stub.identity: stub for stub in stubs}
        idle: list[stub_scan.StubProcess] = []
        with self._lock:
            for identity, replaced in list(self._state.replaced.items()):
                stub = current.get(identity)
                if stub is None or stub.zombie:  # its version unloaded after all
                    del self._state.replaced[identity]
                elif stub.cpu_ticks - replaced.cpu_ticks > IDLE_TICKS_PER_SCAN:
                    replaced.cpu_ticks, replaced.busy_at = stub.cpu_ticks, now
                else:
                    replaced.cpu_ticks = stub.cpu_ticks
                    if now - replaced.busy_at >= self.times.replaced_idle_s:
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
                self.times.replaced_idle_s,
            )
            stub_scan.end_process(stub.pid)
