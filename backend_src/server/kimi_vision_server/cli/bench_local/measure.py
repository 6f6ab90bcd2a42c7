"""bench-local's measurement: every image timed side by side, the batch throughput, the profile of the
images nearest 1080p, 9 MP and 12 MP; the JSON and the plot written (report.py)."""

from __future__ import annotations

import functools
import io
import json
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numba
import numpy as np
from PIL import Image

from kimi_vision_common.patches import normalize_table
from kimi_vision_prep import ImageDecoder, get_preset, navit_target_size, preprocess_batch, preprocess_bytes
from kimi_vision_prep.buffers import scratch_scope
from kimi_vision_prep.patchify.normalize import write_patches
from kimi_vision_prep.pipeline import resize_to_target

from .contenders import BenchImage, Reference, bench_images, dali_runner, fastest_exact_decode, pillow_rgb
from .report import format_row, jsonable, plot, print_profile, print_summary, summarise
from .timing import call_rate, rate_ratios, throughput, time_calls


def batch_throughput(images: list[BenchImage], preset_name: str, rounds: int) -> dict[str, Any]:
    """Images/s of one ``preprocess_batch`` over the set (best of rounds): ``single_thread`` (1
    worker, 1 numba thread, 1 decoder thread) and ``default`` (the library's defaults). The two
    alternate within each round (after one warm-up round of each), so a slow spell of a noisy
    host falls on both rather than on one's whole series. ``default_over_single_thread`` is the
    median of the rounds' ratios (``round_ratios``), as the served/in-process pairs are: the two
    best rounds came from different rounds, so their ratio measured the host's luck too.

    Each round also times the host's own ceiling: the floor decoder (:func:`fastest_exact_decode`,
    no shared state) over the set on one thread and on numba's thread count
    (``ceiling_round_ratios``, median ``ceiling_over_single_thread``). On a VM whose single-thread
    speed wanders it is the figure the batch ratio reads against."""
    items = [im.data for im in images]
    threads = numba.get_num_threads()
    single_thread = ImageDecoder(codec_threads=1, cpu_decode_threads=1)
    runs = {"single_thread": (single_thread, 1, 1), "default": (ImageDecoder(), None, threads)}
    rates: dict[str, list[float]] = {name: [] for name in (*runs, "ceiling_1", "ceiling_n")}
    try:
        with ThreadPoolExecutor(threads) as decode_pool:
            for round_index in range(rounds + 1):
                timed = {}
                for name, (decoder, workers, numba_threads) in runs.items():
                    numba.set_num_threads(numba_threads)
                    batch = functools.partial(preprocess_batch, items, preset_name, decoder=decoder, workers=workers)
                    timed[name] = call_rate(len(items), batch)
                timed["ceiling_1"] = call_rate(len(images), lambda: [fastest_exact_decode(im) for im in images])
                timed["ceiling_n"] = call_rate(len(images), lambda: list(decode_pool.map(fastest_exact_decode, images)))
                if round_index:
                    for name, rate in timed.items():
                        rates[name].append(rate)
    finally:
        numba.set_num_threads(threads)
    result: dict[str, Any] = {f"{name}_img_s": max(rates[name]) for name in runs}
    result["round_ratios"] = rate_ratios(rates["default"], rates["single_thread"])
    result["default_over_single_thread"] = statistics.median(result["round_ratios"])
    result["best_over_best"] = result["default_img_s"] / result["single_thread_img_s"]
    result["ceiling_round_ratios"] = rate_ratios(rates["ceiling_n"], rates["ceiling_1"])
    result["ceiling_over_single_thread"] = statistics.median(result["ceiling_round_ratios"])
    return result


PROFILE_PIXELS = {"1080p": 1920 * 1080, "9 MP": 9_000_000, "12 MP": 12_000_000}
# Rounds of the batch comparison: single rounds on the 2-core VM swung 1.07-2.2x (BENCHMARKS.md's history).
BATCH_ROUNDS = 5


