"""Scratch arenas, recycled output blocks and ``out=``: reuse is bounded, never aliases what a
caller holds, and changes no pixel."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from make_inputs import jpeg_rgb
from reference import reference_preprocess

import kimi_vision_prep
from kimi_vision_prep import buffers
from kimi_vision_prep.buffers import configure_buffers, empty_output, scratch, scratch_scope


@pytest.fixture
def caps() -> Iterator[None]:
    """Restore the default caps after a test that changes them."""
    yield
    configure_buffers(
        scratch_cap_bytes=buffers.DEFAULT_SCRATCH_CAP_BYTES, recycle_cap_bytes=buffers.DEFAULT_RECYCLE_CAP_BYTES
    )


def test_scratch_reuses_the_same_buffers_in_the_next_scope() -> None:
    with scratch_scope():
        first = [scratch((300, 400, 3)), scratch((100, 400, 3))]
    with scratch_scope():
        again = [scratch((300, 400, 3)), scratch((100, 400, 3))]
    assert all(np.shares_memory(a, b) for a, b in zip(first, again, strict=True))
    assert not np.shares_memory(again[0], again[1])


def test_a_nested_scope_is_a_frame() -> None:
    """What a nested scope hands out is free again when it exits: the next frame reuses it; what the
    enclosing scope handed out before the frames stays its own."""
    with scratch_scope():
        kept = scratch((300, 400, 3))
        frames = []
        for _ in range(2):
            with scratch_scope():
                frames.append(scratch((300, 400, 3)))
        after = scratch((300, 400, 3))
    assert np.shares_memory(frames[0], frames[1]) and np.shares_memory(frames[0], after)
    assert not np.shares_memory(kept, frames[0])


def test_scratch_outside_a_scope_is_a_new_array() -> None:
    assert not np.shares_memory(scratch((64, 64, 3)), scratch((64, 64, 3)))


def test_scratch_cap_bounds_what_an_arena_holds(caps: None) -> None:
    configure_buffers(scratch_cap_bytes=1 << 20)
    with scratch_scope():
        small = scratch((512, 1024))  # fits: 0.5 MiB
        big = scratch((2048, 1024))  # beyond the cap: a plain array, not retained
    with scratch_scope():
        assert np.shares_memory(small, scratch((512, 1024)))
        assert not np.shares_memory(big, scratch((2048, 1024)))
    assert kimi_vision_prep.buffer_stats()["scratch_cap_bytes"] == 1 << 20


def test_arenas_are_per_thread() -> None:
    seen: dict[str, np.ndarray] = {}

    def take(name: str) -> None:
        with scratch_scope():
            seen[name] = scratch((256, 256, 3))

    threads = [threading.Thread(target=take, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not np.shares_memory(seen["a"], seen["b"])


def test_output_block_is_recycled_only_when_every_view_is_gone(caps: None) -> None:
    configure_buffers(recycle_cap_bytes=0)  # empty the free list: only this test's blocks on it
    configure_buffers(recycle_cap_bytes=64 << 20)
    shape = (4000, 3, 14, 14)  # 9 MiB of float32
    first = empty_output(shape, np.float32)
    view = first[100:200]
    address = first.__array_interface__["data"][0]
    del first
    held = empty_output(shape, np.float32)  # the view still holds the first block
    second = held.__array_interface__["data"][0]
    assert second != address
    del view, held
    assert kimi_vision_prep.buffer_stats()["recycled_bytes"] >= 2 * (9 << 20)
    reused = empty_output(shape, np.float32)
    assert reused.flags.c_contiguous and reused.flags.writeable
    assert reused.__array_interface__["data"][0] in (address, second)


def test_recycle_cap_bounds_the_free_list(caps: None) -> None:
    configure_buffers(recycle_cap_bytes=8 << 20)
    arrays = [empty_output((3 << 20,), np.uint8) for _ in range(5)]
    del arrays
    assert kimi_vision_prep.buffer_stats()["recycled_bytes"] <= 8 << 20
    configure_buffers(recycle_cap_bytes=0)
    assert kimi_vision_prep.buffer_stats()["recycled_bytes"] == 0


def test_caps_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        configure_buffers(scratch_cap_bytes=-1)


@pytest.mark.parametrize("output", ["pixel_values", "pixel_patches"])
def test_out_receives_the_exact_pixels(output: str) -> None:
    data = jpeg_rgb(1500, 1100)  # resized under K2.5
    expected = reference_preprocess(data, "kimi-k2.5")
    dtype = np.float32 if output == "pixel_values" else np.uint8
    out = np.full((expected.pixel_values.shape[0], 3, 14, 14), 7, dtype)
    result = kimi_vision_prep.preprocess_bytes(data, output=output, out=out)  # type: ignore[arg-type]
    assert getattr(result, output) is out
    pixel_values = out if output == "pixel_values" else kimi_vision_prep.pixel_values_from_patches(out)
    np.testing.assert_array_equal(pixel_values, expected.pixel_values)


@pytest.mark.parametrize(
    "out",
    [
        np.empty((10, 3, 14, 14), np.float32),  # wrong rows
        np.empty((25 * 4, 3, 14, 14), np.float64),  # wrong dtype
        np.empty((25 * 4, 14, 14, 3), np.float32).transpose(0, 3, 1, 2),  # not contiguous
    ],
    ids=["shape", "dtype", "contiguity"],
)
def test_out_is_checked(out: np.ndarray) -> None:
    with pytest.raises(ValueError, match="out"):
        kimi_vision_prep.preprocess_bytes(jpeg_rgb(140, 140), out=out)


def test_preprocess_images_writes_every_image_into_out() -> None:
    images = [jpeg_rgb(300, 200, seed=1), jpeg_rgb(90, 700, seed=2), jpeg_rgb(1800, 1200, seed=3)]
    expected = kimi_vision_prep.preprocess_images(images)
    out = np.empty_like(expected.pixel_values)
    result = kimi_vision_prep.preprocess_images(images, out=out)
    assert result.pixel_values is out
    np.testing.assert_array_equal(out, expected.pixel_values)
    np.testing.assert_array_equal(result.grid_thws, expected.grid_thws)
    with pytest.raises(ValueError, match="rows"):
        kimi_vision_prep.preprocess_images(images, out=out[1:])


def test_a_pipeline_call_leaves_the_arena_bounded_and_the_results_independent() -> None:
    first = kimi_vision_prep.preprocess_bytes(jpeg_rgb(2000, 1500, seed=4))
    kept = first.pixel_values.copy()
    kimi_vision_prep.preprocess_bytes(jpeg_rgb(2000, 1500, seed=5))
    np.testing.assert_array_equal(first.pixel_values, kept)
    stats = kimi_vision_prep.buffer_stats()
    assert 0 < stats["scratch_bytes"] <= stats["scratch_threads"] * stats["scratch_cap_bytes"]
