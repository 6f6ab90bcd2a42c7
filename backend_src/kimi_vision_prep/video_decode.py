"""A video's frames through PyAV, decoding only what its sampled frames need.

The first pass (:func:`demux`) opens the container once and lists the first video stream's
packets (no decoding: each packet's pts, key flag and, from its bytes, whether its frame is a
reference and whether a fresh decoder may start there, :mod:`.frame_types`). The second pass
decodes those packets by a :func:`decode_plan`: a frame that is not sampled is skipped by the
decoder when nothing refers to it (``skip_frame`` "NONREF" for its packet), a run of whole GOPs
with no sampled frame is not sent to the decoder at all (drained and flushed before the next GOP,
as after a seek), and the packets sent are cut into segments that decoders of their own decode at
once. The plan applies where the frame count is the packet count: the packets' pts name each
frame once, in a codec whose decoder gives one frame a packet (:data:`PLANNED_CODECS`); the
decoders must then give exactly the frames the plan says (the references and the sampled frames,
in order, none flagged as damaged), else the video goes back to a full pass (:func:`every_frame`),
which checks the frames already handed over. :class:`FrameProducer` runs a pass in threads and
hands the sampled frames over bounded queues, in order.
"""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import math
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit
from PIL import Image

from kimi_vision_common.errors import InvalidVideoError, VideoTooLargeError

from .frame_types import READERS, fresh_entries, reference_reader
from .limits import VideoLimits
from .numba_runtime import load_word


@dataclass(frozen=True)
class VideoInfo:
    """The first video stream as the first pass found it: its packets in decode order (``pts``,
    None where the container gives none; key flags; whether each frame is a reference, None where
    :mod:`.frame_types` does not read the codec or the packet), ``average_rate``, frame size, codec;
    the key packets a fresh decoder may start at and the x264 build to tell it
    (:func:`~.frame_types.fresh_entries`)."""

    pts: tuple[int | None, ...]
    keyframes: tuple[bool, ...]
    references: tuple[bool | None, ...]
    fps: float
    width: int
    height: int
    codec: str
    fresh_entries: tuple[int, ...] = ()
    x264_build: int | None = None

    @property
    def packets(self) -> int:
        return len(self.pts)


# Decoders that give one frame a packet, honour ``skip_frame`` per packet (FFmpeg copies it to
# each frame thread as the packet is sent) and whose reference frames :mod:`.frame_types` reads.
PLANNED_CODECS = frozenset(READERS)
# Decoders whose pixels on a damaged stream depend on slice threads, with no error or damage flag
# to tell: HEVC's wavefront rows each start at their entry point under slice threads, where one
# thread reads on from wherever the row before ended. A planned pass of these keeps the
# reference's thread settings (PyAV's: slice threads, FFmpeg's count) instead of frame threads.
REFERENCE_THREADED_CODECS = frozenset({"hevc"})
# Decoders that flag no damaged frame (``frame.is_corrupt``) where they conceal one: a planned pass
# of these stops at the first error FFmpeg finds (``err_detect`` explode), so that the plan ends.
EXPLODING_CODECS = frozenset({"hevc"})


@dataclass(frozen=True)
class Segment:
    """Packets a decoder takes from a fresh start (or a flush): the ``runs`` of packets
    ``[first, end)`` sent, decode order, drained and flushed between runs (whole GOPs not sent lie
    between them); ``shown`` the pts it must output, in order; ``optional`` the leading frames of a
    GOP entered after a flush or at the segment's start, which refer to packets not sent (the
    decoder may drop or conceal them; none is sampled)."""

    runs: tuple[tuple[int, int], ...]
    shown: tuple[int, ...]
    optional: frozenset[int]


@dataclass(frozen=True)
class DecodePlan:
    """What the second pass decodes and what must come out of it: ``sampled`` maps each sampled
    frame's pts to its index; ``segments``, in decode order, each decodable by its own decoder
    (:attr:`VideoInfo.fresh_entries`), their frames in presentation order one after another;
    ``packets`` the stream's packet count."""

    sampled: dict[int, int]
    segments: tuple[Segment, ...]
    packets: int

    @property
    def sent(self) -> tuple[bool, ...]:
        """Whether each packet (decode order) goes to a decoder."""
        sent = [False] * self.packets
        for segment in self.segments:
            for first, end in segment.runs:
                sent[first:end] = [True] * (end - first)
        return tuple(sent)

    @property
    def shown(self) -> tuple[int, ...]:
        return tuple(pts for segment in self.segments for pts in segment.shown)

    @property
    def optional(self) -> frozenset[int]:
        return frozenset().union(*(segment.optional for segment in self.segments))


