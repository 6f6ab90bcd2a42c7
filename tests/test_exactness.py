"""Bit-exactness of ``preprocess_bytes`` against the plain reference, on the corpus and on synthetic
inputs covering chroma subsampling, modes, odd sizes and oversized sides."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from make_inputs import (
    CJPEG,
    CORPUS,
    alpha_pattern,
    animated,
    cjpeg_rgb,
    corpus_manifest,
    corpus_names,
    encode,
    gif_transparent,
    jpeg_cmyk,
    jpeg_grey,
    jpeg_rgb,
    jpeg_with_orientation,
    png_mode,
    rgb_pattern,
)
from PIL import Image, ImageOps
from reference import PRESETS as REF_PRESETS
from reference import RefResult, ref_size, reference_preprocess

import kimi_vision_prep
from kimi_vision_prep import ImageDecoder, PreprocessResult
from kimi_vision_prep.decode.decoder import CPU_ROUTES

PRESET_NAMES = ("kimi-k2.5", "kimi-k3")
FAST = "libjpeg"  # the CPU fast route of a clean JPEG; nvimgcodec-cpu takes what it refuses
FAST_PATHS = set(CPU_ROUTES)
PILLOW = "pillow"


def assert_exact(result: PreprocessResult, ref: RefResult, label: str) -> None:
    """pixel_values, grid_thw and num_tokens equal the reference bit for bit."""
    got = np.asarray(result.pixel_values)
    assert got.dtype == np.float32 and got.shape == ref.pixel_values.shape, (label, got.shape, ref.pixel_values.shape)
    if not np.array_equal(got, ref.pixel_values):
        diff = np.abs(got.astype(np.float64) - ref.pixel_values)
        levels = diff.max() * 255 / 2  # mean = std = 0.5: one level is 2/255
        pytest.fail(f"{label}: pixel_values differ in {int((diff > 0).sum())} elements, max {levels:.1f} levels")
    assert result.grid_thw.dtype == np.int64 and result.grid_thw.shape == (3,)
    assert np.array_equal(result.grid_thw, ref.grid_thw), (label, result.grid_thw, ref.grid_thw)
    assert result.num_tokens == ref.num_tokens
    assert result.fallback_reason is None, (label, result.fallback_reason)


# --- the corpus ---------------------------------------------------------------------------------

ACCEPTED = corpus_names(accepted=True)
MANIFEST = corpus_manifest()


def expected_corpus_paths(name: str) -> set[str]:
    """CMYK and non-JPEG files must take the Pillow route; RGB/grey JPEGs may take any."""
    row = MANIFEST[name]
    is_jpeg = name.endswith((".jpg", ".mpo"))
    if not is_jpeg or row["pil_mode"] not in ("RGB", "L"):
        return {PILLOW}
    return FAST_PATHS | {PILLOW}


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("name", ACCEPTED)
def test_corpus_file_exact(corpus: Path, name: str, preset: str) -> None:
    data = (corpus / name).read_bytes()
    result = kimi_vision_prep.preprocess_bytes(data, preset)
    assert_exact(result, reference_preprocess(data, preset), name)
    assert result.decode_path in expected_corpus_paths(name)


def test_corpus_has_accepted_files() -> None:
    assert len(ACCEPTED) >= 70, "MANIFEST.tsv lost its accepted files?"


def test_corpus_fast_path_is_used() -> None:
    """Most accepted RGB/grey JPEGs of the corpus decode through libjpeg, not Pillow, and the
    ones libjpeg's strict mode refuses still take nvImageCodec."""
    jpegs = [n for n in ACCEPTED if n.endswith(".jpg") and MANIFEST[n]["pil_mode"] in ("RGB", "L")]
    paths = [kimi_vision_prep.preprocess_bytes((CORPUS / n).read_bytes()).decode_path for n in jpegs]
    assert paths.count(FAST) >= 0.7 * len(jpegs), dict(zip(jpegs, paths, strict=True))
    assert paths.count("nvimgcodec-cpu") >= 1, dict(zip(jpegs, paths, strict=True))
    assert sum(path in FAST_PATHS for path in paths) >= 0.8 * len(jpegs), dict(zip(jpegs, paths, strict=True))


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_each_cpu_route_alone_is_exact_on_the_corpus(corpus: Path, route: str) -> None:
    """Each fast CPU decoder alone (``cpu_routes=(route,)``) keeps Pillow's verdict and pixels on
    every accepted corpus JPEG, and takes most of them."""
    decoder = ImageDecoder(cpu_routes=(route,))
    jpegs = [n for n in ACCEPTED if n.endswith((".jpg", ".mpo")) and MANIFEST[n]["pil_mode"] in ("RGB", "L")]
    paths = []
    for name in jpegs:
        data = (corpus / name).read_bytes()
        result = kimi_vision_prep.preprocess_bytes(data, "kimi-k2.5", decoder=decoder)
        assert_exact(result, reference_preprocess(data, "kimi-k2.5"), f"{name} via {route}")
        assert result.decode_path in (route, PILLOW), (name, result.decode_path)
        paths.append(result.decode_path)
    assert paths.count(route) >= 0.7 * len(jpegs), dict(zip(jpegs, paths, strict=True))


