"""Whether a stub that has stopped running is stuck, or only waiting: the stub watchdog's rule.

A live stub runs at least every 300 ms, whatever its Python code is doing: its health thread, in
C++, wakes then to tell the Python backend it is healthy. Each scan reads how often the stub's
threads have been put on a CPU so far (the timeslice counts of ``/proc/<pid>/task/*/schedstat``)
and the state each thread is in (``/proc/<pid>/task/<tid>/stat``). A count that has not grown
since the last scan is explained, the stub only waiting, while

- one of its threads is runnable (``R``): it waits for a CPU, its cgroup's CPU quota spent
  (``cpu.max``, ``cpu.cfs_quota_us``) or the host saturated, and runs once it gets one;
- one of its threads is in uninterruptible sleep (``D``): it waits on the kernel (memory reclaim,
  ``memory.high`` throttling, slow I/O; a cgroup v1 freezer's tasks read ``D`` too);
- its cgroup v2 is frozen (``frozen 1`` in its ``cgroup.events``: ``cgroup.freeze`` on it or on
  one above it, as ``docker pause`` does): it runs once thawed, its threads reading ``S`` meanwhile.

Any other stall is the stub's own: every thread stopped (``T``: SIGSTOP) or traced (``t``: a
debugger holding it), or every thread asleep (``S``) past the health thread's 300 ms beat, which
only a deadlock does (its health thread blocked on a lock that will not be released). Such a stub
is stopped on purpose or deadlocked and will not run again by itself. A stub deadlocked in its
Python code alone is not seen here: its health thread keeps beating, so its count keeps growing
(and the Python backend keeps waiting for it).

A stub that has not run for the watchdog's ``stuck_after_s`` is **stuck** (:func:`stuck_reason`)
where that time was all its own, or where it waited but the Python backend failed a request of its
model since it stopped running (its backend failures, :mod:`.triton_repository`: a request no
instance answered, never an error a model instance answered, nor Triton's queue timeouts and
cancellations). The Python backend gives a stub 1 s to take or answer a request, then fails it as
"not healthy" and frees what it shared with the stub for it; a stub that runs again after that
reads the freed request and dies (SIGSEGV), and tritonserver aborts at its next request to that
instance (a lock the dead stub held, docs/faults.md). Ended while it still waits, it is replaced
by a reload and the server lives. A stub that waited while no request came, or while its model's
other instances answered every request (refused images too), resumes and serves.

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
    its threads not running (``stalled_s``) and for how long something did (``waited_s``);
    ``backend_failures_before``: its model's backend failures when a scan first found it not
    running (None until read)."""

    scheduled: int
    seen_at: float
    stalled_s: float = 0.0
    waited_s: float = 0.0
    backend_failures_before: int | None = None

    @property
    def not_running_s(self) -> float:
        """How long the stub has not been put on a CPU (as the scans saw it), for whatever reason."""
        return self.stalled_s + self.waited_s


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


def stuck_reason(
    progress: Progress, activity: Activity, backend_failures_now: int | None, stuck_after_s: float
) -> str | None:
    """Why a stub is stuck (the module's docstring), None where it is not: its own stall reached
    ``stuck_after_s``, or it has not run for that long, waiting, and its model's backend failures
    grew from ``progress.backend_failures_before`` to ``backend_failures_now`` meanwhile (None: not
    known)."""
    if progress.stalled_s >= stuck_after_s:
        states = "".join(sorted(set(activity.states)))
        return f"stopped or deadlocked (its threads in state {states}, none waiting for a CPU or on the kernel)"
    before = progress.backend_failures_before
    if progress.not_running_s < stuck_after_s or backend_failures_now is None or before is None:
        return None
    if backend_failures_now > before:
        return (
            f"{waiting_reason(activity)}, but the Python backend failed a request of its model meanwhile "
            "(not healthy): it has given up on it, and a stub resumed after that crashes"
        )
    return None


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