def decode_plan(info: VideoInfo, indices: Sequence[int]) -> DecodePlan | None:
    """The plan for the sampled frame ``indices``, or None (decode every frame) where a packet has
    no pts or shares one, a frame's reference flag is unknown, the first GOP has leading frames,
    or the codec is not in :data:`PLANNED_CODECS`.

    Frame ``i`` is the packet of the ``i``-th smallest pts (presentation order). The packets are
    cut into GOPs at key packets; a GOP with no sampled frame is not sent, except the GOP before one
    whose sampled frames include a leading frame (shown before its key frame: in an open GOP it
    refers to the GOP before). A new segment starts at each sent GOP whose key packet a fresh
    decoder may start at (:attr:`VideoInfo.fresh_entries`), whose leading frames are not sampled,
    and whose frames all show after every frame before it, in a stream whose frames are evenly
    spaced in time."""
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
    leading_sampled = [any(p in sampled and p < pts[a] for p in pts[a:b]) for a, b in gops]  # type: ignore[operator]
    for g in range(len(gops) - 1, 0, -1):
        if needed[g] and leading_sampled[g]:
            needed[g - 1] = True
    shows_after = _shows_after_all_before(pts, gops)  # type: ignore[arg-type]
    # A packet the demuxer lost (a damaged container) leaves a gap in time; a decoder that read on
    # across it may drop frames up to the next key frame that a fresh one shows: no cut then.
    entries = set(info.fresh_entries) if len({b - a for a, b in itertools.pairwise(order)}) <= 1 else set()
    segments: list[Segment] = []
    runs: list[tuple[int, int]] = []
    shown: list[int] = []
    optional: set[int] = set()
    for g, (a, b) in enumerate(gops):
        if not needed[g]:
            continue
        after_flush = g > 0 and not needed[g - 1]
        if runs and a in entries and not leading_sampled[g] and shows_after[g]:
            segments.append(Segment(tuple(runs), tuple(sorted(shown)), frozenset(optional)))
            runs, shown, optional = [], [], set()
        entered = g > 0 and (after_flush or not runs)
        for k in range(a, b):
            if entered and pts[k] < pts[a]:  # type: ignore[operator]
                optional.add(pts[k])  # type: ignore[arg-type]
            elif references[k] or pts[k] in sampled:
                shown.append(pts[k])  # type: ignore[arg-type]
        if runs and not after_flush:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    segments.append(Segment(tuple(runs), tuple(sorted(shown)), frozenset(optional)))
    return DecodePlan(sampled, tuple(segments), len(pts))


def _shows_after_all_before(pts: Sequence[int], gops: Sequence[tuple[int, int]]) -> list[bool]:
    """Per GOP: whether its frames but the leading ones show after every frame of the packets
    before it, and every frame after it after those (so segments cut there output in order)."""
    before: list[float] = []
    latest = -math.inf
    for a, b in gops:
        before.append(latest)
        latest = max(latest, *pts[a:b])
    after: list[float] = []
    earliest = math.inf
    for a, b in reversed(gops):
        after.append(earliest)
        earliest = min(earliest, *pts[a:b])
    after.reverse()
    return [before[g] < pts[a] and before[g] < after[g] for g, (a, _) in enumerate(gops)]


