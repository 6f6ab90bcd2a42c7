"""Request validation and the tensors of the image models, as pure functions.

A request holds K >= 1 images (``IMAGE_BYTES [1, K]``; the leading 1 is the batch dimension:
one request per batch element). Tensor shapes as the models see them:

=======================  =========================================  ======================================
model                    inputs                                     outputs
=======================  =========================================  ======================================
``kimi_*_decode``        IMAGE_BYTES bytes ``[1, K]``               IMAGE uint8 ``[1, ΣHWC]``, IMAGE_SHAPES
                                                                    int64 ``[1, K, 4]``, MODE bytes ``[1, K]``,
                                                                    RESAMPLE uint8 ``[1, K]`` (0 bicubic,
                                                                    1 nearest), STORED_SIZES int64
                                                                    ``[1, K, 2]``, DECODE_PATH bytes ``[1, K]``
``kimi_*_preprocess``    IMAGE, IMAGE_SHAPES, MODE, RESAMPLE,       PIXEL_VALUES float32 ``[1, ΣN, 3, p, p]``,
                         STORED_SIZES (optional)
                                                                    PIXEL_PATCHES uint8 ``[1, ΣN, 3, p, p]``,
                                                                    GRID_THW int64 ``[1, K, 3]``, NUM_TOKENS
                                                                    int32 ``[1, K]``; only the requested ones
                                                                    are computed
``kimi_*_vision_fused``  IMAGE_BYTES bytes ``[1, K]``               PIXEL_VALUES, GRID_THW, NUM_TOKENS
``*_vision_fused_u8``   IMAGE_BYTES bytes ``[1, K]``               PIXEL_PATCHES, GRID_THW, NUM_TOKENS
``kimi_patch_embed``     PIXEL_VALUES float32 ``[1, N, 3, p, p]``   PATCH_EMBEDS float32 ``[1, N, hidden]``
=======================  =========================================  ======================================

Between decode and preprocess, the K images of different sizes travel as one flat uint8 tensor
``IMAGE`` and a shape table ``IMAGE_SHAPES`` (row k: height, width, channels, offset into
``IMAGE``); image k is ``IMAGE[0, offset : offset + h*w*c].reshape(h, w, c)``, a view (one image
on a GPU: no copy at all). The images tile ``IMAGE`` in order, without gaps or overlap: image 0
at offset 0, image k right after image k-1, the last one ending at L (:func:`check_image_layout`;
the C step ``kimi_patchify`` checks the same). Anything else is refused before any output exists,
so no request can make a step read one image's bytes several times over.

``STORED_SIZES`` row k is the image's stored (height, width), and the
image is one of two things:

* **at its NaViT size**: RGB (``MODE`` ``RGB``, c = 3), ``h x w`` = the NaViT size of the stored
  size, already resized (and composited under K3) exactly as the processor does: what the decode
  step hands over (:func:`~kimi_vision_prep.pipeline.resized_decoded`), so the hop between the
  steps carries at most the preset's patch budget, and the preprocess step pads and patchifies;
* **at its stored size** (``h x w`` = the stored size, or no ``STORED_SIZES`` input: the only
  form an upstream decoder of its own need send) in the source mode ``MODE[0, k]`` names: ``RGB``
  (c = 3) and ``RGBA`` (c = 4, straight alpha, K3 only) are pixel arrays the array kernels
  resize; any other ``MODE`` (K3's CMYK, I;16, L with a transparency key, ...) is a Pillow mode,
  optionally followed by `` transparency=V[,V...]``, and the image is that mode's raw bytes
  (``Image.tobytes()``, c bytes per pixel), which the preprocess step rebuilds with
  ``Image.frombytes`` for resize's PIL kernel.

Any other size is refused (InvalidRequestError).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_common import messages
from kimi_vision_common.errors import InvalidRequestError
from kimi_vision_common.presets import Preset
from kimi_vision_common.sizing import TargetSize, navit_target_size
from kimi_vision_common.wire import (
    DECODE_PATH,
    GRID_THW,
    IMAGE,
    IMAGE_BYTES,
    IMAGE_SHAPES,
    MODE,
    NUM_TOKENS,
    NUM_TOKENS_DTYPE,
    PIXEL_PATCHES,
    PIXEL_VALUES,
    RESAMPLE,
    STORED_SIZES,
)
from kimi_vision_prep.buffers import scratch
from kimi_vision_prep.decode.decoder import DecodedImage
from kimi_vision_prep.kernels import NUMPY, PIL_IMAGE, TORCH, get_kernel, register_kernel
from kimi_vision_prep.patchify.normalize import concatenate_patches
from kimi_vision_prep.pipeline import PixelOutput, map_indexed, out_rows, pixel_values_from_patches, preprocess_decoded
from kimi_vision_prep.tokens import check_image_count, check_patch_total

from .tensors import as_torch, check_dtype, host_array

RESAMPLE_CODES: dict[str, int] = {"bicubic": 0, "nearest": 1}
RESAMPLE_NAMES: dict[int, str] = {code: name for name, code in RESAMPLE_CODES.items()}
ARRAY_MODES: dict[str, int] = {"RGB": 3, "RGBA": 4}  # MODE -> channels of a pixel array

Outputs = dict[str, Any]  # output name -> numpy array or torch tensor (with the batch dim of 1)
PREPROCESS_OUTPUTS = (PIXEL_VALUES, PIXEL_PATCHES, GRID_THW, NUM_TOKENS)
# The pixel-output selections a request can make; each runs its own kernel combination (fused
# float32, uint8 patchify, patchify + expand), so each is warmed up.
PIXEL_SELECTIONS = ((PIXEL_VALUES,), (PIXEL_PATCHES,), (PIXEL_VALUES, PIXEL_PATCHES))


def one_request_row(array: Any, name: str) -> Any:
    """Row 0 of a ``[1, K, ...]`` input; a batch of several rows is the client's mistake."""
    if array.ndim < 2 or array.shape[0] != 1:
        raise InvalidRequestError(
            f"{name} has shape {list(array.shape)}: send one request per batch element ([1, K]) and put "
            "several images in the second dimension"
        )
    return array[0]


