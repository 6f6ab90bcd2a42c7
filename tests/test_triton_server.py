"""The Triton deployment end to end: a real embedded tritonserver, real tritonclient HTTP and gRPC.

Every expected value is computed in-process by the library (``preprocess_bytes``) or by torch;
nothing the server produced is hard-coded. Tests run in file order and the last ones check that
the server survived everything before them.
"""

from __future__ import annotations

import io
import queue
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from make_inputs import corpus_names
from PIL import Image
from reference import PRESETS as REF_PRESETS
from reference import k25_rgb, ref_size
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from kimi_vision_common.wire import served_message
from kimi_vision_prep import PreprocessError, pixel_values_from_patches, preprocess_bytes, preprocess_images
from kimi_vision_server.allocator import SERVER_ONLY_ENV, server_allocator_env

pytestmark = pytest.mark.server

MODELS = [
    "kimi_k25_decode",
    "kimi_k3_decode",
    "kimi_k25_preprocess",
    "kimi_k3_preprocess",
    "kimi_k25_vision",
    "kimi_k3_vision",
    "kimi_k25_vision_u8",
    "kimi_k3_vision_u8",
    "kimi_k25_vision_fused",
    "kimi_k3_vision_fused",
    "kimi_k25_vision_fused_u8",
    "kimi_k3_vision_fused_u8",
    "kimi_patch_embed",
    "kimi_k25_vision_embed",
]
ENSEMBLES = {"kimi_k25_vision": "kimi-k2.5", "kimi_k3_vision": "kimi-k3"}
U8_ENSEMBLES = {"kimi_k25_vision_u8": "kimi-k2.5", "kimi_k3_vision_u8": "kimi-k3"}
FUSED = {"kimi_k25_vision_fused": "kimi-k2.5", "kimi_k3_vision_fused": "kimi-k3"}  # decode + preprocess, one model
FUSED_U8 = {f"{model}_u8": preset for model, preset in FUSED.items()}  # the same over the uint8 wire
VISION_OUTPUTS = ["PIXEL_VALUES", "GRID_THW", "NUM_TOKENS"]
U8_OUTPUTS = ["PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS"]
ALL_OUTPUTS = ["PIXEL_VALUES", "PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS"]
IMAGES = [
    "pil__hopper.jpg",  # baseline 4:2:0 RGB: the nvImageCodec route
    "imagers__large_image.jpg",  # 2268x1512: resized under K2.5
    "pil__pil_sample_cmyk.jpg",  # Adobe CMYK JPEG: Pillow route
    "imagers__tower_grayscale.jpg",  # L
    "pilx__uncompressed_la.png",  # grey + alpha
    "pilx__p_trns_single.png",  # palette with a transparent index: nearest + chessboard under K3
    "pilx__transparent.gif",
]
PROTOCOLS = {"http": httpclient, "grpc": grpcclient}


def read(corpus: Path, name: str) -> bytes:
    return (corpus / name).read_bytes()


def client_for(server: Any, protocol: str) -> Any:
    module = PROTOCOLS[protocol]
    return module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)


def bytes_input(protocol: str, data: bytes) -> Any:
    tensor = PROTOCOLS[protocol].InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
    return tensor


def infer(server: Any, protocol: str, model: str, data: bytes, outputs: list[str] = VISION_OUTPUTS) -> dict:
    """Send one image; returns the named outputs as numpy arrays (batch dim included)."""
    client = client_for(server, protocol)
    try:
        requested = [PROTOCOLS[protocol].InferRequestedOutput(name) for name in outputs]
        result = client.infer(model, [bytes_input(protocol, data)], outputs=requested)
        return {name: result.as_numpy(name) for name in outputs}
    finally:
        client.close()


