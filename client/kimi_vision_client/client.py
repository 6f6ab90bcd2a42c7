"""A Triton client for the Kimi vision preprocessing ensembles, one API over HTTP and gRPC.

The ensembles take ``IMAGE_BYTES`` (TYPE_STRING, batch shape ``[1, 1]``) and return
``PIXEL_VALUES`` float32 ``[1, N, 3, p, p]``, ``GRID_THW`` int64 ``[1, 3]`` and ``NUM_TOKENS``
int32 ``[1, 1]``. :class:`KimiVisionClient` hides the batch dimension and maps server errors onto
the :mod:`kimi_vision_prep.errors` hierarchy, so a remote call fails exactly like
``kimi_vision_prep.preprocess_bytes`` would in-process.

With ``use_shared_memory=True`` the request and the outputs travel through POSIX shared memory
(client and server must share ``/dev/shm``, e.g. the same host or pod). The output size is known
before sending: the NaViT rule needs only the width and height from the image header.
"""

from __future__ import annotations

import io
import re
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import tritonclient.grpc
import tritonclient.http
import tritonclient.utils
import tritonclient.utils.shared_memory as shm
from PIL import Image

from kimi_vision_prep import (
    PRESETS,
    DecoderBusyError,
    InvalidImageError,
    PreprocessError,
    Preset,
    get_preset,
    navit_target_size,
)

Protocol = Literal["http", "grpc"]
Waiter = Callable[[], Any]

INPUT_NAME = "IMAGE_BYTES"
PIXEL_VALUES, GRID_THW, NUM_TOKENS = "PIXEL_VALUES", "GRID_THW", "NUM_TOKENS"
OUTPUT_DTYPES: dict[str, np.dtype] = {
    PIXEL_VALUES: np.dtype(np.float32),
    GRID_THW: np.dtype(np.int64),
    NUM_TOKENS: np.dtype(np.int32),
}
# Which preset sizes a model's outputs (for shared-memory regions). Unknown models are sized with
# the largest registered preset: a region larger than the output is fine, a smaller one is not.
MODEL_PRESETS: dict[str, str] = {"kimi_k25_vision": "kimi-k2.5", "kimi_k3_vision": "kimi-k3"}
# Server status (HTTP code or gRPC StatusCode) -> the error the in-process pipeline raises.
STATUS_ERRORS: dict[str, type[PreprocessError]] = {
    "400": InvalidImageError,
    "StatusCode.INVALID_ARGUMENT": InvalidImageError,
    "503": DecoderBusyError,
    "StatusCode.UNAVAILABLE": DecoderBusyError,
}
# Triton prefixes errors of an ensemble's steps with this; without it the message is the library's own.
ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")
SHM_ALIGNMENT = 1 << 16  # regions grow in 64 KiB steps so small size changes reuse them


@dataclass(frozen=True)
class VisionResult:
    """One image as the server preprocessed it (batch dimension removed).

    ``pixel_values``: float32 ``(N, 3, p, p)``; ``grid_thw``: int64 ``(3,)``; ``num_tokens``: int.
    """

    pixel_values: np.ndarray
    grid_thw: np.ndarray
    num_tokens: int


def strip_scheme(url: str) -> str:
    """``http://host:8000/`` -> ``host:8000`` (tritonclient wants no scheme)."""
    return url.split("://", 1)[-1].rstrip("/")


def error_from_server(exc: Exception) -> PreprocessError:
    """Map a tritonclient error onto the :class:`PreprocessError` hierarchy, keeping the server's message."""
    if isinstance(exc, tritonclient.utils.InferenceServerException):
        error_type = STATUS_ERRORS.get(str(exc.status()), PreprocessError)
        return error_type(ENSEMBLE_PREFIX.sub("", exc.message() or str(exc)))
    return PreprocessError(f"{type(exc).__name__}: {exc}")


