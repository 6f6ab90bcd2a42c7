"""The served GPU check (issue 13): a real tritonserver with ``kimi_k25_vision`` checked from outside.

``run_device_checks.sh served`` runs it on the GPU machine with ``--kind gpu`` (decode and
preprocess KIND_GPU); ``--dry-run`` runs it here with ``--kind cpu`` against the embedded
tritonserver, so the script cannot rot between devices. Steps, in order, each dropped when the
time box (``--budget-s``) has too little left for it:

1. ``outputs``: per image, ``kimi_k25_vision``'s ``PIXEL_VALUES`` / ``GRID_THW`` over HTTP (raw
   KServe v2 with the binary-data extension: the device has no ``tritonclient.http`` stack) and
   over gRPC equal, bit for bit, the CPU pipeline run in this process on the same bytes; the pixels
   ``kimi_k25_decode`` returns (decoded and resized to their NaViT size on the device) equal
   Pillow's decode and resize exactly, and its ``DECODE_PATH`` is the expected one: on ``--kind
   gpu`` the exact route's ``coefficients-cuda`` for every image the CPU pipeline takes on a fast
   route (the default ``gpu_route="exact"``; a missing libjpeg extension would send them to
   Pillow), otherwise the CPU pipeline's own path. nvImageCodec's route (``gpu_route="nvimgcodec"``,
   near-exact) is not served here: ``tests/gpu/test_gpu_decode.py`` bounds it.
2. ``zero_copy``: the preprocess model counted its IMAGE inputs in device memory
   (``kimi_prep_image_inputs_total{device="cuda:0"}``) and logged the first one's data pointer;
   on the CPU the same counter says ``cpu``.
3. ``hbm``: per-process GPU memory (``nvidia-smi --query-compute-apps``) idle and after the
   largest image, at 1 and 2 instances a model (skipped without ``nvidia-smi``).
4. ``throughput``: ensemble and decode img/s and latency (gRPC client, ``--concurrency``) next
   to Pillow's decode img/s in this process on the same images.

Writes ``served_check.json`` and ``tritonserver*.log`` into ``--out``; exit 0 when every step
that ran passed.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from kimi_vision_prep import DecodedImage, ImageDecoder, get_preset, navit_target_size, preprocess_decoded
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.repository import RenderOptions, render_repository

MODEL, DECODE = "kimi_k25_vision", "kimi_k25_decode"
PRESET = get_preset("kimi-k2.5")
EXACT_GPU_PATH = "coefficients-cuda"  # the exact route, a KIND_GPU decode's default (gpu_route="exact")
CUDA_POOL_BYTES = 512 << 20  # a 4200-token image's float32 output and its decoded 12 MP source fit
STEP_COST_S = {"outputs": 60, "zero_copy": 5, "hbm": 150, "throughput": 45}
HTTP_DTYPES = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32, "UINT8": np.uint8}


def check_images() -> dict[str, bytes]:
    """Generated camera-sized JPEGs (no corpus to carry): 640x480 to 12 MP, the largest downscaled."""
    from kimi_vision_client.cli.samples import bench_photos

    return bench_photos()


# -- the server ------------------------------------------------------------------------------------


def start_server(out: Path, kind: str, instances: int, tag: str) -> EmbeddedServer:
    """A server of ``kimi_k25_vision`` and its steps at ``instances`` a model; ``with`` starts it."""
    repository = Path(tempfile.mkdtemp(prefix="kimi_served_check."))
    # The dry run leaves the kind unset (CPU here): the same ensemble as on the GPU, through the Python
    # preprocess step (a KIND_CPU rendering ends it in the C backend kimi_patchify instead).
    render_kind = "gpu" if kind == "gpu" else None
    render_repository(repository, RenderOptions(instances=instances, kind=render_kind), names=[MODEL])
    extra = [f"--cuda-memory-pool-byte-size=0:{CUDA_POOL_BYTES}"] if kind == "gpu" else []
    return EmbeddedServer(repository, extra_args=extra, log_path=out / f"tritonserver_{tag}.log", startup_timeout_s=240)


def http_infer(url: str, model: str, data: bytes, outputs: list[str]) -> dict[str, np.ndarray]:
    """One request over HTTP: KServe v2 JSON header plus the binary-data extension, by hand."""
    header = {
        "inputs": [{"name": "IMAGE_BYTES", "shape": [1, 1], "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(data) + 4}}],
        "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in outputs],
    }  # fmt: skip
    head = json.dumps(header).encode()
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/infer",
        data=head + struct.pack("<I", len(data)) + data,
        headers={"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        body = answer.read()
        json_length = int(answer.headers.get("Inference-Header-Content-Length", len(body)))
    reply, offset, result = json.loads(body[:json_length]), json_length, {}
    for output in reply["outputs"]:
        size = output["parameters"]["binary_data_size"]
        raw = body[offset : offset + size]
        offset += size
        result[output["name"]] = np.frombuffer(raw, HTTP_DTYPES[output["datatype"]]).reshape(output["shape"])
    return result


def grpc_infer(client: Any, model: str, data: bytes, outputs: list[str]) -> dict[str, np.ndarray]:
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs]
    result = client.infer(model, [tensor], outputs=requested, client_timeout=120)
    return {name: result.as_numpy(name) for name in outputs}


def grpc_client(server: EmbeddedServer) -> Any:
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(server.grpc_url)


# -- the steps ---------------------------------------------------------------------------------------


def pillow_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def pillow_resized_rgb(data: bytes) -> np.ndarray:
    """Pillow's decode resized by Pillow to the image's NaViT size: what the decode model returns."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    target = navit_target_size(image.width, image.height, PRESET)
    return np.asarray(image.resize((target.new_width, target.new_height), Image.Resampling.BICUBIC))