# --- synthetic inputs ---------------------------------------------------------------------------


def rgba_tiff(width: int, height: int) -> bytes:
    image = Image.fromarray(rgb_pattern(width, height), "RGB")
    image.putalpha(Image.fromarray(alpha_pattern(width, height), "L"))
    return encode(image, "TIFF")


# name -> (generator, expected decode_path)
SYNTHETIC: dict[str, tuple[Callable[[], bytes], str]] = {
    "jpeg444": (lambda: jpeg_rgb(67, 45, "4:4:4"), FAST),
    "jpeg422": (lambda: jpeg_rgb(67, 45, "4:2:2"), FAST),
    "jpeg420": (lambda: jpeg_rgb(67, 45, "4:2:0"), FAST),
    "jpeg420_progressive": (lambda: jpeg_rgb(67, 45, "4:2:0", progressive=True), FAST),
    "jpeg444_progressive": (lambda: jpeg_rgb(67, 45, "4:4:4", progressive=True), FAST),
    "jpeg_grey": (lambda: jpeg_grey(51, 37), FAST),
    "jpeg_grey_progressive": (lambda: jpeg_grey(51, 37, progressive=True), FAST),
    "jpeg_cmyk": (lambda: jpeg_cmyk(45, 33), PILLOW),
    "jpeg_1x1": (lambda: jpeg_rgb(1, 1), FAST),
    "jpeg_1x57": (lambda: jpeg_rgb(1, 57), FAST),
    "jpeg_57x1": (lambda: jpeg_rgb(57, 1), FAST),
    "jpeg_13x13": (lambda: jpeg_rgb(13, 13), FAST),
    "jpeg_29x31": (lambda: jpeg_rgb(29, 31), FAST),
    "jpeg422_29x31": (lambda: jpeg_rgb(29, 31, "4:2:2"), FAST),
    "jpeg_grey_1x1": (lambda: jpeg_grey(1, 1), FAST),
    "jpeg_100x10000": (lambda: jpeg_rgb(100, 10000), FAST),
    "jpeg_7300x50": (lambda: jpeg_rgb(7300, 50), FAST),
    "jpeg_grey_7300x50": (lambda: jpeg_grey(7300, 50), FAST),
    "jpeg_2300x1700": (lambda: jpeg_rgb(2300, 1700), FAST),  # K2.5 resizes both sides
    "jpeg_3600x3600": (lambda: jpeg_rgb(3600, 3600), FAST),  # K3 resizes both sides
    "png_rgb": (lambda: png_mode(37, 29, "RGB"), PILLOW),
    "png_rgba": (lambda: png_mode(37, 29, "RGBA"), PILLOW),
    "png_la": (lambda: png_mode(37, 29, "LA"), PILLOW),
    "png_l": (lambda: png_mode(37, 29, "L"), PILLOW),
    "png_l_trns": (lambda: png_mode(37, 29, "L+trns"), PILLOW),
    "png_1bit": (lambda: png_mode(37, 29, "1"), PILLOW),
    "png_p": (lambda: png_mode(37, 29, "P"), PILLOW),
    "png_p_trns": (lambda: png_mode(37, 29, "P+trns"), PILLOW),
    "gif_trns": (lambda: gif_transparent(41, 31), PILLOW),
    "gif_animated": (lambda: animated(41, 31, "GIF"), PILLOW),
    "apng_animated": (lambda: animated(41, 31, "PNG"), PILLOW),
    # Sides above 7168 px: every preset resizes, P/1 with NEAREST, RGBA/LA premultiplied (K3).
    "png_rgba_7300x50": (lambda: png_mode(7300, 50, "RGBA"), PILLOW),
    "png_la_50x7300": (lambda: png_mode(50, 7300, "LA"), PILLOW),
    "png_p_trns_7300x50": (lambda: png_mode(7300, 50, "P+trns"), PILLOW),
    "png_p_50x7300": (lambda: png_mode(50, 7300, "P"), PILLOW),
    "png_1bit_7300x50": (lambda: png_mode(7300, 50, "1"), PILLOW),
    "png_l_trns_50x7300": (lambda: png_mode(50, 7300, "L+trns"), PILLOW),
    "gif_trns_50x7300": (lambda: gif_transparent(50, 7300), PILLOW),
    "tiff_rgba_3600x3600": (lambda: rgba_tiff(3600, 3600), PILLOW),  # K3: premultiplied 2-D resize
}
CJPEG_CASES: dict[str, str] = {"jpeg440_cjpeg": "1x2", "jpeg411_cjpeg": "4x1"}


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("synthetic")


