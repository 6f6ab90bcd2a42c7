"""Peak memory of the default `kimi-prep serve` under hostile concurrent load, next to its bound.

The server is rendered as `kimi-prep serve` renders it on this host (the default model set, the
host's layout). For ``--seconds`` it receives at once, from threads that never stop:

- ``--heavy`` clients each sending the largest request the defaults accept to ``kimi_k3_vision``,
  asking for float32 PIXEL_VALUES: K solid-colour JPEGs at Pillow's bomb limit's edge, as many as
  the patch budget allows (a few KB each on the wire, ~2.6 GB of pixels decoded a request), over
  gRPC, each request's bytes made new by a comment, so that none is answered from tritonserver's
  response cache (``--response-cache-mib``, as `kimi-prep serve` starts it on loopback) and every
  answer goes into it;
- ``--over`` clients sending requests over the budget (K = 16 of them) and aliasing layouts to the
  patchify steps (refused; they must stay cheap);
- ``--slow`` raw HTTP connections that each send a heavy request and never read the answer.

The PSS of tritonserver and its stubs (``/proc/PID/smaps_rollup``) is sampled throughout; then the
load stops, the slow connections close, and the server must answer a photo exactly again.
Prints one JSON row and a Markdown line, writes ``bench_hostile_memory.json`` / ``.png``.

    .venv/bin/python benchmarks/bench_hostile_memory.py [--seconds 60] [--out-dir bench_results]
"""

from __future__ import annotations

import argparse
import functools
import io
import itertools
import json
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_idle_memory import pss_mib
from make_inputs import with_comment
from PIL import Image
from plots import saved_axes
from tritonclient.utils import InferenceServerException

from kimi_vision_common.sizing import navit_target_size
from kimi_vision_prep import KIMI_K3, preprocess_bytes
from kimi_vision_prep.limits import PILLOW_MAX_PIXELS
from kimi_vision_server.host import host_layout
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.blocks import SERVING_DEFAULTS
from kimi_vision_server.render.repository import default_model_names, host_rendering

MODEL = "kimi_k3_vision"
BOUND_MIB = 4096  # docs/security.md: the default serve on a 2-core, 24 GB host


def solid_jpeg(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (120, 80, 40)).save(buffer, "JPEG", quality=30)
    return buffer.getvalue()


