"""kimi_vision_common.faults: what Triton and the transport say, mapped to one class each, and
docs/errors.md's account of the table.

The messages below are those a real tritonserver 2.51 and grpcio gave here (tests/test_remote_*.py
provoke each against a real ``kimi-prep serve``: a stalled server, a stopped stub, a killed
server, a server with its own ``/dev/shm``, a full queue)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tritonclient.utils

from kimi_vision_client.transport.server_errors import error_from_server
from kimi_vision_common import faults
from kimi_vision_common.errors import (
    ConnectionLostError,
    DeadlineExceededError,
    DecoderBusyError,
    InvalidImageError,
    ModelNotServedError,
    ModelRestartingError,
    PreprocessError,
    ServerUnavailableError,
    SharedMemoryUnavailableError,
)
from kimi_vision_common.vllm_plugin.calls import NOT_THE_REQUESTS
from kimi_vision_common.wire import ERROR_CLASSES, served_message

DOCS = Path(__file__).resolve().parents[1] / "docs"

SEEN_HERE = [
    ("StatusCode.INTERNAL", "in ensemble 'kimi_k25_vision_u8', Stub process 'kimi_k25_decode_0_0' is not healthy.",
     ModelRestartingError),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'kimi_k25_vision_u8' has no available versions",
     ModelRestartingError),
    ("StatusCode.UNAVAILABLE", "in ensemble 'kimi_k25_vision_u8', Request timeout expired", ServerUnavailableError),
    ("StatusCode.UNAVAILABLE", "Exceeds maximum queue size", ServerUnavailableError),
    ("StatusCode.INTERNAL", "Unable to open shared memory region: '/kimi_vision_0f'", SharedMemoryUnavailableError),
    ("500", "Unable to open shared memory region: '/kimi_vision_0f'", SharedMemoryUnavailableError),
    ("StatusCode.NOT_FOUND", "Unable to find shared memory region: 'kimi_vision_0f'", SharedMemoryUnavailableError),
    ("404", "Unable to find shared memory region: 'kimi_vision_0f'", SharedMemoryUnavailableError),
    ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", DeadlineExceededError),
    ("StatusCode.DEADLINE_EXCEEDED", "Stream removed (Deadline Exceeded)", DeadlineExceededError),
    ("StatusCode.UNAVAILABLE", "in ensemble 'kimi_k25_vision', [request id: <id_unknown>] Exceeds maximum queue size",
     ServerUnavailableError),
    ("None", "failed to obtain inference response", DeadlineExceededError),
    ("StatusCode.UNAVAILABLE", "Stream removed (recvmsg:Connection reset by peer (104))", ConnectionLostError),
    ("StatusCode.UNAVAILABLE", "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:57229: "
     "Failed to connect to remote host: Connection refused", ConnectionLostError),
    ("StatusCode.UNAVAILABLE", "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:41835: "
     "connection attempt timed out before receiving SETTINGS frame", ConnectionLostError),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'nope' is not found", PreprocessError),
]  # fmt: skip


@pytest.mark.parametrize(("status", "message", "expected"), SEEN_HERE)
def test_what_triton_and_grpc_said_here_is_its_fault_class(
    status: str, message: str, expected: type[PreprocessError]
) -> None:
    error = error_from_server(tritonclient.utils.InferenceServerException(message, status=status))
    assert type(error) is expected, (message, type(error))


def test_a_transports_own_failures_are_a_lost_connection() -> None:
    from geventhttpclient.response import HTTPConnectionClosed

    for exc in (ConnectionRefusedError(111, "Connection refused"), ConnectionResetError(104, "reset"),
                HTTPConnectionClosed("connection closed.")):  # fmt: skip
        assert type(error_from_server(exc)) is ConnectionLostError, exc
    assert type(error_from_server(RuntimeError("a bug"))) is PreprocessError


def test_every_fault_is_the_servers_and_no_verdict_is() -> None:
    """Every rule's class and DecoderBusyError are ServerUnavailableError subclasses (retried, never
    the input's verdict, never vLLM's 400); every tagged class keeps its tag's class."""
    for rule in faults.FAULT_RULES:
        assert issubclass(rule.error, ServerUnavailableError), rule
    assert issubclass(DecoderBusyError, ServerUnavailableError)
    assert issubclass(DecoderBusyError, NOT_THE_REQUESTS) and not issubclass(InvalidImageError, NOT_THE_REQUESTS)
    for name, cls in ERROR_CLASSES.items():
        error = error_from_server(tritonclient.utils.InferenceServerException(served_message(cls("x")), status="500"))
        assert type(error) is cls, name