def served_decoded(client: Any, data: bytes) -> tuple[DecodedImage, str]:
    """The decode model's pixels of one image (at its NaViT size) as a host :class:`DecodedImage`
    of its stored size, and its path."""
    out = grpc_infer(client, DECODE, data, ["IMAGE", "IMAGE_SHAPES", "STORED_SIZES", "DECODE_PATH"])
    height, width, channels, _ = (int(v) for v in out["IMAGE_SHAPES"].reshape(-1, 4)[0])
    stored_height, stored_width = (int(v) for v in out["STORED_SIZES"].reshape(-1, 2)[0])
    pixels = out["IMAGE"].reshape(-1)[: height * width * channels].reshape(height, width, channels)
    path = out["DECODE_PATH"].reshape(-1)[0].decode()
    decoded = DecodedImage(np.ascontiguousarray(pixels), stored_width, stored_height, "bicubic", path)  # type: ignore[arg-type]
    return decoded, path


def expected_decode_path(kind: str, cpu_path: str) -> str:
    """What ``kimi_k25_decode`` must say for an image the CPU pipeline decodes by ``cpu_path``: on
    a GPU the exact route for what the CPU takes on a fast route (Pillow's stays Pillow's)."""
    return EXACT_GPU_PATH if kind == "gpu" and cpu_path != "pillow" else cpu_path


def step_outputs(server: EmbeddedServer, images: dict[str, bytes], kind: str) -> dict[str, Any]:
    client, rows, ok = grpc_client(server), [], True
    cpu_decoder = ImageDecoder("cpu")  # the CPU pipeline, in this process
    for name, data in images.items():
        decoded, path = served_decoded(client, data)
        reference = cpu_decoder.decode(data, PRESET)
        expected = preprocess_decoded(reference, PRESET)
        diff = np.abs(decoded.pixels.astype(np.int16) - pillow_resized_rgb(data).astype(np.int16))
        row: dict[str, Any] = {
            "image": name, "decode_path": path, "cpu_decode_path": reference.decode_path,
            "expected_decode_path": expected_decode_path(kind, reference.decode_path),
            "decode_vs_pillow": {"mean": float(diff.mean()), "max": int(diff.max())},
        }  # fmt: skip
        row["decode_path_ok"] = path == row["expected_decode_path"]
        row["decode_equal_pillow"] = int(diff.max()) == 0
        for protocol in ("http", "grpc"):
            if protocol == "http":
                served = http_infer(server.http_url, MODEL, data, ["PIXEL_VALUES", "GRID_THW"])
            else:
                served = grpc_infer(client, MODEL, data, ["PIXEL_VALUES", "GRID_THW"])
            row[f"{protocol}_equal_cpu_pipeline"] = bool(  # the served tensors have the batch dimension
                np.array_equal(served["PIXEL_VALUES"][0], expected.pixel_values)
                and np.array_equal(served["GRID_THW"].reshape(-1), expected.grid_thw)
            )
        checks = ("decode_path_ok", "decode_equal_pillow", "http_equal_cpu_pipeline", "grpc_equal_cpu_pipeline")
        ok &= all(row[check] for check in checks)
        rows.append(row)
    return {"passed": bool(ok), "images": rows}


def metric_lines(server: EmbeddedServer, prefix: str) -> list[str]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as answer:
        return [line for line in answer.read().decode().splitlines() if line.startswith(prefix)]


def step_zero_copy(server: EmbeddedServer, kind: str) -> dict[str, Any]:
    lines = [line for line in metric_lines(server, "kimi_prep_image_inputs_total{") if 'kimi_k25_preprocess' in line]
    memory = "cuda:" if kind == "gpu" else "cpu"
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in lines if f'device="{memory}' in line)
    elsewhere = sum(float(line.rsplit(" ", 1)[1]) for line in lines if f'device="{memory}' not in line)
    logged = [line for line in server.log_tail(400_000).splitlines() if "IMAGE input on cuda" in line]
    passed = counted > 0 and elsewhere == 0 and (bool(logged) or kind != "gpu")
    return {"passed": passed, "inputs_in_expected_memory": counted, "inputs_elsewhere": elsewhere,
            "metric_lines": lines, "log_lines": logged[:4]}  # fmt: skip


