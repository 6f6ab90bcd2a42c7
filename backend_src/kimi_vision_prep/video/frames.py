"""A video's frames through PyAV, decoding what the plan (:mod:`.plan`) says of the demuxed packets
(:mod:`.demux`). The decoders must give exactly the frames the plan says (the references and the
sampled frames, in order, none flagged as damaged), else the video goes back to a full pass
(:func:`every_frame`), which checks the frames already handed over (:func:`~.digest.frame_digest`).
:class:`FrameProducer` runs a pass in threads and hands the sampled frames over bounded queues, in
order.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kimi_vision_common.errors import InvalidVideoError

from ..limits import VideoLimits
from .demux import Demuxed, check_frame_size, open_video, video_stream
from .digest import frame_digest
from .plan import EXPLODING_CODECS, REFERENCE_THREADED_CODECS, DecodePlan, Segment, plan_lanes


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
                check_frame_size(frame.width, frame.height, limits)
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
            check_frame_size(frame.width, frame.height, limits)
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
            container = open_video(self._demuxed.data)
            self._containers.append(container)
            return video_stream(container)
        container = open_video(self._demuxed.data, {"skip_frame": "all"})
        self._containers.append(container)
        stream = video_stream(container)
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