def assert_matches_library(outputs: dict, data: bytes, preset: str) -> None:
    """Server outputs (leading batch dim of 1) are bit-equal to the in-process library."""
    expected = preprocess_bytes(data, preset)
    pixel_values = outputs["PIXEL_VALUES"]
    assert pixel_values.dtype == np.float32 and pixel_values.shape[0] == 1
    np.testing.assert_array_equal(pixel_values[0], expected.pixel_values)
    assert outputs["GRID_THW"].dtype == np.int64
    assert outputs["GRID_THW"].shape == (1, 1, 3)
    np.testing.assert_array_equal(outputs["GRID_THW"][0, 0], expected.grid_thw)
    assert outputs["NUM_TOKENS"].dtype == np.int32
    assert int(outputs["NUM_TOKENS"][0, 0]) == expected.num_tokens


def assert_u8_matches_library(outputs: dict, data: bytes, preset: str) -> None:
    """uint8 ensemble outputs equal the library's ``pixel_patches``, and expanded with the preset's
    table they equal its float32 ``pixel_values`` bit for bit."""
    expected = preprocess_bytes(data, preset)
    patches = outputs["PIXEL_PATCHES"]
    assert patches.dtype == np.uint8 and patches.shape == (1, *expected.pixel_values.shape)
    np.testing.assert_array_equal(patches[0], preprocess_bytes(data, preset, output="pixel_patches").pixel_patches)
    assert pixel_values_from_patches(patches[0], preset).tobytes() == expected.pixel_values.tobytes()
    assert outputs["GRID_THW"].dtype == np.int64
    assert outputs["GRID_THW"].shape == (1, 1, 3)
    np.testing.assert_array_equal(outputs["GRID_THW"][0, 0], expected.grid_thw)
    assert outputs["NUM_TOKENS"].dtype == np.int32
    assert int(outputs["NUM_TOKENS"][0, 0]) == expected.num_tokens


def images_input(protocol: str, items: list[bytes]) -> Any:
    """``IMAGE_BYTES [1, K]``: several images in one request."""
    tensor = PROTOCOLS[protocol].InferInput("IMAGE_BYTES", [1, len(items)], "BYTES")
    tensor.set_data_from_numpy(np.array([items], dtype=np.object_))
    return tensor


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_several_images_per_request(triton_server: Any, corpus: Path, protocol: str) -> None:
    """IMAGE_BYTES [1, K]: one response with ΣN patches, GRID_THW [1, K, 3] and NUM_TOKENS [1, K],
    equal to preprocess_images; requests of different K in flight together each get their own
    answer; a bad image fails its own request only, naming its index."""
    items = [read(corpus, name) for name in IMAGES[:5]]
    bad = [items[0], read(corpus, "pil__truncated_jpeg.jpg")]
    client = client_for(triton_server, protocol)
    try:
        for model, preset in {**ENSEMBLES, **U8_ENSEMBLES, **FUSED, **FUSED_U8}.items():
            expected = preprocess_images(items, preset)
            names = U8_OUTPUTS if model in {**U8_ENSEMBLES, **FUSED_U8} else VISION_OUTPUTS
            requested = [PROTOCOLS[protocol].InferRequestedOutput(n) for n in names]
            sizes = (5, 1, 3, 2)
            with ThreadPoolExecutor(len(sizes)) as pool:
                send = [client_for(triton_server, protocol).infer for _ in sizes]  # a client per thread
                futures = [
                    pool.submit(infer_k, model, [images_input(protocol, items[:k])], outputs=requested)
                    for infer_k, k in zip(send, sizes, strict=True)
                ]
                results = [future.result() for future in futures]
            for k, result in zip(sizes, results, strict=True):
                subset = preprocess_images(items[:k], preset)
                pixels = result.as_numpy(names[0])
                if names[0] == "PIXEL_PATCHES":
                    pixels = pixel_values_from_patches(pixels[0], preset)[None]
                assert pixels.shape[0] == 1 and np.array_equal(pixels[0], subset.pixel_values), (model, k)
                assert result.as_numpy("GRID_THW").tolist() == [subset.grid_thws.tolist()], (model, k)
                assert result.as_numpy("NUM_TOKENS").tolist() == [subset.num_tokens.tolist()], (model, k)
            assert len(expected.num_tokens) == 5
            with pytest.raises(InferenceServerException) as info:
                client.infer(model, [images_input(protocol, bad)], outputs=requested)
            with pytest.raises(PreprocessError) as in_process:
                preprocess_images(bad, preset)
            assert is_invalid_arg(info.value) and served_message(in_process.value) in str(info.value), model
            assert "image 1: " in str(info.value)
    finally:
        client.close()


