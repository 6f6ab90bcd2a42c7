"""Resize kernels against Pillow itself: every expected value comes from Pillow 13 (``pillow_resize``)."""

from __future__ import annotations

import numpy as np
import pytest
from make_inputs import pillow_resize
from PIL import Image

from kimi_vision_prep import PRESETS, navit_target_size
from kimi_vision_prep.resize.resample import vertical_pass_first
from kimi_vision_prep.resize.resize import premultiply_torch, resize, unpremultiply_torch
from kimi_vision_prep.resize.resize_numba import premultiply_numpy, unpremultiply_numpy

torch = pytest.importorskip("torch")

PHOTO = "imagers__large_image.jpg"  # real 2268x1512 photo, 4:4:4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tensors here are small: torch's intra-op threads would only add wake-up latency."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_image(rng: np.random.Generator, height: int, width: int, channels: int) -> np.ndarray:
    """uint8 ``(H, W, C)`` noise; for RGBA the alpha mixes 0, 255 and arbitrary values."""
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    if channels == 4:
        kind = rng.integers(0, 3, (height, width))
        pixels[..., 3] = np.where(kind == 0, 0, np.where(kind == 1, 255, pixels[..., 3]))
    return pixels


def random_pairs(rng: np.random.Generator, n: int, max_in: int, max_out: int) -> list[tuple[int, int, int, int]]:
    """``n`` random ``(height, width, new_height, new_width)`` with 1-pixel sides over-represented."""
    sides = rng.integers(1, [max_in, max_in, max_out, max_out], (n, 4))
    ones = rng.random((n, 4)) < 0.05
    return [tuple(int(v) for v in row) for row in np.where(ones, 1, sides)]


def assert_resize_matches_pillow(pixels: np.ndarray, new_width: int, new_height: int, resample: str) -> None:
    expected = pillow_resize(pixels, new_width, new_height, resample)
    ours = resize(pixels, new_width, new_height, resample)
    assert isinstance(ours, np.ndarray) and ours.dtype == np.uint8
    where = f"{resample} {pixels.shape} -> {new_height}x{new_width}"
    np.testing.assert_array_equal(ours, expected, err_msg=where)
    tensor = resize(torch.tensor(pixels), new_width, new_height, resample)
    assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8
    np.testing.assert_array_equal(tensor.numpy(), expected, err_msg=f"torch {where}")


@pytest.mark.parametrize(("seed", "channels"), [(0, 3), (1, 3), (2, 4), (3, 4)])
def test_bicubic_random_sizes_match_pillow(seed: int, channels: int) -> None:
    """1,200 (size, target) pairs in all: downscale, upscale and mixed, RGB and premultiplied RGBA."""
    rng = np.random.default_rng(seed)
    for height, width, new_height, new_width in random_pairs(rng, 300, 72, 72):
        pixels = random_image(rng, height, width, channels)
        assert_resize_matches_pillow(pixels, new_width, new_height, "bicubic")


@pytest.mark.parametrize("channels", [3, 4])
def test_nearest_random_sizes_match_pillow(channels: int) -> None:
    rng = np.random.default_rng(10 + channels)
    for height, width, new_height, new_width in random_pairs(rng, 300, 90, 90):
        pixels = random_image(rng, height, width, channels)
        assert_resize_matches_pillow(pixels, new_width, new_height, "nearest")


def test_bicubic_large_factors_and_single_pass_match_pillow() -> None:
    """Wide kernels (strong downscale), one-dimensional changes (a pass skipped), 1-pixel rows, and
    images above the serial-work limit."""
    rng = np.random.default_rng(20)
    cases = [
        ((7, 3001), (7, 5)),
        ((2500, 3), (2, 3)),
        ((1, 4000), (1, 2073)),
        ((640, 480), (640, 301)),
        ((640, 480), (211, 480)),
        ((33, 700), (1, 1)),
        ((300, 400), (1554, 2073)),
        ((1200, 500), (300, 480)),  # vertical pass first, large enough for the multi-threaded kernels
    ]
    for (height, width), (new_height, new_width) in cases:
        for channels in (3, 4):
            assert_resize_matches_pillow(random_image(rng, height, width, channels), new_width, new_height, "bicubic")


