"""A video's frames through PyAV, decoding only what its sampled frames need.

The first pass (:func:`demux`) opens the container once and lists the first video stream's
packets (no decoding: each packet's pts, key flag and, from its picture header, whether its frame
is a reference, :mod:`.frame_types`). The second pass decodes those packets by a
:func:`decode_plan`: a frame that is not sampled is skipped by the decoder when nothing refers to
it (``skip_frame`` "NONREF" for its packet), and a run of whole GOPs with no sampled frame is not
sent to the decoder at all (drained and flushed before the next GOP, as after a seek). The plan
applies where the frame count is the packet count: the packets' pts name each frame once, in a
codec whose decoder gives one frame a packet (:data:`PLANNED_CODECS`); the decoder must then give
exactly the frames the plan says (the references and the sampled frames, in order), else the
video goes back to a full pass (:func:`every_frame`) before any frame is handed over, or is
refused as damaged after. :class:`FrameProducer` runs a pass in a thread and hands the sampled
frames over a bounded queue.
"""

from __future__ import annotations

import collections
import contextlib
import io
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from kimi_vision_common.errors import InvalidVideoError, VideoTooLargeError

from .frame_types import READERS, reference_reader
from .limits import VideoLimits


@dataclass(frozen=True)
class VideoInfo:
    """The first video stream as the first pass found it: its packets in decode order (``pts``,
    None where the container gives none; key flags; whether each frame is a reference, None where
    :mod:`.frame_types` does not read the codec or the packet), ``average_rate``, frame size, codec."""

    pts: tuple[int | None, ...]
    keyframes: tuple[bool, ...]
    references: tuple[bool | None, ...]
    fps: float
    width: int
    height: int
    codec: str

    @property
    def packets(self) -> int:
        return len(self.pts)


# Decoders that give one frame a packet, honour ``skip_frame`` per packet (FFmpeg copies it to
# each frame thread as the packet is sent) and whose reference frames :mod:`.frame_types` reads.
PLANNED_CODECS = frozenset(READERS)


@dataclass(frozen=True)
class DecodePlan:
    """What the second pass decodes and what must come out of it: ``sampled`` maps each sampled
    frame's pts to its index; ``sent[k]`` says whether packet ``k`` (decode order) goes to the
    decoder; ``shown`` are the pts the decoder must output, in order (the sent reference frames
    and the sampled ones); ``optional`` the leading frames of a GOP entered after a flush, which a
    decoder may drop or conceal (none is sampled)."""

    sampled: dict[int, int]
    sent: tuple[bool, ...]
    shown: tuple[int, ...]
    optional: frozenset[int]


def decode_plan(info: VideoInfo, indices: Sequence[int]) -> DecodePlan | None:
    """The plan for the sampled frame ``indices``, or None (decode every frame) where a packet has
    no pts or shares one, a frame's reference flag is unknown, the first GOP has leading frames,
    or the codec is not in :data:`PLANNED_CODECS`.

    Frame ``i`` is the packet of the ``i``-th smallest pts (presentation order). The packets are
    cut into GOPs at key packets; a GOP with no sampled frame is not sent, except the GOP before one
    whose sampled frames include a leading frame (shown before its key frame: in an open GOP it
    refers to the GOP before)."""
    pts, references = info.pts, info.references
    if info.codec not in PLANNED_CODECS or None in pts or None in references or len(set(pts)) != len(pts):
        return None
    order = sorted(pts)  # type: ignore[type-var]
    sampled = {order[i]: i for i in indices}
    starts = [k for k, key in enumerate(info.keyframes) if key and k > 0]
    gops = list(zip([0, *starts], [*starts, len(pts)], strict=True))
    if any(p < pts[0] for p in pts[: gops[0][1]]):  # type: ignore[operator]
        return None  # a decoder starting here may drop them: the frame count is not the packets'
    needed = [any(p in sampled for p in pts[a:b]) for a, b in gops]
    for g in range(len(gops) - 1, 0, -1):
        a, b = gops[g]
        if needed[g] and any(p in sampled and p < pts[a] for p in pts[a:b]):  # type: ignore[operator]
            needed[g - 1] = True
    shown: list[int] = []
    optional: set[int] = set()
    for g, (a, b) in enumerate(gops):
        after_flush = g > 0 and not needed[g - 1]
        for k in range(a, b) if needed[g] else ():
            if after_flush and pts[k] < pts[a]:  # type: ignore[operator]
                optional.add(pts[k])  # type: ignore[arg-type]
            elif references[k] or pts[k] in sampled:
                shown.append(pts[k])  # type: ignore[arg-type]
    sent = tuple(needed[g] for g, (a, b) in enumerate(gops) for _ in range(a, b))
    return DecodePlan(sampled, sent, tuple(sorted(shown)), frozenset(optional))


