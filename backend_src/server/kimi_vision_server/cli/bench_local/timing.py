"""bench-local's clocks: min/median of repeated calls, a call rate, batch throughput in rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kimi_vision_prep import ImageDecoder, preprocess_bytes
from kimi_vision_prep.pipeline import PixelOutput

from .contenders import BenchImage


@dataclass
class Timing:
    min_ms: float
    median_ms: float


def time_calls(calls: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, Timing]:
    """Each call once to warm up, then ``repeats`` rounds of every call in turn (interleaved, so a
    load that comes and goes on the host hits them alike); min and median wall time in ms."""
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: Timing(min(s), statistics.median(s)) for name, s in samples.items()}


def throughput(
    images: list[BenchImage], preset_name: str, threads: int, rounds: int, output: PixelOutput = "pixel_values"
) -> float:
    """Images/s of ``preprocess_bytes`` producing ``output`` over the image set on ``threads``
    threads (one warm-up round, then the best of ``rounds``)."""
    return max(rate for rate, _ in timed_rounds(images, preset_name, threads, rounds, output))


def timed_rounds(
    images: list[BenchImage], preset_name: str, threads: int, rounds: int, output: PixelOutput = "pixel_values"
) -> list[tuple[float, float]]:
    """(images/s, CPU ms per image) of each of ``rounds`` rounds of ``preprocess_bytes`` producing
    ``output`` over the image set on ``threads`` threads, after one warm-up round. The CPU time is
    this process's (every thread, numba's and the decoders' included)."""
    decoder = ImageDecoder(pool_size=threads)
    work = lambda im: preprocess_bytes(im.data, preset_name, decoder=decoder, output=output)  # noqa: E731
    measured = []
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, images))
        for _ in range(rounds):
            start, cpu_start = time.perf_counter(), time.process_time()
            list(pool.map(work, images))
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            measured.append((len(images) / wall, 1e3 * cpu / len(images)))
    return measured


def call_rate(count: int, fn: Callable[[], Any]) -> float:
    """``count`` items / the seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return count / (time.perf_counter() - start)


def rate_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    return [n / d for n, d in zip(numerators, denominators, strict=True)]
