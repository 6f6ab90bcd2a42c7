"""What differs between tritonclient's HTTP and gRPC clients, and client-side shared memory.

:data:`ADAPTERS` holds one adapter per protocol (connect, submit, output shape, model config);
:class:`ShmSlot` is one in-flight request's input and output regions of system shared memory.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import tritonclient.grpc
import tritonclient.http
import tritonclient.utils.shared_memory as shm

Waiter = Callable[[], Any]  # returns the result, or raises the server's error
SHM_ALIGNMENT = 1 << 16  # regions grow in 64 KiB steps so small size changes reuse them
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1  # tritonclient's own limit: no message is refused for its size
MAX_RECONNECT_BACKOFF_MS = 1000  # a restarted server is found again within a second


# -- the protocol difference, in one place -----------------------------------------------------


def queue_timeout_us(timeout_s: float | None) -> int | None:
    """Triton's per-request timeout (microseconds) for a client deadline: a request still queued
    when its client has given up is dropped (models allow a shorter timeout than their default)."""
    return None if timeout_s is None else max(1, int(timeout_s * 1e6))


class HttpAdapter:
    """tritonclient.http: requests are gevent greenlets, a result is fetched with ``get_result``.
    ``timeout_s``: the deadline of each call (the connection's network timeout)."""

    module = tritonclient.http

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s

    def connect(self, url: str, max_concurrency: int, round_robin: bool = False) -> Any:
        if self.timeout_s is None:
            return tritonclient.http.InferenceServerClient(url, concurrency=max_concurrency)
        return tritonclient.http.InferenceServerClient(
            url, concurrency=max_concurrency, connection_timeout=self.timeout_s, network_timeout=self.timeout_s
        )

    def call_options(self) -> dict[str, Any]:
        """Keyword arguments that bound a management call (the connection's timeout does here)."""
        return {}

    def submit(self, client: Any, model: str, inputs: list[Any], outputs: list[Any]) -> Waiter:
        timeout = queue_timeout_us(self.timeout_s)
        return client.async_infer(model, inputs, outputs=outputs, timeout=timeout).get_result

    def output_shape(self, result: Any, name: str) -> list[int]:
        return list(result.get_output(name)["shape"])

    def model_config(self, client: Any, model: str) -> dict[str, Any]:
        return client.get_model_config(model)


class GrpcAdapter:
    """tritonclient.grpc: results arrive on a callback thread; a Future hands them over.
    ``timeout_s``: the deadline of each call (gRPC's, ``DEADLINE_EXCEEDED`` past it)."""

    module = tritonclient.grpc

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s

    def call_options(self) -> dict[str, Any]:
        """Keyword arguments that bound a management call (gRPC's deadline)."""
        return {} if self.timeout_s is None else {"client_timeout": self.timeout_s}

    def connect(self, url: str, max_concurrency: int, round_robin: bool = False) -> Any:
        """A client of ``url`` (a target of several servers: each request to one, by gRPC's
        ``round_robin`` policy when asked)."""
        return tritonclient.grpc.InferenceServerClient(url, channel_args=channel_args(round_robin))

    def submit(self, client: Any, model: str, inputs: list[Any], outputs: list[Any]) -> Waiter:
        future: Future[Any] = Future()

        def done(result: Any, error: Exception | None) -> None:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        timeout = queue_timeout_us(self.timeout_s)
        client.async_infer(model, inputs, done, outputs=outputs, timeout=timeout, client_timeout=self.timeout_s)
        return future.result

    def output_shape(self, result: Any, name: str) -> list[int]:
        return list(result.get_output(name).shape)

    def model_config(self, client: Any, model: str) -> dict[str, Any]:
        return client.get_model_config(model, as_json=True)["config"]


def channel_args(round_robin: bool = False) -> list[tuple[str, Any]]:
    """tritonclient's own gRPC channel options (unlimited messages, its keepalive defaults), and a
    reconnect backoff capped at :data:`MAX_RECONNECT_BACKOFF_MS`: gRPC's default grows to 120 s, so
    a client would keep failing long after a restarted server is back. ``round_robin``: each
    request to the next connected address of the target (gRPC's default sticks to the first)."""
    keepalive = tritonclient.grpc.KeepAliveOptions()
    balance = [("grpc.lb_policy_name", "round_robin")] if round_robin else []
    return [
        *balance,
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS // 4),
        ("grpc.min_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS // 4),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


ADAPTERS: dict[str, type[HttpAdapter] | type[GrpcAdapter]] = {"http": HttpAdapter, "grpc": GrpcAdapter}


# -- shared memory -----------------------------------------------------------------------------


class ShmRegion:
    """One system shared-memory region, created here and registered with the server under one name;
    ``headers`` go with both calls (the admin key, where the server restricts shared memory), and
    ``options`` (the adapter's :meth:`~GrpcAdapter.call_options`: a deadline)."""

    def __init__(
        self, client: Any, byte_size: int, headers: dict[str, str] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        self.name = f"kimi_vision_{uuid.uuid4().hex}"
        self.key = f"/{self.name}"
        self.byte_size = byte_size
        self.headers = headers
        self.options = options or {}
        self.handle = shm.create_shared_memory_region(self.name, self.key, byte_size, create_only=True)
        try:
            client.register_system_shared_memory(self.name, self.key, byte_size, headers=headers, **self.options)
        except Exception:
            shm.destroy_shared_memory_region(self.handle)
            raise

    def release(self, client: Any) -> None:
        """Unregister from the server (best effort: it may be gone) and unlink locally."""
        try:
            self.unregister(client)
        finally:
            self.forget()

    def unregister(self, client: Any) -> None:
        """Ask the server to unmap the region."""
        client.unregister_system_shared_memory(self.name, headers=self.headers, **self.options)

    def forget(self) -> None:
        """Unlink and unmap the region here only (a server that still maps it keeps its mapping
        until :meth:`unregister`)."""
        shm.destroy_shared_memory_region(self.handle)


class ShmSlot:
    """An input and an output region for one in-flight request; grown on demand, reused after."""

    def __init__(self, headers: dict[str, str] | None = None, options: dict[str, Any] | None = None) -> None:
        self.headers = headers
        self.options = options
        self.input: ShmRegion | None = None
        self.output: ShmRegion | None = None

    def fit(self, client: Any, input_bytes: int, output_bytes: int) -> list[ShmRegion]:
        """Make both regions at least this large: a region too small is replaced by a larger one.
        Returns the replaced regions, unlinked here but still registered: the server may hold one
        a moment after it answered the request that used it (it lets go when it releases the
        request), so the caller unregisters them later."""
        replaced = []
        for attr, byte_size in (("input", input_bytes), ("output", max(output_bytes, 1))):
            region: ShmRegion | None = getattr(self, attr)
            if region is not None and region.byte_size >= byte_size:
                continue
            # Forget the old region before replacing it, so a failure below never releases it twice.
            setattr(self, attr, None)
            if region is not None:
                region.forget()
                replaced.append(region)
            size = -(-byte_size // SHM_ALIGNMENT) * SHM_ALIGNMENT
            setattr(self, attr, ShmRegion(client, size, self.headers, self.options))
        return replaced

    def detach(self) -> list[ShmRegion]:
        """The slot's regions, the slot left without them."""
        regions, self.input, self.output = [self.input, self.output], None, None
        return [region for region in regions if region is not None]

    def release(self, client: Any) -> None:
        """Unregister and unlink both regions (each unlinked here even where the server fails;
        the first failure raised after)."""
        failures = []
        for region in self.detach():
            try:
                region.release(client)
            except Exception as exc:  # the server's failure, whatever its transport calls it
                failures.append(exc)
        if failures:
            raise failures[0]
