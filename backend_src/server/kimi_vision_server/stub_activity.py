"""Whether a stub that has stopped running is stuck, or only waiting: the stub watchdog's rule.

A live stub runs at least every 300 ms, whatever its Python code is doing: its health thread, in
C++, wakes then to tell the Python backend it is healthy. Each scan reads how often the stub's
threads have been put on a CPU so far (the timeslice counts of ``/proc/<pid>/task/*/schedstat``)
and the state each thread is in (``/proc/<pid>/task/<tid>/stat``). A count that has not grown
since the last scan is explained, and that time not counted against the stub, while

- one of its threads is runnable (``R``): it waits for a CPU, its cgroup's CPU quota spent
  (``cpu.max``, ``cpu.cfs_quota_us``) or the host saturated, and runs once it gets one;
- one of its threads is in uninterruptible sleep (``D``): it waits on the kernel (memory reclaim,
  ``memory.high`` throttling, slow I/O; a cgroup v1 freezer's tasks read ``D`` too);
- its cgroup v2 is frozen (``frozen 1`` in its ``cgroup.events``: ``cgroup.freeze`` on it or on
  one above it, as ``docker pause`` does): it runs once thawed, its threads reading ``S`` meanwhile.

Any other stall counts: every thread stopped (``T``: SIGSTOP, a terminal's stop) or traced
(``t``: a debugger holding it), or every thread asleep (``S``) past the health thread's 300 ms
beat, which only a deadlock does (its health thread blocked on a lock that will not be
released). Such a stub is stopped on purpose or deadlocked: it will not run again by itself, and
the Python backend calls it "not healthy" and fails every request it takes. A stub whose
unexplained stall reaches the watchdog's ``stuck_after_s`` is stuck. A stub deadlocked in its
Python code alone is not: its health thread keeps beating (and the Python backend keeps waiting
for it), so its count keeps growing (docs/faults.md, "Recovery", step 6).

The time between two scans is judged by the second one's reading (a scan every 0.5 s).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

from .stub_scan import PROC, stat_fields

# A thread in one of these states explains its process not being put on a CPU: it will run once
# the kernel lets it.
WAITING_STATES = {"R": "waiting for a CPU", "D": "waiting on the kernel"}


@dataclass(frozen=True)
class Activity:
    """One scan's reading of a stub: ``scheduled``, how often its threads have been put on a CPU so
    far (the sum of their timeslice counts); ``states``, each thread's one-letter state
    (``R``, ``S``, ``D``, ``T``, ``t``...); ``frozen``, whether its cgroup v2 is frozen."""

    scheduled: int
    states: str
    frozen: bool = False


def waiting_reason(activity: Activity) -> str | None:
    """Why a stub whose threads were not put on a CPU since the last scan is only waiting (see the
    module's docstring); None where nothing explains it."""
    if activity.frozen:
        return "its cgroup is frozen"
    for state, reason in WAITING_STATES.items():
        if state in activity.states:
            return f"{reason} (a thread in state {state})"
    return None


@dataclass(frozen=True)
class Progress:
    """What the scans saw of one stub: its :attr:`Activity.scheduled` at the last scan (at
    ``seen_at``, monotonic seconds) and, since that count last grew, for how long nothing explained
    its threads not running (``stalled_s``) and for how long something did (``waited_s``)."""

    scheduled: int
    seen_at: float
    stalled_s: float = 0.0
    waited_s: float = 0.0


def progress_after(last: Progress | None, activity: Activity, now: float) -> Progress:
    """``last`` brought up to a scan at ``now`` that read ``activity``: begun anew where the stub
    ran since (or is seen for the first time), else the time since the last scan added to its
    stall, or to its wait where :func:`waiting_reason` explains it."""
    if last is None or activity.scheduled != last.scheduled:
        return Progress(activity.scheduled, now)
    elapsed = now - last.seen_at
    if waiting_reason(activity) is None:
        return replace(last, seen_at=now, stalled_s=last.stalled_s + elapsed)
    return replace(last, seen_at=now, waited_s=last.waited_s + elapsed)


def read_activity(pid: int) -> Activity | None:
    """``pid``'s :class:`Activity` from ``/proc``; None where the process is gone or the kernel keeps
    no timeslice count (no ``schedstat``). A thread that ends while it is read is left out."""
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return None
    scheduled, states = 0, []
    for task in tasks:
        try:
            count = int((task / "schedstat").read_text().split()[2])
            state = stat_fields(task)[0]
        except FileNotFoundError:  # a thread that ended meanwhile, or no schedstat at all
            continue
        except (OSError, IndexError, ValueError):
            return None
        scheduled += count
        states.append(state)
    return Activity(scheduled, "".join(states), cgroup_frozen(pid)) if states else None


def cgroup_frozen(pid: int) -> bool:
    """Whether ``pid``'s cgroup v2 is frozen, itself or by one above it (``frozen 1`` in its
    ``cgroup.events``); False without a cgroup v2 hierarchy or where nothing tells."""
    mount = cgroup2_mount()
    if mount is None:
        return False
    try:
        path = cgroup2_path((PROC / str(pid) / "cgroup").read_text())
        events = (mount / path.lstrip("/") / "cgroup.events").read_text() if path is not None else ""
    except OSError:  # gone, or the root cgroup (no cgroup.events)
        return False
    return "frozen 1" in events.splitlines()


@functools.cache
def cgroup2_mount() -> Path | None:
    """Where this process sees the cgroup v2 hierarchy mounted (``/sys/fs/cgroup``, or
    ``/sys/fs/cgroup/unified`` on a host that mounts v1 and v2 both); None where it does not."""
    try:
        return cgroup2_mount_in((PROC / "self" / "mountinfo").read_text())
    except OSError:
        return None


def cgroup2_mount_in(mountinfo: str) -> Path | None:
    """The mount point of the first ``cgroup2`` file system in a ``/proc/<pid>/mountinfo``."""
    for line in mountinfo.splitlines():
        mount, _, source = line.partition(" - ")
        if source.split(" ", 1)[0] == "cgroup2":
            return Path(mount.split()[4])
    return None


def cgroup2_path(cgroup: str) -> str | None:
    """A process's cgroup v2 path (the ``0::<path>`` line of ``/proc/<pid>/cgroup``); None without."""
    return next((line[3:] for line in cgroup.splitlines() if line.startswith("0::")), None)