def is_invalid_arg(exc: InferenceServerException) -> bool:
    """INVALID_ARG as each protocol reports it (HTTP 400, gRPC INVALID_ARGUMENT)."""
    return exc.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def assert_all_ready(client: Any) -> None:
    """The server and every model ready, through ``client`` (HTTP or gRPC; closed here)."""
    try:
        assert client.is_server_ready()
        for model in MODELS:
            assert client.is_model_ready(model), model
    finally:
        client.close()


def test_all_models_ready(triton_server: Any) -> None:
    assert_all_ready(httpclient.InferenceServerClient(triton_server.http_url))


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("model", sorted(ENSEMBLES))
def test_ensemble_bit_equal_to_library(triton_server: Any, corpus: Path, protocol: str, model: str) -> None:
    for name in IMAGES:
        data = read(corpus, name)
        assert_matches_library(infer(triton_server, protocol, model, data), data, ENSEMBLES[model])


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("model", sorted(U8_ENSEMBLES))
def test_u8_ensemble_expands_bit_equal_to_library(triton_server: Any, corpus: Path, protocol: str, model: str) -> None:
    """The uint8 wire: downscaled, CMYK, grey, LA / palette / GIF transparency (chessboard under K3)."""
    for name in IMAGES:
        data = read(corpus, name)
        assert_u8_matches_library(infer(triton_server, protocol, model, data, U8_OUTPUTS), data, U8_ENSEMBLES[model])


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("model", sorted({**FUSED, **FUSED_U8}))
def test_fused_model_bit_equal_to_library(triton_server: Any, corpus: Path, protocol: str, model: str) -> None:
    """The fused models: PIXEL_VALUES (``_vision_fused``) or PIXEL_PATCHES (``_vision_fused_u8``)
    bit-equal to in-process preprocessing (downscaled, CMYK, grey, LA / palette / GIF transparency:
    chessboard under K3); naming no outputs returns that one pixel tensor with grid and tokens,
    naming some returns only those, and the other pixel output is not offered."""
    client = client_for(triton_server, protocol)
    module = PROTOCOLS[protocol]
    preset, own = (FUSED_U8[model], U8_OUTPUTS) if model in FUSED_U8 else (FUSED[model], VISION_OUTPUTS)
    matches_library = assert_u8_matches_library if model in FUSED_U8 else assert_matches_library
    try:
        for name in IMAGES:
            data = read(corpus, name)
            result = client.infer(model, [bytes_input(protocol, data)])  # no outputs named: the config's
            assert [n for n in ALL_OUTPUTS if result.as_numpy(n) is not None] == [n for n in ALL_OUTPUTS if n in own]
            matches_library({n: result.as_numpy(n) for n in own}, data, preset)
        data = read(corpus, "pilx__p_trns_single.png")
        for names in (own, ["GRID_THW"]):
            requested = [module.InferRequestedOutput(n) for n in names]
            result = client.infer(model, [bytes_input(protocol, data)], outputs=requested)
            assert [n for n in ALL_OUTPUTS if result.as_numpy(n) is not None] == [n for n in ALL_OUTPUTS if n in names]
        expected = preprocess_bytes(data, preset)
        np.testing.assert_array_equal(result.as_numpy("GRID_THW")[0, 0], expected.grid_thw)
        other = ({"PIXEL_VALUES", "PIXEL_PATCHES"} - set(own)).pop()
        with pytest.raises(InferenceServerException, match=other):
            client.infer(model, [bytes_input(protocol, data)], outputs=[module.InferRequestedOutput(other)])
    finally:
        client.close()


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_outputs_named_or_not(triton_server: Any, corpus: Path, protocol: str) -> None:
    """Naming no outputs returns all of a model's; naming some returns only those (the preprocess
    model computes only what was requested, see PreprocessModel)."""
    data = read(corpus, "pil__hopper.jpg")
    client = client_for(triton_server, protocol)
    try:
        result = client.infer("kimi_k3_vision_u8", [bytes_input(protocol, data)])
        outputs = {name: result.as_numpy(name) for name in U8_OUTPUTS}
        assert_u8_matches_library(outputs, data, "kimi-k3")
        assert result.as_numpy("PIXEL_VALUES") is None
        handed_over = ["IMAGE", "IMAGE_SHAPES", "MODE", "RESAMPLE", "STORED_SIZES"]  # the ensembles' hop
        decoded = infer(triton_server, protocol, "kimi_k3_decode", data, handed_over)
        module = PROTOCOLS[protocol]
        inputs = []
        for name, value in decoded.items():
            tensor = module.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        expected = preprocess_bytes(data, "kimi-k3")
        everything = client.infer("kimi_k3_preprocess", inputs)
        assert_matches_library({n: everything.as_numpy(n) for n in VISION_OUTPUTS}, data, "kimi-k3")
        assert_u8_matches_library({n: everything.as_numpy(n) for n in U8_OUTPUTS}, data, "kimi-k3")
        only = client.infer("kimi_k3_preprocess", inputs, outputs=[module.InferRequestedOutput("GRID_THW")])
        np.testing.assert_array_equal(only.as_numpy("GRID_THW")[0, 0], expected.grid_thw)
        assert all(only.as_numpy(n) is None for n in ("PIXEL_VALUES", "PIXEL_PATCHES", "NUM_TOKENS"))
    finally:
        client.close()


