"""transformers' native ``Kimi_K25ImageProcessor`` against ``KimiVisionProcessor``, in one process.

    make peer-venv && .venv-peer/bin/python benchmarks/bench_transformers_peer.py [--rounds 5] [--out-dir bench_results]

The peer is what a transformers 5.x user gets from ``AutoImageProcessor`` for this checkpoint: its
torchvision backend with its own defaults (its recommended settings). It needs an importable
torchvision next to the torch build it was made for: ``make peer-venv`` installs torch 2.14.1 and
torchvision 0.29.1 (PyPI's CUDA builds, which run on a CPU), transformers and this library into
``.venv-peer``, away from the project's CPU torch (next to which torchvision's C ops do not load
and ``import torchvision`` fails).

On the photos of ``photos.benchmark_photos``: each output's distance from the reference
(``tests/reference.py``: bit-equal count, mean and max |diff|; ours must be bit-equal), then
interleaved rounds of four calls per photo, one image a call as engines make them: the peer and
ours given encoded bytes (the peer gets ``Image.open`` of them, as it takes no bytes) and given a
PIL image opened but not decoded. Ratios are of the round totals (peer over ours), median and
min over rounds. Writes ``bench_transformers_peer.json`` and ``.png``.
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

WAYS = ("peer_bytes", "ours_bytes", "peer_pil", "ours_pil")


def peer_processor() -> Any:
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    return Kimi_K25ImageProcessor()


def calls(peer: Any, ours: KimiVisionProcessor, data: bytes) -> dict[str, Callable[[], np.ndarray]]:
    """The four timed calls of one photo, each returning float32 ``pixel_values`` as numpy."""

    def peer_call(image: Image.Image) -> np.ndarray:
        return np.asarray(peer(images=[image], return_tensors="pt")["pixel_values"].numpy())

    def ours_call(source: Any) -> np.ndarray:
        return ours(images=[source], return_tensors="np")["pixel_values"]

    return {
        "peer_bytes": lambda: peer_call(Image.open(io.BytesIO(data))),
        "ours_bytes": lambda: ours_call(data),
        "peer_pil": lambda: peer_call(Image.open(io.BytesIO(data))),
        "ours_pil": lambda: ours_call(Image.open(io.BytesIO(data))),
    }


def distances(peer: Any, ours: KimiVisionProcessor, photos: list[tuple[str, bytes]]) -> dict[str, Any]:
    """Each output against the reference's: the peer's distance, ours checked bit-equal."""
    reference = plain_reference()
    equal, means, maxima, same_grid = 0, [], [], 0
    for name, data in photos:
        expected = reference.reference_preprocess(data, "kimi-k2.5").pixel_values
        assert np.array_equal(calls(peer, ours, data)["ours_bytes"](), expected), name
        got = calls(peer, ours, data)["peer_bytes"]()
        if got.shape != expected.shape:
            continue
        same_grid += 1
        diff = np.abs(got.astype(np.float64) - expected)
        equal += bool(diff.max() == 0)
        means.append(float(diff.mean()))
        maxima.append(float(diff.max()))
    return {
        "photos": len(photos),
        "peer_same_grid": same_grid,
        "peer_bit_equal": equal,
        "peer_mean_abs_diff": statistics.mean(means) if means else None,
        "peer_max_abs_diff": max(maxima) if maxima else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    photos = benchmark_photos()
    peer, ours = peer_processor(), KimiVisionProcessor()
    result: dict[str, Any] = {"distance": distances(peer, ours, photos)}
    totals: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        spent = dict.fromkeys(WAYS, 0.0)
        for _, data in photos:
            for way, call in calls(peer, ours, data).items():
                start = time.perf_counter()
                call()
                spent[way] += time.perf_counter() - start
        for way in WAYS:
            totals[way].append(spent[way])
    for source in ("bytes", "pil"):
        ratios = [p / o for p, o in zip(totals[f"peer_{source}"], totals[f"ours_{source}"], strict=True)]
        result[source] = {
            "peer_s_median": statistics.median(totals[f"peer_{source}"]),
            "ours_s_median": statistics.median(totals[f"ours_{source}"]),
            "peer_over_ours_median": statistics.median(ratios),
            "peer_over_ours_min": min(ratios),
            "round_ratios": ratios,
        }
    d = result["distance"]
    print(
        f"peer vs the reference on {d['photos']} photos: {d['peer_bit_equal']} bit-equal, same grid "
        f"{d['peer_same_grid']}, mean |diff| {d['peer_mean_abs_diff']:.2e}, max {d['peer_max_abs_diff']:.4f}; "
        "ours bit-equal on every photo"
    )
    print("| input | peer s (median) | ours s (median) | peer / ours: median (min) |\n|---|---:|---:|---|")
    for source in ("bytes", "pil"):
        r = result[source]
        print(
            f"| {source} | {r['peer_s_median']:.2f} | {r['ours_s_median']:.2f} | "
            f"**{r['peer_over_ours_median']:.2f}x** ({r['peer_over_ours_min']:.2f}x) |"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_transformers_peer.json").write_text(json.dumps(result, indent=2))
    with saved_axes(args.out_dir / "bench_transformers_peer.png", (6, 4)) as ax:
        labels = ["bytes", "PIL"]
        x = np.arange(2)
        ax.bar(x - 0.2, [result[s]["peer_s_median"] for s in ("bytes", "pil")], 0.4, label="transformers' peer")
        ax.bar(x + 0.2, [result[s]["ours_s_median"] for s in ("bytes", "pil")], 0.4, label="KimiVisionProcessor")
        ax.set_xticks(x, labels)
        ax.set_ylabel(f"seconds for {len(photos)} photos (median round)")
        ax.legend()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
