"""Video chunks and videos (spec section 8): FFmpeg frames through PyAV, the NaViT rule per chunk.

A **video chunk** is T >= 1 RGB frames, resized to the target of the first frame's size under the
per-frame budget (``in_patch_limit_each_frame``, shared with ``in_patch_limit_video / T``), padded,
normalised and patchified T-major: ``pixel_values[t*gh*gw + gy*gw + gx]``; ``grid_thw = (T, gh, gw)``
and the token count is per chunk, ``(gh / m) * (gw / m)`` (or ``fixed_output_tokens``).

A **video** is decoded in two passes over the encoded bytes: the first demuxes the first video
stream and counts its packets (cheap: no decoding) to sample ``n`` frame indices with the
reference's formula, the second decodes with FFmpeg's threads, converts only the sampled frames to
RGB (``frame.to_ndarray(format="rgb24")``: stored size, no rotation) and yields one chunk as soon
as its frames are in, holding one chunk at a time. ``num_frames`` is by contract the count of
frames decoded: when the decoder yields another count than the packets, the indices are sampled
again from the decoded count and a further pass decodes them (exact), unless chunks have been
yielded already; then :class:`InvalidVideoError` says so (never chunks of a wrong sampling).
Every limit (:class:`VideoLimits`) is checked before the work it guards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import queue
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_common.errors import InvalidVideoError, PreprocessError, VideoTooLargeError
from kimi_vision_common.patches import normalize_table
from kimi_vision_common.presets import Preset, get_preset
from kimi_vision_common.results import VideoChunkResult
from kimi_vision_common.sizing import TargetSize, navit_target_size

from .decode import ImageDecoder, default_decoder
from .limits import VideoLimits
from .normalize import empty_patches, patchify, write_patches
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
    preset = get_preset(preset)
    height, width = int(frames[0].shape[0]), int(frames[0].shape[1])
    target = chunk_target(width, height, len(frames), preset)
    table = normalize_table(preset.image_mean, preset.image_std)
    per_frame = target.num_patches
    dtype = np.float32 if output == "pixel_values" else np.uint8
    pixels = empty_patches(frames[0], (len(frames) * per_frame, 3, preset.patch_size, preset.patch_size), dtype)
    for t, frame in enumerate(frames):
        rgb = resize(frame, target.new_width, target.new_height, "bicubic")
        rows = pixels[t * per_frame : (t + 1) * per_frame]  # this frame's patches, written in place
        if output == "pixel_values":
            write_patches(rgb, table, target.grid_h, target.grid_w, preset.patch_size, out=rows)
        else:
            patchify(rgb, target.grid_h, target.grid_w, preset.patch_size, out=rows)
    return PreprocessResult(
        pixel_values=pixels if output == "pixel_values" else None,
        grid_thw=np.array([len(frames), target.grid_h, target.grid_w], dtype=np.int64),
        num_tokens=chunk_tokens(target, preset),
        decode_path="video",
        fallback_reason=None,
        target=target,
        pixel_patches=pixels if output == "pixel_patches" else None,
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
    """The first video stream as the first pass found it: packets, ``average_rate``, frame size."""

    packets: int
    fps: float
    width: int
    height: int


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
    """First pass: validate the container and count the first video stream's packets."""
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
    with _open(data) as container:
        stream = _video_stream(container)
        rate = stream.average_rate
        if not rate or float(rate) <= 0:
            raise InvalidVideoError("the video stream has no frame rate")
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        _check_frame_size(width, height, limits)
        packets = 0
        try:
            for packet in container.demux(stream):
                if packet.size:  # the demuxer ends with an empty flush packet
                    packets += 1
                    if packets > limits.max_video_frames:
                        raise VideoTooLargeError(
                            f"video of more than {limits.max_video_frames} frames exceeds "
                            f"max_video_frames={limits.max_video_frames}"
                        )
        except av.FFmpegError as exc:
            raise InvalidVideoError(f"cannot read the video stream after {packets} packets: {exc}") from None
    if packets == 0:
        raise InvalidVideoError("the video stream has no frames")
    return VideoInfo(packets, float(rate), width, height)


def _check_frame_size(width: int, height: int, limits: VideoLimits) -> None:
    if width * height > limits.max_frame_pixels:
        raise VideoTooLargeError(
            f"frames of {width}x{height} = {width * height} pixels exceed max_frame_pixels={limits.max_frame_pixels}"
        )


def _decoded_frames(data: bytes, threads: int, limits: VideoLimits) -> Iterator[Any]:
    """Every frame of the first video stream, decoded with FFmpeg's threads (0: FFmpeg's choice)."""
    import av

    with _open(data) as container:
        stream = _video_stream(container)
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = threads
        index = 0
        try:
            for frame in container.decode(stream):
                _check_frame_size(frame.width, frame.height, limits)
                yield frame
                index += 1
        except av.FFmpegError as exc:
            raise InvalidVideoError(f"cannot decode frame {index}: {exc}") from None


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
    info, indices = _sampling(data, preset, limits)
    return _chunk_results(_stream(bytes(data), preset, info, indices, limits, threads, on_frame), preset, output)


