"""A video's sampled chunks as they come: the reference's sampling (:func:`sample_frame_indices`)
over the frames of the first video stream, which flow once through the stages of this folder:
:func:`~.demux.demux` (the packets), :func:`~.plan.decode_plan` (what to decode), then
:class:`~.frames.FrameProducer` (the sampled frames, RGB, in order), each frame handed to its
chunk's sink as it comes (:func:`sampled_chunks`). ``num_frames`` is by contract the count of
frames decoded: when the decoder yields another count than the packets, the indices are sampled
again from the decoded count and a further pass decodes them (exact), unless chunks have been
yielded already; then :class:`InvalidVideoError` says so (never chunks of a wrong sampling).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

import numpy as np

from kimi_vision_common.errors import InvalidVideoError, VideoTooLargeError
from kimi_vision_common.presets import Preset, get_preset

from ..limits import VideoLimits
from .demux import Demuxed, demux
from .frames import FrameProducer
from .plan import DecodePlan, decode_plan


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


def ffmpeg_threads(kernel_threads: int) -> int:
    """FFmpeg decoder threads beside ``kernel_threads`` threads writing sampled frames: the cores
    those leave, at least one. FFmpeg's own choice (a thread a core, plus one) oversubscribes the
    cores; on the 2-core host one decoder thread against its three took 0.82-0.98x the time on six
    of the seven clips of ``benchmarks/bench_media.py`` and 1.05x on the seventh (720p H.264;
    median of 9 paired runs, with two frame writers)."""
    return max(1, (os.cpu_count() or 1) - kernel_threads)


def segment_decoders() -> int:
    """Decoders that take a video's independent segments in turn (:class:`~.frames.FrameProducer`):
    two where there are two cores or more (a GOP's reference frames form one chain, which one
    decoder thread takes about as long to decode as FFmpeg's frame threads take for every frame;
    two chains decode at once), else one."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


class FrameSink(Protocol):
    """Where a chunk's frames go as they come: kept (:func:`sample_video`) or written
    (:class:`~kimi_vision_prep.video_pipeline.ChunkWriter`); ``ready()``: every frame added is in (no wait)."""

    def add(self, frame: np.ndarray) -> None: ...

    def ready(self) -> bool: ...


class _FrameList(list):  # type: ignore[type-arg]
    """A chunk's frames kept as they come."""

    def add(self, frame: np.ndarray) -> None:
        self.append(frame)

    def ready(self) -> bool:
        return True


@dataclass(frozen=True)
class Sampled:
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
    checks and errors as :func:`~kimi_vision_prep.video_pipeline.preprocess_video`."""
    chunks = sampled_chunks(data, get_preset(preset), limits, threads, None, lambda _: _FrameList())
    return (SampledChunk(list(c.frames), c.frame_indices, c.timestamp, c.prompt) for c in chunks)


def sampled_chunks(  # noqa: PLR0917
    data: bytes,
    preset: Preset,
    limits: VideoLimits,
    threads: int,
    on_frame: Callable[[], None] | None,
    new_chunk: Callable[[int], FrameSink],
) -> Iterator[Sampled]:
    """The complete chunks of the encoded video ``data``, each once its sink (``new_chunk(frames)``)
    is ready: the container is demuxed and the sampling checked now (errors raise here); the
    frames decode, demux -> plan -> frames, as the iterator is consumed, and stop when it is
    closed."""
    demuxed, indices = _sampling(data, preset, limits)
    return _stream(demuxed, preset, indices, limits, threads, on_frame, new_chunk)


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
    new_chunk: Callable[[int], FrameSink],
) -> Iterator[Sampled]:
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
    new_chunk: Callable[[int], FrameSink],
) -> Generator[Sampled, None, tuple[int, int]]:
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
    sink: FrameSink | None = None
    waiting: Sampled | None = None  # complete, its frames still being written
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
                    waiting = Sampled(sink, indices_of_chunk, timestamp, prompt)
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
