"""Fixtures of the GPU tests: they skip unless CUDA and nvImageCodec's CUDA decoder are usable."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_common import CORPUS


@pytest.fixture(scope="session")
def gpu_corpus() -> Path:
    """The repository's test corpus (``tests/data/corpus``)."""
    return CORPUS


@pytest.fixture(scope="session")
def cuda_device() -> str:
    """``"cuda:N"`` of the current device, once nvImageCodec has built a CUDA decoder on it."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("nvidia.nvimgcodec")
    from kimi_vision_prep import ImageDecoder

    device = f"cuda:{torch.cuda.current_device()}"
    try:  # the decoder the library builds (its backends and options): a probe of its own could differ
        ImageDecoder(device, gpu_route="nvimgcodec")._make_decoder()
    except Exception as exc:
        pytest.skip(f"nvImageCodec cannot build a CUDA decoder: {type(exc).__name__}: {exc}")
    return device
