"""What a decoder records: each decode's path and fallback reason, counted (bounded: the reasons
are fixed strings), each reason logged once (the ``kimi_vision_prep.decode`` logger)."""

from __future__ import annotations

import logging
import threading
import traceback
from collections import Counter
from collections.abc import Callable

log = logging.getLogger("kimi_vision_prep.decode")


def cause_of(exc: BaseException) -> str:
    """The traceback of an exception a route fell back on, as text (the exception itself would keep
    its frames, a device route's temporaries among them, alive until it is logged)."""
    return "".join(traceback.format_exception(exc))


class DecodeStats:
    """Counters of decode paths and fallback reasons (bounded: reasons are fixed strings), the one
    place that records a decode: each fallback reason is logged once, through ``warn``, and every
    decode is passed to ``on_decode(path, fallback_reason)`` (a serving model's metrics)."""

    def __init__(
        self,
        warn: Callable[[str], None] = log.warning,
        on_decode: Callable[[str, str | None], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._warn = warn
        self._on_decode = on_decode
        self.paths: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()

    def record(self, path: str, fallback_reason: str | None, cause: str | None = None) -> None:
        """Count a decode; ``cause``: the traceback behind the reason, logged with its first use."""
        with self._lock:
            self.paths[path] += 1
            first = fallback_reason is not None and fallback_reason not in self.fallbacks
            if fallback_reason is not None:
                self.fallbacks[fallback_reason] += 1
        if self._on_decode is not None:
            self._on_decode(path, fallback_reason)
        if first:
            detail = f"\n{cause}" if cause else ""
            self._warn(f"decoder fallback to Pillow (logged once per reason): {fallback_reason}{detail}")

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"paths": dict(self.paths), "fallbacks": dict(self.fallbacks)}

    def unlock_after_fork(self) -> None:
        """A new lock, in a forked child: a thread that held the old one at the fork is gone."""
        self._lock = threading.Lock()
