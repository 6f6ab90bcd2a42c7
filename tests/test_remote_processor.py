"""The remote processor (``kimi_vision_client.remote_processor``) against a real tritonserver: for
everything the in-process ``KimiVisionProcessor`` accepts it returns the same arrays, uint8 and
float32, and for everything it refuses the same error class; sizes, token counts and prompts are
answered without the server."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from make_inputs import CORPUS, corpus_names, encode, png_mode, rgb_pattern
from PIL import Image

from kimi_vision_client.processors.encoding import encoded_losslessly
from kimi_vision_client.remote_processor import RemoteKimiProcessor
from kimi_vision_common.errors import (
    InvalidRequestError,
    ModelNotServedError,
    PreprocessError,
    UnsupportedImageError,
)
from kimi_vision_common.presets import get_preset
from kimi_vision_common.wire import DEFAULT_GRPC_PORT
from kimi_vision_prep import KimiVisionProcessor

PRESETS = ("kimi-k2.5", "kimi-k3")
MODES = {"float32": {}, "uint8": {"do_rescale": False, "do_normalize": False}}
IMAGES = sorted(p.name for p in CORPUS.iterdir() if p.is_file() and p.name not in ("MANIFEST.tsv", "README.md"))
ACCEPTED = corpus_names(accepted=True)
CLIPS = ["video/torchcodec__av1_video.mkv", "video/torchcodec__h265_video.mp4"]

pytestmark = pytest.mark.server


@pytest.fixture(scope="module", params=PRESETS)
def pair(request: pytest.FixtureRequest, triton_server: Any) -> Iterator[tuple[Any, RemoteKimiProcessor]]:
    """The in-process processor and the remote one of a preset (the server on loopback: shared memory)."""
    remote = RemoteKimiProcessor(preset=request.param, url=triton_server.grpc_url)
    assert remote.shared_memory
    yield KimiVisionProcessor(preset=request.param), remote
    remote.close()


def outcome(call: Callable[[], Any]) -> Any:
    """What ``call`` returns, or the class of the :class:`PreprocessError` it raises."""
    try:
        return call()
    except PreprocessError as exc:
        return type(exc)


def assert_same(expected: Any, actual: Any, what: str) -> None:
    """Both raised the same class, or returned the same keys with equal arrays of the same dtype."""
    if isinstance(expected, type) or isinstance(actual, type):
        assert expected == actual, what
        return
    assert set(expected) == set(actual), what
    for key in expected:
        want, got = np.asarray(expected[key]), np.asarray(actual[key])
        assert want.dtype == got.dtype and want.shape == got.shape, (what, key, want.dtype, got.dtype)
        assert np.array_equal(want, got), (what, key)


@pytest.mark.parametrize("mode", MODES)
def test_every_corpus_file_as_bytes_equals_in_process(pair: tuple, mode: str) -> None:
    local, remote = pair
    for name in IMAGES:
        data = (CORPUS / name).read_bytes()
        media = {"type": "image", "image": data}
        expected = outcome(lambda media=media: local.preprocess(media, **MODES[mode]))
        assert_same(expected, outcome(lambda media=media: remote.preprocess(media, **MODES[mode])), name)


def test_opened_and_decoded_pil_images_equal_in_process(pair: tuple) -> None:
    """An opened JPEG travels as its file, any other image (opened or decoded in memory) as a
    lossless file of its own mode: the same pixels as in process, transparency included (K3)."""
    local, remote = pair
    for name in ACCEPTED:
        for loaded in (False, True):
            image = Image.open(CORPUS / name)
            if loaded:
                image.load()
            media = {"type": "image", "image": image}
            expected = outcome(lambda media=media: local.preprocess(media))
            assert_same(expected, outcome(lambda media=media: remote.preprocess(media)), name)


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16", "F", "CMYK", "YCbCr", "LAB", "HSV"])
def test_a_decoded_image_of_any_mode_equals_in_process(pair: tuple, mode: str) -> None:
    """Every mode but one: a decoded HSV image (no file format holds it) under K3, which resizes in
    the source mode, is refused as unsupported instead of sent converted."""
    local, remote = pair
    media = {"type": "image", "image": Image.fromarray(rgb_pattern(37, 23)).convert(mode)}
    if mode == "HSV" and remote.base_preset == "kimi-k3":
        with pytest.raises(UnsupportedImageError, match="send its encoded file"):
            remote.preprocess(media)
        return
    assert_same(outcome(lambda: local.preprocess(media)), outcome(lambda: remote.preprocess(media)), mode)


@pytest.mark.parametrize("mode", ["P+trns", "L+trns", "LA", "RGBA"])
def test_a_decoded_image_with_transparency_equals_in_process(pair: tuple, mode: str) -> None:
    local, remote = pair
    image = Image.open(io.BytesIO(png_mode(37, 23, mode)))
    image.load()
    media = {"type": "image", "image": image}
    assert_same(outcome(lambda: local.preprocess(media)), outcome(lambda: remote.preprocess(media)), mode)


def test_a_list_of_images_with_repeats_equals_in_process(pair: tuple) -> None:
    local, remote = pair
    names = ["pil__hopper.jpg", "sklearn__china.jpg", "pil__hopper.jpg", "pilx__transparent.webp"]
    medias = [{"type": "image", "image": (CORPUS / name).read_bytes()} for name in names]
    for kwargs in MODES.values():
        assert_same(local.preprocess(medias, **kwargs), remote.preprocess(medias, **kwargs), "list")
    bad = [*medias[:2], {"type": "image", "image": (CORPUS / "pil__truncated_jpeg.jpg").read_bytes()}]
    assert_same(outcome(lambda: local.preprocess(bad)), outcome(lambda: remote.preprocess(bad)), "list with a bad one")


@pytest.mark.parametrize("clip", CLIPS)
def test_video_chunks_equal_in_process(pair: tuple, clip: str) -> None:
    """The checkpoint's chunks of a corpus clip (PIL frames), and the same frames as PNG files."""
    local, remote = pair
    chunks = local.split_video_chunks((CORPUS / clip).read_bytes())[:3]
    as_files = [{"type": "video_chunk", "video_chunk": [encode(f, "PNG") for f in c["video_chunk"]]} for c in chunks]
    for medias in (chunks, as_files):
        for kwargs in MODES.values():
            assert_same(local.preprocess(medias, **kwargs), remote.preprocess(medias, **kwargs), clip)


