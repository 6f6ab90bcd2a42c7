"""A Triton client for the Kimi vision preprocessing models, one API over HTTP and gRPC.

The models take ``IMAGE_BYTES`` (TYPE_STRING, batch shape ``[1, 1]``) and return
``PIXEL_VALUES`` float32 ``[1, N, 3, p, p]`` (``kimi_*_vision``) or, on the "uint8 wire"
(``kimi_*_vision_u8``), ``PIXEL_PATCHES`` uint8 ``[1, N, 3, p, p]``, plus ``GRID_THW`` int64
``[1, 3]`` and ``NUM_TOKENS`` int32 ``[1, 1]``; the single-model ``kimi_*_vision_fused`` offer
both pixel outputs and compute the one requested (the client asks for ``PIXEL_PATCHES``).
:class:`KimiVisionClient` hides the batch dimension, expands uint8 patches into the float32
``pixel_values`` with the preset's normalise table (bit-equal to the float32 ensemble:
``PIXEL_VALUES`` is that table read at ``PIXEL_PATCHES``), and raises server errors as the
:mod:`kimi_vision_prep.errors` class the server's message is tagged with
(:func:`~kimi_vision_prep.errors.error_from_served`), so a remote call fails exactly like
``kimi_vision_prep.preprocess_bytes`` would in-process.

The wire is learnt from the server, once per client, at the first request (:func:`learn_wire`):
a model whose config lists a ``PIXEL_PATCHES`` output is served over the uint8 wire, and the
preset (mean/std for the table, sizes for shared memory) is read from the ``parameters`` of the
model that produces the pixels (the model itself, or the ensemble step that yields them), so a
renamed or re-parameterised model still expands exactly; the client keeps no table of models.

With ``use_shared_memory=True`` the request and the outputs travel through POSIX shared memory
(client and server must share ``/dev/shm``, e.g. the same host or pod). The output size is known
before sending: the NaViT rule needs only the width and height from the image header.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import tritonclient.utils
import tritonclient.utils.shared_memory as shm
from PIL import Image

from kimi_vision_prep import (
    PRESETS,
    PreprocessError,
    Preset,
    get_preset,
    navit_target_size,
    pixel_values_from_patches,
    preset_from_parameters,
)
from kimi_vision_prep.errors import error_from_served

from .transport import ADAPTERS, ShmSlot, Waiter

Protocol = Literal["http", "grpc"]

INPUT_NAME = "IMAGE_BYTES"
PIXEL_VALUES, PIXEL_PATCHES = "PIXEL_VALUES", "PIXEL_PATCHES"
GRID_THW, NUM_TOKENS = "GRID_THW", "NUM_TOKENS"
OUTPUT_DTYPES: dict[str, np.dtype] = {
    PIXEL_VALUES: np.dtype(np.float32),
    PIXEL_PATCHES: np.dtype(np.uint8),
    GRID_THW: np.dtype(np.int64),
    NUM_TOKENS: np.dtype(np.int32),
}
# Transport status (HTTP code or gRPC StatusCode) -> the Triton code name it carries.
TRITON_CODES: dict[str, str] = {
    "400": "INVALID_ARG",
    "StatusCode.INVALID_ARGUMENT": "INVALID_ARG",
    "503": "UNAVAILABLE",
    "StatusCode.UNAVAILABLE": "UNAVAILABLE",
    "StatusCode.CANCELLED": "CANCELLED",
}


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
    """A tritonclient error as the :class:`PreprocessError` the server raised (its message's tag),
    or, for Triton's own untagged rejections, the class of its code."""
    if isinstance(exc, tritonclient.utils.InferenceServerException):
        return error_from_served(TRITON_CODES.get(str(exc.status()), "INTERNAL"), exc.message() or str(exc))
    return PreprocessError(f"{type(exc).__name__}: {exc}")


def image_size(data: bytes) -> tuple[int, int] | None:
    """Stored ``(width, height)`` from the header (no pixel decode), or None if Pillow cannot parse it."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception:  # any header Pillow rejects: the server will reject it too and say why
        return None


def output_byte_sizes(width: int, height: int, preset: Preset, pixel_output: str = PIXEL_VALUES) -> dict[str, int]:
    """Bytes of each output for a ``width x height`` image under ``preset`` (batch of one), with
    the pixels as ``pixel_output`` (``PIXEL_VALUES`` float32 or ``PIXEL_PATCHES`` uint8)."""
    target = navit_target_size(width, height, preset)
    patch_values = 3 * preset.patch_size * preset.patch_size
    return {
        pixel_output: target.num_patches * patch_values * OUTPUT_DTYPES[pixel_output].itemsize,
        GRID_THW: 3 * OUTPUT_DTYPES[GRID_THW].itemsize,
        NUM_TOKENS: OUTPUT_DTYPES[NUM_TOKENS].itemsize,
    }


def largest_preset() -> Preset:
    """The registered preset with the largest patch budget (its outputs bound every other's)."""
    return max(PRESETS.values(), key=lambda p: (p.in_patch_limit, p.patch_limit_on_one_side))


@dataclass(frozen=True)
class Wire:
    """How a model's pixels travel, as learnt from the server by :func:`learn_wire`.

    ``pixel_output``: ``PIXEL_VALUES`` (float32, used as received) or ``PIXEL_PATCHES`` (uint8,
    expanded on the client). ``preset``: sizes shared-memory regions and, on the uint8 wire, gives
    the normalise table (``normalize_table(preset.image_mean, preset.image_std)``).
    """

    pixel_output: str
    preset: Preset

    @property
    def outputs(self) -> tuple[str, str, str]:
        """The output names requested per image."""
        return (self.pixel_output, GRID_THW, NUM_TOKENS)


def config_parameters(config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters`` of a model config (HTTP / gRPC JSON) as plain ``{key: string_value}``."""
    return {key: str(value.get("string_value", "")) for key, value in (config.get("parameters") or {}).items()}


def producer_preset(
    get_config: Callable[[str], Mapping[str, Any]], config: Mapping[str, Any], tensor: str, depth: int = 0
) -> Preset | None:
    """The preset of the model that produces output ``tensor`` of ``config``: for an ensemble, the
    step whose ``output_map`` yields it (followed recursively); otherwise the model's own
    ``parameters`` when they name a ``preset``. None when no model on the way names one."""
    for step in (config.get("ensemble_scheduling") or {}).get("step", []):
        for key, value in (step.get("output_map") or {}).items():
            if value == tensor and depth < 8:
                return producer_preset(get_config, get_config(step["model_name"]), key, depth + 1)
    parameters = config_parameters(config)
    return preset_from_parameters(parameters) if "preset" in parameters else None


def learn_wire(get_config: Callable[[str], Mapping[str, Any]], model: str, preset: Preset | None = None) -> Wire:
    """Ask the server how ``model`` returns its pixels (``get_config(name)`` is a model-config call).

    A model whose outputs include ``PIXEL_PATCHES`` is served over the uint8 wire (also when it
    offers ``PIXEL_VALUES`` as well, like ``kimi_*_vision_fused``: the patches expand bit-equal and
    are a quarter of the bytes), else it returns ``PIXEL_VALUES``. The preset is ``preset`` if
    given, else the one in the config parameters of the model producing the pixels (the model
    itself, or the ensemble step that yields them), else (float32 only: it just sizes regions) the
    largest registered preset. A uint8 model with no
    known preset is read over float32 if it offers ``PIXEL_VALUES`` too, and otherwise raises
    :class:`PreprocessError`: a guessed table would give wrong values.
    """
    config = get_config(model)
    names = {output.get("name") for output in config.get("output", [])}
    candidates = [name for name in (PIXEL_PATCHES, PIXEL_VALUES) if name in names] or [PIXEL_VALUES]
    for pixel_output in candidates:
        found = preset or producer_preset(get_config, config, pixel_output)
        if found is not None:
            return Wire(pixel_output, found)
        if pixel_output == PIXEL_VALUES:
            return Wire(PIXEL_VALUES, largest_preset())
    raise PreprocessError(
        f"model {model!r} returns uint8 PIXEL_PATCHES but its config names no preset to expand them "
        "with; pass preset= to KimiVisionClient"
    )


def to_vision_result(outputs: Mapping[str, np.ndarray], preset: Preset | None = None) -> VisionResult:
    """Batch-of-one output tensors -> :class:`VisionResult` (new arrays, so shm regions can be reused).

    ``PIXEL_PATCHES`` (uint8) are expanded into float32 ``pixel_values`` with ``preset``'s table;
    ``PIXEL_VALUES`` are copied as they are.
    """
    if PIXEL_PATCHES in outputs:
        if preset is None:
            raise ValueError("expanding PIXEL_PATCHES needs the preset")
        pixel_values = pixel_values_from_patches(np.asarray(outputs[PIXEL_PATCHES][0]), preset)
    else:
        pixel_values = np.array(outputs[PIXEL_VALUES][0], dtype=np.float32)
    return VisionResult(
        pixel_values=pixel_values,
        grid_thw=np.array(outputs[GRID_THW], dtype=np.int64).reshape(3),
        num_tokens=int(np.asarray(outputs[NUM_TOKENS]).reshape(())),
    )


# -- the client ---------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A submitted request: how to wait for it, and the shm slot (if any) holding its outputs."""

    wait: Waiter
    slot: ShmSlot | None
    output_offsets: dict[str, int] | None


class KimiVisionClient:
    """Preprocess images on a Triton server running the Kimi vision models.

    ``url`` is ``host:port`` (a scheme is accepted and ignored); ``protocol`` picks
    tritonclient.http or tritonclient.grpc; ``model`` the ensemble (``kimi_*_vision`` float32, or
    ``kimi_*_vision_u8``: uint8 patches on the wire, expanded here; the result is the same) or
    the single-model ``kimi_*_vision_fused`` (uint8 patches on the wire too);
    ``use_shared_memory`` sends inputs and receives outputs through system shared memory.
    ``preset`` overrides the preset learnt from the server (see :func:`learn_wire`); it sizes the
    output regions and, on the uint8 wire, expands the patches, so it must match the server's.
    ``max_concurrency`` is the HTTP connection pool size. Attributes: ``preset``, the preset in
    use (the given one, else the server's, asked for on first use); ``wire`` (:class:`Wire`);
    ``output_bytes_received``, the output bytes received so far (over the
    wire or through shared memory). Not thread safe: use one client per thread.
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
        self._preset_override = get_preset(preset) if preset is not None else None
        self._adapter = ADAPTERS[protocol]()
        self._client = self._adapter.connect(self.url, max_concurrency)
        self._wire: Wire | None = None
        self._free_slots: list[ShmSlot] = []
        self._all_slots: list[ShmSlot] = []
        self.output_bytes_received = 0

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
    def wire(self) -> Wire:
        """How ``model`` returns its pixels and under which preset; asked from the server once
        (raises what the server call raises; a later access asks again)."""
        if self._wire is None:
            self._wire = learn_wire(
                lambda name: self._adapter.model_config(self._client, name), self.model, self._preset_override
            )
        return self._wire

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
            inputs, outputs, offsets = self._request(data, slot, self.wire)
            return _Pending(self._adapter.submit(self._client, self.model, inputs, outputs), slot, offsets)
        except Exception as exc:
            self._release_slot(slot)
            return error_from_server(exc)

    def _collect(self, pending: _Pending | PreprocessError) -> VisionResult | PreprocessError:
        if isinstance(pending, PreprocessError):
            return pending
        try:
            result = pending.wait()
            wire = self.wire
            if pending.slot is not None and pending.output_offsets is not None:
                outputs = self._read_shm_outputs(result, pending.slot, pending.output_offsets)
            else:
                outputs = {name: result.as_numpy(name) for name in wire.outputs}
            self.output_bytes_received += sum(array.nbytes for array in outputs.values())
            return to_vision_result(outputs, wire.preset)
        except Exception as exc:
            return error_from_server(exc)
        finally:
            self._release_slot(pending.slot)

    def _request(
        self, data: bytes, slot: ShmSlot | None, wire: Wire
    ) -> tuple[list[Any], list[Any], dict[str, int] | None]:
        """InferInput / InferRequestedOutput lists, and the output offsets when outputs go to shm."""
        module = self._adapter.module
        image = module.InferInput(INPUT_NAME, [1, 1], "BYTES")
        batch = np.array([[data]], dtype=np.object_)
        outputs = [module.InferRequestedOutput(name) for name in wire.outputs]
        if slot is None:
            image.set_data_from_numpy(batch)
            return [image], outputs, None
        serialized = tritonclient.utils.serialize_byte_tensor(batch)
        input_bytes = tritonclient.utils.serialized_byte_size(serialized)
        size = image_size(data)
        # An unparsable header has no known output size: the outputs (none: the server rejects it)
        # then travel over the wire, only the input uses shm.
        sizes = output_byte_sizes(*size, wire.preset, wire.pixel_output) if size is not None else None
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
