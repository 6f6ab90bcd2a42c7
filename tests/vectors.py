"""Test vectors shared by every implementation of a rule (numba, torch, numpy, the C step): each
expected value is worked out here from the rule's words in plain Python (scalars, ``struct`` for
float32 rounding), never by the code under test. ``tests/test_vectors.py`` runs every
implementation on every vector.

- Normalisation (docs/contract.md): ``x = float32(v / 255)``, ``x -= mean[c]``, ``x *= 1 / std[c]``,
  float64 operands, float32 after each step.
- Pad and patchify: patch ``n = gy * gw + gx`` holds ``img[gy*p + y, gx*p + x, c]`` at
  ``[n, c, y, x]``, zero past the image's bottom and right edges.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


def f32(value: float) -> float:
    """``value`` rounded to float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


NORMALISATIONS = {
    "half": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "odd": ((0.1, 0.9, 0.333), (0.7, 0.05, 1.25)),
}


def normalised(value: int, channel: int, mean: tuple[float, ...], std: tuple[float, ...]) -> float:
    x = f32(value / 255.0)
    x = f32(x - mean[channel])
    return f32(x * (1.0 / std[channel]))


@dataclass(frozen=True)
class NormaliseVector:
    name: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    table: tuple[tuple[float, float, float], ...]  # [v][c] for v in 0..255


NORMALISE_VECTORS = [
    NormaliseVector(name, mean, std, tuple(tuple(normalised(v, c, mean, std) for c in range(3)) for v in range(256)))
    for name, (mean, std) in NORMALISATIONS.items()
]


def pixel(y: int, x: int, c: int) -> int:
    """The vectors' image content: every value 1..255 appears, none is 0 (padding stands out)."""
    return (y * 37 + x * 11 + c * 101) % 255 + 1


@dataclass(frozen=True)
class PatchVector:
    """A ``height x width`` RGB image of :func:`pixel` values in a ``grid_h x grid_w`` grid of
    ``p x p`` patches; ``patches`` is the uint8 ``(N, 3, p, p)`` expected, as nested tuples."""

    height: int
    width: int
    grid_h: int
    grid_w: int
    p: int

    @property
    def image(self) -> list[list[list[int]]]:
        return [[[pixel(y, x, c) for c in range(3)] for x in range(self.width)] for y in range(self.height)]

    @property
    def patches(self) -> list[list[list[list[int]]]]:
        p = self.p
        out = []
        for gy in range(self.grid_h):
            for gx in range(self.grid_w):
                patch = []
                for c in range(3):
                    rows = []
                    for y in range(p):
                        row = []
                        for x in range(p):
                            yy, xx = gy * p + y, gx * p + x
                            row.append(pixel(yy, xx, c) if yy < self.height and xx < self.width else 0)
                        rows.append(row)
                    patch.append(rows)
                out.append(patch)
        return out


PATCH_VECTORS = [
    PatchVector(4, 6, 2, 3, 2),  # exact fit
    PatchVector(5, 4, 2, 2, 3),  # padding at the bottom
    PatchVector(3, 7, 1, 3, 3),  # padding at the right
    PatchVector(13, 15, 1, 2, 14),  # both, one patch row
    PatchVector(1, 1, 2, 2, 14),  # a single pixel in a 2x2 merge block
    PatchVector(29, 30, 3, 3, 14),  # several patch rows, padded both ways
]
