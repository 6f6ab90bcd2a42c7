"""The verdict rules the fuzzer checks on every input, for every preset.

Images (:func:`judge`): Pillow (``tests/reference.py``) accepts the input -> the library accepts it
and its ``pixel_values``, ``grid_thw`` and token count equal the reference's exactly. Pillow
rejects it, or it is over a decode limit -> the library raises one of the bad-input
:class:`PreprocessError` subclasses (:class:`ImageTooLargeError` for a limit). Any other exception
escaping the library is a bug. The reference only runs when the header's pixel count is within the
limit, so memory stays bounded.

Videos (:func:`judge_video`): the library's chunks (``preprocess_video``) equal the reference's
(``reference_video``: every frame decoded by PyAV) chunk for chunk, or the library refuses the
video with :class:`InvalidVideoError` / :class:`VideoTooLargeError`. A refusal where the reference
decodes is allowed (a damaged stream the planned decode cannot vouch for: docs/media.md) and
counted; chunks where the reference refuses, and chunks that differ, are findings, unless the
reference itself gives other pixels when run again (FFmpeg's HEVC decoder leaves pool memory in a
damaged picture: no decode can equal it). The reference runs only on videos whose every frame is
within the limits (a PyAV decode without conversion first), so memory stays bounded.
"""

from __future__ import annotations

import io
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from reference import RefChunk, RefResult, reference_preprocess, reference_video  # noqa: E402

from kimi_vision_prep import (  # noqa: E402
    DecodeLimits,
    ImageDecoder,
    ImageTooLargeError,
    InvalidImageError,
    InvalidVideoError,
    PreprocessError,
    PreprocessResult,
    UnsupportedImageError,
    VideoChunkResult,
    VideoLimits,
    VideoTooLargeError,
    preprocess_bytes,
    preprocess_video,
)

PRESET_NAMES = ("kimi-k2.5", "kimi-k3")
BAD_INPUT_ERRORS = (InvalidImageError, ImageTooLargeError, UnsupportedImageError)
OVER_LIMIT = "over-limit"
FUZZ_LIMITS = DecodeLimits(max_pixels=4_000_000, max_encoded_bytes=2 << 20)
FUZZ_VIDEO_LIMITS = VideoLimits(
    max_video_bytes=2 << 20, max_frame_pixels=640 * 480, max_video_frames=1000, max_sampled_frames=256
)


@dataclass(frozen=True)
class Rejected:
    """Why the input must be rejected: ``OVER_LIMIT`` or the reference's exception."""

    kind: str
    message: str = ""


class Finding(AssertionError):
    """A violation of the verdict rule. ``signature`` groups findings of the same kind."""

    def __init__(self, signature: str, detail: str) -> None:
        super().__init__(f"{signature}: {detail}")
        self.signature = signature
        self.detail = detail


def make_decoder(limits: DecodeLimits = FUZZ_LIMITS) -> ImageDecoder:
    """A CPU decoder with modest limits, one nvImageCodec decoder on one thread."""
    return ImageDecoder("cpu", limits=limits, pool_size=1, codec_threads=1, cpu_decode_threads=1)


def _rejected(exc: Exception) -> Rejected:
    return Rejected(type(exc).__name__, str(exc))


def expected_outcome(data: bytes, preset: str, limits: DecodeLimits) -> RefResult | Rejected:
    """The reference's result, or why the input must be rejected."""
    if len(data) > limits.max_encoded_bytes:
        return Rejected(OVER_LIMIT, f"{len(data)} bytes")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Exception as exc:  # the reference's verdict is any failure at all
        return _rejected(exc)
    if width * height > limits.max_pixels:
        return Rejected(OVER_LIMIT, f"{width}x{height}")
    try:
        return reference_preprocess(data, preset)
    except Exception as exc:
        return _rejected(exc)


def library_outcome(data: bytes, preset: str, decoder: ImageDecoder) -> PreprocessResult | PreprocessError:
    """The library's result or typed error; any other exception is a :class:`Finding`."""
    try:
        return preprocess_bytes(data, preset, decoder=decoder)
    except PreprocessError as exc:
        return exc
    except Exception as exc:
        raise Finding(f"{preset}:escaped:{type(exc).__name__}", traceback.format_exc()) from exc


def _compare(result: PreprocessResult, ref: RefResult, preset: str) -> None:
    where = f"{preset}:pixels:{result.decode_path}"
    if not np.array_equal(result.grid_thw, ref.grid_thw) or result.num_tokens != ref.num_tokens:
        raise Finding(where, f"grid {result.grid_thw}/{result.num_tokens} != reference {ref.grid_thw}/{ref.num_tokens}")
    ours = np.asarray(result.pixel_values)
    if ours.shape != ref.pixel_values.shape or ours.dtype != ref.pixel_values.dtype:
        raise Finding(where, f"{ours.dtype}{ours.shape} != reference {ref.pixel_values.dtype}{ref.pixel_values.shape}")
    if not np.array_equal(ours, ref.pixel_values):
        diff = np.abs(ours.astype(np.float64) - ref.pixel_values)
        levels = diff.max() * 0.5 * 255  # mean = std = 0.5: one level is 2/255
        raise Finding(
            where,
            f"{int((diff > 0).sum())} of {diff.size} values differ, max {levels:.0f} levels "
            f"(size {result.width}x{result.height}, source decode {result.decode_path})",
        )


