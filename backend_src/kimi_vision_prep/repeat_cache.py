"""Resized images of repeated inputs, for a decode step on a GPU.

tritonserver's response cache keeps only answers whose outputs are all in host memory, so a GPU
decode step, which hands on CUDA tensors, gets nothing from it. :class:`RepeatCache` keeps the
step's own results instead: each image at its NaViT size (what the step hands on), keyed by the
SHA-256 of its encoded bytes and the preset's name, least recently used first out, within a byte
cap. SHA-256, not a fast hash: no request can be made to collide with another's key.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from kimi_vision_common.presets import Preset

from .decode.routes import DecodedImage

RepeatKey = tuple[bytes, str]  # (SHA-256 of the encoded bytes, preset name)


def repeat_key(data: bytes, preset: Preset) -> RepeatKey:
    """The key of ``data`` decoded and resized under ``preset``."""
    return hashlib.sha256(data).digest(), preset.name


def pixel_bytes(pixels: Any) -> int:
    """Bytes held by a numpy array or a torch tensor."""
    if isinstance(pixels, np.ndarray):
        return pixels.nbytes
    return pixels.numel() * pixels.element_size()


class RepeatCache:
    """At most ``cap_bytes`` of resized images (numpy arrays or CUDA tensors), LRU, thread safe.

    An image larger than the cap is not kept. A kept image is handed to every later request with
    its key: callers read it, never write it. ``hits`` and ``misses`` count :meth:`get`.
    """

    def __init__(self, cap_bytes: int) -> None:
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self.held_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[RepeatKey, DecodedImage] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: RepeatKey) -> DecodedImage | None:
        with self._lock:
            image = self._entries.get(key)
            if image is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return image

    def put(self, key: RepeatKey, image: DecodedImage) -> None:
        """Keep ``image`` (resized RGB pixels) under ``key``, evicting the least recently used."""
        size = pixel_bytes(image.pixels)
        if size > self.cap_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.held_bytes -= pixel_bytes(old.pixels)
            while self.held_bytes + size > self.cap_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.held_bytes -= pixel_bytes(evicted.pixels)
            self._entries[key] = image
            self.held_bytes += size

    def __len__(self) -> int:
        return len(self._entries)
