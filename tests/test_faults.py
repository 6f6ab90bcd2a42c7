"""Faults: a killed Python-backend stub is noticed and its model reloaded with no one acting.

One server of its own (not the shared fixture: these tests kill its processes), started with the
stub watchdog and a probe port. Requests keep flowing from a few threads while a stub is killed;
each of them either returns the library's exact result or fails with a server error, none hangs.
Each test stands alone (any order): the one that kills tritonserver itself starts its own. How
fast a model recovers is a benchmark figure (benchmarks/bench_recovery.py), not a test bound: the
waits here only keep a broken recovery from hanging the suite.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cgroup_holds
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from make_inputs import require_tritonserver
from tritonclient.utils import InferenceServerException

from kimi_vision_prep import preprocess_bytes
from kimi_vision_server.launch import shm_regions
from kimi_vision_server.launch.embedded import EmbeddedServer, free_port
from kimi_vision_server.render.blocks import RenderOptions
from kimi_vision_server.watch.stub_scan import StubProcess, parent_pid, signal_process, stub_processes, stubs_in_group
from kimi_vision_server.watch.watchdog import StubWatchdog, watchdog_thread_name

pytestmark = pytest.mark.server

MODEL = "kimi_k25_vision"
PRESET = "kimi-k2.5"
IMAGES = ["pil__hopper.jpg", "imagers__large_image.jpg", "imagers__tower_grayscale.jpg"]
OUTPUTS = ["PIXEL_VALUES", "GRID_THW", "NUM_TOKENS"]
CLIENT_TIMEOUT_S = 60.0  # a request that hangs fails the test instead of the test hanging
HANG_GUARD_S = 300.0  # a wait that never ends fails the test instead; not a performance bound
LOAD_THREADS = 3
STUB_SCAN_S = inspect.signature(StubWatchdog).parameters["interval_s"].default  # the launcher's
DEATHS, RECOVERIES = "kimi_prep_stub_deaths_total", "kimi_prep_recoveries_total"
STALLED = "kimi_prep_stalled_loads_total"


@dataclass
class Outcomes:
    """What the load threads saw: exact results, server errors (by message), and anything else."""

    exact: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    require_tritonserver()
    with EmbeddedServer(probe_port=free_port()) as embedded:
        yield embedded


@pytest.fixture(scope="module")
def images(corpus: Path) -> list[tuple[bytes, dict[str, np.ndarray]]]:
    """(encoded bytes, expected outputs with the batch dimension) of each image."""
    cases = []
    for name in IMAGES:
        data = (corpus / name).read_bytes()
        expected = preprocess_bytes(data, PRESET)
        cases.append(
            (
                data,
                {
                    "PIXEL_VALUES": expected.pixel_values[None],
                    "GRID_THW": np.asarray(expected.grid_thw, dtype=np.int64)[None, None],
                    "NUM_TOKENS": np.asarray([[expected.num_tokens]], dtype=np.int32),
                },
            )
        )
    return cases


def probe(server: EmbeddedServer, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(server.probe_url + path, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def counter(server: EmbeddedServer, family: str, model: str | None) -> float:
    """A watchdog counter from the probe port's /metrics (``model`` None: a family with no label)."""
    status, text = probe(server, "/metrics")
    assert status == 200
    prefix = f"{family} " if model is None else f'{family}{{model="{model}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def restarts(server: EmbeddedServer) -> float:
    """tritonserver processes the watchdog started again: each one the one before exited by itself
    (docs/faults.md: the Python backend can abort the server on a lock a killed stub held)."""
    return counter(server, "kimi_prep_server_restarts_total", None)


def infer(client: grpcclient.InferenceServerClient, data: bytes) -> dict[str, np.ndarray]:
    tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
    requested = [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]
    result = client.infer(MODEL, [tensor], outputs=requested, client_timeout=CLIENT_TIMEOUT_S)
    return {name: result.as_numpy(name) for name in OUTPUTS}


