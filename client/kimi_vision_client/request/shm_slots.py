"""A client's system shared memory: one region per request in flight, registered with one server.

A slot is one region: the request's input at offset 0, its outputs after it. Slots are reused: a
request the server answered, with its outputs or with an error, gives its slot back at once, so a
client never holds more slots than requests it had in flight at one time. A request that got no
answer (its deadline passed, its connection was lost) may still be written by the server: its
region is unlinked here and unregistered after the server next answers (never reused).

Two things make shared memory unsafe to assume, and :class:`SharedMemoryPool` checks both:

- **The server must see the caller's** ``/dev/shm``: a server on a loopback address may still be
  in another mount namespace (a container's published port, ``kubectl port-forward``). In
  ``auto`` mode the first registration is the check: Triton opens the region by its key, which
  only the caller's ``/dev/shm`` holds, so a server with its own fails to open it; the pool then
  sends everything over the wire (logged once).
- **The caller's** ``/dev/shm`` **must hold the region**: tmpfs pages are allocated when written
  (the outputs by the server, after the request was sent), and a write past a full tmpfs kills the
  writer with SIGBUS (Docker's default ``/dev/shm`` is 64 MiB). A region is only created or grown
  where ``/dev/shm`` has its size free beyond :data:`SHM_HEADROOM_BYTES`, and its pages are
  reserved when it is made (``posix_fallocate``: other requests, threads and processes cannot take
  them meanwhile); a request that does not fit goes over the wire.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import Any, Literal

import tritonclient.utils.shared_memory as shm

from kimi_vision_common.errors import PreprocessError
from kimi_vision_common.faults import got_an_answer

from ..transport.deadline import Deadline
from ..transport.server_errors import error_from_server

log = logging.getLogger("kimi_vision_client.shm")

SharedMemoryMode = bool | Literal["auto"]
SHM_ROOT = "/dev/shm"
SHM_ALIGNMENT = 1 << 16  # regions grow in 64 KiB steps so small size changes reuse them
OUTPUT_ALIGNMENT = 64  # the outputs start on a cache line after the input
SHM_HEADROOM_BYTES = 8 << 20  # /dev/shm left free for others (a server's own stubs on the same host)
SHM_IN_USE = "currently in use"  # tritonserver's refusal to unregister a region a request still holds
CLOSE_RETRY_S = 0.05  # how often close() asks again to unregister a region the server still holds


def aligned(byte_size: int, alignment: int) -> int:
    return -(-byte_size // alignment) * alignment


def reserve(path: str, byte_size: int) -> None:
    """Allocate every page of the tmpfs file ``path`` now. A region's pages are otherwise allocated
    as they are written, its outputs by the server after the request was sent: a tmpfs that fills
    meanwhile (other requests' regions, other processes) kills the writer with SIGBUS. OSError
    (ENOSPC) where they do not fit."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, byte_size)
    finally:
        os.close(fd)


def shm_free_bytes(root: str = SHM_ROOT) -> int:
    """Bytes free on the caller's shared-memory filesystem."""
    return shutil.disk_usage(root).free


class NoRoomError(Exception):
    """``/dev/shm`` cannot hold a region's pages (the request goes over the wire)."""


class ShmRegion:
    """One region of system shared memory created here (not registered: the pool registers it),
    its pages reserved on ``/dev/shm`` at once (:class:`NoRoomError` where they do not fit)."""

    def __init__(self, byte_size: int) -> None:
        self.name = f"kimi_vision_{uuid.uuid4().hex}"
        self.key = f"/{self.name}"
        self.byte_size = byte_size
        self.handle = shm.create_shared_memory_region(self.name, self.key, byte_size, create_only=True)
        try:
            reserve(f"{SHM_ROOT}{self.key}", byte_size)
        except OSError as exc:
            self.forget()
            raise NoRoomError(f"{SHM_ROOT} cannot hold {byte_size >> 20} MiB more ({exc.strerror})") from None

    def forget(self) -> None:
        """Unlink and unmap the region here (a server that maps it keeps its mapping until it is
        unregistered there)."""
        shm.destroy_shared_memory_region(self.handle)


class ShmSlot:
    """One request's region: the input at offset 0, the outputs from :attr:`output_offset`."""

    def __init__(self) -> None:
        self.region: ShmRegion | None = None
        self.output_offset = 0

    @staticmethod
    def size_for(input_bytes: int, output_bytes: int) -> int:
        """The region size that holds ``input_bytes`` then ``output_bytes``."""
        return aligned(aligned(input_bytes, OUTPUT_ALIGNMENT) + max(output_bytes, 1), SHM_ALIGNMENT)


class SharedMemoryPool:
    """The slots of one client (one server). ``adapter``: the protocol's (registration calls);
    ``headers``: the admin key's, where the server restricts shared memory; ``mode``: True (use it,
    a failure raised), ``"auto"`` (use it once the server is seen to map the caller's regions) or
    False (never). Attributes: ``usable`` (False once found unusable in ``auto`` mode)."""

    def __init__(self, adapter: Any, headers: dict[str, str] | None, mode: SharedMemoryMode) -> None:
        self.adapter = adapter
        self.headers = headers
        self.mode = mode
        self.usable = bool(mode)
        self.checked = mode is True
        self._free: list[ShmSlot] = []
        self._slots: list[ShmSlot] = []
        self._stale: set[ShmSlot] = set()  # slots in flight whose region the server forgot
        self._unregister_later: list[ShmRegion] = []
        self._said_full = False

    def _timeout(self, deadline: Deadline) -> float | None:
        """A registration call's timeout: the time left of ``deadline``, at most the client's per-RPC bound."""
        return deadline.timeout(self.adapter.timeout_s)

    @property
    def region_names(self) -> list[str]:
        """The regions registered now (for inspection and tests)."""
        return [slot.region.name for slot in self._slots if slot.region is not None]

    def slot_for(self, client: Any, input_bytes: int, output_bytes: int, deadline: Deadline) -> ShmSlot | None:
        """A registered slot that holds a request of ``input_bytes`` in and ``output_bytes`` out,
        or None: send it over the wire (shared memory off, found unusable, or ``/dev/shm`` too
        full). Raises a registration's failure (in ``auto`` mode, only once the server was seen to
        map the caller's regions, or where it did not answer)."""
        if not self.usable:
            return None
        needed = ShmSlot.size_for(input_bytes, output_bytes)
        slot = self._take_free(needed)
        if slot.region is None or slot.region.byte_size < needed:
            if not self._room_for(needed):
                self._free.append(slot)
                return None
            try:
                self._grow(client, slot, needed, deadline)
            except NoRoomError as exc:
                self._free.append(slot)
                self._said_no_room(str(exc))
                return None
            except PreprocessError as error:
                if self.mode != "auto" or self.checked or not got_an_answer(error):
                    raise
                self._found_unusable(error)
                return None
        slot.output_offset = aligned(input_bytes, OUTPUT_ALIGNMENT)
        return slot

    def _take_free(self, byte_size: int) -> ShmSlot:
        """A free slot whose region holds ``byte_size``, else a free one to grow, else a new one."""
        fitting = [slot for slot in self._free if slot.region is not None and slot.region.byte_size >= byte_size]
        if fitting or self._free:
            slot = (fitting or self._free)[-1]
            self._free.remove(slot)
            return slot
        slot = ShmSlot()
        self._slots.append(slot)
        return slot

    def _room_for(self, byte_size: int) -> bool:
        """Whether ``/dev/shm`` has ``byte_size`` free beyond the headroom (said once where not)."""
        free = shm_free_bytes()
        if free >= byte_size + SHM_HEADROOM_BYTES:
            return True
        self._said_no_room(
            f"{SHM_ROOT} has {free >> 20} MiB free, too little for a {-(-byte_size >> 20)} MiB region and "
            f"{SHM_HEADROOM_BYTES >> 20} MiB of headroom"
        )
        return False

    def _said_no_room(self, why: str) -> None:
        """Log once that requests too large for ``/dev/shm`` go over the wire, and ``why``."""
        if not self._said_full:
            self._said_full = True
            log.warning(
                "kimi-vision-client: %s: such requests go over the wire (raise the container's --shm-size)", why
            )

    def _grow(self, client: Any, slot: ShmSlot, byte_size: int, deadline: Deadline) -> None:
        """Give ``slot`` a new registered region of ``byte_size``; its old one is unlinked here and
        unregistered later (the server may hold it a moment after answering the request that used
        it). Raises :class:`NoRoomError`, or the registration's failure as the library's class (the
        slot then has none; a registration that got no answer is unregistered later)."""
        old, slot.region = slot.region, None
        if old is not None:
            old.forget()
            self._unregister_later.append(old)
        region = ShmRegion(byte_size)
        try:
            self.adapter.register_shm(
                client, region.name, region.key, byte_size, headers=self.headers, timeout_s=self._timeout(deadline)
            )
        except Exception as exc:
            region.forget()
            self._free.append(slot)
            error = error_from_server(exc)
            if not got_an_answer(error):  # the server may have registered it all the same
                self._unregister_later.append(region)
            raise error from None
        slot.region = region
        self.checked = True

    def _found_unusable(self, error: PreprocessError) -> None:
        """The first registration failed with the server's answer: it does not map this process's
        regions (its own ``/dev/shm``, or shared memory restricted to a key); the wire from now on."""
        self.usable = False
        log.warning(
            "kimi-vision-client: the server cannot map this process's shared memory (%s: %s); "
            "requests go over the wire",
            type(error).__name__,
            error,
        )

    def answered(self, slot: ShmSlot | None) -> None:
        """The server answered the request that held ``slot`` (outputs or an error): reuse it, or
        drop it where the server forgot its region meanwhile (:meth:`forget_all`)."""
        if slot is None or slot not in self._slots:
            return
        if slot in self._stale:
            self._stale.remove(slot)
            self._drop(slot)
        else:
            self._free.append(slot)

    def unanswered(self, slot: ShmSlot | None) -> None:
        """The request that held ``slot`` got no answer: the server may still write its region,
        which is unlinked here now and unregistered after the server next answers."""
        if slot is None or slot not in self._slots:
            return
        self._stale.discard(slot)
        self._drop(slot)
        if slot.region is not None:
            self._unregister_later.append(slot.region)
            slot.region = None

    def forget_all(self) -> None:
        """The server no longer knows this pool's regions (it restarted): free slots are dropped
        now, those of requests in flight when they come back; the next requests register new ones
        (in ``auto`` mode checking again that the server maps them)."""
        for slot in list(self._free):
            self._drop(slot)
            slot.region = None
        self._stale = set(self._slots)
        self.checked = self.mode is True

    def _drop(self, slot: ShmSlot) -> None:
        """``slot`` out of the pool, its region unlinked and unmapped here."""
        self._slots.remove(slot)
        if slot in self._free:
            self._free.remove(slot)
        if slot.region is not None:
            slot.region.forget()

    def unregister_retired(self, client: Any, deadline: Deadline) -> None:
        """Unregister the retired and replaced regions, once each (a restarted server has forgotten
        them anyway); one the server still holds is asked again after the next answer."""
        regions, self._unregister_later = self._unregister_later, []
        for index, region in enumerate(regions):
            try:
                self.adapter.unregister_shm(
                    client, region.name, headers=self.headers, timeout_s=self._timeout(deadline)
                )
            except PreprocessError:  # the deadline passed: the rest wait for the next answer
                self._unregister_later += regions[index:]
                return
            except Exception as exc:  # the server's failure, whatever its transport calls it
                if not got_an_answer(error_from_server(exc)) or SHM_IN_USE in str(exc):
                    self._unregister_later.append(region)  # no answer, or still held: after the next answer
                # otherwise the server's answer: unknown to it (restarted), or gone

    def close(self, client: Any, deadline: Deadline) -> None:
        """Unlink every region here, and unregister each from the server while ``deadline`` lasts
        (a stalled server leaves them registered; it unmaps them when it stops)."""
        for slot in list(self._slots):
            self._drop(slot)
            if slot.region is not None:
                self._unregister_later.append(slot.region)
        self._stale = set()
        while self._unregister_later:
            self.unregister_retired(client, deadline)
            if not deadline.left():
                break
            deadline.sleep(CLOSE_RETRY_S)  # a region the server holds a moment after its answer
        self._unregister_later = []
