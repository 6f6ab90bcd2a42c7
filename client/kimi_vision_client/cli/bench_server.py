"""``kimi-prep bench``: a client-side concurrency sweep against a running server.

For each concurrency level, that many threads (one :class:`KimiVisionClient` each, warmed up with
the largest images first so shared-memory regions never grow inside the timed window) send the
images round-robin, each thread one request at a time (a closed loop), for ``duration_s`` seconds
or ``requests`` requests in all. A level reports requests/s, images/s (successful requests: one
image each), MB/s of encoded input and of output as received (``PIXEL_VALUES`` float32, or
``PIXEL_PATCHES`` uint8 for a ``*_u8`` model, which the client then expands; plus the small
``GRID_THW`` / ``NUM_TOKENS``), mean and p50/p90/p99 latency and errors.
Triton's per-model statistics are read before and after each level; their difference splits the
server's time per request by model (ensemble, decode, preprocess) and phase (queue,
compute_input, compute_infer, compute_output). Writes ``bench_server.json`` and
``bench_server.png`` (throughput and latency vs concurrency) under ``out_dir``.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kimi_vision_common.errors import PreprocessError

from ..client import KimiVisionClient, Protocol, image_size, strip_scheme
from ..transport.adapters import ADAPTERS
from .samples import bench_photos

PHASES = ("queue", "compute_input", "compute_infer", "compute_output")
Image = tuple[str, bytes]  # (name, encoded bytes)


@dataclass
class BenchConfig:
    url: str
    protocol: Protocol = "grpc"
    model: str = "kimi_k25_vision"
    shm: bool = False
    concurrency: Sequence[int] = (1, 2, 4, 8)
    duration_s: float | None = 10.0  # per level; ignored when ``requests`` is set
    requests: int | None = None  # per level
    admin_key: str | None = None  # for shm registration against a server that restricts it


@dataclass
class Sample:
    latency_s: float
    bytes_in: int
    bytes_out: int
    error: str | None


@dataclass
class ModelSplit:
    """One model's share of a level: requests, executions and mean ms per request for each phase."""

    requests: int
    executions: int
    failed: int
    success_ms: float
    phases_ms: dict[str, float]


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    requests_s: float
    images_s: float
    mb_in_s: float
    mb_out_s: float
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    error_examples: list[str] = field(default_factory=list)
    server: dict[str, ModelSplit] = field(default_factory=dict)


# -- images ---------------------------------------------------------------------------------------


def default_images() -> list[Image]:
    """The generated camera-sized photos (:func:`~.samples.bench_photos`, bench-local's too)."""
    return list(bench_photos().items())


def warmup_images(images: Sequence[Image]) -> list[bytes]:
    """The largest input and the largest (by pixel area) image: after these, shm regions fit all."""
    largest_input = max(images, key=lambda im: len(im[1]))[1]
    largest_area = max(images, key=lambda im: _area(im[1]))[1]
    return list(dict.fromkeys((largest_input, largest_area)))


def _area(data: bytes) -> int:
    size = image_size(data)
    return size[0] * size[1] if size is not None else 0


# -- Triton statistics ----------------------------------------------------------------------------


def read_statistics(stats_client: Any, protocol: Protocol) -> dict[str, dict[str, int]]:
    """Cumulative counters of every model: ``inference_count``, ``execution_count``, ``<stat>_count``
    and ``<stat>_ns`` for success, fail and each phase (gRPC's JSON gives int64 as strings)."""
    options = {"as_json": True} if protocol == "grpc" else {}  # HTTP always answers JSON
    raw = stats_client.get_inference_statistics(**options)
    counters: dict[str, dict[str, int]] = {}
    for model in raw.get("model_stats", []):
        entry = {key: int(model.get(key, 0)) for key in ("inference_count", "execution_count")}
        for stat in ("success", "fail", *PHASES):
            duration = model.get("inference_stats", {}).get(stat, {})
            entry[f"{stat}_count"] = int(duration.get("count", 0))
            entry[f"{stat}_ns"] = int(duration.get("ns", 0))
        counters[model["name"]] = entry
    return counters


