"""Every implementation of a rule against the one table of vectors (tests/vectors.py): the
normalise table (numpy, the C step), pad + patchify (numba, torch, the C step) and the uint8 wire's
expansion (numba, torch, the client's numpy)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from c_step import F32_P, U8_P, load_c_step
from vectors import NORMALISE_VECTORS, PATCH_VECTORS, NormaliseVector, PatchVector

from kimi_vision_common.patches import expand_with_table, expand_with_table_torch, normalize_table
from kimi_vision_prep.patchify.normalize import IDENTITY_TABLE, write_patches_numpy, write_patches_torch
from kimi_vision_prep.patchify.normalize import expand_patches as expand_patches_numba

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def c_step() -> ctypes.CDLL:
    return load_c_step()


def expected_table(vector: NormaliseVector) -> np.ndarray:
    return np.array(vector.table, dtype=np.float32)


def c_table(c_step: ctypes.CDLL, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    channel_major = np.empty(3 * 256, np.float32)
    doubles = ctypes.c_double * 3
    c_step.kimi_normalize_tables(doubles(*mean), doubles(*std), channel_major.ctypes.data_as(F32_P))
    return channel_major.reshape(3, 256).T


@pytest.mark.parametrize("vector", NORMALISE_VECTORS, ids=lambda v: v.name)
def test_every_normalise_table_is_the_vectors(c_step: ctypes.CDLL, vector: NormaliseVector) -> None:
    expected = expected_table(vector)
    assert np.array_equal(normalize_table(vector.mean, vector.std), expected)
    assert np.array_equal(c_table(c_step, vector.mean, vector.std), expected)


def c_patches(c_step: ctypes.CDLL, image: np.ndarray, vector: PatchVector, table: np.ndarray | None) -> np.ndarray:
    shape = (vector.grid_h * vector.grid_w, 3, vector.p, vector.p)
    pixels, grid = image.ctypes.data_as(U8_P), (vector.grid_h, vector.grid_w)
    if table is None:
        out = np.empty(shape, np.uint8)
        c_step.kimi_write_patches_u8(pixels, vector.height, vector.width, out.ctypes.data_as(U8_P), *grid, vector.p)
        return out
    out32 = np.empty(shape, np.float32)
    channel_major = np.ascontiguousarray(table.T).ctypes.data_as(F32_P)
    c_step.kimi_write_patches_f32(
        pixels, vector.height, vector.width, channel_major, out32.ctypes.data_as(F32_P), *grid, vector.p
    )
    return out32


def patch_implementations(c_step: ctypes.CDLL) -> dict[str, Callable[[np.ndarray, PatchVector, Any], np.ndarray]]:
    """Each implementation of pad + patchify + table lookup: ``(image, vector, table) -> patches``
    (``table`` None: the uint8 patches)."""

    def numba(image: np.ndarray, v: PatchVector, table: Any) -> np.ndarray:
        return write_patches_numpy(image, IDENTITY_TABLE if table is None else table, v.grid_h, v.grid_w, v.p)

    def on_torch(image: np.ndarray, v: PatchVector, table: Any) -> np.ndarray:
        result = write_patches_torch(
            torch.from_numpy(image.copy()), IDENTITY_TABLE if table is None else table, v.grid_h, v.grid_w, v.p
        )
        return result.numpy()

    return {"numba": numba, "torch": on_torch, "c": lambda image, v, table: c_patches(c_step, image, v, table)}


@pytest.mark.parametrize("vector", PATCH_VECTORS, ids=lambda v: f"{v.height}x{v.width}-p{v.p}")
def test_every_patchify_is_the_vectors(c_step: ctypes.CDLL, vector: PatchVector) -> None:
    image = np.array(vector.image, dtype=np.uint8).reshape(vector.height, vector.width, 3)
    expected_u8 = np.array(vector.patches, dtype=np.uint8)
    for normalisation in NORMALISE_VECTORS:
        table = expected_table(normalisation)
        expected_f32 = np.take_along_axis(
            np.broadcast_to(table.T[None, :, :], (len(expected_u8), 3, 256)),
            expected_u8.reshape(len(expected_u8), 3, -1).astype(np.int64),
            axis=2,
        ).reshape(expected_u8.shape)
        for name, implementation in patch_implementations(c_step).items():
            assert np.array_equal(implementation(image, vector, None), expected_u8), name
            assert np.array_equal(implementation(image, vector, table), expected_f32), (name, normalisation.name)
        # The uint8 wire's expansion, by each implementation of it.
        assert np.array_equal(expand_with_table(expected_u8, table), expected_f32)
        assert np.array_equal(expand_patches_numba(expected_u8, table), expected_f32)
        assert np.array_equal(expand_with_table_torch(torch.from_numpy(expected_u8), table).numpy(), expected_f32)
