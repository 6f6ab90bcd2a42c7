"""Closing an HTTP client whose request is still running on a server that never answers (a socket
that accepts and reads nothing back): ``close()`` returns within its deadline and the connection
is closed at once (tritonclient.http's own close would wait for the request, and a thread that
ends leaves its greenlets, and their sockets, parked for good)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import tritonclient.http

from kimi_vision_client.transport.adapters import KILL_WAIT_S, HttpAdapter
from kimi_vision_common.errors import DeadlineExceededError

CLOSE_S = 1.0
SLACK_S = 2.0  # a busy host's, past the close's own bound
FAILSAFE_S = 60.0


def test_an_http_client_closed_under_a_request_closes_its_connection_within_its_deadline() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        outcome: dict[str, object] = {}

        def call_then_close() -> None:
            adapter = HttpAdapter(30.0)
            client = adapter.connect(f"127.0.0.1:{port}", 4)
            image = tritonclient.http.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
            image.set_data_from_numpy(np.array([[b"an image"]], dtype=np.object_))
            try:
                adapter.submit(client, "kimi_k25_vision", [image], [], 0.5)()
            except Exception as exc:  # the wait's timeout, as the client classifies it
                outcome["wait"] = exc
            started = time.monotonic()
            adapter.close(client, CLOSE_S)
            outcome["close_s"] = time.monotonic() - started

        caller = threading.Thread(target=call_then_close)
        caller.start()
        connection, _ = listener.accept()
        caller.join(FAILSAFE_S)
        assert "close_s" in outcome, "close() did not return"
        assert outcome["close_s"] < CLOSE_S + KILL_WAIT_S + SLACK_S  # type: ignore[operator]
        connection.settimeout(FAILSAFE_S)
        while connection.recv(65536):  # the request's bytes, then the end the client closed
            pass
        connection.close()
    from kimi_vision_client.transport.server_errors import error_from_server

    assert isinstance(error_from_server(outcome["wait"]), DeadlineExceededError)  # type: ignore[arg-type]