def strings_from_input(array: Any, name: str) -> list[bytes]:
    """The byte strings of a BYTES input of shape ``[1, K]``, K >= 1."""
    row = one_request_row(np.asarray(array), name)
    if row.ndim != 1 or row.shape[0] < 1:
        raise InvalidRequestError(f"{name} must have shape [1, K] with K >= 1, got {[1, *row.shape]}")
    values = []
    for index, value in enumerate(row):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidRequestError(f"{name}[0, {index}] must hold bytes, got {type(value).__name__}")
        values.append(bytes(value))
    return values


def images_from_input(array: Any, max_images: int) -> list[bytes]:
    """The encoded images of an ``IMAGE_BYTES`` input ``[1, K]``, 1 <= K <= ``max_images``."""
    images = strings_from_input(array, IMAGE_BYTES)
    check_image_count(len(images), max_images)
    return images


# -- MODE: the source mode of an image ------------------------------------------------------------


def mode_tag(image: Image.Image) -> str:
    """``MODE`` of a source-mode Pillow image: its mode, plus its transparency key if it has one."""
    key = image.info.get("transparency")
    if key is None:
        return image.mode
    values = key if isinstance(key, tuple) else (key,)
    return f"{image.mode} transparency={','.join(str(int(v)) for v in values)}"


def image_from_tag(raw: np.ndarray, tag: str) -> Image.Image:
    """Rebuild a source-mode Pillow image: raw bytes ``(H, W, bytes per pixel)`` of mode ``tag``."""
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
    """uint8 ``(H, W, C)`` pixels and the ``MODE`` of decoded pixels, by the kernel for their type."""
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


def _string_row(values: Sequence[str]) -> np.ndarray:
    return np.array([[value.encode() for value in values]], dtype=np.object_)


# -- decode -> preprocess -------------------------------------------------------------------------


def decode_outputs(decoded: Sequence[DecodedImage]) -> Outputs:
    """Outputs of a decode model for one request's images, at whichever size their pixels have
    (numpy or torch pixels kept as they are: one image's flat IMAGE is a view of its pixels)."""
    images, modes = zip(*(image_and_mode(d.pixels) for d in decoded), strict=True)
    sizes = [int(np.prod(image.shape)) for image in images]
    offsets = np.cumsum([0, *sizes[:-1]])
    shapes = [[int(i.shape[0]), int(i.shape[1]), int(i.shape[2]), int(o)] for i, o in zip(images, offsets, strict=True)]
    return {
        IMAGE: concatenate_patches([image.reshape(-1) for image in images])[None],
        IMAGE_SHAPES: np.array([shapes], dtype=np.int64),
        MODE: _string_row(modes),
        RESAMPLE: np.array([[RESAMPLE_CODES[d.resample] for d in decoded]], dtype=np.uint8),
        STORED_SIZES: np.array([[[d.height, d.width] for d in decoded]], dtype=np.int64),
        DECODE_PATH: _string_row([d.decode_path for d in decoded]),
    }


