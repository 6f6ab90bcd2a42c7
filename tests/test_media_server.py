"""The video, video-chunk and token-count models on the real tritonserver (gRPC streams for video).

Every expected value comes from ``tests/reference.py`` or the in-process library on the same bytes.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reference
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from make_inputs import CORPUS, encode_clip, photo_frames, video_clips
from tritonclient.utils import InferenceServerException

import kimi_vision_prep as kvp
from kimi_vision_client.client import KimiVisionClient

pytestmark = pytest.mark.server

VIDEO_DIR = CORPUS / "video"
PRESETS = {"kimi_k25": "kimi-k2.5", "kimi_k3": "kimi-k3"}
PROTOCOLS = {"http": httpclient, "grpc": grpcclient}


@pytest.fixture(scope="module")
def long_clip() -> bytes:
    """12 s at 25 fps: several chunks under both presets, long enough to cancel mid-way."""
    return encode_clip(photo_frames("pil__xmp_test.jpg", 320, 240, 300), 25)


def url(server: Any, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


def frames_decoded(server: Any, model: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    pattern = rf'^kimi_prep_video_frames_decoded_total\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$'
    return sum(float(m) for m in re.findall(pattern, text, re.M))


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return video_clips()


@pytest.mark.parametrize("prefix", sorted(PRESETS))
def test_video_stream_equals_reference(
    triton_server: Any, clips: dict[str, bytes], long_clip: bytes, prefix: str
) -> None:
    """Every test clip: one response per chunk (float32, and uint8 expanded: the client reads the
    u8 wire when it asks for the patches), each equal to the reference, then the stream ends."""
    preset = PRESETS[prefix]
    for data in (*clips.values(), long_clip):
        expected = reference.reference_video(data, preset)
        for model in (f"{prefix}_vision", f"{prefix}_vision_u8"):  # the client learns the wire from the video model
            with KimiVisionClient(triton_server.grpc_url, "grpc", model) as client:
                chunks = list(client.preprocess_video(data))
            assert len(chunks) == len(expected)
            for chunk, ref in zip(chunks, expected, strict=True):
                assert np.array_equal(chunk.pixel_values, ref.pixel_values)
                assert chunk.grid_thw.tolist() == ref.grid_thw.tolist() and chunk.num_tokens == ref.num_tokens
                assert (chunk.prompt, chunk.timestamp, chunk.frame_indices) == (
                    ref.prompt, ref.timestamp, ref.frame_indices,
                )  # fmt: skip


def test_video_over_http_is_a_clear_error(triton_server: Any) -> None:
    with (
        KimiVisionClient(triton_server.http_url, "http") as client,
        pytest.raises(kvp.InvalidRequestError, match="gRPC"),
    ):
        client.preprocess_video(b"")


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("still_image", kvp.InvalidVideoError, "an image, not a video"),
        ("text", kvp.InvalidVideoError, "not a decodable video"),
        ("url", kvp.InvalidVideoError, "not a decodable video"),
        ("random", kvp.InvalidVideoError, None),
        ("empty", kvp.InvalidVideoError, "empty"),
        ("mp4_cut_after_header", kvp.InvalidVideoError, None),
        ("frame_bomb", kvp.VideoTooLargeError, "max_video_frames"),
        ("pixel_bomb", kvp.VideoTooLargeError, "max_frame_pixels"),
    ],
)
def test_hostile_videos_get_one_final_error(  # noqa: PLR0917  (fixtures and parameters)
    triton_server: Any, corpus: Path, long_clip: bytes, name: str, error: type, message: str | None
) -> None:
    data = {
        "still_image": (corpus / "pil__hopper.jpg").read_bytes(),
        "text": b"this is not a video at all\n" * 10,
        "url": b"https://example.com/clip.mp4",
        "random": np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes(),
        "empty": b"",
        "mp4_cut_after_header": long_clip[:48],
        "frame_bomb": encode_clip([np.zeros((16, 16, 3), np.uint8)] * 40_000, 1000, "mpeg4"),
        "pixel_bomb": encode_clip([np.zeros((2176, 3856, 3), np.uint8)], 1, "mpeg4"),
    }[name]
    with KimiVisionClient(triton_server.grpc_url, "grpc", "kimi_k25_vision") as client:
        with pytest.raises(error, match=message) as raised:
            list(client.preprocess_video(data))
        assert raised.value.triton_code == "INVALID_ARG"
        assert client.is_ready()


def test_a_video_sent_to_an_image_model_is_invalid(triton_server: Any, long_clip: bytes) -> None:
    with KimiVisionClient(triton_server.grpc_url, "grpc", "kimi_k25_vision") as client:
        with pytest.raises(kvp.InvalidImageError, match="not a decodable image"):
            client.infer(long_clip)
        assert client.is_ready()


def test_truncated_video_sends_its_chunks_then_fails_or_ends(triton_server: Any, long_clip: bytes) -> None:
    """Cut mid-stream: whatever chunks are sent are the reference's for the decoded frames, or one
    typed error ends the stream; the server keeps serving."""
    cut = long_clip[: len(long_clip) * 2 // 3]
    with KimiVisionClient(triton_server.grpc_url, "grpc", "kimi_k3_vision") as client:
        received = []
        try:
            received.extend(client.preprocess_video(cut))
        except kvp.PreprocessError as exc:
            assert exc.triton_code == "INVALID_ARG"
        else:
            expected = reference.reference_video(cut, "kimi-k3")
            assert [c.frame_indices for c in received] == [c.frame_indices for c in expected]
        assert client.is_ready()


def test_cancelled_stream_stops_decoding(triton_server: Any, long_clip: bytes) -> None:
    before = frames_decoded(triton_server, "kimi_k3_video")
    with KimiVisionClient(triton_server.grpc_url, "grpc", "kimi_k3_vision") as client:
        chunks = client.preprocess_video(long_clip)
        next(chunks)
        chunks.close()  # cancels the request on the server
        complete = list(client.preprocess_video((VIDEO_DIR / "torchcodec__h265_video.mp4").read_bytes()))
        assert complete  # the model serves the next stream
    decoded = frames_decoded(triton_server, "kimi_k3_video") - before
    assert 0 < decoded < 300 + 10  # the long clip was not decoded to its end (the h265 clip has 10 frames)


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("prefix", sorted(PRESETS))
def test_video_chunk_model_equals_library(triton_server: Any, corpus: Path, protocol: str, prefix: str) -> None:
    preset = PRESETS[prefix]
    frames = [
        (corpus / n).read_bytes() for n in ("pil__exif-72dpi-int.jpg", "pil__hopper.jpg", "pilx__p_trns_single.png")
    ]
    expected = reference.reference_frames_chunk(frames, preset)
    module = PROTOCOLS[protocol]
    client = module.InferenceServerClient(url(triton_server, protocol))
    try:
        tensor = module.InferInput("FRAME_BYTES", [1, len(frames)], "BYTES")
        tensor.set_data_from_numpy(np.array([frames], dtype=np.object_))
        names = ("PIXEL_VALUES", "GRID_THW", "NUM_TOKENS")
        result = client.infer(
            f"{prefix}_video_chunk", [tensor], outputs=[module.InferRequestedOutput(n) for n in names]
        )
        assert np.array_equal(result.as_numpy("PIXEL_VALUES")[0], expected.pixel_values)
        assert result.as_numpy("GRID_THW").tolist() == [expected.grid_thw.tolist()]
        assert result.as_numpy("NUM_TOKENS").tolist() == [[expected.num_tokens]]
        patches = client.infer(
            f"{prefix}_video_chunk", [tensor], outputs=[module.InferRequestedOutput("PIXEL_PATCHES")]
        ).as_numpy("PIXEL_PATCHES")
        assert np.array_equal(kvp.pixel_values_from_patches(patches[0], preset), expected.pixel_values)
        bad = module.InferInput("FRAME_BYTES", [1, 2], "BYTES")
        bad.set_data_from_numpy(np.array([[frames[0], b"broken"]], dtype=np.object_))
        with pytest.raises(InferenceServerException, match="frame 1: "):
            client.infer(f"{prefix}_video_chunk", [bad])
    finally:
        client.close()


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("prefix", sorted(PRESETS))
def test_tokens_model_equals_full_preprocessing(triton_server: Any, corpus: Path, protocol: str, prefix: str) -> None:
    preset = PRESETS[prefix]
    names = ["pil__hopper.jpg", "imagers__large_image.jpg", "pilx__p_trns_single.png", "pil__truncated_jpeg.jpg"]
    items = [(corpus / n).read_bytes() for n in names]
    with KimiVisionClient(url(triton_server, protocol), protocol, f"{prefix}_vision") as client:
        counts = client.count_tokens(items)
        with pytest.raises(kvp.InvalidImageError, match="image 1: "):
            client.count_tokens([items[0], b"not an image"])
    for data, count in zip(items, counts, strict=True):
        grid_thw, num_tokens, prompt = reference.reference_token_count(data, preset)
        assert (
            count.grid_thw.tolist() == grid_thw.tolist() and count.num_tokens == num_tokens and count.prompt == prompt
        )
    full = kvp.preprocess_images(items[:3], preset)  # the truncated one has a header but no pixels
    assert [c.grid_thw.tolist() for c in counts[:3]] == full.grid_thws.tolist()
    assert [c.num_tokens for c in counts[:3]] == full.num_tokens.tolist()