def judge(data: bytes, preset: str, decoder: ImageDecoder) -> str:
    """Check the verdict rule on one input; returns a short verdict label or raises :class:`Finding`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = expected_outcome(data, preset, decoder.limits)
        outcome = library_outcome(data, preset, decoder)
    if isinstance(expected, Rejected):
        said = f"reference: {expected.kind}: {expected.message}"
        if not isinstance(outcome, PreprocessError):
            raise Finding(
                f"{preset}:accepted-bad-input:{expected.kind}:{outcome.decode_path}",
                f"{said}; library accepted it via {outcome.decode_path} (fallback: {outcome.fallback_reason})",
            )
        wanted = ImageTooLargeError if expected.kind == OVER_LIMIT else BAD_INPUT_ERRORS
        if not isinstance(outcome, wanted):
            raise Finding(f"{preset}:wrong-error:{type(outcome).__name__}", f"{said}; library: {outcome!r}")
        return f"{preset} rejected {type(outcome).__name__} ({expected.kind})"
    if isinstance(outcome, PreprocessError):
        raise Finding(f"{preset}:rejected-good-input:{type(outcome).__name__}", f"reference accepts: {outcome!r}")
    _compare(outcome, expected, preset)
    return f"{preset} ok {outcome.decode_path}"


# -- videos -------------------------------------------------------------------------------------


def frames_within(data: bytes, limits: VideoLimits) -> bool:
    """Whether every frame PyAV decodes from ``data`` is within ``limits`` (so the reference, which
    converts them all, stays bounded); True where PyAV fails on it (the reference's run decides)."""
    import av

    if len(data) > limits.max_video_bytes:
        return False
    frames = 0
    try:
        with av.open(io.BytesIO(data)) as container:
            for frame in container.decode(video=0):
                frames += 1
                if frame.width * frame.height > limits.max_frame_pixels or frames > limits.max_video_frames:
                    return False
    except Exception:  # what PyAV cannot decode, the reference's run decides
        return True
    return True


def _reference_chunks(data: bytes, preset: str) -> list[RefChunk] | Exception:
    try:
        return reference_video(data, preset)
    except Exception as exc:  # the reference's verdict is any failure at all
        return exc


def _chunks_equal(ours: list[VideoChunkResult] | list[RefChunk], ref: list[RefChunk]) -> str | None:
    """None where equal, else what differs first."""
    if len(ours) != len(ref):
        return f"{len(ours)} chunks, the reference {len(ref)}"
    for i, (chunk, expected) in enumerate(zip(ours, ref, strict=True)):
        if tuple(chunk.frame_indices) != tuple(expected.frame_indices):
            return f"chunk {i}: frames {tuple(chunk.frame_indices)}, the reference {tuple(expected.frame_indices)}"
        if not np.array_equal(chunk.pixel_values, expected.pixel_values):
            diff = int((np.asarray(chunk.pixel_values) != expected.pixel_values).sum())
            return f"chunk {i}: {diff} of {expected.pixel_values.size} values differ"
    return None


def _reference_stable(data: bytes, preset: str, first: list[RefChunk]) -> bool:
    again = _reference_chunks(data, preset)
    return not isinstance(again, Exception) and _chunks_equal(again, first) is None


def judge_video(data: bytes, preset: str) -> str:
    """Check the video verdict rule on one input; returns a short verdict label or raises :class:`Finding`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outcome: list[VideoChunkResult] | PreprocessError = list(
                preprocess_video(data, preset, limits=FUZZ_VIDEO_LIMITS)
            )
        except PreprocessError as exc:
            outcome = exc
        except Exception as exc:
            raise Finding(f"{preset}:video:escaped:{type(exc).__name__}", traceback.format_exc()) from exc
        if isinstance(outcome, VideoTooLargeError):
            return f"{preset} video rejected VideoTooLargeError"
        if isinstance(outcome, PreprocessError) and not isinstance(outcome, InvalidVideoError):
            raise Finding(f"{preset}:video:wrong-error:{type(outcome).__name__}", repr(outcome))
        if not frames_within(data, FUZZ_VIDEO_LIMITS):
            said = "rejected" if isinstance(outcome, PreprocessError) else "accepted"
            return f"{preset} video {said}, frames over the limits"
        ref = _reference_chunks(data, preset)
    if isinstance(ref, Exception):
        if isinstance(outcome, PreprocessError):
            return f"{preset} video rejected InvalidVideoError (reference: {type(ref).__name__})"
        raise Finding(
            f"{preset}:video:accepted-bad-input:{type(ref).__name__}", f"reference: {ref!r}; library accepted it"
        )
    if isinstance(outcome, PreprocessError):
        return f"{preset} video refused where the reference decodes"
    difference = _chunks_equal(outcome, ref)
    if difference is None:
        return f"{preset} video ok"
    if not _reference_stable(data, preset, ref):
        return f"{preset} video differs; the reference differs from itself"
    raise Finding(f"{preset}:video:pixels", difference)
