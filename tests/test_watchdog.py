"""The stub watchdog's bookkeeping, one scan at a time: which stub exits are deaths, and how their
models are reloaded.

tests/test_faults.py kills real stubs of a real tritonserver; whether the replaced version's
surviving stub ends before or after the watchdog's next scan is up to tritonserver's timing there.
Here the scans and tritonserver's answers are scripted (tests/scripted_triton.py), so each order is
taken for certain.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from scripted_triton import (
    MODEL,
    REPLACED_IDLE_S,
    ScriptedServer,
    counts,
    repository_of,
    scripted_pair,
    watched,
)

from kimi_vision_server.watch import recovery, triton_repository
from kimi_vision_server.watch.triton_repository import RepositoryError
from kimi_vision_server.watch.watchdog import StubWatchdog


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> tuple[ScriptedServer, StubWatchdog]:
    return scripted_pair(monkeypatch)


def ended(guard: StubWatchdog) -> int:
    return guard.counters()["replaced_stubs_ended"].get(MODEL, 0)


def kill_the_first_stub(server: ScriptedServer, guard: StubWatchdog) -> tuple[int, int]:
    """Both stubs learned, the first killed, a scan: its death and its model's reload (two new
    stubs, unless the reload fails). Returns (the killed stub's pid, the survivor's)."""
    first, survivor = sorted(server.stubs)
    guard.poll_once()
    server.kill(first)
    guard.poll_once()
    return first, survivor


def test_the_replaced_versions_surviving_stub_ending_after_a_scan_is_no_death(scripted) -> None:
    server, guard = scripted
    _, survivor = kill_the_first_stub(server, guard)
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}
    guard.poll_once()  # the old version still unloading: its survivor still runs
    server.end(survivor)  # it unloads
    guard.poll_once()
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}
    assert server.loads == [MODEL]
    assert guard.readiness()[1] != f"recovering from a dead stub: {MODEL}"


def test_a_stub_of_the_reloaded_version_killed_next_is_recovered(scripted) -> None:
    server, guard = scripted
    first, survivor = kill_the_first_stub(server, guard)
    new_first = min(pid for pid, stub in server.stubs.items() if pid not in (first, survivor))
    guard.poll_once()
    server.end(survivor)
    server.kill(new_first)
    guard.poll_once()
    assert counts(guard) == {"stub_deaths": 2, "recoveries": 2}
    assert server.loads == [MODEL, MODEL]


def test_a_new_stub_killed_and_reaped_before_the_next_scan_is_a_death(scripted) -> None:
    server, guard = scripted
    first, survivor = kill_the_first_stub(server, guard)
    new_first = min(pid for pid in server.stubs if pid not in (first, survivor))
    server.end(new_first)  # killed and reaped before that scan
    guard.poll_once()
    assert counts(guard) == {"stub_deaths": 2, "recoveries": 2}


def test_a_replaced_versions_stub_that_never_ends_is_ended_once_idle(scripted) -> None:
    """A request reached the dead stub: the old version never unloads and its survivor would run
    on. It finishes what it had (its CPU time grows), then, idle for ``replaced_idle_s``, it is
    ended; that is neither a death nor a reload, and the new version's stubs are left alone."""
    server, guard = scripted
    first, survivor = kill_the_first_stub(server, guard)
    new = sorted(pid for pid in server.stubs if pid not in (first, survivor))
    for _ in range(3):  # still busy with the requests it had: not ended however long
        server.work(survivor, ticks=20)
        time.sleep(REPLACED_IDLE_S)
        guard.poll_once()
        assert not server.stubs[survivor].zombie
    server.work(survivor, ticks=1)  # its health thread: idle
    guard.poll_once()
    time.sleep(REPLACED_IDLE_S)
    guard.poll_once()
    assert server.stubs[survivor].zombie, "the idle survivor of the replaced version was ended"
    assert ended(guard) == 1
    guard.poll_once()
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}
    assert server.loads == [MODEL]
    assert not any(server.stubs[pid].zombie for pid in new)


def test_a_replaced_versions_stub_that_ends_by_itself_is_not_ended_again(scripted) -> None:
    server, guard = scripted
    _, survivor = kill_the_first_stub(server, guard)
    server.end(survivor)  # its version unloaded
    guard.poll_once()
    time.sleep(REPLACED_IDLE_S)
    guard.poll_once()
    assert ended(guard) == 0
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_a_stub_retired_by_a_failed_reload_is_left_alone(scripted, monkeypatch) -> None:
    """The unload was refused: the old version still serves, and its stubs are not ended while the
    recovery has not completed."""
    server, guard = scripted

    def refused(model: str) -> None:
        raise RepositoryError("POST unload: HTTP 503")

    monkeypatch.setattr(server, "unload", refused)
    _, survivor = kill_the_first_stub(server, guard)  # the death; its reload fails
    time.sleep(REPLACED_IDLE_S)
    guard.poll_once()
    assert not server.stubs[survivor].zombie
    assert ended(guard) == 0
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 0}


@pytest.fixture
def with_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ScriptedServer, StubWatchdog]:
    server = ScriptedServer(instances=2, repository=repository_of(tmp_path))
    return server, watched(server, monkeypatch)


def new_stubs(server: ScriptedServer, old: tuple[int, int]) -> list[int]:
    return [pid for pid, stub in server.stubs.items() if pid not in old and not stub.zombie]


