"""A server's errors as the library's classes: tagged messages back to their class, the rest by
:mod:`kimi_vision_common.faults`' table; a refused connection in words."""

from __future__ import annotations

import tritonclient.utils

from kimi_vision_common.errors import ConnectionLostError, PreprocessError
from kimi_vision_common.faults import CONNECTION_FAILURES, STATUS_CODES, untagged_error
from kimi_vision_common.wire import error_from_served

SINGLE_IMAGE_PREFIX = "image 0: "  # how a model names the only image of a request that fails


def error_from_server(exc: Exception, single_image: bool = False) -> PreprocessError:
    """A tritonclient error as the :class:`PreprocessError` the server raised (its message's tag),
    or, for Triton's and the transport's own words, the class :mod:`~kimi_vision_common.faults`
    gives them. ``single_image``: the request held one image, so the server's ``"image 0: "`` is
    dropped (the message ``preprocess_bytes`` raises; a K-image request keeps the index, as
    ``preprocess_images`` does)."""
    if isinstance(exc, tritonclient.utils.InferenceServerException):
        code = STATUS_CODES.get(str(exc.status()), "INTERNAL")
        error = error_from_served(code, exc.message() or str(exc))
        text = str(error)
        if single_image and text.startswith(SINGLE_IMAGE_PREFIX):
            error = type(error)(text.removeprefix(SINGLE_IMAGE_PREFIX))
        return error
    if isinstance(exc, CONNECTION_FAILURES):
        return ConnectionLostError(connection_failure(exc))
    if isinstance(exc, PreprocessError):
        return exc
    return untagged_error("INTERNAL", f"{type(exc).__name__}: {exc}")


def connection_failure(exc: Exception) -> str:
    """Why a connection failed, in words ("connection refused", ...), from any transport's error."""
    text = str(exc).lower()
    for cause in ("connection refused", "timed out", "name or service not known", "no route to host"):
        if cause in text:
            return cause
    if isinstance(exc, ConnectionRefusedError) or "failed to connect" in text:
        return "connection refused"
    return f"{type(exc).__name__}: {exc}"
