"""A video's first pass: the container opened once and the first video stream's packets listed
(no decoding): each packet's pts, key flag and, from its bytes, whether its frame is a reference
and whether a fresh decoder may start there (:mod:`.frame_types`). The container stays open for
the frames (:mod:`.frames`), which decode these packets: no second demux.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from PIL import Image

from kimi_vision_common.errors import InvalidVideoError, VideoTooLargeError

from ..limits import VideoLimits
from .frame_types import fresh_entries, reference_reader


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


def _reject_images(data: bytes) -> None:
    """Pillow identifies it (except MPEG video, which its plugin reads as a still): an image."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            still = image.format != "MPEG"
    except Exception:  # not an image Pillow knows: maybe a video
        return
    if still:
        raise InvalidVideoError("an image, not a video: use the image models")


def open_video(data: bytes, options: dict[str, str] | None = None) -> Any:
    """``data`` opened by PyAV (``options``: the demuxer's), or :class:`InvalidVideoError`."""
    import av

    try:
        return av.open(io.BytesIO(data), mode="r", options=options)
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise InvalidVideoError(f"not a decodable video ({len(data)} bytes, starts with {data[:8]!r}): {exc}") from None


def video_stream(container: Any) -> Any:
    """The first video stream of ``container``, or :class:`InvalidVideoError` where it is an image's
    or has none FFmpeg decodes."""
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
        raise VideoTooLargeError(f"encoded video of {len(data)} bytes exceeds max_video_bytes={limits.max_video_bytes}")
    _reject_images(data)
    container = open_video(data)
    try:
        stream = video_stream(container)
        rate = stream.average_rate
        if not rate or float(rate) <= 0:
            raise InvalidVideoError("the video stream has no frame rate")
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        check_frame_size(width, height, limits)
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


def check_frame_size(width: int, height: int, limits: VideoLimits) -> None:
    """:class:`VideoTooLargeError` where a frame of ``width`` x ``height`` exceeds ``limits``."""
    if width * height > limits.max_frame_pixels:
        raise VideoTooLargeError(
            f"frames of {width}x{height} = {width * height} pixels exceed max_frame_pixels={limits.max_frame_pixels}"
        )
