"""The CUDA decode path of ``ImageDecoder`` against a fake nvImageCodec (no GPU on CI).

These run the nvImageCodec route (``gpu_route="nvimgcodec"``); the default exact route is in
``tests/test_gpu_route_fake.py``. What is faked is only what needs CUDA: the nvImageCodec module
(``tests/fakes/nvimgcodec.py``) and the ``torch.cuda`` calls ``decode/decoder.py`` makes
(``tests/fakes/torch_cuda.py``). Pillow, the routing, the pool and ``torch.from_dlpack`` run for
real. ``tests/gpu`` runs the same path on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import cuda_fixtures, torch_cuda
from fakes.cuda_fixtures import pillow_rgb, read
from fakes.nvimgcodec import BackendKind, FakeNvImgCodec
from PIL import Image

from kimi_vision_prep import FallbackError, ImageDecoder, get_preset, preprocess_decoded

codec, cuda = cuda_fixtures.codec, cuda_fixtures.cuda  # the fixtures these tests take

K25 = get_preset("kimi-k2.5")
BASELINE_JPEG = "pil__hopper.jpg"
EXIF_ROTATED_JPEG = "pil__orientation_rectangle.jpg"  # stored 2x1, EXIF orientation 8
ARITHMETIC_JPEG = "ljt__testimgari.jpg"  # SOF9: nvJPEG has no arithmetic decoding
RGB_CODED_JPEG = "imagers__rgb.jpg"  # Adobe transform 0: nvJPEG would convert it as YCbCr
NO_DHT_JPEG = "imagers__mjpeg.jpg"  # MJPEG frame on the default Huffman tables, which nvJPEG refuses
DC_ONLY_JPEG = "imagers__progressive-missing-ac.jpg"  # progressive, DC scans only: nvJPEG refuses it
SOURCE_MODE_JPEG = "imagers__jpg-cmyk-2.jpg"  # K3 resizes CMYK in its own mode, with Pillow
PNG = "pilx__hopper.png"


def test_decoder_built_for_the_device_with_gpu_backends_and_fancy_upsampling(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    ImageDecoder("cuda:3", gpu_route="nvimgcodec", codec_threads=5).decode(read(corpus, BASELINE_JPEG), K25)

    [decoder] = codec.decoders
    assert decoder.device_id == 3
    assert decoder.backend_kinds == [BackendKind.GPU_ONLY, BackendKind.HYBRID_CPU_GPU]
    assert ":fancy_upsampling=1" in decoder.options.split()
    assert decoder.max_num_cpu_threads == 5


def test_plain_cuda_means_device_zero(corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda) -> None:
    ImageDecoder("cuda", gpu_route="nvimgcodec").decode(read(corpus, BASELINE_JPEG), K25)

    assert codec.decoders[0].device_id == 0
    assert cuda.entered == [0]


def test_exif_orientation_is_not_applied(corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda) -> None:
    decoded = ImageDecoder("cuda:0", gpu_route="nvimgcodec").decode(read(corpus, EXIF_ROTATED_JPEG), K25)

    [call] = codec.calls
    assert call.params.apply_exif_orientation is False
    assert call.params.color_spec == codec.ColorSpec.SRGB
    assert (decoded.width, decoded.height) == (2, 1)
    assert tuple(decoded.pixels.shape) == (1, 2, 3)


def test_decodes_on_the_current_stream_of_the_decoder_device(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    ImageDecoder("cuda:2", gpu_route="nvimgcodec").decode(read(corpus, BASELINE_JPEG), K25)

    [call] = codec.calls
    assert cuda.entered == [2]
    assert call.cuda_stream == torch_cuda.STREAM_HANDLE_BASE + 2
    assert cuda.current_device is None  # the device context was left


def test_pixels_are_handed_over_through_dlpack_without_a_copy(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    data = read(corpus, BASELINE_JPEG)
    decoded = ImageDecoder("cuda:0", gpu_route="nvimgcodec").decode(data, K25)

    [image] = codec.calls[0].images
    assert isinstance(decoded.pixels, torch.Tensor)
    assert decoded.pixels.data_ptr() == image.tensor.data_ptr()
    assert decoded.decode_path == "nvimgcodec-cuda"
    assert decoded.fallback_reason is None
    assert decoded.resample == "bicubic" and decoded.pixels.shape[2] == 3  # RGB
    # Untouched: the marker the fake writes (value = flat index mod 251), not a copy or a conversion.
    height, width = decoded.height, decoded.width
    marker = (np.arange(height * width * 3) % 251).astype(np.uint8).reshape(height, width, 3)
    np.testing.assert_array_equal(decoded.pixels.numpy(), marker)
    assert cuda.moves == []  # nothing went through a host copy


def test_batch_decodes_fast_items_in_one_call_and_moves_pillow_items_to_the_device(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    items = [read(corpus, BASELINE_JPEG), read(corpus, PNG), read(corpus, EXIF_ROTATED_JPEG)]
    results = ImageDecoder("cuda:1", gpu_route="nvimgcodec").decode_batch(items, K25)

    [call] = codec.calls
    assert [s.data for s in call.streams] == [items[0], items[2]]
    assert [r.decode_path for r in results] == ["nvimgcodec-cuda", "pillow", "nvimgcodec-cuda"]
    assert results[1].fallback_reason is None
    assert isinstance(results[1].pixels, torch.Tensor)
    np.testing.assert_array_equal(results[1].pixels.numpy(), pillow_rgb(items[1]))
    assert cuda.moves == ["cuda:1"]


def test_one_decoder_is_reused_across_sequential_calls(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    decoder = ImageDecoder("cuda:0", gpu_route="nvimgcodec", pool_size=2)
    for _ in range(3):
        decoder.decode(read(corpus, BASELINE_JPEG), K25)

    assert len(codec.decoders) == 1
    assert [call.decoder for call in codec.calls] == codec.decoders * 3
    assert (decoder.pool.created, decoder.pool.idle) == (1, 1)


def test_a_decoder_that_raised_is_discarded_and_the_image_falls_back_to_pillow(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    decoder = ImageDecoder("cuda:0", gpu_route="nvimgcodec")
    data = read(corpus, BASELINE_JPEG)
    codec.outcome = "raise"
    failed = decoder.decode(data, K25)

    assert failed.decode_path == "pillow"
    assert failed.fallback_reason == "nvImageCodec raised FakeDecodeError"
    np.testing.assert_array_equal(failed.pixels.numpy(), pillow_rgb(data))
    assert cuda.moves == ["cuda:0"]
    assert (decoder.pool.discarded, decoder.pool.created) == (1, 0)

    codec.outcome = "ok"
    recovered = decoder.decode(data, K25)

    assert recovered.decode_path == "nvimgcodec-cuda"
    assert len(codec.decoders) == 2  # a fresh decoder, not the one that raised
    assert [call.decoder for call in codec.calls] == [codec.decoders[1]]


def test_no_image_from_the_decoder_falls_back_to_pillow_with_the_reason(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    decoder = ImageDecoder("cuda:0", gpu_route="nvimgcodec")
    data = read(corpus, BASELINE_JPEG)
    codec.outcome = "none"
    decoded = decoder.decode(data, K25)

    assert decoded.decode_path == "pillow"
    assert decoded.fallback_reason == "nvImageCodec returned no image"
    np.testing.assert_array_equal(decoded.pixels.numpy(), pillow_rgb(data))
    assert cuda.moves == ["cuda:0"]
    assert decoder.stats.snapshot() == {"paths": {"pillow": 1}, "fallbacks": {"nvImageCodec returned no image": 1}}
    assert decoder.pool.discarded == 0  # returning None is an answer, not a broken decoder


def test_strict_decoder_raises_instead_of_falling_back(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    codec.outcome = "none"
    with pytest.raises(FallbackError, match=r"nvimgcodec-cuda.*returned no image"):
        ImageDecoder("cuda:0", gpu_route="nvimgcodec", strict=True).decode(read(corpus, BASELINE_JPEG), K25)


@pytest.mark.parametrize("name", [ARITHMETIC_JPEG, RGB_CODED_JPEG, NO_DHT_JPEG, DC_ONLY_JPEG])
def test_what_nvjpeg_decodes_otherwise_than_libjpeg_is_planned_to_pillow_on_cuda(
    name: str, corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    data = read(corpus, name)
    on_cuda = ImageDecoder("cuda:0", gpu_route="nvimgcodec").decode(data, K25)

    assert (on_cuda.decode_path, on_cuda.fallback_reason) == ("pillow", None)
    assert codec.decoders == []
    assert cuda.moves == ["cuda:0"]
    np.testing.assert_array_equal(on_cuda.pixels.numpy(), pillow_rgb(data))


def test_arithmetic_coded_jpeg_is_decoded_by_libjpeg_or_nvimgcodec_on_the_cpu(
    corpus: Path, codec: FakeNvImgCodec
) -> None:
    data = read(corpus, ARITHMETIC_JPEG)
    assert ImageDecoder("cpu").decode(data, K25).decode_path == "libjpeg"  # libjpeg-turbo decodes it
    on_cpu = ImageDecoder("cpu", cpu_routes=("nvimgcodec-cpu",)).decode(data, K25)

    assert on_cpu.decode_path == "nvimgcodec-cpu"
    [cpu_decoder] = codec.decoders
    assert cpu_decoder.backend_kinds == [BackendKind.CPU_ONLY]
    assert cpu_decoder.device_id == codec.NVIMGCODEC_DEVICE_CPU_ONLY


def test_a_source_mode_image_is_resized_on_the_host_and_its_pixel_values_land_on_the_device(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    k3 = get_preset("kimi-k3")
    data = read(corpus, SOURCE_MODE_JPEG)
    decoded = ImageDecoder("cuda:2", gpu_route="nvimgcodec").decode(data, k3)

    assert isinstance(decoded.pixels, Image.Image) and decoded.pixels.mode == "CMYK"
    assert (decoded.device, cuda.moves) == ("cuda:2", [])
    on_device = preprocess_decoded(decoded, k3)

    assert cuda.moves == ["cuda:2"]  # the resized RGB, once
    assert isinstance(on_device.pixel_values, torch.Tensor)
    on_host = preprocess_decoded(ImageDecoder("cpu").decode(data, k3), k3)
    np.testing.assert_array_equal(on_device.pixel_values.numpy(), on_host.pixel_values)
