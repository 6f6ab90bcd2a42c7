"""A Triton client for the Kimi vision preprocessing models, one API over HTTP and gRPC.

The models take ``IMAGE_BYTES`` (TYPE_STRING, batch shape ``[1, K]``: K images a request) and
return ``PIXEL_VALUES`` float32 ``[1, ΣN, 3, p, p]`` (``kimi_*_vision``) or, on the "uint8 wire"
(``kimi_*_vision_u8``), ``PIXEL_PATCHES`` uint8 ``[1, ΣN, 3, p, p]``, plus ``GRID_THW`` int64
``[1, K, 3]`` and ``NUM_TOKENS`` int32 ``[1, K]``; the single models ``kimi_*_vision_fused``
(float32) and ``kimi_*_vision_fused_u8`` (uint8) return the same without an ensemble.
:class:`KimiVisionClient` hides the batch dimension, expands uint8 patches into the float32
``pixel_values`` with the preset's normalise table (bit-equal to the float32 ensemble:
``PIXEL_VALUES`` is that table read at ``PIXEL_PATCHES``), and raises server errors as the
:mod:`kimi_vision_common.errors` class the server's message is tagged with
(:func:`~kimi_vision_common.errors.error_from_served`), so a remote call fails exactly like
``kimi_vision_prep.preprocess_bytes`` would in-process.

The wire is learnt from the server, once per client, at the first request (:func:`learn_wire`):
a model whose config lists a ``PIXEL_PATCHES`` output is served over the uint8 wire, and the
preset (mean/std for the table, sizes for shared memory) is read from the ``parameters`` of the
model that produces the pixels (the model itself, or the ensemble step that yields them), so a
renamed or re-parameterised model still expands exactly; the client keeps no table of models.

With ``use_shared_memory=True`` the request and the outputs travel through POSIX shared memory
(client and server must share ``/dev/shm``, e.g. the same host or pod). The output size is known
before sending: the NaViT rule needs only the width and height from the image header.

Over gRPC a client may be given several servers, or a ``dns:///`` name listing them: each request
goes to one (:mod:`kimi_vision_client.replicas`), and one that got no answer is sent again to
another (a preprocessing request is idempotent).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import tritonclient.utils
import tritonclient.utils.shared_memory as shm
from PIL import Image

from kimi_vision_common.errors import ModelNotServedError, PreprocessError, ServerUnavailableError
from kimi_vision_common.models import default_model_names, is_project_model
from kimi_vision_common.patches import expand_patches
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.results import ImagesResult, TokenCount, VideoChunkResult
from kimi_vision_common.sizing import chunk_target, navit_target_size
from kimi_vision_common.wire import FRAME_BYTES, IMAGE_BYTES, NUM_TOKENS_DTYPE, PROMPT, admin_headers

from .media import require_grpc, sibling_model, stream_video, token_counts, tokens_request
from .replicas import (
    FAILOVER_BACKOFF_S,
    Balance,
    Replica,
    Replicas,
    server_addresses,
    several_servers,
    strip_scheme,
    unavailable_now,
)
from .server_errors import connection_failure, error_from_server
from .transport import ADAPTERS, ShmRegion, ShmSlot, Waiter
from .wire import GRID_THW, NUM_TOKENS, PIXEL_PATCHES, PIXEL_VALUES, Wire, largest_preset, learn_wire

__all__ = [
    "GRID_THW",
    "NUM_TOKENS",
    "PIXEL_PATCHES",
    "PIXEL_VALUES",
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
ResultT = TypeVar("ResultT")

INPUT_NAME = IMAGE_BYTES
SHM_IN_USE = "currently in use"  # tritonserver's refusal to unregister a region a request still holds
CLOSE_UNREGISTER_TRIES, CLOSE_UNREGISTER_WAIT_S = 20, 0.05
OUTPUT_DTYPES: dict[str, np.dtype] = {
    PIXEL_VALUES: np.dtype(np.float32),
    PIXEL_PATCHES: np.dtype(np.uint8),
    GRID_THW: np.dtype(np.int64),
    NUM_TOKENS: np.dtype(np.int32),
}


@dataclass(frozen=True)
class VisionResult:
    """One image as the server preprocessed it (batch dimension removed).

    ``pixel_values``: float32 ``(N, 3, p, p)``; ``grid_thw``: int64 ``(3,)``; ``num_tokens``: int.
    """

    pixel_values: np.ndarray
    grid_thw: np.ndarray
    num_tokens: int


@dataclass(frozen=True)
class WireResult:
    """One image or video chunk as the server returned it (batch dimension removed), its pixels
    not expanded: ``pixels`` uint8 ``(N, 3, p, p)`` patches on the uint8 wire (``wire.pixel_output``
    is ``PIXEL_PATCHES``), float32 ``pixel_values`` otherwise; ``grid_thw`` int64 ``(3,)``."""

    pixels: np.ndarray
    grid_thw: np.ndarray
    num_tokens: int
    wire: Wire


def image_size(data: bytes) -> tuple[int, int] | None:
    """Stored ``(width, height)`` from the header (no pixel decode), or None if Pillow cannot parse it."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception:  # any header Pillow rejects: the server will reject it too and say why
        return None


