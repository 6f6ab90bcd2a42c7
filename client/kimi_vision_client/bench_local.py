"""``kimi-prep bench-local``: in-process, side-by-side timings in one run.

For each image: ours (``preprocess_bytes``), the plain reference (``tests/reference.py``: Pillow
decode + Pillow bicubic + numpy normalize/pad/patchify), the decode floor (Pillow decode to an RGB
array) and, when installed, DALI's CPU pipeline (decode, antialiased cubic resize to the same size,
normalize). Every number is min/median of ``repeats`` runs; ratios compare medians measured in the
same process. Images fall in two classes: ``no-resize`` (within the preset's patch budget) and
``downscale``; ``synthetic`` marks corpus photos upscaled 2x with Lanczos and re-encoded.
Writes ``bench_local.json`` and ``bench_local.png`` under ``out_dir``.
"""

from __future__ import annotations

import importlib.util
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_prep import ImageDecoder, get_preset, navit_target_size, preprocess_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]
CORPUS = REPO_ROOT.parent / "shared" / "corpus"

# Real photos of the corpus (MANIFEST category "photo"/"edge", Pillow accepts them), chosen to cover
# both classes for K2.5; upscaled copies of the first group make the synthetic downscale set.
REAL_PHOTOS = (
    "imagers__large_image.jpg",
    "imagers__extraneous-bytes-after-sos.jpg",
    "pil__xmp_test.jpg",
    "imagers__mjpeg.jpg",
    "imagers__progressive3.jpg",
    "sklearn__china.jpg",
    "pil__iptc.jpg",
)
UPSCALED_PHOTOS = ("pil__xmp_test.jpg", "imagers__large_image.jpg", "sklearn__flower.jpg", "imagers__mjpeg.jpg")


@dataclass
class BenchImage:
    name: str
    data: bytes
    width: int
    height: int
    image_class: str  # "no-resize" | "downscale"
    synthetic: bool


@dataclass
class Timing:
    min_ms: float
    median_ms: float


def time_call(fn: Callable[[], Any], repeats: int) -> Timing:
    """Run ``fn`` once to warm up, then ``repeats`` times; min and median wall time in ms."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return Timing(min(samples), statistics.median(samples))


def load_reference() -> ModuleType:
    """The plain reference from a source checkout (it deliberately lives with the tests)."""
    path = REPO_ROOT / "tests" / "reference.py"
    spec = importlib.util.spec_from_file_location("kimi_plain_reference", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"bench-local needs a source checkout: {path} not found")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def upscale_2x(data: bytes) -> bytes:
    """Re-encode a photo at twice its size (Lanczos, JPEG q=92, 4:2:0): a synthetic large photo."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    big = image.resize((image.width * 2, image.height * 2), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    big.save(out, "JPEG", quality=92, subsampling=2)
    return out.getvalue()


def bench_images(preset_name: str) -> list[BenchImage]:
    preset = get_preset(preset_name)
    images = []
    sources = [(name, (CORPUS / name).read_bytes(), False) for name in REAL_PHOTOS]
    sources += [(f"{name}@2x", upscale_2x((CORPUS / name).read_bytes()), True) for name in UPSCALED_PHOTOS]
    for name, data, synthetic in sources:
        width, height = Image.open(io.BytesIO(data)).size
        target = navit_target_size(width, height, preset)
        image_class = "downscale" if target.needs_resize else "no-resize"
        images.append(BenchImage(name, data, width, height, image_class, synthetic))
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


def throughput(images: list[BenchImage], preset_name: str, threads: int, rounds: int) -> float:
    """Images/s of ``preprocess_bytes`` over the image set on ``threads`` threads (best of rounds)."""
    decoder = ImageDecoder(pool_size=threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda im: preprocess_bytes(im.data, preset_name, decoder=decoder), images))
        for _ in range(rounds):
            start = time.perf_counter()
            list(pool.map(lambda im: preprocess_bytes(im.data, preset_name, decoder=decoder), images))
            best = max(best, len(images) / (time.perf_counter() - start))
    return best


