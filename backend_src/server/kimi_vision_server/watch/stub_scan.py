"""tritonserver's Python-backend stub processes, as ``/proc`` shows them, and the signals sent to them.

Every Python-backend model instance runs in its own ``triton_python_backend_stub`` child of
tritonserver; its argv carries the model file and the instance name (e.g. ``kimi_k25_decode_0_0``).
The stub watchdog (:mod:`.watchdog`) and the launcher list them here; a stub is identified by its
pid and its start time, so that a reused pid is never taken for the same process.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
PROC = Path("/proc")


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


def stat_fields(pid_dir: Path) -> list[str]:
    """Fields of ``/proc/<pid>/stat`` (or ``/proc/<pid>/task/<tid>/stat``) after the command name:
    state is [0], ppid [1], pgrp [2], utime [11], stime [12], starttime [19]."""
    stat = (pid_dir / "stat").read_text()
    return stat.rsplit(")", 1)[1].split()


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None when no such process is visible."""
    try:
        return int(stat_fields(PROC / str(pid))[19])
    except (OSError, IndexError, ValueError):
        return None


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``; None when no such process is visible."""
    try:
        return int(stat_fields(PROC / str(pid))[1])
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
        fields = stat_fields(PROC / str(pid))
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


def stub_processes(server_pid: int) -> list[StubProcess]:
    """The Python-backend stubs whose parent is ``server_pid`` (zombies included)."""
    return _stubs_where(lambda fields: int(fields[1]) == server_pid)


def stubs_in_group(pgid: int) -> list[StubProcess]:
    """The Python-backend stubs in process group ``pgid``, whatever their parent (orphans too)."""
    return _stubs_where(lambda fields: int(fields[2]) == pgid)


def _stubs_where(keep: Callable[[list[str]], bool]) -> list[StubProcess]:
    """The stubs whose ``/proc/<pid>/stat`` fields (:func:`stat_fields`) ``keep`` holds for."""
    stubs = []
    for pid_dir in PROC.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fields = stat_fields(pid_dir)
            if not keep(fields):
                continue
            argv = [a.decode(errors="replace") for a in (pid_dir / "cmdline").read_bytes().split(b"\0")]
        except (OSError, IndexError, ValueError):  # exited while we looked
            continue
        stub = stub_from_argv(int(pid_dir.name), fields, argv)
        if stub is not None:
            stubs.append(stub)
    return stubs


def signal_process(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid``; nothing if it has gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def end_process(pid: int) -> None:
    """SIGKILL ``pid``; nothing if it has gone."""
    signal_process(pid, signal.SIGKILL)