def is_exact(outputs: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> bool:
    return all(
        outputs[name].dtype == expected[name].dtype and np.array_equal(outputs[name], expected[name])
        for name in OUTPUTS
    )


def send_until(stop: threading.Event, server: EmbeddedServer, images: list, outcomes: Outcomes) -> None:
    """One load thread: its own client, the images round robin until ``stop``."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        index = 0
        while not stop.is_set():
            data, expected = images[index % len(images)]
            index += 1
            try:
                exact = is_exact(infer(client, data), expected)
            except InferenceServerException as exc:
                with outcomes.lock:
                    outcomes.errors[f"{exc.status()}: {exc.message()}"[:160]] += 1
                time.sleep(0.05)
                continue
            with outcomes.lock:
                if exact:
                    outcomes.exact += 1
                else:
                    outcomes.wrong.append(f"image {index % len(images)}")
    finally:
        client.close()


def wait_for(condition: Callable[[], bool], what: str, server: EmbeddedServer | None = None) -> float:
    """Seconds until ``condition()`` held; fails with ``what`` after :data:`HANG_GUARD_S`, and with
    what ``server`` was doing then (:func:`server_state`) where one is given."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > HANG_GUARD_S:
            state = "" if server is None else f"\n{server_state(server)}"
            pytest.fail(f"{what} within {HANG_GUARD_S:g} s{state}")
        time.sleep(0.05)
    return time.monotonic() - started


def server_state(server: EmbeddedServer) -> str:
    """What a wait that never ended needs to be explained: whether tritonserver runs, every stub
    process with its parent, the stack of this server's watchdog thread and the tail of
    tritonserver's log, with each live stub's Python stacks (SIGUSR1, contract.py)."""
    assert server.process is not None
    pid = server.process.pid
    stubs = stubs_in_group(pid)
    for stub in stubs:
        if not stub.zombie:
            signal_process(stub.pid, signal.SIGUSR1)
    time.sleep(2)  # the stubs write their stacks
    listed = "\n".join(f"  {stub} parent {parent_pid(stub.pid) or '(gone)'}" for stub in stubs)
    frames = sys._current_frames()
    stacks = [
        "".join(traceback.format_stack(frames[thread.ident]))
        for thread in threading.enumerate()
        if thread.name == watchdog_thread_name(pid) and thread.ident in frames
    ]
    return (
        f"tritonserver {pid}: exit code {server.process.poll()}\nstubs in its process group:\n{listed}\n"
        f"its watchdog thread:\n{''.join(stacks)}\ntritonserver log:\n{server.log_tail(20000)}"
    )


def serves_exactly(server: EmbeddedServer, images: list) -> Callable[[], bool]:
    def check() -> bool:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            return all(is_exact(infer(client, data), expected) for data, expected in images)
        except InferenceServerException:
            return False
        finally:
            client.close()

    return check


def kill_stub(server: EmbeddedServer, instance: str) -> int:
    assert server.process is not None
    (stub,) = [s for s in stub_processes(server.process.pid) if s.instance == instance and not s.zombie]
    os.kill(stub.pid, signal.SIGKILL)
    return stub.pid


def readyz_watcher(server: EmbeddedServer, stop: threading.Event, seen: list[int]) -> threading.Thread:
    def watch() -> None:
        while not stop.is_set():
            seen.append(probe(server, "/readyz")[0])
            time.sleep(0.05)

    return threading.Thread(target=watch, daemon=True)


def kill_under_load_and_recover(server: EmbeddedServer, images: list, model: str) -> None:
    """Kill ``model``'s stub while requests flow; assert errors not hangs, exact service again, counters."""
    assert probe(server, "/readyz")[0] == 200
    recoveries_before, restarts_before = counter(server, RECOVERIES, model), restarts(server)
    deaths_before = counter(server, DEATHS, model)
    outcomes, stop, readyz = Outcomes(), threading.Event(), []
    threads = [
        threading.Thread(target=send_until, args=(stop, server, images, outcomes), daemon=True)
        for _ in range(LOAD_THREADS)
    ]
    threads.append(readyz_watcher(server, stop, readyz))
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: outcomes.exact >= LOAD_THREADS, "exact results under load before the kill")
        killed_at = time.monotonic()
        pid = kill_stub(server, f"{model}_0_0")
        recovered_s = wait_for(
            serves_exactly(server, images), f"{MODEL} served exactly again after killing {model}", server
        )
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz back to 200")
        ready_s = time.monotonic() - killed_at
        exact_at_recovery = outcomes.exact
        wait_for(lambda: outcomes.exact >= exact_at_recovery + LOAD_THREADS, "exact results under load again")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=CLIENT_TIMEOUT_S + 10)
    assert not any(thread.is_alive() for thread in threads), "a request hung past its client timeout"
    server_started_again = restarts(server) - restarts_before
    how = " (tritonserver had died: started again)" if server_started_again else ""
    print(
        f"\nkill -9 {model} stub (pid {pid}): served exactly again after {recovered_s:.2f} s, "
        f"/readyz 200 again after {ready_s:.2f} s{how}; "
        f"under load: {outcomes.exact} exact, errors {dict(outcomes.errors)}, /readyz codes {sorted(set(readyz))}"
    )
    assert not outcomes.wrong, f"results differing from preprocess_bytes: {outcomes.wrong}"
    assert not [message for message in outcomes.errors if "Deadline" in message], outcomes.errors
    assert 503 in readyz, "/readyz never reported the broken model"
    if server_started_again:
        # The Python backend aborted tritonserver on a lock the killed stub held (docs/faults.md):
        # the server was started again, which is the recovery; at most the death was counted first.
        assert server_started_again == 1
        assert counter(server, RECOVERIES, model) == recoveries_before
        assert counter(server, DEATHS, model) - deaths_before in (0, 1)
        return
    assert counter(server, RECOVERIES, model) == recoveries_before + 1
    assert counter(server, DEATHS, model) == deaths_before + 1