def run(
    preset_name: str = "kimi-k2.5",
    repeats: int = 5,
    out_dir: Path = Path("bench_results"),
    allocator: str = "glibc default",
) -> dict[str, Any]:
    """Time every image four ways (ours, reference, decode floor, DALI) and write JSON + PNG.
    ``allocator`` only labels the results (the caller configured the process)."""
    reference = load_reference()
    dali = dali_runner(preset_name)
    decoder = ImageDecoder(pool_size=1)
    preset = get_preset(preset_name)
    rows = []
    for im in bench_images(preset_name):
        target = navit_target_size(im.width, im.height, preset)
        row: dict[str, Any] = {"image": asdict(im) | {"data": len(im.data)}}
        row["ours"] = time_call(lambda im=im: preprocess_bytes(im.data, preset_name, decoder=decoder), repeats)
        row["reference"] = time_call(lambda im=im: reference.reference_preprocess(im.data, preset_name), repeats)
        row["pillow_decode"] = time_call(
            lambda im=im: np.asarray(Image.open(io.BytesIO(im.data)).convert("RGB")), repeats
        )
        if dali is not None:
            size_hw = (target.new_height, target.new_width)
            row["dali"] = time_call(lambda im=im, s=size_hw: dali(im.data, s), repeats)
            expected = np.asarray(
                Image.open(io.BytesIO(im.data)).convert("RGB").resize(
                    (target.new_width, target.new_height), Image.Resampling.BICUBIC
                )
            )
            row["dali_max_abs_error"] = int(np.abs(dali(im.data, size_hw).astype(int) - expected).max())
        rows.append(row)
        print(_format_row(row), flush=True)
    summary = _summarise(rows)
    summary["throughput_2_threads_img_s"] = throughput(bench_images(preset_name), preset_name, 2, 3)
    result = {
        "preset": preset_name,
        "repeats": repeats,
        "allocator": allocator,
        "rows": _jsonable(rows),
        "summary": summary,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_local.json").write_text(json.dumps(result, indent=2))
    _plot(rows, out_dir / "bench_local.png", preset_name)
    _print_summary(summary)
    return result


def _jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: asdict(v) if isinstance(v, Timing) else v for k, v in row.items()} for row in rows]


def _format_row(row: dict[str, Any]) -> str:
    im = row["image"]
    parts = [f"{im['name'][:44]:44s} {im['width']}x{im['height']:<5d} {im['image_class']:9s}"]
    for key in ("ours", "reference", "pillow_decode", "dali"):
        if key in row:
            parts.append(f"{key}={row[key].median_ms:7.1f}ms")
    parts.append(f"ref/ours={row['reference'].median_ms / row['ours'].median_ms:5.2f}x")
    parts.append(f"ours/floor={row['ours'].median_ms / row['pillow_decode'].median_ms:4.2f}x")
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
            "reference_over_ours": _class_ratio(group, "reference", "ours"),
            "ours_over_pillow_decode": _class_ratio(group, "ours", "pillow_decode"),
        }
        if all("dali" in r for r in group):
            entry["dali_over_ours"] = _class_ratio(group, "dali", "ours")
            entry["dali_max_abs_error"] = max(r["dali_max_abs_error"] for r in group)
        summary[name] = entry
    return summary


def _print_summary(summary: dict[str, Any]) -> None:
    print("\nclass       images  reference/ours  ours/decode-floor  dali/ours  dali max err")
    for name in ("all", "no-resize", "downscale"):
        if name in summary:
            e = summary[name]
            dali = f"{e['dali_over_ours']:8.2f}x" if "dali_over_ours" in e else "       -"
            print(
                f"{name:10s}  {e['images']:6d}  {e['reference_over_ours']:13.2f}x"
                f"  {e['ours_over_pillow_decode']:16.2f}x  {dali}  {e.get('dali_max_abs_error', '-')}"
            )
    print(f"in-process throughput on 2 threads: {summary['throughput_2_threads_img_s']:.1f} img/s")


def _plot(rows: list[dict[str, Any]], path: Path, preset_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["image"]["name"][:28] for r in rows]
    keys = [k for k in ("ours", "pillow_decode", "reference", "dali") if all(k in r for r in rows)]
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
