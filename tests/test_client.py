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

from kimi_vision_client.cli.samples import sample_images
from kimi_vision_client.client import (
    GRID_THW,
    NUM_TOKENS,
    PIXEL_PATCHES,
    PIXEL_VALUES,
    KimiVisionClient,
    VisionResult,
    Wire,
    error_from_server,
    image_size,
    largest_preset,
    learn_wire,
    output_byte_sizes,
    strip_scheme,
    to_vision_result,
)
from kimi_vision_common.errors import ConnectionLostError
from kimi_vision_common.wire import served_message
from kimi_vision_prep import (
    KIMI_K3,
    KIMI_K25,
    PRESETS,
    CancelledError,
    DecoderBusyError,
    ImageTooLargeError,
    InvalidImageError,
    InvalidRequestError,
    PreprocessError,
    UnsupportedImageError,
    get_preset,
    preprocess_bytes,
)
from kimi_vision_prep import preprocess_images as kvp_preprocess_images
from kimi_vision_server.render.repository import model_presets

MODEL_PRESETS = model_presets()  # served image model -> its preset, derived from the presets

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
    if isinstance(expected, PreprocessError):  # fails exactly like in process: same type, same message
        assert type(got) is type(expected), f"{what}: expected {type(expected).__name__}, got {got!r}"
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
    ("status", "raised"),
    [
        ("400", InvalidImageError("not a decodable image")),
        ("StatusCode.INVALID_ARGUMENT", UnsupportedImageError("cannot convert")),
        ("400", ImageTooLargeError("too large")),
        ("StatusCode.INVALID_ARGUMENT", InvalidRequestError("IMAGE_BYTES must have shape [1, 1]")),
        ("503", DecoderBusyError("all busy (request id gen-1)")),
        ("StatusCode.UNAVAILABLE", DecoderBusyError("all busy")),
        ("StatusCode.CANCELLED", CancelledError("request cancelled by the client")),
        ("500", PreprocessError("internal error: ValueError: bug")),
    ],
)
def test_served_errors_raise_the_in_process_type(status: str, raised: PreprocessError) -> None:
    """A served message starts with its class's tag (errors.served_message): the client raises that
    class with the library's message, through an ensemble's prefix too."""
    message = f"in ensemble 'm', {served_message(raised)}"
    error = error_from_server(tritonclient.utils.InferenceServerException(message, status=status))
    assert type(error) is type(raised) and str(error) == str(raised)


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        ("400", InvalidRequestError),
        ("StatusCode.INVALID_ARGUMENT", InvalidRequestError),
        ("503", ConnectionLostError),
        ("StatusCode.UNAVAILABLE", ConnectionLostError),
        ("500", PreprocessError),
    ],
)
def test_untagged_words_no_rule_names_map_by_code(status: str, error_type: type[PreprocessError]) -> None:
    """Untagged messages come from Triton or the transport: those kimi_vision_common.faults has no
    rule for take the class of their code (an unknown UNAVAILABLE: no answer is assumed)."""
    error = error_from_server(tritonclient.utils.InferenceServerException("some words", status=status))
    assert type(error) is error_type and str(error) == "some words"


def test_transport_errors_are_a_lost_connection() -> None:
    error = error_from_server(ConnectionRefusedError("[Errno 111] Connection refused"))
    assert type(error) is ConnectionLostError and "connection refused" in str(error)


def test_output_bytes_received_can_be_reset_between_measurements() -> None:
    """A plain attribute a caller may set (a benchmark zeroes it between rounds); the count the
    client keeps is the one set."""
    client = KimiVisionClient("127.0.0.1:1", "grpc")
    try:
        client.output_bytes_received = 5
        assert client.output_bytes_received == 5
        client.output_bytes_received = 0
        assert client.output_bytes_received == 0
    finally:
        client.close()