def test_probes_answer_on_a_healthy_server(server: EmbeddedServer) -> None:
    assert probe(server, "/livez") == (200, "alive\n")
    assert probe(server, "/readyz") == (200, "ready\n")
    status, text = probe(server, "/metrics")
    assert status == 200
    assert "# TYPE kimi_prep_recoveries_total counter" in text
    assert "# TYPE kimi_prep_stub_deaths_total counter" in text
    assert "# TYPE kimi_prep_replaced_stubs_ended_total counter" in text
    assert probe(server, "/nothing")[0] == 404


def test_killed_decode_stub_is_reloaded_under_load(server: EmbeddedServer, images: list) -> None:
    kill_under_load_and_recover(server, images, "kimi_k25_decode")


def test_killed_preprocess_stub_is_reloaded_under_load(server: EmbeddedServer, images: list) -> None:
    kill_under_load_and_recover(server, images, "kimi_k25_preprocess")


def test_each_kill_of_a_two_instance_models_stub_is_one_death_and_one_recovery(images: list) -> None:
    """`kimi-prep serve`'s layout on a host of several cores: two instances a model. A reload
    replaces both; the old version's surviving stub ends if that version unloads (tritonserver
    never finishes unloading it when a request reached the dead stub), and that is no death (taken
    for one it set off a second reload). Three kills in a row, each of a stub of the version the
    last recovery loaded, each of them seen and recovered once."""
    require_tritonserver()
    model = "kimi_k25_decode"
    render = RenderOptions(instances=2, threads=1, kind="cpu")
    with EmbeddedServer(render=render, models=(MODEL,), probe_port=free_port()) as server:
        for kills in (1, 2, 3):
            wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 before the kill")
            deaths, recoveries = (counter(server, name, model) for name in (DEATHS, RECOVERIES))
            started = restarts(server)
            kill_stub(server, f"{model}_0_0")
            wait_for(serves_exactly(server, images), f"{MODEL} served exactly again after kill {kills}", server)
            wait_for(
                lambda r=recoveries, n=started: counter(server, RECOVERIES, model) > r or restarts(server) > n,
                f"recovery {kills}",
                server,
            )
            wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 after the recovery")
            # A replaced version that unloads does so within a few scans (its surviving stub ends
            # then): an exit taken for a death would be counted by now, or by the next round's check.
            time.sleep(4 * STUB_SCAN_S)
            if restarts(server) > started:  # tritonserver aborted (docs/faults.md) and was started again
                assert restarts(server) == started + 1 and counter(server, RECOVERIES, model) == recoveries
                continue
            assert counter(server, DEATHS, model) == deaths + 1
            assert counter(server, RECOVERIES, model) == recoveries + 1


def test_a_two_instance_model_killed_under_load_keeps_serving_and_its_old_survivor_is_ended(
    images: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A two-instance model's stub killed while requests flow. The new version loads in the
    background while the other instance serves: no request meets an unloaded model (NOT_FOUND).
    A request reached the dead stub, so tritonserver never unloads the replaced version (the
    Python backend leaks that request's response factory, docs/faults.md) and its surviving stub
    would run until the server stops; the watchdog ends it once idle: the new version's two stubs
    are left, serving exactly, and that end is no death. The server then stops cleanly (0), not
    after tritonserver's exit timeout for the version that never unloads (1)."""
    require_tritonserver()
    model = "kimi_k25_decode"
    render = RenderOptions(instances=2, threads=1, kind="cpu")
    with EmbeddedServer(render=render, models=(MODEL,), probe_port=free_port()) as server:
        assert server.process is not None and server.watchdog is not None
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 before the kill")
        before = {s.identity for s in stub_processes(server.process.pid) if s.model == model}
        unloaded: list[str] = []
        repository_api, unload = server.watchdog.repository, server.watchdog.repository.unload

        def recorded_unload(name: str) -> None:
            unloaded.append(name)
            unload(name)

        monkeypatch.setattr(repository_api, "unload", recorded_unload)
        outcomes, stop = Outcomes(), threading.Event()
        threads = [
            threading.Thread(target=send_until, args=(stop, server, images, outcomes), daemon=True)
            for _ in range(LOAD_THREADS)
        ]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: outcomes.exact >= LOAD_THREADS, "exact results under load before the kill")
            kill_stub(server, f"{model}_0_0")
            wait_for(lambda: counter(server, RECOVERIES, model) >= 1 or restarts(server) >= 1, "the recovery", server)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=CLIENT_TIMEOUT_S + 10)
        assert not outcomes.wrong, outcomes.wrong
        if restarts(server):
            # tritonserver aborted on a lock the killed stub held (docs/faults.md) and was started
            # again: that is the recovery, and none of the replaced version's story below follows.
            wait_for(serves_exactly(server, images), f"{MODEL} served exactly by the server started again", server)
            assert restarts(server) == 1
            return
        assert any("is not healthy" in message for message in outcomes.errors), (
            f"no request reached the dead stub, the case this test is about: {dict(outcomes.errors)}"
        )
        assert unloaded == [], "the model was unloaded: its other instance stopped serving"
        assert not [message for message in outcomes.errors if "NOT_FOUND" in message], outcomes.errors
        assert not outcomes.wrong, outcomes.wrong
        wait_for(
            lambda: counter(server, "kimi_prep_replaced_stubs_ended_total", model) == 1,
            "the replaced version's surviving stub ended",
        )
        live = [s for s in stub_processes(server.process.pid) if s.model == model and not s.zombie]
        assert len(live) == 2 and not {s.identity for s in live} & before, live
        assert serves_exactly(server, images)()
        assert counter(server, DEATHS, model) == 1
        assert counter(server, RECOVERIES, model) == 1
        # The replaced version never unloads, so tritonserver alone would wait its whole exit
        # timeout and exit with 1; once it runs no stub the launcher ends it as stopped.
        assert server.watchdog.pinned_versions() == [model]
        assert server.stop() == 0


