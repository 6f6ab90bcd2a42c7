"""Request validation and the tensors of the image models, as pure functions.

Tensor shapes as the models see them (``max_batch_size > 0`` and one image per request, so the
leading dimension is 1):

=======================  =========================================  ======================================
model                    inputs                                     outputs
=======================  =========================================  ======================================
``kimi_*_decode``        IMAGE_BYTES bytes ``[1, 1]``               IMAGE uint8 ``[1, H, W, C]``, MODE bytes
                                                                    ``[1, 1]``, ORIGINAL_SIZE int64 ``[1, 2]``
                                                                    (width, height), RESAMPLE uint8 ``[1, 1]``
                                                                    (0 bicubic, 1 nearest), DECODE_PATH bytes
                                                                    ``[1, 1]``
``kimi_*_preprocess``    IMAGE, MODE, ORIGINAL_SIZE, RESAMPLE       PIXEL_VALUES float32 ``[1, N, 3, p, p]``,
                                                                    PIXEL_PATCHES uint8 ``[1, N, 3, p, p]``,
                                                                    GRID_THW int64 ``[1, 3]``, NUM_TOKENS
                                                                    int32 ``[1, 1]``; only the requested ones
                                                                    are computed
``kimi_*_vision_fused``  IMAGE_BYTES bytes ``[1, 1]``               those of ``kimi_*_preprocess``
``kimi_patch_embed``     PIXEL_VALUES float32 ``[1, N, 3, p, p]``   PATCH_EMBEDS float32 ``[1, N, hidden]``
=======================  =========================================  ======================================

``IMAGE`` has one meaning: the decoded pixels at the stored size ``H x W`` (= ORIGINAL_SIZE), in
the source mode that ``MODE`` names. ``MODE`` ``RGB`` (C = 3) and ``RGBA`` (C = 4, straight alpha,
K3 only) are pixel arrays the array kernels resize; any other ``MODE`` (K3's CMYK, I;16, L with a
transparency key, ...) is a Pillow mode, optionally followed by `` transparency=V[,V...]``, and
``IMAGE`` then holds that mode's raw bytes (``Image.tobytes()``), ``C`` bytes per pixel, which the
preprocess step rebuilds with ``Image.frombytes`` for resize's PIL kernel.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
from PIL import Image

from ..decode import DecodedImage
from ..errors import InvalidRequestError
from ..kernels import NUMPY, PIL_IMAGE, TORCH, get_kernel, register_kernel
from ..pipeline import pixel_values_from_patches, preprocess_decoded
from ..presets import Preset
from ..sizing import navit_target_size
from .tensors import as_torch, check_dtype, host_array

RESAMPLE_CODES: dict[str, int] = {"bicubic": 0, "nearest": 1}
RESAMPLE_NAMES: dict[int, str] = {code: name for name, code in RESAMPLE_CODES.items()}
ARRAY_MODES: dict[str, int] = {"RGB": 3, "RGBA": 4}  # MODE -> channels of a pixel array

Outputs = dict[str, Any]  # output name -> numpy array or torch tensor (with the batch dim of 1)
PREPROCESS_OUTPUTS = ("PIXEL_VALUES", "PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS")
# The pixel-output selections a request can make; each runs its own kernel combination (fused
# float32, uint8 patchify, patchify + expand), so each is warmed up.
PIXEL_SELECTIONS = (("PIXEL_VALUES",), ("PIXEL_PATCHES",), ("PIXEL_VALUES", "PIXEL_PATCHES"))


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


# -- MODE: the source mode of IMAGE ---------------------------------------------------------------


def mode_tag(image: Image.Image) -> str:
    """``MODE`` of a source-mode Pillow image: its mode, plus its transparency key if it has one."""
    key = image.info.get("transparency")
    if key is None:
        return image.mode
    values = key if isinstance(key, tuple) else (key,)
    return f"{image.mode} transparency={','.join(str(int(v)) for v in values)}"


def image_from_tag(raw: np.ndarray, tag: str) -> Image.Image:
    """Rebuild the Pillow image :func:`decode_outputs` described: raw bytes ``(H, W, bytes per
    pixel)`` of mode ``tag`` (:func:`mode_tag`)."""
    mode, _, key = tag.partition(" transparency=")
    height, width = int(raw.shape[0]), int(raw.shape[1])
    try:
        image = Image.frombytes(mode, (width, height), np.ascontiguousarray(raw).tobytes())
        if key:
            values = tuple(int(v) for v in key.split(","))
            image.info["transparency"] = values[0] if len(values) == 1 else values
    except ValueError as exc:  # unknown mode, wrong byte count, bad key
        raise InvalidRequestError(f"IMAGE {width}x{height}x{raw.shape[2]} is not raw {tag!r} pixels: {exc}") from None
    return image


def image_and_mode(pixels: Any) -> tuple[Any, str]:
    """``IMAGE`` (uint8 ``(H, W, C)``) and ``MODE`` of decoded pixels, by the kernel for their type."""
    return get_kernel("image_and_mode", pixels)(pixels)


@register_kernel("image_and_mode", NUMPY)
@register_kernel("image_and_mode", TORCH)
def _array_and_mode(pixels: Any) -> tuple[Any, str]:
    return pixels, next(mode for mode, channels in ARRAY_MODES.items() if channels == pixels.shape[2])


@register_kernel("image_and_mode", PIL_IMAGE)
def _raw_bytes_and_mode(image: Image.Image) -> tuple[np.ndarray, str]:
    raw = np.frombuffer(image.tobytes(), dtype=np.uint8)
    if raw.size % (image.width * image.height):  # packed sub-byte modes never reach here (decode converts them)
        raise InvalidRequestError(f"mode {image.mode} has no whole bytes per pixel")
    return raw.reshape(image.height, image.width, -1), mode_tag(image)


# -- decode -> preprocess -------------------------------------------------------------------------


def decode_outputs(decoded: DecodedImage) -> Outputs:
    """Outputs of a decode model for one image (numpy or torch ``pixels`` kept as they are)."""
    image, mode = image_and_mode(decoded.pixels)
    return {
        "IMAGE": image[None],
        "MODE": np.array([[mode.encode()]], dtype=np.object_),
        "ORIGINAL_SIZE": np.array([[decoded.width, decoded.height]], dtype=np.int64),
        "RESAMPLE": np.array([[RESAMPLE_CODES[decoded.resample]]], dtype=np.uint8),
        "DECODE_PATH": np.array([[decoded.decode_path.encode()]], dtype=np.object_),
    }


def _mode_from_input(mode: Any) -> str:
    array = np.asarray(mode)
    if array.shape != (1, 1) or not isinstance(array[0, 0], (bytes, str)):
        raise InvalidRequestError(f"MODE must be one string of shape [1, 1], got {array.shape}")
    value = array[0, 0]
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def decoded_from_inputs(image: Any, mode: Any, original_size: Any, resample: Any, preset: Preset) -> DecodedImage:
    """Rebuild the :class:`DecodedImage` a decode model described, validating what a client sent.

    ``image``: uint8 ``[1, H, W, C]`` (numpy or torch, any device); ``mode``: bytes ``[1, 1]``;
    ``original_size``: int64 ``[1, 2]`` = ``[[W, H]]``; ``resample``: uint8 ``[1, 1]``.
    """
    check_dtype("IMAGE", image, "uint8")
    if image.ndim != 4 or image.shape[0] != 1 or image.shape[3] < 1:
        raise InvalidRequestError(f"IMAGE must have shape [1, H, W, C], got {list(image.shape)}")
    tag = _mode_from_input(mode)
    channels = int(image.shape[3])
    if tag in ARRAY_MODES and ARRAY_MODES[tag] != channels:
        raise InvalidRequestError(f"IMAGE of MODE {tag} must have C={ARRAY_MODES[tag]}, got C={channels}")
    if tag != "RGB" and preset.transparency != "chessboard":
        raise InvalidRequestError(f"preset {preset.name!r} takes RGB images (MODE RGB), got MODE {tag!r}")
    size = host_array(original_size)
    check_dtype("ORIGINAL_SIZE", size, "int64")
    if size.shape != (1, 2) or (size < 1).any():
        raise InvalidRequestError(f"ORIGINAL_SIZE must be [[width, height]] >= 1, got {size.tolist()}")
    width, height = int(size[0, 0]), int(size[0, 1])
    if (int(image.shape[1]), int(image.shape[2])) != (height, width):
        raise InvalidRequestError(f"IMAGE is {image.shape[2]}x{image.shape[1]} but ORIGINAL_SIZE is {width}x{height}")
    flags = host_array(resample)
    check_dtype("RESAMPLE", flags, "uint8")
    if flags.shape != (1, 1) or int(flags[0, 0]) not in RESAMPLE_NAMES:
        raise InvalidRequestError(f"RESAMPLE must be [[0]] (bicubic) or [[1]] (nearest), got {flags.tolist()}")
    pixels = image[0] if tag in ARRAY_MODES else image_from_tag(host_array(image[0]), tag)
    return DecodedImage(
        pixels=pixels,
        width=width,
        height=height,
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
    check_dtype("PIXEL_VALUES", array, "float32")
    if array.ndim != 5 or array.shape[0] != 1 or tuple(array.shape[2:]) != (3, patch_size, patch_size):
        raise InvalidRequestError(
            f"PIXEL_VALUES must have shape [1, N, 3, {patch_size}, {patch_size}], got {list(array.shape)}"
        )
    return as_torch(array)[0]