def settled_statistics(
    stats_client: Any, protocol: Protocol, interval_s: float = 0.05, timeout_s: float = 5.0
) -> dict[str, dict[str, int]]:
    """:func:`read_statistics` once two reads ``interval_s`` apart agree: Triton records a request's
    statistics after its response is sent, so a snapshot taken right after a response may lack it."""
    deadline = time.perf_counter() + timeout_s
    previous = read_statistics(stats_client, protocol)
    while True:
        time.sleep(interval_s)
        current = read_statistics(stats_client, protocol)
        if current == previous or time.perf_counter() >= deadline:
            return current
        previous = current


def statistics_split(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, ModelSplit]:
    """Per-model differences for the models that ran between the two snapshots."""
    split = {}
    for name, counters in after.items():
        delta = {key: value - before.get(name, {}).get(key, 0) for key, value in counters.items()}
        if delta["success_count"] or delta["fail_count"]:
            split[name] = ModelSplit(
                requests=delta["success_count"],
                executions=delta["execution_count"],
                failed=delta["fail_count"],
                success_ms=_mean_ms(delta, "success"),
                phases_ms={phase: _mean_ms(delta, phase) for phase in PHASES},
            )
    return split


def _mean_ms(delta: dict[str, int], stat: str) -> float:
    return delta[f"{stat}_ns"] / delta[f"{stat}_count"] / 1e6 if delta[f"{stat}_count"] else 0.0


# -- load generation ------------------------------------------------------------------------------


def closed_loop(
    client: KimiVisionClient, images: Sequence[Image], tickets: Callable[[], int], on_done: Callable[[], object]
) -> list[Sample]:
    """Send ``images[ticket % n]`` one at a time while ``tickets()`` returns a ticket (>= 0)."""
    samples = []
    while (ticket := tickets()) >= 0:
        data = images[ticket % len(images)][1]
        received = client.output_bytes_received
        start = time.perf_counter()
        try:
            client.infer(data)
            error = None
        except PreprocessError as exc:
            error = f"{type(exc).__name__}: {exc}"
        latency_s = time.perf_counter() - start
        samples.append(Sample(latency_s, len(data), client.output_bytes_received - received, error))
        on_done()
    return samples


def ticket_source(requests: int | None, duration_s: float | None) -> Callable[[], int]:
    """Ticket numbers 0, 1, ... until ``requests`` are handed out or ``duration_s`` has passed; then -1."""
    counter = itertools.count()
    deadline = time.perf_counter() + duration_s if requests is None and duration_s is not None else None

    def next_ticket() -> int:
        ticket = next(counter)  # atomic under the GIL
        if requests is not None and ticket >= requests:
            return -1
        if deadline is not None and time.perf_counter() >= deadline:
            return -1
        return ticket

    return next_ticket


def summarise(concurrency: int, samples: Sequence[Sample], wall_s: float) -> LevelResult:
    ok = [s for s in samples if s.error is None]
    latencies = np.array([s.latency_s * 1e3 for s in ok])
    p50, p90, p99 = (float(np.percentile(latencies, q)) for q in (50, 90, 99)) if ok else (None, None, None)
    errors = [s.error for s in samples if s.error is not None]
    return LevelResult(
        concurrency=concurrency,
        requests=len(samples),
        errors=len(errors),
        wall_s=wall_s,
        requests_s=len(samples) / wall_s,
        images_s=len(ok) / wall_s,
        mb_in_s=sum(s.bytes_in for s in ok) / wall_s / 1e6,
        mb_out_s=sum(s.bytes_out for s in ok) / wall_s / 1e6,
        mean_ms=float(latencies.mean()) if ok else None,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        error_examples=list(dict.fromkeys(errors))[:5],
    )


def run_level(
    config: BenchConfig, images: Sequence[Image], concurrency: int, stats_client: Any, quiet: bool
) -> LevelResult:
    """One concurrency level: warm the clients, snapshot statistics, run the closed loops, snapshot again."""
    from tqdm import tqdm

    clients = [
        KimiVisionClient(config.url, config.protocol, config.model, config.shm, admin_key=config.admin_key)
        for _ in range(concurrency)
    ]
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda c: c.infer_many(warmup_images(images), concurrency=1), clients))
            before = settled_statistics(stats_client, config.protocol)
            total = config.requests if config.requests is not None else None
            with tqdm(
                total=total,
                desc=f"concurrency {concurrency}",
                unit="req",
                file=sys.stderr,
                disable=quiet or not sys.stderr.isatty(),
            ) as progress:
                tickets = ticket_source(config.requests, config.duration_s)
                start = time.perf_counter()
                per_client = list(pool.map(lambda c: closed_loop(c, images, tickets, progress.update), clients))
                wall_s = time.perf_counter() - start
            after = settled_statistics(stats_client, config.protocol)
    finally:
        for client in clients:
            client.close()
    level = summarise(concurrency, [s for samples in per_client for s in samples], wall_s)
    level.server = statistics_split(before, after)
    return level