def test_a_killed_tritonserver_is_started_again_and_leaves_nothing_behind() -> None:
    """docs/faults.md, "When tritonserver itself dies": a tritonserver killed once it served is
    started again by the watchdog, `/readyz` says 503 meanwhile, and what the dead one left is
    gone: its stubs (one stopped here, so that it cannot see its server die by itself, as a stub
    deadlocked on the Python backend's exit path cannot) and its shared-memory regions; the stop
    after that leaves no region either."""
    with EmbeddedServer(models=("kimi_k25_tokens",), probe_port=free_port()) as server:
        killed = server.process
        assert killed is not None
        stubs = [stub for stub in stub_processes(killed.pid) if not stub.zombie]
        regions = set(Path("/dev/shm").glob(f"{server.shm_prefix}*"))
        assert regions, "the Python backend's regions carry the prefix"
        os.kill(stubs[0].pid, signal.SIGSTOP)
        stop, readyz = threading.Event(), []
        watcher = readyz_watcher(server, stop, readyz)
        watcher.start()
        killed.send_signal(signal.SIGKILL)
        wait_for(lambda: server.process is not killed and server.is_ready(), "a new tritonserver, ready", server)
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 again")
        stop.set()
        watcher.join()
        assert 503 in readyz and restarts(server) == 1
        wait_for(lambda: not any(Path(f"/proc/{stub.pid}").exists() for stub in stubs), "the dead server's stubs gone")
        assert not regions & set(Path("/dev/shm").glob(f"{server.shm_prefix}*")), "the dead server's regions left"
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*")), "regions left after the stop"


def test_stale_regions_of_dead_launchers_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_regions, "SHM_DIR", tmp_path)
    own = shm_regions.shm_region_prefix() + "a"
    dead_pid = max(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()) + 10_000
    regions = [own, f"kimi_prep_{dead_pid}-1-0_b", f"kimi_prep_{os.getpid()}-1-0_c", "kimi_prep_d", "other_e"]
    for name in regions:
        (tmp_path / name).write_bytes(b"")
    removed = shm_regions.remove_stale_shm_regions()
    # A dead pid, and a live pid with another start time (a recycled pid or another container).
    assert sorted(removed) == sorted(regions[1:3])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([own, "kimi_prep_d", "other_e"])


def test_readyz_follows_an_operators_explicit_unload_and_load() -> None:
    """An operator who unloads a model through Triton's repository API takes it out of the set the
    server is meant to serve: /readyz stays 200; loading it again puts it back (and 200 again)."""
    models = ("kimi_k25_tokens", "kimi_k3_tokens")
    with EmbeddedServer(models=models, probe_port=free_port()) as server:
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 after start")
        base = f"http://{server.http_url}/v2/repository/models/kimi_k3_tokens"
        operator = server.admin_headers()  # the repository API needs the admin key (docs/security.md)
        unload = urllib.request.Request(f"{base}/unload", data=b"{}", method="POST", headers=operator)
        urllib.request.urlopen(unload, timeout=60)
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 after an explicit unload")
        status, text = probe(server, "/readyz")
        assert status == 200, text
        load = urllib.request.Request(f"{base}/load", data=b"{}", method="POST", headers=operator)
        urllib.request.urlopen(load, timeout=120)
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 after loading it again")