def _reject_images(data: bytes) -> None:
    """Pillow identifies it (except MPEG video, which its plugin reads as a still): an image."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            still = image.format != "MPEG"
    except Exception:  # not an image Pillow knows: maybe a video
        return
    if still:
        raise InvalidVideoError("an image, not a video: use the image models")


def _open(data: bytes, options: dict[str, str] | None = None) -> Any:
    import av

    try:
        return av.open(io.BytesIO(data), mode="r", options=options)
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise InvalidVideoError(f"not a decodable video ({len(data)} bytes, starts with {data[:8]!r}): {exc}") from None


def _video_stream(container: Any) -> Any:
    # FFmpeg's image demuxers (png_pipe, jpeg_pipe, image2, ...) read what Pillow would not open.
    if container.format.name.endswith("_pipe") or container.format.name == "image2":
        raise InvalidVideoError(f"an image ({container.format.name}), not a video: use the image models")
    if not container.streams.video:
        raise InvalidVideoError("no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:  # a codec id FFmpeg has no decoder for
        raise InvalidVideoError("the video stream's codec is not one FFmpeg decodes")
    return stream


def probe_video(data: bytes, limits: VideoLimits = VideoLimits()) -> VideoInfo:
    """First pass: validate the container and list the first video stream's packets."""
    demuxed = demux(data, limits)
    demuxed.container.close()
    return demuxed.info


@dataclass(frozen=True)
class Demuxed:
    """The first pass's container (open), its first video stream and that stream's packets in
    decode order: the second pass decodes these packets, no second demux (``data``: the encoded
    video, which a second decoder opens for its stream's parameters)."""

    info: VideoInfo
    container: Any
    stream: Any
    packets: list[Any]
    data: bytes


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
    codec, extradata = stream.codec_context.name, stream.codec_context.extradata
    read = reference_reader(codec, extradata)
    if read is None:
        references: tuple[bool | None, ...] = (None,) * len(packets)
        entries, x264_build = (), None
    else:  # each packet's bytes copied out as each reader comes to it: a 256 MiB video is not held twice
        references = tuple(read(bytes(packet)) for packet in packets)
        entries, x264_build = fresh_entries(codec, extradata, (bytes(packet) for packet in packets), keyframes)
    info = VideoInfo(pts, keyframes, references, float(rate), width, height, codec, entries, x264_build)
    return Demuxed(info, container, stream, packets, data)


def _check_frame_size(width: int, height: int, limits: VideoLimits) -> None:
    if width * height > limits.max_frame_pixels:
        raise VideoTooLargeError(
            f"frames of {width}x{height} = {width * height} pixels exceed max_frame_pixels={limits.max_frame_pixels}"
        )


def _decoder(stream: Any, threads: int | None, explode: bool = False) -> Any:
    """``stream``'s decoder, ready for a pass from a key packet: set before it opens to FFmpeg's
    threads (0: FFmpeg's count; None: PyAV's defaults, slice threads of FFmpeg's count, as the
    reference decodes: a damaged stream's error concealment differs with other thread settings)
    and, with ``explode``, to fail at the first error it finds; flushed after the segment its lane
    decoded before."""
    decoder = stream.codec_context
    if decoder.is_open:
        decoder.flush_buffers()
    else:
        if threads is not None:
            stream.thread_type = "AUTO"
            decoder.thread_count = threads
        if explode:
            decoder.options = {**decoder.options, "err_detect": "+explode"}
    decoder.skip_frame = "DEFAULT"
    return decoder


def every_frame(
    decoder: Any, demuxed: Demuxed, limits: VideoLimits, wanted: set[int], count: Callable[[], None]
) -> Iterator[tuple[int, Any]]:
    """``(index, frame)`` of each ``wanted`` frame, every frame decoded (``count()`` after each)."""
    import av

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


def segment_frames(  # noqa: PLR0917
    decoder: Any,
    packets: Sequence[Any],
    plan: DecodePlan,
    segment: Segment,
    limits: VideoLimits,
    count: Callable[[], None],
) -> Iterator[tuple[int, Any]]:
    """``(index, frame)`` of each sampled frame of ``segment`` in order, decoding only its runs (a
    frame not sampled with ``skip_frame`` "NONREF"), the decoder drained and flushed between runs,
    as after a seek. Raises :class:`_PlanMismatch` where the decoder's frames are not
    ``segment.shown`` in order (a frame dropped, as a damaged stream's are), where it flags one as
    damaged, and where it fails."""
    import av

    expected = collections.deque(segment.shown)  # presentation order, the order the decoder outputs

    def kept(frames: list[Any]) -> Iterator[tuple[int, Any]]:
        for frame in frames:
            _check_frame_size(frame.width, frame.height, limits)
            count()
            if frame.pts in segment.optional:
                continue
            if not expected or frame.pts != expected[0]:
                raise _PlanMismatch(f"the frame of pts {frame.pts} where the plan expects {list(expected)[:1]}")
            if frame.is_corrupt:
                raise _PlanMismatch(f"the decoder flags the frame of pts {frame.pts} as damaged")
            expected.popleft()
            if frame.pts in plan.sampled:
                yield plan.sampled[frame.pts], frame

    try:
        for number, (first, end) in enumerate(segment.runs):
            if number:
                yield from kept(decoder.decode(None))
                decoder.flush_buffers()
            for packet in packets[first:end]:
                decoder.skip_frame = "DEFAULT" if packet.pts in plan.sampled else "NONREF"
                yield from kept(decoder.decode(packet))
        yield from kept(decoder.decode(None))
    except av.FFmpegError as exc:  # the full pass decides: the reference's decoder may read on
        raise _PlanMismatch(f"the decoder failed: {exc}") from None
    if expected:
        raise _PlanMismatch(f"{len(expected)} frames did not come out of the decoder")


