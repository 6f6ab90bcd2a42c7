"""One deadline per call, end to end, and the server's faults retried within it: a real
``kimi-prep serve`` stalled (SIGSTOP to tritonserver) or with its decode stub stopped.

A call returns by its deadline, plus a slack, with ``DeadlineExceededError``, whatever the number of
images, waves of ``concurrency`` or resends, on first use and on a fresh thread; ``close()`` is
bounded too. :data:`SLACK_S` is generous (a busy 2-core host): what it proves is that no wave,
resend or first-use call got a budget of its own, each of which would add a whole deadline.

A stub that stopped answering makes Triton answer "Stub process ... is not healthy": a fault of the
server, retried while the deadline lasts and answered by the fallback where one is set, never the
caller's bad input.

The times the callers saw are printed (``pytest -s``) for the closing notes and docs/library.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from make_inputs import (
    CORPUS,
    SERVE_START_BUDGET_S,
    ServeProcess,
    children,
    free_loopback_port,
    served,
)

from kimi_vision_client.client import CLOSE_DEADLINE_S, KimiVisionClient
from kimi_vision_client.remote_processor import RemoteKimiProcessor
from kimi_vision_common.errors import DeadlineExceededError, PreprocessError
from kimi_vision_prep import KimiVisionProcessor

pytestmark = pytest.mark.server

MODEL = "kimi_k25_vision_u8"
DECODE_STEP = "kimi_k25_decode"
UINT8 = {"do_rescale": False, "do_normalize": False}
DEADLINE_S = 2.0
SLACK_S = 2.0  # past the deadline a busy host may take to return; one more wave would take DEADLINE_S
IMAGES, CONCURRENCY = 24, 8  # three waves
FAILSAFE_S = 120.0  # a call that never returns fails its test instead of hanging it


@pytest.fixture(scope="module")
def serve() -> Iterator[ServeProcess]:
    with served("--models", MODEL, "--instances", "1", "--threads", "1", "--response-cache-mib", "0") as server:
        yield server


@pytest.fixture(scope="module")
def photo() -> tuple[bytes, np.ndarray]:
    data = (CORPUS / "sklearn__china.jpg").read_bytes()
    return data, KimiVisionProcessor().preprocess({"type": "image", "image": data}, **UINT8)["pixel_values"]


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """``pid`` (tritonserver) stopped (SIGSTOP) for the block, as a server stuck in a loop is, then
    resumed."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # replaced meanwhile (the watchdog)
            os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def stub_stopped(pid: int) -> Iterator[None]:
    """A stub stopped (SIGSTOP) for the block and never resumed: ended (SIGKILL) after it unless the
    watchdog ended it already. A stub thawed after the Python backend failed a request on it
    crashes, and tritonserver with it (docs/faults.md, step 6)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # the watchdog ended it meanwhile
            os.kill(pid, signal.SIGKILL)


def stub_pid(serve: ServeProcess, model: str) -> int:
    """The Python backend stub of ``model``'s first instance."""
    for pid in children(serve.tritonserver_pid(), "triton_python_backend_stub"):
        if f"{model}_0_0" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
    raise AssertionError(f"no stub of {model}")


def in_a_new_thread(call: Callable[[], Any]) -> tuple[float, Any]:
    """``call()`` run in a thread of its own: (seconds it took, what it returned or raised)."""
    outcome: list[Any] = []

    def run() -> None:
        started = time.monotonic()
        try:
            result: Any = call()
        except BaseException as exc:  # the outcome under test
            result = exc
        outcome.append((time.monotonic() - started, result))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(FAILSAFE_S)
    assert outcome, f"the call did not return within {FAILSAFE_S:g} s"
    return outcome[0]


def images(data: bytes, count: int) -> list[dict[str, Any]]:
    return [{"type": "image", "image": data} for _ in range(count)]


