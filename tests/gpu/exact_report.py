"""The ``exact_route`` section of ``gpu_report.py``: the exact GPU route (``coefficients-cuda``,
coefficients read on the CPU, libjpeg's integer arithmetic in torch kernels on the device).

- ``equality``: per accepted corpus JPEG, the kernels on the device vs the same kernels on the CPU
  vs Pillow (in Pillow's mode): taken, equal to each, refused and why, the files that differ.
- ``throughput``: images/s (median of repeats) and CPU seconds per image (the process's CPU time,
  every thread, over the timed calls) of the default ``cuda`` decoder (exact route), the same
  decoder with ``gpu_route="nvimgcodec"`` and the CPU decoder, on the corpus JPEGs the exact route
  takes and on synthetic photos.
- ``memory``: device memory per decoder and decode, on a 12 MP photo: ``torch.cuda.max_memory_allocated``
  above what was allocated before (torch's allocator: the kernels' temporaries and the pixels; nvImageCodec
  allocates outside it, so ``mem_get_info``'s change is given too), for one decode and for two callers at once
  through a pool of two.

On ``--device cpu`` (a smoke run) the kernels run on the CPU tensors and the decoders' rows are the CPU's.
"""

from __future__ import annotations

import io
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_common import CorpusFile
from PIL import Image

from kimi_vision_prep import ImageDecoder, get_preset
from kimi_vision_prep.decode.jpeg_kernels import decode_jpeg

MIB = 1 << 20
PRESET = get_preset("kimi-k2.5")


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def equality(device: str, corpus: Path, files: list[CorpusFile]) -> dict[str, Any]:
    """Kernels on ``device`` vs on the CPU vs Pillow, per accepted corpus JPEG."""
    counts: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    differ: list[str] = []
    for item in (f for f in files if f.is_jpeg):
        data = (corpus / item.name).read_bytes()
        on_device, reason = decode_jpeg(data, device)
        on_cpu, cpu_reason = decode_jpeg(data, "cpu")
        counts["files"] += 1
        if reason is not None or cpu_reason is not None:
            refused[reason if reason is not None else "taken on the device only"] += 1  # refused by the CPU
            if reason != cpu_reason:
                differ.append(f"{item.name}: refused {reason!r} on the device, {cpu_reason!r} on the CPU")
            continue
        counts["taken"] += 1
        host = on_device.cpu()
        with Image.open(io.BytesIO(data)) as image:
            pillow = np.asarray(image)
        equal_cpu, equal_pillow = torch.equal(host, on_cpu), host.shape == pillow.shape and np.array_equal(host, pillow)
        counts["equal_cpu_kernels"] += equal_cpu
        counts["equal_pillow"] += equal_pillow
        if not (equal_cpu and equal_pillow):
            differ.append(f"{item.name}: equal to the CPU kernels {equal_cpu}, to Pillow {equal_pillow}")
    return dict(counts) | {"refused": dict(refused), "differ": differ, "exact": not differ}


def _timed(fn: Callable[[], object], images: int, repeats: int) -> dict[str, float]:
    """``fn`` (decodes ``images`` images) after a warm-up: wall and process CPU time."""
    fn()
    walls, cpu_start = [], time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu_start
    median = statistics.median(walls)
    return {"median_s": median, "images_per_s": images / median, "cpu_s_per_image": cpu / (images * repeats)}


def throughput(device: str, sets: dict[str, list[bytes]], repeats: int) -> dict[str, Any]:
    """The exact route against nvImageCodec and the CPU route, per set of images."""
    cuda = device.startswith("cuda")
    decoders = {"cpu_route": ImageDecoder("cpu")}
    if cuda:
        gpu = {"exact": ImageDecoder(device), "nvimgcodec": ImageDecoder(device, gpu_route="nvimgcodec")}
        decoders = gpu | decoders
    results: dict[str, Any] = {}
    for name, items in sets.items():
        methods: dict[str, Callable[[], object]] = {
            route: (lambda d=decoder, i=items: (d.decode_batch(i, PRESET), _synchronize(device)))
            for route, decoder in decoders.items()
        }
        if not cuda:  # smoke run: the kernels on the CPU, one image after another
            methods["exact_kernels_cpu"] = lambda i=items: [decode_jpeg(d, "cpu") for d in i]
        results[name] = {"images": len(items)} | {m: _timed(fn, len(items), repeats) for m, fn in methods.items()}
    paths = {route: d.stats.snapshot() for route, d in decoders.items()}
    return {"repeats": repeats, "sets": results, "decode_paths": paths}


def _peak_mib(device: str, fn: Callable[[], object]) -> dict[str, float]:
    """Device memory ``fn`` used: torch's peak above the allocation before, and ``mem_get_info``'s change."""
    _synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    allocated, (free_before, _) = torch.cuda.memory_allocated(device), torch.cuda.mem_get_info(device)
    kept = fn()
    _synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    del kept
    return {
        "torch_peak_above_before_mib": (torch.cuda.max_memory_allocated(device) - allocated) / MIB,
        "mem_get_info_change_mib": (free_before - free_after) / MIB,
    }


def memory(device: str, photo: bytes) -> dict[str, Any]:
    """Device memory of one decode and of two at once, per route, on ``photo``."""
    if not device.startswith("cuda"):
        return {"skipped": "needs CUDA"}
    result: dict[str, Any] = {"image": "4000x3000 4:2:0 JPEG"}
    for route in ("exact", "nvimgcodec"):
        decoder = ImageDecoder(device, pool_size=2, gpu_route=route)  # type: ignore[arg-type]
        decoder.decode(photo, PRESET)  # warm: nvImageCodec's decoder made, torch's cache filled

        def two_at_once(d: ImageDecoder = decoder) -> object:
            with ThreadPoolExecutor(2) as pool:
                return list(pool.map(lambda _: d.decode(photo, PRESET), range(2)))

        result[route] = {
            "one_decode": _peak_mib(device, lambda d=decoder: d.decode(photo, PRESET)),
            "two_callers_pool_of_two": _peak_mib(device, two_at_once),
            "pool_created": decoder.pool.created,
            "pixels_mib": 4000 * 3000 * 3 / MIB,
        }
    return result


def exact_route(
    device: str, corpus: Path, files: list[CorpusFile], repeats: int, photos: dict[str, list[bytes]]
) -> dict[str, Any]:
    """The section: equality, throughput and memory (``photos``: synthetic sets by name, the last
    set's first photo measured for memory)."""
    jpegs = [(corpus / f.name).read_bytes() for f in files if f.is_jpeg]
    taken = [data for data in jpegs if decode_jpeg(data)[1] is None]
    sets = {"corpus_exact_jpegs": taken} | photos
    return {
        "equality": equality(device, corpus, files),
        "throughput": throughput(device, sets, repeats),
        "memory": memory(device, list(photos.values())[-1][0]),
    }
