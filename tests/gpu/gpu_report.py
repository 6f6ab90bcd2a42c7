"""Measure the CUDA decode path on a GPU machine and write one JSON report.

    python tests/gpu/gpu_report.py --out "$OUT/gpu_report.json"

Sections (each one is caught on its own, and the JSON is rewritten after each, so a failure or a
timeout keeps what was measured before it):

- ``environment``: versions, GPU, CPU count.
- ``exact_route``: the exact GPU route (a ``cuda`` decoder's default, :mod:`exact_report`): the
  kernels on the device vs on the CPU vs Pillow per corpus JPEG, images/s and CPU time per image
  against nvImageCodec and the CPU route, device memory per decoder. Second, so a timeout later
  keeps it.
- ``accuracy``: per accepted corpus JPEG, the library's decode path and its difference from Pillow,
  and the same for raw nvImageCodec decoders: the library's configuration with
  ``:fancy_upsampling=0`` (the default this project must avoid), GPU-only and hybrid backends
  alone, and the CPU backend (the exact control).
- ``dlpack``: the decoded tensor is the nvImageCodec device buffer (same pointer, no host copy) and
  stays valid after the nvImageCodec image is freed.
- ``patchify``: ``preprocess_decoded`` on the device equals the numpy/numba path on the same pixels,
  per accepted corpus file and preset.
- ``resize``: the exact torch resize on the device against Pillow and the numba path, with timings,
  and torch's antialiased bicubic (``gpu_common.torch_antialias``) for comparison, on a 12 MP photo.
- ``throughput``: images/s of Pillow, the library on CPU and on CUDA, and a raw CUDA decoder, on the
  corpus and on synthetic 1080p and 12 MP photos (min and median of repeats, same run).
- ``memory``: device memory of the process (CUDA context) and per decoder (``mem_get_info`` around
  creating and warming ``--decoders`` decoders), host RSS.

``--device cpu`` is a smoke run for machines without CUDA: the CUDA-only parts are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import exact_report
import numpy as np
import torch
from gpu_common import (
    CORPUS,
    LARGE_CLEAN_JPEG,
    CorpusFile,
    accepted_files,
    decoded_on_host,
    pillow_resize,
    pillow_rgb,
    pixel_diff,
    torch_antialias,
)
from PIL import Image

from kimi_vision_common.sizing import navit_target_size
from kimi_vision_prep import ImageDecoder, get_preset, preprocess_batch, preprocess_decoded
from kimi_vision_prep.decode.decoder import FANCY_UPSAMPLING_OPTIONS
from kimi_vision_prep.resize.resize import resize

PRESETS = ("kimi-k2.5", "kimi-k3")
SYNTHETIC_SETS = {"synthetic_1080p": (1920, 1080, 16), "synthetic_12mp": (4000, 3000, 8)}
MIB = 1 << 20


@dataclass
class Context:
    device: str  # "cuda:N" or "cpu"
    corpus: Path
    files: list[CorpusFile]
    repeats: int
    n_decoders: int
    codec: Any  # nvidia.nvimgcodec

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def read(self, item: CorpusFile) -> bytes:
        return (self.corpus / item.name).read_bytes()


# -- helpers ----------------------------------------------------------------------------------


def synchronize(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def to_host(pixels: Any) -> np.ndarray:
    return pixels.cpu().numpy() if isinstance(pixels, torch.Tensor) else np.asarray(pixels)


def raw_decoder(codec: Any, device: str, backend_kinds: list[str], options: str) -> Any:
    """An nvImageCodec decoder built like the library's, with the backends and options given."""
    device_id = int(device.partition(":")[2]) if device.startswith("cuda") else codec.NVIMGCODEC_DEVICE_CPU_ONLY
    backends = [codec.Backend(getattr(codec.BackendKind, kind)) for kind in backend_kinds]
    return codec.Decoder(device_id=device_id, backends=backends, options=options)


