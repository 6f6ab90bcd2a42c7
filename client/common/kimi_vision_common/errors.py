"""One exception hierarchy for the library, the server and the client.

Every error a caller can see derives from :class:`PreprocessError`. ``triton_code`` is the name
of the Triton error code a served model returns for it; these class attributes are the only
place where that mapping lives (:mod:`.wire` carries the class over the network). The C step
(``models/patchify/`` of the server, no Python at run time) gets the tags and codes of the classes it raises
from ``kimi_errors.h``, which the build writes from these classes (:func:`c_error_header`).
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


class FallbackError(PreprocessError):
    """The planned decoder failed or is unavailable and ``strict=True`` forbids a fallback."""

    triton_code = "INTERNAL"
    reason = "fallback_forbidden"


class CancelledError(PreprocessError):
    """The client cancelled the request before it was processed."""

    triton_code = "CANCELLED"
    reason = "cancelled"


class ServerUnavailableError(PreprocessError):
    """No verdict on the input: the server could not take the request now (queue full, queue
    timeout, a model loading or restarting, busy decoders, a lost connection, the caller's
    deadline). The same request may succeed on another replica or later: retry within your
    deadline. Its subclasses say which fault; :mod:`.faults` maps what Triton and the transport
    report onto them."""

    triton_code = "UNAVAILABLE"
    reason = "server_unavailable"


class DeadlineExceededError(ServerUnavailableError):
    """The server did not answer within the caller's deadline (stuck, overloaded, or the network):
    no answer was taken from it, and the server may still be working on it. Raised by clients only."""

    triton_code = "UNAVAILABLE"
    reason = "deadline_exceeded"


class DecoderBusyError(ServerUnavailableError):
    """No decoder became free within the pool's timeout."""

    triton_code = "UNAVAILABLE"
    reason = "decoder_busy"


class ModelRestartingError(ServerUnavailableError):
    """A model's process died or is stuck and is being replaced (the Python backend's "Stub process
    ... is not healthy"), or Triton is loading or unloading the model. Raised by clients only."""

    triton_code = "UNAVAILABLE"
    reason = "model_restarting"


class ConnectionLostError(ServerUnavailableError):
    """The connection was refused, reset or closed: no answer was taken from the server (a request
    already sent may still run there). Raised by clients only."""

    triton_code = "UNAVAILABLE"
    reason = "connection_lost"


class SharedMemoryUnavailableError(ServerUnavailableError):
    """The server cannot map the caller's shared-memory region (another host or container, its own
    ``/dev/shm``, or a region it no longer knows): the same request goes over the wire. Raised by
    clients only."""

    triton_code = "UNAVAILABLE"
    reason = "shared_memory_unavailable"


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


# TRITONSERVER_Error_Code of Triton's C API (tritonserver.h), by the names ``triton_code`` uses.
TRITON_ERROR_CODES = {
    "UNKNOWN": 0,
    "INTERNAL": 1,
    "NOT_FOUND": 2,
    "INVALID_ARG": 3,
    "UNAVAILABLE": 4,
    "UNSUPPORTED": 5,
    "ALREADY_EXISTS": 6,
    "CANCELLED": 7,
}
# The classes the C patchify step raises, under the names its source uses.
C_STEP_ERRORS = {"INVALID_REQUEST": InvalidRequestError, "TOO_LARGE": ImageTooLargeError, "INTERNAL": PreprocessError}


def c_error_header() -> str:
    """The C step's ``kimi_errors.h``, written at build time (setup.py, the fuzz harness): for each
    class it raises, the tag a served message starts with and its Triton code, from the classes
    above, so the C step restates neither."""
    lines = ["/* Generated from kimi_vision_common/errors.py (c_error_header): do not edit. */", "#pragma once"]
    for name, cls in C_STEP_ERRORS.items():
        lines.append(f'#define KIMI_{name}_TAG "{cls.__name__}"')
        lines.append(f"#define KIMI_{name}_CODE {TRITON_ERROR_CODES[cls.triton_code]}")
    return "\n".join(lines) + "\n"