def gpu_process_mib() -> dict[int, float] | None:
    """pid -> MiB of every compute process (``nvidia-smi``), or None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    text = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    return {int(pid): float(mib) for pid, mib in (line.split(",") for line in text.strip().splitlines() if line)}


def step_hbm(out: Path, kind: str, images: dict[str, bytes], deadline: float) -> dict[str, Any]:
    if gpu_process_mib() is None:
        return {"skipped": "no nvidia-smi (CPU host)"}
    largest = max(images.values(), key=len)
    result: dict[str, Any] = {}
    for instances in (1, 2):
        if time.monotonic() > deadline - 60:
            result[f"instances_{instances}"] = {"skipped": "time box"}
            continue
        with start_server(out, kind, instances, f"hbm{instances}") as server:
            pids = set(server.process_tree())
            idle = {pid: mib for pid, mib in (gpu_process_mib() or {}).items() if pid in pids}
            grpc_infer(grpc_client(server), MODEL, largest, ["PIXEL_VALUES"])
            loaded = {pid: mib for pid, mib in (gpu_process_mib() or {}).items() if pid in pids}
        result[f"instances_{instances}"] = {
            "idle_mib": idle, "after_largest_mib": loaded,
            "idle_total_mib": sum(idle.values()), "after_largest_total_mib": sum(loaded.values()),
        }  # fmt: skip
    return result | {"passed": True}


def rate(call: Callable[[], object], seconds: float, concurrency: int) -> dict[str, float]:
    """Calls/s and p50/p99 latency ms of ``call`` kept ``concurrency`` deep for ``seconds``."""
    latencies: list[float] = []
    lock, stop_at = threading.Lock(), time.monotonic() + seconds

    def worker() -> None:
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            call()
            with lock:
                latencies.append((time.perf_counter() - start) * 1e3)

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    ordered = sorted(latencies)
    return {"per_s": len(ordered) / (time.monotonic() - start), "p50_ms": ordered[len(ordered) // 2],
            "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]}  # fmt: skip


def step_throughput(
    server: EmbeddedServer, images: dict[str, bytes], concurrency: int, seconds: float
) -> dict[str, Any]:
    items = list(images.values())
    cycle = itertools.cycle(items)  # shared by the worker threads: each call takes the next image

    def next_image() -> bytes:
        return next(cycle)

    clients = threading.local()

    def served(model: str, outputs: list[str]) -> Callable[[], object]:
        def call() -> object:
            if not hasattr(clients, "client"):
                clients.client = grpc_client(server)
            return grpc_infer(clients.client, model, next_image(), outputs)

        return call

    return {
        "passed": True, "concurrency": concurrency, "images": len(items),
        "ensemble_img_s": rate(served(MODEL, ["PIXEL_VALUES"]), seconds, concurrency),
        "decode_img_s": rate(served(DECODE, ["IMAGE"]), seconds, concurrency),
        "pillow_decode_in_process_img_s": rate(lambda: pillow_rgb(next_image()), seconds, concurrency),
    }  # fmt: skip


# -- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=330.0, help="the time box of all steps")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="per throughput measurement")
    parser.add_argument("--steps", nargs="+", default=list(STEP_COST_S), choices=list(STEP_COST_S))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    images = check_images()
    report: dict[str, Any] = {"kind": args.kind, "images": {n: len(d) for n, d in images.items()}, "steps": {}}

    def save() -> None:
        (args.out / "served_check.json").write_text(json.dumps(report, indent=2, default=str))

    with start_server(args.out, args.kind, 1, "main") as server:
        report["startup"] = "ready"
        for step in args.steps:
            if time.monotonic() + STEP_COST_S[step] > deadline:
                report["steps"][step] = {"skipped": "time box"}
                continue
            print(f"== served check: {step}", flush=True)
            started = time.monotonic()
            try:
                if step == "outputs":
                    result = step_outputs(server, images, args.kind)
                elif step == "zero_copy":
                    result = step_zero_copy(server, args.kind)
                elif step == "hbm":
                    result = step_hbm(args.out, args.kind, images, deadline)
                else:
                    result = step_throughput(server, images, args.concurrency, args.seconds)
            except Exception as exc:  # a step that breaks is a failed step; the others still run
                result = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
            result["seconds"] = round(time.monotonic() - started, 1)
            report["steps"][step] = result
            summary = {k: v for k, v in result.items() if k != "images"}
            print(json.dumps({step: summary}, default=str)[:2000], flush=True)
            save()
    save()
    failed = [name for name, result in report["steps"].items() if result.get("passed") is False]
    verdict = "FAILED " + ", ".join(failed) if failed else "passed"
    print(f"== served check: {verdict} ({args.out / 'served_check.json'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
