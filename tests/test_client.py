"""KimiVisionClient: HTTP and gRPC, plain and shared memory, bit-equal to in-process preprocessing.

The server tests send corpus images to the real tritonserver (``triton_server`` fixture) and compare
every output with ``kimi_vision_prep.preprocess_bytes`` run here on the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc
import tritonclient.http
import tritonclient.utils
import tritonclient.utils.shared_memory as shm

from kimi_vision_client.client import (
    MODEL_PRESETS,
    PIXEL_VALUES,
    KimiVisionClient,
    VisionResult,
    error_from_server,
    image_size,
    largest_preset,
    output_byte_sizes,
    strip_scheme,
)
from kimi_vision_client.samples import sample_images
from kimi_vision_prep import (
    PRESETS,
    DecoderBusyError,
    InvalidImageError,
    PreprocessError,
    get_preset,
    preprocess_bytes,
)

# Varied routes: 4:2:0, grey, 4:2:2, CMYK JPEG; RGBA WebP, palette+tRNS PNG, I;16 PNG, a 1000x1 strip.
GOOD = [
    "pil__hopper.jpg",
    "pil__hopper_gray.jpg",
    "pil__iptc.jpg",
    "imagers__jpg-cmyk-2.jpg",
    "pilx__transparent.webp",
    "pilx__p_trns_single.png",
    "pilx__i_trns.png",
    "imagers__grayscale_large.jpg",
]
# Header unparsable; header fine but truncated data; zero bytes.
BAD = ["pilx__broken.png", "pil__truncated_jpeg.jpg", "imagers__empty.jpg"]
PROTOCOLS = ("http", "grpc")


def read(corpus: Path, names: list[str]) -> list[bytes]:
    return [(corpus / name).read_bytes() for name in names]


def in_process(data: bytes, model: str) -> VisionResult | PreprocessError:
    """What the server should return for ``data``: the library run here, or the error it raises."""
    try:
        result = preprocess_bytes(data, MODEL_PRESETS[model])
    except PreprocessError as exc:
        return exc
    return VisionResult(np.asarray(result.pixel_values), result.grid_thw, result.num_tokens)


def assert_same(got: VisionResult | PreprocessError, expected: VisionResult | PreprocessError, what: str) -> None:
    if isinstance(expected, PreprocessError):
        assert isinstance(got, InvalidImageError), f"{what}: expected InvalidImageError, got {got!r}"
        assert str(got) == str(expected), what
        return
    assert isinstance(got, VisionResult), f"{what}: {got!r}"
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.shape == expected.pixel_values.shape, what
    assert np.array_equal(got.pixel_values, expected.pixel_values), what
    assert got.grid_thw.dtype == np.int64 and got.grid_thw.tolist() == expected.grid_thw.tolist(), what
    assert got.num_tokens == expected.num_tokens, what


def url_of(server: object, protocol: str) -> str:
    return getattr(server, f"{protocol}_url")


def server_shm_regions(server: object, protocol: str) -> set[str]:
    """Names of the system shared-memory regions the server has registered."""
    url = strip_scheme(url_of(server, protocol))
    if protocol == "http":
        with tritonclient.http.InferenceServerClient(url) as client:
            return {region["name"] for region in client.get_system_shared_memory_status()}
    with tritonclient.grpc.InferenceServerClient(url) as client:
        return set(client.get_system_shared_memory_status(as_json=True).get("regions", {}))


# -- without a server ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        ("400", InvalidImageError),
        ("StatusCode.INVALID_ARGUMENT", InvalidImageError),
        ("503", DecoderBusyError),
        ("StatusCode.UNAVAILABLE", DecoderBusyError),
        ("500", PreprocessError),
        ("StatusCode.INTERNAL", PreprocessError),
    ],
)
def test_server_status_maps_onto_the_error_hierarchy(status: str, error_type: type[PreprocessError]) -> None:
    server_error = tritonclient.utils.InferenceServerException("in ensemble 'm', bad bytes", status=status)
    error = error_from_server(server_error)
    assert type(error) is error_type
    assert str(error) == "bad bytes"


def test_transport_errors_become_preprocess_errors() -> None:
    error = error_from_server(ConnectionRefusedError("refused"))
    assert type(error) is PreprocessError and "refused" in str(error)


def test_output_byte_sizes_match_the_arrays_preprocessing_produces(corpus: Path) -> None:
    images = [*read(corpus, GOOD), *sample_images().values()]
    for preset_name in ("kimi-k2.5", "kimi-k3"):
        preset = get_preset(preset_name)
        for data in images:
            result = preprocess_bytes(data, preset)
            sizes = output_byte_sizes(*image_size(data), preset)
            assert sizes[PIXEL_VALUES] == np.asarray(result.pixel_values).nbytes


def test_largest_preset_bounds_every_registered_preset() -> None:
    largest = largest_preset()
    for width, height in [(640, 480), (4000, 3000), (100, 10000), (8000, 8000)]:
        bound = output_byte_sizes(width, height, largest)[PIXEL_VALUES]
        assert all(output_byte_sizes(width, height, p)[PIXEL_VALUES] <= bound for p in PRESETS.values())


def test_image_size_reads_the_header_only(corpus: Path) -> None:
    assert image_size((corpus / "pil__iptc.jpg").read_bytes()) == (640, 480)
    assert image_size(b"") is None
    assert image_size((corpus / "pilx__broken.png").read_bytes()) is None


def test_strip_scheme() -> None:
    assert strip_scheme("http://127.0.0.1:8000/") == "127.0.0.1:8000"
    assert strip_scheme("localhost:8001") == "localhost:8001"


def test_unknown_protocol_is_rejected() -> None:
    with pytest.raises(ValueError, match="protocol"):
        KimiVisionClient("localhost:8000", "websocket")  # type: ignore[arg-type]


# -- against the real server --------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("model", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_infer_many_is_bit_equal_to_in_process(triton_server: object, corpus: Path, protocol: str, model: str) -> None:
    names = [*GOOD[:4], BAD[0], *GOOD[4:], *BAD[1:]]
    images = read(corpus, names)
    with KimiVisionClient(url_of(triton_server, protocol), protocol, model) as client:
        results = client.infer_many(images, concurrency=3)
    assert len(results) == len(names)
    for name, data, got in zip(names, images, results, strict=True):
        assert_same(got, in_process(data, model), f"{protocol} {model} {name}")


@pytest.mark.server
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_infer_single_image_and_bad_image_message(triton_server: object, corpus: Path, protocol: str) -> None:
    good, bad = read(corpus, [GOOD[0], BAD[0]])
    with KimiVisionClient(url_of(triton_server, protocol), protocol) as client:
        assert_same(client.infer(good), in_process(good, "kimi_k25_vision"), protocol)
        with pytest.raises(InvalidImageError) as raised:
            client.infer(bad)
    with pytest.raises(InvalidImageError) as expected:
        preprocess_bytes(bad)
    assert str(raised.value) == str(expected.value)


@pytest.mark.server
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shared_memory_is_bit_equal_and_cleaned_up(triton_server: object, corpus: Path, protocol: str) -> None:
    model = "kimi_k3_vision"
    # Small, bad (no output size known / known but rejected), then large: regions are reused and grown.
    names = [GOOD[0], BAD[0], GOOD[4], BAD[1], GOOD[2]]
    images = [*read(corpus, names), sample_images()["large_resized.jpg"]]
    names.append("large_resized.jpg")
    with KimiVisionClient(url_of(triton_server, protocol), protocol, model, use_shared_memory=True) as client:
        results = client.infer_many(images, concurrency=2)
        # One input and one output region per request in flight; later requests reuse (and grow) them.
        assert len(client.shared_memory_regions) == 2 * 2
        again = [client.infer(images[-1]), client.infer(images[0])]
        regions = set(client.shared_memory_regions)
        assert len(regions) == 2 * 2
        assert regions <= server_shm_regions(triton_server, protocol)
    for name, data, got in zip(names, images, results, strict=True):
        assert_same(got, in_process(data, model), f"shm {protocol} {name}")
    for data, got in zip([images[-1], images[0]], again, strict=True):
        assert_same(got, in_process(data, model), f"shm {protocol} reuse")
    assert not regions & server_shm_regions(triton_server, protocol)
    assert not any(f"/{name}" in shm.mapped_shared_memory_regions() for name in regions)
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in regions)
