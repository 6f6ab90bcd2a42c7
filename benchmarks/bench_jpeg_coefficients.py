"""The coefficient route on the CPU: what a GPU host's CPU still does per image (the coefficient read,
``decode/coefficients.py``) against a full decode of the same file, and the integer kernels' CPU
speed (``decode/jpeg_kernels.py`` on torch CPU tensors; for information: they are meant for a device).

Per benchmark photo (``photos.benchmark_photos``): CPU time (this thread's, ``time.thread_time``:
every step here runs on the calling thread but the kernels) and wall time of

* ``read``: :func:`~kimi_vision_prep.decode.coefficients.read_coefficients` (entropy decoding into
  the int16 blocks, Pillow's libjpeg-turbo);
* ``full_libjpeg``: a full decode by the same library on one thread (``jpeg_bands.decode_rows``);
* ``pillow``: ``np.asarray(Image.open(...))``, Pillow's own full decode;
* ``kernels``: :func:`~kimi_vision_prep.decode.jpeg_kernels.decode_coefficients` on CPU tensors
  (torch's intra-op threads: ``--threads``; their CPU time is the process's, ``time.process_time``).

Each file's route outcome is checked: equal to Pillow, or the reason it goes to Pillow. Interleaved
repeats; min and median reported.

    .venv/bin/python benchmarks/bench_jpeg_coefficients.py [--repeats 5] [--threads 1] \
        [--out bench_results/jpeg_coefficients.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from photos import benchmark_photos
from PIL import Image

from kimi_vision_prep.decode import jpeg_bands
from kimi_vision_prep.decode.coefficients import read_coefficients
from kimi_vision_prep.decode.jpeg_kernels import decode_coefficients


def timed(call: Callable[[], object], clock: Callable[[], float]) -> tuple[float, float]:
    """(CPU ms by ``clock``, wall ms) of one call."""
    cpu, wall = clock(), time.perf_counter()
    call()
    return (clock() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3


def bench_photo(data: bytes, repeats: int) -> dict:
    """The figures of one photo, or its route outcome where the route refuses it."""
    coefs = read_coefficients(data)
    if isinstance(coefs, str):
        return {"outcome": coefs}
    pixels, flag = decode_coefficients(coefs)
    with Image.open(io.BytesIO(data)) as image:
        reference = np.asarray(image)
    if bool(flag):
        return {"outcome": "out of range"}
    outcome = "equal" if np.array_equal(pixels.numpy(), reference) else "DIFFERENT"
    width, height = coefs.width, coefs.height
    rgb = np.empty((height, width, 3), np.uint8)
    calls = {
        "read": (lambda: read_coefficients(data), time.thread_time),
        "full_libjpeg": (lambda: jpeg_bands.decode_rows(data, rgb, 0, height), time.thread_time),
        "pillow": (lambda: np.asarray(Image.open(io.BytesIO(data))), time.thread_time),
        "kernels": (lambda: decode_coefficients(coefs), time.process_time),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (call, clock) in calls.items():
            samples[name].append(timed(call, clock))
    figures = {
        name: {
            "cpu_ms_min": round(min(c for c, _ in s), 2),
            "cpu_ms_median": round(statistics.median(c for c, _ in s), 2),
            "wall_ms_median": round(statistics.median(w for _, w in s), 2),
        }
        for name, s in samples.items()
    }
    read, full = figures["read"]["cpu_ms_median"], figures["full_libjpeg"]["cpu_ms_median"]
    return {
        "outcome": outcome, "width": width, "height": height, "mode": coefs.mode,
        "sampling": [(c.h, c.v) for c in coefs.components], **figures,
        "read_share_of_full_decode": round(read / full, 3) if full else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the kernels")
    parser.add_argument("--out", type=Path, default=Path("bench_results/jpeg_coefficients.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for name, data in benchmark_photos():
        results[name] = bench_photo(data, args.repeats)
        row = results[name]
        if "read" in row:
            print(
                f"{name:48s} {row['width']}x{row['height']} read {row['read']['cpu_ms_median']:7.1f} ms  "
                f"full {row['full_libjpeg']['cpu_ms_median']:7.1f} ms ({row['read_share_of_full_decode']:.2f})  "
                f"pillow {row['pillow']['cpu_ms_median']:7.1f} ms  kernels {row['kernels']['cpu_ms_median']:7.1f} ms "
                f"CPU / {row['kernels']['wall_ms_median']:7.1f} ms wall  {row['outcome']}"
            )
        else:
            print(f"{name:48s} {row['outcome']}")
    taken = [r for r in results.values() if "read" in r]
    summary = {
        "photos": len(results), "taken": len(taken),
        "equal": sum(r["outcome"] == "equal" for r in taken),
        "median_read_share_of_full_decode": statistics.median(r["read_share_of_full_decode"] for r in taken),
        "median_cpu_ms_saved_per_mpixel": statistics.median(
            (r["full_libjpeg"]["cpu_ms_median"] - r["read"]["cpu_ms_median"]) / (r["width"] * r["height"] / 1e6)
            for r in taken
        ),
        "median_kernel_cpu_ms_per_mpixel": statistics.median(
            r["kernels"]["cpu_ms_median"] / (r["width"] * r["height"] / 1e6) for r in taken
        ),
    }
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": args.threads, "repeats": args.repeats, "libjpeg": jpeg_bands.libjpeg_path()}
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "photos": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
