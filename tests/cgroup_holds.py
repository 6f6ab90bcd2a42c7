"""Hold a real process where it cannot run for a while, the ways a cgroup offers on this host, for
the stub watchdog's tests (it must tell such a wait from a stopped or deadlocked stub):

- ``cgroup v2 freeze``: ``cgroup.freeze`` on a child cgroup of the v2 hierarchy; its threads read
  ``S`` and its ``cgroup.events`` ``frozen 1`` (what ``docker pause`` does on a v2 host);
- ``cgroup v1 freezer``: ``freezer.state`` ``FROZEN`` in the v1 freezer hierarchy; its threads
  read ``D``, as a stub in memory reclaim or slow I/O does;
- ``cpu quota``: 1 ms of CPU a 1 s period (``cpu.cfs_quota_us`` of the v1 cpu controller, its
  longest period), a CPU quota spent: a throttled thread reads ``R``.

Each makes a child cgroup of its hierarchy's root, moves the process in, holds it until the kernel
says it is held, and on the way out releases it, moves it back where it was and removes the child.
Where the host has no such hierarchy, or does not let this process write it (not root, a read-only
``/sys/fs/cgroup``), :func:`hold` skips the test, saying why.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

HANG_GUARD_S = 60.0  # a hold the kernel never reports taken fails the test instead of hanging it


@dataclass(frozen=True)
class Way:
    """One way to hold a process: the hierarchy (``fstype``, and for v1 the controller in its mount
    options), the files written to hold and to release it, and the file and text that say it is held."""

    fstype: str
    controller: str
    hold: tuple[tuple[str, str], ...]
    release: tuple[tuple[str, str], ...]
    held_when: tuple[str, str] | None  # (file, line it holds once the kernel has held every thread)


WAYS = {
    "cgroup v2 freeze": Way(
        "cgroup2", "", (("cgroup.freeze", "1"),), (("cgroup.freeze", "0"),), ("cgroup.events", "frozen 1")
    ),
    "cgroup v1 freezer": Way(
        "cgroup", "freezer", (("freezer.state", "FROZEN"),), (("freezer.state", "THAWED"),), ("freezer.state", "FROZEN")
    ),
    "cpu quota": Way(
        "cgroup",
        "cpu",
        (("cpu.cfs_period_us", "1000000"), ("cpu.cfs_quota_us", "1000")),
        (("cpu.cfs_quota_us", "-1"),),
        None,
    ),
}


def mount_of(way: Way) -> Path | None:
    """Where this process sees the hierarchy of ``way`` mounted; None where it does not."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount, _, source = line.partition(" - ")
        fstype, _, options = [*source.split(" "), "", ""][:3]
        if fstype == way.fstype and (not way.controller or way.controller in options.split(",")):
            return Path(mount.split()[4])
    return None


def cgroup_of(pid: int, way: Way) -> str:
    """``pid``'s cgroup path in the hierarchy of ``way`` (``/proc/<pid>/cgroup``)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (way.fstype == "cgroup2" and controllers == "") or way.controller in controllers.split(","):
            return path
    raise LookupError(f"pid {pid} is in no {way.fstype} {way.controller} cgroup")


@contextlib.contextmanager
def hold(pid: int, name: str) -> Iterator[Path]:
    """``pid`` (all its threads) held the way :data:`WAYS` names, in a child cgroup it yields, until
    the block ends; the test is skipped where this host cannot."""
    way = WAYS[name]
    root = mount_of(way)
    if root is None:
        pytest.skip(f"{name}: no {way.fstype} {way.controller} hierarchy mounted here")
    original = root / cgroup_of(pid, way).lstrip("/")
    child = root / f"kimi-prep-test-hold-{pid}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"{name}: cannot make a cgroup in {root}: {exc}")
    try:
        (child / "cgroup.procs").write_text(str(pid))
        try:
            write(child, way.hold)
            wait_held(child, way)
            yield child
        finally:
            write(child, way.release)
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                (original / "cgroup.procs").write_text(str(pid))
    finally:
        child.rmdir()


def write(cgroup: Path, settings: tuple[tuple[str, str], ...]) -> None:
    for file, value in settings:
        (cgroup / file).write_text(value)


def wait_held(cgroup: Path, way: Way) -> None:
    """Until the kernel says every thread is held (a freeze takes effect thread by thread)."""
    if way.held_when is None:
        return
    file, line = way.held_when
    started = time.monotonic()
    while line not in (cgroup / file).read_text().splitlines():
        if time.monotonic() - started > HANG_GUARD_S:
            pytest.fail(f"{cgroup} not held ({file}: {line}) within {HANG_GUARD_S:g} s")
        time.sleep(0.01)
