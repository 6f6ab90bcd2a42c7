"""Request/response logic of the Triton Python-backend models.

The ``model.py`` files in ``model_repository/`` only forward ``initialize``/``execute``/``finalize``
to the classes here, passing ``triton_python_backend_utils`` in. Everything below is plain Python
on numpy arrays / torch tensors plus a thin adapter (:class:`TritonIO`) around the ``pb_utils``
calls, so it is unit-tested without a server (``tests/test_serving_units.py``).

Tensor shapes as the models see them (every model has ``max_batch_size > 0`` and takes exactly one
image per request, so the leading dimension is 1):

=======================  =========================================  ======================================
model                    inputs                                     outputs
=======================  =========================================  ======================================
``kimi_*_decode``        IMAGE_BYTES bytes ``[1, 1]``               IMAGE uint8 ``[1, H, W, C]`` (C = 3 RGB
                                                                    or 4 straight-alpha RGBA), ORIGINAL_SIZE
                                                                    int64 ``[1, 2]`` (width, height),
                                                                    RESAMPLE uint8 ``[1, 1]`` (0 bicubic,
                                                                    1 nearest), DECODE_PATH bytes ``[1, 1]``
``kimi_*_preprocess``    IMAGE, ORIGINAL_SIZE, RESAMPLE             PIXEL_VALUES float32 ``[1, N, 3, p, p]``,
                                                                    PIXEL_PATCHES uint8 ``[1, N, 3, p, p]``
                                                                    (the same patches before the normalise
                                                                    lookup), GRID_THW int64 ``[1, 3]``,
                                                                    NUM_TOKENS int32 ``[1, 1]``; only the
                                                                    requested ones are computed
``kimi_*_vision_fused``  IMAGE_BYTES bytes ``[1, 1]``               those of ``kimi_*_preprocess`` (decode and
                                                                    preprocess in one model; no hop)
``kimi_patch_embed``     PIXEL_VALUES float32 ``[1, N, 3, p, p]``   PATCH_EMBEDS float32 ``[1, N, hidden]``
=======================  =========================================  ======================================

Contract of ``execute``: one response per request, in order; a request that fails gets a
``TritonError`` whose code comes from :func:`~kimi_vision_prep.errors.triton_code_for` and never
affects the other requests of the batch; a cancelled request gets CANCELLED; nothing is raised out
of ``execute``.

Requested outputs (``request.requested_output_names()``, checked on tritonserver 2.51): a client
that names no outputs gets, and the model sees as requested, every output of the config; an
ensemble step requests exactly the keys of its ``output_map`` (whatever the ensemble's client
asked for); outputs a model returns beyond the requested ones are dropped by the backend.
"""

from __future__ import annotations

import dataclasses
import io
import time
import traceback
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from ..decode import DecodedImage, ImageDecoder, pillow_pixels
from ..errors import CancelledError, InvalidRequestError, PreprocessError, detached, reason_for, triton_code_for
from ..numba_runtime import set_num_threads
from ..pipeline import pixel_values_from_patches, preprocess_decoded
from ..presets import Preset, preset_from_parameters
from ..sizing import navit_target_size
from .config import decoder_settings, model_config_from_args, model_parameters, numba_threads, parse_int
from .metrics import ModelMetrics

RESAMPLE_CODES: dict[str, int] = {"bicubic": 0, "nearest": 1}
RESAMPLE_NAMES: dict[int, str] = {code: name for name, code in RESAMPLE_CODES.items()}
CHANNEL_MODES: dict[int, str] = {3: "RGB", 4: "RGBA"}

Outputs = dict[str, Any]  # output name -> numpy array or torch tensor (with the batch dim of 1)
PREPROCESS_OUTPUTS = ("PIXEL_VALUES", "PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS")


# -- tensors in and out (the DLPack hand-off) ---------------------------------------------------


def input_array(pb_tensor: Any) -> Any:
    """A ``pb_utils.Tensor`` as a numpy array (host memory) or a torch tensor (GPU memory, no copy).

    With ``FORCE_CPU_ONLY_INPUT_TENSORS: "no"`` a GPU producer's tensor arrives on the GPU; it is
    wrapped through DLPack instead of being copied to the host.
    """
    if pb_tensor.is_cpu():
        return pb_tensor.as_numpy()
    import torch

    return torch.from_dlpack(pb_tensor.to_dlpack())