def test_a_chunk_of_frames_of_both_kinds_gets_one_verdict_in_process_and_remote(pair: tuple) -> None:
    """Video chunk frames are all PIL images (opened or decoded) or all encoded: a chunk of an opened
    JPEG and a JPEG's bytes is refused by both processors alike (one rule, processor_api's); each
    kind alone is taken by both, with equal pixels."""
    local, remote = pair
    data = (CORPUS / "pil__hopper.jpg").read_bytes()
    mixed = {"type": "video_chunk", "video_chunk": [Image.open(io.BytesIO(data)), data]}
    assert outcome(lambda: local.preprocess(mixed)) is InvalidRequestError
    assert outcome(lambda: remote.preprocess(mixed)) is InvalidRequestError
    for frames in ([Image.open(io.BytesIO(data))] * 2, [data, data]):
        chunk = {"type": "video_chunk", "video_chunk": frames}
        assert_same(local.preprocess(chunk), remote.preprocess(chunk), "one kind of frame")


def test_transformers_call_and_torch_tensors_equal_in_process(pair: tuple) -> None:
    local, remote = pair
    images = [Image.open(CORPUS / "pil__hopper.jpg"), (CORPUS / "sklearn__china.jpg").read_bytes()]
    expected, actual = local(images=images, return_tensors="pt"), remote(images=images, return_tensors="pt")
    assert isinstance(actual["pixel_values"], torch.Tensor)
    assert_same({k: v.numpy() for k, v in expected.items()}, {k: v.numpy() for k, v in actual.items()}, "call")


