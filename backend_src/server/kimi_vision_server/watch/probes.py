"""Kubernetes probes and the watchdog's counters on one small HTTP port (stdlib, one thread).

- ``GET /livez``: 200 while tritonserver runs (the launcher answers, so it runs too), else 503.
- ``GET /readyz``: 200 when :meth:`StubWatchdog.readiness` holds (server ready, every model
  ``READY``, no stub known dead or stuck, no reload in progress), else 503 with the reason as the body.
- ``GET /metrics``: ``kimi_prep_stub_deaths_total{model}``, ``kimi_prep_stuck_stubs_total{model}``,
  ``kimi_prep_recoveries_total{model}``,
  ``kimi_prep_replaced_stubs_ended_total{model}``, ``kimi_prep_stalled_loads_total{model}`` and
  ``kimi_prep_server_restarts_total`` in the Prometheus text format.
"""

from __future__ import annotations

import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .watchdog import StubWatchdog

METRIC_FAMILIES = {
    # counters() key: (metric family name, help)
    "stub_deaths": ("kimi_prep_stub_deaths_total", "Python backend stub processes found dead, by model"),
    "stuck_stubs": (
        "kimi_prep_stuck_stubs_total",
        "Python backend stub processes found stuck (not run for stuck_after_s) and ended, by model",
    ),
    "recoveries": ("kimi_prep_recoveries_total", "Models reloaded after a stub death or a stuck stub, by model"),
    "replaced_stubs_ended": (
        "kimi_prep_replaced_stubs_ended_total",
        "Stubs of a replaced model version that never unloaded, ended once idle, by model",
    ),
    "stalled_loads": (
        "kimi_prep_stalled_loads_total",
        "Reloads still running after load_stall_s, their new stubs ended so that they fail and are retried, by model",
    ),
    "server_restarts": (
        "kimi_prep_server_restarts_total",
        "tritonserver processes started again after the last one exited by itself",
    ),
}
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def prometheus_text(counters: dict[str, dict[str, int]]) -> str:
    """The watchdog's counters as Prometheus exposition text (a family is listed even when empty; a
    value keyed "" has no label)."""
    lines = []
    for key, (name, description) in METRIC_FAMILIES.items():
        lines += [f"# HELP {name} {description}", f"# TYPE {name} counter"]
        lines += [
            f'{name}{{model="{model}"}} {value}' if model else f"{name} {value}"
            for model, value in sorted(counters.get(key, {}).items())
        ]
    return "\n".join(lines) + "\n"


def liveness(watchdog: StubWatchdog) -> tuple[bool, str]:
    code = watchdog.process.poll()
    return (True, "alive") if code is None else (False, f"tritonserver exited with code {code}")


def _handler_for(watchdog: StubWatchdog) -> type[BaseHTTPRequestHandler]:
    class ProbeHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/livez":
                self._reply_check(*liveness(watchdog))
            elif path == "/readyz":
                self._reply_check(*watchdog.readiness())
            elif path == "/metrics":
                self._reply(HTTPStatus.OK, prometheus_text(watchdog.counters()), PROMETHEUS_CONTENT_TYPE)
            else:
                self._reply(HTTPStatus.NOT_FOUND, "not found: /livez, /readyz, /metrics\n")

        def _reply_check(self, ok: bool, reason: str) -> None:
            self._reply(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, reason + "\n")

        def _reply(self, status: HTTPStatus, body: str, content_type: str = "text/plain; charset=utf-8") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            """No access log: the kubelet probes every few seconds."""

    return ProbeHandler


class ProbeServer:
    """``/livez``, ``/readyz``, ``/metrics`` for ``watchdog`` on ``host:port`` in a daemon thread."""

    def __init__(self, watchdog: StubWatchdog, port: int, host: str = "0.0.0.0") -> None:
        self.httpd = ThreadingHTTPServer((host, port), _handler_for(watchdog))
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kimi-prep-probes", daemon=True)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ProbeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