def test_output_byte_sizes_match_the_arrays_preprocessing_produces(corpus: Path) -> None:
    images = [*read(corpus, GOOD), *sample_images().values()]
    for preset_name in ("kimi-k2.5", "kimi-k3"):
        preset = get_preset(preset_name)
        for data in images:
            result = preprocess_bytes(data, preset)
            sizes = output_byte_sizes([image_size(data)], preset)
            assert sizes[PIXEL_VALUES] == np.asarray(result.pixel_values).nbytes
            u8_sizes = output_byte_sizes([image_size(data)], preset, PIXEL_PATCHES)
            patches = preprocess_bytes(data, preset, output="pixel_patches").pixel_patches
            assert list(u8_sizes) == [PIXEL_PATCHES, GRID_THW, NUM_TOKENS]
            assert u8_sizes[PIXEL_PATCHES] == patches.nbytes == sizes[PIXEL_VALUES] // 4


# Model configs as the server returns them (JSON), for learn_wire without a server.
def _step(model: str, pixels: str) -> dict:
    return {
        "model_name": model,
        "output_map": {pixels: pixels, "GRID_THW": "GRID_THW", "NUM_TOKENS": "NUM_TOKENS"},
    }


def _ensemble(name: str, pixels: str, prep: str) -> dict:
    outputs = [{"name": n} for n in (pixels, "GRID_THW", "NUM_TOKENS")]
    steps = [{"model_name": "decode", "output_map": {"IMAGE": "image"}}, _step(prep, pixels)]
    return {"name": name, "output": outputs, "ensemble_scheduling": {"step": steps}}


def _preprocess(name: str, **parameters: str) -> dict:
    outputs = [{"name": n} for n in ("PIXEL_VALUES", "PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS")]
    return {"name": name, "output": outputs, "parameters": {k: {"string_value": v} for k, v in parameters.items()}}


CONFIGS = {
    c["name"]: c
    for c in [
        _ensemble("kimi_k3_vision_u8", PIXEL_PATCHES, "prep_k3"),
        _ensemble("kimi_k3_vision", PIXEL_VALUES, "prep_k3"),
        _ensemble("custom_u8", PIXEL_PATCHES, "prep_custom"),
        _ensemble("bare_u8", PIXEL_PATCHES, "prep_bare"),
        _ensemble("bare_f32", PIXEL_VALUES, "prep_bare"),
        _ensemble("kimi_k25_vision_u8", PIXEL_PATCHES, "prep_bare"),
        _preprocess("prep_k3", preset="kimi-k3"),
        _preprocess("prep_custom", preset="kimi-k2.5", image_mean="0.1,0.2,0.3", image_std="0.4,0.5,0.6"),
        _preprocess("prep_bare"),
        # Single models with both pixel outputs (a custom decode + preprocess model): their own parameters.
        _preprocess("fused_k3", preset="kimi-k3", cpu_decode_threads="1"),
        _preprocess("fused_custom", preset="kimi-k2.5", image_mean="0.1,0.2,0.3", image_std="0.4,0.5,0.6"),
        _preprocess("fused_bare"),
    ]
}


def test_learn_wire_from_model_configs() -> None:
    """The wire comes from the model's outputs, the preset from the config of the model producing
    the pixels (so customised mean/std expand correctly); fallbacks never guess a uint8 table."""
    asked: list[str] = []

    def get_config(name: str) -> dict:
        asked.append(name)
        return CONFIGS[name]

    assert learn_wire(get_config, "kimi_k3_vision_u8") == Wire(PIXEL_PATCHES, KIMI_K3)
    assert asked == ["kimi_k3_vision_u8", "prep_k3"]
    assert learn_wire(get_config, "kimi_k3_vision") == Wire(PIXEL_VALUES, KIMI_K3)
    custom = learn_wire(get_config, "custom_u8").preset
    assert (custom.image_mean, custom.image_std) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert learn_wire(get_config, "custom_u8", KIMI_K25) == Wire(PIXEL_PATCHES, KIMI_K25)  # given: used as is
    # No preset in the server's config: the largest (float32 sizing only), whatever the model's name ...
    assert learn_wire(get_config, "bare_f32") == Wire(PIXEL_VALUES, largest_preset())
    # ... but never a guessed table for uint8 (the client keeps no table of model names).
    for model in ("bare_u8", "kimi_k25_vision_u8"):
        with pytest.raises(PreprocessError, match="preset="):
            learn_wire(get_config, model)
    assert learn_wire(get_config, "bare_u8", KIMI_K3).preset == KIMI_K3


