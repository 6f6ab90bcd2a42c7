"""Memory of `kimi-prep serve` under load: PSS of tritonserver and its stubs at concurrency 16 (issue 11).

For each served selection (``kimi_k25_vision kimi_k25_vision_u8``, the default set, ``--all``) at
this host's layout (``host_layout``), a fresh rendering is started and kept at ``--concurrency``
gRPC requests in flight on ``kimi_k25_vision``: the benchmark photos (``photos.benchmark_photos``)
mixed with bad payloads (one in four: truncated photos, random bytes, text), which must fail with
INVALID_ARG while the good ones succeed. After ``--warmup`` seconds the PSS
(``/proc/PID/smaps_rollup``, shared pages counted once) of the whole process tree is sampled every
``--every`` seconds for ``--seconds``. Reported: the peak, the median, and the growth (peak of the
last third minus peak of the first third: a working set swings with what is in flight, a leak
raises every later peak). With each sample, the answers Triton has finished that the load generator
has not yet received (Triton's success count of the model minus the generator's, read one after
the other): a float32 answer waiting for its client is held twice by tritonserver's gRPC frontend
(the response message and its serialized copy, 2 x 37 MiB at the patch cap), so on this 2-core
host, where the client shares the cores, that backlog is most of tritonserver's memory under load.
The load generator's own CPU ms per request (this process's) says how much of the host it takes.
The first selection runs three times: as the launcher starts it
(jemalloc in tritonserver where the host has it, ``allocator.server_allocator_env``), with glibc's
malloc everywhere (``LD_PRELOAD=``), and with glibc's retention setting (``allocator.allocator_env``:
large buffers kept on the heap), so each allocator's cost in memory and its throughput are
measured at the same load. ``--photos corpus`` loads with the corpus photos and
their upscales only (smaller outputs than the camera photos, which all reach the patch cap).

    .venv/bin/python benchmarks/bench_load_memory.py [--seconds 60] [--warmup 20] [--out-dir bench_results]

Writes ``bench_load_memory.json`` and ``.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_idle_memory import pss_mib
from bench_perf_analyzer import model_stats
from bench_server_malloc import ALLOCATORS as SERVER_MALLOCS
from bench_server_malloc import launcher_environment
from photos import benchmark_photos, corpus_photos
from plots import saved_axes

from kimi_vision_server.allocator import allocator_env
from kimi_vision_server.host import host_layout
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.repository import RenderOptions, default_model_names, host_rendering

LOADED_MODEL = "kimi_k25_vision"
SELECTIONS: dict[str, tuple[str, ...] | None] = {
    "kimi_k25_vision kimi_k25_vision_u8": ("kimi_k25_vision", "kimi_k25_vision_u8"),
    "default": default_model_names(),
    "--all": None,
}


PHOTO_SETS = {"benchmark": benchmark_photos, "corpus": corpus_photos}
# bench_server_malloc's two, and glibc's retention setting everywhere.
ALLOCATORS = {**SERVER_MALLOCS, "glibc retention": {"LD_PRELOAD": "", **allocator_env()}}


def payloads(photos: str) -> list[tuple[bytes, bool]]:
    """(encoded bytes, good?): every photo of the set, and a bad payload after every third."""
    rng = np.random.default_rng(0)
    good = [data for _, data in PHOTO_SETS[photos]()]
    bad = [data[: len(data) // 3] for data in good[::3]]
    bad += [rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), b"not an image at all"]
    items = [(data, True) for data in good]
    for i, data in enumerate(bad):
        items.insert(4 * i + 3, (data, False))
    return items


def keep_loaded(
    url: str, concurrency: int, stop: threading.Event, tally: Counter[str], items: list[tuple[bytes, bool]]
) -> None:
    """``concurrency`` requests of ``items`` in flight on :data:`LOADED_MODEL` until ``stop``;
    tallies outcomes."""
    client = grpcclient.InferenceServerClient(url)
    slots = threading.Semaphore(concurrency)
    i = 0
    while not stop.is_set():
        data, good = items[i % len(items)]
        i += 1
        slots.acquire()
        tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))

        def done(result: object, error: object, good: bool = good) -> None:
            tally[f"{'good' if good else 'bad'} {'failed' if error else 'ok'}"] += 1
            slots.release()

        client.async_infer(LOADED_MODEL, [tensor], done)
    for _ in range(concurrency):  # the last responses
        slots.acquire()
    client.close()


def loaded_pss(options: RenderOptions, models: tuple[str, ...] | None, args: argparse.Namespace) -> dict[str, Any]:
    with EmbeddedServer(render=options, models=models) as server:
        return pss_under_load(server, args)


def pss_under_load(server: EmbeddedServer, args: argparse.Namespace) -> dict[str, Any]:
    """The PSS samples of ``server``'s processes under this benchmark's load (``args``: concurrency,
    photos, warmup, seconds, every), with the peak, median, growth and requests/s."""
    stop, tally = threading.Event(), Counter[str]()
    items = payloads(args.photos)
    load = threading.Thread(target=keep_loaded, args=(server.grpc_url, args.concurrency, stop, tally, items))
    # Triton's count starts with the server's own warm-up requests.
    answered_before = model_stats(server.http_url, LOADED_MODEL)["success"][0]
    load.start()
    time.sleep(args.warmup)
    start, served_before, cpu_before = time.monotonic(), sum(tally.values()), time.process_time()
    samples, times, waiting = [], [], []
    while time.monotonic() - start < args.seconds:
        samples.append(pss_mib(server.process_tree()))
        answered = model_stats(server.http_url, LOADED_MODEL)["success"][0] - answered_before
        waiting.append(answered - tally["good ok"])
        times.append(time.monotonic() - start)
        time.sleep(args.every)
    requests = sum(tally.values()) - served_before
    rate, load_cpu_s = requests / (time.monotonic() - start), time.process_time() - cpu_before
    stop.set()
    load.join()
    third = max(len(samples) // 3, 1)
    return {
        "models": len(server.model_names),
        "processes": len(server.process_tree()),
        "peak_pss_mib": max(samples),
        "median_pss_mib": statistics.median(samples),
        "growth_mib": max(samples[-third:]) - max(samples[:third]),
        "requests_s": rate,
        "load_cpu_ms_per_request": 1e3 * load_cpu_s / max(requests, 1),
        "answers_waiting_median": statistics.median(waiting),
        "answers_waiting_max": max(waiting),
        "outcomes": dict(tally),
        "samples_mib": samples,
        "sample_answers_waiting": waiting,
        "sample_times_s": times,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--photos", choices=list(PHOTO_SETS), default="benchmark")
    parser.add_argument("--selections", nargs="+", choices=list(SELECTIONS), default=list(SELECTIONS))
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    layout = host_layout()
    options = host_rendering(layout)
    print(f"{layout.describe()}; concurrency {args.concurrency} on {LOADED_MODEL}", flush=True)
    runs = [(selection, "launcher's") for selection in args.selections]
    runs[1:1] = [(args.selections[0], "glibc"), (args.selections[0], "glibc retention")]
    rows = []
    if {"MALLOC_CONF", *(name for env in ALLOCATORS.values() for name in env)} & set(os.environ):
        raise SystemExit("unset LD_PRELOAD / MALLOC_*: they would apply to every run")
    for selection, allocator in runs:
        with launcher_environment(ALLOCATORS[allocator]):
            row = {"selection": selection, "allocator": allocator, **loaded_pss(options, SELECTIONS[selection], args)}
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("sample")}), flush=True)
        rows.append(row)
    print(
        "\n| served | malloc | models | processes | peak PSS MiB | median | growth MiB | requests/s "
        "| answers waiting for the client: median / max | load generator CPU ms / request | outcomes |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(r["outcomes"].items()))
        print(
            f"| {r['selection']} | {r['allocator']} | {r['models']} | {r['processes']} | {r['peak_pss_mib']:.0f} | "
            f"{r['median_pss_mib']:.0f} | {r['growth_mib']:+.0f} | {r['requests_s']:.1f} | "
            f"{r['answers_waiting_median']:.0f} / {r['answers_waiting_max']:.0f} | "
            f"{r['load_cpu_ms_per_request']:.1f} | {outcomes} |"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"layout": layout.describe(), "concurrency": args.concurrency, "photos": args.photos, "rows": rows}
    (args.out_dir / "bench_load_memory.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out_dir / "bench_load_memory.png")
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    with saved_axes(path, (8, 4.5)) as ax:
        for r in rows:
            ax.plot(r["sample_times_s"], r["samples_mib"], label=f"{r['selection']} ({r['allocator']})")
        ax.axhline(1500 * 1000**2 / 1024**2, color="grey", linestyle="--", label="1.5 GB")
        ax.set_xlabel("seconds after warm-up")
        ax.set_ylabel("PSS, MiB (tritonserver + stubs)")
        ax.set_title(f"kimi-prep serve under load on {LOADED_MODEL}")
        ax.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
