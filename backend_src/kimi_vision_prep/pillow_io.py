"""Pillow as the reference: header verdict, typed errors, and source-mode pixels.

Pillow 13 (the reference build) decides what is accepted: :func:`open_with_pillow` parses the
header only, :func:`pillow_call` maps the failures of a pixel-loading call onto the typed errors.
:func:`pillow_pixels` returns the pixels of an opened image in the form the preset's resize step
takes, and :func:`as_rgb_array` (an op with a kernel per type) turns what the resize step returns
into the RGB/RGBA array the composite and patchify steps take.
"""

from __future__ import annotations

import binascii
import io
import re
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from PIL import Image, UnidentifiedImageError

from kimi_vision_common.errors import ImageTooLargeError, InvalidImageError, UnsupportedImageError
from kimi_vision_common.media import looks_like_video
from kimi_vision_common.presets import Preset

from .kernels import NUMPY, PIL_IMAGE, TORCH, get_kernel, register_kernel
from .limits import PILLOW_MAX_PIXELS
from .resample import Resample

ResultT = TypeVar("ResultT")



def open_with_pillow(data: bytes, max_pixels: int = PILLOW_MAX_PIXELS) -> Image.Image:
    """Parse the header with Pillow (the reference verdict, no pixels loaded) and apply the pixel limit."""
    try:
        with warnings.catch_warnings():
            # Between Pillow's warning and error thresholds the reference accepts the image (with
            # a warning on its stderr): no stray line here; max_pixels is the limit.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"image too large: {exc}") from None
    except UnidentifiedImageError:
        raise InvalidImageError(
            f"not a decodable image ({len(data)} bytes, starts with {data[:8]!r}): Pillow cannot identify it"
            + content_hint(data)
        ) from None
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, struct.error...
        raise load_failure("parse the image header", exc) from None
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidImageError(f"image has zero size {width}x{height}")
    if width * height > max_pixels:
        raise ImageTooLargeError(f"image of {width}x{height} = {width * height} pixels exceeds max_pixels={max_pixels}")
    return image


# Magic numbers of the formats a JSON client typically base64-encodes by mistake.
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")
_BASE64_ALPHABET = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\r\n")


def content_hint(data: bytes) -> str:
    """What ``data`` looks like when it is not an image, as a hint for the sender ("" when it looks
    like nothing known): a video, a ``data:`` URL, a URL or a file path sent as the bytes, or base64
    text of an image. Read from the first bytes only; nothing is fetched, opened or decoded."""
    if looks_like_video(data):
        return "; these bytes are a video: send them to a video model (kimi_*_video, kimi-prep infer does)"
    head = bytes(data[:256])
    if head.startswith(b"data:"):
        return "; these bytes are a data: URL: send the image's bytes (the base64 payload decoded)"
    if head.startswith((b"http://", b"https://", b"ftp://", b"s3://", b"gs://")):
        return "; these bytes are a URL: the server fetches nothing; send the image's bytes"
    if len(data) < 4096 and head.isascii() and head.strip() and not head.strip().count(b"\n") and (
        head.startswith((b"/", b"./", b"../", b"~/")) or _PATH_SUFFIX.search(head.strip())
    ):
        return "; these bytes are a file path: the server opens no files; send the file's bytes"
    return base64_hint(data)


_PATH_SUFFIX = re.compile(rb"\.(jpe?g|png|gif|webp|bmp|tiff?|heic|avif)$", re.IGNORECASE)


