"""The normalise/patchify kernels: fused float32, uint8 patchify + expand, numpy (numba) and torch.

``PIXEL_VALUES`` is a table read of the padded, patchified uint8 pixels, so the uint8 route
(patchify, ship, expand) must equal the fused pass bit for bit, for any table and any size. The
layout is checked against a plain numpy pad + reshape/transpose (spec section 4).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import kimi_vision_prep as kvp
from kimi_vision_common.patches import expand_with_table_torch, normalize_table
from kimi_vision_prep.patchify.normalize import (
    IDENTITY_TABLE,
    expand_patches,
    patchify_numpy,
    patchify_torch,
    write_patch_rows,
    write_patches_numpy,
    write_patches_torch,
)

torch = pytest.importorskip("torch")

P = 14
TABLES = {
    "kimi": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "odd": ((0.1, 0.9, 0.33), (0.7, 0.05, 1.3)),
}


def reference_patches(image: np.ndarray, grid_h: int, grid_w: int, p: int) -> np.ndarray:
    """Plain numpy: zero-pad bottom/right, then ``[gy*gw + gx, c, y, x] = img[gy*p + y, gx*p + x, c]``."""
    padded = np.zeros((grid_h * p, grid_w * p, 3), dtype=np.uint8)
    padded[: image.shape[0], : image.shape[1]] = image
    return padded.reshape(grid_h, p, grid_w, p, 3).transpose(0, 2, 4, 1, 3).reshape(grid_h * grid_w, 3, p, p)


def random_cases(seed: int, n: int) -> list[tuple[np.ndarray, int, int]]:
    """(image, grid_h, grid_w): exact multiples of the patch, padded sizes, one-pixel images, extra padding."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        height, width = (int(v) for v in rng.integers(1, 160, size=2))
        if i % 4 == 0:
            height, width = -(-height // P) * P, -(-width // P) * P  # no padding at all
        extra_h, extra_w = (int(v) for v in rng.integers(0, 2, size=2)) if i % 3 == 0 else (0, 0)
        image = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        cases.append((image, -(-height // P) + extra_h, -(-width // P) + extra_w))
    cases.append((np.full((1, 1, 3), 255, np.uint8), 1, 1))
    cases.append((np.zeros((P, P, 3), np.uint8), 1, 1))
    return cases


@pytest.mark.parametrize("table_name", sorted(TABLES))
def test_patchify_then_expand_equals_the_fused_pass_numpy(table_name: str) -> None:
    table = normalize_table(*TABLES[table_name])
    for image, grid_h, grid_w in random_cases(seed=len(table_name), n=24):
        fused = write_patches_numpy(image, table, grid_h, grid_w, P)
        patches = patchify_numpy(image, grid_h, grid_w, P)
        assert patches.dtype == np.uint8 and patches.shape == (grid_h * grid_w, 3, P, P)
        assert np.array_equal(patches, reference_patches(image, grid_h, grid_w, P))
        expanded = expand_patches(patches, table)
        assert expanded.dtype == np.float32 and expanded.shape == fused.shape
        assert expanded.tobytes() == fused.tobytes()  # bit for bit (-0.0 and 0.0 would differ here)
        # and the fused pass is that table read of the reference layout
        assert np.array_equal(fused, table[reference_patches(image, grid_h, grid_w, P), np.arange(3)[:, None, None]])


def test_uint8_patches_split_without_lookup_only_for_the_identity_table() -> None:
    """Whole 14x14 patches of the identity table are split by byte shuffles, in one call and in
    row bands; any other uint8 table, and another patch side, take the lookup: all equal the
    reference (a shuffle path taken for a non-identity table would give the image's bytes)."""
    rng = np.random.default_rng(7)
    image = rng.integers(0, 256, size=(5 * P + 3, 7 * P, 3), dtype=np.uint8)
    grid_h, grid_w = 6, 8
    expected = reference_patches(image, grid_h, grid_w, P)
    assert np.array_equal(patchify_numpy(image, grid_h, grid_w, P), expected)
    banded = np.full_like(expected, 77)
    for rows in ((0, 2 * P), (2 * P, image.shape[0])):
        write_patch_rows(image, IDENTITY_TABLE, banded, grid_w, rows=rows)
    assert np.array_equal(banded, expected)
    shifted = ((np.arange(256)[:, None] + np.array([1, 2, 3])) % 256).astype(np.uint8)
    looked_up = shifted[expected, np.arange(3)[:, None, None]]
    assert np.array_equal(write_patches_numpy(image, shifted, grid_h, grid_w, P), looked_up)
    assert np.array_equal(patchify_numpy(image, 5, 7, 16), reference_patches(image, 5, 7, 16))


def test_padding_is_zero_in_patches_and_table_zero_in_pixel_values() -> None:
    table = normalize_table(*TABLES["odd"])
    image = np.full((15, 29, 3), 200, np.uint8)  # pads to 28x42: 2x3 patches
    patches = patchify_numpy(image, 2, 3, P)
    fused = write_patches_numpy(image, table, 2, 3, P)
    last = patches[5]  # bottom-right patch: one real row (y = 0), one real column (x = 0)
    assert (last[:, 0, 0] == 200).all() and (last[:, 1:, :] == 0).all() and (last[:, :, 1:] == 0).all()
    for c in range(3):
        assert (fused[5, c, 1:, :] == table[0, c]).all() and fused[5, c, 0, 0] == table[200, c]


def test_expand_accepts_read_only_and_non_contiguous_patches() -> None:
    table = normalize_table(*TABLES["kimi"])
    image = np.random.default_rng(7).integers(0, 256, size=(40, 50, 3), dtype=np.uint8)
    patches = patchify_numpy(image, 3, 4, P)
    expected = write_patches_numpy(image, table, 3, 4, P)
    read_only = patches.copy()
    read_only.setflags(write=False)
    strided = np.zeros((12, 3, P, 2 * P), np.uint8)
    strided[..., ::2] = patches
    for variant in (read_only, strided[..., ::2], np.asfortranarray(patches)):
        assert np.array_equal(expand_patches(variant, table), expected)
    writable_table = np.array(table)  # a caller's own (writable) table works too
    assert np.array_equal(expand_patches(patches, writable_table), expected)


def test_kernels_reject_bad_inputs() -> None:
    table = normalize_table(*TABLES["kimi"])
    with pytest.raises(ValueError, match="uint8"):
        expand_patches(np.zeros((1, 3, P, P), np.float32), table)
    with pytest.raises(ValueError, match="uint8"):
        expand_patches(np.zeros((1, 4, P, P), np.uint8), table)
    with pytest.raises(ValueError, match="table"):
        expand_patches(np.zeros((1, 3, P, P), np.uint8), table[:, :2])
    with pytest.raises(ValueError, match="larger"):
        patchify_numpy(np.zeros((30, 14, 3), np.uint8), 2, 1, P)
    with pytest.raises(ValueError, match="uint8"):
        expand_with_table_torch(torch.zeros((1, 3, P, P)), table)


@pytest.mark.parametrize("table_name", ["kimi", "odd"])
def test_torch_kernels_equal_numpy(table_name: str) -> None:
    """torch on the CPU (the same code runs on CUDA): patchify, expand and fused, all equal numpy."""
    table = normalize_table(*TABLES[table_name])
    for image, grid_h, grid_w in random_cases(seed=11, n=10):
        expected_patches = patchify_numpy(image, grid_h, grid_w, P)
        expected_values = write_patches_numpy(image, table, grid_h, grid_w, P)
        tensor = torch.from_numpy(image)
        patches = patchify_torch(tensor, grid_h, grid_w, P)
        assert patches.dtype == torch.uint8 and patches.is_contiguous()
        assert np.array_equal(patches.numpy(), expected_patches)
        expanded = expand_with_table_torch(patches, table)
        assert expanded.dtype == torch.float32 and expanded.numpy().tobytes() == expected_values.tobytes()
        assert write_patches_torch(tensor, table, grid_h, grid_w, P).numpy().tobytes() == expected_values.tobytes()


# -- the pipeline's choice of output --------------------------------------------------------------

PIPELINE_IMAGES = {
    "kimi-k2.5": ["pil__hopper.jpg", "imagers__large_image.jpg", "pilx__transparent.webp"],  # large: downscaled
    "kimi-k3": ["pilx__p_trns_single.png", "pilx__uncompressed_la.png", "imagers__large_image.jpg"],  # chessboard
}


@pytest.mark.parametrize("preset", sorted(PIPELINE_IMAGES))
def test_pipeline_pixel_patches_expand_to_pixel_values(corpus: Path, preset: str) -> None:
    for name in PIPELINE_IMAGES[preset]:
        data = (corpus / name).read_bytes()
        fused = kvp.preprocess_bytes(data, preset)
        split = kvp.preprocess_bytes(data, preset, output="pixel_patches")
        assert fused.pixel_patches is None and split.pixel_values is None
        assert split.pixel_patches.dtype == np.uint8 and split.pixel_patches.shape == fused.pixel_values.shape
        assert np.array_equal(split.grid_thw, fused.grid_thw) and split.num_tokens == fused.num_tokens
        expanded = kvp.pixel_values_from_patches(split.pixel_patches, preset)
        assert expanded.tobytes() == fused.pixel_values.tobytes(), name
        (batched,) = kvp.preprocess_batch([data], preset, output="pixel_patches")
        assert np.array_equal(batched.pixel_patches, split.pixel_patches)


def test_pipeline_torch_path_pixel_patches(corpus: Path) -> None:
    """Torch pixels (the GPU route, run on the CPU here) give the same patches and values."""
    decoded = kvp.default_decoder().decode((corpus / "pilx__transparent.webp").read_bytes(), kvp.KIMI_K3)
    on_torch = dataclasses.replace(decoded, pixels=torch.from_numpy(np.ascontiguousarray(decoded.pixels)))
    expected = kvp.preprocess_decoded(decoded, "kimi-k3")
    split = kvp.preprocess_decoded(on_torch, "kimi-k3", output="pixel_patches")
    on_numpy = kvp.preprocess_decoded(decoded, "kimi-k3", output="pixel_patches")
    assert isinstance(split.pixel_patches, torch.Tensor)
    assert np.array_equal(split.pixel_patches.numpy(), on_numpy.pixel_patches)
    expanded = kvp.pixel_values_from_patches(split.pixel_patches, "kimi-k3")
    assert expanded.numpy().tobytes() == expected.pixel_values.tobytes()


def test_pipeline_rejects_unknown_output_and_concat_of_patches(corpus: Path) -> None:
    data = (corpus / "pil__hopper.jpg").read_bytes()
    with pytest.raises(ValueError, match="output"):
        kvp.preprocess_bytes(data, output="float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pixel_values"):
        kvp.concat_results([kvp.preprocess_bytes(data, output="pixel_patches")])


def test_concat_results_of_nothing_is_empty_with_the_right_shapes() -> None:
    pixel_values, grid_thws = kvp.concat_results([], patch_size=14)
    assert pixel_values.shape == (0, 3, 14, 14) and pixel_values.dtype == np.float32
    assert grid_thws.shape == (0, 3) and grid_thws.dtype == np.int64


def test_public_ops_dispatch_on_the_array_type() -> None:
    """One op, one kernel per type (kimi_vision_prep.kernels): numpy in, numpy out; torch in, torch out."""
    from kimi_vision_prep.patchify.normalize import expand_patches as expand
    from kimi_vision_prep.patchify.normalize import patchify, write_patches

    table = normalize_table(*TABLES["kimi"])
    image = np.random.default_rng(8).integers(0, 256, size=(20, 30, 3), dtype=np.uint8)
    for array, kind in ((image, np.ndarray), (torch.from_numpy(image), torch.Tensor)):
        values, patches = write_patches(array, table, 2, 3, P), patchify(array, 2, 3, P)
        assert isinstance(values, kind) and isinstance(patches, kind) and isinstance(expand(patches, table), kind)
    with pytest.raises(TypeError, match=r"numpy\.ndarray or torch\.Tensor"):
        patchify(image.tolist(), 2, 3, P)