def test_a_call_of_several_waves_ends_by_its_one_deadline(serve: ServeProcess, photo: tuple) -> None:
    """24 images, 8 in flight, a stalled server: the call ends with DeadlineExceededError by its
    deadline; the later waves are not sent with budgets of their own."""
    data, expected = photo
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=DEADLINE_S, concurrency=CONCURRENCY)
    assert np.array_equal(remote.preprocess(images(data, 1), **UINT8)["pixel_values"], expected)
    with stopped(serve.tritonserver_pid()):
        took, outcome = in_a_new_thread(lambda: remote.preprocess(images(data, IMAGES), **UINT8))
    print(f"\n{IMAGES} images, {CONCURRENCY} in flight, stalled server: {type(outcome).__name__} after {took:.2f} s")
    assert isinstance(outcome, DeadlineExceededError) and serve.grpc_url in str(outcome)
    assert took < DEADLINE_S + SLACK_S
    remote.deadline_s = SERVE_START_BUDGET_S
    got = remote.preprocess(images(data, IMAGES), **UINT8)["pixel_values"]
    assert np.array_equal(got, np.concatenate([expected] * IMAGES))  # exact again once it resumes
    remote.close()


@pytest.mark.parametrize("warm", [False, True], ids=["first-use", "warm-processor"])
def test_a_new_thread_ends_by_its_deadline(serve: ServeProcess, photo: tuple, warm: bool) -> None:
    """A fresh processor (the models' readiness and config not asked yet), or a used one called
    from a thread it has no connection for: against a stalled server, every call it makes gets the
    time left of the deadline."""
    data, expected = photo
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=DEADLINE_S)
    if warm:
        assert np.array_equal(remote.preprocess(images(data, 1), **UINT8)["pixel_values"], expected)
    with stopped(serve.tritonserver_pid()):
        took, outcome = in_a_new_thread(lambda: remote.preprocess(images(data, 1), **UINT8))
    kind = "warm" if warm else "first use"
    print(f"\n{kind}, new thread, stalled server: {type(outcome).__name__} after {took:.2f} s")
    assert isinstance(outcome, DeadlineExceededError), outcome
    assert took < DEADLINE_S + SLACK_S
    remote.close()


def test_resends_to_other_replicas_end_by_the_deadline(serve: ServeProcess, photo: tuple) -> None:
    """Two replicas, one refusing connections and one stalled: requests refused by the first are
    resent to the second, and the call still ends by its deadline."""
    data, _ = photo
    url = f"{serve.grpc_url},127.0.0.1:{free_loopback_port()}"
    remote = RemoteKimiProcessor(url=url, deadline_s=DEADLINE_S, concurrency=CONCURRENCY)
    with stopped(serve.tritonserver_pid()):
        took, outcome = in_a_new_thread(lambda: remote.preprocess(images(data, IMAGES), **UINT8))
    print(f"\nrefusing + stalled replicas: {type(outcome).__name__} after {took:.2f} s")
    assert isinstance(outcome, DeadlineExceededError), outcome
    assert took < DEADLINE_S + SLACK_S
    remote.close()


def test_the_client_door_keeps_a_calls_deadline(serve: ServeProcess, photo: tuple) -> None:
    """``KimiVisionClient.infer_many(deadline=...)``: every image not answered by the deadline is a
    DeadlineExceededError, all by the deadline; after it, the client answers exactly again."""
    data, _ = photo
    client = KimiVisionClient(serve.grpc_url, "grpc", MODEL)
    with stopped(serve.tritonserver_pid()):
        took, outcome = in_a_new_thread(lambda: client.infer_many([data] * IMAGES, CONCURRENCY, deadline=DEADLINE_S))
    kinds = sorted({type(r).__name__ for r in outcome})
    print(f"\nclient, {IMAGES} images, stalled server: {kinds} after {took:.2f} s")
    assert len(outcome) == IMAGES and all(isinstance(r, DeadlineExceededError) for r in outcome)
    assert took < DEADLINE_S + SLACK_S
    local = KimiVisionProcessor().preprocess(images(data, 1))["pixel_values"]
    assert np.array_equal(client.infer(data, deadline=SERVE_START_BUDGET_S).pixel_values, local)
    client.close()


