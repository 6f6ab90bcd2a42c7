"""Engine threads calling the library at once, one image a call, against ``preprocess_batch``.

    .venv/bin/python benchmarks/bench_threads.py [--threads 1 2 4] [--rounds 5] [--out-dir bench_results]

vLLM's multimodal executor calls the processor from several threads, one image a call. Each
round times, on the photos of ``photos.benchmark_photos`` (K2.5, float32 ``pixel_values``):
``preprocess_batch`` over all of them (the library's batch path, its defaults: every core) and,
for each thread count N, N threads taking the photos one ``preprocess_bytes`` call each (the
default decoder, shared, as an engine's processor shares it). The calls alternate within a
round, so a slow spell of a shared host falls on all of them; each N's figure is the median over
rounds of its images/s over the batch path's in the same round (min and max beside it). Every
output is checked equal to the batch path's first. Writes ``bench_threads.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from photos import benchmark_photos
from plots import saved_axes

from kimi_vision_prep import preprocess_batch, preprocess_bytes

PRESET = "kimi-k2.5"


def rate(count: int, run: Callable[[], Any]) -> float:
    """``count`` images / the seconds ``run()`` took."""
    start = time.perf_counter()
    run()
    return count / (time.perf_counter() - start)


def engine_threads(pool: ThreadPoolExecutor, photos: list[bytes]) -> list[Any]:
    return list(pool.map(lambda data: preprocess_bytes(data, PRESET), photos))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    photos = [data for _, data in benchmark_photos()]
    pools = {n: ThreadPoolExecutor(n, thread_name_prefix=f"engine-{n}") for n in args.threads}
    expected = [r.pixel_values for r in preprocess_batch(photos, PRESET)]
    for n, pool in pools.items():  # warm-up, and the outputs checked
        got = engine_threads(pool, photos)
        assert all(np.array_equal(r.pixel_values, e) for r, e in zip(got, expected, strict=True)), n
    batch_rates: list[float] = []
    ratios: dict[int, list[float]] = {n: [] for n in pools}
    rates: dict[int, list[float]] = {n: [] for n in pools}
    for _ in range(args.rounds):
        batch = rate(len(photos), lambda: preprocess_batch(photos, PRESET))
        batch_rates.append(batch)
        for n, pool in pools.items():
            threads_rate = rate(len(photos), lambda pool=pool: engine_threads(pool, photos))
            rates[n].append(threads_rate)
            ratios[n].append(threads_rate / batch)
    rows = [
        {
            "threads": n,
            "img_s_median": statistics.median(rates[n]),
            "over_batch_median": statistics.median(ratios[n]),
            "over_batch_min": min(ratios[n]),
            "over_batch_max": max(ratios[n]),
            "round_ratios": ratios[n],
        }
        for n in pools
    ]
    batch_median = statistics.median(batch_rates)
    result = {"preset": PRESET, "photos": len(photos), "batch_img_s_median": batch_median, "rows": rows}
    print(f"preprocess_batch: {result['batch_img_s_median']:.1f} img/s (median of {args.rounds} rounds)")
    print("| engine threads | img/s | over preprocess_batch: median (min-max) |\n|---:|---:|---|")
    for row in rows:
        print(
            f"| {row['threads']} | {row['img_s_median']:.1f} | **{row['over_batch_median']:.2f}x** "
            f"({row['over_batch_min']:.2f}-{row['over_batch_max']:.2f}) |"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_threads.json").write_text(json.dumps(result, indent=2))
    with saved_axes(args.out_dir / "bench_threads.png", (6, 4)) as ax:
        ax.bar([str(row["threads"]) for row in rows], [row["over_batch_median"] for row in rows])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("engine threads, one image a call")
        ax.set_ylabel("images/s over preprocess_batch (median)")
        ax.set_title(f"{len(photos)} photos, {PRESET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