def test_the_watchdog_says_why_a_stub_died() -> None:
    """A zombie's wait status (a signal or an exit code), or gone once reaped: what the watchdog logs."""
    from kimi_vision_server.watch.stub_scan import death_cause

    killed = subprocess.Popen(["sleep", "30"])
    os.kill(killed.pid, signal.SIGKILL)
    wait_for(lambda: death_cause(killed.pid).startswith("a zombie"), "the killed child is a zombie")
    assert death_cause(killed.pid) == "a zombie, killed by SIGKILL (9)"
    killed.wait()
    assert death_cause(killed.pid).startswith("gone")
    exited = subprocess.Popen(["sh", "-c", "exit 3"])
    wait_for(lambda: death_cause(exited.pid).startswith("a zombie"), "the exited child is a zombie")
    assert death_cause(exited.pid) == "a zombie, exited with code 3"
    exited.wait()


def test_sigusr1_writes_a_stubs_python_stacks_to_the_log(server: EmbeddedServer, images: list) -> None:
    """docs/faults.md: where a stub is stuck, ``kill -USR1`` shows it, and the stub goes on serving."""
    assert server.process is not None
    (stub,) = [s for s in stub_processes(server.process.pid) if s.instance == "kimi_k25_decode_0_0" and not s.zombie]
    assert server.log_path is not None
    logged_before = server.log_path.stat().st_size
    os.kill(stub.pid, signal.SIGUSR1)
    wait_for(lambda: "most recent call first" in server.log_path.read_text(errors="replace")[logged_before:], "stacks")
    assert [s.identity for s in stub_processes(server.process.pid) if s.identity == stub.identity and not s.zombie]
    assert serves_exactly(server, images)()


STALLING_CONFIG = """name: "stalling"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
STALLING_MODEL = '''import faulthandler
import signal
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        marker = Path(args["model_repository"]).parent / "stall"
        while marker.exists():  # a stub whose initialize never returns while the marker is there
            time.sleep(0.05)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
'''


def test_a_load_stuck_in_a_stubs_initialize_is_ended_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/faults.md, step 3: a model whose stub was killed reloads, and the new stub's initialize
    never returns (here: while a marker file exists). The load is ended after ``load_stall_s``, the
    stub's Python stacks in the log first, and tried again until one completes; the model serves.
    ``load_stall_s`` is 3 s here (120 s by default)."""
    from kimi_vision_server.launch import launcher

    require_tritonserver()
    (tmp_path / "stalling" / "1").mkdir(parents=True)
    (tmp_path / "stalling" / "config.pbtxt").write_text(STALLING_CONFIG)
    (tmp_path / "stalling" / "1" / "model.py").write_text(STALLING_MODEL)
    marker = tmp_path / "stall"
    monkeypatch.setattr(launcher, "StubWatchdog", functools.partial(StubWatchdog, load_stall_s=3.0))
    with EmbeddedServer(model_repository=tmp_path, probe_port=free_port()) as server:
        marker.touch()
        time.sleep(2 * STUB_SCAN_S)  # a scan has seen the stub (docs/faults.md: one it never saw is not watched)
        kill_stub(server, "stalling_0_0")
        # A second stalled load began once the first had failed: its stub was ended while the marker stood.
        wait_for(lambda: counter(server, STALLED, "stalling") >= 2, "a second stalled load", server)
        assert probe(server, "/readyz")[0] == 503
        marker.unlink()
        wait_for(lambda: counter(server, RECOVERIES, "stalling") == 1, "the recovery", server)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        tensor = grpcclient.InferInput("X", [1], "INT32")
        tensor.set_data_from_numpy(np.array([7], dtype=np.int32))
        assert client.infer("stalling", [tensor], client_timeout=CLIENT_TIMEOUT_S).as_numpy("Y").tolist() == [7]
        client.close()
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 after the recovery")
        assert counter(server, DEATHS, "stalling") == 1
        log = server.log_tail(200_000)
    assert "in initialize" in log and "most recent call first" in log  # the stalled stub's stack


BUSY_CONFIG = STALLING_CONFIG.replace('"stalling"', '"busy"')
BUSY_MODEL = '''import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        seconds = float(pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0])
        end, spins = time.monotonic() + seconds, 0
        while time.monotonic() < end:  # busy in Python the whole time, holding the GIL
            spins += 1
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
'''
STUCK = "kimi_prep_stuck_stubs_total"
STUCK_AFTER_S = inspect.signature(StubWatchdog).parameters["stuck_after_s"].default  # the launcher's


