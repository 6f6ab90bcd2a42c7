"""The CUDA path on a real GPU: nvImageCodec decode, DLPack hand-off, torch preprocessing.

Skipped as a whole without CUDA (CI, developer machines); ``run_device_checks.sh`` runs it on the
lent GPU machine. Bounds vs Pillow for the nvJPEG decode (a different IDCT, so near-exact, not
exact): mean absolute difference <= ``MEAN_ABS_DIFF_BOUND`` and max <= ``MAX_ABS_DIFF_BOUND`` per
image. Nearest-neighbour chroma, the failure these guard against, gives a mean of about 1.4 and a
max up to 75 on this corpus (spec section 2). ``gpu_report.py`` records the measured values.
"""

from __future__ import annotations

import dataclasses
import gc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_common import (
    CORPUS,
    LARGE_CLEAN_JPEG,
    CorpusFile,
    accepted_files,
    decoded_on_host,
    pillow_resize,
    pillow_rgb,
    pixel_diff,
)
from PIL import Image

from kimi_vision_common.orientation import exif_orientation, turned_size
from kimi_vision_prep import (
    DecodedImage,
    ImageDecoder,
    InvalidImageError,
    Preset,
    get_preset,
    pixel_values_from_patches,
    preprocess_decoded,
)
from kimi_vision_prep.decode.jpeg_scan import scan_jpeg
from kimi_vision_prep.decode.orientation import turned
from kimi_vision_prep.pipeline import preprocess_turned, resized_decoded
from kimi_vision_prep.repeat_cache import RepeatCache, repeat_key
from kimi_vision_prep.resize.resize import resize

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (run tests/gpu/run_device_checks.sh on a GPU machine)", allow_module_level=True)

pytestmark = pytest.mark.gpu

MEAN_ABS_DIFF_BOUND = 0.5
MAX_ABS_DIFF_BOUND = 12
PRESETS = [get_preset("kimi-k2.5"), get_preset("kimi-k3")]
ACCEPTED = accepted_files(CORPUS)
JPEGS = [f for f in ACCEPTED if f.is_jpeg]
CPU_DECODER = ImageDecoder("cpu", strict=True)  # the plan and the pixels the CUDA path must follow


def libjpeg_warns(item: CorpusFile) -> bool:
    """libjpeg decodes ``item`` only with a warning (damaged entropy-coded data it conceals): the
    CPU's strict libjpeg route refuses it and nvImageCodec's CPU backend (libjpeg) decodes it."""
    return CPU_DECODER.decode((CORPUS / item.name).read_bytes(), PRESETS[0]).decode_path == "nvimgcodec-cpu"


DAMAGED = [f for f in JPEGS if libjpeg_warns(f)]
SMALL_JPEG = "pil__hopper.jpg"


def by_name(files: list[CorpusFile]) -> list[object]:
    return [pytest.param(f, id=f.name) for f in files]


def by_preset() -> list[object]:
    return [pytest.param(p, id=p.name) for p in PRESETS]


@pytest.fixture(scope="module")
def cuda_decoder(cuda_device: str) -> ImageDecoder:
    """strict: a fallback from the planned path is a failure here, not a silent Pillow decode."""
    return ImageDecoder(cuda_device, strict=True, gpu_route="nvimgcodec")


@pytest.fixture(scope="module")
def lenient_cuda_decoder(cuda_device: str) -> ImageDecoder:
    """For the checks after the decode: a fallback there is reported by the decode test alone."""
    return ImageDecoder(cuda_device, gpu_route="nvimgcodec")


def assert_on_device(pixels: object, device: str) -> None:
    assert isinstance(pixels, torch.Tensor)
    assert pixels.device == torch.device(device)
    assert pixels.dtype == torch.uint8