def test_decode_model_outputs(triton_server: Any, corpus: Path) -> None:
    """The decode model on its own: each image decoded and resized to its NaViT size exactly as
    Pillow does, its stored size, resample flag, path label and pixel layout."""
    outputs = ["IMAGE", "IMAGE_SHAPES", "MODE", "RESAMPLE", "STORED_SIZES", "DECODE_PATH"]
    jpeg = infer(triton_server, "grpc", "kimi_k25_decode", read(corpus, "imagers__rgb.jpg"), outputs)
    assert jpeg["IMAGE"].dtype == np.uint8 and jpeg["IMAGE"].shape == (1, 333 * 500 * 3)
    assert jpeg["MODE"][0, 0] == b"RGB"
    assert jpeg["IMAGE_SHAPES"].tolist() == [[[333, 500, 3, 0]]]  # height, width, channels, offset
    assert jpeg["STORED_SIZES"].tolist() == [[[333, 500]]]  # K2.5 keeps it at its stored size
    np.testing.assert_array_equal(jpeg["RESAMPLE"], [[0]])
    assert jpeg["DECODE_PATH"][0, 0] in (b"libjpeg", b"nvimgcodec-cuda")
    data = read(corpus, "imagers__large_image.jpg")
    large = infer(triton_server, "http", "kimi_k25_decode", data, outputs)
    stored = Image.open(io.BytesIO(data))
    size = ref_size(stored.width, stored.height, REF_PRESETS["kimi-k2.5"])  # the reference's size rule
    assert (size.new_w, size.new_h) < stored.size
    assert large["STORED_SIZES"].tolist() == [[[stored.height, stored.width]]]
    assert large["IMAGE_SHAPES"].tolist() == [[[size.new_h, size.new_w, 3, 0]]]
    expected = k25_rgb(stored, size)  # the reference's Pillow decode and BICUBIC
    np.testing.assert_array_equal(large["IMAGE"].reshape(expected.shape), expected)
    palette = infer(triton_server, "http", "kimi_k3_decode", read(corpus, "pilx__p_trns_single.png"), outputs)
    assert palette["IMAGE_SHAPES"].tolist() == [[[64, 64, 3, 0]]] and palette["MODE"][0, 0] == b"RGB"  # composited
    np.testing.assert_array_equal(palette["RESAMPLE"], [[1]])  # nearest
    assert palette["DECODE_PATH"][0, 0] == b"pillow"


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_patch_embed_chain_equals_torch(triton_server: Any, corpus: Path, protocol: str) -> None:
    import torch

    torch.manual_seed(0)  # the seed documented in kimi_patch_embed/config.pbtxt
    conv = torch.nn.Conv2d(3, 1152, kernel_size=14, stride=14)
    for name in ("pil__hopper.jpg", "pilx__transparent.gif"):
        data = read(corpus, name)
        outputs = infer(
            triton_server, protocol, "kimi_k25_vision_embed", data, ["PATCH_EMBEDS", "GRID_THW", "NUM_TOKENS"]
        )
        expected = preprocess_bytes(data, "kimi-k2.5")
        with torch.inference_mode():
            embeds = conv(torch.from_numpy(expected.pixel_values)).flatten(1).numpy()
        assert outputs["PATCH_EMBEDS"].shape == (1, *embeds.shape)
        # Same weights, same input; oneDNN may block the reduction differently across thread counts.
        np.testing.assert_allclose(outputs["PATCH_EMBEDS"][0], embeds, rtol=1e-5, atol=1e-5)
        assert outputs["GRID_THW"].shape == (1, 1, 3)
        np.testing.assert_array_equal(outputs["GRID_THW"][0, 0], expected.grid_thw)
        assert int(outputs["NUM_TOKENS"][0, 0]) == expected.num_tokens


