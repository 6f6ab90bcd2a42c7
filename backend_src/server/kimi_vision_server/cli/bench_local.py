"""``kimi-prep bench-local``: in-process, side-by-side timings in one run.

For each image: ours (``preprocess_bytes`` exactly as a caller gets it), a reference processor when
the caller gives one (``benchmarks/bench_local_corpus.py`` gives ``tests/reference.py``), the floor
(:func:`fastest_exact_decode`: the fastest exact single-thread decoder alone), our decoder alone
(``decode``: the library's route for the file, a lone JPEG in row bands on every core, so
``ours/decode`` is what the pipeline adds to its own decode), the Pillow decode and, when
installed, DALI's CPU pipeline (decode, antialiased cubic resize to the same size, normalize). Then
batch throughput (``preprocess_batch`` over the set: single-thread = 1 worker, 1 numba and 1
decoder thread, against the defaults) and a profile (decode, resize, patchify, the rest: allocation
and page faults) of the images nearest 1080p, 9 MP and 12 MP. Every number is min/median of
``repeats`` runs; ratios compare medians measured in the same process. Images fall in two classes:
``no-resize`` (within the preset's patch budget) and ``downscale``. The default images are
generated (:func:`~.samples.bench_photos`), so the command needs no checkout; ``--images`` takes
real photos, and ``benchmarks/bench_local_corpus.py`` runs it on the test corpus against
``tests/reference.py``. Writes ``bench_local.json`` and ``bench_local.png`` under ``out_dir``.
"""

from __future__ import annotations

import functools
import io
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np
from PIL import Image

from kimi_vision_client.cli.samples import bench_photos
from kimi_vision_common.patches import normalize_table
from kimi_vision_prep import ImageDecoder, get_preset, navit_target_size, preprocess_batch, preprocess_bytes
from kimi_vision_prep.buffers import scratch_scope
from kimi_vision_prep.decode import jpeg_bands
from kimi_vision_prep.decode.jpeg_scan import scan_jpeg
from kimi_vision_prep.decode.routes import decode_simplejpeg
from kimi_vision_prep.patchify.normalize import write_patches
from kimi_vision_prep.pipeline import PixelOutput, resize_to_target

from ..allocator import keep_large_buffers

Reference = Callable[[bytes, str], Any]  # (encoded image, preset name) -> anything (timed only)


@dataclass
class BenchImage:
    name: str
    data: bytes
    width: int
    height: int
    image_class: str  # "no-resize" | "downscale"
    synthetic: bool
    floor: str  # the fastest exact single-thread decoder of the file: "simplejpeg" | "libjpeg" | "pillow"


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


def fastest_exact_decode(im: BenchImage) -> np.ndarray:
    """The floor: RGB pixels by the fastest single-thread decoder exact for the file (``im.floor``,
    :func:`floor_decoder`), nothing else: not the attempt of a decoder that refuses the file."""
    pixels = None
    if im.floor == "simplejpeg":
        pixels = decode_simplejpeg(im.data, im.width, im.height)
    elif im.floor == "libjpeg":
        pixels = libjpeg_on_one_thread(im.data, im.width, im.height)
    return pixels if pixels is not None else pillow_rgb(im.data)


def floor_decoder(data: bytes, width: int, height: int) -> str:
    """The fastest single-thread decoder exact for the file: simplejpeg
    (:func:`~kimi_vision_prep.decode.routes.decode_simplejpeg`) where its strict mode takes it, else
    the libjpeg route on one thread (:func:`libjpeg_on_one_thread`) where that takes it, else Pillow."""
    if decode_simplejpeg(data, width, height) is not None:
        return "simplejpeg"
    if libjpeg_on_one_thread(data, width, height) is not None:
        return "libjpeg"
    return "pillow"


def libjpeg_on_one_thread(data: bytes, width: int, height: int) -> np.ndarray | None:
    """uint8 ``(height, width, 3)`` by the libjpeg route in one band, tolerant where the scan finds
    damage libjpeg conceals (as the decoder plans it), or None where it refuses the file or is
    not built."""
    if jpeg_bands.libjpeg_path() is None:
        return None
    pixels = np.empty((height, width, 3), np.uint8)
    tolerant = scan_jpeg(data).conceals_damage
    return pixels if jpeg_bands.decode_rows(data, pixels, 0, height, tolerant) else None


def pillow_rgb(data: bytes) -> np.ndarray:
    """RGB pixels by Pillow alone, the fastest way: an image that is RGB already is read out as it
    is (``convert`` to its own mode would copy every pixel first)."""
    image = Image.open(io.BytesIO(data))
    return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))


