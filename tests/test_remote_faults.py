"""Faults seen through the remote processor: a real ``kimi-prep serve`` (a subprocess) stalled,
restarted, overloaded and killed under load from several threads. A call answers exactly or raises
the server's unavailability as a typed error naming the server, within its deadline; nothing is
answered wrong; a server that comes back is used again by the same processor; with a fallback the
call is answered in process, counted and logged once.

The times at which the callers saw what are printed (``pytest -s``) for docs/library.md's account.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from make_inputs import CORPUS, SERVE_START_BUDGET_S, ServeProcess, served

from kimi_vision_client.remote_processor import RemoteKimiProcessor
from kimi_vision_common.errors import (
    DeadlineExceededError,
    ModelNotServedError,
    PreprocessError,
    ServerUnavailableError,
)
from kimi_vision_prep import KimiVisionProcessor

pytestmark = pytest.mark.server

MODEL = "kimi_k25_vision_u8"
PHOTOS = ["pil__hopper.jpg", "sklearn__china.jpg", "pil__hopper_gray.jpg", "sklearn__flower.jpg", "pilx__hopper.bmp"]
UINT8 = {"do_rescale": False, "do_normalize": False}
THREADS = 4  # callers of one processor at once
DEADLINE_S = 2.0  # the processors' deadline where a fault is expected
AT_ONCE = 300  # requests of the overload test's one call


@pytest.fixture(scope="module")
def serve() -> Iterator[ServeProcess]:
    with served("--models", MODEL, "--instances", "1", "--threads", "1") as server:
        yield server


@pytest.fixture(scope="module")
def photos() -> dict[str, tuple[bytes, np.ndarray]]:
    """Each photo's bytes and its uint8 patches in process."""
    local = KimiVisionProcessor()
    out = {}
    for name in PHOTOS:
        data = (CORPUS / name).read_bytes()
        out[name] = (data, local.preprocess({"type": "image", "image": data}, **UINT8)["pixel_values"])
    return out


@dataclass
class Load:
    """Threads calling one processor with the photos in turn, recording each call's outcome and when."""

    processor: RemoteKimiProcessor
    photos: dict[str, tuple[bytes, np.ndarray]]
    threads: int = THREADS
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[tuple[float, str, str]] = field(default_factory=list)  # (time, photo, "exact" | class name)
    last_error: str = ""  # the message of the last error a call raised
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.workers = [threading.Thread(target=self.run, args=(i,)) for i in range(self.threads)]

    def run(self, index: int) -> None:
        names = list(self.photos)
        turn = index
        while not self.stop.is_set():
            name = names[turn % len(names)]
            turn += 1
            data, expected = self.photos[name]
            try:
                got = self.processor.preprocess({"type": "image", "image": data}, **UINT8)["pixel_values"]
                seen = "exact" if got.dtype == expected.dtype and np.array_equal(got, expected) else "WRONG"
            except PreprocessError as exc:
                named = self.processor.url in str(exc)
                seen = type(exc).__name__ if named else f"{type(exc).__name__} not naming the server: {exc}"
                self.last_error = str(exc)
            with self.lock:
                self.outcomes.append((time.monotonic(), name, seen))

    def __enter__(self) -> Load:
        for worker in self.workers:
            worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for worker in self.workers:
            worker.join()

    def count(self, seen: str, since: float = 0.0) -> int:
        with self.lock:
            return sum(1 for at, _, what in self.outcomes if what == seen and at >= since)

    def wait_for(self, seen: str, count: int, since: float = 0.0) -> None:
        give_up = time.monotonic() + SERVE_START_BUDGET_S
        while self.count(seen, since) < count:
            if time.monotonic() > give_up:
                pytest.fail(f"not {count} {seen} outcomes: {self.summary(since)}")
            time.sleep(0.05)

    def summary(self, since: float = 0.0) -> dict[str, int]:
        with self.lock:
            kinds = [what for at, _, what in self.outcomes if at >= since]
        return {kind: kinds.count(kind) for kind in sorted(set(kinds))}

    def first(self, seen: str, since: float) -> float:
        with self.lock:
            return min(at for at, _, what in self.outcomes if what == seen and at >= since) - since


def report(what: str, load: Load, since: float, **times: float) -> None:
    print(f"\n{what}: outcomes since the fault {load.summary(since)}; " + ", ".join(
        f"{name} {value:.2f} s" for name, value in times.items()
    ))


def test_a_chunk_to_a_server_without_the_chunk_model_names_the_flag(serve: ServeProcess) -> None:
    remote = RemoteKimiProcessor(url=serve.grpc_url)
    frame = (CORPUS / "pil__hopper.jpg").read_bytes()
    with pytest.raises(ModelNotServedError, match="--models kimi_k25_video_chunk"):
        remote.preprocess({"type": "video_chunk", "video_chunk": [frame, frame]})
    remote.close()


