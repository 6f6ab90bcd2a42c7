"""Video chunks and videos (spec section 8): FFmpeg frames through PyAV, the NaViT rule per chunk.

A **video chunk** is T >= 1 RGB frames, resized to the target of the first frame's size under the
per-frame budget (``in_patch_limit_each_frame``, shared with ``in_patch_limit_video / T``), padded,
normalised and patchified T-major: ``pixel_values[t*gh*gw + gy*gw + gx]``; ``grid_thw = (T, gh, gw)``
and the token count is per chunk, ``(gh / m) * (gw / m)`` (or ``fixed_output_tokens``).

A **video** is decoded in two passes over the encoded bytes: the first demuxes the first video
stream and lists its packets (cheap: no decoding; each packet's pts and key flag) to sample ``n``
frame indices with the reference's formula, the second decodes with FFmpeg's threads only what the
sampled frames need (:func:`decode_plan`): a frame that is not sampled is skipped by the decoder
when nothing refers to it (``skip_frame`` "NONREF" for its packet), and a run of whole GOPs with no
sampled frame is not sent to the decoder at all. Only the sampled frames are converted to RGB
(``frame.to_ndarray(format="rgb24")``: stored size, no rotation), and one chunk is yielded as soon as
its frames are in, holding one chunk at a time. ``num_frames`` is by contract the count of frames
decoded. Where the packets' pts name each frame once, in a codec whose decoder gives one frame a
packet (:data:`PLANNED_CODECS`), that count is the packet count and the plan maps each sampled
index to its packet; a sampled frame that does not come out of the decoder where the plan expects
it puts the video back on the full pass. The full pass decodes every frame: when the decoder
yields another count than the packets, the indices are sampled again from the decoded count and a
further pass decodes them (exact), unless chunks have been yielded already; then
:class:`InvalidVideoError` says so (never chunks of a wrong sampling).
Every limit (:class:`VideoLimits`) is checked before the work it guards.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import queue
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

import numba
import numpy as np
from PIL import Image

from kimi_vision_common.errors import InvalidVideoError, PreprocessError, VideoTooLargeError
from kimi_vision_common.patches import normalize_table
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.results import VideoChunkResult
from kimi_vision_common.sizing import TargetSize, navit_target_size

from .decode import ImageDecoder, default_decoder
from .frame_types import READERS, reference_reader
from .limits import VideoLimits
from .normalize import empty_patches, patchify, write_patches
from .numba_runtime import kernel_threads
from .pipeline import PIXEL_OUTPUTS, PixelOutput, PreprocessResult, with_index
from .resize import resize

# -- chunks ---------------------------------------------------------------------------------------


def chunk_target(width: int, height: int, frames: int, preset: Preset) -> TargetSize:
    """The NaViT target of a ``frames``-frame chunk whose first frame is ``width x height``."""
    limit = preset.in_patch_limit if preset.in_patch_limit_each_frame is None else preset.in_patch_limit_each_frame
    if preset.in_patch_limit_video is not None:
        limit = min(round(preset.in_patch_limit_video / frames), limit)
    return navit_target_size(width, height, preset, in_patch_limit=limit)


def chunk_tokens(target: TargetSize, preset: Preset) -> int:
    """Tokens of a chunk: ``(gh / m) * (gw / m)`` whatever T, or ``fixed_output_tokens``."""
    return target.num_tokens if preset.fixed_output_tokens is None else preset.fixed_output_tokens


def preprocess_frames(
    frames: Sequence[Any], preset: str | Preset, output: PixelOutput = "pixel_values"
) -> PreprocessResult:
    """RGB uint8 ``(H, W, 3)`` frames (numpy, or torch on any device) -> one chunk's
    :class:`PreprocessResult` (``grid_thw = (T, gh, gw)``, T-major patches)."""
    if output not in PIXEL_OUTPUTS:
        raise ValueError(f"output must be one of {PIXEL_OUTPUTS}, got {output!r}")
    if not frames:
        raise InvalidVideoError("a video chunk needs at least one frame")
    chunk = ChunkWriter(len(frames), get_preset(preset), output)
    for frame in frames:
        chunk.add(frame)
    return chunk.result()


class ChunkWriter:
    """One chunk of ``frames`` frames written a frame at a time, as each comes: the target is the
    first frame's (:func:`chunk_target`), frame ``t``'s patches are rows ``t*gh*gw`` on."""

    def __init__(self, frames: int, preset: Preset, output: PixelOutput) -> None:
        self.frames, self.preset, self.output = frames, preset, output
        self.target: TargetSize | None = None
        self.pixels: Any = None
        self.written = 0

    def add(self, frame: Any) -> None:
        """Resize, pad, (normalise) and patchify the next RGB uint8 ``(H, W, 3)`` frame."""
        preset, t = self.preset, self.written
        if self.target is None:
            self.target = chunk_target(int(frame.shape[1]), int(frame.shape[0]), self.frames, preset)
            dtype = np.float32 if self.output == "pixel_values" else np.uint8
            shape = (self.frames * self.target.num_patches, 3, preset.patch_size, preset.patch_size)
            self.pixels = empty_patches(frame, shape, dtype)
        target = self.target
        rgb = resize(frame, target.new_width, target.new_height, "bicubic")
        rows = self.pixels[t * target.num_patches : (t + 1) * target.num_patches]  # written in place
        if self.output == "pixel_values":
            table = normalize_table(preset.image_mean, preset.image_std)
            write_patches(rgb, table, target.grid_h, target.grid_w, preset.patch_size, out=rows)
        else:
            patchify(rgb, target.grid_h, target.grid_w, preset.patch_size, out=rows)
        self.written += 1

    def result(self) -> PreprocessResult:
        assert self.target is not None and self.written == self.frames
        return PreprocessResult(
            pixel_values=self.pixels if self.output == "pixel_values" else None,
            grid_thw=np.array([self.frames, self.target.grid_h, self.target.grid_w], dtype=np.int64),
            num_tokens=chunk_tokens(self.target, self.preset),
            decode_path="video",
            fallback_reason=None,
            target=self.target,
            pixel_patches=self.pixels if self.output == "pixel_patches" else None,
        )


@functools.lru_cache(maxsize=16)
def rgb_preset(preset: Preset) -> Preset:
    """``preset`` with K2.5's colour rule: frames are opened with ``convert("RGB")`` under every preset."""
    return dataclasses.replace(preset, transparency="convert_rgb")


