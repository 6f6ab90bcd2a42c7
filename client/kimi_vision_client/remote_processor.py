"""``RemoteKimiProcessor``: the checkpoint processor's interfaces, its pixels computed by a server.

The interfaces are :class:`~kimi_vision_common.processor_api.ProcessorInterface`'s, the same as the
library's ``KimiVisionProcessor``: sizes, token counts, ``num_frames_per_chunk`` and prompts are
answered here from headers and the config (no round trip). ``preprocess`` and ``__call__`` send
each image, and each video chunk, as its own request to the served models over gRPC, up to
``concurrency`` at once, so that a repeated image is answered from the server's response cache: an
image to ``kimi_*_vision_u8``, a chunk's frames to ``kimi_*_video_chunk``, both on the uint8 wire.
The patches are handed over as they arrive for ``do_rescale=False, do_normalize=False`` (vLLM) and
expanded exactly into float32 otherwise, with numpy or, on the ``device`` the caller names, torch
(a quarter of the bytes crosses the bus). Where the server is on this host (one loopback address)
and maps this process's shared memory, the request and its answer travel through it. Given several
servers (or a ``dns:///`` name listing them), each request goes to one of them (``balance``, as
:class:`~kimi_vision_client.client.KimiVisionClient` takes it), one that got no answer to another.

What is sent: an encoded image's own bytes (bytes, ``data:`` URLs, paths, a JPEG Pillow opened but
did not decode, an engine's wrapper of such a JPEG); an image already decoded in memory is sent as
a lossless file of its own mode and transparency
(:func:`~kimi_vision_client.processors.encoding.encoded_losslessly`), which the server decodes to
the same pixels. Bit-equal to in process for everything it accepts, and a bad image
raises the library's typed error (the server's verdict, carried by its message's tag).

Faults: each call has one deadline (``deadline_s``), and every RPC it makes (the models' check on
first use, shared-memory registration, each request and resend) gets the time left of it, on any
thread, so the call returns by it. A fault of the server's state, not a verdict on the input
(:class:`ServerUnavailableError` and its subclasses: refused or lost connections, a stub that died or
is being replaced, a model reloading, busy decoders, a full queue; :mod:`kimi_vision_common.faults`)
is asked again, with a backoff, while time is left; a request that does not answer in time fails
with :class:`DeadlineExceededError` (never asked again: it may still be working on it). Either way
the error names the server and what to do, or, given ``fallback`` (an in-process processor, e.g. the
library's ``KimiVisionProcessor``), the call is answered by it instead: counted in
:attr:`RemoteKimiProcessor.fallbacks`, the first one logged as a warning. A verdict on the input is
final. A request is never sent again after an answer, so none is answered twice; each has its own
output buffer, and the buffer of a request that did not answer is never reused.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kimi_vision_common.errors import (
    DeadlineExceededError,
    InvalidPresetError,
    ModelNotServedError,
    PreprocessError,
    ServerUnavailableError,
)
from kimi_vision_common.faults import retry_elsewhere
from kimi_vision_common.models import SERVED_PRESETS, model_prefix
from kimi_vision_common.patches import expand_patches, expand_with_table_torch, normalize_table
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.processor_api import MediaItem, ProcessorInterface
from kimi_vision_common.results import PixelOutput
from kimi_vision_common.wire import DEFAULT_GRPC_PORT, is_loopback

from .client import CLOSE_DEADLINE_S, PIXEL_PATCHES, KimiVisionClient, WireResult
from .processors.encoding import chunk_frames, encoded
from .processors.thread_clients import ThreadClients
from .request.shm_slots import SharedMemoryMode
from .servers.replicas import Balance, server_addresses
from .transport.deadline import Deadline

log = logging.getLogger("kimi_vision_client.remote")

DEFAULT_URL = f"localhost:{DEFAULT_GRPC_PORT}"
DEFAULT_DEADLINE_S = 60.0  # a call's whole budget: a 12 MP photo or a long chunk takes seconds on a CPU
DEFAULT_CONCURRENCY = 8  # requests of one call in flight at once
# Backoff between attempts at an unavailable server: doubling from the first, capped.
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.05, 1.0


def served_model(preset: Preset, kind: str) -> str:
    """The served model of ``kind`` whose preset is ``preset``'s base (``kimi-k2.6`` is served as
    ``kimi-k2.5``, its equal under another name)."""
    for name in SERVED_PRESETS:
        if dataclasses.replace(get_preset(name), name=preset.name) == preset:
            return f"{model_prefix(name)}_{kind}"
    raise InvalidPresetError(
        f"no served model follows preset {preset.name!r} (served: {', '.join(SERVED_PRESETS)}): "
        "use the library's KimiVisionProcessor in process"
    )


class RemoteKimiProcessor(ProcessorInterface):
    """The checkpoint's vision processor (K2.5 / K2.6 / K3) whose pixels a kimi-prep server computes.

    ``media_proc_cfg``, ``preset``: as :class:`~kimi_vision_common.processor_api.ProcessorInterface`
    takes them (the server's model must follow the same values: checked at the first request).
    ``url``: the server's gRPC ``host:port``, several (``"h1:p1,h2:p2"`` or a list) or a
    ``dns:///name:port``; ``balance``: how requests spread over several (``round_robin``, or
    ``rendezvous``: an image's repeats to one replica's response cache). ``deadline_s``: the most
    one call waits, every RPC of it included (first use, resends, retries). ``concurrency``:
    requests of one call in flight. ``shared_memory``: send and receive through system shared
    memory (True; None: ``"auto"`` where ``url`` is one loopback address, once the server is seen
    to map this process's regions, :mod:`~kimi_vision_client.request.shm_slots`). ``device``: where
    float32 ``pixel_values`` are expanded (None: numpy on the host; a torch device such as
    ``"cuda:0"``: the uint8 patches move there and expand there, torch tensors returned).
    ``fallback``: an in-process processor that answers a call the server cannot (a fault of its
    state, :class:`ServerUnavailableError`: down, stuck, restarting, busy): counted in
    :attr:`fallbacks`, the first logged. Thread safe: one connection per thread, closed once the
    thread ends.
    """

    def __init__(
        self,
        media_proc_cfg: Mapping[str, Any] | None = None,
        preset: str | Preset | None = None,
        *,
        url: str | Sequence[str] = DEFAULT_URL,
        balance: Balance = "round_robin",
        deadline_s: float = DEFAULT_DEADLINE_S,
        concurrency: int = DEFAULT_CONCURRENCY,
        shared_memory: bool | None = None,
        device: Any = None,
        fallback: ProcessorInterface | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(media_proc_cfg, preset, **kwargs)
        if deadline_s <= 0 or concurrency < 1:
            raise ValueError(f"deadline_s must be > 0 and concurrency >= 1, got {deadline_s}, {concurrency}")
        addresses = server_addresses(url)
        self.url = ",".join(addresses)
        self.balance = balance
        self.deadline_s = deadline_s
        self.concurrency = concurrency
        one_local = len(addresses) == 1 and is_loopback(addresses[0].rsplit(":", 1)[0])
        # On one loopback address, shared memory once the server is seen to map this process's
        # regions: a loopback port may lead into a container with its own /dev/shm.
        self.shared_memory: SharedMemoryMode = (
            ("auto" if one_local else False) if shared_memory is None else shared_memory
        )
        self.device = device
        self.fallback = fallback
        self.fallbacks = 0
        self.model = served_model(get_preset(self.base_preset), "vision_u8")
        self._connections = ThreadClients(self._new_client)
        self._lock = threading.Lock()
        self._checked: set[str] = set()

    # -- the pixels -------------------------------------------------------------------------------

    def _pixels(self, items: Sequence[MediaItem], output: PixelOutput) -> tuple[Any, np.ndarray]:
        requests = [
            encoded(payload, self.preset) if kind == "image" else chunk_frames(payload) for kind, payload in items
        ]
        try:
            results = self._answers(requests)
        except ServerUnavailableError as exc:
            if self.fallback is None:
                raise
            self._fell_back(exc)
            return self.fallback._pixels(items, output)
        return self._joined(results, output), np.stack([r.grid_thw for r in results])

    def _answers(self, requests: list[bytes | list[bytes]]) -> list[WireResult]:
        """The server's answer to each request within one deadline (``deadline_s`` from now: every
        RPC of the call gets the time left of it), asking again those the server could not take
        (a fault of its state, not a verdict on the input) with a backoff while time is left; the
        first verdict on an input (in order) raised, else the server's fault."""
        deadline = Deadline.after(self.deadline_s)
        results: list[WireResult | PreprocessError | None] = [None] * len(requests)
        backoff = FIRST_BACKOFF_S
        while True:
            pending = [i for i, result in enumerate(results) if not isinstance(result, WireResult)]
            try:
                with self._connections.use(deadline) as client:
                    self._check_models(client, [requests[i] for i in pending], deadline)
                    answers = client.preprocess_media(
                        [requests[i] for i in pending], self.concurrency, deadline=deadline
                    )
            except ServerUnavailableError as exc:
                answers = [exc] * len(pending)
            for i, answer in zip(pending, answers, strict=True):
                results[i] = answer
            failures = [r for r in results if isinstance(r, PreprocessError)]
            if not failures:
                return results  # type: ignore[return-value]
            verdicts = [r for r in failures if not isinstance(r, ServerUnavailableError)]
            if verdicts:
                raise verdicts[0]
            left = deadline.left()
            if not all(retry_elsewhere(r) for r in failures) or (left is not None and left <= backoff):
                raise self._explained(failures[0])
            log.debug(
                "kimi-vision-client: %d of %d requests not taken (%s: %s); asking again in %.2f s",
                len(failures),
                len(requests),
                type(failures[0]).__name__,
                failures[0],
                backoff,
            )
            deadline.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    def _check_models(self, client: KimiVisionClient, requests: list[bytes | list[bytes]], deadline: Deadline) -> None:
        """Once per model: the server serves it (else a typed error naming the flag that serves it),
        on the uint8 wire, and under this processor's preset (else :class:`ModelNotServedError`:
        the server serves no model for this checkpoint, whose pixels would differ; the deployment's
        fault, not the request's), asked within ``deadline``."""
        kinds = {"vision_u8" if isinstance(r, bytes) else "video_chunk" for r in requests}
        for model in sorted(served_model(get_preset(self.base_preset), kind) for kind in kinds):
            if model in self._checked:
                continue
            client.require_model(model, deadline)
            wire = client.wire_of(model, deadline)
            if wire.pixel_output != PIXEL_PATCHES:
                raise ModelNotServedError(f"{model} at {self.url} does not return uint8 {PIXEL_PATCHES}")
            served = wire.preset
            if dataclasses.replace(served, name=self.preset.name) != self.preset:
                raise ModelNotServedError(
                    f"{model} at {self.url} follows preset {served.name!r} and this processor's config differs "
                    f"from it ({self.media_proc_cfg}): its pixels would not be this checkpoint's"
                )
            self._checked.add(model)

    def _explained(self, error: PreprocessError) -> PreprocessError:
        """The error a call ends with: a verdict on the input as it is; a fault of the server, once
        the deadline leaves no time to ask again, as :class:`DeadlineExceededError` naming the server,
        the last fault and what to do."""
        if not isinstance(error, ServerUnavailableError):
            return error
        return DeadlineExceededError(
            f"no answer from the kimi-prep server at {self.url} within deadline_s={self.deadline_s:g} "
            f"(last: {type(error).__name__}: {error}): is it running, stuck or overloaded? check its /readyz, "
            "start one with `kimi-prep serve`, add replicas or raise deadline_s"
        )

    def _fell_back(self, exc: PreprocessError) -> None:
        with self._lock:
            self.fallbacks += 1
            first = self.fallbacks == 1
        (log.warning if first else log.debug)(
            "kimi-vision-client: answered in process (%s), fallback %d: %s",
            type(self.fallback).__name__,
            self.fallbacks,
            exc,
        )

    def _joined(self, results: list[WireResult], output: PixelOutput) -> Any:
        """The answers' pixels as one ``(ΣN, 3, p, p)`` array: uint8 as received for
        ``pixel_patches``, float32 expanded with the preset's table for ``pixel_values``."""
        patches = [r.pixels for r in results]
        if self.device is None:
            joined = patches[0] if len(patches) == 1 else np.concatenate(patches)
            return joined if output == "pixel_patches" else expand_patches(joined, self.preset)
        import torch

        joined = torch.cat([torch.from_numpy(p) for p in patches]).to(self.device, non_blocking=True)
        if output == "pixel_patches":
            return joined
        return expand_with_table_torch(joined, normalize_table(self.preset.image_mean, self.preset.image_std))

    # -- connections ------------------------------------------------------------------------------

    def _new_client(self, deadline: Deadline) -> KimiVisionClient:
        """A thread's connection, made within ``deadline`` (a ``dns:///`` name's first answer waited
        for no longer: the client bounds its start by ``timeout_s``; every call after passes the
        call's own deadline)."""
        client = KimiVisionClient(
            self.url, "grpc", self.model, self.shared_memory, timeout_s=deadline.timeout(), balance=self.balance
        )
        client.timeout_s = None
        return client

    @property
    def output_bytes_received(self) -> int:
        """Output bytes received so far, every thread's (over the wire or through shared memory)."""
        return self._connections.output_bytes_received

    @property
    def shared_memory_regions(self) -> list[str]:
        """The regions the live threads' connections have registered (for inspection and tests)."""
        return [name for client in self._connections.clients for name in client.shared_memory_regions]

    def close(self) -> None:
        """Close every thread's connection (and its shared-memory regions) that no call is using,
        all within :data:`~kimi_vision_client.client.CLOSE_DEADLINE_S` (a stalled server keeps the
        regions it could not be asked to unregister until it stops); one in use is closed when its
        call is done. The processor stays usable (new connections)."""
        self._connections.close(Deadline.after(CLOSE_DEADLINE_S))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_connections", "_lock"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._connections, self._lock = ThreadClients(self._new_client), threading.Lock()
