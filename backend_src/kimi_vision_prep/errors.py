"""One exception hierarchy for the package, its Triton codes, and its round trip over the wire.

Every error a caller can see derives from :class:`PreprocessError`. ``triton_code`` is the name
of the ``pb_utils.TritonError`` code the serving layer returns for it; these class attributes are
the only place where that mapping lives (docs/errors.md repeats it).

Triton 2.51 passes a client only a code and a message, so a served message starts with a tag
naming the class (:func:`served_message`: ``"InvalidImageError: not a decodable image ..."``) and
:func:`error_from_served` turns it back into that class: a remote failure raises the same type
as in process. Triton's own rejections (queue full, wrong shape, ...) carry no tag and map by code.
"""

from __future__ import annotations

import re
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


def _error_classes() -> dict[str, type[PreprocessError]]:
    """Every :class:`PreprocessError` class of this module by name (derived, not listed)."""
    classes: dict[str, type[PreprocessError]] = {}
    pending: list[type[PreprocessError]] = [PreprocessError]
    while pending:
        cls = pending.pop()
        if cls.__module__ == __name__:
            classes[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return classes


ERROR_CLASSES = _error_classes()
# The class a served message without a tag maps to, by Triton code (Triton's own rejections).
_UNTAGGED = {
    "INVALID_ARG": InvalidRequestError,
    "UNAVAILABLE": ServerUnavailableError,
    "CANCELLED": CancelledError,
}
_TAG = re.compile(r"^(?P<tag>[A-Za-z]+Error): (?P<message>.*)$", re.S)
# Triton prefixes an ensemble step's error with this.
ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")


def served_message(exc: BaseException) -> str:
    """The message a served model returns for ``exc``: its class tag, then its text (a bug, not a
    :class:`PreprocessError`, is tagged ``PreprocessError: internal error: <type>: ...``)."""
    if isinstance(exc, PreprocessError):
        return f"{type(exc).__name__}: {exc}"
    return f"{PreprocessError.__name__}: internal error: {type(exc).__name__}: {exc}"


def error_from_served(code: str, message: str) -> PreprocessError:
    """The error a served ``message`` with Triton ``code`` (a ``triton_code`` name: INVALID_ARG,
    UNAVAILABLE, ...) stands for: the tagged class with the untagged text, else by code."""
    message = ENSEMBLE_PREFIX.sub("", message)
    match = _TAG.match(message)
    if match and match["tag"] in ERROR_CLASSES:
        return ERROR_CLASSES[match["tag"]](match["message"])
    return _UNTAGGED.get(code, PreprocessError)(message)

