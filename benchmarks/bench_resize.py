"""Resize speed: the numba kernels (and the torch path on CPU) against Pillow's own BICUBIC.

Sizes are the K2.5 NaViT targets of typical photos (4000x3000 -> 2073x1554, 2048x2048 ->
1795x1795). Implementations are interleaved within each repeat so that load from other processes
affects them alike; min and median are reported, and every result is checked equal to Pillow.

    .venv/bin/python benchmarks/bench_resize.py [--repeats 9] [--threads N] [--torch] [--out bench_results/resize.json]

``--threads 1`` compares one core with Pillow (itself single-threaded), which is also the figure
least disturbed by other load on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
from PIL import Image

from kimi_vision_prep import PRESETS, navit_target_size
from kimi_vision_prep.numba_runtime import set_num_threads
from kimi_vision_prep.resize.resize import resize
from kimi_vision_server.cli.bench_local import time_calls

SOURCES = [(4000, 3000), (2048, 2048)]


def pillow_resize(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """Pillow's own BICUBIC resize of uint8 ``(H, W, 3|4)`` (the reference)."""
    mode = {3: "RGB", 4: "RGBA"}[pixels.shape[2]]
    return np.asarray(Image.fromarray(pixels, mode).resize((width, height), Image.Resampling.BICUBIC))


def torch_antialias(tensor: object, width: int, height: int) -> object:
    """``interpolate(bicubic, antialias=True)`` rounded: the common torch route (not exact, spec 6)."""
    import torch

    planar = tensor.permute(2, 0, 1)[None].to(torch.float32)
    resized = torch.nn.functional.interpolate(planar, size=(height, width), mode="bicubic", antialias=True)
    return torch.clamp(torch.round(resized[0]), 0, 255).permute(1, 2, 0).to(torch.uint8)


def bench_case(width: int, height: int, channels: int, repeats: int, with_torch: bool) -> dict:
    target = navit_target_size(width, height, PRESETS["kimi-k2.5"])
    size = (target.new_width, target.new_height)
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, channels), dtype=np.uint8)
    calls: dict[str, Callable[[], object]] = {
        "pillow": lambda: pillow_resize(pixels, *size),
        "numba": lambda: resize(pixels, *size, "bicubic"),
    }
    if with_torch:
        import torch

        tensor = torch.from_numpy(pixels)
        calls["torch_exact_cpu"] = lambda: resize(tensor, *size, "bicubic")
        calls["torch_antialias_cpu"] = lambda: torch_antialias(tensor, *size)
    expected = pillow_resize(pixels, *size)
    exact = bool(np.array_equal(resize(pixels, *size, "bicubic"), expected))
    stats = {name: {"min_ms": t.min_ms, "median_ms": t.median_ms} for name, t in time_calls(calls, repeats).items()}
    return {
        "source": f"{width}x{height}",
        "target": f"{size[0]}x{size[1]}",
        "channels": channels,
        "numba_equals_pillow": exact,
        "ms": stats,
        "speedup_vs_pillow": {
            name: {
                "min": stats["pillow"]["min_ms"] / s["min_ms"],
                "median": stats["pillow"]["median_ms"] / s["median_ms"],
            }
            for name, s in stats.items()
            if name != "pillow"
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, help="numba threads (default: all)")
    parser.add_argument("--torch", action="store_true", help="also time the torch path on CPU tensors")
    parser.add_argument("--out", type=Path, default=Path("bench_results/resize.json"))
    args = parser.parse_args()
    if args.threads:
        set_num_threads(args.threads)

    results = []
    for width, height in SOURCES:
        for channels in (3, 4):
            case = bench_case(width, height, channels, args.repeats, args.torch)
            results.append(case)
            line = ", ".join(
                f"{name} {s['min_ms']:.1f}/{s['median_ms']:.1f} ms" for name, s in case["ms"].items()
            )
            ratios = ", ".join(f"{name} x{r['min']:.2f}" for name, r in case["speedup_vs_pillow"].items())
            print(f"{case['source']} -> {case['target']} C={channels}: {line} (min/median); vs Pillow {ratios};"
                  f" exact={case['numba_equals_pillow']}")
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "numba_threads": numba.get_num_threads(),
            "load_average_1m": os.getloadavg()[0],
            "python": platform.python_version(),
        },
        "repeats": args.repeats,
        "cases": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