def test_learn_wire_of_a_single_model_with_both_pixel_outputs() -> None:
    """A single model offering PIXEL_PATCHES and PIXEL_VALUES is read over uint8 with
    the preset of its own parameters (no ensemble to follow); only when no preset is known at all
    does the client fall back to its float32 output rather than guess a table."""
    asked: list[str] = []

    def get_config(name: str) -> dict:
        asked.append(name)
        return CONFIGS[name]

    assert learn_wire(get_config, "fused_k3") == Wire(PIXEL_PATCHES, KIMI_K3)
    assert asked == ["fused_k3"]
    custom = learn_wire(get_config, "fused_custom")
    assert custom.pixel_output == PIXEL_PATCHES
    assert (custom.preset.image_mean, custom.preset.image_std) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert learn_wire(get_config, "fused_bare") == Wire(PIXEL_VALUES, largest_preset())
    assert learn_wire(get_config, "fused_bare", KIMI_K3) == Wire(PIXEL_PATCHES, KIMI_K3)


def test_to_vision_result_expands_patches(corpus: Path) -> None:
    data = (corpus / "pilx__p_trns_single.png").read_bytes()
    expected = preprocess_bytes(data, "kimi-k3")
    patches = preprocess_bytes(data, "kimi-k3", output="pixel_patches").pixel_patches
    outputs = {
        PIXEL_PATCHES: patches[None],
        GRID_THW: expected.grid_thw[None],
        NUM_TOKENS: np.array([[expected.num_tokens]], np.int32),
    }
    result = to_vision_result(outputs, KIMI_K3)
    assert result.pixel_values.tobytes() == expected.pixel_values.tobytes()
    assert result.grid_thw.tolist() == expected.grid_thw.tolist() and result.num_tokens == expected.num_tokens
    with pytest.raises(ValueError, match="preset"):
        to_vision_result(outputs)


def test_largest_preset_bounds_every_registered_preset() -> None:
    largest = largest_preset()
    for width, height in [(640, 480), (4000, 3000), (100, 10000), (8000, 8000)]:
        bound = output_byte_sizes([(width, height)], largest)[PIXEL_VALUES]
        assert all(output_byte_sizes([(width, height)], p)[PIXEL_VALUES] <= bound for p in PRESETS.values())


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
@pytest.mark.parametrize("shm", [False, True], ids=["wire", "shm"])
@pytest.mark.parametrize(
    "model", ["kimi_k25_vision_u8", "kimi_k3_vision_u8", "kimi_k25_vision_fused_u8", "kimi_k3_vision_fused_u8"]
)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_u8_wire_is_learnt_and_receives_a_quarter(
    triton_server: object, corpus: Path, protocol: str, model: str, shm: bool
) -> None:
    """A ``*_vision_u8`` ensemble, and a ``*_vision_fused_u8`` model, is served over
    the uint8 wire (learnt from the server): the client receives uint8 patches, a quarter of the
    float32 bytes, and returns the same float32 pixel_values."""
    good = read(corpus, GOOD[:3])
    with KimiVisionClient(url_of(triton_server, protocol), protocol, model, shm) as client:
        assert client.wire == Wire(PIXEL_PATCHES, get_preset(MODEL_PRESETS[model]))
        results = client.infer_many(good, concurrency=2)
        received = client.output_bytes_received
    expected = [in_process(data, model) for data in good]
    for got, want in zip(results, expected, strict=True):
        assert_same(got, want, f"{protocol} {model}")
    pixel_bytes = sum(r.pixel_values.nbytes for r in expected)
    assert received == pixel_bytes // 4 + len(good) * (3 * 8 + 4)


