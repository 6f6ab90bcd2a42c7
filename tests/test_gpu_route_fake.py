"""The default GPU route of ``ImageDecoder`` (``gpu_route="exact"``: coefficients read on the CPU,
libjpeg's integer arithmetic in torch kernels on the device) on a ``cuda`` decoder, without a GPU.

Faked is only what needs CUDA (``tests/fakes/torch_cuda.py``: a ``.to("cuda:N")`` is recorded and the
tensor stays on the CPU; ``tests/fakes/nvimgcodec.py`` proves nvImageCodec is not called): the
coefficient read, the kernels (on CPU tensors), the routing, the pool and the fallbacks run for real,
so the pixels are compared with Pillow's. ``tests/gpu`` runs the same route on a GPU.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fakes import cuda_fixtures, torch_cuda
from fakes.cuda_fixtures import pillow_rgb, read
from fakes.nvimgcodec import FakeNvImgCodec

from kimi_vision_prep import FallbackError, ImageDecoder, get_preset
from kimi_vision_prep.decode import jpeg_kernels
from kimi_vision_prep.decode.coefficients import LIBJPEG_REFUSED, OUT_OF_RANGE, SMOOTHING

codec, cuda = cuda_fixtures.codec, cuda_fixtures.cuda  # the fixtures these tests take

K25 = get_preset("kimi-k2.5")
BASELINE_JPEG = "pil__hopper.jpg"
GREY_JPEG = "imagers__grayscale_16x24_sampling2x2.jpg"
# Planned to Pillow on the nvImageCodec route (nvJPEG decodes them otherwise); the kernels take them.
NOT_FOR_NVJPEG = ["ljt__testimgari.jpg", "imagers__rgb.jpg", "imagers__mjpeg.jpg"]
SMOOTHING_JPEG = "imagers__progressive-missing-ac.jpg"  # DC scans only: libjpeg smooths the blocks
REFUSED_JPEG = "imagers__subtract-with-overflow.jpg"  # a libjpeg warning while reading coefficients
CMYK_JPEG = "imagers__jpg-cmyk-2.jpg"
EVENT_WAIT_S = 60.0  # a hang guard only: every wait below is released by an event, not a clock


@pytest.mark.parametrize("name", [BASELINE_JPEG, GREY_JPEG, *NOT_FOR_NVJPEG])
def test_a_cuda_decoder_takes_the_exact_route_by_default_with_pillows_pixels(
    name: str, corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    data = read(corpus, name)
    decoder = ImageDecoder("cuda:1")
    decoded = decoder.decode(data, K25)

    assert (decoder.gpu_route, decoded.decode_path, decoded.fallback_reason) == ("exact", "coefficients-cuda", None)
    assert codec.decoders == []  # nvImageCodec is not used
    assert isinstance(decoded.pixels, torch.Tensor) and decoded.device == "cuda:1"
    assert set(cuda.moves) == {"cuda:1"}  # the coefficients and quant tables went to the device
    assert decoded.pixels.dtype == torch.uint8 and decoded.pixels.shape == (decoded.height, decoded.width, 3)
    np.testing.assert_array_equal(decoded.pixels.numpy(), pillow_rgb(data))  # grey replicated, as Pillow
    assert decoder.stats.snapshot() == {"paths": {"coefficients-cuda": 1}, "fallbacks": {}}


@pytest.mark.parametrize(("name", "reason"), [(SMOOTHING_JPEG, SMOOTHING), (REFUSED_JPEG, LIBJPEG_REFUSED)])
def test_what_the_route_refuses_goes_to_pillow_with_its_reason_counted(
    name: str, reason: str, corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    data = read(corpus, name)
    decoder = ImageDecoder("cuda:0")
    decoded = decoder.decode(data, K25)

    assert (decoded.decode_path, decoded.fallback_reason) == ("pillow", reason)
    np.testing.assert_array_equal(decoded.pixels.numpy(), pillow_rgb(data))
    assert decoder.stats.snapshot() == {"paths": {"pillow": 1}, "fallbacks": {reason: 1}}
    assert codec.decoders == []


def test_an_out_of_range_stream_flagged_by_the_kernels_goes_to_pillow(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = jpeg_kernels.decode_coefficients

    def flagged(coefs: Any, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        return real(coefs, device)[0], torch.tensor(True)

    monkeypatch.setattr(jpeg_kernels, "decode_coefficients", flagged)
    data = read(corpus, BASELINE_JPEG)
    decoder = ImageDecoder("cuda:0")
    decoded = decoder.decode(data, K25)

    assert (decoded.decode_path, decoded.fallback_reason) == ("pillow", OUT_OF_RANGE)
    np.testing.assert_array_equal(decoded.pixels.numpy(), pillow_rgb(data))
    assert decoder.stats.fallbacks == {OUT_OF_RANGE: 1}


def test_kernels_that_raise_fall_back_to_pillow_and_free_their_slot(
    corpus: Path,
    codec: FakeNvImgCodec,
    cuda: torch_cuda.FakeCuda,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def out_of_memory(coefs: Any, device: str) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    monkeypatch.setattr(jpeg_kernels, "decode_coefficients", out_of_memory)
    data = read(corpus, BASELINE_JPEG)
    decoder = ImageDecoder("cuda:0", pool_size=1)
    for _ in range(2):  # the slot is given back: the second decode does not wait for it
        decoded = decoder.decode(data, K25)
        assert (decoded.decode_path, decoded.fallback_reason) == ("pillow", "kernels raised OutOfMemoryError")
        np.testing.assert_array_equal(decoded.pixels.numpy(), pillow_rgb(data))
    assert decoder.stats.fallbacks == {"kernels raised OutOfMemoryError": 2}
    # The reason's first use is logged with the exception's traceback, once.
    logged = [r.getMessage() for r in caplog.records if "kernels raised OutOfMemoryError" in r.getMessage()]
    assert len(logged) == 1 and "CUDA out of memory (fake)" in logged[0] and "Traceback" in logged[0]
    # The error is caught inside the slot (its traceback freed first); the slot, which holds no
    # state, goes back to the pool and serves the second decode.
    assert (decoder.pool.created, decoder.pool.discarded, decoder.pool.idle) == (1, 0, 1)


def test_strict_decoder_raises_instead_of_falling_back(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    with pytest.raises(FallbackError, match=r"coefficients-cuda.*block smoothing"):
        ImageDecoder("cuda:0", strict=True).decode(read(corpus, SMOOTHING_JPEG), K25)


def test_cmyk_stays_with_pillow(corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda) -> None:
    data = read(corpus, CMYK_JPEG)
    decoder = ImageDecoder("cuda:0")
    decoded = decoder.decode(data, K25)

    assert (decoded.decode_path, decoded.fallback_reason) == ("pillow", None)
    np.testing.assert_array_equal(decoded.pixels.numpy(), pillow_rgb(data))
    assert decoder.pool.created == 0


def test_the_setting_switches_a_cuda_decoder_to_nvimgcodec(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda
) -> None:
    decoded = ImageDecoder("cuda:0", gpu_route="nvimgcodec").decode(read(corpus, BASELINE_JPEG), K25)

    assert decoded.decode_path == "nvimgcodec-cuda"
    assert len(codec.calls) == 1


def test_an_unknown_route_is_refused_and_the_cpu_ignores_the_setting(corpus: Path, codec: FakeNvImgCodec) -> None:
    with pytest.raises(ValueError, match="gpu_route must be one of"):
        ImageDecoder("cpu", gpu_route="fast")  # type: ignore[arg-type]
    decoded = ImageDecoder("cpu", gpu_route="exact").decode(read(corpus, BASELINE_JPEG), K25)
    assert decoded.decode_path == "libjpeg"


class CountingCondition(threading.Condition):
    """The pool's condition, counting the threads blocked in it; ``blocked`` is set once
    ``expected`` threads wait there at the same time."""

    def __init__(self, expected: int) -> None:
        super().__init__()
        self.expected = expected
        self.waiting = 0
        self.blocked = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1  # the lock is held here
        if self.waiting >= self.expected:
            self.blocked.set()
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1


def test_the_pool_bounds_the_images_decoded_at_once(
    corpus: Path, codec: FakeNvImgCodec, cuda: torch_cuda.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four images, four threads, a pool of two: two run their kernels (held there by an event),
    the other two are proven blocked in the pool before the first two are let go."""
    real = jpeg_kernels.decode_coefficients
    lock, active, peak = threading.Lock(), [0], [0]
    two_inside, release = threading.Event(), threading.Event()

    def held(coefs: Any, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            if active[0] == 2:
                two_inside.set()
        try:
            assert release.wait(EVENT_WAIT_S)
            return real(coefs, device)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(jpeg_kernels, "decode_coefficients", held)
    decoder = ImageDecoder("cuda:0", pool_size=2, pool_timeout_s=EVENT_WAIT_S, cpu_decode_threads=4)
    condition = CountingCondition(expected=2)
    decoder.pool._cond = condition
    items = [read(corpus, name) for name in (BASELINE_JPEG, GREY_JPEG, *NOT_FOR_NVJPEG[:2])]
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(decoder.decode_batch(items, K25)))
    runner.start()
    try:
        assert two_inside.wait(EVENT_WAIT_S) and condition.blocked.wait(EVENT_WAIT_S)
        with lock:
            assert active[0] == 2
        assert (decoder.pool.created, decoder.pool.idle) == (2, 0)
    finally:
        release.set()
        runner.join(EVENT_WAIT_S)
    assert peak[0] == 2
    assert [r.decode_path for r in results] == ["coefficients-cuda"] * 4
    for data, result in zip(items, results, strict=True):
        np.testing.assert_array_equal(result.pixels.numpy(), pillow_rgb(data))
    assert (decoder.pool.created, decoder.pool.idle) == (2, 2)
