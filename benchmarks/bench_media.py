"""Videos, several images per request and token counts: side by side in one run (issue 10).

In process, per clip (the corpus's three real clips, and 10-12 s clips encoded here with PyAV from
a corpus photo: x264 with its defaults, x264 with short open GOPs, MPEG-4 with B-frames):
``preprocess_video`` vs the decode-only floor (PyAV decoding every frame, no RGB conversion, at
FFmpeg's thread count and at one thread a core: the faster of the two) vs our sampling alone
(``sample_video``: the planned decode, the sampled frames' RGB conversion and digest, no resize or
patches; the most a faster pixel path could take ours down to) vs the plain reference
(``tests/reference.py``: every frame decoded and converted, Pillow resize, numpy); sampled
frames/s and chunks/s; the RSS while streaming the longest clip (sampled after every chunk: from
the third chunk on it stays within a band of one chunk's size, at most two being held besides
the caller's). Served (an embedded tritonserver, gRPC): time to the first chunk vs the whole
video; one K=8 request vs 8 single requests; ``count_tokens`` (the tokens model) vs full
preprocessing of the same images.

    .venv/bin/python benchmarks/bench_media.py [--repeats 3] [--out-dir bench_results] [--no-served]

Writes ``bench_media.json`` and ``bench_media.png``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import av
import numpy as np
from make_inputs import encode_clip, iter_photo_frames
from photos import CORPUS, plain_reference

import kimi_vision_prep as kvp
from kimi_vision_prep.video.demux import probe_video
from kimi_vision_prep.video.sampling import sample_video


def median(sample: dict[str, float]) -> float:
    return sample["median_s"]


def timed(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    """min / median seconds of ``repeats`` runs after one warm-up run."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return {"min_s": min(samples), "median_s": statistics.median(samples)}


def alternating(ways: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, float]]:
    """min / median seconds of each way over ``repeats`` rounds that run every way once, in turn
    (after one warm-up round), so a noisy host slows them alike."""
    for fn in ways.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: {"min_s": min(v), "median_s": statistics.median(v)} for name, v in samples.items()}


