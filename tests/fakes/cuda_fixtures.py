"""The fixtures of the CUDA-path tests: a fake nvImageCodec the decoder imports, a fake
``torch.cuda``, and the files and Pillow pixels they compare with."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kimi_vision_prep.decode import decoder as decode_module

from . import torch_cuda
from .nvimgcodec import FakeNvImgCodec


@pytest.fixture
def codec(monkeypatch: pytest.MonkeyPatch) -> FakeNvImgCodec:
    fake = FakeNvImgCodec()
    monkeypatch.setattr(decode_module, "import_nvimgcodec", lambda: fake)
    return fake


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> torch_cuda.FakeCuda:
    return torch_cuda.install(monkeypatch)


def read(corpus: Path, name: str) -> bytes:
    return (corpus / name).read_bytes()


def pillow_rgb(data: bytes) -> np.ndarray:
    """uint8 (H, W, 3): Pillow's pixels of ``data`` as RGB."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
