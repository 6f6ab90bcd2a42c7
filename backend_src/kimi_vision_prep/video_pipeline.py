"""Video chunks and videos (spec section 8): where the video stage meets resize and patchify.

A **video chunk** is T >= 1 RGB frames, resized to the target of the first frame's size under the
per-frame budget (``in_patch_limit_each_frame``, shared with ``in_patch_limit_video / T``), padded,
normalised and patchified T-major: ``pixel_values[t*gh*gw + gy*gw + gx]``; ``grid_thw = (T, gh, gw)``
and the token count is per chunk, ``(gh / m) * (gw / m)`` (or ``fixed_output_tokens``).

A **video** is cut into chunks by the reference's sampling
(:func:`~kimi_vision_prep.video.sampling.sample_frame_indices`) over the frames of its first video
stream, decoded by :mod:`kimi_vision_prep.video` (only what the sampled frames need, in threads,
each sampled frame converted to RGB there as the reference converts it); each is written into its
chunk as it comes; a complete chunk is yielded once its frames are written, seen as the next frames
come in (and at the latest when the next chunk is complete), so its writes and the next chunk's
frames overlap; at most two chunks are held. Every limit (:class:`VideoLimits`) is checked before
the work it guards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numba
import numpy as np

from kimi_vision_common.errors import InvalidVideoError, PreprocessError
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
from .video.sampling import FrameSink, Sampled, ffmpeg_threads, sampled_chunks

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


# -- videos ---------------------------------------------------------------------------------------


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
    decode of H.264, MPEG-4 or MPEG-2 (0: :func:`~.video.sampling.ffmpeg_threads`), shared out among the video's
    decoders (:func:`~.video.sampling.segment_decoders`; at least one each; HEVC, and a video decoded whole, get the
    reference's settings); ``on_frame`` is called once per decoded frame (e.g. a metric).
    """
    if output not in PIXEL_OUTPUTS:
        raise ValueError(f"output must be one of {PIXEL_OUTPUTS}, got {output!r}")
    preset = get_preset(preset)
    # Each frame is written into its chunk as it comes, while the next ones decode: the frame
    # writers share half the numba threads (at least one each), FFmpeg's decoder threads the
    # cores that half leaves.
    frame_threads = max(1, numba.get_num_threads() // 2)
    threads = threads or ffmpeg_threads(frame_threads)
    workers = batch_workers()

    def new_chunk(frames: int) -> FrameSink:
        return _FrameWriters(ChunkWriter(frames, preset, output), workers, max(1, frame_threads // workers))

    return _chunk_results(sampled_chunks(data, preset, limits, threads, on_frame, new_chunk))


def _chunk_results(chunks: Iterator[Sampled]) -> Iterator[VideoChunkResult]:
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
