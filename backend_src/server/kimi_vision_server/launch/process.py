"""A tritonserver's process life: started in its own process group with a SIGTERM on the
launcher's death (:func:`server_process_setup`), stopped with SIGINT and waited for
(:func:`stop_process`, :func:`wait_stopping`: not on a version a crashed stub pinned), the stubs it
left behind ended (:func:`end_left_in_group`), its exit code as a shell reports it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..watch.stub_scan import StubProcess, end_process, stub_processes, stubs_in_group
from ..watch.watchdog import StubWatchdog

PR_SET_PDEATHSIG = 1  # linux/prctl.h
log = logging.getLogger("kimi_vision_server.launcher")  # fixed: log lines and logging configs key on it


@dataclass
class ServerStop:
    """How a launched server's stop ended, once its launch's stack has closed: the exit code of
    :func:`stop_process` (0 also for a server ended while waiting only on pinned versions)."""

    exit_code: int | None = None

    def stop(self, watchdog: StubWatchdog) -> None:
        """Stop the server ``watchdog`` runs now (it stood down first: nothing starts it again)."""
        process = watchdog.process
        self.exit_code = stop_process(process, pinned=watchdog.pinned_versions)
        end_left_in_group(process.pid)


def end_left_in_group(pgid: int) -> list[StubProcess]:
    """SIGKILL the stubs still in an exited server's process group (its pgid is its pid:
    :func:`server_process_setup`); those stubs. A stub exits once it sees its server gone, unless
    its health thread blocks first: the Python backend's stub stops its queue monitors under a
    lock held by a thread that waits for the dead server to take a log message, and then sleeps
    for good (seen after a server was killed: an orphan holding 150 MiB)."""
    left = [stub for stub in stubs_in_group(pgid) if not stub.zombie]
    for stub in left:
        log.warning("ending %s (pid %d): a stub left running after tritonserver exited", stub.instance, stub.pid)
        end_process(stub.pid)
    return left


def _load_prctl() -> Any:
    """libc's prctl, resolved in the parent (nothing may be loaded between fork and exec)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def server_process_setup() -> None:
    """In the forked child: own process group (a terminal's Ctrl-C reaches tritonserver once, through
    the launcher, not twice) and SIGTERM when the launcher dies (no orphaned servers on a shared host).
    The signal follows the thread that started the server: for a server the watchdog started again,
    the watchdog's thread, which ends only when the server is being stopped anyway."""
    os.setpgrp()
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# A stopping server that has run no stub this long (its requests done, its Python models unloaded)
# is waiting only for what never unloads.
PINNED_ONLY_AFTER_S = 2.0


def wait_stopping(
    process: subprocess.Popen[bytes], timeout_s: float | None, pinned: Callable[[], list[str]] = list
) -> int:
    """Wait for a server that was asked to stop; its exit code, or -9 after SIGKILL at ``timeout_s``
    (None: no limit but tritonserver's own).

    tritonserver stops by waiting for in-flight requests, then unloading every model, up to its
    exit timeout (30 s), and exits with code 1 when a version never unloads. A version pinned by a
    request that reached a crashed stub never does (``pinned()``: its models, from the watchdog;
    docs/faults.md). Once the server has run no stub for :data:`PINNED_ONLY_AFTER_S` (every
    request done, every Python model unloaded), waiting on for those is pointless: it is ended and
    counts as stopped (0)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    stubless_since: float | None = None
    while process.poll() is None:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            process.kill()
            break
        models = pinned()
        if models and not stub_processes(process.pid):
            stubless_since = stubless_since or now
            if now - stubless_since >= PINNED_ONLY_AFTER_S:
                log.info(
                    "tritonserver has stopped serving and would wait its exit timeout for the version of %s "
                    "that a crashed stub pinned (docs/faults.md): ending it",
                    ", ".join(models),
                )
                process.kill()
                process.wait()
                return 0
        else:
            stubless_since = None
        time.sleep(0.25)
    return process.wait()


def stop_process(
    process: subprocess.Popen[bytes], timeout_s: float = 60.0, pinned: Callable[[], list[str]] = list
) -> int:
    """SIGINT (a clean shutdown that unloads the models), then :func:`wait_stopping`; the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        return wait_stopping(process, timeout_s, pinned)
    return process.returncode


def exit_status(code: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a process killed by signal N."""
    return code if code >= 0 else 128 - code
