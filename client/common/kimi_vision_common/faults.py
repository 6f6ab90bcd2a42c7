"""Failures the input did not cause: what Triton and the transport report, mapped to one class each.

A served model's own errors carry their class's tag (:func:`.wire.error_from_served` reads it), and
a tagged class is final: a verdict on the input (``InvalidImageError``...) or a fault of the server
(``DecoderBusyError``). Everything else a client sees comes untagged, from Triton itself or from
the connection, and is mapped here, in one table:

- :data:`STATUS_CODES`: a transport's status (HTTP code, gRPC ``StatusCode``) -> the Triton code
  name it carries;
- :data:`FAULT_RULES`: an untagged message -> the :class:`~.errors.ServerUnavailableError`
  subclass of the fault it reports, whatever the code (Triton reports a stub that died as
  ``INTERNAL`` and a model being reloaded as ``NOT_FOUND``);
- :data:`UNTAGGED_BY_CODE`: any other untagged message -> the class of its code.

Whether the server produced an answer matters to a client that lent it a shared-memory region: a
request that got none (:data:`NO_ANSWER`: its deadline passed, its connection was lost) may still
be running there, and may still write the region.
"""

from __future__ import annotations

import http.client
from dataclasses import dataclass

from .errors import (
    CancelledError,
    ConnectionLostError,
    DeadlineExceededError,
    InvalidRequestError,
    ModelRestartingError,
    PreprocessError,
    ServerUnavailableError,
    SharedMemoryUnavailableError,
)

# Transport status -> Triton code name. HTTP codes as tritonclient.http gives them; gRPC's as
# ``str(grpc.StatusCode.X)``, as tritonclient.grpc gives them.
STATUS_CODES: dict[str, str] = {
    "400": "INVALID_ARG",
    "404": "NOT_FOUND",
    "500": "INTERNAL",
    "502": "UNAVAILABLE",  # a proxy in front found no server behind it
    "503": "UNAVAILABLE",
    "504": "UNAVAILABLE",  # a proxy in front got no answer in time
    "StatusCode.INVALID_ARGUMENT": "INVALID_ARG",
    "StatusCode.NOT_FOUND": "NOT_FOUND",
    "StatusCode.INTERNAL": "INTERNAL",
    "StatusCode.UNKNOWN": "UNKNOWN",
    "StatusCode.UNAVAILABLE": "UNAVAILABLE",
    "StatusCode.CANCELLED": "CANCELLED",
    "StatusCode.DEADLINE_EXCEEDED": "DEADLINE_EXCEEDED",
}


@dataclass(frozen=True)
class FaultRule:
    """An untagged message containing ``text`` (any Triton code) reports ``error``'s fault."""

    text: str
    error: type[ServerUnavailableError]
    source: str  # who says it, for the documentation's table


FAULT_RULES: tuple[FaultRule, ...] = (
    FaultRule("is not healthy", ModelRestartingError, "Python backend: a stub that died or stopped answering"),
    FaultRule(
        "has no available versions", ModelRestartingError, "Triton: the model is loading, unloading or reloading"
    ),
    FaultRule("Exceeds maximum queue size", ServerUnavailableError, "Triton: the model's queue is full"),
    FaultRule("Request timeout expired", ServerUnavailableError, "Triton: queued past the queue policy's timeout"),
    FaultRule(
        "Failed to increase the shared memory pool size", ServerUnavailableError, "Python backend: its /dev/shm is full"
    ),
    FaultRule("Unable to open shared memory region", SharedMemoryUnavailableError, "Triton: registering a region"),
    FaultRule("Unable to find shared memory region", SharedMemoryUnavailableError, "Triton: a region it does not know"),
    FaultRule("failed to obtain inference response", DeadlineExceededError, "tritonclient.http: the wait's timeout"),
    FaultRule("failed to connect", ConnectionLostError, "gRPC: nothing listens there"),
    FaultRule("Connection reset", ConnectionLostError, "gRPC: the server's end went away"),
    FaultRule("Stream removed", ConnectionLostError, "gRPC: the server's end went away"),
    FaultRule("Socket closed", ConnectionLostError, "gRPC: the connection closed mid-call"),
    FaultRule("Broken pipe", ConnectionLostError, "gRPC: the connection closed mid-call"),
    FaultRule("GOAWAY", ConnectionLostError, "gRPC: the server is shutting the connection"),
)
# Untagged messages no rule names, by code. An unknown UNAVAILABLE may be the transport's: treated
# as a lost connection (no answer), so a shared-memory region it held is never reused.
UNTAGGED_BY_CODE: dict[str, type[PreprocessError]] = {
    "INVALID_ARG": InvalidRequestError,
    "UNAVAILABLE": ConnectionLostError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "CANCELLED": CancelledError,
}
# Faults after which the server may still run the request: no answer was taken from it.
NO_ANSWER: tuple[type[PreprocessError], ...] = (DeadlineExceededError, ConnectionLostError)
# What a transport raises, other than Triton's answers, when the connection fails.
CONNECTION_FAILURES: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)


def untagged_error(code: str, message: str) -> PreprocessError:
    """The error an untagged ``message`` with Triton ``code`` reports: a passed deadline whatever its
    words (gRPC says "Stream removed" of some), else the first rule whose text it contains, else
    the class of its code (:class:`PreprocessError` for an unknown one)."""
    if code == "DEADLINE_EXCEEDED":
        return DeadlineExceededError(message)
    for rule in FAULT_RULES:
        if rule.text in message:
            return rule.error(message)
    return UNTAGGED_BY_CODE.get(code, PreprocessError)(message)


def got_an_answer(error: PreprocessError) -> bool:
    """Whether the server answered the request that failed with ``error`` (False: it may still run it)."""
    return not isinstance(error, NO_ANSWER)


def is_verdict(error: PreprocessError) -> bool:
    """Whether ``error`` is a verdict on the input (Triton's ``INVALID_ARG``: the same bytes fail
    the same way anywhere), as opposed to a fault of the server's state or a bug."""
    return error.triton_code == "INVALID_ARG"


def retry_elsewhere(error: PreprocessError) -> bool:
    """Whether a request that failed with ``error`` may be sent again: a fault of the server, not a
    verdict on the input, and not a deadline (the caller's time is up)."""
    return isinstance(error, ServerUnavailableError) and not isinstance(error, DeadlineExceededError)