def test_expansion_with_torch_on_a_device_equals_numpys(pair: tuple, triton_server: Any) -> None:
    """``device=``: the uint8 patches move to the device and expand there (here the CPU device;
    tests/gpu runs the same on CUDA), bit-equal to numpy's expansion."""
    local, remote = pair
    on_device = RemoteKimiProcessor(preset=remote.base_preset, url=triton_server.grpc_url, device="cpu")
    try:
        medias = [{"type": "image", "image": (CORPUS / name).read_bytes()} for name in ACCEPTED[:12]]
        got = on_device.preprocess(medias)
        assert isinstance(got["pixel_values"], torch.Tensor)
        assert_same(local.preprocess(medias), {k: np.asarray(v) for k, v in got.items()}, "device")
    finally:
        on_device.close()


def test_without_shared_memory_the_answers_are_the_same(pair: tuple, triton_server: Any) -> None:
    local, remote = pair
    over_the_wire = RemoteKimiProcessor(preset=remote.base_preset, url=triton_server.grpc_url, shared_memory=False)
    try:
        medias = [{"type": "image", "image": (CORPUS / name).read_bytes()} for name in ACCEPTED[:12]]
        for kwargs in MODES.values():
            assert_same(local.preprocess(medias, **kwargs), over_the_wire.preprocess(medias, **kwargs), "no shm")
    finally:
        over_the_wire.close()


def test_sizes_tokens_and_prompts_are_answered_without_a_server() -> None:
    """Pointed at a port where nothing listens: every answer that needs no pixels is the library's."""
    for preset in PRESETS:
        local = KimiVisionProcessor(preset=preset)
        remote = RemoteKimiProcessor(preset=preset, url="127.0.0.1:9", deadline_s=0.5)
        assert remote.num_frames_per_chunk == local.num_frames_per_chunk
        assert remote.make_chunk_prompt("00:00:01.000") == local.make_chunk_prompt("00:00:01.000")
        assert remote.media_proc_cfg == local.media_proc_cfg
        for name in ACCEPTED:
            media = {"type": "image", "image": (CORPUS / name).read_bytes()}
            assert remote.media_tokens_calculator(media) == local.media_tokens_calculator(media), name
            assert remote.get_resize_config(media) == local.get_resize_config(media), name
        frames = [Image.open(CORPUS / "pil__hopper.jpg")] * 4
        chunk = {"type": "video_chunk", "video_chunk": frames}
        assert remote.get_resize_config(chunk) == local.get_resize_config(chunk)
        assert remote.get_number_of_image_patches(480, 640) == local.get_number_of_image_patches(480, 640)


def test_a_config_the_served_model_does_not_follow_is_refused(triton_server: Any) -> None:
    """A checkpoint whose media_proc_cfg differs from the served preset would get other pixels: the
    server serves no model for it (the deployment's fault: vLLM's 500, not a 400)."""
    remote = RemoteKimiProcessor({"in_patch_limit": 4096}, url=triton_server.grpc_url)
    with pytest.raises(ModelNotServedError, match="kimi_k25_vision_u8"):
        remote.preprocess({"type": "image", "image": (CORPUS / "pil__hopper.jpg").read_bytes()})


def test_a_lossless_file_decodes_to_the_same_pixels() -> None:
    for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16", "I", "F", "CMYK", "YCbCr", "LAB"):
        image = Image.fromarray(rgb_pattern(19, 11)).convert(mode)
        with Image.open(io.BytesIO(encoded_losslessly(image, get_preset("kimi-k3")))) as back:
            assert back.mode == image.mode and np.array_equal(np.asarray(back), np.asarray(image)), mode


def test_the_default_address_is_the_servers_default_grpc_port() -> None:
    assert RemoteKimiProcessor().url == f"localhost:{DEFAULT_GRPC_PORT}"
