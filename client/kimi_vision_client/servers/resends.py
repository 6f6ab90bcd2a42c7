"""A client's requests on their way: each sent to a replica, sent again where the server's state
failed it, its answer collected and converted.

A request is idempotent (its answer depends on its bytes alone, docs/contract.md), so one that
failed for the server's state (:func:`~kimi_vision_common.faults.retry_elsewhere`) is sent again: to
another replica (the one that failed passed over for a while, :mod:`.replicas`), or over fresh
shared-memory regions where the server lost this client's; one that passed its deadline is never
sent again. A request that got no answer may still be written by the server: its shared-memory slot
is retired, never reused for another request's outputs (:mod:`~kimi_vision_client.request.shm_slots`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from kimi_vision_common.errors import PreprocessError, SharedMemoryUnavailableError
from kimi_vision_common.faults import got_an_answer, retry_elsewhere

from ..request.outputs import to_wire_result
from ..request.request_io import Request, built, shm_outputs
from ..request.shm_slots import SharedMemoryPool, ShmSlot
from ..request.wire import Wire
from ..transport.adapters import Waiter
from ..transport.deadline import Deadline
from ..transport.server_errors import error_from_server
from .replicas import FAILOVER_BACKOFF_S, Replica, Replicas

ResultT = TypeVar("ResultT")


@dataclass
class Pending:
    """A submitted request: how to wait for it, the shm slot (if any) it travelled in and the
    offsets of its outputs there (None: they come over the wire), and the replica it went to."""

    wait: Waiter
    slot: ShmSlot | None
    output_offsets: dict[str, int] | None
    wire: Wire
    request: Request
    replica: Replica


class Sender:
    """Sends a client's requests through ``adapter`` (:mod:`~kimi_vision_client.transport.adapters`)
    to its ``replicas``, in ``shm``'s regions where it uses shared memory, each request's wire asked
    of ``wire_of(model, deadline)``. Attribute: ``output_bytes_received``, the output bytes received
    so far (over the wire or through shared memory)."""

    def __init__(
        self,
        adapter: Any,
        replicas: Replicas,
        shm: SharedMemoryPool,
        wire_of: Callable[[str, Deadline], Wire],
    ) -> None:
        self._adapter = adapter
        self._replicas = replicas
        self._shm = shm
        self._wire_of = wire_of
        self.output_bytes_received = 0

    @property
    def _client(self) -> Any:
        """The tritonclient for calls about the models (configs, readiness, shared memory)."""
        return self._replicas.primary.client

    def _timeout(self, deadline: Deadline) -> float | None:
        """The next RPC's timeout: the time left of ``deadline``, at most the adapter's bound."""
        return deadline.timeout(self._adapter.timeout_s)

    def windowed(
        self,
        requests: Iterable[tuple[Any, str, str]],
        concurrency: int,
        convert: Callable[..., ResultT],
        deadline: Deadline,
        on_result: Callable[[int, Any], None] | None = None,
    ) -> list[ResultT | PreprocessError]:
        """``(items or one item, model, input name)`` requests, up to ``concurrency`` in flight,
        their results (``convert``'s) or errors in order."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        results: list[ResultT | PreprocessError] = []
        window: list[Pending | PreprocessError] = []

        def collect_oldest() -> None:
            outcome = self.collect(window.pop(0), convert, deadline)
            if on_result is not None:
                on_result(len(results), outcome)
            results.append(outcome)

        for payload, model, input_name in requests:
            if len(window) >= concurrency:
                collect_oldest()
            items = payload if isinstance(payload, list) else [payload]
            window.append(self.send(Request(items, model, input_name), deadline))
        while window:
            collect_oldest()
        return results

    def send(self, request: Request, deadline: Deadline) -> Pending | PreprocessError:
        """Send ``request`` (``input_name`` ``[1, K]``: K images, or a chunk's K frames) within
        ``deadline``: its pending answer, or the error that kept it from being sent (sent again
        first where the server's state kept it, :meth:`again`)."""
        try:
            wire = self._wire_of(request.model, deadline)  # asked of the primary replica, once per model
        except PreprocessError as error:
            return self.again(request, error, self._replicas.primary, deadline)
        replica = self._replicas.pick(request.items)
        slot = None
        try:
            inputs, outputs, slot, offsets = built(
                self._adapter.module, request, wire, pool=self._shm, client=self._client, deadline=deadline
            )
            waiter = self._adapter.submit(replica.client, request.model, inputs, outputs, self._timeout(deadline))
            self._replicas.sent(replica)
            return Pending(waiter, slot, offsets, wire, request, replica)
        except Exception as exc:
            self._shm.answered(slot)  # never sent: reusable
            return self.again(request, error_from_server(exc, request.single), replica, deadline)

    def again(
        self, request: Request, error: PreprocessError, replica: Replica, deadline: Deadline
    ) -> Pending | PreprocessError:
        """``request`` sent again where it failed for the server's state, not the input, and has
        attempts left: to another replica (``replica`` passed over for a while), or over fresh
        regions where the server lost this client's shared memory; else ``error``."""
        shm_lost = isinstance(error, SharedMemoryUnavailableError)
        attempts = self._replicas.failover_attempts + shm_lost
        if not retry_elsewhere(error) or request.attempt >= attempts:
            return error
        if shm_lost:
            self._shm.forget_all()
        else:
            self._replicas.failed(replica)
            deadline.sleep(FAILOVER_BACKOFF_S * 2 ** (request.attempt - 1))  # gRPC notices the dead connection
        return self.send(request.again(), deadline)

    def collect(
        self, pending: Pending | PreprocessError, convert: Callable[..., ResultT], deadline: Deadline
    ) -> ResultT | PreprocessError:
        """``convert(outputs, preset_or_wire)`` of a submitted request's outputs (before its shm
        slot is reused: the converters return new arrays), or its error. A request that got no
        answer (past its deadline, the connection lost) may still be written by the server: its
        slot is retired, never reused for another request's outputs."""
        if isinstance(pending, PreprocessError):
            return pending
        try:
            result = pending.wait()
        except Exception as exc:
            error = error_from_server(exc, pending.request.single)
            self._replicas.answered(pending.replica)
            if got_an_answer(error):
                self._shm.answered(pending.slot)
            else:
                self._shm.unanswered(pending.slot)
            return self.collect(self.again(pending.request, error, pending.replica, deadline), convert, deadline)
        try:
            if pending.slot is not None and pending.output_offsets is not None:
                outputs = shm_outputs(self._adapter, result, pending.slot, pending.output_offsets)
            else:
                outputs = {name: result.as_numpy(name) for name in pending.wire.outputs}
            self.output_bytes_received += sum(array.nbytes for array in outputs.values())
            return convert(outputs, pending.wire if convert is to_wire_result else pending.wire.preset)
        finally:
            self._replicas.answered(pending.replica)
            self._shm.answered(pending.slot)
            self._shm.unregister_retired(self._client, deadline)