def host_array(value: Any) -> np.ndarray:
    """numpy view of a small tensor wherever it lives (used for sizes and flags)."""
    if isinstance(value, np.ndarray):
        return value
    return value.detach().cpu().numpy()


def output_tensor(pb_utils: Any, name: str, value: Any) -> Any:
    """``pb_utils.Tensor`` named ``name`` from a numpy array or a torch tensor.

    A CUDA tensor is handed over through DLPack (made contiguous first; the backend rejects strided
    DLPack tensors); host data goes through numpy. Empty tensors are refused: the Python stub
    cannot pass them through an ensemble.
    """
    if isinstance(value, np.ndarray):
        if value.size == 0:
            raise ValueError(f"output {name} would be empty (shape {value.shape})")
        return pb_utils.Tensor(name, np.ascontiguousarray(value))
    if value.numel() == 0:
        raise ValueError(f"output {name} would be empty (shape {tuple(value.shape)})")
    if value.device.type == "cpu":
        return pb_utils.Tensor(name, np.ascontiguousarray(value.numpy()))
    return pb_utils.Tensor.from_dlpack(name, value.contiguous())


def synchronize_cuda(values: Iterable[Any]) -> None:
    """Wait for the kernels that produce CUDA outputs (they run on torch's current stream; the
    backend reads the memory from another process through CUDA IPC without joining that stream)."""
    devices = sorted(
        {f"cuda:{v.device.index or 0}" for v in values if not isinstance(v, np.ndarray) and v.device.type == "cuda"}
    )
    if devices:
        import torch

        for device in devices:
            torch.cuda.synchronize(device)


def _dtype_name(value: Any) -> str:
    return str(value.dtype).replace("torch.", "")


def _check_dtype(name: str, value: Any, expected: str) -> None:
    if _dtype_name(value) != expected:
        raise InvalidRequestError(f"{name} must be {expected}, got {_dtype_name(value)}")


# -- pure request/response functions -------------------------------------------------------------


def image_bytes_from_input(array: np.ndarray) -> bytes:
    """The encoded image of an ``IMAGE_BYTES`` input: object array of shape ``[1, 1]`` holding bytes."""
    array = np.asarray(array)
    if array.shape != (1, 1):
        raise InvalidRequestError(
            f"IMAGE_BYTES must have shape [1, 1] (one image per request), got {list(array.shape)}"
        )
    value = array[0, 0]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidRequestError(f"IMAGE_BYTES must hold bytes, got {type(value).__name__}")


def decode_outputs(decoded: DecodedImage) -> Outputs:
    """Outputs of a decode model for one image (numpy or torch ``pixels`` kept as they are)."""
    return {
        "IMAGE": decoded.pixels[None],
        "ORIGINAL_SIZE": np.array([[decoded.width, decoded.height]], dtype=np.int64),
        "RESAMPLE": np.array([[RESAMPLE_CODES[decoded.resample]]], dtype=np.uint8),
        "DECODE_PATH": np.array([[decoded.decode_path.encode()]], dtype=np.object_),
    }