def test_close_is_bounded_against_a_stalled_server(serve: ServeProcess, photo: tuple) -> None:
    """Shared-memory regions registered by several threads, then the server stalls: ``close()``
    unlinks them all here and returns within its deadline."""
    data, _ = photo
    # The calls that register the regions have all the time a busy host needs: what is bounded here
    # is close(), by CLOSE_DEADLINE_S, whatever the processor's deadline.
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=SERVE_START_BUDGET_S, concurrency=CONCURRENCY)
    # The barrier waits past the calls' own budget: a call that fails reports its own error.
    called, done = threading.Barrier(5, timeout=SERVE_START_BUDGET_S + FAILSAFE_S), threading.Event()
    failed: list[BaseException] = []

    def call_and_hold() -> None:
        try:
            remote.preprocess(images(data, CONCURRENCY), **UINT8)
        except BaseException as exc:  # reported by the test, not lost in the thread
            failed.append(exc)
        called.wait()
        done.wait(FAILSAFE_S)  # the thread lives on, idle, while close() runs: four connections at once

    threads = [threading.Thread(target=call_and_hold) for _ in range(4)]
    for thread in threads:
        thread.start()
    called.wait()
    assert not failed, failed
    regions = remote.shared_memory_regions
    assert len(regions) >= 4
    with stopped(serve.tritonserver_pid()):
        took, outcome = in_a_new_thread(remote.close)
    done.set()
    for thread in threads:
        thread.join(FAILSAFE_S)
    print(f"\nclose() of {len(regions)} regions, stalled server: {took:.2f} s")
    assert outcome is None and took < CLOSE_DEADLINE_S + SLACK_S
    assert not any(Path(f"/dev/shm/{name}").exists() for name in regions)


def test_a_stub_that_stopped_answering_is_retried_within_the_deadline(
    serve: ServeProcess, photo: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    """The decode step's stub stopped: Triton answers "Stub process ... is not healthy" (then, while
    the watchdog replaces the stub, that the model is reloading), a fault of the server
    (ModelRestartingError), asked again while the deadline lasts; once the new stub answers, the
    call returns the exact pixels."""
    data, expected = photo
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=SERVE_START_BUDGET_S)
    assert np.array_equal(remote.preprocess(images(data, 1), **UINT8)["pixel_values"], expected)
    caplog.set_level(logging.DEBUG, logger="kimi_vision_client.remote")
    with stub_stopped(stub_pid(serve, DECODE_STEP)):
        took, outcome = in_a_new_thread(lambda: answer(remote, data))
    retries = [r.getMessage() for r in caplog.records if "asking again" in r.getMessage()]
    print(f"\nstopped stub: answered after {took:.2f} s, {len(retries)} retries, first: {retries[:1]}")
    assert any("ModelRestartingError" in message for message in retries), retries
    assert isinstance(outcome, np.ndarray) and np.array_equal(outcome, expected), outcome
    remote.close()
    serving_again(serve, photo)


def test_a_stub_that_stopped_answering_is_answered_by_the_fallback(serve: ServeProcess, photo: tuple) -> None:
    """The same fault with a fallback and a deadline shorter than the stub's replacement: the call
    is answered in process, exactly, and counted."""
    data, expected = photo
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=1.0, fallback=KimiVisionProcessor())
    with stub_stopped(stub_pid(serve, DECODE_STEP)):
        _, outcome = in_a_new_thread(lambda: answer(remote, data))
    assert isinstance(outcome, np.ndarray) and np.array_equal(outcome, expected)
    assert remote.fallbacks == 1
    remote.close()
    serving_again(serve, photo)


def serving_again(serve: ServeProcess, photo: tuple) -> None:
    """Until the server answers exactly again (the watchdog replaces an ended stub), so that the
    next test meets a healthy one."""
    data, expected = photo
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=SERVE_START_BUDGET_S)
    assert np.array_equal(answer(remote, data), expected)
    remote.close()