def _reject_images(data: bytes) -> None:
    """Pillow identifies it (except MPEG video, which its plugin reads as a still): an image."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            still = image.format != "MPEG"
    except Exception:  # not an image Pillow knows: maybe a video
        return
    if still:
        raise InvalidVideoError("an image, not a video: use the image models")


def _open(data: bytes) -> Any:
    import av

    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise InvalidVideoError(f"not a decodable video ({len(data)} bytes, starts with {data[:8]!r}): {exc}") from None


def _video_stream(container: Any) -> Any:
    # FFmpeg's image demuxers (png_pipe, jpeg_pipe, image2, ...) read what Pillow would not open.
    if container.format.name.endswith("_pipe") or container.format.name == "image2":
        raise InvalidVideoError(f"an image ({container.format.name}), not a video: use the image models")
    if not container.streams.video:
        raise InvalidVideoError("no video stream")
    return container.streams.video[0]


def probe_video(data: bytes, limits: VideoLimits = VideoLimits()) -> VideoInfo:
    """First pass: validate the container and list the first video stream's packets."""
    demuxed = demux(data, limits)
    demuxed.container.close()
    return demuxed.info


@dataclass(frozen=True)
class Demuxed:
    """The first pass's container (open), its first video stream and that stream's packets in
    decode order: the second pass decodes these packets, no second open or demux."""

    info: VideoInfo
    container: Any
    stream: Any
    packets: list[Any]