def decoded_from_inputs(image: Any, original_size: Any, resample: Any, preset: Preset) -> DecodedImage:
    """Rebuild the :class:`DecodedImage` a decode model described, validating what a client sent.

    ``image``: uint8 ``[1, H, W, C]`` (numpy or torch, any device); ``original_size``: int64
    ``[1, 2]`` (width, height); ``resample``: uint8 ``[1, 1]``. ``H x W`` is the original size, or
    already the target size (exotic modes the K3 decode resized with Pillow).
    """
    _check_dtype("IMAGE", image, "uint8")
    if image.ndim != 4 or image.shape[0] != 1 or image.shape[3] not in CHANNEL_MODES:
        raise InvalidRequestError(f"IMAGE must have shape [1, H, W, 3 or 4], got {list(image.shape)}")
    channels = int(image.shape[3])
    if channels == 4 and preset.transparency != "chessboard":
        raise InvalidRequestError(f"preset {preset.name!r} takes RGB images (C=3), got C=4")
    size = host_array(original_size)
    _check_dtype("ORIGINAL_SIZE", size, "int64")
    if size.shape != (1, 2) or (size < 1).any():
        raise InvalidRequestError(f"ORIGINAL_SIZE must be [[width, height]] >= 1, got {size.tolist()}")
    width, height = int(size[0, 0]), int(size[0, 1])
    flags = host_array(resample)
    _check_dtype("RESAMPLE", flags, "uint8")
    if flags.shape != (1, 1) or int(flags[0, 0]) not in RESAMPLE_NAMES:
        raise InvalidRequestError(f"RESAMPLE must be [[0]] (bicubic) or [[1]] (nearest), got {flags.tolist()}")
    target = navit_target_size(width, height, preset)
    stored = (int(image.shape[1]), int(image.shape[2]))
    if stored not in ((height, width), (target.new_height, target.new_width)):
        raise InvalidRequestError(
            f"IMAGE is {stored[1]}x{stored[0]} but ORIGINAL_SIZE is {width}x{height} "
            f"(expected that or the target size {target.new_width}x{target.new_height})"
        )
    return DecodedImage(
        pixels=image[0],
        width=width,
        height=height,
        source_mode=CHANNEL_MODES[channels],
        resample=RESAMPLE_NAMES[int(flags[0, 0])],  # type: ignore[arg-type]
        decode_path="upstream",  # type: ignore[arg-type]  # decoded by another model
    )


def preprocess_outputs(decoded: DecodedImage, preset: Preset, requested: Collection[str] | None = None) -> Outputs:
    """Outputs of a preprocess model for one image: the ``requested`` names (None: all of
    :data:`PREPROCESS_OUTPUTS`), each computed only if asked for.

    PIXEL_VALUES alone: the fused float32 pass. PIXEL_PATCHES: uint8 pad + patchify, and
    PIXEL_VALUES, if asked for as well, expanded from those patches (one resize for both; bit-equal
    to the fused pass). Neither pixel output: no resize at all (GRID_THW / NUM_TOKENS need only
    the size).
    """
    wanted = set(PREPROCESS_OUTPUTS if requested is None else requested)
    outputs: Outputs = {}
    if {"PIXEL_VALUES", "PIXEL_PATCHES"} & wanted:
        output = "pixel_patches" if "PIXEL_PATCHES" in wanted else "pixel_values"
        result = preprocess_decoded(decoded, preset, output=output)
        target = result.target
        if "PIXEL_PATCHES" in wanted:
            outputs["PIXEL_PATCHES"] = result.pixel_patches[None]
        if "PIXEL_VALUES" in wanted:
            values = result.pixel_values
            if values is None:
                values = pixel_values_from_patches(result.pixel_patches, preset)
            outputs["PIXEL_VALUES"] = values[None]
    else:
        target = navit_target_size(decoded.width, decoded.height, preset)
    if "GRID_THW" in wanted:
        outputs["GRID_THW"] = np.asarray(target.grid_thw, dtype=np.int64)[None]
    if "NUM_TOKENS" in wanted:
        outputs["NUM_TOKENS"] = np.array([[target.num_tokens]], dtype=np.int32)
    return outputs


def pixel_values_from_input(array: Any, patch_size: int) -> Any:
    """``PIXEL_VALUES`` float32 ``[1, N, 3, p, p]`` -> torch float32 ``(N, 3, p, p)``."""
    import torch

    _check_dtype("PIXEL_VALUES", array, "float32")
    if array.ndim != 5 or array.shape[0] != 1 or tuple(array.shape[2:]) != (3, patch_size, patch_size):
        raise InvalidRequestError(
            f"PIXEL_VALUES must have shape [1, N, 3, {patch_size}, {patch_size}], got {list(array.shape)}"
        )
    if isinstance(array, np.ndarray):
        array = torch.from_numpy(array if array.flags.writeable else array.copy())
    return array[0]