@pytest.mark.parametrize("preset", by_preset())
@pytest.mark.parametrize("item", by_name([f for f in ACCEPTED if f not in DAMAGED]))
def test_decode_on_cuda_follows_the_cpu_plan_and_pillow(
    item: CorpusFile,
    preset: Preset,
    gpu_corpus: Path,
    cuda_decoder: ImageDecoder,
    record_property: pytest.RecordProperty,
) -> None:
    data = (gpu_corpus / item.name).read_bytes()
    on_gpu = cuda_decoder.decode(data, preset)
    reference = CPU_DECODER.decode(data, preset)

    assert on_gpu.device == cuda_decoder.torch_device
    record_property("decode_path", on_gpu.decode_path)
    if isinstance(reference.pixels, Image.Image):  # a source mode only Pillow resizes: on the host
        assert on_gpu.decode_path == "pillow"
        assert isinstance(on_gpu.pixels, Image.Image)
        assert (on_gpu.pixels.mode, on_gpu.pixels.tobytes()) == (reference.pixels.mode, reference.pixels.tobytes())
        return
    assert_on_device(on_gpu.pixels, cuda_decoder.device)
    assert (on_gpu.width, on_gpu.height, on_gpu.resample) == (reference.width, reference.height, reference.resample)
    assert on_gpu.fallback_reason is None
    # A fast CPU route is the GPU's too, but for what nvJPEG decodes otherwise than libjpeg.
    planned_fast = reference.decode_path != "pillow" and scan_jpeg(data).nvjpeg_decodable
    if not planned_fast:
        assert on_gpu.decode_path == "pillow"
        np.testing.assert_array_equal(on_gpu.pixels.cpu().numpy(), reference.pixels)
        return
    assert on_gpu.decode_path == "nvimgcodec-cuda"
    diff = pixel_diff(on_gpu.pixels.cpu().numpy(), pillow_rgb(data))
    record_property("mean_abs_diff", diff.mean_abs)
    record_property("max_abs_diff", diff.max_abs)
    assert diff.mean_abs <= MEAN_ABS_DIFF_BOUND
    assert diff.max_abs <= MAX_ABS_DIFF_BOUND


@pytest.mark.parametrize("item", by_name(DAMAGED))
def test_damaged_streams_decode_on_cuda_or_fall_back_to_pillow_with_a_reason(
    item: CorpusFile, gpu_corpus: Path, lenient_cuda_decoder: ImageDecoder, record_property: pytest.RecordProperty
) -> None:
    """nvJPEG conceals damaged entropy-coded data otherwise than libjpeg (or refuses it), and only
    an entropy decode shows the damage: the GPU's pixels are its own (recorded), or Pillow's with
    the fallback counted."""
    data = (gpu_corpus / item.name).read_bytes()
    on_gpu = lenient_cuda_decoder.decode(data, PRESETS[0])

    assert_on_device(on_gpu.pixels, lenient_cuda_decoder.device)
    diff = pixel_diff(on_gpu.pixels.cpu().numpy(), pillow_rgb(data))
    record_property("decode_path", on_gpu.decode_path)
    record_property("mean_abs_diff", diff.mean_abs)
    if on_gpu.decode_path == "pillow":  # planned (nvJPEG would decode it otherwise), or a counted fallback
        planned = not scan_jpeg(data).nvjpeg_decodable
        assert on_gpu.fallback_reason == (None if planned else "nvImageCodec returned no image")
        assert diff.exact
    else:
        assert on_gpu.decode_path == "nvimgcodec-cuda"


@pytest.mark.parametrize("preset", by_preset())
@pytest.mark.parametrize("item", by_name(ACCEPTED))
def test_preprocess_on_cuda_equals_the_cpu_pipeline_on_the_same_pixels(
    item: CorpusFile, preset: Preset, gpu_corpus: Path, cuda_device: str, lenient_cuda_decoder: ImageDecoder
) -> None:
    decoded = lenient_cuda_decoder.decode((gpu_corpus / item.name).read_bytes(), preset)
    on_gpu = preprocess_decoded(decoded, preset)
    on_host = preprocess_decoded(decoded_on_host(decoded), preset)

    assert isinstance(on_gpu.pixel_values, torch.Tensor)
    assert on_gpu.pixel_values.device == torch.device(cuda_device)
    assert on_gpu.pixel_values.dtype == torch.float32
    np.testing.assert_array_equal(on_gpu.grid_thw, on_host.grid_thw)
    assert torch.equal(on_gpu.pixel_values.cpu(), torch.from_numpy(on_host.pixel_values))


def turned_on_host(decoded: DecodedImage, orientation: int) -> DecodedImage:
    """``decoded``'s pixels on the host, turned as EXIF ``orientation`` says (the numpy kernel)."""
    on_host = decoded_on_host(decoded)
    width, height = turned_size(on_host.width, on_host.height, orientation)
    return dataclasses.replace(on_host, pixels=turned(on_host.pixels, orientation), width=width, height=height)