def output_byte_sizes(
    sizes: Sequence[tuple[int, int]], preset: Preset, pixel_output: str = PIXEL_VALUES
) -> dict[str, int]:
    """Bytes of each output of a request of images of ``sizes`` (width, height) under ``preset``,
    with the pixels as ``pixel_output`` (``PIXEL_VALUES`` float32 or ``PIXEL_PATCHES`` uint8)."""
    patches = sum(navit_target_size(width, height, preset).num_patches for width, height in sizes)
    patch_values = 3 * preset.patch_size * preset.patch_size
    return {
        pixel_output: patches * patch_values * OUTPUT_DTYPES[pixel_output].itemsize,
        GRID_THW: len(sizes) * 3 * OUTPUT_DTYPES[GRID_THW].itemsize,
        NUM_TOKENS: len(sizes) * OUTPUT_DTYPES[NUM_TOKENS].itemsize,
    }


def chunk_output_byte_sizes(frames: int, size: tuple[int, int], preset: Preset, pixel_output: str) -> dict[str, int]:
    """Bytes of each output of a ``frames``-frame video chunk whose first frame is ``size``
    (width, height), with the pixels as ``pixel_output``."""
    target = chunk_target(*size, frames, preset)
    patch_values = 3 * preset.patch_size * preset.patch_size
    return {
        pixel_output: frames * target.num_patches * patch_values * OUTPUT_DTYPES[pixel_output].itemsize,
        GRID_THW: 3 * OUTPUT_DTYPES[GRID_THW].itemsize,
        NUM_TOKENS: OUTPUT_DTYPES[NUM_TOKENS].itemsize,
    }


def _pixel_values(outputs: Mapping[str, np.ndarray], preset: Preset | None) -> np.ndarray:
    """float32 ``(ΣN, 3, p, p)`` of one request's outputs (a new array, so shm regions can be
    reused): ``PIXEL_PATCHES`` expanded with ``preset``'s table, ``PIXEL_VALUES`` copied."""
    if PIXEL_PATCHES in outputs:
        if preset is None:
            raise ValueError("expanding PIXEL_PATCHES needs the preset")
        return expand_patches(np.asarray(outputs[PIXEL_PATCHES][0]), preset)
    return np.array(outputs[PIXEL_VALUES][0], dtype=np.float32)


def to_vision_result(outputs: Mapping[str, np.ndarray], preset: Preset | None = None) -> VisionResult:
    """The output tensors of a one-image request -> :class:`VisionResult`."""
    return VisionResult(
        pixel_values=_pixel_values(outputs, preset),
        grid_thw=np.array(outputs[GRID_THW], dtype=np.int64).reshape(3),
        num_tokens=int(np.asarray(outputs[NUM_TOKENS]).reshape(())),
    )


def to_wire_result(outputs: Mapping[str, np.ndarray], wire: Wire) -> WireResult:
    """The output tensors of a one-image or one-chunk request -> :class:`WireResult` (a new array)."""
    return WireResult(
        pixels=np.array(outputs[wire.pixel_output][0]),
        grid_thw=np.array(outputs[GRID_THW], dtype=np.int64).reshape(3),
        num_tokens=int(np.asarray(outputs[NUM_TOKENS]).reshape(())),
        wire=wire,
    )