def decoded_from_inputs(  # noqa: PLR0917
    image: Any, shapes: Any, mode: Any, resample: Any, stored_sizes: Any, preset: Preset
) -> list[DecodedImage]:
    """Rebuild the images a decode model described, validating what a client sent.

    ``image``: uint8 ``[1, L]`` (numpy or torch, any device); ``shapes``: int64 ``[1, K, 4]``;
    ``mode``: bytes ``[1, K]``; ``resample``: uint8 ``[1, K]``; ``stored_sizes``: int64
    ``[1, K, 2]``, or None (each image at its stored size).
    """
    check_dtype(IMAGE, image, "uint8")
    flat = one_request_row(image, IMAGE)
    if flat.ndim != 1:
        raise InvalidRequestError(f"IMAGE must have shape [1, L] (the images' bytes, flat), got {list(image.shape)}")
    table = host_array(shapes)
    check_dtype(IMAGE_SHAPES, table, "int64")
    rows = one_request_row(table, IMAGE_SHAPES)
    if rows.ndim != 2 or rows.shape[1] != 4 or rows.shape[0] < 1:
        raise InvalidRequestError(f"IMAGE_SHAPES must have shape [1, K, 4], got {list(table.shape)}")
    tags = _modes_from_input(mode)
    flags = host_array(resample)
    check_dtype(RESAMPLE, flags, "uint8")
    codes = one_request_row(flags, RESAMPLE)
    if len(tags) != rows.shape[0] or codes.shape != (rows.shape[0],):
        raise InvalidRequestError(f"MODE and RESAMPLE must have shape [1, {rows.shape[0]}] like IMAGE_SHAPES")
    stored = rows[:, :2] if stored_sizes is None else _stored_sizes(stored_sizes, rows.shape[0])
    check_image_layout(rows, int(flat.shape[0]))
    return [
        _decoded(flat, rows[k], tags[k], int(codes[k]), tuple(int(v) for v in stored[k]), preset, k)
        for k in range(rows.shape[0])
    ]


def check_image_layout(rows: np.ndarray, length: int) -> None:
    """``rows`` int64 ``(K, 4)`` (height, width, channels, offset) tile an ``IMAGE`` of ``length``
    bytes in order, without gaps or overlap; else InvalidRequestError naming the first bad row (in
    the C step's words: both take them from ``kimi_vision_common.messages``).
    Checked in Python integers: no product of client values can wrap around."""
    expected = 0
    for k, row in enumerate(rows.tolist()):
        height, width, channels, offset = row
        if min(height, width, channels) < 1:
            raise InvalidRequestError(messages.ROW_BELOW_ONE % (k, *row))
        if offset != expected:
            raise InvalidRequestError(messages.ROW_NOT_NEXT % (k, *row, k, expected))
        expected += height * width * channels
        if expected > length:
            raise InvalidRequestError(messages.ROW_OUTSIDE_IMAGE % (k, *row, length))
    if expected != length:
        raise InvalidRequestError(messages.IMAGE_HAS_GAPS % (length, len(rows), expected))


def _stored_sizes(stored_sizes: Any, count: int) -> np.ndarray:
    table = host_array(stored_sizes)
    check_dtype(STORED_SIZES, table, "int64")
    rows = one_request_row(table, STORED_SIZES)
    if rows.shape != (count, 2):
        raise InvalidRequestError(
            f"STORED_SIZES must have shape [1, {count}, 2] like IMAGE_SHAPES, got {list(table.shape)}"
        )
    if rows.min() < 1:
        raise InvalidRequestError(f"STORED_SIZES must hold positive heights and widths, got {rows.tolist()}")
    return rows


def _modes_from_input(mode: Any) -> list[str]:
    row = one_request_row(np.asarray(mode), MODE)
    if row.ndim != 1:
        raise InvalidRequestError(f"MODE must have shape [1, K], got {[1, *row.shape]}")
    return [value.decode(errors="replace") if isinstance(value, bytes) else str(value) for value in row]


def _decoded(  # noqa: PLR0917
    flat: Any, row: np.ndarray, tag: str, code: int, stored: tuple[int, ...], preset: Preset, k: int
) -> DecodedImage:
    """Image ``k`` of a checked layout (:func:`check_image_layout`)."""
    height, width, channels, offset = (int(v) for v in row)
    stored_height, stored_width = stored
    if (height, width) != stored:
        target = navit_target_size(stored_width, stored_height, preset)
        if (height, width, tag) != (target.new_height, target.new_width, "RGB"):
            raise InvalidRequestError(
                f"image {k}: IMAGE is {width}x{height} {tag}, neither its stored size {stored_width}x{stored_height} "
                f"nor its NaViT size {target.new_width}x{target.new_height} RGB"
            )
    if tag in ARRAY_MODES and ARRAY_MODES[tag] != channels:
        raise InvalidRequestError(f"image {k}: IMAGE of MODE {tag} must have C={ARRAY_MODES[tag]}, got C={channels}")
    if tag != "RGB" and preset.transparency != "chessboard":
        raise InvalidRequestError(f"image {k}: preset {preset.name!r} takes RGB images (MODE RGB), got MODE {tag!r}")
    if code not in RESAMPLE_NAMES:
        raise InvalidRequestError(f"image {k}: RESAMPLE must be 0 (bicubic) or 1 (nearest), got {code}")
    pixels = flat[offset : offset + height * width * channels].reshape(height, width, channels)
    if tag not in ARRAY_MODES:
        pixels = image_from_tag(host_array(pixels), tag)
    return DecodedImage(pixels, stored_width, stored_height, RESAMPLE_NAMES[code], "upstream")  # type: ignore[arg-type]