def test_a_stub_busy_longer_than_stuck_after_s_is_not_taken_for_stuck(tmp_path: Path) -> None:
    """A slow but working stub: its execute spins in Python for twice ``stuck_after_s`` (a long
    decode or video is no different to the watchdog). Its health thread, in C++, keeps running, so
    it is answered, and neither counted stuck nor reloaded."""
    require_tritonserver()
    (tmp_path / "busy" / "1").mkdir(parents=True)
    (tmp_path / "busy" / "config.pbtxt").write_text(BUSY_CONFIG)
    (tmp_path / "busy" / "1" / "model.py").write_text(BUSY_MODEL)
    with EmbeddedServer(model_repository=tmp_path, probe_port=free_port()) as server:
        time.sleep(2 * STUB_SCAN_S)  # a scan has seen the stub
        seconds = int(2 * STUB_SCAN_S + 2 * STUCK_AFTER_S)
        assert answers(server, "busy", [seconds]) == [seconds]
        assert counter(server, STUCK, "busy") == 0 and counter(server, RECOVERIES, "busy") == 0
        assert probe(server, "/readyz")[0] == 200


@dataclass
class Timeline:
    """What each load thread saw, by when the request was sent: (time, "exact" | "wrong" | the
    server's error)."""

    seen: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, sent_at: float, what: str) -> None:
        with self.lock:
            self.seen.append((sent_at, what))

    def between(self, start: float, end: float = float("inf")) -> Counter[str]:
        with self.lock:
            return Counter(what for at, what in self.seen if start <= at < end)


def send_new_photos(stop: threading.Event, server: EmbeddedServer, images: list, timeline: Timeline) -> None:
    """One load thread: its own client, each request a photo made new (bytes after its end, which
    decoders ignore), as a server under load of new photos sees them."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for index in itertools.count():
            if stop.is_set():
                return
            data, expected = images[index % len(images)]
            sent_at = time.monotonic()
            try:
                outputs = infer(client, data + f"new photo {threading.get_ident()} {index}".encode())
            except InferenceServerException as exc:
                timeline.add(sent_at, f"{exc.status()}: {exc.message()}"[:160])
                continue
            timeline.add(sent_at, "exact" if is_exact(outputs, expected) else "wrong")
    finally:
        client.close()


def test_a_stopped_stub_under_load_is_ended_and_replaced_and_no_request_fails_after(images: list) -> None:
    """docs/faults.md: the default serve's layout of a model of two instances; one decode stub
    stopped (SIGSTOP, as a decoder that stopped running would be) while four threads send new
    photos. Requests it takes fail (the Python backend: not healthy) until the watchdog finds it
    has not run for ``stuck_after_s``, ends it and reloads the model (/readyz 503 meanwhile); no
    request sent after that fails. The stub is resumed at the end (it is gone by then)."""
    require_tritonserver()
    model = "kimi_k25_decode"
    render = RenderOptions(instances=2, threads=1, kind="cpu")
    with EmbeddedServer(render=render, models=(MODEL,), probe_port=free_port()) as server:
        assert server.process is not None
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 before the stop")
        timeline, stop, readyz = Timeline(), threading.Event(), []
        threads = [
            threading.Thread(target=send_new_photos, args=(stop, server, images, timeline), daemon=True)
            for _ in range(4)
        ]
        threads.append(readyz_watcher(server, stop, readyz))
        for thread in threads:
            thread.start()
        (stub,) = [s for s in stub_processes(server.process.pid) if s.instance == f"{model}_0_1" and not s.zombie]
        try:
            wait_for(lambda: timeline.between(0)["exact"] >= 8, "exact results under load before the stop")
            stopped_at = time.monotonic()
            os.kill(stub.pid, signal.SIGSTOP)
            found_s = wait_for(lambda: counter(server, STUCK, model) == 1, "the stuck stub found", server)
            wait_for(lambda: counter(server, RECOVERIES, model) == 1 or restarts(server) >= 1, "the recovery", server)
            replaced_at = time.monotonic()
            wait_for(lambda: timeline.between(replaced_at)["exact"] >= 40, "exact results after the recovery")
            ended_at = time.monotonic()
        finally:
            stop.set()
            signal_process(stub.pid, signal.SIGCONT)
            for thread in threads:
                thread.join(timeout=CLIENT_TIMEOUT_S + 10)
        before, during = timeline.between(0, stopped_at), timeline.between(stopped_at, replaced_at)
        after = timeline.between(replaced_at, ended_at)
        print(
            f"\nSIGSTOP {stub.instance} under load: found stuck {found_s:.2f} s after the stop, replaced "
            f"{replaced_at - stopped_at:.2f} s after it; requests sent before the stop {dict(before)}, until "
            f"replaced {dict(during)}, after {dict(after)}; /readyz codes {sorted(set(readyz))}"
        )
        assert not any(what == "wrong" for what, _ in timeline.between(0).items()), timeline.between(0)
        assert set(after) == {"exact"}, after
        assert 503 in readyz, "/readyz never reported the stuck stub"
        assert counter(server, DEATHS, model) == 0  # ended as stuck, not counted again as a death
        assert probe(server, "/readyz")[0] == 200


FROZEN_WAYS = ("cgroup v2 freeze", "cgroup v1 freezer")  # tests/cgroup_holds.py: threads read S / D


def busy_server(folder: Path) -> EmbeddedServer:
    """A server of the one-instance ``busy`` model (:data:`BUSY_MODEL`) in ``folder``, not started."""
    (folder / "busy" / "1").mkdir(parents=True)
    (folder / "busy" / "config.pbtxt").write_text(BUSY_CONFIG)
    (folder / "busy" / "1" / "model.py").write_text(BUSY_MODEL)
    return EmbeddedServer(model_repository=folder, probe_port=free_port())


def answers(server: EmbeddedServer, model: str, x: list) -> list | str:
    """What ``model`` (X in, Y out, int32) answers to X = ``x``: Y as a list, or the server's error."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("X", list(np.shape(x)), "INT32")
    tensor.set_data_from_numpy(np.array(x, dtype=np.int32))
    try:
        return client.infer(model, [tensor], client_timeout=CLIENT_TIMEOUT_S).as_numpy("Y").tolist()
    except InferenceServerException as exc:
        return f"{exc.status()}: {exc.message()}"
    finally:
        client.close()