def answer(remote: RemoteKimiProcessor, data: bytes, count: int = 1) -> np.ndarray | PreprocessError:
    try:
        return remote.preprocess(images(data, count), **UINT8)["pixel_values"]
    except PreprocessError as exc:
        return exc


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_client_keeps_a_calls_deadline_and_a_bounded_close_over_both_protocols(
    serve: ServeProcess, photo: tuple, protocol: str
) -> None:
    """A ``KimiVisionClient`` that has answered once (its model's wire known), then a stalled
    server, over HTTP and gRPC: ``infer`` and ``preprocess_images`` given a deadline end by it with
    DeadlineExceededError (the requests themselves waited on); ``close()``, its requests still
    running on the server, within its own. One thread makes every call (an HTTP client is its
    thread's)."""
    data, _ = photo
    url = f"127.0.0.1:{serve.ports[0]}" if protocol == "http" else serve.grpc_url
    answered, stalled = threading.Event(), threading.Event()
    seen: dict[str, tuple[float, Any]] = {}

    def scenario() -> None:
        client = KimiVisionClient(url, protocol, MODEL)
        seen["warm"] = (0.0, client.infer(data, deadline=SERVE_START_BUDGET_S))
        answered.set()
        stalled.wait(FAILSAFE_S)
        calls = {
            "infer": lambda: client.infer(data, deadline=DEADLINE_S),
            "preprocess_images": lambda: client.preprocess_images([data, data], deadline=DEADLINE_S),
            "close": client.close,
        }
        for name, call in calls.items():
            started = time.monotonic()
            try:
                outcome: Any = call()
            except PreprocessError as exc:
                outcome = exc
            seen[name] = (time.monotonic() - started, outcome)

    worker = threading.Thread(target=scenario)
    worker.start()
    assert answered.wait(FAILSAFE_S), seen
    with stopped(serve.tritonserver_pid()):
        stalled.set()
        worker.join(FAILSAFE_S)
    print(
        f"\n{protocol}, stalled server: " + ", ".join(f"{k} {type(v).__name__} {t:.2f} s" for k, (t, v) in seen.items())
    )
    for name in ("infer", "preprocess_images"):
        took, outcome = seen[name]
        assert isinstance(outcome, DeadlineExceededError), (name, outcome)
        assert took < DEADLINE_S + SLACK_S
    took, outcome = seen["close"]
    assert outcome is None and took < CLOSE_DEADLINE_S + SLACK_S


def test_a_resend_keeps_the_calls_deadline(serve: ServeProcess, photo: tuple) -> None:
    """Two replicas, the first refusing connections, the other stalled: ``preprocess_images`` is
    sent again to the stalled one and still ends by its deadline."""
    data, _ = photo
    client = KimiVisionClient(f"127.0.0.1:{free_loopback_port()},{serve.grpc_url}", "grpc", MODEL)
    with stopped(serve.tritonserver_pid()):
        took, outcome = in_a_new_thread(lambda: client.preprocess_images([data, data], deadline=DEADLINE_S))
    print(f"\nrefusing + stalled replicas, preprocess_images: {type(outcome).__name__} after {took:.2f} s")
    assert isinstance(outcome, DeadlineExceededError) and took < DEADLINE_S + SLACK_S
    client.close()


def test_a_dead_first_replica_does_not_fail_a_first_request(serve: ServeProcess, photo: tuple) -> None:
    """A fresh client of two replicas, the first refusing connections: its first requests (the
    model's config asked of the dead one first) are sent again to the live one, exactly."""
    data, _ = photo
    expected = KimiVisionProcessor().preprocess(images(data, 1))["pixel_values"]
    with KimiVisionClient(f"127.0.0.1:{free_loopback_port()},{serve.grpc_url}", "grpc", MODEL) as client:
        results = client.infer_many([data] * 4, concurrency=2, deadline=SERVE_START_BUDGET_S)
    assert all(not isinstance(r, PreprocessError) and np.array_equal(r.pixel_values, expected) for r in results)


def test_close_while_another_thread_is_mid_call_leaves_that_call_whole(serve: ServeProcess, photo: tuple) -> None:
    """``close()`` from one thread while another's call waits on a stalled server: close returns
    within its deadline without touching the busy connection (its regions may be being read); the
    call, once the server resumes, answers exactly, and its connection is closed after it."""
    data, expected = photo
    remote = RemoteKimiProcessor(url=serve.grpc_url, deadline_s=SERVE_START_BUDGET_S, concurrency=CONCURRENCY)
    outcome: list[Any] = []
    caller = threading.Thread(target=lambda: outcome.append(answer(remote, data, CONCURRENCY)))
    with stopped(serve.tritonserver_pid()):
        caller.start()
        give_up = time.monotonic() + SERVE_START_BUDGET_S
        while not remote._connections.clients:  # the caller's connection made: its call is under way
            assert time.monotonic() < give_up and caller.is_alive(), outcome
            time.sleep(0.01)
        took, closed = in_a_new_thread(remote.close)
    caller.join(FAILSAFE_S)
    print(f"\nclose() beside a call in flight: {took:.2f} s")
    assert closed is None and took < CLOSE_DEADLINE_S + SLACK_S
    assert outcome and isinstance(outcome[0], np.ndarray), outcome
    assert np.array_equal(outcome[0], np.concatenate([expected] * CONCURRENCY))
    give_up = time.monotonic() + SERVE_START_BUDGET_S
    while remote._connections.clients:  # closed by its thread once its call was done
        assert time.monotonic() < give_up, "the busy connection was never closed"
        time.sleep(0.01)
