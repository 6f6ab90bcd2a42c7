"""``KimiVisionProcessor`` against the plain reference processor, on PIL inputs and on bytes.

    .venv/bin/python benchmarks/bench_processor.py [--preset kimi-k2.5] [--repeats 5] [--out-dir bench_results]

An engine hands the checkpoint processor either PIL images it opened (``Image.open``: decoded
inside the processor call) or encoded bytes. Each photo of ``photos.benchmark_photos``
is timed four ways in interleaved rounds, each call from a fresh ``Image.open`` / the same bytes:
the reference (``tests/reference.py``: Pillow convert + BICUBIC resize, numpy normalise and
patchify) and ``KimiVisionProcessor.preprocess`` on a PIL image (a JPEG opened but not loaded
takes the library's decoders from its file's bytes, another image Pillow's decode; then the
library's resize and fused normalise/patchify) and on bytes. Every output is
checked bit-equal to the reference before timing. Prints per-photo medians and the ratios of the
totals (min and median over rounds); writes ``bench_processor.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from photos import benchmark_photos, plain_reference
from PIL import Image
from plots import saved_axes

from kimi_vision_prep import KimiVisionProcessor

WAYS = ("reference_pil", "ours_pil", "reference_bytes", "ours_bytes")


def calls(processor: KimiVisionProcessor, data: bytes, preset: str, reference: Any) -> dict[str, Callable[[], Any]]:
    """The four timed calls of one photo, each returning float32 ``pixel_values``."""

    def reference_pil() -> np.ndarray:
        image = Image.open(io.BytesIO(data))  # what an engine hands over: opened, not yet decoded
        size = reference.ref_size(image.width, image.height, reference.PRESETS[preset])
        to_rgb = reference.k25_rgb if reference.PRESETS[preset]["transparency"] == "convert_rgb" else reference.k3_rgb
        return reference.normalize_patchify(to_rgb(image, size), size, reference.PRESETS[preset])

    return {
        "reference_pil": reference_pil,
        "ours_pil": lambda: processor.preprocess({"type": "image", "image": Image.open(io.BytesIO(data))})[
            "pixel_values"
        ],
        "reference_bytes": lambda: reference.reference_preprocess(data, preset).pixel_values,
        "ours_bytes": lambda: processor.preprocess({"type": "image", "image": data})["pixel_values"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="kimi-k2.5")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    reference, processor = plain_reference(), KimiVisionProcessor(preset=args.preset)
    photos = benchmark_photos()
    per_photo = {name: calls(processor, data, args.preset, reference) for name, data in photos}
    for name, photo_calls in per_photo.items():  # exact first (and warm: numba compiles, caches fill)
        expected = photo_calls["reference_bytes"]()
        for way, call in photo_calls.items():
            if not np.array_equal(np.asarray(call()), expected):
                raise AssertionError(f"{name}: {way} differs from the reference")
    samples: dict[str, dict[str, list[float]]] = {name: {way: [] for way in WAYS} for name in per_photo}
    totals: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        round_total = dict.fromkeys(WAYS, 0.0)
        for name, photo_calls in per_photo.items():
            for way in WAYS:
                start = time.perf_counter()
                photo_calls[way]()
                elapsed = (time.perf_counter() - start) * 1e3
                samples[name][way].append(elapsed)
                round_total[way] += elapsed
        for way in WAYS:
            totals[way].append(round_total[way])
    print(f"{'photo':44s} " + " ".join(f"{way:>16s}" for way in WAYS) + "   (median ms)")
    for name, by_way in samples.items():
        print(f"{name[:44]:44s} " + " ".join(f"{statistics.median(by_way[way]):16.1f}" for way in WAYS))
    summary = {
        source: {
            "reference_over_ours_min": min(totals[f"reference_{source}"]) / min(totals[f"ours_{source}"]),
            "reference_over_ours_median": statistics.median(totals[f"reference_{source}"])
            / statistics.median(totals[f"ours_{source}"]),
            "ours_total_ms_median": statistics.median(totals[f"ours_{source}"]),
            "reference_total_ms_median": statistics.median(totals[f"reference_{source}"]),
        }
        for source in ("pil", "bytes")
    }
    for source, row in summary.items():
        print(
            f"{source:5s}: reference/ours {row['reference_over_ours_median']:.2f}x median, "
            f"{row['reference_over_ours_min']:.2f}x min ({row['reference_total_ms_median']:.0f} vs "
            f"{row['ours_total_ms_median']:.0f} ms for {len(photos)} photos)"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"preset": args.preset, "repeats": args.repeats, "photos": len(photos), "summary": summary}
    result["per_photo_median_ms"] = {n: {w: statistics.median(s[w]) for w in WAYS} for n, s in samples.items()}
    (args.out_dir / "bench_processor.json").write_text(json.dumps(result, indent=2))
    with saved_axes(args.out_dir / "bench_processor.png", (7, 4)) as ax:
        sources = list(summary)
        x = np.arange(len(sources))
        ax.bar(x - 0.2, [summary[s]["reference_total_ms_median"] for s in sources], 0.4, label="reference")
        ax.bar(x + 0.2, [summary[s]["ours_total_ms_median"] for s in sources], 0.4, label="KimiVisionProcessor")
        ax.set_xticks(x, [f"{s} inputs" for s in sources])
        ax.set_ylabel(f"ms for {len(photos)} photos (median of {args.repeats})")
        ax.set_title(f"preprocess(medias), {args.preset}")
        ax.legend()
    return 0


if __name__ == "__main__":
    sys.exit(main())
