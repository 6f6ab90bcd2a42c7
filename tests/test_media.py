"""Several images, video chunks, videos and token counts (spec sections 7-9), in process.

Every expected value comes from ``tests/reference.py`` (PyAV frames + Pillow + numpy, no library
code) or from the spec's worked examples. Test clips are encoded here with PyAV from corpus photos.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import reference
from make_inputs import CORPUS, corpus_names, encode_clip, photo_frames, video_clips
from PIL import Image

import kimi_vision_prep as kvp
from kimi_vision_common.errors import InvalidVideoError
from kimi_vision_common.sizing import chunk_target
from kimi_vision_common.wire import NUM_TOKENS_DTYPE
from kimi_vision_prep import video_pipeline
from kimi_vision_prep.video.frames import FrameProducer
from kimi_vision_prep.video.sampling import chunk_timestamp, sample_frame_indices

PRESET_NAMES = ("kimi-k2.5", "kimi-k3")
VIDEO_DIR = CORPUS / "video"


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return video_clips()


def assert_chunk_equal(ours: kvp.VideoChunkResult, ref: reference.RefChunk, where: str) -> None:
    assert ours.pixel_values.dtype == np.float32, where
    assert np.array_equal(ours.pixel_values, ref.pixel_values), where
    assert ours.grid_thw.tolist() == ref.grid_thw.tolist() and ours.num_tokens == ref.num_tokens, where
    assert (ours.timestamp, ours.prompt, ours.frame_indices) == (ref.timestamp, ref.prompt, ref.frame_indices), where


# -- several images (section 7) -------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_images_are_the_concatenation_of_single_results(corpus: Path, preset: str) -> None:
    names = ["pil__hopper.jpg", "imagers__large_image.jpg", "pilx__p_trns_single.png", "pil__pil_sample_cmyk.jpg"]
    items = [(corpus / n).read_bytes() for n in names]
    result = kvp.preprocess_images(items, preset)
    pixel_values, grid_thws, num_tokens = reference.reference_images(items, preset)
    assert result.pixel_values.dtype == np.float32 and np.array_equal(result.pixel_values, pixel_values)
    assert result.grid_thws.dtype == np.int64 and result.grid_thws.tolist() == grid_thws.tolist()
    assert result.num_tokens.dtype == NUM_TOKENS_DTYPE and result.num_tokens.tolist() == num_tokens.tolist()
    patches = kvp.preprocess_images(items, preset, output="pixel_patches")
    assert patches.pixel_values is None and patches.pixel_patches.dtype == np.uint8
    assert np.array_equal(kvp.pixel_values_from_patches(patches.pixel_patches, preset), pixel_values)


def test_no_images_give_empty_arrays() -> None:
    result = kvp.preprocess_images([])
    assert result.pixel_values.shape == (0, 3, 14, 14) and result.pixel_values.dtype == np.float32
    assert result.grid_thws.shape == (0, 3) and result.num_tokens.shape == (0,)
    assert kvp.preprocess_images([], output="pixel_patches").pixel_patches.dtype == np.uint8


def test_a_bad_image_raises_its_type_with_its_index(corpus: Path) -> None:
    good, bad = (corpus / "pil__hopper.jpg").read_bytes(), (corpus / "pil__truncated_jpeg.jpg").read_bytes()
    with pytest.raises(kvp.PreprocessError) as single:
        kvp.preprocess_bytes(bad)
    with pytest.raises(type(single.value), match=r"^image 2: ") as raised:
        kvp.preprocess_images([good, good, bad, good])
    assert str(raised.value) == f"image 2: {single.value}"
    with pytest.raises(kvp.InvalidRequestError, match=r"at most 16 \(max_images_per_request\)"):
        kvp.preprocess_images([good] * 17)
    assert len(kvp.preprocess_images([good] * 3, max_images_per_request=3).num_tokens) == 3


# -- video chunks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_chunk_of_encoded_frames_equals_reference(corpus: Path, preset: str) -> None:
    """The first frame's size sets the target; frames of other sizes and modes (a palette PNG with
    transparency: RGB under every preset) are resized to it."""
    names = ["pil__exif-72dpi-int.jpg", "pil__hopper.jpg", "pilx__p_trns_single.png", "imagers__large_image.jpg"]
    frames = [(corpus / n).read_bytes() for n in names]
    ours = kvp.preprocess_video_chunk(frames, preset)
    ref = reference.reference_frames_chunk(frames, preset)
    assert np.array_equal(ours.pixel_values, ref.pixel_values)
    assert ours.grid_thw.tolist() == ref.grid_thw.tolist() == [4, *ref.grid_thw[1:].tolist()]
    assert ours.num_tokens == ref.num_tokens
    split = kvp.preprocess_video_chunk(frames, preset, output="pixel_patches")
    assert np.array_equal(kvp.pixel_values_from_patches(split.pixel_patches, preset), ref.pixel_values)
    with pytest.raises(kvp.InvalidImageError, match=r"^frame 1: "):
        kvp.preprocess_video_chunk([frames[0], b"not a frame"], preset)


@pytest.mark.parametrize(
    ("size", "new_size", "grid", "tokens"),
    [((1920, 1080), (1196, 672), (48, 86), 1032), ((1280, 720), (1202, 676), (50, 86), 1075),
     ((640, 360), (640, 360), (26, 46), 299)],
)  # fmt: skip
def test_spec_chunk_examples(size: tuple[int, int], new_size: tuple[int, int], grid: tuple, tokens: int) -> None:
    for frames in (1, 4):
        target = chunk_target(*size, frames, kvp.KIMI_K25)
        assert (target.new_width, target.new_height) == new_size and (target.grid_h, target.grid_w) == grid
        assert target.num_tokens == tokens
    result = kvp.preprocess_frames([np.zeros((size[1], size[0], 3), np.uint8)] * 3, "kimi-k2.5")
    assert result.grid_thw.tolist() == [3, *grid] and result.num_tokens == tokens
    assert result.pixel_values.shape == (3 * grid[0] * grid[1], 3, 14, 14)


# -- videos ---------------------------------------------------------------------------------------


def test_spec_video_example() -> None:
    """The AV1 clip: 125 frames at 25 fps (no frame count in the container)."""
    data = (VIDEO_DIR / "torchcodec__av1_video.mkv").read_bytes()
    k25 = list(kvp.preprocess_video(data, "kimi-k2.5"))
    assert [c.frame_indices for c in k25] == [(0, 14, 28, 41), (55, 69, 83, 96), (110, 124)]
    assert [c.timestamp for c in k25] == ["00:00:00.000", "00:00:02.200", "00:00:04.400"]
    k3 = list(kvp.preprocess_video(data, "kimi-k3"))
    assert len(k3) == 10 and all(len(c.frame_indices) == 4 for c in k3)
    assert k3[9].frame_indices[0] == 114 and k3[9].timestamp == "00:00:04.559"
    assert k3[9].prompt == "00:00:04.559<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"


def test_timestamps_truncate_milliseconds_in_every_mode() -> None:
    assert chunk_timestamp(114, 25.0, "hh:mm:ss.fff") == "00:00:04.559"
    assert chunk_timestamp(114, 25.0, "mm:ss.fff") == "00:04.559"
    assert chunk_timestamp(114, 25.0, "mm:ss") == "00:04"
    assert chunk_timestamp(3725 * 30 + 15, 30.0, "hh:mm:ss.fff") == "01:02:05.500"
    assert sample_frame_indices(125, 25.0, kvp.KIMI_K25) == [0, 14, 28, 41, 55, 69, 83, 96, 110, 124]


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_videos_equal_reference(clips: dict[str, bytes], preset: str) -> None:
    for name, data in clips.items():
        ours = list(kvp.preprocess_video(data, preset))
        ref = reference.reference_video(data, preset)
        assert len(ours) == len(ref), name
        for i, (chunk, expected) in enumerate(zip(ours, ref, strict=True)):
            assert_chunk_equal(chunk, expected, f"{preset} {name} chunk {i}")


def test_frames_whose_size_format_and_colour_change_mid_stream_equal_reference() -> None:
    """A video's frames go through one swscale context: where a frame's size, pixel format, colour
    matrix or range differs from the one before, the conversion is still the reference's
    (``to_ndarray`` per frame). MPEG-TS segments, concatenated, each its own settings; chunks
    mix frames of two segments."""
    photo = "pil__xmp_test.jpg"
    segments = [
        encode_clip(photo_frames(photo, 320, 240, 30), 25, container="mpegts"),
        encode_clip(photo_frames(photo, 256, 192, 30), 25, container="mpegts", pix_fmt="yuvj420p"),
        encode_clip(
            photo_frames(photo, 320, 240, 30), 25, container="mpegts", options={"x264-params": "colormatrix=bt709"}
        ),
        encode_clip(photo_frames(photo, 320, 240, 30), 25, container="mpegts", pix_fmt="yuv444p"),
    ]
    data = b"".join(segments)
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(video=0))
    kinds = {(f.width, f.height, f.format.name, int(f.colorspace), int(f.color_range)) for f in frames}
    assert len({kind[:3] for kind in kinds}) == 3 and len({kind[3:] for kind in kinds}) >= 3, kinds
    # The tags change the pixels: a context kept set up for the frame before would differ.
    tagged = next(f for f in frames if f.colorspace == 1)  # AVCOL_SPC_BT709
    as_tagged = tagged.to_ndarray(format="rgb24")
    tagged.colorspace = 2  # AVCOL_SPC_UNSPECIFIED, as the first segment's frames are
    assert not np.array_equal(as_tagged, tagged.to_ndarray(format="rgb24"))
    for preset in PRESET_NAMES:
        ours = list(kvp.preprocess_video(data, preset))
        ref = reference.reference_video(data, preset)
        assert len(ours) == len(ref) > 1, preset
        for i, (chunk, expected) in enumerate(zip(ours, ref, strict=True)):
            assert_chunk_equal(chunk, expected, f"{preset} chunk {i}")


def test_several_chunks_with_a_short_last_one(clips: dict[str, bytes]) -> None:
    chunks = list(kvp.preprocess_video(clips["h264_29.97fps_320x240.mp4"], "kimi-k3"))
    assert [len(c.frame_indices) for c in chunks] == [4, 4, 3]  # n = round(40 * 8 / 29.97) = 11
    assert chunks[-1].grid_thw[0] == 3 and chunks[-1].num_tokens == chunks[0].num_tokens


def test_chunks_complete_before_a_decode_error_go_out_first(
    clips: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk is yielded once its frames are written, which may be after the next chunk's frames
    came in: with writes that are never seen done early, a decoder failing after 9 frames (K3:
    chunks of 4) still hands out the two complete chunks, equal to an undisturbed run's, then raises."""
    data = clips["h264_29.97fps_320x240.mp4"]
    expected = list(kvp.preprocess_video(data, "kimi-k3"))
    frames_of = FrameProducer.__iter__

    def failing(producer: FrameProducer) -> Iterator[tuple[int, Any]]:
        for count, item in enumerate(frames_of(producer)):
            if count == 9:
                raise InvalidVideoError("the decoder failed")
            yield item

    monkeypatch.setattr(FrameProducer, "__iter__", failing)
    monkeypatch.setattr(video_pipeline._FrameWriters, "ready", lambda self: False)  # as if the writes lagged
    got = []
    with pytest.raises(InvalidVideoError, match="the decoder failed"):
        got.extend(kvp.preprocess_video(data, "kimi-k3"))
    assert [c.frame_indices for c in got] == [c.frame_indices for c in expected[:2]]
    assert all(a.pixel_values.tobytes() == b.pixel_values.tobytes() for a, b in zip(got, expected, strict=False))