def image_size(data: bytes) -> tuple[int, int] | None:
    """Stored ``(width, height)`` from the header (no pixel decode), or None if Pillow cannot parse it."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception:  # any header Pillow rejects: the server will reject it too and say why
        return None


def output_byte_sizes(width: int, height: int, preset: Preset) -> dict[str, int]:
    """Bytes of each output for a ``width x height`` image under ``preset`` (batch of one)."""
    target = navit_target_size(width, height, preset)
    patch_values = 3 * preset.patch_size * preset.patch_size
    return {
        PIXEL_VALUES: target.num_patches * patch_values * OUTPUT_DTYPES[PIXEL_VALUES].itemsize,
        GRID_THW: 3 * OUTPUT_DTYPES[GRID_THW].itemsize,
        NUM_TOKENS: OUTPUT_DTYPES[NUM_TOKENS].itemsize,
    }


def largest_preset() -> Preset:
    """The registered preset with the largest patch budget (its outputs bound every other's)."""
    return max(PRESETS.values(), key=lambda p: (p.in_patch_limit, p.patch_limit_on_one_side))


def to_vision_result(outputs: dict[str, np.ndarray]) -> VisionResult:
    """Batch-of-one output tensors -> :class:`VisionResult` (copies, so shm regions can be reused)."""
    return VisionResult(
        pixel_values=np.array(outputs[PIXEL_VALUES][0], dtype=np.float32),
        grid_thw=np.array(outputs[GRID_THW], dtype=np.int64).reshape(3),
        num_tokens=int(np.asarray(outputs[NUM_TOKENS]).reshape(())),
    )


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


ADAPTERS: dict[str, type[HttpAdapter] | type[GrpcAdapter]] = {"http": HttpAdapter, "grpc": GrpcAdapter}


# -- shared memory -----------------------------------------------------------------------------


class ShmRegion:
    """One system shared-memory region, created here and registered with the server under one name."""

    def __init__(self, client: Any, byte_size: int) -> None:
        self.name = f"kimi_vision_{uuid.uuid4().hex}"
        self.key = f"/{self.name}"
        self.byte_size = byte_size
        self.handle = shm.create_shared_memory_region(self.name, self.key, byte_size, create_only=True)
        try:
            client.register_system_shared_memory(self.name, self.key, byte_size)
        except Exception:
            shm.destroy_shared_memory_region(self.handle)
            raise

    def release(self, client: Any) -> None:
        """Unregister from the server (best effort: it may be gone) and unlink locally."""
        try:
            client.unregister_system_shared_memory(self.name)
        finally:
            shm.destroy_shared_memory_region(self.handle)


class ShmSlot:
    """An input and an output region for one in-flight request; grown on demand, reused after."""

    def __init__(self) -> None:
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
            setattr(self, attr, ShmRegion(client, -(-byte_size // SHM_ALIGNMENT) * SHM_ALIGNMENT))

    def release(self, client: Any) -> None:
        for region in (self.input, self.output):
            if region is not None:
                region.release(client)
        self.input = self.output = None


# -- the client ---------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A submitted request: how to wait for it, and the shm slot (if any) holding its outputs."""

    wait: Waiter
    slot: ShmSlot | None
    output_offsets: dict[str, int] | None


class KimiVisionClient:
    """Preprocess images on a Triton server running the Kimi vision ensembles.

    ``url`` is ``host:port`` (a scheme is accepted and ignored); ``protocol`` picks
    tritonclient.http or tritonclient.grpc; ``model`` the ensemble; ``use_shared_memory`` sends
    inputs and receives outputs through system shared memory. ``preset`` sizes the output regions
    (default: the model's preset, or the largest registered one for unknown models); pass it when
    the server's preset parameters are customised, or its outputs may not fit the regions.
    ``max_concurrency`` is the HTTP connection pool size. Not thread safe: use one client per thread.
    """

    def __init__(
        self,
        url: str,
        protocol: Protocol = "grpc",
        model: str = "kimi_k25_vision",
        use_shared_memory: bool = False,
        *,
        preset: str | Preset | None = None,
        max_concurrency: int = 16,
    ) -> None:
        if protocol not in ADAPTERS:
            raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
        self.url = strip_scheme(url)
        self.protocol = protocol
        self.model = model
        self.use_shared_memory = use_shared_memory
        self.preset = get_preset(preset) if preset is not None else self._model_preset(model)
        self._adapter = ADAPTERS[protocol]()
        self._client = self._adapter.connect(self.url, max_concurrency)
        self._free_slots: list[ShmSlot] = []
        self._all_slots: list[ShmSlot] = []

    @staticmethod
    def _model_preset(model: str) -> Preset:
        return get_preset(MODEL_PRESETS[model]) if model in MODEL_PRESETS else largest_preset()

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister and destroy every shared-memory region, then close the connection."""
        try:
            for slot in self._all_slots:
                slot.release(self._client)
        finally:
            self._all_slots.clear()
            self._free_slots.clear()
            self._client.close()

    def __enter__(self) -> KimiVisionClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def shared_memory_regions(self) -> list[str]:
        """Names of the regions this client has registered (for inspection and tests)."""
        return [r.name for slot in self._all_slots for r in (slot.input, slot.output) if r is not None]

    def is_ready(self) -> bool:
        """True when the server answers and ``model`` is loaded (connection errors mean False)."""
        try:
            return bool(self._client.is_server_ready() and self._client.is_model_ready(self.model))
        except Exception:  # refused / unreachable / timed out: not ready, whatever the transport says
            return False

    # -- inference ------------------------------------------------------------------------------

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
            outcome = self._collect(window.pop(0))
            if on_result is not None:
                on_result(len(results), outcome)
            results.append(outcome)

        for data in items:
            if len(window) >= concurrency:
                collect_oldest()
            window.append(self._submit(data))
        while window:
            collect_oldest()
        return results

    def _submit(self, data: bytes) -> _Pending | PreprocessError:
        slot = self._acquire_slot() if self.use_shared_memory else None
        try:
            inputs, outputs, offsets = self._request(data, slot)
            return _Pending(self._adapter.submit(self._client, self.model, inputs, outputs), slot, offsets)
        except Exception as exc:
            self._release_slot(slot)
            return error_from_server(exc)

    def _collect(self, pending: _Pending | PreprocessError) -> VisionResult | PreprocessError:
        if isinstance(pending, PreprocessError):
            return pending
        try:
            result = pending.wait()
            if pending.slot is not None and pending.output_offsets is not None:
                return to_vision_result(self._read_shm_outputs(result, pending.slot, pending.output_offsets))
            return to_vision_result({name: result.as_numpy(name) for name in OUTPUT_DTYPES})
        except Exception as exc:
            return error_from_server(exc)
        finally:
            self._release_slot(pending.slot)

    def _request(self, data: bytes, slot: ShmSlot | None) -> tuple[list[Any], list[Any], dict[str, int] | None]:
        """InferInput / InferRequestedOutput lists, and the output offsets when outputs go to shm."""
        module = self._adapter.module
        image = module.InferInput(INPUT_NAME, [1, 1], "BYTES")
        batch = np.array([[data]], dtype=np.object_)
        outputs = [module.InferRequestedOutput(name) for name in OUTPUT_DTYPES]
        if slot is None:
            image.set_data_from_numpy(batch)
            return [image], outputs, None
        serialized = tritonclient.utils.serialize_byte_tensor(batch)
        input_bytes = tritonclient.utils.serialized_byte_size(serialized)
        size = image_size(data)
        # An unparsable header has no known output size: the outputs (none: the server rejects it)
        # then travel over the wire, only the input uses shm.
        sizes = output_byte_sizes(*size, self.preset) if size is not None else None
        slot.fit(self._client, input_bytes, sum(sizes.values()) if sizes else 0)
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
        slot = ShmSlot()
        self._all_slots.append(slot)
        return slot

    def _release_slot(self, slot: ShmSlot | None) -> None:
        if slot is not None:
            self._free_slots.append(slot)
