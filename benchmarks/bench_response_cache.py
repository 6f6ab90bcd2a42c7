"""Repeated images from Triton's response cache: a multi-turn chat trace against the same trace made
unique, on the uint8 and float32 image ensembles, with the cache as ``kimi-prep serve`` sets it up
and without one, the two servers running side by side and serving in turn, in one run.

The trace: ``--photos`` camera photos (``photos.camera_photos``), each sent ``--repeats`` times,
interleaved with new ones as a chat resends its earlier images with each new turn (request order:
photo 0; 1, 0; 2, 1, 0; ...). Its unique twin sends the same requests with a 4-byte JPEG comment
that differs per request (the same pixels and work, a different cache key). Every round tags its
requests with its own comment too, so each round starts with nothing of its own in the cache.
Requests go over gRPC, ``--chats`` at once; every answer is compared with the in-process pipeline
(bit-equal or counted as wrong). Each of ``--rounds`` starts both servers, warms them (see
:func:`warm_up_passes`) and runs each trace ``--passes`` times on each model, the servers taking
turns. Reported per model and configuration: requests/s (min/median of the passes), the ratios
(median of the ratios within a pass), the hit rate and tritonserver's own milliseconds a hit and
a miss from its metrics, and the peak PSS of each server's processes (``/proc/PID/smaps_rollup``)
sampled throughout.

    .venv/bin/python benchmarks/bench_response_cache.py [--rounds 3] [--passes 3] [--out-dir bench_results]

Writes ``bench_response_cache.json`` and ``.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_idle_memory import pss_mib
from bench_perf_analyzer import process_usage
from make_inputs import with_comment
from photos import camera_photos
from plots import saved_axes

from kimi_vision_prep import preprocess_bytes
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.blocks import SERVING_DEFAULTS
from kimi_vision_server.render.repository import host_rendering

MIB = 1 << 20
# model -> (output compared, the in-process output it equals)
MODELS = {"kimi_k25_vision_u8": ("PIXEL_PATCHES", "pixel_patches"), "kimi_k25_vision": ("PIXEL_VALUES", "pixel_values")}
PRESET = "kimi-k2.5"


def chat_trace(photos: int, repeats: int) -> list[int]:
    """Photo indices in request order: each new turn adds a photo and resends the ``repeats - 1``
    before it, so every photo is sent ``repeats`` times, the repeats interleaved with new ones."""
    return [i - k for i in range(photos + repeats - 1) for k in range(repeats) if 0 <= i - k < photos]


@dataclass
class Tally:
    exact: int = 0
    wrong: int = 0
    failed: int = 0


def replay(
    url: str, model: str, chats: list[list[tuple[bytes, int]]], expected: list[np.ndarray]
) -> tuple[float, Tally, float]:
    """Run the ``chats`` at once, each on its own gRPC connection and thread, its requests
    ((bytes, photo index)) one after the other as a chat's turns are; seconds, outcomes and the CPU
    seconds of the chats' threads. Each chat sends and receives through two system shared-memory
    regions of its own, as a client on the server's host does (``kimi-prep infer --shm``): a hit
    then costs what the server does for it, not gRPC's copies of a 1-3 MB photo and a 9.6 or 38 MB
    answer. The clock runs from the moment every chat is connected with its regions registered
    until the last answer is checked, as for clients that keep their connection and regions from
    turn to turn."""
    output = MODELS[model][0]
    in_bytes = max(len(data) for chat in chats for data, _ in chat) + 4  # + its length prefix
    out_bytes = max(e.nbytes for e in expected)
    tally = Tally()
    lock = threading.Lock()
    ready = threading.Barrier(len(chats) + 1)
    finished: list[float] = []
    cpu: list[float] = []

    def chat(index: int, items: list[tuple[bytes, int]]) -> None:
        client = grpcclient.InferenceServerClient(url)
        names = [f"bench_cache_{os.getpid()}_{index}_{part}" for part in ("in", "out")]
        regions = [
            shm.create_shared_memory_region(name, f"/{name}", size)
            for name, size in zip(names, (in_bytes, out_bytes), strict=True)
        ]
        for name, size in zip(names, (in_bytes, out_bytes), strict=True):
            client.register_system_shared_memory(name, f"/{name}", size)
        try:
            ready.wait()
            cpu_start = time.thread_time()
            for data, photo in items:
                serialized = serialize_byte_tensor(np.array([[data]], dtype=np.object_))
                shm.set_shared_memory_region(regions[0], [serialized])
                tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
                tensor.set_shared_memory(names[0], serialized_byte_size(serialized))
                wanted = grpcclient.InferRequestedOutput(output)
                wanted.set_shared_memory(names[1], out_bytes)
                try:
                    result = client.infer(model, [tensor], outputs=[wanted])
                except InferenceServerException:
                    with lock:
                        tally.failed += 1
                    continue
                shape = result.get_output(output).shape
                answer = shm.get_contents_as_numpy(regions[1], expected[photo].dtype, shape)[0]
                equal = bit_equal(answer, expected[photo])
                with lock:
                    tally.exact += equal
                    tally.wrong += not equal
            finished.append(time.perf_counter())
            cpu.append(time.thread_time() - cpu_start)
        finally:
            for name in names:
                for _ in range(100):  # Triton lets go of a region shortly after the last response
                    try:
                        client.unregister_system_shared_memory(name)
                        break
                    except InferenceServerException:
                        time.sleep(0.05)
            for region in regions:
                shm.destroy_shared_memory_region(region)
            client.close()

    with ThreadPoolExecutor(len(chats)) as pool:
        done = [pool.submit(chat, index, items) for index, items in enumerate(chats)]
        ready.wait()
        start = time.perf_counter()
        for future in done:
            future.result()
    return max(finished) - start, tally, sum(cpu)


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same bytes: compared eight at a time (the client's check shares
    the server's cores, so it is kept cheap)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    whole = a.size - a.size % 8
    return np.array_equal(a[:whole].view(np.uint64), b[:whole].view(np.uint64)) and np.array_equal(a[whole:], b[whole:])


CACHE_METRICS = {
    "hits": "nv_cache_num_hits_per_model",
    "misses": "nv_cache_num_misses_per_model",
    "hit_us": "nv_cache_hit_duration_per_model",
    "miss_us": "nv_cache_miss_duration_per_model",
}


def cache_counts(metrics_url: str) -> dict[str, dict[str, float]]:
    """Triton's cache counters per model (absent without a cache): hits, misses, and the
    microseconds spent on them (a miss: the lookup plus the insertion)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts: dict[str, dict[str, float]] = {}
    for key, name in CACHE_METRICS.items():
        for model, value in re.findall(rf'^{name}{{model="([^"]*)",version="1"}} (\S+)', text, re.M):
            counts.setdefault(model, dict.fromkeys(CACHE_METRICS, 0.0))[key] = float(value)
    return counts