def synthetic_bytes(directory: Path, name: str, make: Callable[[], bytes]) -> bytes:
    """Generate once into ``directory`` (kept for inspection on failure), then read back."""
    path = directory / name
    if not path.exists():
        path.write_bytes(make())
    return path.read_bytes()


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_synthetic_exact(synthetic_dir: Path, name: str, preset: str) -> None:
    make, expected_path = SYNTHETIC[name]
    data = synthetic_bytes(synthetic_dir, name, make)
    result = kimi_vision_prep.preprocess_bytes(data, preset)
    assert_exact(result, reference_preprocess(data, preset), name)
    assert result.decode_path == expected_path


@pytest.mark.skipif(CJPEG is None, reason="cjpeg not on PATH (Debian: apt-get install libjpeg-turbo-progs)")
@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("name", sorted(CJPEG_CASES))
def test_cjpeg_subsampling_exact(synthetic_dir: Path, name: str, preset: str) -> None:
    """4:4:0 and 4:1:1 (which Pillow cannot write) decode like Pillow through the fast path."""
    data = synthetic_bytes(synthetic_dir, name, lambda: cjpeg_rgb(61, 43, CJPEG_CASES[name]))
    result = kimi_vision_prep.preprocess_bytes(data, preset)
    assert_exact(result, reference_preprocess(data, preset), name)
    assert result.decode_path == FAST


def test_synthetic_cases_really_resize() -> None:
    """The oversized cases exercise resizing (else they would not test it) under both presets."""
    for name, (width, height) in {"7300x50": (7300, 50), "50x7300": (50, 7300), "100x10000": (100, 10000)}.items():
        for preset in PRESET_NAMES:
            size = ref_size(width, height, REF_PRESETS[preset])
            assert (size.new_w, size.new_h) != (width, height), (name, preset)
    assert ref_size(2300, 1700, REF_PRESETS["kimi-k2.5"]).new_w < 2300
    k3 = ref_size(3600, 3600, REF_PRESETS["kimi-k3"])
    assert k3.new_w < 3600 and k3.new_h < 3600


# --- chroma upsampling: why fancy upsampling is needed ------------------------------------------


def decode_with_nvimgcodec(data: bytes, options: str) -> np.ndarray:
    from nvidia import nvimgcodec

    decoder = nvimgcodec.Decoder(
        device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
        backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)],
        options=options,
    )
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False)
    image = decoder.decode(nvimgcodec.CodeStream(data), params=params)
    assert image is not None
    return np.asarray(image.cpu())


def test_nvimgcodec_needs_fancy_upsampling() -> None:
    data = jpeg_rgb(96, 64, "4:2:0")
    pillow = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    fancy = decode_with_nvimgcodec(data, ":fancy_upsampling=1")
    nearest = decode_with_nvimgcodec(data, ":fancy_upsampling=0")
    assert np.array_equal(fancy, pillow)
    assert not np.array_equal(nearest, pillow)
    assert np.abs(nearest.astype(int) - pillow).max() > 10  # colour edges move by many levels


# --- EXIF orientation is not applied -----------------------------------------------------------


def test_exif_orientation_not_applied_corpus(corpus: Path) -> None:
    data = (corpus / "pil__hopper_orientation_6.jpg").read_bytes()
    image = Image.open(io.BytesIO(data))
    assert image.getexif().get(0x0112) == 6
    result = kimi_vision_prep.preprocess_bytes(data)
    assert (result.width, result.height) == image.size
    assert_exact(result, reference_preprocess(data, "kimi-k2.5"), "orientation 6")
    # The rotated image differs, so the comparison above would catch a rotation.
    rotated = io.BytesIO()
    ImageOps.exif_transpose(image.convert("RGB")).save(rotated, "PNG")
    assert not np.array_equal(reference_preprocess(rotated.getvalue(), "kimi-k2.5").pixel_values, result.pixel_values)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_exif_orientation_keeps_stored_size(preset: str) -> None:
    data = jpeg_with_orientation(60, 20, 6)  # displayed as 20x60 if rotated
    result = kimi_vision_prep.preprocess_bytes(data, preset)
    assert (result.width, result.height) == (60, 20)
    assert list(result.grid_thw) == [1, 2, 6]  # 60x20 pads to 84x28 -> 6 patches wide, 2 high
    assert_exact(result, reference_preprocess(data, preset), "synthetic orientation 6")


