"""A server's errors as the library's classes: tagged messages back to their class, Triton's own
rejections by code (transport status -> Triton code), a refused connection in words."""

from __future__ import annotations

import tritonclient.utils

from kimi_vision_common.errors import DeadlineExceededError, PreprocessError, ServerUnavailableError
from kimi_vision_common.wire import error_from_served

DEADLINE_STATUS = "StatusCode.DEADLINE_EXCEEDED"
# Triton's answer for a model it knows but has no version of loaded right now: starting, stopping,
# or reloading it (the watchdog does, after a stub died).
NOT_LOADED_NOW = "has no available versions"  # gRPC's status of a call past its client_timeout
SINGLE_IMAGE_PREFIX = "image 0: "  # how a model names the only image of a request that fails
# Transport status (HTTP code or gRPC StatusCode) -> the Triton code name it carries.
TRITON_CODES: dict[str, str] = {
    "400": "INVALID_ARG",
    "StatusCode.INVALID_ARGUMENT": "INVALID_ARG",
    "503": "UNAVAILABLE",
    "StatusCode.UNAVAILABLE": "UNAVAILABLE",
    "StatusCode.CANCELLED": "CANCELLED",
}


def error_from_server(exc: Exception, single_image: bool = False) -> PreprocessError:
    """A tritonclient error as the :class:`PreprocessError` the server raised (its message's tag),
    or, for Triton's own untagged rejections, the class of its code. ``single_image``: the request
    held one image, so the server's ``"image 0: "`` is dropped (the message ``preprocess_bytes``
    raises; a K-image request keeps the index, as ``preprocess_images`` does)."""
    if isinstance(exc, tritonclient.utils.InferenceServerException):
        if str(exc.status()) == DEADLINE_STATUS:
            return DeadlineExceededError(f"no answer within the request's deadline ({exc.message()})")
        if NOT_LOADED_NOW in (exc.message() or ""):
            return ServerUnavailableError(f"{exc.message()}: the server is starting, stopping or reloading it; retry")
        error = error_from_served(TRITON_CODES.get(str(exc.status()), "INTERNAL"), exc.message() or str(exc))
        text = str(error)
        if single_image and text.startswith(SINGLE_IMAGE_PREFIX):
            error = type(error)(text.removeprefix(SINGLE_IMAGE_PREFIX))
        return error
    return PreprocessError(f"{type(exc).__name__}: {exc}")


def connection_failure(exc: Exception) -> str:
    """Why a connection failed, in words ("connection refused", ...), from any transport's error."""
    text = str(exc).lower()
    for cause in ("connection refused", "timed out", "name or service not known", "no route to host"):
        if cause in text:
            return cause
    if isinstance(exc, ConnectionRefusedError) or "failed to connect" in text:
        return "connection refused"
    return f"{type(exc).__name__}: {exc}"