def busy_answers(server: EmbeddedServer) -> list | str:
    """What ``busy`` answers to a request of 0 s."""
    return answers(server, "busy", [0])


def the_stub(server: EmbeddedServer, instance: str) -> StubProcess:
    assert server.process is not None
    (stub,) = [s for s in stub_processes(server.process.pid) if s.instance == instance and not s.zombie]
    return stub


@contextlib.contextmanager
def serving_busy(folder: Path) -> Iterator[tuple[EmbeddedServer, StubProcess]]:
    """A started :func:`busy_server` that has answered and is ready, and its stub."""
    require_tritonserver()
    with busy_server(folder) as server:
        assert busy_answers(server) == [0]
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 before the freeze")
        yield server, the_stub(server, "busy_0_0")


@pytest.mark.parametrize("way", FROZEN_WAYS)
def test_a_stub_frozen_while_no_request_comes_is_left_alone_and_serves_after(
    tmp_path: Path, way: str, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/faults.md step 6: a stub frozen in its cgroup past ``stuck_after_s`` has not run, but
    only waits: the watchdog logs it waiting, neither counts it stuck nor ends it, and, thawed
    another ``stuck_after_s`` later, the same stub answers."""
    caplog.set_level(logging.WARNING, logger="kimi_vision_server.watchdog")
    with serving_busy(tmp_path) as (server, stub):
        with cgroup_holds.hold(stub.pid, way):
            frozen_at = time.monotonic()
            wait_for(lambda: "is waiting, not stuck" in caplog.text or counter(server, STUCK, "busy") > 0, "a verdict")
            seen_s = time.monotonic() - frozen_at
            time.sleep(STUCK_AFTER_S)  # frozen for twice stuck_after_s in all
            held_s = time.monotonic() - frozen_at
        answer = busy_answers(server)
        print(f"\n{way} of {stub.instance} for {held_s:.1f} s: logged waiting after {seen_s:.1f} s; after: {answer}")
        assert counter(server, STUCK, "busy") == 0 and counter(server, DEATHS, "busy") == 0
        assert f"{stub.instance} (pid {stub.pid}) has not run for" in caplog.text
        assert answer == [0] and the_stub(server, "busy_0_0").identity == stub.identity
        assert counter(server, RECOVERIES, "busy") == 0 and restarts(server) == 0


@pytest.mark.parametrize("way", FROZEN_WAYS)
def test_a_frozen_stub_a_request_failed_on_is_ended_while_frozen_and_replaced(tmp_path: Path, way: str) -> None:
    """docs/faults.md step 6: a request sent to a frozen stub fails (the Python backend: not
    healthy), and that stub would crash when thawed (it reads the request the backend freed), which
    takes tritonserver down at the next request. So once it has not run for ``stuck_after_s`` it is
    counted stuck and ended while still frozen; its model is reloaded, and serves, on the same server."""
    with serving_busy(tmp_path) as (server, stub):
        with cgroup_holds.hold(stub.pid, way):
            frozen_at = time.monotonic()
            during = busy_answers(server)
            wait_for(lambda: counter(server, STUCK, "busy") == 1, "the frozen stub ended", server)
            found_s = time.monotonic() - frozen_at
        recovered_s = wait_for(lambda: busy_answers(server) == [0], "busy answering again", server)
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 after the recovery")
        print(
            f"\n{way} of {stub.instance}, a request sent: {during!r}; ended {found_s:.1f} s after the freeze, "
            f"answering again {recovered_s:.1f} s after the thaw"
        )
        assert "not healthy" in str(during)
        assert counter(server, DEATHS, "busy") == 0 and restarts(server) == 0
        assert counter(server, RECOVERIES, "busy") == 1
        assert the_stub(server, "busy_0_0").identity != stub.identity


# Two instances: pair_0_0 takes every request, pair_1_0 is passive (loaded, its stub running, never
# scheduled), so that which instance a request reaches is Triton's certainty, not its timing. A
# request waits in the queue at most 0.5 s; a negative X is refused (an error the model answers).
PAIR_QUEUE_TIMEOUT_S = 0.5
PAIR_CONFIG = f"""name: "pair"
backend: "python"
max_batch_size: 1
dynamic_batching {{
  default_queue_policy {{ timeout_action: REJECT default_timeout_microseconds: {int(PAIR_QUEUE_TIMEOUT_S * 1e6)} }}
}}
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }}, {{ count: 1 kind: KIND_CPU passive: true }} ]
"""
PAIR_MODEL = '''import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x.flat[0] < 0:
                refused = pb_utils.TritonError("refused", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse([], error=refused))
                continue
            end = time.monotonic() + float(x.flat[0])
            while time.monotonic() < end:  # busy in Python the whole time
                pass
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
'''


def pair_answers(server: EmbeddedServer, seconds: int) -> list | str:
    """What ``pair`` answers to a request of ``seconds`` (negative: refused)."""
    return answers(server, "pair", [[seconds]])


def triton_failures(server: EmbeddedServer, model: str) -> dict[str, float]:
    """tritonserver's failed requests of ``model`` by reason (its metrics port), and ``fail``: the
    count its statistics API gives (``inference_stats.fail.count``)."""
    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        text = response.read().decode()
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/stats", timeout=30) as response:
        stats = json.load(response)["model_stats"]
    reasons = {}
    for line in text.splitlines():
        if line.startswith("nv_inference_request_failure{") and f'model="{model}"' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            reasons[reason] = reasons.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return reasons | {"fail": float(sum(s["inference_stats"]["fail"]["count"] for s in stats))}


@pytest.mark.parametrize("way", FROZEN_WAYS)
def test_a_frozen_stub_is_left_alone_while_its_models_other_instance_refuses_and_its_queue_times_out(
    tmp_path: Path, way: str, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/faults.md step 6: ``pair``'s passive stub frozen past ``stuck_after_s`` while its other
    instance refuses a request and runs a long one, and two requests queued behind that one time
    out (Triton's statistics count them failed). None reached the frozen stub: it is left alone,
    and runs on after the thaw; no reload."""
    require_tritonserver()
    caplog.set_level(logging.WARNING, logger="kimi_vision_server.watchdog")
    (tmp_path / "pair" / "1").mkdir(parents=True)
    (tmp_path / "pair" / "config.pbtxt").write_text(PAIR_CONFIG)
    (tmp_path / "pair" / "1" / "model.py").write_text(PAIR_MODEL)
    with EmbeddedServer(model_repository=tmp_path, probe_port=free_port()) as server:
        assert pair_answers(server, 0) == [[0]]
        wait_for(lambda: probe(server, "/readyz")[0] == 200, "/readyz 200 before the freeze")
        frozen = the_stub(server, "pair_1_0")
        before = triton_failures(server, "pair")
        with cgroup_holds.hold(frozen.pid, way):
            # Waiting, and its model's backend failures read long before the requests below.
            wait_for(lambda: "is waiting, not stuck" in caplog.text or counter(server, STUCK, "pair") > 0, "a verdict")
            refused = pair_answers(server, -1)
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                idle_ticks = the_stub(server, "pair_0_0").cpu_ticks
                long = pool.submit(pair_answers, server, int(2 * STUCK_AFTER_S))
                # Running (0.1 s of CPU, an idle stub's health thread takes a tick now and then):
                # the two sent now queue behind it until their timeout.
                wait_for(lambda: the_stub(server, "pair_0_0").cpu_ticks > idle_ticks + 10, "the long request")
                queued = [pool.submit(pair_answers, server, 0) for _ in range(2)]
                answers = [long.result(), *(future.result() for future in queued)]
            time.sleep(STUCK_AFTER_S)  # scans after the timeouts, the stub still frozen
            during = triton_failures(server, "pair")
        after = pair_answers(server, 0)
        print(f"\n{way} of {frozen.instance}: {refused!r}, {answers}; failures {before} -> {during}; after: {after}")
        assert "INVALID_ARGUMENT: refused" in str(refused)
        assert answers[0] == [[int(2 * STUCK_AFTER_S)]] and all("timeout expired" in str(a) for a in answers[1:])
        # The refused request is a success to Triton; the two timeouts are its failures, not the backend's.
        assert during["fail"] - before["fail"] == 2 and during["REJECTED"] - before["REJECTED"] == 2
        assert during["BACKEND"] == before["BACKEND"]
        assert counter(server, STUCK, "pair") == 0 and counter(server, RECOVERIES, "pair") == 0
        assert after == [[0]] and the_stub(server, "pair_1_0").identity == frozen.identity
        assert counter(server, DEATHS, "pair") == 0 and restarts(server) == 0