def profile(images: list[BenchImage], preset_name: str, repeats: int) -> list[dict[str, Any]]:
    """For the images nearest each :data:`PROFILE_PIXELS` size: the full call and its stages
    (decode, resize, patchify into a warm buffer), median ms; ``rest`` = full - stages (the
    allocation and first touch of the output, bookkeeping)."""
    preset, decoder = get_preset(preset_name), ImageDecoder()
    table = normalize_table(preset.image_mean, preset.image_std)
    rows = []
    for label, pixels in PROFILE_PIXELS.items():
        im = min(images, key=lambda im: abs(im.width * im.height - pixels))
        decoded = decoder.decode(im.data, preset)
        target = navit_target_size(im.width, im.height, preset)
        rgb = np.array(resize_to_target(decoded, target, preset))
        out = np.empty((target.num_patches, 3, preset.patch_size, preset.patch_size), np.float32)

        def decode(im: BenchImage = im) -> None:
            with scratch_scope():
                decoder.decode(im.data, preset)

        def resize(decoded: Any = decoded, target: Any = target) -> None:
            with scratch_scope():
                resize_to_target(decoded, target, preset)

        def patchify(rgb: np.ndarray = rgb, target: Any = target, out: np.ndarray = out) -> None:
            write_patches(rgb, table, target.grid_h, target.grid_w, preset.patch_size, out=out)

        full = lambda im=im: preprocess_bytes(im.data, preset_name, decoder=decoder)  # noqa: E731
        stages = time_calls({"full": full, "decode": decode, "resize": resize, "patchify": patchify}, repeats)
        row = {"size": label, "image": im.name, "width": im.width, "height": im.height, "path": decoded.decode_path}
        row |= {f"{k}_ms": v.median_ms for k, v in stages.items()}
        row["rest_ms"] = row["full_ms"] - row["decode_ms"] - row["resize_ms"] - row["patchify_ms"]
        rows.append(row)
    return rows


# Over 60 lines: the run's steps in order (images, timings, throughput, profile, report), each a call.
def run(  # noqa: PLR0917
    preset_name: str = "kimi-k2.5",
    repeats: int = 5,
    out_dir: Path = Path("bench_results"),
    allocator: str = "glibc default",
    sources: Sequence[tuple[str, bytes]] | None = None,
    reference: Reference | None = None,
) -> dict[str, Any]:
    """Time every image several ways (ours, ``reference`` when given, decode floor, our decode,
    Pillow's decode, DALI; interleaved) and write JSON + PNG.
    ``sources`` as for :func:`bench_images`; ``allocator`` only labels the results (the caller
    configured the process)."""
    dali = dali_runner(preset_name)
    decoder = ImageDecoder(pool_size=1)
    preset = get_preset(preset_name)
    images = bench_images(preset_name, sources)
    rows = []

    def our_decode(im: BenchImage) -> None:
        with scratch_scope():
            decoder.decode(im.data, preset)

    for im in images:
        target = navit_target_size(im.width, im.height, preset)
        row: dict[str, Any] = {"image": asdict(im) | {"data": len(im.data)}}
        calls: dict[str, Callable[[], Any]] = {
            "ours": lambda im=im: preprocess_bytes(im.data, preset_name, decoder=decoder),
            "floor": lambda im=im: fastest_exact_decode(im),
            "decode": lambda im=im: our_decode(im),
            "pillow_decode": lambda im=im: pillow_rgb(im.data),
        }
        if reference is not None:
            calls["reference"] = lambda im=im, reference=reference: reference(im.data, preset_name)
        size_hw = (target.new_height, target.new_width)
        if dali is not None:
            calls["dali"] = lambda im=im, s=size_hw: dali(im.data, s)
        row |= time_calls(calls, repeats)
        if dali is not None:
            expected = np.asarray(
                Image.open(io.BytesIO(im.data))
                .convert("RGB")
                .resize((target.new_width, target.new_height), Image.Resampling.BICUBIC)
            )
            row["dali_max_abs_error"] = int(np.abs(dali(im.data, size_hw).astype(int) - expected).max())
        rows.append(row)
        print(format_row(row), flush=True)
    summary = summarise(rows)
    summary["throughput_2_threads_img_s"] = throughput(images, preset_name, 2, 3)
    summary["batch"] = batch_throughput(images, preset_name, BATCH_ROUNDS)
    profiles = profile(images, preset_name, repeats)
    result = {
        "preset": preset_name,
        "repeats": repeats,
        "allocator": allocator,
        "rows": jsonable(rows),
        "summary": summary,
        "profile": profiles,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_local.json").write_text(json.dumps(result, indent=2))
    plot(rows, out_dir / "bench_local.png", preset_name)
    print_summary(summary)
    print_profile(profiles)
    return result