def preprocess_video_chunk(
    frames: Sequence[bytes],
    preset: str | Preset = "kimi-k2.5",
    *,
    decoder: ImageDecoder | None = None,
    output: PixelOutput = "pixel_values",
) -> PreprocessResult:
    """A chunk of encoded frames (JPEG, PNG, ...) -> :class:`PreprocessResult` with ``grid_thw =
    (T, gh, gw)``. Frames are decoded like ``Image.open(...).convert("RGB")`` under every preset
    (routed decode, Pillow's verdict); a bad frame raises its typed error with its index."""
    preset = get_preset(preset)
    decoded = (decoder or default_decoder()).decode_batch(frames, rgb_preset(preset))
    pixels = []
    for index, item in enumerate(decoded):
        if isinstance(item, PreprocessError):
            raise with_index(item, "frame", index)
        pixels.append(item.pixels)
    return preprocess_frames(pixels, preset, output)


# -- sampling and timestamps ----------------------------------------------------------------------


def sample_frame_indices(num_frames: int, fps: float, preset: Preset) -> list[int]:
    """The reference's sampling: ``n = max(round(num_frames * min(sample_fps, fps) / fps), 1)``, capped
    by ``max_num_frames_each_video``, then ``linspace(0, num_frames - 1, n).round()``."""
    sample_fps = min(preset.sample_fps, fps)
    n = max(round(num_frames * sample_fps / fps), 1)
    if preset.max_num_frames_each_video is not None:
        n = min(n, preset.max_num_frames_each_video)
    return [int(i) for i in np.linspace(0, num_frames - 1, n).round().astype(int)]


def chunk_timestamp(first_index: int, fps: float, mode: str) -> str:
    """``first_index / fps`` seconds as the prompt writes it; milliseconds truncate (spec section 8)."""
    t = first_index / fps
    clock = datetime.fromtimestamp(t, tz=timezone.utc)
    millis = f".{int((t % 1) * 1000):03d}"
    if mode == "hh:mm:ss.fff":
        return clock.strftime("%H:%M:%S") + millis
    if mode == "mm:ss.fff":
        return clock.strftime("%M:%S") + millis
    return clock.strftime("%M:%S")


def chunked(indices: Sequence[int], size: int) -> list[tuple[int, ...]]:
    return [tuple(indices[i : i + size]) for i in range(0, len(indices), size)]


# -- containers -----------------------------------------------------------------------------------


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
    demuxed = _demux(data, limits)
    demuxed.container.close()
    return demuxed.info


@dataclass(frozen=True)
class _Demuxed:
    """The first pass's container (open), its first video stream and that stream's packets in
    decode order: the second pass decodes these packets, no second open or demux."""

    info: VideoInfo
    container: Any
    stream: Any
    packets: list[Any]


