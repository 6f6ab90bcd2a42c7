"""NVIDIA's perf_analyzer against the server as `kimi-prep serve` starts it, next to in-process (issue 11).

The server: the default model set (the four image ensembles and their steps) plus K2.5's fused
models, rendered with the host's layout (``host_layout``: what `kimi-prep serve` prints at start),
plus the peer a Triton user would write instead: the plain reference processor in a Python model
(``peer_model.py``, same batching and instances) as ``reference_k25_vision``, in the same
bench-only repository. perf_analyzer (from the ``tritonclient==2.41.0`` wheel in its own venv,
``make perf-analyzer``) sends the benchmark photos (``photos.benchmark_photos``, ``kimi-prep
perf-data``), gRPC, at ``--concurrency`` (default 4), with and without system shared memory, to
each model. In-process: the library's fastest path on the same photos, ``preprocess_batch`` with
its defaults (every core), producing the same output, once the server's processes are idle
(``settle``: the tail of the last perf_analyzer run would otherwise fall on it), the faster of two
rounds (the first after the server worked pays the kernel's system time for fresh pages). Each row is
``--rounds`` pairs of one in-process round and one perf_analyzer run, alternating, so that a slow
spell of a shared host falls on both sides of a ratio (the VM this was built on moved 30-50%
between minutes); the row reports each pair's ratio, their median and range, and the pair of the
median ratio in full. A second ratio, in-process CPU ms per image over the server's CPU ms per
request, says the same where both saturate the host and moves less with another tenant's load
(it slows a process, it adds less to its CPU time). perf_analyzer shares the host's cores with
the server: its own CPU ms per request and its share of the cores during its run say how much of
a gap that is. Triton's statistics of each model the request passes (the
ensemble and its steps) split the server time into queue / compute_input / compute_infer /
compute_output per request; ``/proc`` gives the server's CPU ms and minor page faults per request,
by process (tritonserver, each model's stubs).

    .venv/bin/python benchmarks/bench_perf_analyzer.py --perf-analyzer .venv-perf/bin/perf_analyzer
        [--concurrency 4] [--seconds 5] [--rounds 3] [--models ...] [--out-dir bench_results]

Writes ``bench_perf_analyzer.json`` and ``.png`` and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from photos import ROOT, benchmark_photos
from plots import saved_axes

from kimi_vision_client.cli.front import perf_input_data
from kimi_vision_common.errors import PreprocessError
from kimi_vision_common.presets import get_preset
from kimi_vision_prep import preprocess_batch
from kimi_vision_prep.pipeline import PixelOutput
from kimi_vision_server.cli import bench_local
from kimi_vision_server.host import host_layout
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.blocks import IMAGE_BYTES_INPUT, SERVING_DEFAULTS, pixel_outputs, python_model
from kimi_vision_server.render.repository import (
    RenderOptions,
    default_model_names,
    host_rendering,
    render_repository,
    repository_models,
)

PEER = "reference_k25_vision"
# model -> the in-process output it is compared with (the peer: with ours producing the same float32).
MODELS = {
    "kimi_k25_vision": "pixel_values",
    "kimi_k25_vision_u8": "pixel_patches",
    "kimi_k25_vision_fused": "pixel_values",
    "kimi_k25_vision_fused_u8": "pixel_patches",
    PEER: "pixel_values",
}
STAT_PARTS = ("queue", "compute_input", "compute_infer", "compute_output")
OUTPUT_SHM_BYTES = 48 << 20  # the largest K2.5 output (16,900 patches of float32) fits


def cudart_dir(perf_analyzer: Path) -> str:
    """``libcudart.so.12`` of the perf venv's ``nvidia-cuda-runtime-cu12`` wheel."""
    python = perf_analyzer.parent / "python"
    code = "import nvidia.cuda_runtime as c, os; print(os.path.join(list(c.__path__)[0], 'lib'))"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def run_perf_analyzer(  # noqa: PLR0917
    perf_analyzer: Path, url: str, model: str, data: Path, concurrency: int, shm: bool, seconds: float
) -> dict[str, float]:
    """perf_analyzer's row for ``model``; a slow model (the peer) that is not stable within six
    windows of ``seconds`` gets windows twice, then four times as long (a few requests a window
    cannot be stable)."""
    for window_s in (seconds, 2 * seconds, 4 * seconds):
        try:
            return perf_analyzer_row(perf_analyzer, url, model, data, concurrency, shm, window_s)
        except UnstableMeasurement:
            print(f"{model}: not stable with {window_s:.0f} s windows", flush=True)
    raise UnstableMeasurement(f"{model}: no stable measurement with windows up to {4 * seconds:.0f} s")