def test_what_is_sent_again_and_what_may_still_run() -> None:
    assert faults.retry_elsewhere(ModelRestartingError("stub")) and faults.retry_elsewhere(DecoderBusyError("busy"))
    assert faults.retry_elsewhere(ConnectionLostError("reset"))
    assert not faults.retry_elsewhere(DeadlineExceededError("late"))  # the caller's time is up
    assert not faults.retry_elsewhere(InvalidImageError("verdict"))
    assert not faults.got_an_answer(DeadlineExceededError("late")) and not faults.got_an_answer(ConnectionLostError(""))
    assert faults.got_an_answer(ModelRestartingError("stub")) and faults.got_an_answer(InvalidImageError("verdict"))


def rows(document: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in (DOCS / document).read_text().splitlines()
        if line.startswith("| `")
    ]


def test_errors_md_has_a_row_for_every_class_and_every_rule() -> None:
    table = rows("errors.md")
    labelled = {re.match(r"`(\w+)` \(`(\w+)`", row[0]).groups() for row in table if re.match(r"`\w+` \(`", row[0])}
    assert {(name, cls.reason) for name, cls in ERROR_CLASSES.items()} <= labelled
    rules = {(row[0], row[1]) for row in table if len(row) == 3}
    assert rules == {(f"`{rule.text}`", f"`{rule.error.__name__}`") for rule in faults.FAULT_RULES}
    for row in table:
        if len(row) == 5:  # the class table: the Triton code is the class's
            name = re.match(r"`(\w+)`", row[0]).group(1)  # type: ignore[union-attr]
            assert row[2] == f"`{ERROR_CLASSES[name].triton_code}`", name


class Answers:
    """A transport adapter whose server is live and whose model is not ready, its config answered
    as given (a dict: the config; an exception: Triton's answer)."""

    protocol = "grpc"
    timeout_s = None

    def __init__(self, config: object) -> None:
        self.config = config

    def is_server_live(self, client: object, timeout_s: float | None) -> bool:
        return True

    def is_model_ready(self, client: object, model: str, timeout_s: float | None) -> bool:
        return False

    def model_config(self, client: object, model: str, timeout_s: float | None) -> dict:
        if isinstance(self.config, Exception):
            raise self.config
        return self.config  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"name": "kimi_k25_vision_u8"}, ModelRestartingError),  # in the repository, loading
        (tritonclient.utils.InferenceServerException(
            "Request for unknown model: 'kimi_k25_vision_u8' has no available versions", status="StatusCode.NOT_FOUND"
        ), ModelRestartingError),  # reloading
        (tritonclient.utils.InferenceServerException(
            "Request for unknown model: 'kimi_k25_vision_u8' is not found", status="StatusCode.NOT_FOUND"
        ), ModelNotServedError),  # not in the repository
    ],
)  # fmt: skip
def test_a_model_not_ready_is_restarting_where_the_server_has_it(config: object, expected: type) -> None:
    """A live server's model that is not ready: loading or reloading (a fault of the server's state,
    asked again) where the server knows it, not served (final) where it does not."""
    from kimi_vision_client.servers.readiness import require_model
    from kimi_vision_client.servers.replicas import Replicas
    from kimi_vision_client.transport.deadline import Deadline

    replicas = Replicas(("127.0.0.1:1",), "round_robin", lambda target: target)
    with pytest.raises(expected):
        require_model(Answers(config), replicas, "127.0.0.1:1", "kimi_k25_vision_u8", Deadline.after(5))


def test_vllm_answers_a_verdict_400_and_anything_else_as_a_server_error() -> None:
    """vllm_plugin.calls.vllm_error: a verdict (INVALID_ARG) is the ValueError vLLM answers 400; a fault
    or a bug is a server error (vLLM's own classes where vLLM is installed; tests/vllm checks
    those; here, without vLLM, the library's error as it is, never a ValueError)."""
    from kimi_vision_common.vllm_plugin.calls import vllm_error

    for verdict in (InvalidImageError("truncated"),):
        assert type(vllm_error(verdict)) is ValueError and str(vllm_error(verdict)).startswith("InvalidImageError: ")
    for not_the_input in (ModelRestartingError("stub"), PreprocessError("internal error: a bug")):
        assert not isinstance(vllm_error(not_the_input), ValueError)