def raw_decode(codec: Any, device: str, decoder: Any, items: list[bytes]) -> list[Any]:
    """Decode on the current stream; each image a CUDA tensor (DLPack) or a numpy array, or None."""
    params = codec.DecodeParams(apply_exif_orientation=False, color_spec=codec.ColorSpec.SRGB, allow_any_depth=False)
    streams = [codec.CodeStream(data) for data in items]
    if not device.startswith("cuda"):
        return [None if im is None else np.asarray(im.cpu()) for im in decoder.decode(streams, params=params)]
    images = decoder.decode(streams, params=params, cuda_stream=torch.cuda.current_stream(device).cuda_stream)
    return [None if im is None else torch.from_dlpack(im) for im in images]


def library_config(ctx: Context) -> list[str]:
    return ["GPU_ONLY", "HYBRID_CPU_GPU"] if ctx.cuda else ["CPU_ONLY"]


def time_call(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """Seconds of ``fn()`` after one warm-up call: min and median of ``repeats`` calls."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"min_s": min(times), "median_s": statistics.median(times)}


def synthetic_photo(width: int, height: int, seed: int) -> bytes:
    """A photo-like 4:2:0 JPEG (quality 90): smooth colour fields, edges and sensor-like noise."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (height // 64 + 2, width // 64 + 2, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    noise = rng.normal(0, 6, (height, width, 3)).astype(np.int16)
    pixels = np.clip(smooth + noise, 0, 255).astype(np.uint8)
    pixels[:, ::97] = 255 - pixels[:, ::97]  # thin edges: where chroma upsampling shows
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90, subsampling=2)
    return out.getvalue()


