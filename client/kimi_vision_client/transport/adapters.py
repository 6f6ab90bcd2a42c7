"""What differs between tritonclient's HTTP and gRPC clients, in one place.

:data:`ADAPTERS` holds one adapter per protocol. Every call takes its own ``timeout_s`` (the time
left of the caller's deadline, :mod:`.deadline`): gRPC bounds each call by it (its deadline);
tritonclient's HTTP calls take none, so the HTTP adapter bounds each with a gevent timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import gevent
import tritonclient.grpc
import tritonclient.http
import tritonclient.utils

from kimi_vision_common.errors import DeadlineExceededError

Waiter = Callable[[], Any]  # returns the result, or raises the server's error
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1  # tritonclient's own limit: no message is refused for its size
MAX_RECONNECT_BACKOFF_MS = 1000  # a restarted server is found again within a second
# How long past its own deadline a wait lasts for gRPC to report the deadline (its callback runs
# on gRPC's thread): the slack a call may return by after its deadline.
WAIT_GRACE_S = 0.25
# How long an HTTP client's close waits for its requests' greenlets to end once told to.
KILL_WAIT_S = 0.1
# The gRPC status a wait reports when gRPC itself did not (read by kimi_vision_common.faults).
DEADLINE_STATUS = "StatusCode.DEADLINE_EXCEEDED"


def queue_timeout_us(timeout_s: float | None) -> int | None:
    """Triton's per-request timeout (microseconds) for a client deadline: a request still queued
    when its client has given up is dropped (models allow a shorter timeout than their default)."""
    return None if timeout_s is None else max(1, int(timeout_s * 1e6))


class HttpAdapter:
    """tritonclient.http: requests are gevent greenlets, a result is fetched with ``get_result``.
    ``timeout_s``: the connection's network timeout; each call is bounded by its own ``timeout_s``
    too (a gevent timeout in the calling greenlet: tritonclient.http's calls take none)."""

    module = tritonclient.http
    protocol = "http"

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s

    def connect(self, url: str, max_concurrency: int) -> Any:
        if self.timeout_s is None:
            return tritonclient.http.InferenceServerClient(url, concurrency=max_concurrency)
        return tritonclient.http.InferenceServerClient(
            url, concurrency=max_concurrency, connection_timeout=self.timeout_s, network_timeout=self.timeout_s
        )

    def submit(self, client: Any, model: str, inputs: list[Any], outputs: list[Any], timeout_s: float | None) -> Waiter:
        request = client.async_infer(model, inputs, outputs=outputs, timeout=queue_timeout_us(timeout_s))
        wait = None if timeout_s is None else timeout_s + WAIT_GRACE_S
        return lambda: request.get_result(block=True, timeout=wait)

    def is_server_live(self, client: Any, timeout_s: float | None) -> bool:
        return within(timeout_s, client.is_server_live)

    def is_model_ready(self, client: Any, model: str, timeout_s: float | None) -> bool:
        return within(timeout_s, client.is_model_ready, model)

    def model_config(self, client: Any, model: str, timeout_s: float | None) -> dict[str, Any]:
        return within(timeout_s, client.get_model_config, model)

    def register_shm(
        self, client: Any, name: str, key: str, byte_size: int, *, headers: Any, timeout_s: float | None
    ) -> None:
        within(timeout_s, client.register_system_shared_memory, name, key, byte_size, headers=headers)

    def unregister_shm(self, client: Any, name: str, *, headers: Any, timeout_s: float | None) -> None:
        within(timeout_s, client.unregister_system_shared_memory, name, headers=headers)

    def close(self, client: Any, timeout_s: float | None) -> None:
        """Close ``client``: tritonclient.http waits for its requests still running, here at most
        ``timeout_s``; past it their greenlets are ended and its connections closed at once (through
        the client's pool and connection stub, which its own close would reach only after them)."""
        try:
            within(timeout_s, client.close)
        except DeadlineExceededError:
            client._pool.kill(block=True, timeout=KILL_WAIT_S)  # the greenlets run in this thread's hub
            client._client_stub.close()

    def output_shape(self, result: Any, name: str) -> list[int]:
        return list(result.get_output(name)["shape"])


def within(timeout_s: float | None, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` (a tritonclient.http call), :class:`DeadlineExceededError` past
    ``timeout_s`` (None: no bound)."""
    if timeout_s is None:
        return call(*args, **kwargs)
    with gevent.Timeout(timeout_s, DeadlineExceededError(f"no answer within {timeout_s:.3g} s")):
        return call(*args, **kwargs)


class GrpcAdapter:
    """tritonclient.grpc: results arrive on a callback thread; a Future hands them over. Every call
    is bounded by its ``timeout_s`` (gRPC's deadline, ``DEADLINE_EXCEEDED`` past it)."""

    module = tritonclient.grpc
    protocol = "grpc"

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s

    def connect(self, url: str, max_concurrency: int) -> Any:
        """A client of the server at ``url`` (a name: gRPC tries each of its addresses)."""
        return tritonclient.grpc.InferenceServerClient(url, channel_args=channel_args())

    def submit(self, client: Any, model: str, inputs: list[Any], outputs: list[Any], timeout_s: float | None) -> Waiter:
        future: Future[Any] = Future()

        def done(result: Any, error: Exception | None) -> None:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        timeout = queue_timeout_us(timeout_s)
        client.async_infer(model, inputs, done, outputs=outputs, timeout=timeout, client_timeout=timeout_s)

        def wait() -> Any:
            try:
                return future.result(None if timeout_s is None else timeout_s + WAIT_GRACE_S)
            except FutureTimeout:  # gRPC did not report its own deadline in time
                raise tritonclient.utils.InferenceServerException("Deadline Exceeded", status=DEADLINE_STATUS) from None

        return wait

    def is_server_live(self, client: Any, timeout_s: float | None) -> bool:
        return client.is_server_live(client_timeout=timeout_s)

    def is_model_ready(self, client: Any, model: str, timeout_s: float | None) -> bool:
        return client.is_model_ready(model, client_timeout=timeout_s)

    def model_config(self, client: Any, model: str, timeout_s: float | None) -> dict[str, Any]:
        return client.get_model_config(model, as_json=True, client_timeout=timeout_s)["config"]

    def register_shm(
        self, client: Any, name: str, key: str, byte_size: int, *, headers: Any, timeout_s: float | None
    ) -> None:
        client.register_system_shared_memory(name, key, byte_size, headers=headers, client_timeout=timeout_s)

    def unregister_shm(self, client: Any, name: str, *, headers: Any, timeout_s: float | None) -> None:
        client.unregister_system_shared_memory(name, headers=headers, client_timeout=timeout_s)

    def close(self, client: Any, timeout_s: float | None) -> None:
        """Close ``client`` (gRPC cancels what is still running on it)."""
        client.close()

    def output_shape(self, result: Any, name: str) -> list[int]:
        return list(result.get_output(name).shape)


def channel_args() -> list[tuple[str, Any]]:
    """tritonclient's own gRPC channel options (unlimited messages, its keepalive defaults), and a
    reconnect backoff capped at :data:`MAX_RECONNECT_BACKOFF_MS`: gRPC's default grows to 120 s, so
    a client would keep failing long after a restarted server is back. (Not
    ``grpc.min_reconnect_backoff_ms``: gRPC takes it as the connect timeout too, and a busy server
    that takes longer to answer the handshake would be called unreachable; each call's deadline
    bounds a connection attempt instead.)"""
    keepalive = tritonclient.grpc.KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS // 4),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


ADAPTERS: dict[str, type[HttpAdapter] | type[GrpcAdapter]] = {"http": HttpAdapter, "grpc": GrpcAdapter}
