"""The GPU decode step's own cache of repeated images (``kimi_vision_prep.repeat_cache``): keyed by
SHA-256 of the bytes and the preset, least recently used out within its byte cap."""

from __future__ import annotations

import numpy as np
import pytest
from make_inputs import jpeg_rgb, with_comment

from kimi_vision_prep import get_preset, preprocess_bytes, preprocess_decoded
from kimi_vision_prep.decode.decoder import ImageDecoder
from kimi_vision_prep.pipeline import resized_decoded
from kimi_vision_prep.repeat_cache import RepeatCache, pixel_bytes, repeat_key

K25, K3 = get_preset("kimi-k2.5"), get_preset("kimi-k3")


def resized(data: bytes) -> object:
    return resized_decoded(ImageDecoder("cpu").decode(data, K25), K25)


def test_keys_differ_with_the_bytes_and_the_preset_only() -> None:
    data = jpeg_rgb(64, 48, seed=1)
    same_pixels = with_comment(data, b"ab")

    assert repeat_key(data, K25) == repeat_key(bytes(data), get_preset("kimi-k2.5"))
    assert len({repeat_key(data, K25), repeat_key(same_pixels, K25), repeat_key(data, K3)}) == 3


def test_a_kept_image_comes_back_and_counts_as_a_hit() -> None:
    cache = RepeatCache(16 << 20)
    data = jpeg_rgb(300, 200, seed=2)
    key = repeat_key(data, K25)
    assert cache.get(key) is None
    image = resized(data)
    cache.put(key, image)

    assert cache.get(key) is image
    assert (cache.hits, cache.misses, cache.held_bytes) == (1, 1, pixel_bytes(image.pixels))


def test_the_least_recently_used_go_first_and_the_cap_holds() -> None:
    images = {seed: resized(jpeg_rgb(200, 200, seed=seed)) for seed in range(4)}
    size = pixel_bytes(images[0].pixels)
    cache = RepeatCache(3 * size)
    for seed, image in list(images.items())[:3]:
        cache.put((bytes([seed]), "k"), image)
    cache.get((bytes([0]), "k"))  # 0 is now the most recently used: 1 goes first
    cache.put((bytes([3]), "k"), images[3])

    assert cache.get((bytes([1]), "k")) is None
    assert all(cache.get((bytes([s]), "k")) is images[s] for s in (0, 2, 3))
    assert cache.held_bytes == 3 * size <= cache.cap_bytes


def test_an_image_larger_than_the_cap_is_not_kept() -> None:
    image = resized(jpeg_rgb(300, 200, seed=3))
    cache = RepeatCache(pixel_bytes(image.pixels) - 1)
    cache.put(repeat_key(b"x", K25), image)

    assert (len(cache), cache.held_bytes) == (0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        RepeatCache(-1)


def test_a_kept_image_preprocesses_like_a_fresh_decode() -> None:
    data = jpeg_rgb(900, 700, seed=4)
    cache = RepeatCache(64 << 20)
    cache.put(repeat_key(data, K25), resized(data))

    again = preprocess_decoded(cache.get(repeat_key(data, K25)), K25)
    np.testing.assert_array_equal(again.pixel_values, preprocess_bytes(data, K25).pixel_values)
