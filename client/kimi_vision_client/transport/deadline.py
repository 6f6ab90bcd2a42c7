"""One deadline for a whole call: every RPC the call makes gets the time that is left of it.

A caller's call may make many RPCs: the model's readiness and config on first use, shared-memory
registrations, the requests in waves of ``concurrency``, resends to other replicas, and sleeps
between attempts. Each of them is given :meth:`Deadline.timeout` (the time left, capped by the
client's per-RPC ``timeout_s``), and none starts once the time is up, so the call returns by its
deadline whatever the number of images, waves or resends: a late answer is the slack of one
result's conversion, not of one more RPC.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kimi_vision_common.errors import DeadlineExceededError


@dataclass(frozen=True)
class Deadline:
    """``at``: the ``time.monotonic()`` by which the call returns (None: no deadline);
    ``seconds``: the budget it was made with, for messages."""

    at: float | None
    seconds: float | None = None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """A deadline ``seconds`` from now (None: none)."""
        return cls(None if seconds is None else time.monotonic() + seconds, seconds)

    def left(self) -> float | None:
        """Seconds left (0.0 once passed); None without a deadline."""
        return None if self.at is None else max(self.at - time.monotonic(), 0.0)

    def timeout(self, cap: float | None = None) -> float | None:
        """The timeout of the next RPC: the time left, at most ``cap`` (None: neither bounds it).
        :class:`DeadlineExceededError` where no time is left, so no RPC starts after the deadline."""
        left = self.left()
        if left is not None and left <= 0.0:
            raise DeadlineExceededError(f"the call's deadline of {self.seconds:g} s passed before this step")
        if left is None:
            return cap
        return left if cap is None else min(left, cap)

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or only until the deadline where that comes first."""
        left = self.left()
        time.sleep(seconds if left is None else min(seconds, left))


NO_DEADLINE = Deadline(None)


def as_deadline(deadline: Deadline | float | None) -> Deadline:
    """A call's deadline from seconds (from now), a :class:`Deadline`, or None (none)."""
    return deadline if isinstance(deadline, Deadline) else Deadline.after(deadline)