def to_images_result(outputs: Mapping[str, np.ndarray], preset: Preset | None = None) -> ImagesResult:
    """The output tensors of a K-image request -> :class:`~kimi_vision_prep.ImagesResult`."""
    return ImagesResult(
        pixel_values=_pixel_values(outputs, preset),
        grid_thws=np.array(outputs[GRID_THW], dtype=np.int64).reshape(-1, 3),
        num_tokens=np.array(outputs[NUM_TOKENS], dtype=NUM_TOKENS_DTYPE).reshape(-1),
    )


# -- the client ---------------------------------------------------------------------------------


@dataclass
class _Request:
    """What a request sends, kept to send it again to another replica."""

    items: list[bytes]
    model: str
    input_name: str
    attempt: int = 1


@dataclass
class _Pending:
    """A submitted request: how to wait for it, the shm slot (if any) holding its outputs, and the
    replica it went to."""

    wait: Waiter
    slot: ShmSlot | None
    output_offsets: dict[str, int] | None
    wire: Wire
    request: _Request
    replica: Replica
    single_image: bool = True


class KimiVisionClient:
    """Preprocess images on a Triton server running the Kimi vision models.

    ``url`` is ``host:port`` (a scheme is accepted and ignored), or over gRPC several of them
    (``"h1:p1,h2:p2"`` or a list) or a ``dns:///name:port`` that lists them, spread per request as
    ``balance`` says (``round_robin``: gRPC's policy; ``rendezvous``: an image's repeats to the
    same replica, for its response cache; :mod:`~kimi_vision_client.replicas`); ``protocol`` picks
    tritonclient.http or tritonclient.grpc; ``model`` the ensemble (``kimi_*_vision`` float32, or
    ``kimi_*_vision_u8``: uint8 patches on the wire, expanded here; the result is the same) or
    the single models ``kimi_*_vision_fused`` / ``kimi_*_vision_fused_u8`` (the same two wires);
    ``use_shared_memory`` sends inputs and receives outputs through system shared memory.
    ``preset`` overrides the preset learnt from the server (see :func:`learn_wire`); it sizes the
    output regions and, on the uint8 wire, expands the patches, so it must match the server's.
    ``max_concurrency`` is the HTTP connection pool size. ``timeout_s``: each request's deadline
    (None: none): past it the request fails with :class:`DeadlineExceededError` and the server
    drops it from its queue if it has not started it (Triton's per-request timeout).
    ``admin_key``: the server's admin key, sent with the shared-memory calls of a server that
    restricts them (one listening beyond loopback, docs/security.md). Attributes: ``preset``, the
    preset in
    use (the given one, else the server's, asked for on first use); ``wire`` (:class:`Wire`);
    ``output_bytes_received``, the output bytes received so far (over the
    wire or through shared memory). Not thread safe: use one client per thread.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        protocol: Protocol = "grpc",
        model: str = "kimi_k25_vision",
        use_shared_memory: bool = False,
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
        self._admin_headers = admin_headers(admin_key, protocol) if admin_key else None
        self._preset_override = get_preset(preset) if preset is not None else None
        self._adapter = ADAPTERS[protocol](timeout_s)
        several = several_servers(addresses)
        if several and protocol == "http":
            raise ValueError(f"several servers ({self.url}) need protocol='grpc': gRPC balances them")
        if several and use_shared_memory:
            raise ValueError("shared memory is registered with one server: use one address with use_shared_memory")
        self._replicas = Replicas(
            addresses, balance, lambda target, rr: self._adapter.connect(target, max_concurrency, rr)
        )
        self._wires: dict[str, Wire] = {}
        self._free_slots: list[ShmSlot] = []
        self._all_slots: list[ShmSlot] = []
        self._unregister_later: list[ShmRegion] = []
        self.output_bytes_received = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister and destroy every shared-memory region (each unlinked here even where the
        server fails; the first failure raised after), then close the connection."""
        failures = []
        for _ in range(CLOSE_UNREGISTER_TRIES):  # a region the server still holds is let go within moments
            self._unregister_retired()
            if not self._unregister_later:
                break
            time.sleep(CLOSE_UNREGISTER_WAIT_S)
        for slot in self._all_slots:
            try:
                slot.release(self._client)
            except Exception as exc:  # the server's failure, whatever its transport calls it
                failures.append(exc)
        self._all_slots.clear()
        self._free_slots.clear()
        for client in self._replicas.clients():
            client.close()
        if failures:
            raise failures[0]

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
        """Each request's deadline (None: none); set it to change the next requests'."""
        return self._adapter.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float | None) -> None:
        self._adapter.timeout_s = value

    @property
    def wire(self) -> Wire:
        """How ``model`` returns its pixels and under which preset (:meth:`wire_of`)."""
        return self.wire_of(self.model)

    def wire_of(self, model: str) -> Wire:
        """How ``model`` returns its pixels and under which preset; asked from the server once per
        model (raises what the server call raises; a later call asks again)."""
        if model not in self._wires:
            self._wires[model] = learn_wire(
                lambda name: self._adapter.model_config(self._client, name), model, self._preset_override
            )
        return self._wires[model]

    @property
    def preset(self) -> Preset:
        """The preset the client sizes and expands with (:attr:`wire`'s)."""
        return self.wire.preset

    @property
    def shared_memory_regions(self) -> list[str]:
        """Names of the regions this client has registered (for inspection and tests)."""
        return [r.name for slot in self._all_slots for r in (slot.input, slot.output) if r is not None]

    def is_ready(self) -> bool:
        """True when the server answers and ``model`` is loaded (connection errors mean False)."""
        try:
            self.require_model()
        except PreprocessError:
            return False
        return True

    def require_model(self, model: str | None = None) -> None:
        """Return when the server answers and serves ``model`` (default: this client's), else raise
        :class:`ServerUnavailableError` (nothing answers at the URL: refused, unreachable) or
        :class:`ModelNotServedError` (it answers but does not serve the model), saying what to do."""
        name = model or self.model
        for attempt in range(self._replicas.count):
            try:
                live = self._client.is_server_live()
                break
            except Exception as exc:  # refused / unreachable / timed out, whatever the transport calls it
                if attempt + 1 < self._replicas.count:
                    self._replicas.failed(self._replicas.primary)  # ask the next replica
                    continue
                raise ServerUnavailableError(
                    f"cannot connect to {self.url} ({self.protocol}): {connection_failure(exc)}; "
                    "is the server running? start one with `kimi-prep serve`"
                ) from None
        if not live:
            raise ServerUnavailableError(f"the server at {self.url} ({self.protocol}) is not live yet; retry")
        try:
            ready = self._client.is_model_ready(name)
        except Exception:  # an unknown model is an error on some transports, False on others
            ready = False
        if not ready and not is_project_model(name):
            raise ModelNotServedError(
                f"the server at {self.url} does not serve {name!r}, and no kimi-prep repository has a model of "
                f"that name: check --model (the default image models: {', '.join(default_model_names())})"
            )
        if not ready:
            raise ModelNotServedError(
                f"the server at {self.url} does not serve {name!r}: start it with "
                f"`kimi-prep serve --models {name}` (or `--all` for every model)"
            )

    # -- inference ------------------------------------------------------------------------------

    def preprocess_images(self, items: Sequence[bytes]) -> ImagesResult:
        """Preprocess K encoded images in one request (``IMAGE_BYTES [1, K]``): the concatenation
        of their results, as ``kimi_vision_prep.preprocess_images`` returns it; the first bad image
        raises its typed error, its index in the message."""
        result = self._collect(self._submit(list(items)), to_images_result)
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
        wire = learn_wire(lambda n: self._adapter.model_config(self._client, n), name, self._preset_override)
        return stream_video(self._replicas.stream_target, name, data, wire, error_from_server)

    def count_tokens(self, items: Sequence[bytes], model: str | None = None) -> list[TokenCount]:
        """Grid, tokens and prompt of each image from its header (``model``: default the
        ``*_tokens`` model of this client's preset prefix), in one request."""
        name = model or sibling_model(self.model, "tokens")
        self.require_model(name)
        inputs, outputs = tokens_request(self._adapter.module, items)
        try:
            result = self._adapter.submit(self._client, name, inputs, outputs)()
        except Exception as exc:
            raise error_from_server(exc, len(items) == 1) from None
        return token_counts({n: result.as_numpy(n) for n in (GRID_THW, NUM_TOKENS, PROMPT)})

    def infer(self, data: bytes) -> VisionResult:
        """Preprocess one encoded image; raises a :class:`PreprocessError` subclass on failure."""
        (result,) = self.infer_many([data], concurrency=1)
        if isinstance(result, Exception):
            raise result
        return result

    def infer_many(
        self,
        items: Iterable[bytes],
        concurrency: int = 4,
        on_result: Callable[[int, VisionResult | PreprocessError], None] | None = None,
    ) -> list[VisionResult | PreprocessError]:
        """Preprocess many images with up to ``concurrency`` requests in flight.

        Returns one :class:`VisionResult` or one :class:`PreprocessError` per item, in order; a bad
        image does not affect the others. ``on_result(index, result)`` is called as each completes
        (in order), e.g. to drive a progress bar. ``items`` may be a lazy iterable.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        results: list[VisionResult | PreprocessError] = []
        window: list[_Pending | PreprocessError] = []

        def collect_oldest() -> None:
            outcome = self._collect(window.pop(0), to_vision_result)
            if on_result is not None:
                on_result(len(results), outcome)
            results.append(outcome)

        for data in items:
            if len(window) >= concurrency:
                collect_oldest()
            window.append(self._submit([data]))
        while window:
            collect_oldest()
        return results

    def preprocess_media(
        self, requests: Iterable[bytes | Sequence[bytes]], concurrency: int = 4
    ) -> list[WireResult | PreprocessError]:
        """Each request is one encoded image (to ``model``) or a video chunk's encoded frames (a
        list, to the ``*_video_chunk`` model of this client's preset prefix); up to ``concurrency``
        in flight. One :class:`WireResult` (pixels as the wire carries them) or one
        :class:`PreprocessError` per request, in order."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        results: list[WireResult | PreprocessError] = []
        window: list[_Pending | PreprocessError] = []
        chunk_model = sibling_model(self.model, "video_chunk")
        for request in requests:
            if len(window) >= concurrency:
                results.append(self._collect(window.pop(0), to_wire_result))
            if isinstance(request, (bytes, bytearray, memoryview)):
                window.append(self._submit([bytes(request)]))
            else:
                window.append(self._submit(list(request), model=chunk_model, input_name=FRAME_BYTES))
        results.extend(self._collect(pending, to_wire_result) for pending in window)
        return results

    def _submit(
        self, items: list[bytes], *, model: str | None = None, input_name: str = INPUT_NAME
    ) -> _Pending | PreprocessError:
        """Send one request (``input_name`` ``[1, K]``: K images, or a chunk's K frames)."""
        return self._send(_Request(items, model or self.model, input_name))

    def _send(self, request: _Request) -> _Pending | PreprocessError:
        single = len(request.items) == 1 or request.input_name == FRAME_BYTES
        slot = self._acquire_slot() if self.use_shared_memory else None
        replica = self._replicas.pick(request.items)
        try:
            wire = self.wire_of(request.model)
            inputs, outputs, offsets = self._request(request.items, slot, wire, request.input_name)
            waiter = self._adapter.submit(replica.client, request.model, inputs, outputs)
            self._replicas.sent(replica)
            return _Pending(waiter, slot, offsets, wire, request, replica, single)
        except Exception as exc:
            self._release_slot(slot)
            return error_from_server(exc, single)

    def _resend(self, pending: _Pending, error: PreprocessError) -> _Pending | None:
        """``pending`` sent again, to another replica where there is one, when it got no answer
        (:func:`~kimi_vision_client.replicas.unavailable_now`) and has attempts left; else None."""
        request = pending.request
        if not unavailable_now(error) or request.attempt >= self._replicas.failover_attempts:
            return None
        self._replicas.failed(pending.replica)
        time.sleep(FAILOVER_BACKOFF_S * 2 ** (request.attempt - 1))  # gRPC notices the dead connection
        again = self._send(_Request(request.items, request.model, request.input_name, request.attempt + 1))
        return again if isinstance(again, _Pending) else None

    def _collect(
        self, pending: _Pending | PreprocessError, convert: Callable[..., ResultT]
    ) -> ResultT | PreprocessError:
        """``convert(outputs, preset_or_wire)`` of a submitted request's outputs (before its shm
        slot is reused: the converters return new arrays), or its error. A request that did not
        answer (past its deadline, the connection lost) may still be written by the server: its
        slot is retired, never reused for another request's outputs."""
        if isinstance(pending, PreprocessError):
            return pending
        answered = False
        try:
            result = pending.wait()
            answered = True
            if pending.slot is not None and pending.output_offsets is not None:
                outputs = self._read_shm_outputs(result, pending.slot, pending.output_offsets)
            else:
                outputs = {name: result.as_numpy(name) for name in pending.wire.outputs}
            self.output_bytes_received += sum(array.nbytes for array in outputs.values())
            return convert(outputs, pending.wire if convert is to_wire_result else pending.wire.preset)
        except Exception as exc:
            error = error_from_server(exc, pending.single_image)
            again = None if answered else self._resend(pending, error)
            return error if again is None else self._collect(again, convert)
        finally:
            self._replicas.answered(pending.replica)
            if answered:
                self._release_slot(pending.slot)
                self._unregister_retired()
            else:
                self._retire_slot(pending.slot)

    def _request(
        self, items: list[bytes], slot: ShmSlot | None, wire: Wire, input_name: str = INPUT_NAME
    ) -> tuple[list[Any], list[Any], dict[str, int] | None]:
        """InferInput / InferRequestedOutput lists, and the output offsets when outputs go to shm."""
        module = self._adapter.module
        image = module.InferInput(input_name, [1, len(items)], "BYTES")
        batch = np.array([items], dtype=np.object_)
        outputs = [module.InferRequestedOutput(name) for name in wire.outputs]
        if slot is None:
            image.set_data_from_numpy(batch)
            return [image], outputs, None
        serialized = tritonclient.utils.serialize_byte_tensor(batch)
        input_bytes = tritonclient.utils.serialized_byte_size(serialized)
        # An unparsable header has no known output size: the outputs (none: the server rejects it)
        # then travel over the wire, only the input uses shm.
        if input_name == FRAME_BYTES:
            first = image_size(items[0])
            sizes = chunk_output_byte_sizes(len(items), first, wire.preset, wire.pixel_output) if first else None
        else:
            image_sizes = [image_size(data) for data in items]
            known = None if None in image_sizes else image_sizes
            sizes = output_byte_sizes(known, wire.preset, wire.pixel_output) if known else None
        self._unregister_later += slot.fit(self._client, input_bytes, sum(sizes.values()) if sizes else 0)
        assert slot.input is not None and slot.output is not None
        shm.set_shared_memory_region(slot.input.handle, [serialized])
        image.set_shared_memory(slot.input.name, input_bytes)
        if sizes is None:
            return [image], outputs, None
        offsets: dict[str, int] = {}
        offset = 0
        for output, (name, byte_size) in zip(outputs, sizes.items(), strict=True):
            output.set_shared_memory(slot.output.name, byte_size, offset)
            offsets[name] = offset
            offset += byte_size
        return [image], outputs, offsets

    def _read_shm_outputs(self, result: Any, slot: ShmSlot, offsets: dict[str, int]) -> dict[str, np.ndarray]:
        assert slot.output is not None
        return {
            name: shm.get_contents_as_numpy(
                slot.output.handle, OUTPUT_DTYPES[name], self._adapter.output_shape(result, name), offset
            )
            for name, offset in offsets.items()
        }

    def _acquire_slot(self) -> ShmSlot:
        if self._free_slots:
            return self._free_slots.pop()
        slot = ShmSlot(self._admin_headers, self._adapter.call_options())
        self._all_slots.append(slot)
        return slot

    def _release_slot(self, slot: ShmSlot | None) -> None:
        if slot is not None:
            self._free_slots.append(slot)

    def _retire_slot(self, slot: ShmSlot | None) -> None:
        """Drop ``slot`` for good: the server may still write the outputs of the request that held
        it. Its regions are unlinked here now, and unregistered after the server next answers (a
        stuck server would hold the caller as long as it is stuck)."""
        if slot is None:
            return
        self._all_slots.remove(slot)
        for region in slot.detach():
            region.forget()
            self._unregister_later.append(region)

    def _unregister_retired(self) -> None:
        """Unregister the retired and replaced regions: once each (a restarted server has forgotten
        them anyway), but a region the server still holds is asked again after the next answer."""
        regions, self._unregister_later = self._unregister_later, []
        for region in regions:
            try:
                region.unregister(self._client)
            except Exception as exc:  # gone with the server that had it, unknown to a new one, or in use
                if SHM_IN_USE in str(exc):
                    self._unregister_later.append(region)