def decode_floor(data: bytes, threads: int) -> int:
    """Every frame decoded on ``threads`` FFmpeg threads (0: FFmpeg's choice), nothing converted:
    what decoding every frame costs, the floor of a pipeline that does."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = threads
        return sum(1 for _ in container.decode(stream))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def clips() -> dict[str, bytes]:
    photo = "pil__xmp_test.jpg"
    open_gop = {"x264-params": "keyint=50:min-keyint=50:scenecut=0:open-gop=1:bframes=3:b-pyramid=normal"}
    return {
        "av1_640x360_125f_25fps.mkv": (CORPUS / "video" / "torchcodec__av1_video.mkv").read_bytes(),
        "h264_10bit_corpus.mp4": (CORPUS / "video" / "torchcodec__h264_10bits.mp4").read_bytes(),
        "hevc_corpus.mp4": (CORPUS / "video" / "torchcodec__h265_video.mp4").read_bytes(),
        "h264_1280x720_250f_25fps.mp4": encode_clip(iter_photo_frames(photo, 1280, 720, 250), 25),
        "h264_1920x1080_300f_30fps.mp4": encode_clip(iter_photo_frames(photo, 1920, 1080, 300), 30),
        "h264_open_gop_1280x720_300f.mkv": encode_clip(
            iter_photo_frames(photo, 1280, 720, 300), 25, container="matroska", options=open_gop
        ),
        "mpeg4_bframes_1280x720_300f.mkv": encode_clip(
            iter_photo_frames(photo, 1280, 720, 300), 25, "mpeg4", "matroska", options={"bf": "2", "g": "50"}
        ),
    }


def in_process(repeats: int) -> list[dict[str, Any]]:
    reference = plain_reference()
    rows = []
    for name, data in clips().items():
        chunks = list(kvp.preprocess_video(data, "kimi-k2.5"))
        sampled = sum(len(c.frame_indices) for c in chunks)
        ways = {
            "ours": lambda d=data: list(kvp.preprocess_video(d, "kimi-k2.5")),
            "sampling": lambda d=data: sum(len(chunk.frames) for chunk in sample_video(d, "kimi-k2.5")),
            "decode_floor_ffmpeg_threads": lambda d=data: decode_floor(d, 0),
            "decode_floor_thread_a_core": lambda d=data: decode_floor(d, os.cpu_count() or 1),
        }
        row = {
            "clip": name,
            "chunks": len(chunks),
            "sampled_frames": sampled,
            "seconds": probe_video(data).packets / probe_video(data).fps,
            **alternating(ways, repeats),
            "reference": timed(lambda d=data: reference.reference_video(d, "kimi-k2.5"), 1),
        }
        row["decode_floor"] = min(row["decode_floor_ffmpeg_threads"], row["decode_floor_thread_a_core"], key=median)
        ours = row["ours"]["median_s"]
        row["ours_over_floor"] = ours / row["decode_floor"]["median_s"]
        row["sampling_over_floor"] = row["sampling"]["median_s"] / row["decode_floor"]["median_s"]
        row["reference_over_ours"] = row["reference"]["median_s"] / ours
        row["sampled_frames_per_s"] = sampled / ours
        row["chunks_per_s"] = len(chunks) / ours
        print(
            f"{name:34s} chunks {len(chunks):3d}  ours {ours * 1e3:8.1f} ms  floor "
            f"{row['decode_floor']['median_s'] * 1e3:8.1f} ms  ours/floor {row['ours_over_floor']:.2f}x  "
            f"sampling/floor {row['sampling_over_floor']:.2f}x  "
            f"reference/ours {row['reference_over_ours']:.2f}x  {row['sampled_frames_per_s']:.1f} sampled frames/s",
            flush=True,
        )
        rows.append(row)
    return rows


def streaming_rss() -> dict[str, Any]:
    """RSS after every chunk of a 60 s 720p clip (K3: 480 sampled frames, 120 chunks)."""
    long_clip = encode_clip(iter_photo_frames("pil__xmp_test.jpg", 1280, 720, 60 * 25), 25)
    samples, chunk_mib = [rss_mib()], 0.0
    for chunk in kvp.preprocess_video(long_clip, "kimi-k3"):
        samples.append(rss_mib())
        chunk_mib = max(chunk_mib, chunk.pixel_values.nbytes / 2**20)
    result = {"chunks": len(samples) - 1, "rss_mib_first_chunk": samples[1], "rss_mib_max": max(samples)}
    result["rss_mib_growth_after_first_chunk"] = max(samples[1:]) - samples[1]
    # While the caller holds chunk k, chunk k + 1 may still be written and chunk k + 2 filling:
    # from the third chunk on the RSS moves within a band (one chunk's buffers, reused or not)
    # and ends where that band started if nothing accumulates.
    result["chunk_mib"] = chunk_mib
    result["rss_mib_band_from_third_chunk"] = max(samples[3:]) - min(samples[3:])
    result["rss_mib_last_over_third_chunk"] = samples[-1] - samples[3]
    print(f"streaming RSS: {result}", flush=True)
    return result


def served(repeats: int) -> dict[str, Any]:
    from kimi_vision_client.client import KimiVisionClient
    from kimi_vision_server.launch.embedded import EmbeddedServer

    data = clips()["h264_1920x1080_300f_30fps.mp4"]
    # Three photos whose 8 copies fit one request's patch budget (max_patches_per_request).
    photos = [(CORPUS / n).read_bytes() for n in ("pil__hopper.jpg", "sklearn__china.jpg", "pil__iptc.jpg")]
    images = (photos * 3)[:8]
    out: dict[str, Any] = {}
    with EmbeddedServer() as server, KimiVisionClient(server.grpc_url, "grpc", "kimi_k25_vision_u8") as client:

        def first_chunk() -> None:
            chunks = client.preprocess_video(data)
            next(chunks)
            chunks.close()

        out["video_first_chunk"] = timed(first_chunk, repeats)
        out["video_whole"] = timed(lambda: list(client.preprocess_video(data)), repeats)
        out["k8_one_request"] = timed(lambda: client.preprocess_images(images), repeats)
        out["k8_eight_requests"] = timed(lambda: client.infer_many(images, concurrency=1), repeats)
        out["tokens_k8"] = timed(lambda: client.count_tokens(images), repeats)
    out["full_over_tokens"] = out["k8_one_request"]["median_s"] / out["tokens_k8"]["median_s"]
    out["whole_over_first_chunk"] = out["video_whole"]["median_s"] / out["video_first_chunk"]["median_s"]
    out["eight_requests_over_one"] = out["k8_eight_requests"]["median_s"] / out["k8_one_request"]["median_s"]
    tokens_in_process = timed(lambda: [kvp.count_tokens(d) for d in images], repeats)
    full_in_process = timed(lambda: kvp.preprocess_images(images), repeats)
    out["in_process_full_over_tokens"] = full_in_process["median_s"] / tokens_in_process["median_s"]
    print(json.dumps(out, indent=1), flush=True)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = (
        ("decode_floor", "decode floor"),
        ("sampling", "our sampling alone"),
        ("ours", "ours"),
        ("reference", "reference"),
    )
    for i, (key, label) in enumerate(bars):
        ax.bar(x + i * 0.2, [r[key]["median_s"] for r in rows], 0.2, label=label)
    ax.set_xticks(x + 0.3, [r["clip"] for r in rows], rotation=15, fontsize=7)
    ax.set_ylabel("median s per video (K2.5)")
    ax.set_title("bench_media: lower is better")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    parser.add_argument("--no-served", action="store_true", help="in process only")
    args = parser.parse_args()
    result: dict[str, Any] = {"in_process": in_process(args.repeats), "streaming": streaming_rss()}
    if not args.no_served:
        result["served"] = served(args.repeats)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_media.json").write_text(json.dumps(result, indent=2))
    plot(result["in_process"], args.out_dir / "bench_media.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