def demux(data: bytes, limits: VideoLimits) -> Demuxed:
    """First pass: validate ``data`` against ``limits`` and list the first video stream's packets;
    the container stays open for the second pass (the caller closes it)."""
    import av

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidVideoError(f"expected encoded video bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise InvalidVideoError("empty input: 0 bytes")
    if len(data) > limits.max_video_bytes:
        raise VideoTooLargeError(
            f"encoded video of {len(data)} bytes exceeds max_video_bytes={limits.max_video_bytes}"
        )
    _reject_images(data)
    container = _open(data)
    try:
        stream = _video_stream(container)
        rate = stream.average_rate
        if not rate or float(rate) <= 0:
            raise InvalidVideoError("the video stream has no frame rate")
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        _check_frame_size(width, height, limits)
        packets: list[Any] = []
        try:
            for packet in container.demux(stream):
                if packet.size:  # the demuxer ends with an empty flush packet
                    packets.append(packet)
                    if len(packets) > limits.max_video_frames:
                        raise VideoTooLargeError(
                            f"video of more than {limits.max_video_frames} frames exceeds "
                            f"max_video_frames={limits.max_video_frames}"
                        )
        except av.FFmpegError as exc:
            raise InvalidVideoError(f"cannot read the video stream after {len(packets)} packets: {exc}") from None
        if not packets:
            raise InvalidVideoError("the video stream has no frames")
    except BaseException:
        container.close()
        raise
    pts = tuple(packet.pts for packet in packets)
    keyframes = tuple(bool(packet.is_keyframe) for packet in packets)
    codec = stream.codec_context.name
    read = reference_reader(codec, stream.codec_context.extradata)
    references = tuple(None if read is None else read(bytes(packet)) for packet in packets)
    info = VideoInfo(pts, keyframes, references, float(rate), width, height, codec)
    return Demuxed(info, container, stream, packets)


def _check_frame_size(width: int, height: int, limits: VideoLimits) -> None:
    if width * height > limits.max_frame_pixels:
        raise VideoTooLargeError(
            f"frames of {width}x{height} = {width * height} pixels exceed max_frame_pixels={limits.max_frame_pixels}"
        )


def _decoder(stream: Any, threads: int) -> Any:
    """``stream``'s decoder, ready for a pass from the first packet: set to FFmpeg's threads (0:
    FFmpeg's choice) before it opens, flushed after an earlier pass."""
    decoder = stream.codec_context
    if decoder.is_open:
        decoder.flush_buffers()
    else:
        stream.thread_type = "AUTO"
        decoder.thread_count = threads
    decoder.skip_frame = "DEFAULT"
    return decoder


def every_frame(
    demuxed: Demuxed, threads: int, limits: VideoLimits, wanted: set[int], count: Callable[[], None]
) -> Iterator[tuple[int, Any]]:
    """``(index, frame)`` of each ``wanted`` frame, every frame decoded (``count()`` after each)."""
    import av

    decoder = _decoder(demuxed.stream, threads)
    index = 0
    try:
        for packet in [*demuxed.packets, None]:  # None: drain the decoder
            for frame in decoder.decode(packet):
                _check_frame_size(frame.width, frame.height, limits)
                count()
                if index in wanted:
                    yield index, frame
                index += 1
    except av.FFmpegError as exc:
        raise InvalidVideoError(f"cannot decode frame {index}: {exc}") from None


class _PlanMismatch(Exception):
    """The decoder's frames are not the ones the plan says (one dropped, or one more)."""


def planned_frames(
    demuxed: Demuxed, threads: int, limits: VideoLimits, plan: DecodePlan, count: Callable[[], None]
) -> Iterator[tuple[int, Any]]:
    """``(index, frame)`` of each sampled frame in order, decoding only what ``plan`` sends (a
    frame not sampled with ``skip_frame`` "NONREF"); after a run of packets not sent, the decoder
    is drained and flushed, as after a seek. Raises :class:`_PlanMismatch` where the decoder's
    frames are not ``plan.shown`` in order (a frame dropped, as a damaged stream's are)."""
    import av

    expected = collections.deque(plan.shown)  # presentation order, the order the decoder outputs

    def kept(frames: list[Any]) -> Iterator[tuple[int, Any]]:
        for frame in frames:
            _check_frame_size(frame.width, frame.height, limits)
            count()
            if frame.pts in plan.optional:
                continue
            if not expected or frame.pts != expected[0]:
                raise _PlanMismatch(f"the frame of pts {frame.pts} where the plan expects {list(expected)[:1]}")
            expected.popleft()
            if frame.pts in plan.sampled:
                yield plan.sampled[frame.pts], frame

    decoder = _decoder(demuxed.stream, threads)
    resume = False
    try:
        for packet, sent in zip(demuxed.packets, plan.sent, strict=True):
            if not sent:
                resume = True
                continue
            if resume:
                yield from kept(decoder.decode(None))
                decoder.flush_buffers()
                resume = False
            decoder.skip_frame = "DEFAULT" if packet.pts in plan.sampled else "NONREF"
            yield from kept(decoder.decode(packet))
        yield from kept(decoder.decode(None))
    except av.FFmpegError as exc:
        raise InvalidVideoError(f"cannot decode the video: {exc}") from None
    if expected:
        raise _PlanMismatch(f"{len(expected)} frames did not come out of the decoder")


class FrameProducer:
    """Decodes the video in a thread (by ``plan``, else every frame) and hands over the sampled
    frames (PyAV frames: the consumer converts them to RGB, so this thread goes on feeding the
    decoder) through a queue of ``depth`` frames (so at most a chunk's worth waits); iterate for
    ``(frame index, frame)``, read ``frames_in_stream`` after (the packet count when the
    plan held, else the frames decoded). A plan that does not hold before any frame is handed over
    gives way to decoding every frame; after, the video is refused as damaged. Leaving the
    ``with`` block stops the thread."""

    def __init__(  # noqa: PLR0917
        self,
        demuxed: Demuxed,
        threads: int,
        limits: VideoLimits,
        wanted: set[int],
        plan: DecodePlan | None,
        on_frame: Callable[[], None] | None,
        depth: int,
    ) -> None:
        self._args = (demuxed, threads, limits, wanted)
        self._plan, self._on_frame = plan, on_frame
        self._queue: queue.Queue[tuple[str, Any, Any]] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kimi-prep video decode", daemon=True)
        self.frames_in_stream = 0
        self._decoded = 0
        self._handed = 0

    def __enter__(self) -> FrameProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _put(self, item: tuple[str, Any, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _count(self) -> None:
        self._decoded += 1
        if self._on_frame is not None:
            self._on_frame()

    def _hand_over(self, frames: Iterator[tuple[int, Any]]) -> bool:
        """Each frame into the queue; False when stopped."""
        with contextlib.closing(frames):  # type: ignore[type-var]
            for index, frame in frames:
                if self._stop.is_set() or not self._put(("frame", index, frame)):
                    return False
                self._handed += 1
        return True

    def _run(self) -> None:
        demuxed, threads, limits, wanted = self._args
        try:
            if self._plan is not None:
                try:
                    if not self._hand_over(planned_frames(demuxed, threads, limits, self._plan, self._count)):
                        return
                    self.frames_in_stream = len(self._plan.sent)
                    self._put(("end", None, None))
                    return
                except _PlanMismatch as exc:
                    if self._handed:
                        raise InvalidVideoError(
                            f"the decoder's frames do not match the container's packets ({exc}): the video is "
                            f"damaged ({self._handed} frames were already sampled)"
                        ) from None
                    self._decoded = 0
            if not self._hand_over(every_frame(demuxed, threads, limits, wanted, self._count)):
                return
            self.frames_in_stream = self._decoded
            self._put(("end", None, None))
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(("error", exc, None))

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        while True:
            kind, first, second = self._queue.get()
            if kind == "error":
                raise first
            if kind == "end":
                return
            yield first, second
