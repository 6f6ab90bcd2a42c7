"""NVIDIA's perf_analyzer against the server as `kimi-prep serve` starts it, next to in-process (issue 11).

The server: the default model set (the four image ensembles and their steps) rendered with the
host's layout (``host_layout``: what `kimi-prep serve` prints at start). perf_analyzer (from the
``tritonclient==2.41.0`` wheel in its own venv, ``make perf-analyzer``) sends the corpus photos
(``kimi-prep perf-data``), gRPC, at ``--concurrency`` (default 4), with and without system shared
memory, to ``kimi_k25_vision`` (float32) and ``kimi_k25_vision_u8``. In-process: the library on 2
threads producing the same output, measured right before each row (same load on the host).

    .venv/bin/python benchmarks/bench_perf_analyzer.py --perf-analyzer .venv-perf/bin/perf_analyzer
        [--concurrency 4] [--seconds 5] [--out-dir bench_results]

Writes ``bench_perf_analyzer.json`` and ``.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from photos import benchmark_photos

from kimi_vision_client import bench_local
from kimi_vision_client.cli import perf_input_data
from kimi_vision_prep.host import host_layout
from kimi_vision_prep.serving.launcher import EmbeddedServer
from kimi_vision_prep.serving.repository import RenderOptions, default_model_names

MODELS = {"kimi_k25_vision": "pixel_values", "kimi_k25_vision_u8": "pixel_patches"}
OUTPUT_SHM_BYTES = 48 << 20  # the largest K2.5 output (16,900 patches of float32) fits


def cudart_dir(perf_analyzer: Path) -> str:
    """``libcudart.so.12`` of the perf venv's ``nvidia-cuda-runtime-cu12`` wheel."""
    python = perf_analyzer.parent / "python"
    code = "import nvidia.cuda_runtime as c, os; print(os.path.join(list(c.__path__)[0], 'lib'))"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def run_perf_analyzer(  # noqa: PLR0917
    perf_analyzer: Path, url: str, model: str, data: Path, concurrency: int, shm: bool, seconds: float
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.csv"
        command = [
            str(perf_analyzer), "-m", model, "-u", url, "-i", "grpc", "--input-data", str(data),
            "--concurrency-range", str(concurrency), "--measurement-interval", str(int(seconds * 1000)),
            "-s", "25", "--max-trials", "6", "-f", str(report),
        ]  # fmt: skip
        if shm:
            command += ["--shared-memory", "system", "--output-shared-memory-size", str(OUTPUT_SHM_BYTES)]
        env = {**os.environ, "LD_LIBRARY_PATH": cudart_dir(perf_analyzer)}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        (row,) = list(csv.DictReader(report.open()))
    return {
        "inferences_s": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1000,
        "p99_ms": float(row["p99 latency"]) / 1000,
        "queue_ms": float(row["Server Queue"]) / 1000,
        "compute_input_ms": float(row["Server Compute Input"]) / 1000,
        "compute_infer_ms": float(row["Server Compute Infer"]) / 1000,
        "compute_output_ms": float(row["Server Compute Output"]) / 1000,
    }


def in_process(images: list[bench_local.BenchImage], output: str) -> float:
    """Images/s of the library on 2 threads producing ``output`` (best of 3 rounds)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from kimi_vision_prep import ImageDecoder, preprocess_bytes

    decoder = ImageDecoder(pool_size=2)
    best = 0.0
    with ThreadPoolExecutor(2) as pool:
        work = lambda im: preprocess_bytes(im.data, "kimi-k2.5", decoder=decoder, output=output)  # noqa: E731
        list(pool.map(work, images))
        for _ in range(3):
            start = time.perf_counter()
            list(pool.map(work, images))
            best = max(best, len(images) / (time.perf_counter() - start))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--perf-analyzer", type=Path, default=Path(".venv-perf/bin/perf_analyzer"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    images = bench_local.bench_images("kimi-k2.5", benchmark_photos())
    layout = host_layout()
    options = RenderOptions(layout.instances, layout.threads, layout.kind)  # type: ignore[arg-type]
    print(f"{layout.describe()}; {len(images)} photos", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(render=options, models=default_model_names()) as server:
        data = Path(tmp) / "data.json"
        data.write_text(json.dumps(perf_input_data([im.data for im in images])))
        for model, output in MODELS.items():
            for shm in (False, True):
                local = in_process(images, output)
                served = run_perf_analyzer(
                    args.perf_analyzer, server.grpc_url, model, data, args.concurrency, shm, args.seconds
                )
                row = {"model": model, "shm": shm, "in_process_img_s": local, **served}
                row["served_over_in_process"] = served["inferences_s"] / local
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| model | shm | perf_analyzer img/s | in-process img/s | served / in-process | p50 / p99 ms |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {'system' if r['shm'] else 'no'} | {r['inferences_s']:.1f} | "
            f"{r['in_process_img_s']:.1f} | {r['served_over_in_process']:.2f}x | "
            f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} |"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"layout": layout.describe(), "concurrency": args.concurrency, "rows": rows}
    (args.out_dir / "bench_perf_analyzer.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out_dir / "bench_perf_analyzer.png")
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model'].removeprefix('kimi_k25_')}\n{'shm' if r['shm'] else 'no shm'}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(labels, [r["served_over_in_process"] for r in rows])
    ax.axhline(0.8, color="grey", linestyle="--", label="0.8x target")
    ax.set_ylabel("perf_analyzer img/s / in-process img/s")
    ax.set_title("default kimi-prep serve, gRPC")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