def test_a_model_whose_version_folder_can_be_marked_is_reloaded_without_an_unload(with_repository) -> None:
    """Another instance lives: the version folder marked changed, one load starts a new version
    while the old one serves, no unload (during which the model and its ensembles would answer
    NOT_FOUND)."""
    server, guard = with_repository
    old = kill_the_first_stub(server, guard)
    assert server.unloads == [] and server.loads == [MODEL]
    assert len(new_stubs(server, old)) == 2
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_a_read_only_repository_is_reloaded_by_unload_and_load(with_repository, monkeypatch) -> None:
    server, guard = with_repository

    def read_only(folders: list[Path]) -> None:
        raise PermissionError(30, "Read-only file system", str(folders[0]))

    monkeypatch.setattr(recovery, "mark_changed", read_only)
    old = kill_the_first_stub(server, guard)
    assert server.unloads == [MODEL] and server.loads == [MODEL]
    assert len(new_stubs(server, old)) == 2
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_a_load_that_keeps_the_dead_instance_is_followed_by_unload_and_load(with_repository, monkeypatch) -> None:
    """Where tritonserver does not see the folders' change (its load keeps the instances, the dead
    one too), the recovery does not stop there."""
    server, guard = with_repository
    monkeypatch.setattr(recovery, "mark_changed", lambda folders: None)
    old = kill_the_first_stub(server, guard)
    assert server.unloads == [MODEL] and server.loads == [MODEL, MODEL]
    assert len(new_stubs(server, old)) == 2
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_marking_a_folder_changed_moves_its_mtime_past_the_last_one(tmp_path: Path) -> None:
    folder = tmp_path / "1"
    folder.mkdir()
    future = time.time_ns() + 3_600 * 10**9
    os.utime(folder, ns=(future, future))  # a clock that went back since, or a coarse one
    triton_repository.mark_changed([folder])
    assert folder.stat().st_mtime_ns > future
    assert triton_repository.version_folders(tmp_path) == [folder]


# tritonserver 2.51's metrics text as its metrics port serves it (one sample per model, version and
# reason), with a second version of the model and a model whose name begins with the model's.
TRITON_METRICS = f"""# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{{model="{MODEL}",version="1"}} 40
# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{{model="{MODEL}",reason="OTHER",version="1"}} 1
nv_inference_request_failure{{model="{MODEL}",reason="BACKEND",version="1"}} 2
nv_inference_request_failure{{model="{MODEL}",reason="CANCELED",version="1"}} 22
nv_inference_request_failure{{model="{MODEL}",reason="REJECTED",version="1"}} 23
nv_inference_request_failure{{model="{MODEL}",reason="BACKEND",version="2"}} 3
nv_inference_request_failure{{model="{MODEL}_u8",reason="BACKEND",version="1"}} 7
# HELP kimi_prep_errors_total Failed requests, by error reason
# TYPE kimi_prep_errors_total counter
kimi_prep_errors_total{{instance="{MODEL}_0_0",model="{MODEL}",reason="invalid_image"}} 5
"""


def test_backend_failures_are_the_backend_reasons_samples_of_the_model_over_its_versions() -> None:
    """Neither Triton's queue timeouts (REJECTED), cancelled clients (CANCELED), its checks before
    execution (OTHER), another model, nor the errors a model answered (kimi_prep_errors_total)."""
    assert triton_repository.backend_failures_in(TRITON_METRICS, MODEL) == 2 + 3
    assert triton_repository.backend_failures_in(TRITON_METRICS, f"{MODEL}_u8") == 7
    assert triton_repository.backend_failures_in(TRITON_METRICS, "kimi_k3_decode") is None  # not loaded
    assert triton_repository.backend_failures_in("", MODEL) is None  # metrics off


def test_a_model_with_no_other_live_instance_is_reloaded_by_unload_and_load(tmp_path: Path, monkeypatch) -> None:
    """With one instance, dead, nothing would serve while a new version loads in the background,
    and each request would wait 1 s at the dead stub: unload (NOT_FOUND at once) and load."""
    server = ScriptedServer(instances=1, repository=repository_of(tmp_path))
    guard = watched(server, monkeypatch)
    (only,) = server.stubs
    guard.poll_once()
    server.kill(only)
    guard.poll_once()
    assert server.unloads == [MODEL] and server.loads == [MODEL]
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1}


def test_a_load_stuck_in_a_new_stubs_initialize_ends_that_stub_and_is_tried_again(tmp_path: Path, monkeypatch) -> None:
    """The Python backend waits for a new stub's initialize as long as the stub lives: the load
    still running after ``load_stall_s`` has its new stub ended, fails, and the next attempt loads."""
    server = ScriptedServer(instances=1, repository=repository_of(tmp_path))
    monkeypatch.setattr(recovery, "STACKS_WRITTEN_S", 0.0)
    guard = watched(server, monkeypatch, load_stall_s=0.2, initial_backoff_s=0.0)
    loaded = server.load

    def stuck(model: str) -> None:
        """The first load's stub never finishes initialize: the load returns once it is ended."""
        server.loads.append(model)
        (stub,) = server.start()
        while not server.stubs[stub].zombie:
            time.sleep(0.01)
        monkeypatch.setattr(server, "load", loaded)
        raise RepositoryError(f"POST load: HTTP 400: Stub process '{MODEL}_0_0' is not healthy.")

    monkeypatch.setattr(server, "load", stuck)
    (only,) = server.stubs
    guard.poll_once()
    server.kill(only)
    guard.poll_once()  # the death, a reload whose load stalls and fails
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 0, "stalled_loads": 1}
    assert not guard.readiness()[0]
    guard.poll_once()  # the ended stub is no death of a READY model; the next attempt loads
    assert server.unloads == [MODEL, MODEL] and server.loads == [MODEL, MODEL]
    assert counts(guard) == {"stub_deaths": 1, "recoveries": 1, "stalled_loads": 1}
    assert [stub.zombie for stub in server.stubs.values()].count(False) == 1
