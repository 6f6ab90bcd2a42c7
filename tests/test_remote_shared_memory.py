"""Shared memory that is safe to turn on, against a real ``kimi-prep serve``.

- A request the server answered, with its outputs or with an error, gives its region back at once:
  a burst of refused images leaves no more regions registered on the server (read from Triton's
  shared-memory status) than requests were in flight.
- ``auto`` (the remote processor's default on a loopback address) uses shared memory only once the
  server is seen to map this process's regions: a server in a mount namespace of its own with its
  own ``/dev/shm`` (``unshare --mount``, as a container behind a published port) gets the bytes on
  the wire, said once in the log, and answers exactly.
- A request larger than ``/dev/shm`` has room for goes over the wire (no region is written past a
  full tmpfs, which would kill the writer with SIGBUS).
- A thread's connection, and its regions, are let go once the thread ends.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc
from make_inputs import CORPUS, SERVE_START_BUDGET_S, ServeProcess, require_tritonserver, served

from kimi_vision_client.client import KimiVisionClient
from kimi_vision_client.remote_processor import DEFAULT_CONCURRENCY, RemoteKimiProcessor
from kimi_vision_common.errors import InvalidImageError
from kimi_vision_prep import KimiVisionProcessor

pytestmark = pytest.mark.server

MODEL = "kimi_k25_vision_u8"
UINT8 = {"do_rescale": False, "do_normalize": False}
SERVE = ("--models", MODEL, "--instances", "1", "--threads", "1", "--response-cache-mib", "0")
# Refused two ways: a header Pillow rejects (no output size known: the answer comes over the wire)
# and a JPEG cut short (its outputs sized from the header, in the region).
REFUSED = ["imagers__null_height.jpg", "pil__truncated_jpeg.jpg"]
BURST, IN_FLIGHT = 1000, 8
HERE = Path(__file__).resolve().parent
FAILSAFE_S = 120.0  # a thread whose call never returns fails the test instead of hanging it
OWN_SHM = 'mount -t tmpfs -o size=512m kimi-test-shm /dev/shm && exec "$@"'


def can_unshare() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


@pytest.fixture(scope="module")
def serve() -> Iterator[ServeProcess]:
    with served(*SERVE) as server:
        yield server


def registered(server: ServeProcess) -> set[str]:
    """The system shared-memory regions the server has registered now."""
    with tritonclient.grpc.InferenceServerClient(server.grpc_url) as client:
        return set(client.get_system_shared_memory_status(as_json=True).get("regions", {}))


def test_a_burst_of_refused_images_leaves_at_most_the_requests_in_flight_registered(serve: ServeProcess) -> None:
    refused = [(CORPUS / REFUSED[i % len(REFUSED)]).read_bytes() for i in range(BURST)]
    before = registered(serve)
    with KimiVisionClient(serve.grpc_url, "grpc", MODEL, use_shared_memory=True) as client:
        results = client.preprocess_media(refused, concurrency=IN_FLIGHT)
        during = registered(serve) - before
        assert set(client.shared_memory_regions) == during
    print(f"\n{BURST} refused images, {IN_FLIGHT} in flight: {len(during)} regions registered after")
    assert all(isinstance(r, InvalidImageError) for r in results), {type(r).__name__ for r in results}
    assert 0 < len(during) <= IN_FLIGHT
    assert registered(serve) == before


def test_refused_calls_of_the_remote_processor_leave_at_most_its_concurrency_registered(serve: ServeProcess) -> None:
    remote = RemoteKimiProcessor(url=serve.grpc_url)
    before = registered(serve)
    for index in range(200):
        with pytest.raises(InvalidImageError):
            remote.preprocess({"type": "image", "image": (CORPUS / REFUSED[index % 2]).read_bytes()}, **UINT8)
    during = registered(serve) - before
    print(f"\n200 refused calls: {len(during)} regions registered after")
    assert 0 < len(during) <= DEFAULT_CONCURRENCY
    remote.close()
    assert registered(serve) == before


def test_a_threads_connection_is_let_go_when_the_thread_ends(serve: ServeProcess) -> None:
    """Four threads call once each (all before any ends) and end; the next call (any thread's)
    has their connections closed in a thread of its own (not on its time), so only the live
    thread's region stays registered."""
    data = (CORPUS / "pil__hopper.jpg").read_bytes()
    remote = RemoteKimiProcessor(url=serve.grpc_url)
    before = registered(serve)
    called = threading.Barrier(4, timeout=FAILSAFE_S)
    failed: list[BaseException] = []

    def call_then_end() -> None:
        try:
            remote.preprocess({"type": "image", "image": data})
        except BaseException as exc:  # reported by the test, not lost in the thread
            failed.append(exc)
        called.wait()

    threads = [threading.Thread(target=call_then_end) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failed, failed
    by_ended_threads = registered(serve) - before
    assert len(by_ended_threads) == 4
    remote.preprocess({"type": "image", "image": data})  # closes the ended threads' connections, apart
    give_up = time.monotonic() + SERVE_START_BUDGET_S
    while registered(serve) & by_ended_threads:
        assert time.monotonic() < give_up, "the ended threads' regions stayed registered"
        time.sleep(0.05)
    assert len(registered(serve) - before) == 1 and len(remote.shared_memory_regions) == 1
    remote.close()
    assert registered(serve) == before


@pytest.mark.skipif(not can_unshare(), reason="needs root and unshare (a mount namespace of its own)")
def test_a_server_with_its_own_dev_shm_gets_the_bytes_on_the_wire(caplog: pytest.LogCaptureFixture) -> None:
    """``kimi-prep serve`` in a mount namespace with its own tmpfs on ``/dev/shm`` (as a container's
    published port is: loopback, another ``/dev/shm``): the remote processor's ``auto`` finds the
    server cannot map its region, says so once, and every answer comes over the wire, exact."""
    require_tritonserver()
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", OWN_SHM, "sh"]
    server = ServeProcess(*SERVE, kimi_prep=[*command, sys.executable, "-m", "kimi_vision_client.cli"])
    server.start()
    try:
        remote = RemoteKimiProcessor(url=server.grpc_url)
        local = KimiVisionProcessor()
        names = ["pil__hopper.jpg", "sklearn__china.jpg", "pilx__hopper.png"]
        with caplog.at_level(logging.WARNING, logger="kimi_vision_client.shm"):
            for name in names * 2:
                media = {"type": "image", "image": (CORPUS / name).read_bytes()}
                got = remote.preprocess(media, **UINT8)["pixel_values"]
                assert np.array_equal(got, local.preprocess(media, **UINT8)["pixel_values"]), name
        said = [r.getMessage() for r in caplog.records if "cannot map" in r.getMessage()]
        assert len(said) == 1 and "SharedMemoryUnavailableError" in said[0], said
        assert registered(server) == set()
        assert remote.shared_memory_regions == []
        remote.close()
    finally:
        server.stop()


@pytest.mark.skipif(not can_unshare(), reason="needs root and unshare (a mount namespace of its own)")
def test_a_request_larger_than_dev_shm_has_room_for_goes_over_the_wire(tmp_path: Path) -> None:
    """Client and server share a ``/dev/shm`` left with room for a small photo's request but not a
    12-megapixel one's (beside the client's headroom): the small one travels in a region, the large
    one over the wire, both exact. Then, with room for two large regions, eight large requests at
    once: each region's pages are reserved when it is made, so the rest travel over the wire and
    nothing writes past the full tmpfs (``shm_namespace_side.py`` runs both in one namespace)."""
    require_tritonserver()
    out = tmp_path / "report.json"
    command = ["unshare", "--mount", "--propagation", "private", sys.executable, str(HERE / "shm_namespace_side.py")]
    done = subprocess.run([*command, str(out)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    print(f"\nsmall /dev/shm: {report}")
    assert report["small"]["exact"] and report["large"]["exact"]
    needs, headroom = report["needs"], report["headroom"]
    assert needs["small"] + headroom <= report["free"] < needs["large"] + headroom
    assert report["needs"]["small"] <= report["small"]["largest_region"] < report["needs"]["large"]
    assert report["large"]["largest_region"] == report["small"]["largest_region"]
    in_flight = report["in_flight"]
    assert all(in_flight["exact"]) and in_flight["same_tritonserver"], in_flight
    assert 1 <= in_flight["regions"] <= 2  # the rest went over the wire: their pages did not fit
    no_room = report["no_room"]  # a region whose pages cannot be reserved leaves nothing behind
    assert no_room["refused"] and no_room["free_after"] == no_room["free_before"], no_room