def _chunk_results(chunks: Iterator[SampledChunk], preset: Preset, output: PixelOutput) -> Iterator[VideoChunkResult]:
    """Each sampled chunk preprocessed as it comes; closing this stops the decoding."""
    with contextlib.closing(chunks):  # type: ignore[type-var]
        for chunk in chunks:
            yield _chunk_result(chunk, preset, output)


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
    info, indices = _sampling(data, preset, limits)
    return _stream(bytes(data), preset, info, indices, limits, threads, None)


def _sampling(data: bytes, preset: Preset, limits: VideoLimits) -> tuple[VideoInfo, list[int]]:
    """The first pass (:func:`probe_video`) and the sampled frame indices, within the limits."""
    info = probe_video(data, limits)
    indices = sample_frame_indices(info.packets, info.fps, preset)
    if len(indices) > limits.max_sampled_frames:
        raise VideoTooLargeError(f"{len(indices)} sampled frames exceed max_sampled_frames={limits.max_sampled_frames}")
    return info, indices


def _stream(  # noqa: PLR0917
    data: bytes,
    preset: Preset,
    info: VideoInfo,
    indices: list[int],
    limits: VideoLimits,
    threads: int,
    on_frame: Callable[[], None] | None,
) -> Iterator[SampledChunk]:
    decode = functools.partial(
        _sampled_chunks, data, preset, info.fps, limits=limits, threads=threads, on_frame=on_frame
    )
    expected = info.packets
    decoded, sent = yield from decode(indices)
    if decoded not in (0, expected) and sent == 0:
        # The decoder disagreed with the demuxer before any chunk went out: sample from its count.
        expected = decoded
        decoded, sent = yield from decode(sample_frame_indices(decoded, info.fps, preset))
    if decoded == 0:
        raise InvalidVideoError("no frame of the video stream could be decoded")
    if decoded != expected:
        raise InvalidVideoError(
            f"the decoder produced {decoded} frames where the container holds {expected}: the video is damaged "
            f"({sent} chunks were already sampled for {expected} frames)"
        )


def _sampled_chunks(
    data: bytes,
    preset: Preset,
    fps: float,
    indices: list[int],
    *,
    limits: VideoLimits,
    threads: int,
    on_frame: Callable[[], None] | None,
) -> Generator[SampledChunk, None, tuple[int, int]]:
    """Decode (in a thread: FFmpeg and numba release the GIL, so a chunk is preprocessed while the
    next frames decode), keep the sampled frames of the chunk not yet complete, yield each chunk
    when complete; the generator's value is ``(frames decoded, chunks yielded)``."""
    chunks = chunked(indices, preset.temporal_merge_kernel_size)
    wanted: dict[int, list[int]] = {}
    for number, chunk in enumerate(chunks):
        for index in chunk:
            wanted.setdefault(index, []).append(number)
    frames = _FrameProducer(data, threads, limits, set(wanted), on_frame, preset.temporal_merge_kernel_size)
    pending: dict[int, list[np.ndarray]] = {}
    next_chunk = 0
    with frames:
        for frame_index, rgb in frames:
            for number in wanted[frame_index]:
                pending.setdefault(number, []).append(rgb)
            while next_chunk < len(chunks) and len(pending.get(next_chunk, ())) == len(chunks[next_chunk]):
                indices_of_chunk = chunks[next_chunk]
                timestamp = chunk_timestamp(indices_of_chunk[0], fps, preset.timestamp_mode)
                prompt = preset.video_prompt.format(timestamp=timestamp)
                yield SampledChunk(pending.pop(next_chunk), indices_of_chunk, timestamp, prompt)
                next_chunk += 1
    return frames.decoded, next_chunk


class _FrameProducer:
    """Decodes every frame of the video in a thread and hands over the sampled ones as RGB arrays
    through a queue of ``depth`` frames (so at most a chunk's worth waits); iterate for
    ``(frame index, rgb)``, read ``decoded`` after. Leaving the ``with`` block stops the thread."""

    def __init__(  # noqa: PLR0917
        self,
        data: bytes,
        threads: int,
        limits: VideoLimits,
        wanted: set[int],
        on_frame: Callable[[], None] | None,
        depth: int,
    ) -> None:
        self._args = (data, threads, limits, wanted, on_frame)
        self._queue: queue.Queue[tuple[str, Any, Any]] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kimi-prep video decode", daemon=True)
        self.decoded = 0

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

    def _run(self) -> None:
        data, threads, limits, wanted, on_frame = self._args
        try:
            with contextlib.closing(_decoded_frames(data, threads, limits)) as decoded:
                for index, frame in enumerate(decoded):
                    if self._stop.is_set():
                        return
                    self.decoded += 1
                    if on_frame is not None:
                        on_frame()
                    if index in wanted and not self._put(("frame", index, frame.to_ndarray(format="rgb24"))):
                        return
            self._put(("end", None, None))
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(("error", exc, None))

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        while True:
            kind, first, second = self._queue.get()
            if kind == "error":
                raise first
            if kind == "end":
                return
            yield first, second


def _chunk_result(chunk: SampledChunk, preset: Preset, output: PixelOutput) -> VideoChunkResult:
    result = preprocess_frames(chunk.frames, preset, output)
    return VideoChunkResult(
        pixel_values=result.pixel_values,
        grid_thw=result.grid_thw,
        num_tokens=result.num_tokens,
        prompt=chunk.prompt,
        timestamp=chunk.timestamp,
        frame_indices=chunk.frame_indices,
        pixel_patches=result.pixel_patches,
    )
