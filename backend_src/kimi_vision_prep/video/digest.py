"""A keyed digest of a decoded frame's pixels: how a whole decode checks the frames a plan handed
over already (:class:`~.frames.FrameProducer`)."""

from __future__ import annotations

import os

import numpy as np
from numba import njit

from ..numba_runtime import load_word

# The frame digest's primes (xxHash64's) and its key, random in each process: unlike a CRC's, a
# digest's value cannot be worked out ahead of time from the pixels a damaged stream decodes to.
_P1, _P2, _P3 = np.uint64(0x9E3779B185EBCA87), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
_DIGEST_KEY = np.uint64(int.from_bytes(os.urandom(8), "little"))


@njit(cache=True, nogil=True, inline="always")
def _mix(acc: np.uint64, word: np.uint64) -> np.uint64:
    """xxHash64's round: ``rotl(acc + word * P2, 31) * P1``, uint64 wrapping."""
    acc = acc + word * _P2
    return ((acc << np.uint64(31)) | (acc >> np.uint64(33))) * _P1


@njit(cache=True, nogil=True)
def _digest_rows(span: np.ndarray, rows: int, stride: int, length: int, key: np.uint64) -> np.uint64:
    """64-bit keyed digest of ``rows`` rows of ``length`` bytes, ``stride`` bytes apart in the uint8
    ``span``: four lanes of 8-byte words through :func:`_mix`, each row's last ``length % 32``
    bytes one at a time, then the shape and xxHash64's final avalanche."""
    a0, a1, a2, a3 = key + _P1 + _P2, key + _P2, key, key - _P1
    for r in range(rows):
        row = span[r * stride : r * stride + length]
        i = 0
        while i + 32 <= length:
            a0, a1 = _mix(a0, load_word(row, i)), _mix(a1, load_word(row, i + 8))
            a2, a3 = _mix(a2, load_word(row, i + 16)), _mix(a3, load_word(row, i + 24))
            i += 32
        while i < length:
            a0 = _mix(a0, np.uint64(row[i]) | np.uint64(256))
            i += 1
    h = a0 ^ _mix(np.uint64(1), a1) ^ _mix(np.uint64(2), a2) ^ _mix(np.uint64(3), a3)
    h ^= _mix(np.uint64(rows), np.uint64(length))
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    return h ^ (h >> np.uint64(32))


def frame_digest(rgb: np.ndarray) -> int:
    """A keyed 64-bit digest of an RGB uint8 ``(H, W, 3)`` frame's pixels (its rows may be padded):
    equal where two decodes gave the same frame. It runs on every sampled frame of a planned
    decode, so it is one pass of multiplies over 8-byte words rather than zlib's CRC-32, which
    takes 2.5 times as long. The kernel reads the rows where they lie, through one read-only
    uint8 span from the first row's start to the last row's end: one signature, padded or not."""
    if rgb.strides[1:] != (3, 1) or rgb.strides[0] < 3 * rgb.shape[1]:
        rgb = np.ascontiguousarray(rgb)
    height, length, stride = rgb.shape[0], 3 * rgb.shape[1], rgb.strides[0]
    span = np.lib.stride_tricks.as_strided(rgb, ((height - 1) * stride + length,), (1,), writeable=False)
    return int(_digest_rows(span, height, stride, length, _DIGEST_KEY))