@pytest.mark.parametrize("preset", by_preset())
@pytest.mark.parametrize("item", by_name([f for f in JPEGS if "orientation" in f.name]))
def test_a_turned_jpeg_on_cuda_equals_the_cpu_pipeline_on_the_same_turned_pixels(
    item: CorpusFile, preset: Preset, gpu_corpus: Path, cuda_device: str, lenient_cuda_decoder: ImageDecoder
) -> None:
    """An EXIF-rotated photo as vLLM's loader turns it (``TurnedJpeg``'s route): decoded on the
    device, turned there (the torch kernel), resized and patchified there; equal to the host's
    pipeline on the same decoded pixels turned by the numpy kernel."""
    data = (gpu_corpus / item.name).read_bytes()
    orientation = exif_orientation(Image.open(gpu_corpus / item.name))
    assert orientation != 1
    on_gpu = preprocess_turned(data, orientation, preset, decoder=lenient_cuda_decoder)
    on_host = preprocess_decoded(turned_on_host(lenient_cuda_decoder.decode(data, preset), orientation), preset)

    assert isinstance(on_gpu.pixel_values, torch.Tensor)
    assert on_gpu.pixel_values.device == torch.device(cuda_device)
    np.testing.assert_array_equal(on_gpu.grid_thw, on_host.grid_thw)
    assert torch.equal(on_gpu.pixel_values.cpu(), torch.from_numpy(on_host.pixel_values))


@pytest.mark.parametrize("preset", by_preset())
@pytest.mark.parametrize("item", by_name(ACCEPTED)[:8])
def test_uint8_patches_on_cuda_expand_to_the_cpu_pixel_values(
    item: CorpusFile, preset: Preset, gpu_corpus: Path, cuda_device: str, lenient_cuda_decoder: ImageDecoder
) -> None:
    """The uint8 wire on a GPU instance: patchify_torch + expand_with_table_torch on the device equal
    the host's fused float32 pass on the same pixels."""
    decoded = lenient_cuda_decoder.decode((gpu_corpus / item.name).read_bytes(), preset)
    patches = preprocess_decoded(decoded, preset, output="pixel_patches").pixel_patches
    on_host = preprocess_decoded(decoded_on_host(decoded), preset)

    assert isinstance(patches, torch.Tensor) and patches.device == torch.device(cuda_device)
    assert patches.dtype == torch.uint8 and patches.is_contiguous()
    expanded = pixel_values_from_patches(patches, preset)
    assert expanded.device == torch.device(cuda_device)
    assert torch.equal(expanded.cpu(), torch.from_numpy(on_host.pixel_values))


@pytest.mark.parametrize("channels", [3, 4])
@pytest.mark.parametrize("resample", ["bicubic", "nearest"])
def test_exact_resize_on_cuda_equals_pillow(channels: int, resample: str, cuda_device: str) -> None:
    """Noise (and noisy alpha: premultiplied RGBA) at odd sizes; the corpus rarely needs resizing."""
    pixels = np.random.default_rng(channels).integers(0, 256, (779, 1037, channels), dtype=np.uint8)
    on_gpu = resize(torch.from_numpy(pixels).to(cuda_device), 512, 301, resample)

    assert on_gpu.device == torch.device(cuda_device)
    np.testing.assert_array_equal(on_gpu.cpu().numpy(), pillow_resize(pixels, 512, 301, resample))


