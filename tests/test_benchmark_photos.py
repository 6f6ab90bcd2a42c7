"""The benchmark's camera photos (``benchmarks/data/``, public test suites) are exact like the corpus:
``preprocess_bytes`` equals the plain reference on each, for every served preset, on the route the
scan picks; and the folder stays what its README promises (licences listed, <= 30 MB)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from reference import reference_preprocess

import kimi_vision_prep

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
PHOTOS = sorted(DATA.glob("*/*.jpg"))


def test_the_folder_is_bounded_and_every_photo_is_listed_with_its_licence() -> None:
    readme = (DATA / "README.md").read_text()
    assert len(PHOTOS) >= 10
    assert sum(path.stat().st_size for path in PHOTOS) <= 30 << 20
    for path in PHOTOS:
        assert f"| {path.name} |" in readme, f"{path} is not listed in {DATA / 'README.md'}"
    assert "Licence" in readme


@pytest.mark.parametrize("preset", ["kimi-k2.5", "kimi-k3"])
@pytest.mark.parametrize("path", PHOTOS, ids=lambda p: p.name)
def test_camera_photo_is_exact(path: Path, preset: str) -> None:
    data = path.read_bytes()
    expected = reference_preprocess(data, preset)
    result = kimi_vision_prep.preprocess_bytes(data, preset)
    assert result.decode_path in ("libjpeg", "nvimgcodec-cpu", "pillow")
    np.testing.assert_array_equal(result.grid_thw, expected.grid_thw)
    np.testing.assert_array_equal(result.pixel_values, expected.pixel_values)
