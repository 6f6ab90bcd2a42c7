"""Decoder routing and the decoder pool, with real nvImageCodec CPU decoders."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
from make_inputs import jpeg_cmyk, jpeg_damaged_at_a_restart, jpeg_grey, jpeg_rgb, jpeg_with_concealed_damage, png_mode
from PIL import Image
from reference import reference_preprocess

import kimi_vision_prep
from kimi_vision_prep import (
    DecoderBusyError,
    FallbackError,
    ImageDecoder,
    ImageTooLargeError,
    InvalidImageError,
    PreprocessError,
    PreprocessResult,
    pipeline,
)
from kimi_vision_prep.decode import decoder as decode_module
from kimi_vision_prep.decode import jpeg_bands
from kimi_vision_prep.decode.decoder import CPU_ROUTES

# This module tests nvImageCodec's pool, fallbacks and batching: its decoders take only that route
# (libjpeg, the default first CPU route, is covered by test_exactness.py, test_jpeg_bands.py and
# below).
FAST = "nvimgcodec-cpu"


def nvimgcodec_decoder(**kwargs: object) -> ImageDecoder:
    return ImageDecoder(cpu_routes=(FAST,), **kwargs)  # type: ignore[arg-type]


def assert_exact(result: PreprocessResult, data: bytes, preset: str = "kimi-k2.5") -> None:
    ref = reference_preprocess(data, preset)
    assert np.array_equal(np.asarray(result.pixel_values), ref.pixel_values)
    assert np.array_equal(result.grid_thw, ref.grid_thw)
    assert result.num_tokens == ref.num_tokens


class DecoderProbe:
    """Wraps real nvImageCodec decoders: counts creations and concurrent decode calls, and can make
    the next ``fail_next`` calls raise."""

    def __init__(self, make_real: Callable[[], Any]) -> None:
        self._make_real = make_real
        self._lock = threading.Lock()
        self.created = 0
        self.active = 0
        self.max_active = 0
        self.fail_next = 0
        # When set, the first ``rendezvous.parties`` decode calls wait for each other, so that many
        # decoders are provably in use at the same moment.
        self.rendezvous: threading.Barrier | None = None
        self._calls = 0

    def factory(self) -> Any:
        with self._lock:
            self.created += 1
        return _ProbedDecoder(self, self._make_real())

    def enter(self) -> bool:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self._calls += 1
            meet = self.rendezvous is not None and self._calls <= self.rendezvous.parties
            fail = self.fail_next > 0
            self.fail_next -= int(fail)
        if meet:
            self.rendezvous.wait(timeout=20)
        return fail

    def leave(self) -> None:
        with self._lock:
            self.active -= 1


class _ProbedDecoder:
    def __init__(self, probe: DecoderProbe, real: Any) -> None:
        self._probe = probe
        self._real = real

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        fail = self._probe.enter()
        try:
            if fail:
                raise RuntimeError("injected decoder failure")
            return self._real.decode(*args, **kwargs)
        finally:
            self._probe.leave()


@pytest.fixture
def probed_decoder(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[ImageDecoder, DecoderProbe]]:
    """An ImageDecoder whose pool makes real decoders through a DecoderProbe."""
    real_make = ImageDecoder._make_decoder

    def build(**kwargs: Any) -> tuple[ImageDecoder, DecoderProbe]:
        holder: dict[str, DecoderProbe] = {}

        def make(self: ImageDecoder) -> Any:
            return holder["probe"].factory()

        monkeypatch.setattr(ImageDecoder, "_make_decoder", make)
        decoder = nvimgcodec_decoder(**kwargs)
        holder["probe"] = DecoderProbe(lambda: real_make(decoder))
        return decoder, holder["probe"]

    return build


# --- the pool -----------------------------------------------------------------------------------


def test_pool_is_lazy() -> None:
    decoder = nvimgcodec_decoder(pool_size=2)
    assert decoder.pool.created == 0
    kimi_vision_prep.preprocess_bytes(png_mode(20, 20, "RGB"), decoder=decoder)  # Pillow route
    assert decoder.pool.created == 0
    data = jpeg_rgb(40, 30)
    result = kimi_vision_prep.preprocess_bytes(data, decoder=decoder)
    assert result.decode_path == FAST
    assert_exact(result, data)
    assert (decoder.pool.created, decoder.pool.idle) == (1, 1)
    kimi_vision_prep.preprocess_bytes(data, decoder=decoder)
    assert (decoder.pool.created, decoder.pool.idle) == (1, 1)  # reused, not recreated


def test_pool_reuses_last_returned_first() -> None:
    decoder = nvimgcodec_decoder(pool_size=2)
    pool = decoder.pool
    with pool.borrow() as first, pool.borrow() as second:
        assert first is not second
    # ``second`` went back first, ``first`` last: LIFO lends ``first`` next.
    with pool.borrow() as again:
        assert again is first
        with pool.borrow() as other:
            assert other is second
    assert (pool.created, pool.idle) == (2, 2)


def test_pool_discards_decoder_whose_block_raised() -> None:
    pool = nvimgcodec_decoder(pool_size=2).pool
    with pytest.raises(ValueError), pool.borrow() as broken:
        raise ValueError("boom")
    assert (pool.created, pool.discarded, pool.idle) == (0, 1, 0)
    with pool.borrow() as fresh:
        assert fresh is not broken
    assert pool.created == 1


def test_cap_respected_under_threads(probed_decoder: Callable[..., tuple[ImageDecoder, DecoderProbe]]) -> None:
    decoder, probe = probed_decoder(pool_size=2, codec_threads=1)
    probe.rendezvous = threading.Barrier(2)  # both pooled decoders busy at once, 6 threads waiting
    images = [jpeg_rgb(160 + 7 * i, 120 + 5 * i, ("4:2:0", "4:2:2", "4:4:4")[i % 3], seed=i) for i in range(8)]
    images += [jpeg_grey(90 + i, 70) for i in range(4)]
    expected = {i: reference_preprocess(data, "kimi-k2.5") for i, data in enumerate(images)}

    def work(index: int) -> tuple[int, PreprocessResult]:
        return index, kimi_vision_prep.preprocess_bytes(images[index], decoder=decoder)

    jobs = [i % len(images) for i in range(48)]
    with ThreadPoolExecutor(max_workers=8) as executor:
        results = list(executor.map(work, jobs))
    assert probe.created == 2 and decoder.pool.created == 2
    assert probe.max_active == 2
    assert decoder.pool.discarded == 0
    for index, result in results:
        assert result.decode_path == FAST and result.fallback_reason is None
        assert np.array_equal(result.pixel_values, expected[index].pixel_values), index
    assert decoder.stats.snapshot()["paths"] == {FAST: len(jobs)}


def test_raising_decoder_is_discarded_and_falls_back(
    probed_decoder: Callable[..., tuple[ImageDecoder, DecoderProbe]],
) -> None:
    decoder, probe = probed_decoder(pool_size=2)
    data = jpeg_rgb(50, 40)
    probe.fail_next = 1
    result = kimi_vision_prep.preprocess_bytes(data, decoder=decoder)
    assert result.decode_path == "pillow"
    assert result.fallback_reason is not None and "RuntimeError" in result.fallback_reason
    assert_exact(result, data)  # the fallback is still Pillow-exact
    assert (decoder.pool.discarded, decoder.pool.created) == (1, 0)
    assert decoder.stats.snapshot()["fallbacks"] == {result.fallback_reason: 1}
    again = kimi_vision_prep.preprocess_bytes(data, decoder=decoder)
    assert again.decode_path == FAST and again.fallback_reason is None
    assert probe.created == 2  # a fresh decoder replaced the discarded one


def test_raising_decoder_with_strict_raises_fallback_error(
    probed_decoder: Callable[..., tuple[ImageDecoder, DecoderProbe]],
) -> None:
    decoder, probe = probed_decoder(pool_size=1, strict=True)
    probe.fail_next = 1
    with pytest.raises(FallbackError, match="strict"):
        kimi_vision_prep.preprocess_bytes(jpeg_rgb(50, 40), decoder=decoder)
    assert decoder.pool.discarded == 1


def test_busy_pool_times_out() -> None:
    decoder = nvimgcodec_decoder(pool_size=1, pool_timeout_s=0.2)
    outcome: dict[str, object] = {}

    def other_request() -> None:
        try:
            outcome["result"] = kimi_vision_prep.preprocess_bytes(jpeg_rgb(30, 20), decoder=decoder)
        except PreprocessError as exc:
            outcome["result"] = exc

    with decoder.pool.borrow():  # the only decoder is held
        thread = threading.Thread(target=other_request)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive()
        # The Pillow route needs no pooled decoder and is not blocked.
        png = png_mode(20, 20, "RGBA")
        assert kimi_vision_prep.preprocess_bytes(png, decoder=decoder).decode_path == "pillow"
    error = outcome["result"]
    assert isinstance(error, DecoderBusyError), error
    assert error.triton_code == "UNAVAILABLE" and "busy" in str(error)
    # Once released, the same decoder serves again.
    assert kimi_vision_prep.preprocess_bytes(jpeg_rgb(30, 20), decoder=decoder).decode_path == FAST


# --- fallback when nvImageCodec is unavailable -------------------------------------------------


def make_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> Any:
        raise ImportError("No module named 'nvidia.nvimgcodec'")

    monkeypatch.setattr(decode_module, "import_nvimgcodec", unavailable)


def test_unavailable_nvimgcodec_strict_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    make_unavailable(monkeypatch)
    decoder = nvimgcodec_decoder(strict=True)
    with pytest.raises(FallbackError, match="ImportError"):
        kimi_vision_prep.preprocess_bytes(jpeg_rgb(40, 30), decoder=decoder)
    # Images planned to Pillow anyway are not fallbacks.
    for data in (png_mode(20, 20, "P+trns"), jpeg_cmyk(20, 20)):
        result = kimi_vision_prep.preprocess_bytes(data, "kimi-k3", decoder=decoder)
        assert result.decode_path == "pillow" and result.fallback_reason is None


@pytest.mark.parametrize("preset", ["kimi-k2.5", "kimi-k3"])
def test_unavailable_nvimgcodec_falls_back_loudly(monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    make_unavailable(monkeypatch)
    decoder = nvimgcodec_decoder(strict=False)
    inputs = [jpeg_rgb(40, 30), jpeg_grey(33, 17), jpeg_rgb(45, 45, progressive=True)]
    for data in inputs:
        result = kimi_vision_prep.preprocess_bytes(data, preset, decoder=decoder)
        assert result.decode_path == "pillow"
        assert result.fallback_reason is not None and "ImportError" in result.fallback_reason
        assert_exact(result, data, preset)
    snapshot = decoder.stats.snapshot()
    assert snapshot["paths"] == {"pillow": len(inputs)}
    assert sum(snapshot["fallbacks"].values()) == len(inputs)
    assert decoder.pool.created == 0


def test_strict_keeps_pillow_verdict_for_corrupt_clean_looking_jpeg() -> None:
    """A corrupted Huffman table passes the structural scan; nvImageCodec returns no image, and
    Pillow rejects the stream: that is bad input (INVALID_ARG), not a fallback (INTERNAL)."""
    data = bytearray(jpeg_rgb(64, 48, progressive=True))
    dht = data.index(b"\xff\xc4")
    data[dht + 5 : dht + 21] = b"\xff" * 16  # impossible code-length counts
    with pytest.raises(Exception) as reference_error:
        reference_preprocess(bytes(data), "kimi-k2.5")
    assert reference_error.value is not None
    with pytest.raises(InvalidImageError):
        kimi_vision_prep.preprocess_bytes(bytes(data), decoder=nvimgcodec_decoder(strict=True))


# --- batches ------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["kimi-k2.5", "kimi-k3"])
def test_batch_mixed_good_and_bad_in_order(preset: str) -> None:
    good_jpeg = jpeg_rgb(70, 50)
    items: list[tuple[bytes, type | None]] = [
        (good_jpeg, None),
        (b"", InvalidImageError),
        (png_mode(33, 21, "RGBA"), None),
        (good_jpeg[: len(good_jpeg) // 2], InvalidImageError),
        (jpeg_cmyk(30, 30), None),
        (b"http://example.com/x.jpg", InvalidImageError),
        (jpeg_grey(17, 90), None),
        (good_jpeg, None),
    ]
    decoder = nvimgcodec_decoder(limits=kimi_vision_prep.DecodeLimits(max_pixels=70 * 50))
    items.append((jpeg_rgb(71, 50), ImageTooLargeError))
    results = kimi_vision_prep.preprocess_batch([data for data, _ in items], preset, decoder=decoder)
    assert len(results) == len(items)
    for (data, error_type), result in zip(items, results, strict=True):
        if error_type is None:
            assert isinstance(result, PreprocessResult), result
            assert_exact(result, data, preset)
            assert result.fallback_reason is None
        else:
            assert isinstance(result, error_type), result
    assert results[0].decode_path == FAST and results[4].decode_path == "pillow"
    pixel_values, grid_thws = kimi_vision_prep.concat_results([r for r in results if isinstance(r, PreprocessResult)])
    assert grid_thws.dtype == np.int64 and grid_thws.shape == (5, 3)
    assert pixel_values.shape[0] == int(grid_thws[:, 1].astype(np.int64) @ grid_thws[:, 2])


# --- the strict libjpeg routes (libjpeg, the default first CPU route, else simplejpeg) -----------


@pytest.mark.parametrize(
    ("routes", "path"),
    [(CPU_ROUTES, "libjpeg"), (("simplejpeg", "libjpeg"), "pillow"), (("simplejpeg", "nvimgcodec-cpu"), "pillow")],
)
def test_damage_libjpeg_conceals_takes_the_libjpeg_route_only_where_it_comes_first(
    routes: tuple[str, ...], path: str
) -> None:
    """A stream the scan finds damaged (restart markers out of sequence) is decoded by the libjpeg
    route, tolerant, where that is the decoder's first libjpeg-turbo route; else (simplejpeg and
    nvImageCodec are strict) by Pillow, as planned: no fallback reason either way, Pillow's pixels."""
    decoder = ImageDecoder(cpu_routes=routes)  # type: ignore[arg-type]
    data = jpeg_with_concealed_damage("interval missing")
    result = kimi_vision_prep.preprocess_bytes(data, decoder=decoder)
    assert (result.decode_path, result.fallback_reason) == (path, None)
    assert_exact(result, data)