class UnstableMeasurement(RuntimeError):
    pass


def perf_analyzer_row(  # noqa: PLR0917
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
        if "Failed to obtain stable measurement" in done.stdout + done.stderr:
            raise UnstableMeasurement(model)
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


def bench_repository(out: Path, options: RenderOptions) -> Path:
    """The default set and K2.5's fused models rendered with ``options``, plus the peer."""
    render_repository(out, options, names=[*default_model_names(), "kimi_k25_vision_fused", "kimi_k25_vision_fused_u8"])
    preset = get_preset("kimi-k2.5")
    tensors = pixel_outputs(preset.patch_size)
    outputs = [tensors["PIXEL_VALUES"], tensors["GRID_THW"], tensors["NUM_TOKENS"]]
    summary = f"{PEER}: the plain reference processor (tests/reference.py) in a Python model, the peer"
    # kind "peer": no setting of ours applies (an empty settings block); the peer reads none.
    peer = python_model(
        PEER, summary, IMAGE_BYTES_INPUT, outputs, [], "peer.Model", options, SERVING_DEFAULTS, "peer", preset
    )
    (out / PEER / "1").mkdir(parents=True)
    (out / PEER / "config.pbtxt").write_text(peer.config)
    shutil.copy(ROOT / "benchmarks" / "peer_model.py", out / PEER / "1" / "model.py")
    shutil.copy(ROOT / "tests" / "reference.py", out / PEER / "1" / "reference.py")
    return out


def chain(model: str, options: RenderOptions) -> list[str]:
    """``model`` and, for an ensemble, its steps: the models whose statistics a request adds to."""
    rendered = {files.name: files for files in repository_models(options)}
    return [model, *(rendered[model].steps if model in rendered else ())]


def model_stats(http_url: str, model: str) -> dict[str, tuple[int, int]]:
    """Triton's ``(count, ns)`` of each :data:`STAT_PARTS` and ``success`` for ``model``."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=10) as answer:
        stats = json.load(answer)["model_stats"][0]["inference_stats"]
    return {part: (int(stats[part]["count"]), int(stats[part]["ns"])) for part in ("success", *STAT_PARTS)}


def per_request_ms(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Mean ms per request of each part between two :func:`model_stats` snapshots."""
    requests = max(after["success"][0] - before["success"][0], 1)
    return {part: (after[part][1] - before[part][1]) / requests / 1e6 for part in STAT_PARTS}


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
Usage = dict[str, tuple[float, int]]  # process group -> (CPU seconds, minor page faults)


def process_usage(pids: list[int]) -> Usage:
    """CPU seconds (user + system) and minor page faults so far of the server's processes, summed by
    group: ``tritonserver``, and each model's stubs (the model folder on the stub's command line)."""
    usage: Usage = {}
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a stub restarted since the tree was listed
            continue
        model = re.search(r"/([^/ ]+)/\d+/model\.py", command)
        group = model.group(1) if model else "tritonserver"
        cpu_s, faults = usage.get(group, (0.0, 0))
        usage[group] = (cpu_s + (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, faults + int(fields[7]))
    return usage


def usage_per_request(before: Usage, after: Usage, requests: int) -> dict[str, Any]:
    """``server_cpu_ms`` (all groups) and, by group, CPU ms and minor faults per request between two
    :func:`process_usage` readings: less noisy than img/s on a shared host (another tenant's load
    slows the server, it does not add to its CPU time)."""
    requests = max(requests, 1)
    cpu = {group: 1e3 * (after[group][0] - before.get(group, (0.0, 0))[0]) / requests for group in after}
    faults = {group: (after[group][1] - before.get(group, (0.0, 0))[1]) / requests for group in after}
    return {"server_cpu_ms": sum(cpu.values()), "cpu_ms_by_process": cpu, "minor_faults_by_process": faults}


def measured_run(  # noqa: PLR0917
    server: EmbeddedServer,
    perf_analyzer: Path,
    model: str,
    data: Path,
    concurrency: int,
    shm: bool,
    seconds: float,
    steps: list[str],
) -> dict[str, Any]:
    """:func:`run_perf_analyzer`'s row for ``model`` on ``server``, with what the run cost the server:
    ``steps`` (the models a request passes, :func:`chain`) each split per request by Triton's
    statistics, and the CPU ms and minor faults per request by process (:func:`usage_per_request`)."""
    before = {m: model_stats(server.http_url, m) for m in steps}
    pids = server.process_tree()
    usage = process_usage(pids)
    client_before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    served = run_perf_analyzer(perf_analyzer, server.grpc_url, model, data, concurrency, shm, seconds)
    client_after, wall_s = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
    after = {m: model_stats(server.http_url, m) for m in steps}
    requests = after[model]["success"][0] - before[model]["success"][0]
    served["steps"] = {m: per_request_ms(before[m], after[m]) for m in steps}
    # perf_analyzer is this process's only child that ends (the server runs on): its CPU time.
    client_s = sum(getattr(client_after, f) - getattr(client_before, f) for f in ("ru_utime", "ru_stime"))
    served["client_cpu_ms"] = 1e3 * client_s / max(requests, 1)
    served["client_core_share"] = client_s / (wall_s * (os.cpu_count() or 1))
    return served | usage_per_request(usage, process_usage(pids), requests)


def settle(pids: list[int], quiet_cpu_s: float = 0.02, timeout_s: float = 30.0) -> None:
    """Wait until the server's processes use less than ``quiet_cpu_s`` CPU seconds in a second (the
    last requests of a perf_analyzer run, a stub's start, done), at most ``timeout_s``. An
    in-process round that overlaps the server's work measures neither side."""
    start = time.perf_counter()
    before = sum(cpu for cpu, _ in process_usage(pids).values())
    while time.perf_counter() - start < timeout_s:
        time.sleep(1.0)
        now = sum(cpu for cpu, _ in process_usage(pids).values())
        if now - before < quiet_cpu_s:
            return
        before = now


def batch_round(photos: list[bytes], output: PixelOutput) -> tuple[float, float]:
    """(images/s, CPU ms per image) of one ``preprocess_batch`` over ``photos`` with the library's
    defaults (every core): the fastest in-process path, the denominator of every served ratio."""
    start, cpu_start = time.perf_counter(), time.process_time()
    results = preprocess_batch(photos, "kimi-k2.5", output=output)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if any(isinstance(result, PreprocessError) for result in results):
        raise RuntimeError("a benchmark photo failed in process")
    return len(photos) / wall, 1e3 * cpu / len(photos)


def paired_row(  # noqa: PLR0917
    server: EmbeddedServer,
    images: list[bench_local.BenchImage],
    data: Path,
    model: str,
    shm: bool,
    options: RenderOptions,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``args.rounds`` pairs of one in-process round (:func:`batch_round`) and one
    :func:`measured_run`, alternating: the pair of the median ratio in full, and each pair's img/s,
    ratio and CPU ratio (in-process CPU ms per image / server CPU ms per request)."""
    photos = [im.data for im in images]
    settle(server.process_tree())
    batch_round(photos, MODELS[model])  # warm-up: the batch threads and their arenas
    pairs = []
    for _ in range(args.rounds):
        settle(server.process_tree())
        # The first round after the server worked pays the kernel's time for fresh pages (up to
        # 85 ms an image of system time measured here): the faster of two is the library's own.
        local_img_s, local_cpu_ms = max(batch_round(photos, MODELS[model]) for _ in range(2))
        served = measured_run(
            server, args.perf_analyzer, model, data, args.concurrency, shm, args.seconds, chain(model, options)
        )
        pairs.append({"in_process_img_s": local_img_s, "in_process_cpu_ms": local_cpu_ms, **served})
        pairs[-1]["served_over_in_process"] = served["inferences_s"] / local_img_s
        pairs[-1]["cpu_ratio"] = local_cpu_ms / served["server_cpu_ms"]
    ratios = [pair["served_over_in_process"] for pair in pairs]
    median = pairs[ratios.index(statistics.median_low(ratios))]
    keys = (
        "inferences_s", "in_process_img_s", "served_over_in_process", "in_process_cpu_ms", "server_cpu_ms",
        "client_cpu_ms", "client_core_share",
    )  # fmt: skip
    return median | {
        "cpu_ratio": statistics.median(pair["cpu_ratio"] for pair in pairs),
        "pairs": [{key: pair[key] for key in (*keys, "cpu_ratio")} for pair in pairs],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--perf-analyzer", type=Path, default=Path(".venv-perf/bin/perf_analyzer"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3, help="in-process / served pairs per row")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    images = bench_local.bench_images("kimi-k2.5", benchmark_photos())
    layout = host_layout()
    options = host_rendering(layout)
    print(f"{layout.describe()}; {len(images)} photos", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repository = bench_repository(Path(tmp) / "repository", options)
        data = Path(tmp) / "data.json"
        data.write_text(json.dumps(perf_input_data([im.data for im in images])))
        with EmbeddedServer(repository) as server:
            for model in args.models:
                for shm in (False, True):
                    row = {"model": model, "shm": shm, **paired_row(server, images, data, model, shm, options, args)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print_tables(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"layout": layout.describe(), "concurrency": args.concurrency, "photos": len(images), "rows": rows}
    (args.out_dir / "bench_perf_analyzer.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out_dir / "bench_perf_analyzer.png")
    return 0


def print_tables(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| model | shm | perf_analyzer img/s | preprocess_batch img/s | served / in-process: median (each pair) "
        "| CPU ratio | p50 / p99 ms | server CPU ms / request | in-process CPU ms / image "
        "| perf_analyzer CPU ms / request (share of the cores) |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        each = ", ".join(f"{pair['served_over_in_process']:.2f}" for pair in r["pairs"])
        print(
            f"| {r['model']} | {'system' if r['shm'] else 'no'} | {r['inferences_s']:.1f} | "
            f"{r['in_process_img_s']:.1f} | {r['served_over_in_process']:.2f}x ({each}) | {r['cpu_ratio']:.2f}x | "
            f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} | {r['server_cpu_ms']:.1f} | {r['in_process_cpu_ms']:.1f} | "
            f"{r['client_cpu_ms']:.1f} ({r['client_core_share']:.0%}) |"
        )
    print("\n| model | shm | process | CPU ms / request | minor faults / request |")
    print("|---|---|---|---:|---:|")
    for r in rows:
        for group, cpu_ms in r["cpu_ms_by_process"].items():
            faults = r["minor_faults_by_process"][group]
            if cpu_ms < 0.05:  # a model the request does not pass
                continue
            print(f"| {r['model']} | {'system' if r['shm'] else 'no'} | {group} | {cpu_ms:.1f} | {faults:.0f} |")
    print("\n| model | shm | step | " + " | ".join(f"{part} ms" for part in STAT_PARTS) + " |")
    print("|---|---|---|" + "---:|" * len(STAT_PARTS))
    for r in rows:
        for step, parts in r["steps"].items():
            values = " | ".join(f"{parts[part]:.1f}" for part in STAT_PARTS)
            print(f"| {r['model']} | {'system' if r['shm'] else 'no'} | {step} | {values} |")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per row: the median throughput ratio with its pairs' range, and the CPU ratio beside it."""
    names = [r["model"].removeprefix("kimi_k25_") if r["model"] != PEER else "peer" for r in rows]
    labels = [f"{name}\n{'shm' if r['shm'] else 'no shm'}" for name, r in zip(names, rows, strict=True)]
    x = np.arange(len(rows))
    medians = np.array([r["served_over_in_process"] for r in rows])
    spans = [[pair["served_over_in_process"] for pair in r["pairs"]] for r in rows]
    errors = [medians - [min(span) for span in spans], [max(span) for span in spans] - medians]
    with saved_axes(path, (12, 4.5)) as ax:
        ax.bar(x - 0.2, medians, 0.4, yerr=errors, capsize=3, label="img/s ratio (median, range of pairs)")
        ax.bar(x + 0.2, [r["cpu_ratio"] for r in rows], 0.4, label="CPU ratio (in-process / server ms)")
        ax.axhline(0.8, color="grey", linestyle="--", label="0.8x target")
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("served / in-process")
        ax.set_title("default kimi-prep serve, perf_analyzer gRPC, pairs alternating")
        ax.legend()


if __name__ == "__main__":
    sys.exit(main())