def warmup_images() -> list[bytes]:
    """Small encoded images that exercise every compiled path: an RGB JPEG (fast decode, no resize),
    tall and wide RGB JPEGs and RGBA PNGs that every shipped preset must resize (a side > 512
    patches: both pass orders, premultiplied RGBA under K3) and a small RGBA PNG (alpha, no resize)."""

    def encode(pixels: np.ndarray, mode: str, fmt: str) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(pixels).astype(np.uint8), mode).save(buffer, format=fmt)
        return buffer.getvalue()

    ramp = np.arange(48 * 64 * 4, dtype=np.uint32).reshape(48, 64, 4) % 251
    tall = np.tile(ramp[:1, :16], (7300, 1, 1))
    wide = tall.transpose(1, 0, 2)
    return [
        encode(ramp[:, :, :3], "RGB", "JPEG"),
        encode(tall[:, :, :3], "RGB", "JPEG"),
        encode(wide[:, :, :3], "RGB", "JPEG"),
        encode(tall, "RGBA", "PNG"),
        encode(wide, "RGBA", "PNG"),
        encode(ramp, "RGBA", "PNG"),
    ]


def warmup_decoded(preset: Preset) -> list[DecodedImage]:
    """:func:`warmup_images` decoded in-process with Pillow (no nvImageCodec decoder created)."""
    decoded = []
    for data in warmup_images():
        image = Image.open(io.BytesIO(data))
        pixels, resample = pillow_pixels(image, preset)
        decoded.append(DecodedImage(pixels, image.width, image.height, image.mode, resample, "pillow"))
    return decoded


# -- the pb_utils adapter ------------------------------------------------------------------------


class TritonIO:
    """The few ``pb_utils`` calls the models make, in one place (a fake replaces it in unit tests)."""

    def __init__(self, pb_utils: Any) -> None:
        self.pb = pb_utils

    def get_input(self, request: Any, name: str) -> Any:
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise InvalidRequestError(f"missing input {name}")
        return input_array(tensor)

    @staticmethod
    def requested_outputs(request: Any) -> frozenset[str] | None:
        """The output names the request asked for (``requested_output_names()``); None when the
        request cannot say, meaning all. Triton fills in every output when a client names none."""
        getter = getattr(request, "requested_output_names", None)
        names = getter() if callable(getter) else None
        return frozenset(names) if names else None

    @staticmethod
    def is_cancelled(request: Any) -> bool:
        check = getattr(request, "is_cancelled", None)
        return bool(check()) if check is not None else False

    def response(self, outputs: Mapping[str, Any]) -> Any:
        synchronize_cuda(outputs.values())
        tensors = [output_tensor(self.pb, name, value) for name, value in outputs.items()]
        return self.pb.InferenceResponse(output_tensors=tensors)

    @staticmethod
    def request_id(request: Any) -> str:
        """The client's request id, else a generated one, so a failure can be found in the server log."""
        getter = getattr(request, "request_id", None)
        given = getter() if callable(getter) else ""
        return str(given) if given else f"gen-{uuid.uuid4().hex[:12]}"

    def error_response(self, exc: BaseException, request_id: str | None = None) -> Any:
        errors = self.pb.TritonError
        code = getattr(errors, triton_code_for(exc), errors.INTERNAL)
        message = str(exc) if isinstance(exc, PreprocessError) else f"internal error: {type(exc).__name__}: {exc}"
        if request_id is not None:
            message = f"{message} (request id {request_id})"
        return self.pb.InferenceResponse(output_tensors=[], error=errors(message, code))

    def log(self, level: str, message: str) -> None:
        logger = getattr(self.pb, "Logger", None)
        if logger is not None:
            getattr(logger, f"log_{level}")(message)


# -- the models ----------------------------------------------------------------------------------