@pytest.mark.parametrize("routes", [CPU_ROUTES, ("simplejpeg", "nvimgcodec-cpu")])
def test_strict_libjpeg_refusal_takes_nvimgcodec_not_a_fallback(routes: tuple[str, ...]) -> None:
    """A file libjpeg only warns about (a restart interval cut short: premature end of data) is
    refused by the strict libjpeg route (ours, or simplejpeg where that comes first) and decoded by
    nvImageCodec: a planned route, no fallback reason, Pillow's pixels. Only one of the two is
    tried: they refuse alike."""
    decoder = ImageDecoder(cpu_routes=routes)  # type: ignore[arg-type]
    data = jpeg_damaged_at_a_restart("cut")
    result = kimi_vision_prep.preprocess_bytes(data, decoder=decoder)
    assert (result.decode_path, result.fallback_reason) == ("nvimgcodec-cpu", None)
    assert_exact(result, data)
    clean = kimi_vision_prep.preprocess_bytes(jpeg_rgb(40, 30), decoder=decoder)
    assert (clean.decode_path, clean.fallback_reason) == (routes[0], None)


def test_batch_decodes_several_jpegs_at_once_exactly(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """libjpeg decodes a batch's JPEGs on ``cpu_decode_threads`` threads at once, each whole: each image
    is still Pillow's pixels, in order, owned by the caller (the worker threads have no scratch
    arena), a refused file in the same batch still takes its planned route, and a damaged one
    (libjpeg conceals it) the libjpeg route, tolerant."""
    names = ["imagers__large_image.jpg", "sklearn__china.jpg"]
    items = [(corpus / name).read_bytes() for name in names]
    refused = jpeg_damaged_at_a_restart("cut")
    items += [refused, (corpus / "pil__iptc.jpg").read_bytes(), jpeg_grey(33, 17), jpeg_rgb(64, 48)]
    items += [jpeg_with_concealed_damage("stray marker")]
    preset = kimi_vision_prep.get_preset("kimi-k2.5")
    threads_seen: list[tuple[str, int, int]] = []
    real_decode = jpeg_bands.decode_rows

    def recorded_decode(data: bytes, pixels: np.ndarray, row_begin: int, row_end: int, tolerant: bool = False) -> bool:
        threads_seen.append((threading.current_thread().name, row_begin, row_end))
        return real_decode(data, pixels, row_begin, row_end, tolerant)

    monkeypatch.setattr(jpeg_bands, "decode_rows", recorded_decode)
    decoded = ImageDecoder(cpu_decode_threads=2).decode_batch(items, preset)
    assert len(threads_seen) == len(items), threads_seen  # whole images: one call each
    assert all(name.startswith("kimi-prep-decode") and begin == 0 for name, begin, _ in threads_seen), threads_seen
    assert [d.decode_path for d in decoded] == ["libjpeg"] * 2 + ["nvimgcodec-cpu"] + ["libjpeg"] * 4
    for data, image in zip(items, decoded, strict=True):
        expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        np.testing.assert_array_equal(np.asarray(image.pixels), expected)
    kept = [np.array(d.pixels) for d in decoded]
    ImageDecoder(cpu_decode_threads=2).decode_batch(items[::-1], preset)
    assert all(np.array_equal(d.pixels, k) for d, k in zip(decoded, kept, strict=True))
    result = kimi_vision_prep.preprocess_images(items, decoder=ImageDecoder(cpu_decode_threads=2))
    sequential = kimi_vision_prep.preprocess_images(items, decoder=ImageDecoder(cpu_decode_threads=1))
    np.testing.assert_array_equal(result.pixel_values, sequential.pixel_values)
    assert result.decode_paths == sequential.decode_paths


def test_cpu_routes_are_checked() -> None:
    with pytest.raises(ValueError, match="cpu_routes"):
        ImageDecoder(cpu_routes=("nvjpeg",))  # type: ignore[arg-type]


def test_decode_outside_a_pipeline_call_returns_owned_pixels() -> None:
    """libjpeg writes into the thread's scratch arena only inside a pipeline call: pixels that
    ImageDecoder.decode returns are the caller's and survive the next decode."""
    decoder, preset = ImageDecoder(), kimi_vision_prep.get_preset("kimi-k2.5")
    first = decoder.decode(jpeg_rgb(64, 48, seed=1), preset)
    kept = np.array(first.pixels)
    decoder.decode(jpeg_rgb(64, 48, seed=2), preset)
    kimi_vision_prep.preprocess_bytes(jpeg_rgb(64, 48, seed=3), decoder=decoder)
    assert first.decode_path == "libjpeg" and np.array_equal(first.pixels, kept)


def test_batch_workers_share_the_callers_numba_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers on a caller with 2 numba threads run their kernels on 1 thread each (they fill
    the cores already), on the same threads from call to call; the caller's own setting is
    untouched, and the results are the same."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 numba threads")
    seen: set[tuple[str, int]] = set()
    idents: list[set[int]] = [set()]  # the threads of each call
    real = pipeline.preprocess_bytes

    def recorded(*args: Any, **kwargs: Any) -> PreprocessResult:
        seen.add((threading.current_thread().name.rsplit("_", 1)[0], numba.get_num_threads()))
        idents[-1].add(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "preprocess_bytes", recorded)
    images = [jpeg_rgb(300 + 20 * i, 200, seed=i) for i in range(4)]
    threads = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        kimi_vision_prep.preprocess_batch(images, workers=2)
        idents.append(set())
        results = kimi_vision_prep.preprocess_batch(images, workers=2)
        assert numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(threads)
    assert seen == {("kimi-prep-batch", 1)}, seen
    # The same two threads serve every call (their scratch arenas stay warm): never more than the
    # workers over both calls (which of the two takes which image varies with the load).
    assert len(idents[0] | idents[1]) <= 2, idents
    for data, result in zip(images, results, strict=True):
        assert isinstance(result, PreprocessResult)
        assert_exact(result, data)