def summarize_diffs(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    diffs = [r[key] for r in rows if isinstance(r.get(key), dict)]
    if not diffs:
        return {"decoded": 0}
    worst = max(diffs, key=lambda d: d["max_abs"])
    return {
        "decoded": len(diffs),
        "not_decoded": len(rows) - len(diffs),
        "exact": sum(d["max_abs"] == 0 for d in diffs),
        "mean_of_mean_abs": statistics.fmean(d["mean_abs"] for d in diffs),
        "max_mean_abs": max(d["mean_abs"] for d in diffs),
        "max_abs": worst["max_abs"],
        "worst_file": next(r["file"] for r in rows if r.get(key) is worst),
    }


def diff_dict(actual: Any, expected: np.ndarray) -> dict[str, Any] | str:
    host = to_host(actual)
    if host.shape != expected.shape:
        return f"shape {host.shape} != {expected.shape}"
    diff = pixel_diff(host, expected)
    return {"mean_abs": diff.mean_abs, "max_abs": diff.max_abs}


# -- sections ---------------------------------------------------------------------------------


def environment(ctx: Context) -> dict[str, Any]:
    import numba

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": np.__version__,
        "pillow": Image.__version__,
        "numba": numba.__version__,
        "nvimgcodec": getattr(ctx.codec, "__version__", None),
        "nvimgcodec_cuda": getattr(ctx.codec, "__cuda_version__", None),
        "device": ctx.device,
        "corpus": str(ctx.corpus),
        "accepted_files": len(ctx.files),
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info |= {
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "gpu_memory_mib": props.total_memory // MIB,
        }
    return info


def accuracy(ctx: Context) -> dict[str, Any]:
    variants = {  # name: (device, backends, options)
        "fancy0": (ctx.device, library_config(ctx), ":fancy_upsampling=0"),
        "cpu_backend": ("cpu", ["CPU_ONLY"], FANCY_UPSAMPLING_OPTIONS),
    }
    if ctx.cuda:
        variants |= {
            "gpu_only": (ctx.device, ["GPU_ONLY"], FANCY_UPSAMPLING_OPTIONS),
            "hybrid_only": (ctx.device, ["HYBRID_CPU_GPU"], FANCY_UPSAMPLING_OPTIONS),
        }
    decoders: dict[str, tuple[str, Any]] = {}
    unbuilt: dict[str, str] = {}
    for name, variant in variants.items():
        try:  # nvImageCodec 0.9 refuses some backend sets alone (GPU_ONLY: "Code: 7")
            decoders[name] = (variant[0], raw_decoder(ctx.codec, *variant))
        except Exception as exc:
            unbuilt[name] = f"{type(exc).__name__}: {exc}"
    library = ImageDecoder(ctx.device, gpu_route="nvimgcodec")
    preset = get_preset("kimi-k2.5")
    rows = []
    for item in (f for f in ctx.files if f.is_jpeg):
        data = ctx.read(item)
        expected = pillow_rgb(data)
        decoded = library.decode(data, preset)
        row: dict[str, Any] = {
            "file": item.name,
            "size": [decoded.width, decoded.height],
            "path": decoded.decode_path,
            "fallback_reason": decoded.fallback_reason,
            "library": diff_dict(decoded.pixels, expected),
        }
        for name, (device, decoder) in decoders.items():
            try:
                [pixels] = raw_decode(ctx.codec, device, decoder, [data])
                row[name] = "no image" if pixels is None else diff_dict(pixels, expected)
            except Exception as exc:
                row[name] = f"raised {type(exc).__name__}: {exc}"
        rows.append(row)
    fast_rows = [r for r in rows if r["path"] != "pillow"]
    return {
        "paths": {p: sum(r["path"] == p for r in rows) for p in sorted({r["path"] for r in rows})},
        "fallbacks": [r["file"] for r in rows if r["fallback_reason"]],
        "decoders_not_built": unbuilt,
        # Over the files the library decodes with nvImageCodec (the others are Pillow's by definition).
        "summary": {name: summarize_diffs(fast_rows, name) for name in ["library", *decoders]},
        "files": rows,
    }


def dlpack(ctx: Context) -> dict[str, Any]:
    if not ctx.cuda:
        return {"skipped": "needs CUDA (nvImageCodec exports DLPack through the CUDA runtime)"}
    data = (ctx.corpus / LARGE_CLEAN_JPEG).read_bytes()
    handed: list[dict[str, Any]] = []
    real_from_dlpack = torch.from_dlpack

    def spy(image: Any) -> torch.Tensor:
        tensor = real_from_dlpack(image)
        handed.append(
            {
                "buffer_kind": str(image.buffer_kind),
                "image_ptr": image.__cuda_array_interface__["data"][0],
                "tensor_ptr": tensor.data_ptr(),
                "tensor_device": str(tensor.device),
                "tensor_strides": list(tensor.stride()),
            }
        )
        return tensor

    decoder = ImageDecoder(ctx.device, gpu_route="nvimgcodec")
    torch.from_dlpack = spy
    try:
        decoded = decoder.decode(data, get_preset("kimi-k2.5"))
    finally:
        torch.from_dlpack = real_from_dlpack
    first = decoded.pixels
    gc.collect()
    for _ in range(3):
        decoder.decode_batch([data, data], get_preset("kimi-k2.5"))
    synchronize(ctx)
    again = decoder.decode(data, get_preset("kimi-k2.5")).pixels
    return {
        "file": LARGE_CLEAN_JPEG,
        "decode_path": decoded.decode_path,
        "handed": handed,
        "zero_copy": len(handed) == 1 and handed[0]["image_ptr"] == handed[0]["tensor_ptr"] == first.data_ptr(),
        "result_ptr": first.data_ptr(),
        "tensor_outlives_image": bool(torch.equal(first, again)),
    }


def patchify(ctx: Context) -> dict[str, Any]:
    decoder = ImageDecoder(ctx.device, gpu_route="nvimgcodec")
    mismatches = []
    checked = 0
    for preset_name in PRESETS:
        preset = get_preset(preset_name)
        for item in ctx.files:
            decoded = decoder.decode(ctx.read(item), preset)
            host = decoded_on_host(decoded) if ctx.cuda else decoded
            on_torch = decoded
            if not ctx.cuda and isinstance(host.pixels, np.ndarray):  # a --device cpu smoke run: CPU tensors
                on_torch = dataclasses.replace(host, pixels=torch.from_numpy(host.pixels.copy()))
            on_device = preprocess_decoded(on_torch, preset)
            on_host = preprocess_decoded(host, preset)
            checked += 1
            got = to_host(on_device.pixel_values)
            if got.shape != on_host.pixel_values.shape or not np.array_equal(got, on_host.pixel_values):
                mismatches.append({"preset": preset_name, "file": item.name, "path": decoded.decode_path})
    return {"checked": checked, "equal": checked - len(mismatches), "mismatches": mismatches}


def resize_check(ctx: Context) -> dict[str, Any]:
    width, height = SYNTHETIC_SETS["synthetic_12mp"][:2]
    host = pillow_rgb(synthetic_photo(width, height, seed=7))
    on_device = torch.from_numpy(host.copy()).to(ctx.device)
    target = navit_target_size(width, height, get_preset("kimi-k2.5"))
    size = (target.new_width, target.new_height)
    reference = pillow_resize(host, *size, "bicubic")

    def on_torch(method: str) -> Any:
        out = resize(on_device, *size, "bicubic") if method == "exact" else torch_antialias(on_device, *size)
        synchronize(ctx)
        return out

    return {
        "from": [width, height],
        "to": list(size),
        "exact_torch_equals_pillow": bool(np.array_equal(to_host(on_torch("exact")), reference)),
        "numba_equals_pillow": bool(np.array_equal(resize(host, *size, "bicubic"), reference)),
        "antialias_torch_vs_pillow": diff_dict(on_torch("antialias"), reference),
        "timings": {
            "pillow": time_call(lambda: pillow_resize(host, *size, "bicubic"), ctx.repeats),
            "numba": time_call(lambda: resize(host, *size, "bicubic"), ctx.repeats),
            f"torch_exact_{ctx.device}": time_call(lambda: on_torch("exact"), ctx.repeats),
            f"torch_antialias_{ctx.device}": time_call(lambda: on_torch("antialias"), ctx.repeats),
        },
    }


def throughput(ctx: Context) -> dict[str, Any]:
    preset = get_preset("kimi-k2.5")
    library = ImageDecoder(ctx.device, gpu_route="nvimgcodec")
    on_cpu = ImageDecoder("cpu")
    fast = [f for f in ctx.files if f.is_jpeg and library.decode(ctx.read(f), preset).decode_path != "pillow"]
    sets = {"corpus_fast_jpegs": [ctx.read(f) for f in fast]}
    sets |= {
        name: [synthetic_photo(w, h, seed) for seed in range(count)] for name, (w, h, count) in SYNTHETIC_SETS.items()
    }
    raw = raw_decoder(ctx.codec, ctx.device, library_config(ctx), FANCY_UPSAMPLING_OPTIONS)
    results = {}
    for name, items in sets.items():
        megapixels = sum(w * h for w, h in (Image.open(io.BytesIO(d)).size for d in items)) / 1e6

        def run_library(decoder: ImageDecoder = library, items: list[bytes] = items) -> None:
            decoder.decode_batch(items, preset)
            synchronize(ctx)

        def run_raw(items: list[bytes] = items) -> None:
            raw_decode(ctx.codec, ctx.device, raw, items)
            synchronize(ctx)

        def run_preprocess(decoder: ImageDecoder = library, items: list[bytes] = items) -> None:
            preprocess_batch(items, preset, decoder=decoder)
            synchronize(ctx)

        methods: dict[str, Callable[[], object]] = {
            "pillow_decode_1_thread": lambda items=items: [pillow_rgb(d) for d in items],
            "library_decode_cpu": lambda items=items: run_library(on_cpu, items),
            f"library_decode_{ctx.device}": run_library,
            f"raw_nvimgcodec_{ctx.device}": run_raw,
        }
        if name != "corpus_fast_jpegs":
            methods |= {
                "preprocess_cpu": lambda items=items: run_preprocess(on_cpu, items),
                f"preprocess_{ctx.device}": run_preprocess,
            }
        timings = {}
        for method, fn in methods.items():
            t = time_call(fn, ctx.repeats)
            timings[method] = t | {
                "images_per_s": len(items) / t["median_s"],
                "megapixels_per_s": megapixels / t["median_s"],
            }
        results[name] = {"images": len(items), "megapixels": megapixels, "timings": timings}
    return {"repeats": ctx.repeats, "sets": results}


def memory(ctx: Context) -> dict[str, Any]:
    info: dict[str, Any] = {"host_max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if not ctx.cuda:
        return info | {"device": "skipped: needs CUDA"}

    def used_mib() -> float:
        synchronize(ctx)
        free, total = torch.cuda.mem_get_info(ctx.device)
        return (total - free) / MIB

    big = synthetic_photo(*SYNTHETIC_SETS["synthetic_12mp"][:2], seed=99)
    gc.collect()
    torch.cuda.empty_cache()
    baseline = used_mib()
    steps = []
    decoders = []
    for _ in range(ctx.n_decoders):
        before = used_mib()
        decoder = raw_decoder(ctx.codec, ctx.device, library_config(ctx), FANCY_UPSAMPLING_OPTIONS)
        created = used_mib()
        images = raw_decode(ctx.codec, ctx.device, decoder, [big])
        del images
        gc.collect()
        torch.cuda.empty_cache()
        warmed = used_mib()
        decoders.append(decoder)
        steps.append({"create_mib": created - before, "after_warm_decode_mib": warmed - before})
    all_alive = used_mib()
    decoders.clear()
    gc.collect()
    released = used_mib()
    return info | {
        "device_used_at_start_mib (CUDA context of this process, torch + nvImageCodec loaded)": baseline,
        "per_decoder": steps,
        "device_used_with_all_decoders_mib": all_alive,
        "device_used_after_releasing_decoders_mib": released,
        "torch_max_memory_allocated_mib": torch.cuda.max_memory_allocated(ctx.device) / MIB,
        "warm_decode_image": "4000x3000 4:2:0 JPEG",
    }


def exact_route(ctx: Context) -> dict[str, Any]:
    photos = {"synthetic_1080p": [synthetic_photo(1920, 1080, seed) for seed in range(8)]}
    photos["synthetic_12mp"] = [synthetic_photo(4000, 3000, seed) for seed in range(4)]
    return exact_report.exact_route(ctx.device, ctx.corpus, ctx.files, min(ctx.repeats, 3), photos)


SECTIONS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "environment": environment,
    "exact_route": exact_route,
    "accuracy": accuracy,
    "dlpack": dlpack,
    "patchify": patchify,
    "resize": resize_check,
    "throughput": throughput,
    "memory": memory,
}


def headline(name: str, result: dict[str, Any]) -> str:
    """One line per section for the log."""
    if "error" in result:
        return f"{name}: ERROR {result['error']}"
    if name == "accuracy":
        return f"{name}: paths {result['paths']} fallbacks {result['fallbacks']} " + json.dumps(result["summary"])
    if name == "throughput":
        lines = [f"{name}:"]
        for set_name, s in result["sets"].items():
            rates = ", ".join(f"{m} {t['images_per_s']:.1f} img/s" for m, t in s["timings"].items())
            lines.append(f"  {set_name} ({s['images']} images, {s['megapixels']:.1f} MP): {rates}")
        return "\n".join(lines)
    if name == "dlpack" and "zero_copy" in result:
        return f"{name}: zero_copy={result['zero_copy']} tensor_outlives_image={result['tensor_outlives_image']}"
    return f"{name}: " + json.dumps(result)[:600]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decoders", type=int, default=4, help="decoders created in the memory section")
    args = parser.parse_args(argv)

    corpus = CORPUS
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else args.device
    from nvidia import nvimgcodec

    ctx = Context(device, corpus, accepted_files(corpus), args.repeats, args.decoders, nvimgcodec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    for name, section in SECTIONS.items():
        start = time.perf_counter()
        try:
            result = section(ctx)
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["section_s"] = round(time.perf_counter() - start, 2)
        report[name] = result
        args.out.write_text(json.dumps(report, indent=1, default=str))
        print(headline(name, result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