# A lane's decoder (a thread, an open of the video) pays for itself on this many packets and more:
# the 10 packets of the HEVC clip in benchmarks/bench_media.py took ~1.1x the time on two lanes.
PACKETS_A_LANE = 50

def plan_lanes(plan: DecodePlan, decoders: int) -> int:
    """The lanes ``plan``'s segments run on with up to ``decoders``: one a :data:`PACKETS_A_LANE`
    packets sent, at least one, at most one a segment."""
    return min(decoders, len(plan.segments), max(1, sum(plan.sent) // PACKETS_A_LANE))


# A lane's work: its segments in order, each (given the lane's stream) the frames to hand over.
_Job = Callable[[Any], Iterator[tuple[int, Any]]]
# What a lane hands over: ("frame", index, rgb), ("end", None, None) after each job,
# ("error", exception, None).
_Item = tuple[str, Any, Any]


class _RgbConverter:
    """A video's frames as RGB uint8 ``(H, W, 3)`` arrays, bit for bit what the reference's
    ``frame.to_ndarray(format="rgb24")`` gives, through one swscale context on the calling thread:
    ``to_ndarray`` sets up a context (and a swscale thread a core) for each frame anew, 0.6-1.1 ms
    a frame on this project's benchmark clips. swscale sets the context up again where a frame's
    size, pixel format or colour tags differ from the one before."""

    def __init__(self) -> None:
        from av.video.reformatter import VideoReformatter

        self._reformatter = VideoReformatter()

    def __call__(self, frame: Any) -> np.ndarray:
        return self._reformatter.reformat(frame, format="rgb24", threads=1).to_ndarray()


# The frame digest's primes (xxHash64's) and its key, random in each process: unlike a CRC's, a
# digest's value cannot be worked out ahead of time from the pixels a damaged stream decodes to.
_P1, _P2, _P3 = np.uint64(0x9E3779B185EBCA87), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
_DIGEST_KEY = np.uint64(int.from_bytes(os.urandom(8), "little"))


@njit(cache=True, nogil=True, inline="always")
def _mix(acc: np.uint64, word: np.uint64) -> np.uint64:
    """xxHash64's round: ``rotl(acc + word * P2, 31) * P1``, uint64 wrapping."""
    acc = acc + word * _P2
    return ((acc << np.uint64(31)) | (acc >> np.uint64(33))) * _P1


@njit(cache=True, nogil=True)
def _digest_rows(span: np.ndarray, rows: int, stride: int, length: int, key: np.uint64) -> np.uint64:
    """64-bit keyed digest of ``rows`` rows of ``length`` bytes, ``stride`` bytes apart in the uint8
    ``span``: four lanes of 8-byte words through :func:`_mix`, each row's last ``length % 32``
    bytes one at a time, then the shape and xxHash64's final avalanche."""
    a0, a1, a2, a3 = key + _P1 + _P2, key + _P2, key, key - _P1
    for r in range(rows):
        row = span[r * stride : r * stride + length]
        i = 0
        while i + 32 <= length:
            a0, a1 = _mix(a0, load_word(row, i)), _mix(a1, load_word(row, i + 8))
            a2, a3 = _mix(a2, load_word(row, i + 16)), _mix(a3, load_word(row, i + 24))
            i += 32
        while i < length:
            a0 = _mix(a0, np.uint64(row[i]) | np.uint64(256))
            i += 1
    h = a0 ^ _mix(np.uint64(1), a1) ^ _mix(np.uint64(2), a2) ^ _mix(np.uint64(3), a3)
    h ^= _mix(np.uint64(rows), np.uint64(length))
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    return h ^ (h >> np.uint64(32))


def frame_digest(rgb: np.ndarray) -> int:
    """A keyed 64-bit digest of an RGB uint8 ``(H, W, 3)`` frame's pixels (its rows may be padded):
    equal where two decodes gave the same frame. It runs on every sampled frame of a planned
    decode, so it is one pass of multiplies over 8-byte words rather than zlib's CRC-32, which
    takes 2.5 times as long. The kernel reads the rows where they lie, through one read-only
    uint8 span from the first row's start to the last row's end: one signature, padded or not."""
    if rgb.strides[1:] != (3, 1) or rgb.strides[0] < 3 * rgb.shape[1]:
        rgb = np.ascontiguousarray(rgb)
    height, length, stride = rgb.shape[0], 3 * rgb.shape[1], rgb.strides[0]
    span = np.lib.stride_tricks.as_strided(rgb, ((height - 1) * stride + length,), (1,), writeable=False)
    return int(_digest_rows(span, height, stride, length, _DIGEST_KEY))


class FrameProducer:
    """Decodes the video (by ``plan``, else every frame) in threads and hands over the sampled
    frames in order, each converted to RGB uint8 ``(H, W, 3)`` in its decoding thread before that
    decoder takes its next packet (:class:`_RgbConverter`, as the reference converts); iterate for
    ``(frame index, rgb)``, read ``frames_in_stream`` after (the packet count when the plan held,
    else the frames decoded).

    A video decoded whole gets the reference's thread settings (:func:`_decoder`). A plan's
    segments go to :func:`plan_lanes` lanes in turn, each a thread with its own decoder
    (``threads`` FFmpeg threads shared out among them; the first lane's decoder is the demuxed
    stream's, the others' a second open of the same bytes) and its own queue of ``depth`` frames,
    so a lane runs at most that far ahead of the segment being handed over. A plan that does not
    hold gives way to decoding every frame on one decoder, from the start; frames it handed over
    already are not handed again but checked (the :func:`frame_digest` of their RGB, taken as they
    went out): where one differs the video is refused as damaged. Leaving the ``with`` block stops
    the threads."""

    def __init__(  # noqa: PLR0917
        self,
        demuxed: Demuxed,
        threads: int,
        limits: VideoLimits,
        wanted: set[int],
        plan: DecodePlan | None,
        on_frame: Callable[[], None] | None,
        depth: int,
        decoders: int = 1,
    ) -> None:
        self._demuxed, self._threads, self._limits, self._wanted = demuxed, threads, limits, wanted
        self._plan, self._on_frame, self._depth, self._decoders = plan, on_frame, max(depth, 1), max(decoders, 1)
        self._stop = threading.Event()
        self._lanes: list[tuple[threading.Thread, queue.Queue[_Item]]] = []
        self._containers: list[Any] = []  # opens of the video beside the demuxed one (:meth:`_stream`)
        self._count_lock = threading.Lock()
        self.frames_in_stream = 0
        self._decoded = 0
        self._handed: dict[int, int] = {}  # frames a plan handed over: index -> digest of the RGB

    def __enter__(self) -> FrameProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt()
        for container in self._containers:
            container.close()

    def _halt(self) -> None:
        self._stop.set()
        for thread, _ in self._lanes:
            thread.join()
        self._lanes = []
        self._stop = threading.Event()

    def _count(self) -> None:
        with self._count_lock:  # lanes decode at once
            self._decoded += 1
            if self._on_frame is not None:
                self._on_frame()

    def _stream(self, lane: int) -> Any:
        """The stream whose decoder ``lane`` uses: the demuxed one for the first pass that decodes;
        for a later pass (a full one after a plan that did not hold, or one sampled again from the
        decoded frame count), the same stream of a new open (a flushed decoder keeps state of the
        pass before that a full decode's has not: a damaged stream's pixels differed). Another lane's:
        the same stream of a second open whose probe decodes nothing (FFmpeg's probe decodes an
        H.264 stream's first frames: 25-45 ms at 720p-1080p on the 2-core host), given the two
        values that probe finds from the first open (the pixel format and the reorder depth a
        decoder starts with), and told the x264 build the stream's first packet names (it starts
        past that packet)."""
        if lane == 0 and not self._demuxed.stream.codec_context.is_open:
            return self._demuxed.stream
        if lane == 0:
            container = _open(self._demuxed.data)
            self._containers.append(container)
            return _video_stream(container)
        container = _open(self._demuxed.data, {"skip_frame": "all"})
        self._containers.append(container)
        stream = _video_stream(container)
        probed, decoder = self._demuxed.stream.codec_context, stream.codec_context
        decoder.reorder_depth, decoder.pix_fmt = probed.reorder_depth, probed.pix_fmt
        if self._demuxed.info.x264_build is not None:
            decoder.options = {**decoder.options, "x264_build": str(self._demuxed.info.x264_build)}
        if probed.sample_aspect_ratio is not None:
            decoder.sample_aspect_ratio = probed.sample_aspect_ratio
        return stream

    def _run(self, lane: int, jobs: list[_Job], out: queue.Queue[_Item], stop: threading.Event) -> None:
        def put(item: _Item) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            stream = self._stream(lane)
            to_rgb = _RgbConverter()
            for job in jobs:
                with contextlib.closing(job(stream)) as frames:  # type: ignore[type-var]
                    for index, frame in frames:
                        # Converted before the decoder takes its next packet, and the frame let go,
                        # as in the reference's loop: a damaged H.264 stream's decoder fills missing
                        # pictures from buffers of its pool, so which frames are still held decides
                        # the pixels of later ones.
                        rgb = to_rgb(frame)
                        del frame
                        if not put(("frame", index, rgb)):
                            return
                if not put(("end", None, None)):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            put(("error", exc, None))

    def _hand_over(
        self, jobs: list[_Job], lanes: int, handed: Mapping[int, int] | None = None
    ) -> Iterator[tuple[int, Any]]:
        """Run ``jobs`` (in order) on ``lanes`` lanes, job ``i`` on lane ``i % lanes``, and yield
        their frames in job order, but for those ``handed`` over before (index -> digest):
        checked against it instead. A plan's frames (``handed`` None) are recorded with their
        digest as they go out, here, off the decoders' threads."""
        planned, handed = handed is None, handed or {}
        for lane in range(lanes):
            out: queue.Queue[_Item] = queue.Queue(maxsize=self._depth)
            thread = threading.Thread(
                target=self._run,
                args=(lane, jobs[lane::lanes], out, self._stop),
                name="kimi-prep video decode",
                daemon=True,
            )
            self._lanes.append((thread, out))
            thread.start()
        for number in range(len(jobs)):
            _, out = self._lanes[number % lanes]
            while True:
                kind, first, second = out.get()
                if kind == "error":
                    raise first
                if kind == "end":
                    break
                rgb = second
                if first in handed:
                    if frame_digest(rgb) != handed[first]:
                        raise InvalidVideoError(
                            f"the video is damaged: decoded whole, frame {first} differs from the one already "
                            f"sampled ({len(handed)} frames were)"
                        )
                    continue
                if planned:
                    self._handed[first] = frame_digest(rgb)
                yield first, rgb

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        demuxed, limits = self._demuxed, self._limits
        plan = self._plan
        if plan is not None:
            lanes = plan_lanes(plan, self._decoders)
            threads: int | None = max(1, self._threads // lanes) if self._threads else 0
            if demuxed.info.codec in REFERENCE_THREADED_CODECS:
                threads = None
            explode = demuxed.info.codec in EXPLODING_CODECS

            def job(segment: Segment) -> _Job:
                return lambda stream: segment_frames(
                    _decoder(stream, threads, explode), demuxed.packets, plan, segment, limits, self._count
                )

            try:
                yield from self._hand_over([job(segment) for segment in plan.segments], lanes)
                self.frames_in_stream = plan.packets
                return
            except _PlanMismatch:
                self._halt()
                self._decoded = 0
        yield from self._hand_over(
            [lambda stream: every_frame(_decoder(stream, None), demuxed, limits, self._wanted, self._count)],
            lanes=1,
            handed=dict(self._handed),
        )
        self.frames_in_stream = self._decoded
