"""The few ``torch.cuda`` calls ``decode/decoder.py`` makes, faked for a CPU-only torch build.

``install(monkeypatch)`` replaces ``torch.cuda.device`` (records the device entered),
``torch.cuda.current_stream`` (a stream whose ``cuda_stream`` handle encodes the current device,
``STREAM_HANDLE_BASE + index``) and ``torch.Tensor.to`` for ``"cuda:N"`` targets only (records the
move and keeps the tensor on the CPU; every other ``to`` runs for real).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

STREAM_HANDLE_BASE = 0x5000


@dataclass(frozen=True)
class FakeStream:
    cuda_stream: int


@dataclass
class FakeCuda:
    current_device: int | None = None
    entered: list[int] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)

    def device(self, index: int) -> _DeviceContext:
        return _DeviceContext(self, index)

    def current_stream(self, device: Any = None) -> FakeStream:
        if self.current_device is None:
            raise AssertionError("current_stream() asked for outside a torch.cuda.device(...) block")
        return FakeStream(STREAM_HANDLE_BASE + self.current_device)


class _DeviceContext:
    def __init__(self, cuda: FakeCuda, index: int) -> None:
        self.cuda = cuda
        self.index = index
        self.previous: int | None = None

    def __enter__(self) -> None:
        self.previous = self.cuda.current_device
        self.cuda.current_device = self.index
        self.cuda.entered.append(self.index)

    def __exit__(self, *exc: object) -> None:
        self.cuda.current_device = self.previous


def install(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    real_to = torch.Tensor.to

    def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            cuda.moves.append(args[0])
            return tensor
        return real_to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "device", cuda.device)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return cuda