# --- batches and random small JPEGs -------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_corpus_as_one_batch_exact(corpus: Path, preset: str) -> None:
    """One preprocess_batch call (one nvImageCodec batch decode) gives the same per-image outputs."""
    datas = [(corpus / name).read_bytes() for name in ACCEPTED]
    results = kimi_vision_prep.preprocess_batch(datas, preset)
    for name, data, result in zip(ACCEPTED, datas, results, strict=True):
        assert isinstance(result, PreprocessResult), (name, result)
        assert_exact(result, reference_preprocess(data, preset), name)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_resized_by_a_decode_step_exact(corpus: Path, synthetic_dir: Path, preset: str) -> None:
    """The served split: ``resized_decoded`` (the decode step: RGB at the NaViT size, composited
    under K3), then ``preprocess_decoded`` on those pixels (the preprocess step: pad and patchify)
    equals the reference for every accepted corpus file and the synthetic resize cases."""
    decoder, settings = kimi_vision_prep.default_decoder(), kimi_vision_prep.get_preset(preset)
    datas = {name: (corpus / name).read_bytes() for name in ACCEPTED}
    datas.update({name: synthetic_bytes(synthetic_dir, name, make) for name, (make, _) in SYNTHETIC.items()})
    for name, data in datas.items():
        resized = kimi_vision_prep.resized_decoded(decoder.decode(data, settings), settings)
        size = ref_size(resized.width, resized.height, REF_PRESETS[preset])
        assert resized.pixels.shape == (size.new_h, size.new_w, 3), name
        assert_exact(kimi_vision_prep.preprocess_decoded(resized, preset), reference_preprocess(data, preset), name)


small_jpegs = st.tuples(
    st.integers(1, 90),  # width
    st.integers(1, 90),  # height
    st.sampled_from(["4:4:4", "4:2:2", "4:2:0"]),
    st.booleans(),  # progressive
    st.integers(30, 100),  # quality
    st.integers(0, 1000),  # content seed
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=small_jpegs)
def test_random_small_jpeg_exact(case: tuple[int, int, str, bool, int, int]) -> None:
    width, height, subsampling, progressive, quality, seed = case
    image = Image.fromarray(rgb_pattern(width, height, seed), "RGB")
    data = encode(image, "JPEG", quality=quality, subsampling=subsampling, progressive=progressive)
    result = kimi_vision_prep.preprocess_bytes(data, "kimi-k2.5")
    assert result.decode_path == FAST
    assert_exact(result, reference_preprocess(data, "kimi-k2.5"), f"{case}")


# --- the reference itself against the spec ------------------------------------------------------


def test_reference_padding_and_normalisation() -> None:
    """mean = std = 0.5: value v maps to float32(v/255) * 2 - 1 in float64 steps; padding is -1.0."""
    data = encode(Image.new("RGB", (3, 2), (255, 0, 128)), "PNG")
    ref = reference_preprocess(data, "kimi-k2.5")
    assert ref.pixel_values.shape == (4, 3, 14, 14)  # 3x2 pads to 28x28: 2x2 patches
    top_left = ref.pixel_values[0]
    assert top_left[0, 0, 0] == 1.0 and top_left[1, 0, 0] == -1.0
    expected = np.float32((np.float64(np.float32(128 / 255.0)) - 0.5) * 2.0)
    assert top_left[2, 1, 2] == expected
    assert (top_left[:, 2:, :] == -1.0).all() and (top_left[:, :, 3:] == -1.0).all()
    assert (ref.pixel_values[1:] == -1.0).all()


def test_reference_chessboard() -> None:
    """Fully transparent pixels show the board (255 where (y//8 + x//8) is even, else 180)."""
    rgba = np.zeros((20, 20, 4), dtype=np.uint8)
    rgba[10:, 10:] = (10, 20, 30, 255)  # an opaque corner keeps its colour
    data = encode(Image.fromarray(rgba, "RGBA"), "PNG")
    ref = reference_preprocess(data, "kimi-k3")
    # Back from normalised values to uint8: v = (x + 1) / 2 * 255.
    values = np.rint((ref.pixel_values[0] + 1.0) / 2.0 * 255.0).astype(int)  # patch (0, 0): y, x < 14
    assert values[0, 0, 0] == 255 and values[0, 0, 8] == 180 and values[0, 8, 0] == 180 and values[0, 8, 8] == 255
    assert tuple(values[:, 12, 12]) == (10, 20, 30)
