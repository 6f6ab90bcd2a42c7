"""One exception hierarchy for the library, the server and the client.

Every error a caller can see derives from :class:`PreprocessError`. ``triton_code`` is the name
of the Triton error code a served model returns for it; these class attributes are the only
place where that mapping lives in Python (:mod:`.wire` carries the class over the network). The C
step (``_triton_patchify.c``, no Python at run time) restates the two it raises,
``InvalidRequestError`` and ``ImageTooLargeError``, with their codes; tests/test_patchify_backend.py
reads them back through the client and compares them with these classes.
"""

from __future__ import annotations

from typing import TypeVar


class PreprocessError(Exception):
    """Base class. ``reason`` is a short stable label used in metrics and logs."""

    triton_code = "INTERNAL"
    reason = "internal"


class InvalidImageError(PreprocessError):
    """The bytes are not an image Pillow accepts (corrupt, truncated, unknown format)."""

    triton_code = "INVALID_ARG"
    reason = "invalid_image"


class UnsupportedImageError(PreprocessError):
    """A well-formed image of a kind Pillow (the reference) cannot decode or convert."""

    triton_code = "INVALID_ARG"
    reason = "unsupported_image"


class ImageTooLargeError(PreprocessError):
    """Encoded size or decoded pixel count exceeds a configured limit."""

    triton_code = "INVALID_ARG"
    reason = "too_large"


class InvalidVideoError(PreprocessError):
    """The bytes are not a video FFmpeg decodes (corrupt, truncated, no video stream), or an image
    sent as a video."""

    triton_code = "INVALID_ARG"
    reason = "invalid_video"


class VideoTooLargeError(PreprocessError):
    """Encoded size, frame size, frame count or sampled-frame count exceeds a configured limit."""

    triton_code = "INVALID_ARG"
    reason = "video_too_large"


class InvalidRequestError(PreprocessError):
    """The request itself is malformed (wrong dtype, shape or batch)."""

    triton_code = "INVALID_ARG"
    reason = "invalid_request"


class InvalidPresetError(PreprocessError, ValueError):
    """A preset or its parameters cannot reproduce the reference processor."""

    triton_code = "INVALID_ARG"
    reason = "invalid_preset"


class DecoderBusyError(PreprocessError):
    """No decoder became free within the pool's timeout."""

    triton_code = "UNAVAILABLE"
    reason = "decoder_busy"


class FallbackError(PreprocessError):
    """The planned decoder failed or is unavailable and ``strict=True`` forbids a fallback."""

    triton_code = "INTERNAL"
    reason = "fallback_forbidden"


class CancelledError(PreprocessError):
    """The client cancelled the request before it was processed."""

    triton_code = "CANCELLED"
    reason = "cancelled"


class ServerUnavailableError(PreprocessError):
    """Triton refused the request before a model ran it (queue full, queue timeout, unloaded
    model): retry with backoff. Raised by clients only."""

    triton_code = "UNAVAILABLE"
    reason = "server_unavailable"


class ModelNotServedError(PreprocessError):
    """The server does not serve the model asked for (not in its repository, or not loaded).
    Raised by clients only; the message names the flag that serves it."""

    triton_code = "NOT_FOUND"
    reason = "model_not_served"


def triton_code_for(exc: BaseException) -> str:
    """Triton error code name for any exception; unknown exceptions are INTERNAL."""
    return exc.triton_code if isinstance(exc, PreprocessError) else "INTERNAL"


def reason_for(exc: BaseException) -> str:
    """Stable metric label for any exception."""
    return exc.reason if isinstance(exc, PreprocessError) else "internal"


ErrorT = TypeVar("ErrorT", bound=BaseException)


def detached(exc: ErrorT) -> ErrorT:
    """``exc`` without its traceback, for keeping an error as a value (one result per request).

    A stored traceback keeps every frame it passed through alive, and the frame that stores the
    error usually holds the list it is stored in: a reference cycle that pins the request's decoded
    or half-decoded pixels (megabytes) until the cycle collector runs. Under a stream of bad images
    that grew a decode stub's heap by ~2 MiB per rejected image. Bad input needs no traceback.
    """
    exc.__context__ = exc.__cause__ = None  # the library's errors carry their cause in the message
    return exc.with_traceback(None)
