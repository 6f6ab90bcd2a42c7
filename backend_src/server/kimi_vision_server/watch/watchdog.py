"""Notice dead and stuck Python-backend stubs and have their models reloaded; the health behind ``/readyz``.

tritonserver 2.51 does not restart a Python backend stub that died (segfault, OOM kill,
``kill -9``) or stopped running: the model stays ``READY`` in every health endpoint while each
request to it fails with ``Stub process '<instance>' is not healthy``. :class:`StubWatchdog` runs
in the launcher process, next to the tritonserver it started:

- every ``interval_s`` it lists the server's ``triton_python_backend_stub`` children
  (:mod:`.stub_scan`: their argv carries the model file and the instance name, e.g.
  ``kimi_k25_decode_0_0``). A stub that became a zombie (the server does not reap it) or vanished
  while its model is still ``READY`` is dead; stubs of a model the repository reports as not
  ``READY`` are being (un)loaded on purpose and are left alone;
- a stub that has not run for ``stuck_after_s`` (none of its threads put on a CPU) is stuck where
  nothing explains it (no thread waiting for a CPU or on the kernel, its cgroup not frozen: it is
  stopped or deadlocked), or where it waited but the Python backend failed a request of its model
  meanwhile (it gave up on a stub that did not answer, and a stub that resumes after that crashes;
  read from the metrics port, :mod:`.triton_repository`: errors a model instance answered and
  Triton's queue timeouts do not count); the rule is :mod:`.stub_activity`'s. The Python
  backend's health check already calls a stuck stub "not healthy" (its health thread beats every
  300 ms, in C++, whatever the model's Python code is doing), so every request it takes fails.
  The watchdog ends it (SIGKILL) and has its model reloaded as for a dead one. A stub that is
  slow but working (a long decode, a long video) keeps its health thread running and is never
  taken for stuck; one that only waits (CPU-throttled, in uninterruptible sleep under memory
  pressure, in a frozen cgroup) while the backend fails no request of its model is left to run
  again, and logged once it has waited ``stuck_after_s``;
- a model with a dead or stuck stub is reloaded by its :class:`~.recovery.ModelRecovery` (one
  reload at a time, with backoff; a new version in the background where another instance serves
  meanwhile), which also ends the stubs a replaced version leaves running;
- a tritonserver that exits by itself after it started serving (the Python backend aborts it
  when it finds a lock a dead stub held, docs/faults.md) is started again with the same command
  line (``restart``, from the launcher: it ends the stubs and removes the shared memory the old
  one left first), at once, or after the backoff where the last one also exited within
  :data:`SERVER_QUICK_EXIT_S` of its start; one that exits cleanly (code 0), or with an error
  code before it answered ``/v2/health/live`` (a start-up failure), is not;
- ``kimi_prep_stub_deaths_total{model}``, ``kimi_prep_stuck_stubs_total{model}``, ``kimi_prep_recoveries_total{model}``,
  ``kimi_prep_replaced_stubs_ended_total{model}``, ``kimi_prep_stalled_loads_total{model}`` and
  ``kimi_prep_server_restarts_total`` count deaths, stuck stubs ended, completed recoveries, the
  replaced stubs ended, the loads ended for stalling and the servers started again;
  :meth:`StubWatchdog.readiness` is false while a stub is known dead or its recovery is in progress.

Process scanning is used instead of canary requests: it sees every crash within one interval,
costs nothing per request and never mistakes a slow or overloaded model for a dead one.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

# stub_scan's and stub_activity's readings and signals are called through their modules, as the
# recovery calls them: the scripted server of tests/scripted_triton.py replaces them in one place.
from . import stub_activity, stub_scan
from .recovery import ModelRecovery, RecoveryTimes
from .stub_activity import Progress, progress_after, stuck_reason, waiting_reason
from .stub_scan import StubProcess, death_cause, describe_exit
from .triton_repository import READY, UNLOADED, RepositoryError, TritonRepository
from .watchdog_state import PendingRecovery, WatchdogState

log = logging.getLogger("kimi_vision_server.watchdog")  # fixed: log lines and logging configs key on it

# A tritonserver that exits this soon after its start, and the last one did too, is started again
# after a backoff (the watchdog's initial_backoff_s, doubling up to max_backoff_s), not at once.
SERVER_QUICK_EXIT_S = 60.0


def watchdog_thread_name(server_pid: int) -> str:
    """The name of the thread watching tritonserver ``server_pid`` (its stacks are looked up by it)."""
    return f"kimi-prep-stub-watchdog-{server_pid}"


class StubWatchdog:
    """Thread watching the stubs of ``process`` (a running tritonserver, its HTTP and metrics ports at
    ``http_url`` and ``metrics_url``, ``host:port``); its :attr:`recovery` reloads their models."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        http_url: str,
        metrics_url: str,
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
        self.repository = TritonRepository(http_url, metrics_url, headers=headers)
        self.interval_s = interval_s
        self.stuck_after_s = stuck_after_s
        self.times = RecoveryTimes(initial_backoff_s, max_backoff_s, replaced_idle_s, load_stall_s)
        self.restart = restart
        self._state = WatchdogState()
        self._said_no_failures = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=watchdog_thread_name(process.pid), daemon=True)
        self.recovery = ModelRecovery(
            self.repository,
            self._state,
            self._lock,
            lambda: self.process.pid,
            model_repository=model_repository,
            times=self.times,
        )

    @property
    def replaced_idle_s(self) -> float:
        return self.times.replaced_idle_s

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
            backoff = min(self.times.max_backoff_s, self.times.initial_backoff_s * 2 ** (repeats - 1))
            delay = backoff if repeats > 0 else 0
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
            return not self._stopped.wait(self.times.initial_backoff_s)
        with self._lock:
            self.process = process
            self._state.new_server()
            self._state.server_restarts += 1
        self._thread.name = watchdog_thread_name(process.pid)
        return True

    def poll_once(self) -> None:
        """One round: scan the stubs, record deaths, end stuck stubs and replaced ones that are
        idle, run the reloads that are due."""
        stubs = stub_scan.stub_processes(self.process.pid)
        self._record_deaths(stubs)
        self._end_stuck(stubs)
        self.recovery.end_idle_replaced(stubs)
        self.recovery.run_due(self._stopped)

    def _dead_stubs(self, stubs: list[StubProcess]) -> list[StubProcess]:
        """Stubs that died since the last round (zombies, or known live ones gone); learns new live ones."""
        seen = {stub.identity for stub in stubs}
        with self._lock:
            self._state.handled &= seen  # a stub gone for good needs no remembering
            self._state.learn(stubs)
            zombies = [stub for stub in stubs if stub.zombie and stub.identity not in self._state.handled]
            vanished = [stub for identity, stub in self._state.known.items() if identity not in seen]
        return zombies + vanished

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

    def _stuck_stubs(self, stubs: list[StubProcess]) -> list[tuple[StubProcess, Progress, str]]:
        """Watched stubs that are stuck (:func:`~.stub_activity.stuck_reason`), with what the scans
        saw of them and why; those of a model already being reloaded are left to the reload. A stub
        that has waited ``stuck_after_s`` and is not stuck is logged, once a wait."""
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
            activity = stub_activity.read_activity(stub.pid)
            if activity is None:
                continue
            with self._lock:
                last = self._state.progress.get(stub.identity)
            progress = progress_after(last, activity, now)
            if progress.not_running_s > 0 and progress.backend_failures_before is None:
                progress = replace(progress, backend_failures_before=self._backend_failures(stub.model))
            waited_long = progress.not_running_s >= self.stuck_after_s
            failures_now = self._backend_failures(stub.model) if waited_long else None
            reason = stuck_reason(progress, activity, failures_now, self.stuck_after_s)
            with self._lock:
                self._state.progress[stub.identity] = progress
            if reason is not None:
                stuck.append((stub, progress, reason))
            elif last is not None and last.waited_s < self.stuck_after_s <= progress.waited_s:
                log.warning(
                    "stub of %s is waiting, not stuck: %s (pid %d) has not run for %.1f s, %s, and the Python "
                    "backend failed no request of its model meanwhile; left to run again",
                    stub.model,
                    stub.instance,
                    stub.pid,
                    progress.not_running_s,
                    waiting_reason(activity),
                )
        return stuck

    def _backend_failures(self, model: str) -> int | None:
        """``model``'s backend failures so far; None where tritonserver's metrics do not tell (said
        once: a waiting stub is then never ended for a request the backend failed on it)."""
        try:
            return self.repository.backend_failures(model)
        except RepositoryError as exc:
            if not self._said_no_failures:
                self._said_no_failures = True
                log.warning(
                    "the backend failures of %s are not known (%s): a waiting stub is left to run again even "
                    "where a request failed on it meanwhile (keep tritonserver's metrics on)",
                    model,
                    exc,
                )
            return None

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
        for stub, progress, reason in stuck:
            if states.get(stub.model) != READY:
                continue
            with self._lock:
                self._state.known.pop(stub.identity, None)
                self._state.progress.pop(stub.identity, None)
                self._state.handled.add(stub.identity)
                self._state.stuck[stub.model] += 1
                self._state.pending.setdefault(stub.model, PendingRecovery(detected_at=time.monotonic()))
            log.warning(
                "stub of %s is stuck: %s (pid %d) has not run for %.1f s, %s; the Python backend fails "
                "every request it takes (not healthy): ending it and reloading the model",
                stub.model,
                stub.instance,
                stub.pid,
                progress.not_running_s,
                reason,
            )
            stub_scan.end_process(stub.pid)
