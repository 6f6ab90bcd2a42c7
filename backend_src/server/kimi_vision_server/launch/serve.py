"""``kimi-prep serve``: tritonserver in the foreground (:func:`serve`: SIGINT/SIGTERM forwarded, its exit
status returned) and the ready line it writes once every model has loaded or failed.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from ..watch.triton_repository import RepositoryError
from .command import Ports
from .launcher import Launched, LaunchSpec, launch
from .process import exit_status, wait_stopping


def ready_lines(index: Sequence[dict[str, str]], host: str, ports: Ports) -> list[str]:
    """What ``kimi-prep serve`` says once every model has loaded or failed: one line with the
    models and the URLs, then one line per model that failed to load, with tritonserver's reason."""
    ready = [m["name"] for m in index if m.get("state") == "READY"]
    failed = [m for m in index if m.get("state") != "READY"]
    urls = f"HTTP http://{host}:{ports.http}, gRPC {host}:{ports.grpc}, metrics http://{host}:{ports.metrics}/metrics"
    if ports.probe is not None:
        urls += f", probes http://{host}:{ports.probe}/readyz"
    lines = [f"kimi-prep: ready: {len(ready)} of {len(index)} models ({', '.join(ready)}) at {urls}"]
    lines += [
        f"kimi-prep: not serving {m['name']}: {m.get('reason') or m.get('state') or 'not loaded'}" for m in failed
    ]
    return lines


def announce_ready(launched: Launched, host: str, out: IO[str]) -> None:
    """Wait until tritonserver answers (it opens its ports once every model has loaded or failed),
    then write :func:`ready_lines`; nothing if the server exits first."""
    while launched.process.poll() is None:
        try:
            index = launched.watchdog.repository.index()
        except (RepositoryError, ValueError):
            time.sleep(0.2)
            continue
        if index and all(m.get("state") in ("READY", "UNAVAILABLE") for m in index):
            out.write("\n".join(ready_lines(index, host, launched.ports)) + "\n")
            out.flush()
            return
        time.sleep(0.2)


def _log_to_stderr() -> None:
    """The watchdog's recoveries on stderr, next to tritonserver's log (unless the caller set up logging)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s kimi-prep %(levelname)s %(name)s: %(message)s")


def serve(spec: LaunchSpec) -> int:
    """Run tritonserver in the foreground until SIGINT/SIGTERM, or until it exits cleanly or fails
    to start (one that dies once it served is started again by the watchdog); returns its exit
    status (128 + N where a signal N ended it).

    The handlers are in place before the server starts: a signal that arrives while it starts
    is held and forwarded as soon as there is a process to forward it to."""
    _log_to_stderr()
    held: list[int] = []
    started: list[Launched] = []
    stopping = threading.Event()

    def forward(signum: int, _frame: Any) -> None:
        if not started:
            held.append(signum)
            return
        started[0].watchdog.stand_down()  # a shutdown on purpose: its stub exits are no faults
        started[0].process.send_signal(signum)
        stopping.set()

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.ExitStack() as stack:
            launched = launch(stack, spec)
            started.append(launched)
            if held:
                forward(held[0], None)
            threading.Thread(target=announce_ready, args=(launched, spec.host, sys.stderr), daemon=True).start()
            # A server that exits by itself is started again by the watchdog, unless it exited
            # cleanly (code 0: a signal sent to tritonserver itself), which ends the launcher too.
            while not stopping.wait(0.5) and (launched.process.poll() is None or launched.watchdog.watching()):
                pass
            return exit_status(wait_stopping(launched.process, None, launched.watchdog.pinned_versions))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