def test_32_concurrent_requests(triton_server: Any, corpus: Path) -> None:
    jobs = [(("grpc", "http")[i % 2], sorted(ENSEMBLES)[(i // 2) % 2], IMAGES[i % len(IMAGES)]) for i in range(32)]

    def run(job: tuple[str, str, str]) -> tuple[dict, bytes, str]:
        protocol, model, name = job
        data = read(corpus, name)
        return infer(triton_server, protocol, model, data), data, ENSEMBLES[model]

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(run, jobs))
    assert len(results) == 32
    for outputs, data, preset in results:
        assert_matches_library(outputs, data, preset)


def test_rejected_files_fail_alone_among_concurrent_requests(triton_server: Any, corpus: Path) -> None:
    """Every file Pillow rejects gets INVALID_ARG for its own request; good requests in flight at the
    same time (async gRPC) succeed bit-exactly. A CPU rendering's decode step takes one request an
    execute (its working set is bounded by one request, docs/security.md): each answered alone."""
    rejected = corpus_names(accepted=False)
    assert rejected
    good = IMAGES[:4]
    jobs: list[tuple[str, str, bool]] = []  # (model, file, expected ok)
    for i, name in enumerate(rejected):
        model = sorted(ENSEMBLES)[i % 2]
        jobs.append((model, name, False))
        jobs.append((model, good[i % len(good)], True))
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    stats_before = client.get_inference_statistics("kimi_k25_decode", as_json=True)
    done: queue.Queue = queue.Queue()
    try:
        for index, (model, name, _) in enumerate(jobs):
            client.async_infer(
                model,
                [bytes_input("grpc", read(corpus, name))],
                callback=lambda result, error, index=index: done.put((index, result, error)),
                outputs=[grpcclient.InferRequestedOutput(n) for n in VISION_OUTPUTS],
            )
        answers = {}
        for _ in jobs:
            index, result, error = done.get(timeout=120)
            answers[index] = (result, error)
        stats_after = client.get_inference_statistics("kimi_k25_decode", as_json=True)
    finally:
        client.close()
    for index, (model, name, ok) in enumerate(jobs):
        result, error = answers[index]
        if ok:
            assert error is None, f"{name}: {error}"
            outputs = {n: result.as_numpy(n) for n in VISION_OUTPUTS}
            assert_matches_library(outputs, read(corpus, name), ENSEMBLES[model])
        else:
            assert result is None and error is not None, f"{name} was accepted"
            assert is_invalid_arg(error), f"{name}: {error.status()} {error}"

    # The decode step saw every request of the k25 half, one request an execute.
    def counts(stats: dict) -> tuple[int, int]:
        model = stats["model_stats"][0]
        return int(model.get("inference_count", 0)), int(model.get("execution_count", 0))

    inferences = counts(stats_after)[0] - counts(stats_before)[0]
    executions = counts(stats_after)[1] - counts(stats_before)[1]
    assert inferences == len(jobs) // 2 and executions == inferences


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("family", ["u8", "fused"])
def test_u8_bad_image_fails_alone(triton_server: Any, corpus: Path, protocol: str, family: str) -> None:
    """In the uint8 ensembles and in the fused models (asked for PIXEL_PATCHES, as KimiVisionClient
    does) a bad image gets INVALID_ARG (with the library's message) while the good requests around
    it, in flight at the same time, succeed bit-exactly."""
    presets = U8_ENSEMBLES if family == "u8" else FUSED_U8
    bad = ["pil__truncated_jpeg.jpg", "pilx__broken.png"]
    jobs = [(model, name) for model in sorted(presets) for name in (IMAGES[0], bad[0], IMAGES[1], bad[1])]
    module = PROTOCOLS[protocol]
    if protocol == "http":  # a connection per request in flight, so the dynamic batcher can group them
        client = httpclient.InferenceServerClient(triton_server.http_url, concurrency=len(jobs))
    else:
        client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        if protocol == "grpc":
            done: queue.Queue = queue.Queue()
            for index, (model, name) in enumerate(jobs):
                client.async_infer(
                    model,
                    [bytes_input(protocol, read(corpus, name))],
                    callback=lambda result, error, index=index: done.put((index, result, error)),
                    outputs=[module.InferRequestedOutput(n) for n in U8_OUTPUTS],
                )
            answers = {}
            for _ in jobs:
                index, result, error = done.get(timeout=120)
                answers[index] = (result, error)
        else:
            requested = [module.InferRequestedOutput(n) for n in U8_OUTPUTS]
            pending = [
                client.async_infer(model, [bytes_input(protocol, read(corpus, name))], outputs=requested)
                for model, name in jobs
            ]
            answers = {}
            for index, request in enumerate(pending):
                try:
                    answers[index] = (request.get_result(), None)
                except InferenceServerException as error:
                    answers[index] = (None, error)
    finally:
        client.close()
    for index, (model, name) in enumerate(jobs):
        result, error = answers[index]
        data = read(corpus, name)
        if name in bad:
            assert result is None and error is not None and is_invalid_arg(error), f"{model} {name}: {error}"
            with pytest.raises(PreprocessError) as raised:
                preprocess_bytes(data, presets[model])
            assert str(raised.value) in str(error)
        else:
            assert error is None, f"{model} {name}: {error}"
            assert_u8_matches_library({n: result.as_numpy(n) for n in U8_OUTPUTS}, data, presets[model])
            assert result.as_numpy("PIXEL_VALUES") is None


def test_rejected_file_over_http_is_400(triton_server: Any, corpus: Path) -> None:
    with pytest.raises(InferenceServerException) as info:
        infer(triton_server, "http", "kimi_k25_vision", read(corpus, "pil__truncated_jpeg.jpg"))
    assert is_invalid_arg(info.value) and "truncated" in str(info.value)


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_wrong_dtype_and_shape_are_clear_errors(triton_server: Any, protocol: str, corpus: Path) -> None:
    module = PROTOCOLS[protocol]
    client = client_for(triton_server, protocol)
    data = read(corpus, "pil__hopper.jpg")

    def call(model: str, tensor: Any) -> InferenceServerException:
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, [tensor])
        return info.value

    try:
        wrong_dtype = module.InferInput("IMAGE_BYTES", [1, 1], "INT32")
        wrong_dtype.set_data_from_numpy(np.zeros((1, 1), dtype=np.int32))
        error = call("kimi_k25_vision", wrong_dtype)
        assert is_invalid_arg(error) and "IMAGE_BYTES" in str(error) and "BYTES" in str(error)

        wrong_shape = module.InferInput("IMAGE_BYTES", [1, 1, 1], "BYTES")  # [1, K] holds K images
        wrong_shape.set_data_from_numpy(np.array([[[data]]], dtype=np.object_))
        error = call("kimi_k25_vision", wrong_shape)
        assert is_invalid_arg(error) and "IMAGE_BYTES" in str(error) and "shape" in str(error)

        two_images = module.InferInput("IMAGE_BYTES", [2, 1], "BYTES")
        two_images.set_data_from_numpy(np.array([[data], [data]], dtype=np.object_))
        error = call("kimi_k3_vision", two_images)  # the pixel ensembles batch one request: Triton says so
        assert is_invalid_arg(error) and "batch-size must be <= 1" in str(error)
        error = call("kimi_k3_decode", two_images)  # a CPU rendering's decode batches one request too
        assert is_invalid_arg(error) and "batch-size must be <= 1" in str(error)
        error = call("kimi_k3_tokens", two_images)  # the tokens model batches 8: its own check answers
        assert is_invalid_arg(error) and "one request per batch element" in str(error)

        five_channels = module.InferInput("IMAGE", [1, 80], "UINT8")
        five_channels.set_data_from_numpy(np.zeros((1, 80), dtype=np.uint8))
        size = module.InferInput("IMAGE_SHAPES", [1, 1, 4], "INT64")
        size.set_data_from_numpy(np.array([[[4, 4, 5, 0]]], dtype=np.int64))
        resample = module.InferInput("RESAMPLE", [1, 1], "UINT8")
        resample.set_data_from_numpy(np.zeros((1, 1), dtype=np.uint8))
        mode = module.InferInput("MODE", [1, 1], "BYTES")
        mode.set_data_from_numpy(np.array([[b"RGB"]], dtype=np.object_))
        with pytest.raises(InferenceServerException) as info:
            client.infer("kimi_k25_preprocess", [five_channels, mode, size, resample])
        assert is_invalid_arg(info.value) and "IMAGE of MODE RGB must have C=3, got C=5" in str(info.value)
    finally:
        client.close()


def refuse_bad_bytes(server: Any, protocol: str, model: str) -> None:
    """Send bytes that are no image to ``model`` (an image model: every one returns GRID_THW): the
    decode step's INVALID_ARG for that request."""
    with pytest.raises(InferenceServerException) as info:
        infer(server, protocol, model, b"these bytes are not an image", ["GRID_THW"])
    assert is_invalid_arg(info.value) and "InvalidImageError" in str(info.value), info.value


def test_concurrent_clients_after_errors_still_match(triton_server: Any, corpus: Path) -> None:
    """Errors leave no state behind: after bad requests on both protocols, a concurrent burst on
    both still matches the library."""
    for protocol in PROTOCOLS:
        refuse_bad_bytes(triton_server, protocol, "kimi_k3_vision")
    barrier = threading.Barrier(4)

    def run(index: int) -> None:
        barrier.wait()
        protocol = ("http", "grpc")[index % 2]
        data = read(corpus, IMAGES[index])
        assert_matches_library(infer(triton_server, protocol, "kimi_k3_vision", data), data, "kimi-k3")

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(run, range(4)))


def kimi_counters(url: str) -> dict[str, float]:
    """Every ``kimi_prep_*`` series of the metrics endpoint: ``name{labels}`` -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("kimi_prep_")}


def grown(before: dict[str, float], after: dict[str, float], family: str, *labels: str) -> bool:
    """Whether the series of ``family`` carrying every one of ``labels`` grew between the two reads."""

    def total(counters: dict[str, float]) -> float:
        return sum(v for k, v in counters.items() if k.startswith(family + "{") and all(x in k for x in labels))

    return total(after) > total(before)


def test_metrics_count_decodes_errors_and_stage_seconds(triton_server: Any, corpus: Path) -> None:
    """The requests made here (a PNG: Pillow; a clean JPEG: libjpeg; bytes that are no image) move
    the decode, error and stage counters of the models they went through."""
    png, jpeg = read(corpus, "pilx__hopper.png"), read(corpus, "pil__hopper.jpg")
    models = ["kimi_k25_vision_embed", *FUSED_U8]
    before = kimi_counters(triton_server.metrics_url)
    for model in models:
        outputs = ["PATCH_EMBEDS"] if model.endswith("_embed") else U8_OUTPUTS
        for data in (png, jpeg):
            infer(triton_server, "grpc", model, data, outputs)
        refuse_bad_bytes(triton_server, "grpc", model)
    after = kimi_counters(triton_server.metrics_url)
    assert grown(before, after, "kimi_prep_decodes_total", 'path="pillow"', 'model="kimi_k25_decode"')
    assert grown(before, after, "kimi_prep_decodes_total", 'path="libjpeg"', 'model="kimi_k25_decode"')
    assert grown(before, after, "kimi_prep_errors_total", 'reason="invalid_image"', 'model="kimi_k25_decode"')
    for stage in ("decode", "patchify", "patch_embed"):  # the CPU rendering's embed chain, C step included
        assert grown(before, after, "kimi_prep_stage_seconds_total", f'stage="{stage}"'), stage
    for model in FUSED_U8:  # the fused models count their decodes and errors like the decode models
        assert grown(before, after, "kimi_prep_decodes_total", 'path="libjpeg"', f'model="{model}"')
        assert grown(before, after, "kimi_prep_decodes_total", 'path="pillow"', f'model="{model}"')
        assert grown(before, after, "kimi_prep_errors_total", 'reason="invalid_image"', f'model="{model}"')
        assert grown(before, after, "kimi_prep_stage_seconds_total", 'stage="vision"', f'model="{model}"')


def test_tritonserver_runs_with_jemalloc_and_the_stubs_with_glibc(triton_server: Any) -> None:
    """allocator.server_allocator_env: jemalloc is mapped into tritonserver (where the host has it:
    `make` installs Debian's libjemalloc2 as root), never into a stub, and the stubs' environment
    keeps none of tritonserver's own entries (triton_install.STUB_WRAPPER)."""
    if not server_allocator_env({}):
        pytest.skip("no libjemalloc.so.2 on this host")
    server, *stubs = triton_server.process_tree()
    assert "libjemalloc.so.2" in Path(f"/proc/{server}/maps").read_text()
    python_models = [c for c in triton_server.repository.glob("*/config.pbtxt") if 'backend: "python"' in c.read_text()]
    assert len(stubs) == len(python_models)  # one instance each; ensembles have no process
    for pid in stubs:
        assert "libjemalloc" not in Path(f"/proc/{pid}/maps").read_text()
        names = {entry.split(b"=", 1)[0] for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")}
        assert not names & {b"LD_PRELOAD", b"MALLOC_CONF", SERVER_ONLY_ENV.encode()}
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/bin/triton_python_backend_stub")


def test_every_model_stays_ready_after_bad_requests(triton_server: Any) -> None:
    for model in [*ENSEMBLES, *U8_ENSEMBLES, *FUSED, *FUSED_U8]:
        refuse_bad_bytes(triton_server, "http", model)
    assert_all_ready(grpcclient.InferenceServerClient(triton_server.grpc_url))


def test_json_client_sending_base64_is_told_how_to_send_bytes(triton_server: Any, corpus: Path) -> None:
    """HTTP without the binary-data extension: a base64 string arrives as text; INVALID_ARG says so."""
    import base64

    text = base64.b64encode(read(corpus, "pil__hopper.jpg"))
    client = httpclient.InferenceServerClient(triton_server.http_url)
    try:
        tensor = httpclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[text]], dtype=np.object_), binary_data=False)
        with pytest.raises(InferenceServerException) as info:
            client.infer("kimi_k25_vision", [tensor])
        assert is_invalid_arg(info.value) and "base64 text of an image: send the raw bytes" in str(info.value)
    finally:
        client.close()