def heaviest_request() -> list[bytes]:
    """As many of the largest square image the decoder takes as one request's budget allows."""
    side = int(PILLOW_MAX_PIXELS**0.5)
    each = navit_target_size(side, side, KIMI_K3).num_patches
    count = max(1, SERVING_DEFAULTS.patch_budget(KIMI_K3) // each)
    return [solid_jpeg(side)] * count


def image_bytes_input(module: Any, images: list[bytes]) -> Any:
    tensor = module.InferInput("IMAGE_BYTES", [1, len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array([images], dtype=np.object_))
    return tensor


def heavy_request(images: list[bytes], tags: Iterator[int]) -> list[tuple[str, list[Any]]]:
    """The heaviest request with other bytes each time (a comment in its first image), so that every
    one misses the response cache, is decoded, and its 308 MB answer goes into the cache."""
    return [
        (MODEL, [image_bytes_input(grpcclient, [with_comment(images[0], next(tags).to_bytes(8, "big")), *images[1:]])])
    ]


def keep_sending(
    url: str, stop: threading.Event, tally: Counter[str], requests: Callable[[], list[tuple[str, list[Any]]]]
) -> None:
    """Send ``requests()`` (model, inputs) after one another until ``stop``; tallies outcomes."""
    client = grpcclient.InferenceServerClient(url)
    try:
        while not stop.is_set():
            for model, inputs in requests():
                outputs = [grpcclient.InferRequestedOutput("PIXEL_VALUES")]
                try:
                    client.infer(model, inputs, outputs=outputs, client_timeout=600)
                    tally[f"{model} ok"] += 1
                except InferenceServerException as exc:
                    tally[f"{model} {exc.status()}"] += 1
    finally:
        client.close()


def slow_reader(http_url: str, images: list[bytes]) -> socket.socket:
    """A connection that sends one heavy request over HTTP and never reads the answer."""
    outputs = [httpclient.InferRequestedOutput("PIXEL_VALUES", binary_data=True)]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        [image_bytes_input(httpclient, images)], outputs=outputs
    )
    host, port = http_url.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    head = (
        f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: {http_url}\r\nContent-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {json_size}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def hostile_requests() -> list[tuple[str, list[Any]]]:
    """Over the budget (refused from the headers) and an aliasing layout (refused by the step)."""
    over = [solid_jpeg(4000)] * 16
    side = 2000
    image = np.zeros((1, side * side * 3), np.uint8)
    shapes = np.array([[[side, side, 3, 0]] * 16], np.int64)
    aliasing = [
        grpcclient.InferInput("IMAGE", list(image.shape), "UINT8"),
        grpcclient.InferInput("IMAGE_SHAPES", [1, 16, 4], "INT64"),
    ]
    aliasing[0].set_data_from_numpy(image)
    aliasing[1].set_data_from_numpy(shapes)
    return [(MODEL, [image_bytes_input(grpcclient, over)]), ("kimi_k3_patchify", aliasing)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = host_layout()
    options = host_rendering(layout)
    heavy = heaviest_request()
    cache_bytes = args.response_cache_mib << 20
    with EmbeddedServer(render=options, models=default_model_names(), response_cache_bytes=cache_bytes) as server:
        idle = pss_mib(server.process_tree())
        stop, tally = threading.Event(), Counter[str]()
        tags = itertools.count()  # shared by the heavy clients (next() on a count is atomic under the GIL)
        refused = hostile_requests()
        threads = [
            threading.Thread(
                target=keep_sending, args=(server.grpc_url, stop, tally, functools.partial(heavy_request, heavy, tags))
            )
            for _ in range(args.heavy)
        ] + [
            threading.Thread(target=keep_sending, args=(server.grpc_url, stop, tally, lambda: refused))
            for _ in range(args.over)
        ]
        for thread in threads:
            thread.start()
        slow = [slow_reader(server.http_url, heavy) for _ in range(args.slow)]
        samples, times, start = [], [], time.monotonic()
        while time.monotonic() - start < args.seconds:
            samples.append(pss_mib(server.process_tree()))
            times.append(time.monotonic() - start)
            time.sleep(args.every)
        stop.set()
        for thread in threads:
            thread.join()
        for sock in slow:
            sock.close()
        time.sleep(args.settle)
        after = pss_mib(server.process_tree())
        photo = (Path(__file__).resolve().parent / "data" / "exif-samples" / "jolla.jpg").read_bytes()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            result = client.infer(MODEL, [image_bytes_input(grpcclient, [photo])])
        finally:
            client.close()
        exact = result.as_numpy("PIXEL_VALUES")[0].tobytes() == preprocess_bytes(photo, KIMI_K3).pixel_values.tobytes()
        return {
            "layout": layout.describe(),
            "heavy_request": {"images": len(heavy), "encoded_bytes": sum(map(len, heavy))},
            "clients": {"heavy": args.heavy, "over_budget_and_aliasing": args.over, "slow_readers": args.slow},
            "idle_pss_mib": idle,
            "peak_pss_mib": max(samples),
            "median_pss_mib": statistics.median(samples),
            "after_pss_mib": after,
            "bound_mib": BOUND_MIB,
            "response_cache_mib": args.response_cache_mib,
            "exact_after": exact,
            "alive_after": server.is_ready(),
            "outcomes": dict(tally),
            "samples_mib": samples,
            "sample_times_s": times,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=0.25)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the load before 'after'")
    parser.add_argument("--heavy", type=int, default=4, help="clients sending the heaviest accepted request")
    parser.add_argument("--over", type=int, default=2, help="clients sending refused requests")
    parser.add_argument("--slow", type=int, default=2, help="connections that never read their answer")
    parser.add_argument(
        "--response-cache-mib",
        type=int,
        default=SERVING_DEFAULTS.response_cache_bytes >> 20,
        help="tritonserver's response cache, as kimi-prep serve starts it on loopback (0: none)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    row = run(args)
    print(json.dumps({k: v for k, v in row.items() if not k.startswith("sample")}), flush=True)
    print("\n| peak PSS MiB | median | idle | after | bound | exact after |")
    print("|---:|---:|---:|---:|---:|---|")
    print(
        f"| {row['peak_pss_mib']:.0f} | {row['median_pss_mib']:.0f} | {row['idle_pss_mib']:.0f} | "
        f"{row['after_pss_mib']:.0f} | {row['bound_mib']} | {row['exact_after']} |"
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_hostile_memory.json").write_text(json.dumps(row, indent=1))
    with saved_axes(args.out_dir / "bench_hostile_memory.png", (8, 4)) as axes:
        axes.plot(row["sample_times_s"], row["samples_mib"], label="server PSS (MiB)")
        axes.axhline(row["bound_mib"], color="red", linestyle="--", label="documented bound")
        axes.set_xlabel("seconds under hostile load")
        axes.set_ylabel("MiB")
        axes.legend()
    return 0 if row["peak_pss_mib"] <= row["bound_mib"] and row["exact_after"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
