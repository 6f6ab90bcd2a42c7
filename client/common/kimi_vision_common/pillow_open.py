"""Pillow's verdict on an image's file, shared by the library and the remote processor.

Pillow 13 (the reference build) decides what is accepted: :func:`open_with_pillow` parses the
header only (no pixel decoded) and applies the pixel limit, :func:`pillow_call` maps the failures
of a pixel-loading call onto the typed errors, and :func:`unloaded_jpeg_bytes` finds the file of a
JPEG Pillow has opened but not decoded (so it can go to a faster exact decoder, or to a server).
"""

from __future__ import annotations

import binascii
import io
import re
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from PIL import Image, UnidentifiedImageError

from .errors import ImageTooLargeError, InvalidImageError, UnsupportedImageError
from .media import looks_like_video

ResultT = TypeVar("ResultT")
# 178,956,970: Pillow's own DecompressionBombError threshold (2 x Image.MAX_IMAGE_PIXELS in Pillow 13).
PILLOW_MAX_PIXELS = 178_956_970


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