def counts_between(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    return {m: {k: v - before.get(m, {}).get(k, 0.0) for k, v in c.items()} for m, c in after.items()}


class PeakPss:
    """The peak PSS (MiB) of tritonserver and its stubs, sampled every ``every_s`` while open."""

    def __init__(self, pids: Callable[[], list[int]], every_s: float = 0.2) -> None:
        self.pids, self.every_s, self.peak_mib = pids, every_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                pids = self.pids()
            except OSError:  # a process left while the tree was read: the next sample
                continue
            self.peak_mib = max(self.peak_mib, pss_mib(pids))

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def serve(cache_bytes: int) -> EmbeddedServer:
    """The two image ensembles as ``kimi-prep serve`` renders them on this host, with a response
    cache of ``cache_bytes`` (0: none)."""
    options = host_rendering()
    return EmbeddedServer(render=options, models=tuple(MODELS), response_cache_bytes=cache_bytes)


class Tags:
    """Fresh 4-byte comment tags: a round's repeated requests share one per photo, unique ones get one each."""

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last += 1
        return self.last


def chat_requests(
    photos: list[bytes], chats: int, repeats: int, unique: bool, tags: Tags
) -> list[list[tuple[bytes, int]]]:
    """The chats' requests: photo i belongs to chat ``i % chats``, and each chat sends its photos as
    :func:`chat_trace` says; tagged fresh per photo (repeated) or per request (unique)."""
    per_photo = [tags.next() for _ in photos]
    out = []
    for c in range(chats):
        mine = list(range(c, len(photos), chats))
        requests = []
        for local in chat_trace(len(mine), repeats):
            photo = mine[local]
            tag = tags.next() if unique else per_photo[photo]
            requests.append((with_comment(photos[photo], tag.to_bytes(4, "big")), photo))
        out.append(requests)
    return out


@dataclass
class Runs:
    """Requests/s of every round of one (configuration, model, trace), outcomes, cache counts."""

    rates: list[float]
    tally: Tally
    server_cpu_ms: list[float] = field(default_factory=list)  # per request, each pass
    client_cpu_ms: list[float] = field(default_factory=list)
    hits: float = 0.0
    misses: float = 0.0
    hit_us: float = 0.0
    miss_us: float = 0.0

    def add(
        self, rate: float, tally: Tally, cache: dict[str, float] | None, server_cpu_ms: float, client_cpu_ms: float
    ) -> None:
        self.rates.append(rate)
        self.server_cpu_ms.append(server_cpu_ms)
        self.client_cpu_ms.append(client_cpu_ms)
        for outcome in vars(tally):
            setattr(self.tally, outcome, getattr(self.tally, outcome) + getattr(tally, outcome))
        if cache:
            for key in CACHE_METRICS:
                setattr(self, key, getattr(self, key) + cache[key])

    def summary(self) -> dict[str, Any]:
        return {
            "rps_min": min(self.rates),
            "rps_median": statistics.median(self.rates),
            "server_cpu_ms_median": statistics.median(self.server_cpu_ms),
            "client_cpu_ms_median": statistics.median(self.client_cpu_ms),
            "rounds": self.rates,
            **vars(self.tally),
            "hits": self.hits,
            "misses": self.misses,
            "ms_per_hit": self.hit_us / 1e3 / max(1.0, self.hits),
            "ms_per_miss": self.miss_us / 1e3 / max(1.0, self.misses),
        }


def one_round(
    servers: dict[str, EmbeddedServer],
    photos: list[bytes],
    expected: dict[str, list[np.ndarray]],
    *,
    runs: dict[str, dict[tuple[str, str], Runs]],
    args: argparse.Namespace,
    tags: Tags,
) -> None:
    """Both traces on both models, ``args.passes`` times, against each of ``servers`` (running
    side by side, one serving at a time) in turn, after warm-up passes of unique requests."""
    for model, (_, out) in MODELS.items():
        for server in servers.values():
            for _ in range(warm_up_passes(expected[out], args.repeats)):
                chats = chat_requests(photos, args.chats, args.repeats, True, tags)
                replay(server.grpc_url, model, chats, expected[out])
        for _ in range(args.passes):
            for kind in ("unique", "repeated"):
                for name, server in servers.items():
                    chats = chat_requests(photos, args.chats, args.repeats, kind == "unique", tags)
                    requests = sum(map(len, chats))
                    before, server_cpu = cache_counts(server.metrics_url), cpu_s(server)
                    seconds, tally, client_cpu = replay(server.grpc_url, model, chats, expected[out])
                    server_ms = 1e3 * (cpu_s(server) - server_cpu) / requests
                    cache = counts_between(before, cache_counts(server.metrics_url)).get(model)
                    run = runs[name].setdefault((model, kind), Runs([], Tally()))
                    run.add(requests / seconds, tally, cache, server_ms, 1e3 * client_cpu / requests)


def cpu_s(server: EmbeddedServer) -> float:
    """CPU seconds so far of tritonserver and its stubs."""
    return sum(seconds for seconds, _ in process_usage(server.process_tree()).values())


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the ratios of rates measured in the same pass (side by side in time)."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def warm_up_passes(expected: list[np.ndarray], repeats: int) -> int:
    """Unique passes whose answers fill the default cache at least once, plus one: each page of its
    arena is then touched, as on a long-running server. (A fresh arena's first touch costs a miss
    several milliseconds of page faults; measured, that is the first hours of a server, not its
    state.) The server without a cache gets the same passes."""
    pass_bytes = repeats * sum(e.nbytes for e in expected)
    return -(-SERVING_DEFAULTS.response_cache_bytes // pass_bytes) + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--chats", type=int, default=4, help="chats at once (the requests in flight)")
    parser.add_argument("--rounds", type=int, default=3, help="starts of the two servers")
    parser.add_argument("--passes", type=int, default=3, help="passes of each trace per start, alternating servers")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()

    photos = [data for _, data in camera_photos()[: args.photos]]
    expected = {
        out: [getattr(preprocess_bytes(p, PRESET, output=out), out) for p in photos] for _, out in MODELS.values()
    }
    configurations = {"no cache": 0, "cache": SERVING_DEFAULTS.response_cache_bytes}
    runs: dict[str, dict[tuple[str, str], Runs]] = {c: {} for c in configurations}
    peak_pss = dict.fromkeys(configurations, 0.0)
    tags = Tags()
    for _ in range(args.rounds):
        with contextlib.ExitStack() as stack:
            servers = {name: stack.enter_context(serve(size)) for name, size in configurations.items()}
            samplers = {name: stack.enter_context(PeakPss(s.process_tree)) for name, s in servers.items()}
            one_round(servers, photos, expected, runs=runs, args=args, tags=tags)
        for name, sampler in samplers.items():
            peak_pss[name] = max(peak_pss[name], sampler.peak_mib)
    rows = []
    for model in MODELS:
        cached, plain = runs["cache"], runs["no cache"]
        repeated, unique = cached[(model, "repeated")], cached[(model, "unique")]
        unique_plain = plain[(model, "unique")]
        rows.append({
            "model": model,
            "repeated_over_unique": paired_ratio(repeated.rates, unique.rates),
            "unique_cache_over_no_cache": paired_ratio(unique.rates, unique_plain.rates),
            "server_cpu_unique_over_repeated": paired_ratio(unique.server_cpu_ms, repeated.server_cpu_ms),
            "hit_rate": repeated.hits / max(1.0, repeated.hits + repeated.misses),
            "runs": {f"{c} {k}": r.summary() for c in configurations for (m, k), r in runs[c].items() if m == model},
        })  # fmt: skip
    report = {
        "photos": args.photos, "repeats": args.repeats, "chats": args.chats,
        "rounds": args.rounds, "passes": args.passes,
        "cache_bytes": SERVING_DEFAULTS.response_cache_bytes, "peak_pss_mib": peak_pss, "rows": rows,
    }  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_response_cache.json").write_text(json.dumps(report, indent=1))
    print(markdown(report))
    plot(report, args.out_dir / "bench_response_cache.png")
    return 0


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| model | trace | no cache req/s (min / median) | cache req/s (min / median) | hit rate "
        "| exact / wrong / failed |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        for kind in ("unique", "repeated"):
            plain, cached = row["runs"][f"no cache {kind}"], row["runs"][f"cache {kind}"]
            hit_rate = cached["hits"] / max(1.0, cached["hits"] + cached["misses"])
            outcome = "/".join(str(plain[f] + cached[f]) for f in ("exact", "wrong", "failed"))
            lines.append(
                f"| {row['model']} | {kind} | {plain['rps_min']:.1f} / {plain['rps_median']:.1f} | "
                f"{cached['rps_min']:.1f} / {cached['rps_median']:.1f} | {hit_rate:.0%} | {outcome} |"
            )
    lines.append("")
    for row in report["rows"]:
        repeated, unique = row["runs"]["cache repeated"], row["runs"]["cache unique"]
        lines.append(
            f"{row['model']}: repeated / unique with the cache {row['repeated_over_unique']:.2f}x; "
            f"unique with / without it {row['unique_cache_over_no_cache']:.2f}x; tritonserver's cache "
            f"{repeated['ms_per_hit']:.2f} ms a hit, {unique['ms_per_miss']:.2f} ms a miss; server CPU ms a request "
            f"unique {unique['server_cpu_ms_median']:.1f}, repeated {repeated['server_cpu_ms_median']:.1f} "
            f"({row['server_cpu_unique_over_repeated']:.2f}x), client CPU ms a request "
            f"{unique['client_cpu_ms_median']:.1f} / {repeated['client_cpu_ms_median']:.1f}"
        )
    pss = ", ".join(f"{name} {mib:.0f} MiB" for name, mib in report["peak_pss_mib"].items())
    lines.append(f"peak PSS of tritonserver and its stubs: {pss}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    with saved_axes(path, (7, 4)) as ax:
        labels, values = [], []
        for row in report["rows"]:
            for key in ("no cache unique", "no cache repeated", "cache unique", "cache repeated"):
                labels.append(f"{row['model'].removeprefix('kimi_k25_')}\n{key}")
                values.append(row["runs"][key]["rps_median"])
        ax.bar(range(len(values)), values)
        ax.set_xticks(range(len(values)), labels, fontsize=6)
        ax.set_ylabel("requests/s (median of rounds)")
        ax.set_title(f"chat trace: {report['photos']} photos x {report['repeats']}, {report['chats']} chats at once")


if __name__ == "__main__":
    sys.exit(main())