def _demux(data: bytes, limits: VideoLimits) -> _Demuxed:
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
    read = reference_reader(stream.codec_context.name, stream.codec_context.extradata)
    references = tuple(None if read is None else read(bytes(packet)) for packet in packets)
    info = VideoInfo(pts, keyframes, references, float(rate), width, height, stream.codec_context.name)
    return _Demuxed(info, container, stream, packets)


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


def _every_frame(
    demuxed: _Demuxed, threads: int, limits: VideoLimits, wanted: set[int], count: Callable[[], None]
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
    """The decoder did not give a sampled frame where the plan expects it."""


def _planned_frames(
    demuxed: _Demuxed, threads: int, limits: VideoLimits, plan: DecodePlan, count: Callable[[], None]
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


def preprocess_video(
    data: bytes,
    preset: str | Preset = "kimi-k2.5",
    *,
    output: PixelOutput = "pixel_values",
    limits: VideoLimits = VideoLimits(),
    threads: int = 0,
    on_frame: Callable[[], None] | None = None,
) -> Iterator[VideoChunkResult]:
    """An encoded video -> its chunks, one :class:`VideoChunkResult` at a time as each is ready.

    The container is validated and its frames counted here (errors raise now); decoding happens as
    the iterator is consumed and stops when it is closed. ``threads``: FFmpeg decoder threads (0:
    its default); ``on_frame`` is called once per decoded frame (e.g. a metric).
    """
    if output not in PIXEL_OUTPUTS:
        raise ValueError(f"output must be one of {PIXEL_OUTPUTS}, got {output!r}")
    preset = get_preset(preset)
    demuxed, indices = _sampling(data, preset, limits)
    # Each frame is written into its chunk as it comes, while the next ones decode: its kernels
    # take half the numba threads, FFmpeg's decoder threads the other half of the cores.
    threads_per_frame = max(1, numba.get_num_threads() // 2)

    def new_chunk(frames: int) -> _FrameSink:
        return _KernelThreads(ChunkWriter(frames, preset, output), threads_per_frame)

    return _chunk_results(_stream(demuxed, preset, indices, limits, threads, on_frame, new_chunk))


def _chunk_results(chunks: Iterator[_Sampled]) -> Iterator[VideoChunkResult]:
    """Each chunk's result as it completes; closing this stops the decoding."""
    with contextlib.closing(chunks):  # type: ignore[type-var]
        for chunk in chunks:
            result = chunk.frames.result()
            yield VideoChunkResult(
                pixel_values=result.pixel_values,
                grid_thw=result.grid_thw,
                num_tokens=result.num_tokens,
                prompt=chunk.prompt,
                timestamp=chunk.timestamp,
                frame_indices=chunk.frame_indices,
                pixel_patches=result.pixel_patches,
            )


class _FrameSink(Protocol):
    """Where a chunk's frames go as they come: kept (:func:`sample_video`) or written
    (:class:`ChunkWriter`)."""

    def add(self, frame: np.ndarray) -> None: ...


@dataclass(frozen=True)
class _KernelThreads:
    """A :class:`ChunkWriter` whose frames are written with ``threads`` numba threads."""

    writer: ChunkWriter
    threads: int

    def add(self, frame: np.ndarray) -> None:
        with kernel_threads(self.threads):
            self.writer.add(frame)

    def result(self) -> PreprocessResult:
        return self.writer.result()


class _FrameList(list):  # type: ignore[type-arg]
    """A chunk's frames kept as they come."""

    def add(self, frame: np.ndarray) -> None:
        self.append(frame)


@dataclass(frozen=True)
class _Sampled:
    """A complete chunk: its frames' sink, their indices, its timestamp and prompt."""

    frames: Any
    frame_indices: tuple[int, ...]
    timestamp: str
    prompt: str


@dataclass(frozen=True)
class SampledChunk:
    """One chunk of a video as sampled, before preprocessing: its RGB uint8 ``(H, W, 3)`` frames
    (stored size), their indices in the stream, and the chunk's timestamp and prompt."""

    frames: list[np.ndarray]
    frame_indices: tuple[int, ...]
    timestamp: str
    prompt: str


def sample_video(
    data: bytes, preset: str | Preset = "kimi-k2.5", *, limits: VideoLimits = VideoLimits(), threads: int = 0
) -> Iterator[SampledChunk]:
    """An encoded video -> its chunks' sampled frames, one :class:`SampledChunk` at a time (what
    the checkpoint processor's ``split_video_chunks`` returns, as arrays); the same sampling,
    checks and errors as :func:`preprocess_video`."""
    preset = get_preset(preset)
    demuxed, indices = _sampling(data, preset, limits)
    chunks = _stream(demuxed, preset, indices, limits, threads, None, lambda _: _FrameList())
    return (SampledChunk(list(c.frames), c.frame_indices, c.timestamp, c.prompt) for c in chunks)


def _sampling(data: bytes, preset: Preset, limits: VideoLimits) -> tuple[_Demuxed, list[int]]:
    """The first pass (the container left open for the second) and the sampled frame indices,
    within the limits."""
    demuxed = _demux(data, limits)
    indices = sample_frame_indices(demuxed.info.packets, demuxed.info.fps, preset)
    if len(indices) > limits.max_sampled_frames:
        demuxed.container.close()
        raise VideoTooLargeError(f"{len(indices)} sampled frames exceed max_sampled_frames={limits.max_sampled_frames}")
    return demuxed, indices


def _stream(  # noqa: PLR0917
    demuxed: _Demuxed,
    preset: Preset,
    indices: list[int],
    limits: VideoLimits,
    threads: int,
    on_frame: Callable[[], None] | None,
    new_chunk: Callable[[int], _FrameSink],
) -> Iterator[_Sampled]:
    info = demuxed.info
    decode = functools.partial(
        _sampled_chunks, demuxed, preset, limits=limits, threads=threads, on_frame=on_frame, new_chunk=new_chunk
    )
    with contextlib.closing(demuxed.container):
        expected = info.packets
        decoded, sent = yield from decode(indices, decode_plan(info, indices))
        if decoded not in (0, expected) and sent == 0:
            # The decoder disagreed with the demuxer before any chunk went out: sample from its count.
            expected = decoded
            decoded, sent = yield from decode(sample_frame_indices(decoded, info.fps, preset), None)
    if decoded == 0:
        raise InvalidVideoError("no frame of the video stream could be decoded")
    if decoded != expected:
        raise InvalidVideoError(
            f"the decoder produced {decoded} frames where the container holds {expected}: the video is damaged "
            f"({sent} chunks were already sampled for {expected} frames)"
        )


def _sampled_chunks(
    demuxed: _Demuxed,
    preset: Preset,
    indices: list[int],
    plan: DecodePlan | None,
    *,
    limits: VideoLimits,
    threads: int,
    on_frame: Callable[[], None] | None,
    new_chunk: Callable[[int], _FrameSink],
) -> Generator[_Sampled, None, tuple[int, int]]:
    """Decode (in a thread: FFmpeg and numba release the GIL, so frames are written while the next
    ones decode) by ``plan`` (None: every frame), hand each sampled frame to its chunk's sink
    (``new_chunk(frames)``) as it comes, yield each chunk when complete; the generator's value is
    ``(frames in the stream, chunks yielded)``. Frames come in presentation order, so chunks
    complete in order and one is open at a time."""
    chunks = chunked(indices, preset.temporal_merge_kernel_size)
    chunk_of = {index: number for number, chunk in enumerate(chunks) for index in chunk}
    frames = _FrameProducer(demuxed, threads, limits, set(chunk_of), plan, on_frame, preset.temporal_merge_kernel_size)
    sink: _FrameSink | None = None
    filled, next_chunk = 0, 0
    with frames:
        for frame_index, frame in frames:
            if chunk_of[frame_index] != next_chunk:
                raise AssertionError(f"frame {frame_index} came before chunk {next_chunk} was complete")
            if sink is None:
                sink = new_chunk(len(chunks[next_chunk]))
            sink.add(frame.to_ndarray(format="rgb24"))  # here, so the decode thread goes on feeding
            filled += 1
            if filled == len(chunks[next_chunk]):
                indices_of_chunk = chunks[next_chunk]
                timestamp = chunk_timestamp(indices_of_chunk[0], demuxed.info.fps, preset.timestamp_mode)
                prompt = preset.video_prompt.format(timestamp=timestamp)
                yield _Sampled(sink, indices_of_chunk, timestamp, prompt)
                sink, filled, next_chunk = None, 0, next_chunk + 1
    return frames.frames_in_stream, next_chunk


class _FrameProducer:
    """Decodes the video in a thread (by ``plan``, else every frame) and hands over the sampled
    frames (PyAV frames: the consumer converts them to RGB, so this thread goes on feeding the
    decoder) through a queue of ``depth`` frames (so at most a chunk's worth waits); iterate for
    ``(frame index, frame)``, read ``frames_in_stream`` after (the packet count when the
    plan held, else the frames decoded). A plan that does not hold before any frame is handed over
    gives way to decoding every frame; after, the video is refused as damaged. Leaving the
    ``with`` block stops the thread."""

    def __init__(  # noqa: PLR0917
        self,
        demuxed: _Demuxed,
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

    def __enter__(self) -> _FrameProducer:
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
                    if not self._hand_over(_planned_frames(demuxed, threads, limits, self._plan, self._count)):
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
            if not self._hand_over(_every_frame(demuxed, threads, limits, wanted, self._count)):
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