def test_uint8_route_expands_to_pixel_values(clips: dict[str, bytes]) -> None:
    data = clips["vp9_portrait_180x320.webm"]
    for floats, patches in zip(
        kvp.preprocess_video(data), kvp.preprocess_video(data, output="pixel_patches"), strict=True
    ):
        assert patches.pixel_values is None and patches.pixel_patches.dtype == np.uint8
        assert np.array_equal(kvp.pixel_values_from_patches(patches.pixel_patches, "kimi-k2.5"), floats.pixel_values)


def test_video_preset_fields(clips: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """``in_patch_limit_video``, ``max_num_frames_each_video`` (caps silently), ``fixed_output_tokens``
    and ``timestamp_mode`` as the spec says (the reference with the same values)."""
    fields = dict(
        in_patch_limit_video=1000, max_num_frames_each_video=6, fixed_output_tokens=77, timestamp_mode="mm:ss.fff"
    )
    monkeypatch.setitem(reference.PRESETS, "custom", {**reference.PRESETS["kimi-k3"], **fields})
    custom = dataclasses.replace(kvp.KIMI_K3, name="custom", **fields)
    data = clips["h264_25fps_1280x720.mp4"]
    ours = list(kvp.preprocess_video(data, custom))
    ref = reference.reference_video(data, "custom")
    assert [len(c.frame_indices) for c in ours] == [4, 2] and all(c.num_tokens == 77 for c in ours)
    for i, (chunk, expected) in enumerate(zip(ours, ref, strict=True)):
        assert_chunk_equal(chunk, expected, f"custom chunk {i}")
    assert ours[0].grid_thw.tolist() != ours[1].grid_thw.tolist()  # the budget is shared by T frames


def test_closing_the_iterator_stops_decoding(clips: dict[str, bytes]) -> None:
    decoded = []
    chunks = kvp.preprocess_video(clips["mpeg4_1000fps_64x48.mkv"], "kimi-k3", on_frame=lambda: decoded.append(1))
    assert not decoded  # validated and counted, nothing decoded yet
    first = next(iter(chunks))
    # Frames 0 and 199 of 200, GOPs of 12: only the first and the last GOP are decoded.
    assert first.frame_indices == (0, 199) and 2 <= len(decoded) <= 24
    streamed = kvp.preprocess_video(clips["h264_25fps_1280x720.mp4"], "kimi-k3", on_frame=lambda: decoded.append(2))
    next(streamed)
    streamed.close()
    assert 0 < decoded.count(2) < 30


# -- hostile videos -------------------------------------------------------------------------------


def hostile_videos(
    clips: dict[str, bytes], corpus: Path
) -> dict[str, tuple[bytes, type[kvp.PreprocessError], str | None]]:
    mp4 = clips["h264_25fps_1280x720.mp4"]
    noise = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    mkv = clips["mpeg4_1000fps_64x48.mkv"]
    assert mkv.count(b"V_MPEG4/ISO/ASP") == 1
    return {
        # found by `make fuzz-videos`: a stream PyAV opens without a codec context
        "unknown_codec": (mkv.replace(b"V_MPEG4/ISO/ASP", b"V_UNKNOWN/CODEC"), kvp.InvalidVideoError, "codec"),
        "empty": (b"", kvp.InvalidVideoError, "empty"),
        "random": (noise, kvp.InvalidVideoError, None),
        "text": (b"hello, this is not a video\n" * 20, kvp.InvalidVideoError, "not a decodable video"),
        "url": (b"http://example.com/video.mp4", kvp.InvalidVideoError, "not a decodable video"),
        "mp4_cut_after_header": (mp4[:48], kvp.InvalidVideoError, None),
        "jpeg_as_video": ((corpus / "pil__hopper.jpg").read_bytes(), kvp.InvalidVideoError, "an image, not a video"),
        "png_as_video": ((corpus / "pilx__p_trns_single.png").read_bytes(), kvp.InvalidVideoError, "use the image"),
    }


def test_hostile_videos_raise_typed_errors(clips: dict[str, bytes], corpus: Path) -> None:
    for label, (data, error, message) in hostile_videos(clips, corpus).items():
        with pytest.raises(error, match=message) as raised:
            list(kvp.preprocess_video(data))
        assert raised.value.triton_code == "INVALID_ARG", label


def test_truncated_videos_follow_the_reference_or_fail_typed(clips: dict[str, bytes]) -> None:
    """Cut mid-stream: the frames FFmpeg still decodes are the video (as the reference reads it),
    or a typed error; never another exception, never a wrong chunk."""
    for name in ("vp9_portrait_180x320.webm", "mpeg4_1000fps_64x48.mkv", "h264_29.97fps_320x240.mp4"):
        data = clips[name]
        for fraction in (0.3, 0.6, 0.9):
            cut = data[: int(len(data) * fraction)]
            try:
                ours = list(kvp.preprocess_video(cut, "kimi-k3"))
            except kvp.PreprocessError as exc:
                assert exc.triton_code == "INVALID_ARG", (name, fraction, exc)
                continue
            ref = reference.reference_video(cut, "kimi-k3")
            for i, (chunk, expected) in enumerate(zip(ours, ref, strict=True)):
                assert_chunk_equal(chunk, expected, f"{name} cut at {fraction} chunk {i}")


def test_bombs_and_limits_are_refused_before_the_work() -> None:
    tiny = [np.zeros((16, 16, 3), np.uint8)]
    frame_bomb = encode_clip(tiny * 100_000, 1000, "mpeg4")
    with pytest.raises(kvp.VideoTooLargeError, match="max_video_frames=36000"):
        kvp.preprocess_video(frame_bomb)
    pixel_bomb = encode_clip([np.zeros((2176, 3856, 3), np.uint8)], 1, "mpeg4")
    with pytest.raises(kvp.VideoTooLargeError, match="max_frame_pixels"):
        kvp.preprocess_video(pixel_bomb)
    clip = encode_clip(tiny * 50, 25, "mpeg4")
    with pytest.raises(kvp.VideoTooLargeError, match="max_sampled_frames=2"):
        kvp.preprocess_video(clip, limits=kvp.VideoLimits(max_sampled_frames=2))
    with pytest.raises(kvp.VideoTooLargeError, match="max_video_bytes=100"):
        kvp.preprocess_video(clip, limits=kvp.VideoLimits(max_video_bytes=100))
    with pytest.raises(kvp.VideoTooLargeError, match="max_video_frames=10"):
        kvp.preprocess_video(clip, limits=kvp.VideoLimits(max_video_frames=10))


# -- token counts (section 9) ---------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_token_counts_equal_full_preprocessing(corpus: Path, preset: str) -> None:
    counted = 0
    for name in corpus_names(accepted=True):
        data = (corpus / name).read_bytes()
        tokens = kvp.count_tokens(data, preset)
        full = kvp.preprocess_bytes(data, preset, output="pixel_patches")
        grid_thw, num_tokens, prompt = reference.reference_token_count(data, preset)
        assert tokens.grid_thw.tolist() == full.grid_thw.tolist() == grid_thw.tolist(), name
        assert tokens.num_tokens == full.num_tokens == num_tokens and tokens.prompt == prompt, name
        counted += 1
    assert counted > 20


def test_token_count_reads_the_header_only(corpus: Path) -> None:
    """A header that parses gets a count even when the pixels are corrupt (preprocessing fails)."""
    data = (corpus / "pil__truncated_jpeg.jpg").read_bytes()
    with pytest.raises(kvp.InvalidImageError):
        kvp.preprocess_bytes(data)
    width, height = Image.open(io.BytesIO(data)).size
    assert kvp.count_tokens(data, "kimi-k3").prompt == (
        f"<|media_begin|>image {width}x{height}<|media_content|><|media_pad|><|media_end|>"
    )
    with pytest.raises(kvp.InvalidImageError):
        kvp.count_tokens(b"not an image")