@pytest.mark.server
@pytest.mark.parametrize("model", ["kimi_k3_vision", "kimi_k25_vision_u8", "kimi_k3_vision_u8", "kimi_k3_vision_fused"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shared_memory_is_bit_equal_and_cleaned_up(
    triton_server: object, corpus: Path, protocol: str, model: str
) -> None:
    # Small, bad (no output size known / known but rejected), then large: regions are reused and grown.
    names = [GOOD[0], BAD[0], GOOD[4], BAD[1], GOOD[2]]
    images = [*read(corpus, names), sample_images()["large_resized.jpg"]]
    names.append("large_resized.jpg")
    with KimiVisionClient(url_of(triton_server, protocol), protocol, model, use_shared_memory=True) as client:
        results = client.infer_many(images, concurrency=2)
        # One region (input, then outputs) per request in flight; later requests reuse (and grow) them.
        assert len(client.shared_memory_regions) == 2
        again = [client.infer(images[-1]), client.infer(images[0])]
        regions = set(client.shared_memory_regions)
        assert len(regions) == 2
        assert regions <= server_shm_regions(triton_server, protocol)
    for name, data, got in zip(names, images, results, strict=True):
        assert_same(got, in_process(data, model), f"shm {protocol} {name}")
    for data, got in zip([images[-1], images[0]], again, strict=True):
        assert_same(got, in_process(data, model), f"shm {protocol} reuse")
    assert not regions & server_shm_regions(triton_server, protocol)
    assert not any(f"/{name}" in shm.mapped_shared_memory_regions() for name in regions)
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in regions)


@pytest.mark.server
@pytest.mark.parametrize("shm", [False, True], ids=["wire", "shm"])
@pytest.mark.parametrize("model", ["kimi_k25_vision", "kimi_k3_vision_u8", "kimi_k3_vision_fused"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_preprocess_images_in_one_request(
    triton_server: object, corpus: Path, protocol: str, model: str, shm: bool
) -> None:
    """K images, one request: equal to kimi_vision_prep.preprocess_images, errors included."""
    items = read(corpus, GOOD[:5])
    preset = MODEL_PRESETS[model]
    expected = kvp_preprocess_images(items, preset)
    with KimiVisionClient(url_of(triton_server, protocol), protocol, model, shm) as client:
        got = client.preprocess_images(items)
        assert got.pixel_values.dtype == np.float32 and np.array_equal(got.pixel_values, expected.pixel_values)
        assert got.grid_thws.tolist() == expected.grid_thws.tolist()
        assert got.num_tokens.tolist() == expected.num_tokens.tolist()
        bad = [items[0], *read(corpus, BAD[1:2])]
        with pytest.raises(PreprocessError) as raised:
            client.preprocess_images(bad)
    with pytest.raises(PreprocessError) as in_process:
        kvp_preprocess_images(bad, preset)
    assert type(raised.value) is type(in_process.value) and str(raised.value) == str(in_process.value)
    assert str(raised.value).startswith("image 1: ")


@pytest.mark.server
def test_a_grown_slot_leaves_its_old_region_registered_until_the_next_answer(triton_server: object) -> None:
    """The server may still hold a region a moment after it answered the request that used it
    ("currently in use"), so growing a slot unlinks the old region here at once and unregisters it
    from the server only after the next answer."""
    from kimi_vision_client.request.shm_slots import SharedMemoryPool
    from kimi_vision_client.transport.adapters import GrpcAdapter
    from kimi_vision_client.transport.deadline import Deadline

    url = strip_scheme(url_of(triton_server, "grpc"))
    with tritonclient.grpc.InferenceServerClient(url) as client:
        pool = SharedMemoryPool(GrpcAdapter(), None, True)
        slot = pool.slot_for(client, 100, 100, Deadline.after(30))
        small = slot.region.name
        pool.answered(slot)
        grown = pool.slot_for(client, 1 << 20, 1 << 20, Deadline.after(30))
        assert grown is slot and slot.region.name != small and pool.region_names == [slot.region.name]
        assert {small, slot.region.name} <= server_shm_regions(triton_server, "grpc")
        assert not os.path.exists(f"/dev/shm/{small}")
        pool.answered(slot)
        pool.unregister_retired(client, Deadline.after(30))
        assert small not in server_shm_regions(triton_server, "grpc")
        big = slot.region.name
        pool.close(client, Deadline.after(30))
    assert not {small, big} & server_shm_regions(triton_server, "grpc")
    assert not os.path.exists(f"/dev/shm/{big}")