class ServingModel:
    """Shared ``execute`` contract; subclasses implement :meth:`handle` for the live requests."""

    stage = "model"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        self.io = TritonIO(pb_utils)
        self.config = model_config_from_args(args)
        self.parameters = model_parameters(self.config)
        self.name = str(args.get("model_name") or self.config.get("name", "model"))
        self.instance = str(args.get("model_instance_name") or self.name)
        gpu = str(args.get("model_instance_kind", "CPU")).upper() == "GPU"
        self.device = f"cuda:{int(args.get('model_instance_device_id', 0))}" if gpu else "cpu"
        self.metrics = ModelMetrics(pb_utils, self.name, self.instance)
        if self.metrics.error:
            self.io.log("warn", f"{self.name}: {self.metrics.error}")

    def handle(self, requests: Sequence[Any]) -> list[Outputs | BaseException]:
        """One outputs dict or one exception per request, in order."""
        raise NotImplementedError

    def failed(self, exc: BaseException) -> BaseException:
        """A request's error as a result value: without its traceback (see :func:`detached`: kept, it
        pins the request's tensors in a reference cycle), logged in full first when it is a bug."""
        if not isinstance(exc, PreprocessError):
            self.io.log("error", f"{self.name}: {''.join(traceback.format_exception(exc)).rstrip()}")
        return detached(exc)

    def attempt(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or the exception it raised as a result value (:meth:`failed`): one
        request's error never fails the others of its batch."""
        try:
            return fn(*args)
        except Exception as exc:
            return self.failed(exc)

    def per_request(self, items: Iterable[Any], fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(item)`` for each item, in order, through :meth:`attempt`; an item that already is an
        error stays that request's result."""
        return [item if isinstance(item, BaseException) else self.attempt(fn, item) for item in items]

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        """One response per request, in order; never raises (the stub would fail the whole batch)."""
        try:
            return self._execute(requests)
        except Exception as exc:  # last line of defence (metrics/logging/adapter failures)
            return [self.io.error_response(exc) for _ in requests]

    def _execute(self, requests: Sequence[Any]) -> list[Any]:
        results: list[Outputs | BaseException | None] = [None] * len(requests)
        live: list[int] = []
        for index, request in enumerate(requests):
            if self.io.is_cancelled(request):
                results[index] = CancelledError("request cancelled by the client")
            else:
                live.append(index)
        started = time.perf_counter()
        try:
            handled = self.handle([requests[i] for i in live]) if live else []
            for index, result in zip(live, handled, strict=True):
                results[index] = result
        except Exception as exc:  # a bug; it must not take the stub down
            self.io.log("error", f"{self.name}: execute failed for {len(live)} request(s): {type(exc).__name__}: {exc}")
            error = self.failed(exc)
            for index in live:
                results[index] = error
        self.metrics.add_stage_seconds(self.stage, time.perf_counter() - started)
        return [self._respond(request, result) for request, result in zip(requests, results, strict=True)]

    def _respond(self, request: Any, result: Outputs | BaseException | None) -> Any:
        if result is None:
            result = RuntimeError("no result produced")
        if not isinstance(result, BaseException):
            try:
                return self.io.response(result)
            except Exception as exc:
                result = exc
        reason = reason_for(result)
        self.metrics.count_error(reason)
        if triton_code_for(result) in ("INVALID_ARG", "CANCELLED"):  # the client's doing: not a server error
            self.io.log("verbose", f"{self.name}: request failed ({reason}): {result}")
            return self.io.error_response(result)
        # UNAVAILABLE / INTERNAL: logged with the id the client sees in its error message.
        request_id = self.io.request_id(request)
        self.io.log("error", f"{self.name}: request {request_id} failed ({reason}): {type(result).__name__}: {result}")
        return self.io.error_response(result, request_id)

    def finalize(self) -> None:
        self.metrics.close()


# -- the pieces the image models are built from ------------------------------------------------

# The pixel-output selections a request can make; each runs its own kernel combination (fused
# float32, uint8 patchify, patchify + expand), so each is warmed up.
PIXEL_SELECTIONS = (("PIXEL_VALUES",), ("PIXEL_PATCHES",), ("PIXEL_VALUES", "PIXEL_PATCHES"))


def configure_numba(parameters: Mapping[str, str]) -> int:
    """Apply the ``numba_threads`` parameter to this process (0 leaves numba's default); returns it."""
    threads = numba_threads(parameters)
    if threads:
        set_num_threads(threads)
    return threads


def writable_and_read_only(decoded: DecodedImage) -> list[DecodedImage]:
    """``decoded`` with its host pixels copied once writable and once read-only (distinct numba
    signatures: Triton may hand a model either); device tensors are returned as they are."""
    if not isinstance(decoded.pixels, np.ndarray):
        return [decoded]
    variants = []
    for writable in (True, False):
        pixels = decoded.pixels.copy()
        pixels.setflags(write=writable)
        variants.append(dataclasses.replace(decoded, pixels=pixels))
    return variants


class PresetModel(ServingModel):
    """A model whose ``parameters`` carry a preset block (:func:`preset_from_parameters`)."""

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        self.preset = preset_from_parameters(self.parameters)


class DecodesImages(PresetModel):
    """``IMAGE_BYTES`` in: the decoder (the config's :class:`~.config.DecoderSettings`), its
    warm-up, one batch decode per execute, decodes counted by path and fallbacks counted and logged
    once per reason. Subclasses call :meth:`setup_decoder` from ``__init__``."""

    def setup_decoder(self) -> list[DecodedImage]:
        """Create the decoder and decode :func:`warmup_images` with it, so the first request pays
        no decoder creation; returns those decoded images."""
        self.decoder_settings = settings = decoder_settings(self.parameters)
        self.decoder = ImageDecoder(
            self.device,
            limits=settings.limits,
            strict=settings.strict_decode,
            pool_size=settings.decoder_pool_size,
            decoder_threads=settings.decoder_threads,
        )
        self._logged_fallbacks: set[str] = set()
        images = warmup_images()
        decoded = []
        for data, result in zip(images, self.decoder.decode_batch(images, self.preset), strict=True):
            if isinstance(result, BaseException):
                raise RuntimeError(f"warm-up decode of a {len(data)}-byte image failed: {result}")
            decoded.append(result)
        return decoded

    def record_decode(self, decoded: DecodedImage) -> None:
        self.metrics.count_decode(decoded.decode_path)
        reason = decoded.fallback_reason
        if reason is not None:
            self.metrics.count_fallback(reason)
            if reason not in self._logged_fallbacks:
                self._logged_fallbacks.add(reason)
                self.io.log("warn", f"{self.name}: decoder fallback to Pillow (logged once per reason): {reason}")

    def decode_requests(self, requests: Sequence[Any]) -> list[DecodedImage | BaseException]:
        """The requests' images, all decoded in one batch call: a :class:`DecodedImage` or the
        error per request, in order."""
        items = self.per_request(requests, lambda r: image_bytes_from_input(self.io.get_input(r, "IMAGE_BYTES")))
        decoded = iter(self.decoder.decode_batch([x for x in items if isinstance(x, bytes)], self.preset))
        results: list[DecodedImage | BaseException] = []
        for item in items:
            result = item if isinstance(item, BaseException) else next(decoded)
            if isinstance(result, DecodedImage):
                self.record_decode(result)
            results.append(result)
        return results


class PreprocessesImages(PresetModel):
    """Decoded pixels -> the requested preprocess outputs (numba on the host, torch on a GPU), with
    the ``numba_threads`` parameter applied. Subclasses call :meth:`setup_preprocess` from
    ``__init__``."""

    def setup_preprocess(self, warmup: Iterable[DecodedImage]) -> int:
        """Apply ``numba_threads`` and run every ``warmup`` image through each pixel selection of
        :data:`PIXEL_SELECTIONS` (loads or compiles the numba kernels); returns the thread count."""
        threads = configure_numba(self.parameters)
        for decoded in warmup:
            for requested in PIXEL_SELECTIONS:
                preprocess_outputs(decoded, self.preset, requested)
        return threads

    def preprocess(self, decoded: DecodedImage, request: Any) -> Outputs:
        """The outputs ``request`` asked for (all when it cannot say)."""
        return preprocess_outputs(decoded, self.preset, self.io.requested_outputs(request))


# -- the models ----------------------------------------------------------------------------------


class DecodeModel(DecodesImages):
    """``kimi_*_decode``: encoded bytes -> pixels; all requests of one execute in one batch decode."""

    stage = "decode"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        self.setup_decoder()
        self.io.log("info", f"{self.name}: preset {self.preset.name}, device {self.device}, {self.decoder_settings}")

    def handle(self, requests: Sequence[Any]) -> list[Outputs | BaseException]:
        return self.per_request(self.decode_requests(requests), decode_outputs)


class PreprocessModel(PreprocessesImages):
    """``kimi_*_preprocess``: decoded pixels -> resize, pad, normalise, patchify (numba or torch)."""

    stage = "preprocess"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        # Warm-up from the inputs as this model receives them (IMAGE is a [1, H, W, C] tensor).
        warmup = (
            self.decoded_input(decode_outputs(variant))
            for decoded in warmup_decoded(self.preset)
            for variant in writable_and_read_only(decoded)
        )
        threads = self.setup_preprocess(warmup)
        self.io.log(
            "info", f"{self.name}: preset {self.preset}, device {self.device}, numba_threads {threads or 'default'}"
        )

    def decoded_input(self, inputs: Mapping[str, Any]) -> DecodedImage:
        return decoded_from_inputs(inputs["IMAGE"], inputs["ORIGINAL_SIZE"], inputs["RESAMPLE"], self.preset)

    def process(self, request: Any) -> Outputs:
        names = ("IMAGE", "ORIGINAL_SIZE", "RESAMPLE")
        return self.preprocess(self.decoded_input({n: self.io.get_input(request, n) for n in names}), request)

    def handle(self, requests: Sequence[Any]) -> list[Outputs | BaseException]:
        return self.per_request(requests, self.process)


class FusedVisionModel(DecodesImages, PreprocessesImages):
    """``kimi_*_vision_fused``: encoded bytes -> the preprocess outputs in one model, for CPU hosts.

    The ``kimi_*_vision`` ensembles' work without their hop: no decoded image is copied into the
    stub's shared memory, read back by a second model and sent through a second stub round trip.
    All requests of one execute are decoded in one batch call (as :class:`DecodeModel`), then each
    is preprocessed on its own (as :class:`PreprocessModel`), computing only its requested outputs.
    """

    stage = "vision"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        decoded = self.setup_decoder()
        # Warm-up from the decoder's own outputs (the arrays this model will see), and host copies.
        threads = self.setup_preprocess([*decoded, *(v for d in decoded for v in writable_and_read_only(d))])
        self.io.log(
            "info",
            f"{self.name}: preset {self.preset}, device {self.device}, {self.decoder_settings}, "
            f"numba_threads {threads or 'default'}",
        )

    def handle(self, requests: Sequence[Any]) -> list[Outputs | BaseException]:
        decoded = self.decode_requests(requests)
        return [
            image if isinstance(image, BaseException) else self.attempt(self.preprocess, image, request)
            for request, image in zip(requests, decoded, strict=True)
        ]


class PatchEmbedModel(ServingModel):
    """``kimi_patch_embed``: seeded Conv2d over the patches of every request in one call."""

    stage = "patch_embed"

    def __init__(self, pb_utils: Any, args: Mapping[str, Any]) -> None:
        super().__init__(pb_utils, args)
        from .patch_embed import make_patch_embed

        self.patch_size = parse_int("patch_size", self.parameters.get("patch_size", "14"), 1)
        self.hidden_size = parse_int("hidden_size", self.parameters.get("hidden_size", "1152"), 1)
        self.seed = parse_int("seed", self.parameters.get("seed", "0"), 0)
        self.conv = make_patch_embed(self.seed, self.hidden_size, self.patch_size, self.device)
        self.io.log(
            "info", f"{self.name}: Conv2d(3, {self.hidden_size}, {self.patch_size}) seed {self.seed} on {self.device}"
        )

    def handle(self, requests: Sequence[Any]) -> list[Outputs | BaseException]:
        import torch

        from .patch_embed import embed_patches

        results: list[Outputs | BaseException] = []
        inputs: list[Any] = []
        for request in requests:
            try:
                pixel_values = pixel_values_from_input(self.io.get_input(request, "PIXEL_VALUES"), self.patch_size)
                inputs.append(pixel_values.to(self.device))
                results.append({})
            except Exception as exc:
                results.append(self.failed(exc))
        if inputs:
            embeds = embed_patches(self.conv, torch.cat(inputs)).split([len(x) for x in inputs])
            ok = (r for r in results if not isinstance(r, BaseException))
            for result, embed in zip(ok, embeds, strict=True):
                result["PATCH_EMBEDS"] = embed[None]
        return results


def triton_python_model(model_class: type[ServingModel]) -> type:
    """The ``TritonPythonModel`` class a ``model.py`` exports for ``model_class`` (the Python
    backend looks the name up in the module and calls ``initialize``/``execute``/``finalize``)."""

    class TritonPythonModel:
        def initialize(self, args: dict[str, Any]) -> None:
            import triton_python_backend_utils as pb_utils  # only importable inside the stub

            self.model = model_class(pb_utils, args)

        def execute(self, requests: list[Any]) -> list[Any]:
            return self.model.execute(requests)

        def finalize(self) -> None:
            self.model.finalize()

    TritonPythonModel.__qualname__ = f"TritonPythonModel[{model_class.__name__}]"
    return TritonPythonModel