def sweep(
    config: BenchConfig, images: Sequence[Image], quiet: bool = False, report: Callable[[str], object] = print
) -> list[LevelResult]:
    """Every level of ``config.concurrency``, in order; ``report`` gets a line per level and its split."""
    stats_client = ADAPTERS[config.protocol]().connect(strip_scheme(config.url), 1)
    levels = []
    try:
        report(LEVEL_HEADER)
        for concurrency in config.concurrency:
            level = run_level(config, images, concurrency, stats_client, quiet)
            report(format_level(level))
            for line in format_split(level, config.model):
                report(line)
            levels.append(level)
    finally:
        stats_client.close()
    return levels


def best_level(levels: Sequence[LevelResult]) -> LevelResult:
    return max(levels, key=lambda level: level.images_s)


# -- reporting --------------------------------------------------------------------------------------

LEVEL_HEADER = "conc  requests  errors    req/s    img/s  MB/s in  MB/s out  mean ms   p50 ms   p90 ms   p99 ms"


def _ms(value: float | None) -> str:
    return f"{value:8.1f}" if value is not None else "       -"


def format_level(level: LevelResult) -> str:
    counts = f"{level.concurrency:4d}  {level.requests:8d}  {level.errors:6d}"
    rates = f"{level.requests_s:7.2f}  {level.images_s:7.2f}  {level.mb_in_s:7.2f}  {level.mb_out_s:8.1f}"
    latencies = " ".join(_ms(ms) for ms in (level.mean_ms, level.p50_ms, level.p90_ms, level.p99_ms))
    return f"{counts}  {rates} {latencies}"


def format_split(level: LevelResult, model: str) -> list[str]:
    """The level's server time per request by model (the benchmarked model first) and phase."""
    names = sorted(level.server, key=lambda name: (name != model, name))
    lines = []
    for name in names:
        split = level.server[name]
        batch = split.requests / split.executions if split.executions else 0.0
        phases = "  ".join(f"{phase} {ms:6.1f}" for phase, ms in split.phases_ms.items())
        lines.append(
            f"      {name:24s} {split.requests:5d} req (batch {batch:3.1f}, {split.failed} failed)"
            f"  total {split.success_ms:6.1f}  {phases}  ms/req"
        )
    return lines


def plot(series: dict[str, Sequence[LevelResult]], path: Path, title: str) -> None:
    """Images/s (left) and p50/p99 latency (right) against concurrency, one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, levels in series.items():
        x = [level.concurrency for level in levels]
        throughput.plot(x, [level.images_s for level in levels], marker="o", label=label)
        p50 = latency.plot(x, [level.p50_ms or np.nan for level in levels], marker="o", label=f"{label} p50")
        latency.plot(
            x,
            [level.p99_ms or np.nan for level in levels],
            marker="x",
            linestyle="--",
            color=p50[0].get_color(),
            label=f"{label} p99",
        )
    for ax, ylabel in ((throughput, "images/s (higher is better)"), (latency, "latency ms (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def jsonable(levels: Sequence[LevelResult]) -> list[dict[str, Any]]:
    return [asdict(level) for level in levels]


def run(
    config: BenchConfig,
    images: Sequence[Image] | None = None,
    out_dir: Path = Path("bench_results"),
    quiet: bool = False,
) -> dict[str, Any]:
    """Sweep, print, and write ``bench_server.json`` / ``bench_server.png`` under ``out_dir``."""
    images = list(images) if images is not None else default_images()
    levels = sweep(config, images, quiet)
    best = best_level(levels)
    print(f"best: {best.images_s:.2f} img/s at concurrency {best.concurrency}")
    result = {
        "config": asdict(config) | {"concurrency": list(config.concurrency)},
        "images": [{"name": name, "bytes": len(data)} for name, data in images],
        "levels": jsonable(levels),
        "best_concurrency": best.concurrency,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_server.json").write_text(json.dumps(result, indent=2))
    label = f"{config.protocol}{' + shm' if config.shm else ''}"
    plot({label: levels}, out_dir / "bench_server.png", f"kimi-prep bench: {config.model}")
    return result