def apply_allocator(keep: bool) -> str:
    """The malloc setting of this run, applied (``keep``: :func:`~kimi_vision_server.allocator.keep_large_buffers`,
    the retention setting; else glibc's defaults, as an inference engine's process has them), as
    the label the results carry."""
    if keep and keep_large_buffers():
        return "large buffers kept on the heap (kimi_vision_server.allocator)"
    return "glibc default"


def bench_images(preset_name: str, sources: Sequence[tuple[str, bytes]] | None = None) -> list[BenchImage]:
    """``sources`` (name, encoded bytes; default: :func:`~.samples.bench_photos`) with their class
    under the preset; ``synthetic`` marks generated images."""
    preset = get_preset(preset_name)
    images = []
    named = [(name, data, False) for name, data in sources] if sources is not None else None
    for name, data, synthetic in named or [(n, d, True) for n, d in bench_photos().items()]:
        width, height = Image.open(io.BytesIO(data)).size
        target = navit_target_size(width, height, preset)
        image_class = "downscale" if target.needs_resize else "no-resize"
        floor = floor_decoder(data, width, height)
        images.append(BenchImage(name, data, width, height, image_class, synthetic, floor))
    return images


def dali_runner(preset_name: str) -> Callable[[bytes, tuple[int, int]], np.ndarray] | None:
    """DALI CPU pipeline (decode, cubic antialiased resize, normalize, CHW) or None if not installed."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        return None
    preset = get_preset(preset_name)
    mean = [255.0 * m for m in preset.image_mean]
    std = [255.0 * s for s in preset.image_std]

    @pipeline_def(batch_size=1, num_threads=2, device_id=None, prefetch_queue_depth=1, exec_dynamic=True)
    def pipeline():  # DALI graph definition
        data = fn.external_source(name="data", dtype=types.UINT8, ndim=1)
        size = fn.external_source(name="size", dtype=types.FLOAT, ndim=1)
        image = fn.decoders.image(data, device="cpu", output_type=types.RGB)
        image = fn.resize(image, size=size, interp_type=types.INTERP_CUBIC, antialias=True)
        return fn.crop_mirror_normalize(image, mean=mean, std=std, output_layout="CHW", dtype=types.FLOAT), image

    pipe = pipeline()
    pipe.build()

    def run(data: bytes, size_hw: tuple[int, int]) -> np.ndarray:
        pipe.feed_input("data", [np.frombuffer(data, np.uint8)])
        pipe.feed_input("size", [np.asarray(size_hw, np.float32)])
        _, resized = pipe.run()
        return np.asarray(resized[0])

    return run


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
                    timed[name] = _rate(len(items), batch)
                timed["ceiling_1"] = _rate(len(images), lambda: [fastest_exact_decode(im) for im in images])
                timed["ceiling_n"] = _rate(len(images), lambda: list(decode_pool.map(fastest_exact_decode, images)))
                if round_index:
                    for name, rate in timed.items():
                        rates[name].append(rate)
    finally:
        numba.set_num_threads(threads)
    result: dict[str, Any] = {f"{name}_img_s": max(rates[name]) for name in runs}
    result["round_ratios"] = _ratios(rates["default"], rates["single_thread"])
    result["default_over_single_thread"] = statistics.median(result["round_ratios"])
    result["best_over_best"] = result["default_img_s"] / result["single_thread_img_s"]
    result["ceiling_round_ratios"] = _ratios(rates["ceiling_n"], rates["ceiling_1"])
    result["ceiling_over_single_thread"] = statistics.median(result["ceiling_round_ratios"])
    return result


def _rate(count: int, fn: Callable[[], Any]) -> float:
    """``count`` items / the seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return count / (time.perf_counter() - start)


def _ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    return [n / d for n, d in zip(numerators, denominators, strict=True)]


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
                Image.open(io.BytesIO(im.data)).convert("RGB").resize(
                    (target.new_width, target.new_height), Image.Resampling.BICUBIC
                )
            )
            row["dali_max_abs_error"] = int(np.abs(dali(im.data, size_hw).astype(int) - expected).max())
        rows.append(row)
        print(_format_row(row), flush=True)
    summary = _summarise(rows)
    summary["throughput_2_threads_img_s"] = throughput(images, preset_name, 2, 3)
    summary["batch"] = batch_throughput(images, preset_name, BATCH_ROUNDS)
    profiles = profile(images, preset_name, repeats)
    result = {
        "preset": preset_name,
        "repeats": repeats,
        "allocator": allocator,
        "rows": _jsonable(rows),
        "summary": summary,
        "profile": profiles,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_local.json").write_text(json.dumps(result, indent=2))
    _plot(rows, out_dir / "bench_local.png", preset_name)
    _print_summary(summary)
    _print_profile(profiles)
    return result


def _jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: asdict(v) if isinstance(v, Timing) else v for k, v in row.items()} for row in rows]