def test_pixels_are_handed_over_through_dlpack_without_a_copy(
    gpu_corpus: Path, cuda_device: str, cuda_decoder: ImageDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed: list[tuple[int, int, str]] = []
    real_from_dlpack = torch.from_dlpack

    def spy(image: object) -> torch.Tensor:
        tensor = real_from_dlpack(image)
        handed.append((image.__cuda_array_interface__["data"][0], tensor.data_ptr(), str(image.buffer_kind)))
        return tensor

    monkeypatch.setattr(torch, "from_dlpack", spy)
    decoded = cuda_decoder.decode((gpu_corpus / LARGE_CLEAN_JPEG).read_bytes(), PRESETS[0])

    [(image_ptr, tensor_ptr, buffer_kind)] = handed
    assert decoded.decode_path == "nvimgcodec-cuda"
    assert "DEVICE" in buffer_kind
    assert tensor_ptr == image_ptr == decoded.pixels.data_ptr()


def test_decoded_tensor_outlives_the_nvimgcodec_image(gpu_corpus: Path, cuda_decoder: ImageDecoder) -> None:
    data = (gpu_corpus / LARGE_CLEAN_JPEG).read_bytes()
    first = cuda_decoder.decode(data, PRESETS[0]).pixels
    gc.collect()
    for _ in range(3):  # reuse whatever device memory the freed image held
        cuda_decoder.decode_batch([data, (gpu_corpus / SMALL_JPEG).read_bytes()], PRESETS[0])
    torch.cuda.synchronize()
    again = cuda_decoder.decode(data, PRESETS[0]).pixels

    assert torch.equal(first, again)


def test_batch_decode_keeps_order_and_errors_per_item(
    gpu_corpus: Path, cuda_device: str, lenient_cuda_decoder: ImageDecoder
) -> None:
    items = [(gpu_corpus / f.name).read_bytes() for f in JPEGS if f not in DAMAGED]
    results = lenient_cuda_decoder.decode_batch([*items[:3], b"not an image", *items[3:]], PRESETS[0])

    assert isinstance(results[3], InvalidImageError)
    for data, result in zip(items, results[:3] + results[4:], strict=True):
        assert isinstance(result, DecodedImage), result
        assert_on_device(result.pixels, cuda_device)
        diff = pixel_diff(result.pixels.cpu().numpy(), pillow_rgb(data))
        assert diff.mean_abs <= MEAN_ABS_DIFF_BOUND
        assert diff.max_abs <= MAX_ABS_DIFF_BOUND


def test_sequential_decodes_reuse_one_cuda_decoder(gpu_corpus: Path, cuda_device: str) -> None:
    decoder = ImageDecoder(cuda_device, pool_size=2, gpu_route="nvimgcodec")
    data = (gpu_corpus / SMALL_JPEG).read_bytes()
    first = decoder.decode(data, PRESETS[0]).pixels
    for _ in range(3):
        assert torch.equal(decoder.decode(data, PRESETS[0]).pixels, first)

    assert (decoder.pool.created, decoder.pool.idle, decoder.pool.discarded) == (1, 1, 0)


def test_concurrent_callers_get_their_own_decoders_and_the_same_pixels(gpu_corpus: Path, cuda_device: str) -> None:
    decoder = ImageDecoder(cuda_device, pool_size=2, gpu_route="nvimgcodec")
    items = [(gpu_corpus / f.name).read_bytes() for f in JPEGS]

    def decode_all() -> list[torch.Tensor]:
        pixels = [r.pixels for r in decoder.decode_batch(items, PRESETS[0])]
        torch.cuda.current_stream().synchronize()
        return pixels

    expected = decode_all()
    with ThreadPoolExecutor(max_workers=4) as workers:
        rounds = [workers.submit(decode_all) for _ in range(12)]
        mismatches = {
            f.name for r in rounds for f, a, b in zip(JPEGS, r.result(), expected, strict=True) if not torch.equal(a, b)
        }

    assert mismatches == set()
    assert decoder.pool.created <= 2
    assert decoder.pool.discarded == 0


def test_the_repeat_cache_keeps_resized_cuda_images_within_its_cap(
    gpu_corpus: Path, cuda_device: str, cuda_decoder: ImageDecoder
) -> None:
    """What a GPU decode step does with repeats (tritonserver caches no CUDA answer): the resized
    CUDA tensor is kept under the SHA-256 of the bytes and handed out again, counted in device bytes."""
    data = (gpu_corpus / LARGE_CLEAN_JPEG).read_bytes()
    image = resized_decoded(cuda_decoder.decode(data, PRESETS[0]), PRESETS[0])
    size = image.pixels.numel()
    cache = RepeatCache(size)
    cache.put(repeat_key(data, PRESETS[0]), image)
    again = cache.get(repeat_key(data, PRESETS[0]))

    assert_on_device(again.pixels, cuda_device)
    assert again.pixels.data_ptr() == image.pixels.data_ptr() and cache.held_bytes == size
    assert cache.get(repeat_key(data, PRESETS[1])) is None
    on_host = preprocess_decoded(decoded_on_host(again), PRESETS[0])
    assert torch.equal(preprocess_decoded(again, PRESETS[0]).pixel_values.cpu(), torch.from_numpy(on_host.pixel_values))
    cache.put(repeat_key(b"other", PRESETS[0]), resized_decoded(cuda_decoder.decode(data, PRESETS[0]), PRESETS[0]))
    assert len(cache) == 1 and cache.held_bytes <= cache.cap_bytes
