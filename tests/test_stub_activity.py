"""The stub watchdog's rule, stuck or waiting (kimi_vision_server.watch.stub_activity), and what ``/proc``
tells of real processes held the ways the kernel holds a stub: stopped (SIGSTOP), frozen in a
cgroup (v2 and v1), throttled by a CPU quota (tests/cgroup_holds.py).

tests/test_stuck_stubs.py drives the watchdog through scripted scans of these states, and
tests/test_faults.py freezes a real tritonserver's stub.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cgroup_holds
import pytest

from kimi_vision_server.watch import stub_activity
from kimi_vision_server.watch.stub_activity import Activity

# Threads that are not put on a CPU and will not be by themselves (stub_activity's rule).
STOPPED_OR_DEADLOCKED = {
    "stopped by SIGSTOP (T)": "TTT",
    "held by a debugger (t)": "ttt",
    "deadlocked, every thread asleep past its health beat (S)": "SSS",
}
# Threads that are not put on a CPU but wait for the kernel to let them run: (states, cgroup frozen).
WAITING = {
    "one in uninterruptible sleep, reclaim or I/O (D)": ("SDS", False),
    "one runnable, its CPU quota spent (R)": ("SRS", False),
    "in a frozen cgroup v2 (S)": ("SSS", True),
    "in a cgroup v1 freezer (D)": ("DDD", False),
}


@pytest.mark.parametrize(("states", "frozen"), WAITING.values(), ids=list(WAITING))
def test_a_wait_is_explained_and_a_stop_or_deadlock_is_not(states: str, frozen: bool) -> None:
    assert stub_activity.waiting_reason(Activity(7, states, frozen)) is not None
    for stopped in STOPPED_OR_DEADLOCKED.values():
        assert stub_activity.waiting_reason(Activity(7, stopped)) is None


def test_only_time_nothing_explains_counts_toward_stuck() -> None:
    """A scan's reading judges the time since the scan before: a wait adds to ``waited_s``, a stop
    to ``stalled_s``, and a stub that ran again starts anew."""
    stopped, waiting, ran = Activity(10, "TT"), Activity(10, "SD"), Activity(13, "SS")
    progress = stub_activity.progress_after(None, stopped, now=100.0)
    assert progress == stub_activity.Progress(10, seen_at=100.0)
    progress = stub_activity.progress_after(progress, waiting, now=105.0)
    assert (progress.stalled_s, progress.waited_s) == (0.0, 5.0)
    progress = stub_activity.progress_after(progress, stopped, now=106.5)
    assert (progress.stalled_s, progress.waited_s, progress.not_running_s) == (1.5, 5.0, 6.5)
    assert stub_activity.progress_after(progress, ran, now=107.0) == stub_activity.Progress(13, seen_at=107.0)


STUCK_AFTER_S = 2.0


@pytest.mark.parametrize(("states", "frozen"), WAITING.values(), ids=list(WAITING))
def test_a_waiting_stub_is_stuck_only_once_the_backend_failed_a_request_of_its_model(states: str, frozen: bool) -> None:
    waiting = Activity(10, states, frozen)
    progress = stub_activity.Progress(10, seen_at=0.0, waited_s=STUCK_AFTER_S, backend_failures_before=4)
    assert stub_activity.stuck_reason(progress, waiting, 4, STUCK_AFTER_S) is None
    assert stub_activity.stuck_reason(progress, waiting, None, STUCK_AFTER_S) is None  # not known
    why = stub_activity.stuck_reason(progress, waiting, 5, STUCK_AFTER_S)
    assert why is not None and "failed a request of its model" in why
    early = dataclasses.replace(progress, waited_s=STUCK_AFTER_S / 2)
    assert stub_activity.stuck_reason(early, waiting, 5, STUCK_AFTER_S) is None


@pytest.mark.parametrize("states", STOPPED_OR_DEADLOCKED.values(), ids=list(STOPPED_OR_DEADLOCKED))
def test_a_stub_stopped_or_deadlocked_for_stuck_after_s_is_stuck_whatever_its_model_did(states: str) -> None:
    progress = stub_activity.Progress(10, seen_at=0.0, stalled_s=STUCK_AFTER_S)
    why = stub_activity.stuck_reason(progress, Activity(10, states), None, STUCK_AFTER_S)
    assert why is not None and f"in state {''.join(sorted(set(states)))}" in why
    early = dataclasses.replace(progress, stalled_s=STUCK_AFTER_S / 2)
    assert stub_activity.stuck_reason(early, Activity(10, states), 9, STUCK_AFTER_S) is None


# -- what /proc tells of real processes ----------------------------------------------------------

SLEEPER = "import time\nwhile True: time.sleep(0.01)"  # put on a CPU every 10 ms
SPINNER = "import threading, time\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\n" + SLEEPER


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def ran_again(pid: int) -> Activity:
    """The activity of ``pid`` once its count has grown since now (it runs every 10 ms)."""
    first = stub_activity.read_activity(pid)
    assert first is not None
    while (now := stub_activity.read_activity(pid)) is not None and now.scheduled == first.scheduled:
        time.sleep(0.01)
    assert now is not None
    return now


def test_read_activity_counts_a_live_process_and_freezes_for_a_stopped_one(sleeper) -> None:
    ran_again(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGSTOP)
    while set(activity_of(sleeper.pid).states) != {"T"}:
        time.sleep(0.01)
    stopped = activity_of(sleeper.pid)
    time.sleep(0.1)
    assert activity_of(sleeper.pid) == stopped
    assert stub_activity.waiting_reason(stopped) is None and not stopped.frozen
    os.kill(sleeper.pid, signal.SIGCONT)
    ran_again(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    assert stub_activity.read_activity(sleeper.pid) is None


def activity_of(pid: int) -> Activity:
    activity = stub_activity.read_activity(pid)
    assert activity is not None
    return activity


@pytest.mark.parametrize(("way", "state"), [("cgroup v2 freeze", "S"), ("cgroup v1 freezer", "D")])
def test_a_process_in_a_frozen_cgroup_reads_as_waiting(sleeper, way: str, state: str) -> None:
    """A real freeze (tests/cgroup_holds.py): the count stops, every thread reads ``state``, and the
    rule explains it; thawed, the process runs again."""
    ran_again(sleeper.pid)
    with cgroup_holds.hold(sleeper.pid, way):
        frozen = activity_of(sleeper.pid)
        time.sleep(0.1)
        assert activity_of(sleeper.pid).scheduled == frozen.scheduled
        assert set(frozen.states) == {state} and frozen.frozen == (way == "cgroup v2 freeze")
        assert stub_activity.waiting_reason(frozen) is not None
    ran_again(sleeper.pid)


def test_a_throttled_process_reads_as_waiting_for_a_cpu() -> None:
    """A process spinning a thread under a 1 ms a second CPU quota (tests/cgroup_holds.py): once the
    kernel has throttled it, a reading in which no thread was put on a CPU for 0.1 s (its other
    thread wakes every 10 ms) shows a runnable thread (R), which the rule explains."""
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER])
    try:
        ran_again(spinner.pid)
        with cgroup_holds.hold(spinner.pid, "cpu quota") as cgroup:
            started = time.monotonic()
            while throttled_periods(cgroup) == 0:
                assert time.monotonic() - started < cgroup_holds.HANG_GUARD_S, "never throttled"
                time.sleep(0.01)
            last = activity_of(spinner.pid)
            while True:
                time.sleep(0.1)
                now = activity_of(spinner.pid)
                if now.scheduled == last.scheduled:
                    break
                assert time.monotonic() - started < cgroup_holds.HANG_GUARD_S, "never a reading without a run"
                last = now
        assert "R" in now.states and stub_activity.waiting_reason(now) is not None
    finally:
        spinner.kill()
        spinner.wait()


def throttled_periods(cgroup: Path) -> int:
    """How many periods the kernel has throttled ``cgroup`` (``nr_throttled`` in its ``cpu.stat``)."""
    return int(dict(line.split() for line in (cgroup / "cpu.stat").read_text().splitlines())["nr_throttled"])


def test_the_cgroup_v2_hierarchy_and_a_process_path_in_it_are_read_from_proc() -> None:
    hybrid = "35 25 0:30 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n"
    v1 = "36 25 0:31 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    assert stub_activity.cgroup2_mount_in(v1 + hybrid) == Path("/sys/fs/cgroup/unified")
    assert stub_activity.cgroup2_mount_in(v1) is None
    assert stub_activity.cgroup2_path("6:freezer:/a\n0::/kubepods/pod1/c2\n") == "/kubepods/pod1/c2"
    assert stub_activity.cgroup2_path("6:freezer:/a\n") is None