def base64_hint(data: bytes) -> str:
    """A hint for a JSON client that sent an image as base64 text: ``data`` is base64 whose
    decoded start is an image's magic number (checked, never guessed: the bytes are not decoded)."""
    head = data[:64]
    if len(head) < 8 or not set(head) <= _BASE64_ALPHABET:
        return ""
    try:
        decoded = binascii.a2b_base64(head[: len(head) // 4 * 4])
    except binascii.Error:
        return ""
    if not decoded.startswith(_IMAGE_MAGIC):
        return ""
    return (
        "; these bytes are base64 text of an image: send the raw bytes instead (tritonclient's binary tensor "
        "data, e.g. set_data_from_numpy(..., binary_data=True), or a BYTES element holding the file's bytes)"
    )


# What Pillow's loaders say, in words a caller acts on (the loader's own text follows).
_TRUNCATED = ("image file is truncated", "truncated", "unexpected end of file", "premature end")
_CORRUPT = ("broken data stream", "decoder error", "corrupt", "invalid", "crc", "bad ")


def load_failure(what: str, exc: Exception) -> InvalidImageError:
    """A loader's failure as "truncated" or "corrupt" in words, Pillow's own text after it."""
    text = str(exc)
    lowered = text.lower()
    if any(marker in lowered for marker in _TRUNCATED):
        return InvalidImageError(f"truncated image: the file ends early ({text}); send the whole file")
    kind = "corrupt image" if any(marker in lowered for marker in _CORRUPT) else f"cannot {what}"
    return InvalidImageError(f"{kind}: {type(exc).__name__}: {text}")


def pillow_call(what: str, fn: Callable[..., ResultT], *args: Any) -> ResultT:
    """``fn(*args)``, a Pillow call that loads pixels, with its failures mapped onto the typed
    errors (a truncated or corrupt file said so in words)."""
    try:
        with warnings.catch_warnings():
            # The reference accepts what lies between Pillow's warning and its error threshold.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return fn(*args)
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"image too large: {exc}") from None
    except MemoryError:
        raise ImageTooLargeError(f"out of memory while {what}") from None
    except (ValueError, NotImplementedError) as exc:
        raise UnsupportedImageError(f"cannot {what}: {exc}") from None
    except Exception as exc:
        raise load_failure(what, exc) from None


def has_alpha(image: Image.Image) -> bool:
    """An alpha band or a transparency key (the K3 rule for "has transparency")."""
    return "A" in image.getbands() or "transparency" in image.info


def _converted(image: Image.Image, mode: str) -> np.ndarray:
    what = f"convert {image.mode} to {mode}"
    if image.mode == mode:
        # Pillow's convert to an image's own mode copies every pixel (40 MB at 10 MP, ~14 ms
        # here): the loaded image's pixels are read out once instead.
        pillow_call(what, image.load)
        return np.asarray(image)
    return np.asarray(pillow_call(what, image.convert, mode))


def pillow_pixels(image: Image.Image, preset: Preset) -> tuple[np.ndarray | Image.Image, Resample]:
    """The pixels of an opened image as the preset's resize step takes them, and its filter.

    ``convert_rgb`` (K2.5): ``convert("RGB")``, uint8 ``(H, W, 3)``. ``chessboard`` (K3), resizing
    in the source mode: where that commutes with a per-pixel conversion, the converted array (RGB
    and L -> RGB, RGBA and LA -> RGBA, bicubic; P and 1 -> RGB or RGBA, nearest); any other mode
    (CMYK, I;16, L with a transparency key, ...) stays a Pillow image in that mode, loaded, for
    resize's PIL kernel. Always the stored size.
    """
    mode = image.mode
    if preset.transparency == "convert_rgb" or mode == "RGB" or (mode == "L" and "transparency" not in image.info):
        return _converted(image, "RGB"), "bicubic"
    if mode in ("RGBA", "LA"):
        return _converted(image, "RGBA"), "bicubic"
    if mode in ("P", "1"):
        return _converted(image, "RGBA" if has_alpha(image) else "RGB"), "nearest"
    return pillow_call(f"decode a {mode} image", image.copy), "bicubic"


def as_rgb_array(pixels: Any) -> Any:
    """uint8 ``(H, W, 3)`` RGB or ``(H, W, 4)`` straight-alpha RGBA: arrays and tensors as they
    are, a Pillow image converted (RGBA when it has transparency, else RGB)."""
    return get_kernel("as_rgb_array", pixels)(pixels)


@register_kernel("as_rgb_array", NUMPY)
@register_kernel("as_rgb_array", TORCH)
def _rgb_array_as_is(pixels: Any) -> Any:
    return pixels


@register_kernel("as_rgb_array", PIL_IMAGE)
def _rgb_array_from_pil(image: Image.Image) -> np.ndarray:
    return _converted(image, "RGBA" if has_alpha(image) else "RGB")


def unloaded_jpeg_bytes(image: Image.Image) -> bytes | None:
    """The encoded bytes of a JPEG that Pillow has opened but not decoded, with nothing pending
    that changes its pixels (no ``draft``: the same mode, size and tile as a fresh open of the
    bytes; ``reduce`` and ``transpose`` load the image first); None for anything else (loaded or
    made in memory, another format, a file that cannot be read again), which keeps Pillow's
    pixels. The file is read from its start, as ``Image.open`` read it, and its position restored."""
    fp = getattr(image, "fp", None)
    if image.format != "JPEG" or image._im is not None or fp is None or image.decoderconfig:
        return None
    try:
        position = fp.tell()
        fp.seek(0)
        data = fp.read()
        fp.seek(position)
    except (OSError, ValueError, AttributeError):  # closed, unseekable, not a file
        return None
    try:
        with Image.open(io.BytesIO(data)) as fresh:
            same = (fresh.format, fresh.mode, fresh.size, fresh.tile) == ("JPEG", image.mode, image.size, image.tile)
    except Exception:  # the bytes read back are not that image: Pillow decides, as before
        return None
    return data if same else None
