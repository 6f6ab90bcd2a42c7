"""Video chunks and videos (spec section 8): FFmpeg frames through PyAV, the NaViT rule per chunk.

A **video chunk** is T >= 1 RGB frames, resized to the target of the first frame's size under the
per-frame budget (``in_patch_limit_each_frame``, shared with ``in_patch_limit_video / T``), padded,
normalised and patchified T-major: ``pixel_values[t*gh*gw + gy*gw + gx]``; ``grid_thw = (T, gh, gw)``
and the token count is per chunk, ``(gh / m) * (gw / m)`` (or ``fixed_output_tokens``).

A **video** is cut into chunks by the reference's sampling (:func:`sample_frame_indices`) over
the frames of its first video stream, decoded by :mod:`.video_decode` (only what the sampled
frames need, in threads, each sampled frame converted to RGB there as the reference converts
it); each is written into its chunk as it comes; a complete chunk is
yielded once its frames are written, seen as the next frames come in (and at the latest when the
next chunk is complete), so its writes and the next chunk's frames overlap; at most two chunks
are held.
``num_frames`` is by contract the count of frames decoded: when the decoder yields another count
than the packets, the indices are sampled again from the decoded count and a further pass decodes
them (exact), unless chunks have been yielded already; then :class:`InvalidVideoError` says so
(never chunks of a wrong sampling).
Every limit (:class:`VideoLimits`) is checked before the work it guards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

import numba
import numpy as np

from kimi_vision_common.errors import InvalidVideoError, PreprocessError, VideoTooLargeError
from kimi_vision_common.patches import normalize_table
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.results import VideoChunkResult
from kimi_vision_common.sizing import TargetSize, chunk_target, chunk_tokens

from .decode.decoder import ImageDecoder, default_decoder
from .limits import VideoLimits
from .numba_runtime import kernel_threads
from .patchify.normalize import empty_patches, patchify, write_patches
from .pipeline import PIXEL_OUTPUTS, PixelOutput, PreprocessResult, batch_workers, with_index
from .resize.resize import resize
from .video_decode import DecodePlan, Demuxed, FrameProducer, decode_plan, demux

# -- chunks ---------------------------------------------------------------------------------------


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
        self.write(frame, self.claim(frame))

    def claim(self, frame: Any) -> int:
        """The next frame's index ``t``; the first frame sets the target and the output array.
        Frames claimed can then be written in any order, from any thread (their rows are apart)."""
        if self.target is None:
            preset = self.preset
            self.target = chunk_target(int(frame.shape[1]), int(frame.shape[0]), self.frames, preset)
            dtype = np.float32 if self.output == "pixel_values" else np.uint8
            shape = (self.frames * self.target.num_patches, 3, preset.patch_size, preset.patch_size)
            self.pixels = empty_patches(frame, shape, dtype)
        self.written += 1
        return self.written - 1

    def write(self, frame: Any, t: int) -> None:
        """Resize, pad, (normalise) and patchify claimed frame ``t`` into its rows."""
        preset, target = self.preset, self.target
        assert target is not None
        rgb = resize(frame, target.new_width, target.new_height, "bicubic")
        rows = self.pixels[t * target.num_patches : (t + 1) * target.num_patches]  # written in place
        if self.output == "pixel_values":
            table = normalize_table(preset.image_mean, preset.image_std)
            write_patches(rgb, table, target.grid_h, target.grid_w, preset.patch_size, out=rows)
        else:
            patchify(rgb, target.grid_h, target.grid_w, preset.patch_size, out=rows)

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
    the iterator is consumed and stops when it is closed. ``threads``: FFmpeg threads of a planned
    decode of H.264, MPEG-4 or MPEG-2 (0: :func:`ffmpeg_threads`), shared out among the video's
    decoders (:func:`segment_decoders`; at least one each; HEVC, and a video decoded whole, get the
    reference's settings); ``on_frame`` is called once per decoded frame (e.g. a metric).
    """
    if output not in PIXEL_OUTPUTS:
        raise ValueError(f"output must be one of {PIXEL_OUTPUTS}, got {output!r}")
    preset = get_preset(preset)
    demuxed, indices = _sampling(data, preset, limits)
    # Each frame is written into its chunk as it comes, while the next ones decode: the frame
    # writers share half the numba threads (at least one each), FFmpeg's decoder threads the
    # cores that half leaves.
    frame_threads = max(1, numba.get_num_threads() // 2)
    threads = threads or ffmpeg_threads(frame_threads)
    workers = batch_workers()

    def new_chunk(frames: int) -> _FrameSink:
        return _FrameWriters(ChunkWriter(frames, preset, output), workers, max(1, frame_threads // workers))

    return _chunk_results(_stream(demuxed, preset, indices, limits, threads, on_frame, new_chunk))


def ffmpeg_threads(kernel_threads: int) -> int:
    """FFmpeg decoder threads beside ``kernel_threads`` threads writing sampled frames: the cores
    those leave, at least one. FFmpeg's own choice (a thread a core, plus one) oversubscribes the
    cores; on the 2-core host one decoder thread against its three took 0.82-0.98x the time on six
    of the seven clips of ``benchmarks/bench_media.py`` and 1.05x on the seventh (720p H.264;
    median of 9 paired runs, with two frame writers)."""
    return max(1, (os.cpu_count() or 1) - kernel_threads)


def segment_decoders() -> int:
    """Decoders that take a video's independent segments in turn (:class:`~.video_decode.FrameProducer`):
    two where there are two cores or more (a GOP's reference frames form one chain, which one
    decoder thread takes about as long to decode as FFmpeg's frame threads take for every frame;
    two chains decode at once), else one."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


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
    (:class:`ChunkWriter`); ``ready()``: every frame added is in (no wait)."""

    def add(self, frame: np.ndarray) -> None: ...

    def ready(self) -> bool: ...


class _FrameWriters:
    """A :class:`ChunkWriter` whose frames are written ``workers`` at a time (:func:`_frame_pool`),
    each on ``threads`` numba threads: frames at once rather than each frame's kernels on more
    threads, since beside the decoder's thread a parallel kernel waits for its slowest thread at
    every barrier. On the 2-core host two writers against one took 0.77x the time on the MPEG-4
    clip of ``benchmarks/bench_media.py`` and 0.87-0.97x on the others (median of 9 paired runs).
    ``result()`` waits for the chunk's writes and raises the first error."""

    def __init__(self, writer: ChunkWriter, workers: int, threads: int) -> None:
        self.writer, self.workers, self.threads = writer, workers, threads
        self.writes: list[Future[None]] = []

    def add(self, frame: np.ndarray) -> None:
        t = self.writer.claim(frame)
        self.writes.append(_frame_pool(self.workers).submit(self._write, frame, t))

    def _write(self, frame: np.ndarray, t: int) -> None:
        with kernel_threads(self.threads):
            self.writer.write(frame, t)

    def ready(self) -> bool:
        return all(write.done() for write in self.writes)

    def result(self) -> PreprocessResult:
        for write in self.writes:
            write.result()
        return self.writer.result()


@functools.lru_cache(maxsize=4)  # a few worker counts a process
def _frame_pool(workers: int) -> ThreadPoolExecutor:
    """The threads writing video frames, kept from call to call (their scratch arenas stay warm);
    apart from the batch pool, so a video inside a batch's item cannot wait on its own pool."""
    return ThreadPoolExecutor(workers, thread_name_prefix="kimi-prep-frames")


os.register_at_fork(after_in_child=_frame_pool.cache_clear)  # a forked child makes its own threads


class _FrameList(list):  # type: ignore[type-arg]
    """A chunk's frames kept as they come."""

    def add(self, frame: np.ndarray) -> None:
        self.append(frame)

    def ready(self) -> bool:
        return True


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


def _sampling(data: bytes, preset: Preset, limits: VideoLimits) -> tuple[Demuxed, list[int]]:
    """The first pass (the container left open for the second) and the sampled frame indices,
    within the limits."""
    demuxed = demux(data, limits)
    indices = sample_frame_indices(demuxed.info.packets, demuxed.info.fps, preset)
    if len(indices) > limits.max_sampled_frames:
        demuxed.container.close()
        raise VideoTooLargeError(f"{len(indices)} sampled frames exceed max_sampled_frames={limits.max_sampled_frames}")
    return demuxed, indices


def _stream(  # noqa: PLR0917
    demuxed: Demuxed,
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
    demuxed: Demuxed,
    preset: Preset,
    indices: list[int],
    plan: DecodePlan | None,
    *,
    limits: VideoLimits,
    threads: int,
    on_frame: Callable[[], None] | None,
    new_chunk: Callable[[int], _FrameSink],
) -> Generator[_Sampled, None, tuple[int, int]]:
    """Decode (in threads: FFmpeg and numba release the GIL, so frames are written while the next
    ones decode) by ``plan`` (None: every frame), hand each sampled frame to its chunk's sink
    (``new_chunk(frames)``) as it comes, yield each complete chunk once its sink is ready, and at
    the latest when the next one is complete (its consumer then waits for the writes while the
    next chunk's go on: 0.85-0.88x the time on the MPEG-4 clip of ``benchmarks/bench_media.py``,
    0.91-1.05x on the others, medians of 11 paired runs); the generator's value is ``(frames in
    the stream, chunks yielded)``. Frames come in presentation order, so chunks complete in order
    and one is open at a time."""
    chunks = chunked(indices, preset.temporal_merge_kernel_size)
    chunk_of = {index: number for number, chunk in enumerate(chunks) for index in chunk}
    depth = preset.temporal_merge_kernel_size
    frames = FrameProducer(demuxed, threads, limits, set(chunk_of), plan, on_frame, depth, segment_decoders())
    sink: _FrameSink | None = None
    waiting: _Sampled | None = None  # complete, its frames still being written
    filled, next_chunk = 0, 0
    with frames:
        try:
            for frame_index, rgb in frames:
                if chunk_of[frame_index] != next_chunk:
                    raise AssertionError(f"frame {frame_index} came before chunk {next_chunk} was complete")
                if sink is None:
                    sink = new_chunk(len(chunks[next_chunk]))
                sink.add(rgb)
                filled += 1
                if waiting is not None and waiting.frames.ready():
                    yield waiting
                    waiting = None
                if filled == len(chunks[next_chunk]):
                    if waiting is not None:
                        yield waiting  # its consumer waits for the writes; this chunk's go on meanwhile
                    indices_of_chunk = chunks[next_chunk]
                    timestamp = chunk_timestamp(indices_of_chunk[0], demuxed.info.fps, preset.timestamp_mode)
                    prompt = preset.video_prompt.format(timestamp=timestamp)
                    waiting = _Sampled(sink, indices_of_chunk, timestamp, prompt)
                    if sink.ready():
                        yield waiting
                        waiting = None
                    sink, filled, next_chunk = None, 0, next_chunk + 1
        except Exception:
            if waiting is not None:  # a complete chunk goes out before the error, as without the overlap
                yield waiting
            raise
    if waiting is not None:
        yield waiting
    return frames.frames_in_stream, next_chunk