def _format_row(row: dict[str, Any]) -> str:
    im = row["image"]
    parts = [f"{im['name'][:44]:44s} {im['width']}x{im['height']:<5d} {im['image_class']:9s}"]
    for key in ("ours", "reference", "floor", "decode", "pillow_decode", "dali"):
        if key in row:
            parts.append(f"{key}={row[key].median_ms:7.1f}ms")
    if "reference" in row:
        parts.append(f"ref/ours={row['reference'].median_ms / row['ours'].median_ms:5.2f}x")
    parts.append(f"ours/floor={row['ours'].median_ms / row['floor'].median_ms:4.2f}x")
    return "  ".join(parts)


def _class_ratio(rows: list[dict[str, Any]], numerator: str, denominator: str) -> float:
    """Ratio of summed medians (a workload of these images, each once)."""
    return sum(r[numerator].median_ms for r in rows) / sum(r[denominator].median_ms for r in rows)


def _summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    groups = {"all": rows}
    for name in ("no-resize", "downscale"):
        groups[name] = [r for r in rows if r["image"]["image_class"] == name]
    for name, group in groups.items():
        if not group:
            continue
        entry = {
            "images": len(group),
            "ours_over_floor": _class_ratio(group, "ours", "floor"),
            "ours_over_decode": _class_ratio(group, "ours", "decode"),
            "decode_over_floor": _class_ratio(group, "decode", "floor"),
            "ours_over_pillow_decode": _class_ratio(group, "ours", "pillow_decode"),
        }
        if all("reference" in r for r in group):
            entry["reference_over_ours"] = _class_ratio(group, "reference", "ours")
        if all("dali" in r for r in group):
            entry["dali_over_ours"] = _class_ratio(group, "dali", "ours")
            entry["dali_max_abs_error"] = max(r["dali_max_abs_error"] for r in group)
        summary[name] = entry
    return summary


def _print_summary(summary: dict[str, Any]) -> None:
    print(
        "\nclass       images  reference/ours  ours/floor  ours/decode  decode/floor  ours/Pillow-decode  dali/ours"
        "  dali max err"
    )
    for name in ("all", "no-resize", "downscale"):
        if name in summary:
            e = summary[name]
            dali = f"{e['dali_over_ours']:8.2f}x" if "dali_over_ours" in e else "       -"
            reference = f"{e['reference_over_ours']:13.2f}x" if "reference_over_ours" in e else f"{'-':>14s}"
            print(
                f"{name:10s}  {e['images']:6d}  {reference}  {e['ours_over_floor']:9.2f}x"
                f"  {e['ours_over_decode']:10.2f}x  {e['decode_over_floor']:11.2f}x"
                f"  {e['ours_over_pillow_decode']:17.2f}x  {dali}  {e.get('dali_max_abs_error', '-')}"
            )
    print(f"in-process throughput on 2 threads: {summary['throughput_2_threads_img_s']:.1f} img/s")
    batch = summary["batch"]
    print(
        f"preprocess_batch: {batch['single_thread_img_s']:.1f} img/s single-thread, {batch['default_img_s']:.1f} img/s "
        f"default (median of the rounds {batch['default_over_single_thread']:.2f}x: "
        f"{', '.join(f'{r:.2f}x' for r in batch['round_ratios'])}; best over best {batch['best_over_best']:.2f}x)"
    )
    print(
        f"the host's ceiling, the floor decoder on {numba.get_num_threads()} threads over 1, same rounds: median "
        f"{batch['ceiling_over_single_thread']:.2f}x: {', '.join(f'{r:.2f}x' for r in batch['ceiling_round_ratios'])}"
    )


def _print_profile(profiles: list[dict[str, Any]]) -> None:
    print("\nsize    image                                    size       path        full  decode  resize  patchify")
    for r in profiles:
        print(
            f"{r['size']:6s}  {r['image'][:40]:40s} {r['width']}x{r['height']:<5d} {r['path']:10s} {r['full_ms']:6.1f} "
            f"{r['decode_ms']:6.1f}  {r['resize_ms']:6.1f}  {r['patchify_ms']:8.1f}  rest {r['rest_ms']:5.1f} ms"
        )


def _plot(rows: list[dict[str, Any]], path: Path, preset_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["image"]["name"][:28] for r in rows]
    keys = [k for k in ("ours", "floor", "decode", "pillow_decode", "reference", "dali") if all(k in r for r in rows)]
    x = np.arange(len(rows))
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 5))
    for i, key in enumerate(keys):
        ax.bar(x + i * width, [r[key].median_ms for r in rows], width, label=key)
    ax.set_xticks(x + width * (len(keys) - 1) / 2, names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("median ms per image")
    ax.set_title(f"bench-local ({preset_name}): lower is better")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