def check_request_size(
    decoded: Sequence[DecodedImage], preset: Preset, max_images: int, max_patches: int | None
) -> None:
    """A decoded request within the limits of the decode step that would have made it: at most
    ``max_images`` images and ``max_patches`` NaViT patches (None: no limit), from the sizes alone."""
    check_image_count(len(decoded), max_images)
    patches = sum(navit_target_size(image.width, image.height, preset).num_patches for image in decoded)
    check_patch_total(patches, max_patches)


def preprocess_outputs(
    decoded: Sequence[DecodedImage], preset: Preset, requested: Collection[str] | None = None
) -> Outputs:
    """Outputs of a preprocess model for one request's images: the ``requested`` names (None: all
    of :data:`PREPROCESS_OUTPUTS`), each computed only if asked for; an image that fails raises
    its typed error with its index.

    PIXEL_VALUES alone: the fused float32 pass. PIXEL_PATCHES: uint8 pad + patchify, and
    PIXEL_VALUES, if asked for as well, expanded from those patches (one resize for both; bit-equal
    to the fused pass). Neither pixel output: no resize at all (GRID_THW / NUM_TOKENS need only
    the size).
    """
    wanted = set(PREPROCESS_OUTPUTS if requested is None else requested)
    outputs: Outputs = {}
    if {PIXEL_VALUES, PIXEL_PATCHES} & wanted:
        output = "pixel_patches" if PIXEL_PATCHES in wanted else "pixel_values"
        targets, pixels = request_patches(decoded, preset, output)
        if PIXEL_PATCHES in wanted:
            outputs[PIXEL_PATCHES] = pixels[None]
        if PIXEL_VALUES in wanted:
            values = pixels if output == "pixel_values" else pixel_values_from_patches(pixels, preset)
            outputs[PIXEL_VALUES] = values[None]
    else:
        targets = [navit_target_size(image.width, image.height, preset) for image in decoded]
    if GRID_THW in wanted:
        outputs[GRID_THW] = np.array([[t.grid_thw for t in targets]], dtype=np.int64)
    if NUM_TOKENS in wanted:
        outputs[NUM_TOKENS] = np.array([[t.num_tokens for t in targets]], dtype=NUM_TOKENS_DTYPE)
    return outputs


def request_patches(
    decoded: Sequence[DecodedImage], preset: Preset, output: PixelOutput
) -> tuple[list[TargetSize], Any]:
    """The NaViT sizes of one request's images and their ``output`` patches, ``(ΣN, 3, p, p)``.

    numpy pixels are written straight into their rows (:func:`~kimi_vision_prep.pipeline.out_rows`)
    of one :func:`~kimi_vision_prep.buffers.scratch` array (in a model's execute: an arena buffer
    whose pages the next request reuses; no concatenation); other pixels (torch tensors, Pillow
    images) are preprocessed one by one and concatenated."""
    pixels = None
    if all(isinstance(image.pixels, np.ndarray) for image in decoded):
        count = sum(navit_target_size(image.width, image.height, preset).num_patches for image in decoded)
        p = preset.patch_size
        pixels = scratch((count, 3, p, p), np.float32 if output == "pixel_values" else np.uint8)
    write = lambda pair: preprocess_decoded(pair[0], preset, output=output, out=pair[1])  # noqa: E731
    results = map_indexed(write, zip(decoded, out_rows(decoded, preset, pixels), strict=True), "image")
    if pixels is None:
        pixels = concatenate_patches([getattr(result, output) for result in results])
    return [result.target for result in results], pixels


def pixel_values_from_input(array: Any, patch_size: int) -> Any:
    """``PIXEL_VALUES`` float32 ``[1, N, 3, p, p]`` -> torch float32 ``(N, 3, p, p)``."""
    check_dtype(PIXEL_VALUES, array, "float32")
    if array.ndim != 5 or array.shape[0] != 1 or tuple(array.shape[2:]) != (3, patch_size, patch_size):
        raise InvalidRequestError(
            f"PIXEL_VALUES must have shape [1, N, 3, {patch_size}, {patch_size}], got {list(array.shape)}"
        )
    return as_torch(array)[0]