def test_an_overloaded_server_answers_every_request_of_a_call_exactly(serve: ServeProcess, photos: dict) -> None:
    """300 requests at once, more than the decode step's queue holds: any it turns away (UNAVAILABLE,
    no answer produced) are sent again, and every answer is the image's own."""
    remote = RemoteKimiProcessor(url=serve.grpc_url, concurrency=AT_ONCE, deadline_s=SERVE_START_BUDGET_S)
    names = [PHOTOS[i % len(PHOTOS)] for i in range(AT_ONCE)]
    medias = [{"type": "image", "image": photos[name][0]} for name in names]
    got = remote.preprocess(medias, **UINT8)["pixel_values"]
    assert np.array_equal(got, np.concatenate([photos[name][1] for name in names]))
    remote.close()


def test_a_stalled_server_fails_calls_at_their_deadline_and_answers_exactly_when_it_resumes(
    serve: ServeProcess, photos: dict
) -> None:
    """SIGSTOP to tritonserver under load (as a server stuck in a loop): every call ends with
    DeadlineExceededError naming the server; after SIGCONT every answer is exact (no request's
    output buffer was reused while the stalled server could still write it)."""
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=DEADLINE_S)
    pid = serve.tritonserver_pid()
    with Load(remote, photos) as load:
        load.wait_for("exact", 20)
        stalled = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            load.wait_for("DeadlineExceededError", 2 * load.threads, stalled)
        finally:
            resumed = time.monotonic()
            os.kill(pid, signal.SIGCONT)
        load.wait_for("exact", 20, resumed)
    report(
        "stalled",
        load,
        stalled,
        first_deadline_error=load.first("DeadlineExceededError", stalled),
        first_exact_after_resume=load.first("exact", resumed),
    )
    assert set(load.summary()) <= {"exact", "DeadlineExceededError"}, load.summary()
    remote.close()


def test_a_restarting_tritonserver_is_waited_for_within_the_deadline(serve: ServeProcess, photos: dict) -> None:
    """tritonserver killed: ``kimi-prep serve`` starts it again; a call given a deadline longer than
    the restart retries the refused connection until the new server answers, exactly."""
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=SERVE_START_BUDGET_S)
    data, expected = photos["sklearn__china.jpg"]
    assert np.array_equal(remote.preprocess({"type": "image", "image": data}, **UINT8)["pixel_values"], expected)
    killed = time.monotonic()
    os.kill(serve.tritonserver_pid(), signal.SIGKILL)
    got = remote.preprocess({"type": "image", "image": data}, **UINT8)["pixel_values"]
    print(f"\nrestarting: answered {time.monotonic() - killed:.2f} s after tritonserver was killed")
    assert np.array_equal(got, expected)
    remote.close()


def test_a_killed_server_fails_calls_with_its_typed_error_and_is_used_again_when_back(
    serve: ServeProcess, photos: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """The whole ``kimi-prep serve`` killed under load: each call, having asked again until its
    deadline, ends with DeadlineExceededError naming the server and the last fault (the connection
    refused: ConnectionLostError); with a fallback, calls are answered in process, exactly, counted,
    logged once; once a server is back on the address the same processor answers from it again."""
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=DEADLINE_S)
    backed = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=DEADLINE_S, fallback=KimiVisionProcessor())
    with Load(remote, photos) as load:
        load.wait_for("exact", 20)
        killed = time.monotonic()
        serve.kill()
        load.wait_for("DeadlineExceededError", 2 * load.threads, killed)
    report("killed", load, killed, first_unavailable=load.first("DeadlineExceededError", killed))
    assert set(load.summary()) <= {"exact", "DeadlineExceededError"}, load.summary()
    assert "ConnectionLostError" in load.last_error

    with caplog.at_level(logging.DEBUG, logger="kimi_vision_client.remote"):
        for name in PHOTOS:
            data, expected = photos[name]
            got = backed.preprocess({"type": "image", "image": data}, **UINT8)["pixel_values"]
            assert np.array_equal(got, expected), name
    assert backed.fallbacks == len(PHOTOS)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "kimi_vision_client.remote"]
    assert len(warnings) == 1 and serve.grpc_url in warnings[0].getMessage()

    serve.start()
    data, expected = photos["pil__hopper.jpg"]
    assert np.array_equal(remote.preprocess({"type": "image", "image": data}, **UINT8)["pixel_values"], expected)
    backed.preprocess({"type": "image", "image": data}, **UINT8)
    assert backed.fallbacks == len(PHOTOS), "a server that is back answers, not the fallback"
    remote.close()
    backed.close()


def test_unavailable_and_deadline_errors_are_one_family() -> None:
    """A caller catching ServerUnavailableError catches a deadline too (both: the server's state,
    not the request's fault)."""
    assert issubclass(DeadlineExceededError, ServerUnavailableError)
    assert not issubclass(ServerUnavailableError, DeadlineExceededError)
