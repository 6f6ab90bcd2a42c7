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


# -- the protocol difference, in one place -----------------------------------------------------


class HttpAdapter:
    """tritonclient.http: requests are gevent greenlets, a result is fetched with ``get_result``."""

    module = tritonclient.http

    def connect(self, url: str, max_concurrency: int) -> Any:
        return tritonclient.http.InferenceServerClient(url, concurrency=max_concurrency)

    def submit(self, client: Any, model: str, inputs: list[Any], outputs: list[Any]) -> Waiter:
        return client.async_infer(model, inputs, outputs=outputs).get_result

    def output_shape(self, result: Any, name: str) -> list[int]:
        return list(result.get_output(name)["shape"])

    def model_config(self, client: Any, model: str) -> dict[str, Any]:
        return client.get_model_config(model)


class GrpcAdapter:
    """tritonclient.grpc: results arrive on a callback thread; a Future hands them over."""

    module = tritonclient.grpc

    def connect(self, url: str, max_concurrency: int) -> Any:
        return tritonclient.grpc.InferenceServerClient(url)

    def submit(self, client: Any, model: str, inputs: list[Any], outputs: list[Any]) -> Waiter:
        future: Future[Any] = Future()

        def done(result: Any, error: Exception | None) -> None:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        client.async_infer(model, inputs, done, outputs=outputs)
        return future.result

    def output_shape(self, result: Any, name: str) -> list[int]:
        return list(result.get_output(name).shape)

    def model_config(self, client: Any, model: str) -> dict[str, Any]:
        return client.get_model_config(model, as_json=True)["config"]


ADAPTERS: dict[str, type[HttpAdapter] | type[GrpcAdapter]] = {"http": HttpAdapter, "grpc": GrpcAdapter}


# -- shared memory -----------------------------------------------------------------------------


class ShmRegion:
    """One system shared-memory region, created here and registered with the server under one name;
    ``headers`` go with both calls (the admin key, where the server restricts shared memory)."""

    def __init__(self, client: Any, byte_size: int, headers: dict[str, str] | None = None) -> None:
        self.name = f"kimi_vision_{uuid.uuid4().hex}"
        self.key = f"/{self.name}"
        self.byte_size = byte_size
        self.headers = headers
        self.handle = shm.create_shared_memory_region(self.name, self.key, byte_size, create_only=True)
        try:
            client.register_system_shared_memory(self.name, self.key, byte_size, headers=headers)
        except Exception:
            shm.destroy_shared_memory_region(self.handle)
            raise

    def release(self, client: Any) -> None:
        """Unregister from the server (best effort: it may be gone) and unlink locally."""
        try:
            client.unregister_system_shared_memory(self.name, headers=self.headers)
        finally:
            shm.destroy_shared_memory_region(self.handle)


class ShmSlot:
    """An input and an output region for one in-flight request; grown on demand, reused after."""

    def __init__(self, headers: dict[str, str] | None = None) -> None:
        self.headers = headers
        self.input: ShmRegion | None = None
        self.output: ShmRegion | None = None

    def fit(self, client: Any, input_bytes: int, output_bytes: int) -> None:
        """Make both regions at least this large (re-registering a region that is too small)."""
        for attr, byte_size in (("input", input_bytes), ("output", max(output_bytes, 1))):
            region: ShmRegion | None = getattr(self, attr)
            if region is not None and region.byte_size >= byte_size:
                continue
            # Forget the old region before releasing it, so a failure below never releases it twice.
            setattr(self, attr, None)
            if region is not None:
                region.release(client)
            setattr(self, attr, ShmRegion(client, -(-byte_size // SHM_ALIGNMENT) * SHM_ALIGNMENT, self.headers))

    def release(self, client: Any) -> None:
        for region in (self.input, self.output):
            if region is not None:
                region.release(client)
        self.input = self.output = None