def test_horizontal_tile_edges_match_pillow() -> None:
    """Row counts around the RGB tile (24 rows, moved in and out in groups of 8 by a byte
    transposition) and source and result widths around its 8-byte words: full and partial groups,
    rows shorter than one word, rows of several words and a tail."""
    rng = np.random.default_rng(25)
    for height in (1, 7, 8, 9, 23, 24, 25, 31, 32, 33, 47, 48, 49):
        for width in (1, 2, 3, 5, 8, 11, 16, 17, 29, 64):
            pixels = random_image(rng, height, width, 3)
            assert_resize_matches_pillow(pixels, max(1, width * 2 // 3), height, "bicubic")
            assert_resize_matches_pillow(pixels, width + 3, height, "bicubic")


def test_pass_order_boundary_matches_pillow() -> None:
    """Around the vertical-first rule ``h - nh > 2 * (w - nw)`` the two orders give different pixels;
    Pillow must be matched on both sides of the boundary."""
    rng = np.random.default_rng(30)
    checked_both_orders = set()
    for height, width, new_height in [(100, 100, 50), (50, 200, 25), (97, 61, 30), (120, 40, 119)]:
        boundary = width - (height - new_height) / 2
        for new_width in range(max(1, int(boundary) - 2), int(boundary) + 3):
            if new_width == width:
                continue
            checked_both_orders.add(vertical_pass_first(width, height, new_width, new_height))
            assert_resize_matches_pillow(random_image(rng, height, width, 3), new_width, new_height, "bicubic")
    assert checked_both_orders == {True, False}


def test_same_size_is_returned_unchanged() -> None:
    pixels = random_image(np.random.default_rng(40), 9, 7, 4)
    assert resize(pixels, 7, 9, "bicubic") is pixels
    tensor = torch.from_numpy(pixels)
    assert resize(tensor, 7, 9, "nearest") is tensor


def test_non_contiguous_input() -> None:
    pixels = random_image(np.random.default_rng(41), 60, 80, 3)[::2, 1::3]
    assert_resize_matches_pillow(pixels, 11, 17, "bicubic")


def all_alpha_value_pairs() -> np.ndarray:
    """uint8 ``(256, 256, 4)``: pixel ``(a, v)`` is ``(v, 255 - v, v, a)``."""
    alpha, value = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    return np.stack([value, 255 - value, value, alpha], axis=-1).astype(np.uint8)


def test_premultiply_exhaustive_matches_pillow() -> None:
    pixels = all_alpha_value_pairs()
    expected = np.asarray(Image.fromarray(pixels, "RGBA").convert("RGBa"))
    np.testing.assert_array_equal(premultiply_numpy(pixels), expected)
    premultiplied = premultiply_torch(torch.from_numpy(pixels))
    assert premultiplied.dtype == torch.uint8  # the twins take and return the same dtype
    np.testing.assert_array_equal(premultiplied.numpy(), expected)


def test_unpremultiply_exhaustive_matches_pillow() -> None:
    pixels = all_alpha_value_pairs()
    expected = np.asarray(Image.frombytes("RGBa", (256, 256), pixels.tobytes()).convert("RGBA"))
    np.testing.assert_array_equal(unpremultiply_numpy(pixels.copy()), expected)
    ours_torch = unpremultiply_torch(torch.from_numpy(pixels))
    assert ours_torch.dtype == torch.uint8
    np.testing.assert_array_equal(ours_torch.numpy(), expected)


def test_alpha_conversions_random_images_match_pillow() -> None:
    pixels = random_image(np.random.default_rng(50), 123, 77, 4)
    premultiplied = np.asarray(Image.fromarray(pixels, "RGBA").convert("RGBa"))
    np.testing.assert_array_equal(premultiply_numpy(pixels), premultiplied)
    straight = np.asarray(Image.frombytes("RGBa", (77, 123), pixels.tobytes()).convert("RGBA"))
    np.testing.assert_array_equal(unpremultiply_numpy(pixels.copy()), straight)


@pytest.fixture(scope="module")
def photo(corpus) -> np.ndarray:
    with Image.open(corpus / PHOTO) as image:
        return np.asarray(image.convert("RGB"))


@pytest.mark.parametrize("preset", ["kimi-k2.5", "kimi-k3"])
def test_corpus_photo_to_navit_target_matches_pillow(photo: np.ndarray, preset: str) -> None:
    target = navit_target_size(photo.shape[1], photo.shape[0], PRESETS[preset])
    assert_resize_matches_pillow(photo, target.new_width, target.new_height, "bicubic")


def test_corpus_photo_with_alpha_matches_pillow(photo: np.ndarray) -> None:
    """Premultiplied path on real content: the photo with a varying alpha, to the K2.5 target."""
    height, width = photo.shape[:2]
    alpha = ((np.arange(height)[:, None] * 3 + np.arange(width)[None, :]) % 256).astype(np.uint8)
    rgba = np.concatenate([photo, alpha[:, :, None]], axis=-1)
    target = navit_target_size(width, height, PRESETS["kimi-k2.5"])
    assert_resize_matches_pillow(rgba, target.new_width, target.new_height, "bicubic")


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="uint8"):
        resize(np.zeros((4, 4, 3), dtype=np.float32), 2, 2, "bicubic")
    with pytest.raises(ValueError, match="uint8"):
        resize(np.zeros((4, 4, 2), dtype=np.uint8), 2, 2, "bicubic")
    with pytest.raises(ValueError, match="positive"):
        resize(np.zeros((4, 4, 3), dtype=np.uint8), 0, 2, "bicubic")
    with pytest.raises(TypeError, match=r"numpy\.ndarray or torch\.Tensor or PIL\.Image\.Image"):
        resize([[0]], 2, 2, "bicubic")


def test_pil_kernel_resizes_in_the_source_mode() -> None:
    """A Pillow image (K3's source-mode route: CMYK, I;16, ...) is resized by Pillow in its mode."""
    rng = np.random.default_rng(60)
    cmyk = Image.frombytes("CMYK", (50, 40), rng.integers(0, 256, 40 * 50 * 4, dtype=np.uint8).tobytes())
    grey16 = Image.frombytes("I;16", (50, 40), rng.integers(0, 65536, 40 * 50, dtype=np.uint16).tobytes())
    for image in (cmyk, grey16):
        resized = resize(image, 21, 17, "bicubic")
        assert resized.mode == image.mode
        assert resized.tobytes() == image.resize((21, 17), Image.Resampling.BICUBIC).tobytes()
        assert resize(image, 50, 40, "bicubic") is image
