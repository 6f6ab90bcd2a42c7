"""A Triton client for the Kimi vision preprocessing models, one API over HTTP and gRPC.

The models take ``IMAGE_BYTES`` ``[1, K]`` and return ``PIXEL_VALUES`` float32 (or, on the uint8
wire, ``PIXEL_PATCHES``) ``[1, ΣN, 3, p, p]``, ``GRID_THW`` int64 ``[1, K, 3]`` and ``NUM_TOKENS``
int32 ``[1, K]`` (:mod:`.request.outputs`). :class:`KimiVisionClient` hides the batch dimension,
expands uint8 patches bit-equal to the float32 ensemble, and raises a server's error as the class
the library raises in process (:mod:`.transport.server_errors`). The wire and the preset are learnt
from the server's model configs on first use (:func:`learn_wire`); the client keeps no table of
models.

:class:`KimiVisionClient` is the front: the transport (:mod:`.transport`), a request's data and its
shared-memory slots (:mod:`.request`), and the servers it goes to (:mod:`.servers`) are its pieces.
Requests travel over the wire or through shared memory (:mod:`.request.shm_slots`,
:mod:`.request.request_io`); a call given a ``deadline=`` returns by it (:mod:`.transport.deadline`);
several servers are balanced and a request that failed for the server's state is sent again to
another (:mod:`.servers.replicas`, :mod:`.servers.resends`, :mod:`kimi_vision_common.faults`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

from kimi_vision_common.errors import PreprocessError
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.results import ImagesResult, TokenCount, VideoChunkResult
from kimi_vision_common.wire import FRAME_BYTES, IMAGE_BYTES, PROMPT, admin_headers

from .request.media import require_grpc, sibling_model, stream_video, token_counts, tokens_request
from .request.outputs import (
    VisionResult,
    WireResult,
    image_size,
    output_byte_sizes,
    to_images_result,
    to_vision_result,
    to_wire_result,
)
from .request.request_io import Request
from .request.shm_slots import SharedMemoryMode, SharedMemoryPool
from .request.wire import GRID_THW, NUM_TOKENS, PIXEL_PATCHES, PIXEL_VALUES, Wire, largest_preset, learn_wire
from .servers.readiness import require_model
from .servers.replicas import RESOLVE_TIMEOUT_S, Balance, Replicas, server_addresses, several_servers, strip_scheme
from .servers.resends import Sender
from .transport.adapters import ADAPTERS
from .transport.deadline import NO_DEADLINE, Deadline, as_deadline
from .transport.server_errors import error_from_server

__all__ = [
    "GRID_THW",
    "NUM_TOKENS",
    "PIXEL_PATCHES",
    "PIXEL_VALUES",
    "Deadline",
    "KimiVisionClient",
    "VisionResult",
    "Wire",
    "WireResult",
    "error_from_server",
    "image_size",
    "largest_preset",
    "learn_wire",
    "output_byte_sizes",
    "strip_scheme",
    "to_images_result",
    "to_vision_result",
]

Protocol = Literal["http", "grpc"]

INPUT_NAME = IMAGE_BYTES
# close() unregisters the client's regions within this (a stalled server keeps them until it stops).
CLOSE_DEADLINE_S = 2.0


class KimiVisionClient:
    """Preprocess images on a Triton server running the Kimi vision models.

    ``url`` is ``host:port`` (a scheme is accepted and ignored), or over gRPC several of them
    (``"h1:p1,h2:p2"`` or a list) or a ``dns:///name:port`` that lists them, spread per request as
    ``balance`` says (``round_robin`` or ``rendezvous``: an image's repeats to the same replica,
    for its response cache; :mod:`~kimi_vision_client.servers.replicas`); ``protocol`` picks
    tritonclient.http or tritonclient.grpc; ``model`` the ensemble (``kimi_*_vision`` float32, or
    ``kimi_*_vision_u8``: uint8 patches on the wire, expanded here; the result is the same) or
    the single models ``kimi_*_vision_fused`` / ``kimi_*_vision_fused_u8`` (the same two wires).
    ``use_shared_memory``: send inputs and receive outputs through system shared memory (True;
    ``"auto"``: once the server is seen to map this process's regions, else over the wire;
    :mod:`.request.shm_slots`). ``preset`` overrides the preset learnt from the server (see
    :func:`learn_wire`); it sizes the output regions and, on the uint8 wire, expands the patches,
    so it must match the server's. ``max_concurrency`` is the HTTP connection pool size.
    ``timeout_s``: the most any one RPC may take (None: none), below a call's ``deadline``: past
    it a request fails with :class:`DeadlineExceededError` and the server drops it from its queue
    if it has not started it (Triton's per-request timeout). ``admin_key``: the server's admin
    key, sent with the shared-memory calls of a server that restricts them (one listening beyond
    loopback, docs/security.md). Attributes: ``preset``, the preset in use (the given one, else
    the server's, asked for on first use); ``wire`` (:class:`Wire`); ``output_bytes_received``,
    the output bytes received so far (over the wire or through shared memory). Not thread safe:
    use one client per thread.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        protocol: Protocol = "grpc",
        model: str = "kimi_k25_vision",
        use_shared_memory: SharedMemoryMode = False,
        *,
        preset: str | Preset | None = None,
        max_concurrency: int = 16,
        admin_key: str | None = None,
        timeout_s: float | None = None,
        balance: Balance = "round_robin",
    ) -> None:
        if protocol not in ADAPTERS:
            raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
        addresses = server_addresses(url)
        self.url = ",".join(addresses)
        self.protocol = protocol
        self.model = model
        self.use_shared_memory = use_shared_memory
        self._preset_override = get_preset(preset) if preset is not None else None
        self._adapter = ADAPTERS[protocol](timeout_s)
        several = several_servers(addresses)
        if several and protocol == "http":
            raise ValueError(f"several servers ({self.url}) need protocol='grpc': gRPC balances them")
        if several and use_shared_memory:
            raise ValueError("shared memory is registered with one server: use one address with use_shared_memory")
        resolve_timeout_s = RESOLVE_TIMEOUT_S if timeout_s is None else min(RESOLVE_TIMEOUT_S, timeout_s)
        self._replicas = Replicas(
            addresses, balance, lambda target: self._adapter.connect(target, max_concurrency), resolve_timeout_s
        )
        headers = admin_headers(admin_key, protocol) if admin_key else None
        self._shm = SharedMemoryPool(self._adapter, headers, use_shared_memory)
        self._wires: dict[str, Wire] = {}
        self._sender = Sender(self._adapter, self._replicas, self._shm, self.wire_of)

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self, deadline: Deadline | float | None = CLOSE_DEADLINE_S) -> None:
        """Unlink every shared-memory region here and unregister it from the server within
        ``deadline`` (default :data:`CLOSE_DEADLINE_S`; a stalled server keeps them until it
        stops), then close the connections (within the same deadline: over HTTP, requests still
        running end by the connection's network timeout). Never raises for the server's state."""
        deadline = as_deadline(deadline)
        self._shm.close(self._client, deadline)
        for client in self._replicas.clients():
            self._adapter.close(client, deadline.left())

    def __enter__(self) -> KimiVisionClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def _client(self) -> Any:
        """The tritonclient for calls about the models (configs, readiness, shared memory)."""
        return self._replicas.primary.client

    @property
    def timeout_s(self) -> float | None:
        """The most one RPC may take (None: no bound but a call's deadline); set it to change the
        next RPCs'."""
        return self._adapter.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float | None) -> None:
        self._adapter.timeout_s = value

    def _timeout(self, deadline: Deadline) -> float | None:
        """The next RPC's timeout: the time left of ``deadline``, at most :attr:`timeout_s`."""
        return deadline.timeout(self.timeout_s)

    @property
    def output_bytes_received(self) -> int:
        """The output bytes received so far (over the wire or through shared memory)."""
        return self._sender.output_bytes_received

    @output_bytes_received.setter
    def output_bytes_received(self, value: int) -> None:
        self._sender.output_bytes_received = value

    @property
    def wire(self) -> Wire:
        """How ``model`` returns its pixels and under which preset (:meth:`wire_of`)."""
        return self.wire_of(self.model)

    def wire_of(self, model: str, deadline: Deadline = NO_DEADLINE) -> Wire:
        """How ``model`` returns its pixels and under which preset; asked from the server once per
        model, within ``deadline`` (raises what the server call raises; a later call asks again)."""
        if model not in self._wires:
            try:
                self._wires[model] = learn_wire(
                    lambda name: self._adapter.model_config(self._client, name, self._timeout(deadline)),
                    model,
                    self._preset_override,
                )
            except Exception as exc:  # the server's failure or the transport's, as the library's class
                raise error_from_server(exc) from None
        return self._wires[model]

    @property
    def preset(self) -> Preset:
        """The preset the client sizes and expands with (:attr:`wire`'s)."""
        return self.wire.preset

    @property
    def shared_memory_regions(self) -> list[str]:
        """Names of the regions this client has registered (for inspection and tests)."""
        return self._shm.region_names

    def is_ready(self, deadline: Deadline | float | None = None) -> bool:
        """True when the server answers and ``model`` is loaded (connection errors mean False)."""
        try:
            self.require_model(deadline=deadline)
        except PreprocessError:
            return False
        return True

    def require_model(self, model: str | None = None, deadline: Deadline | float | None = None) -> None:
        """Return when the server answers and serves ``model`` (default: this client's), else raise
        what :func:`~.servers.readiness.require_model` says (a fault of the server's state, or
        :class:`ModelNotServedError` naming the flag that serves the model)."""
        require_model(self._adapter, self._replicas, self.url, model or self.model, as_deadline(deadline))

    # -- inference ------------------------------------------------------------------------------

    def preprocess_images(self, items: Sequence[bytes], *, deadline: Deadline | float | None = None) -> ImagesResult:
        """Preprocess K encoded images in one request (``IMAGE_BYTES [1, K]``): the concatenation
        of their results, as ``kimi_vision_prep.preprocess_images`` returns it; the first bad image
        raises its typed error, its index in the message."""
        deadline = as_deadline(deadline)
        request = Request(list(items), self.model, INPUT_NAME)
        result = self._sender.collect(self._sender.send(request, deadline), to_images_result, deadline)
        if isinstance(result, PreprocessError):
            raise result
        return result

    def preprocess_video(self, data: bytes, model: str | None = None) -> Iterator[VideoChunkResult]:
        """The chunks of an encoded video, as the server streams them (``model``: default the
        ``*_video`` model of this client's preset prefix). gRPC only (decoupled model); closing
        the iterator early cancels the request on the server."""
        require_grpc(self.protocol)
        name = model or sibling_model(self.model, "video")
        self.require_model(name)
        wire = self.wire_of(name)
        return stream_video(self._replicas.stream_target, name, data, wire, error_from_server)

    def count_tokens(
        self, items: Sequence[bytes], model: str | None = None, *, deadline: Deadline | float | None = None
    ) -> list[TokenCount]:
        """Grid, tokens and prompt of each image from its header (``model``: default the
        ``*_tokens`` model of this client's preset prefix), in one request."""
        name, deadline = model or sibling_model(self.model, "tokens"), as_deadline(deadline)
        self.require_model(name, deadline)
        inputs, outputs = tokens_request(self._adapter.module, items)
        try:
            result = self._adapter.submit(self._client, name, inputs, outputs, self._timeout(deadline))()
        except Exception as exc:
            raise error_from_server(exc, len(items) == 1) from None
        return token_counts({n: result.as_numpy(n) for n in (GRID_THW, NUM_TOKENS, PROMPT)})

    def infer(self, data: bytes, *, deadline: Deadline | float | None = None) -> VisionResult:
        """Preprocess one encoded image; raises a :class:`PreprocessError` subclass on failure."""
        (result,) = self.infer_many([data], concurrency=1, deadline=deadline)
        if isinstance(result, Exception):
            raise result
        return result

    def infer_many(
        self,
        items: Iterable[bytes],
        concurrency: int = 4,
        on_result: Callable[[int, VisionResult | PreprocessError], None] | None = None,
        *,
        deadline: Deadline | float | None = None,
    ) -> list[VisionResult | PreprocessError]:
        """Preprocess many images with up to ``concurrency`` requests in flight.

        Returns one :class:`VisionResult` or one :class:`PreprocessError` per item, in order; a bad
        image does not affect the others. ``on_result(index, result)`` is called as each completes
        (in order), e.g. to drive a progress bar. ``items`` may be a lazy iterable. ``deadline``:
        the whole call's (seconds or a :class:`Deadline`): an item not answered by then is a
        :class:`DeadlineExceededError`.
        """
        return self._sender.windowed(
            ((data, self.model, INPUT_NAME) for data in items),
            concurrency,
            to_vision_result,
            as_deadline(deadline),
            on_result,
        )

    def preprocess_media(
        self,
        requests: Iterable[bytes | Sequence[bytes]],
        concurrency: int = 4,
        *,
        deadline: Deadline | float | None = None,
    ) -> list[WireResult | PreprocessError]:
        """Each request is one encoded image (to ``model``) or a video chunk's encoded frames (a
        list, to the ``*_video_chunk`` model of this client's preset prefix); up to ``concurrency``
        in flight, all within ``deadline``. One :class:`WireResult` (pixels as the wire carries
        them) or one :class:`PreprocessError` per request, in order."""
        chunk_model = sibling_model(self.model, "video_chunk")

        def sent(request: bytes | Sequence[bytes]) -> tuple[Any, str, str]:
            if isinstance(request, (bytes, bytearray, memoryview)):
                return bytes(request), self.model, INPUT_NAME
            return list(request), chunk_model, FRAME_BYTES

        return self._sender.windowed(map(sent, requests), concurrency, to_wire_result, as_deadline(deadline))
