"""tritonserver's malloc, A/B: perf_analyzer on the pair with jemalloc in tritonserver vs glibc's (issue 11).

`kimi-prep serve --models kimi_k25_vision kimi_k25_vision_u8` at this host's layout, started
alternately as the launcher starts it (jemalloc in tritonserver where the host has it,
``allocator.server_allocator_env``; the stubs keep glibc's) and with glibc's malloc everywhere
(``LD_PRELOAD=``, the operator's opt-out), ``--rounds`` times. Each server gets perf_analyzer
(gRPC, concurrency 4, the benchmark photos) on the float32 wire with system shared memory and the
uint8 wire with and without; the in-process rate of the same output (the library on 2 threads)
is measured in each round, so every ratio compares within one round.

    .venv/bin/python benchmarks/bench_server_malloc.py [--rounds 3] [--out-dir bench_results]

Writes ``bench_server_malloc.json`` and ``.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_perf_analyzer import run_perf_analyzer
from photos import benchmark_photos
from plots import saved_axes

from kimi_vision_client.cli.front import perf_input_data
from kimi_vision_server.allocator import server_allocator_env
from kimi_vision_server.cli import bench_local
from kimi_vision_server.host import host_layout
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.repository import host_rendering

SERVED = ("kimi_k25_vision", "kimi_k25_vision_u8")
# (model, system shared memory, the in-process output it is compared with)
WIRES = (
    ("kimi_k25_vision", True, "pixel_values"),
    ("kimi_k25_vision_u8", True, "pixel_patches"),
    ("kimi_k25_vision_u8", False, "pixel_patches"),
)
# The launcher's environment for each malloc (an operator's LD_PRELOAD, even empty, wins).
ALLOCATORS: dict[str, dict[str, str]] = {"launcher's": {}, "glibc": {"LD_PRELOAD": ""}}


@contextlib.contextmanager
def launcher_environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in this process's environment while a server starts and runs (the launcher passes its
    environment on to tritonserver and, through the stub wrapper, to the stubs), removed after."""
    os.environ.update(env)
    try:
        yield
    finally:
        for name in env:
            del os.environ[name]


def wire_name(model: str, shm: bool) -> str:
    return f"{model}{' + shm' if shm else ''}"


def rows_of(rows: list[dict[str, Any]], model: str, shm: bool, allocator: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["wire"] == wire_name(model, shm) and r["allocator"] == allocator]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--perf-analyzer", type=Path, default=Path(".venv-perf/bin/perf_analyzer"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    if {"LD_PRELOAD", "MALLOC_CONF"} & set(os.environ):
        raise SystemExit("unset LD_PRELOAD / MALLOC_CONF: they would apply to both servers")
    if not server_allocator_env({}):
        raise SystemExit("no libjemalloc.so.2 on this host: both servers would run glibc's malloc")
    layout = host_layout()
    options = host_rendering(layout)
    images = bench_local.bench_images("kimi-k2.5", benchmark_photos())
    print(f"{layout.describe()}; {len(images)} photos", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.json"
        data.write_text(json.dumps(perf_input_data([im.data for im in images])))
        for round_index in range(args.rounds):
            local = {out: bench_local.throughput(images, "kimi-k2.5", 2, 3, output=out) for _, _, out in WIRES}
            for allocator, env in ALLOCATORS.items():
                with launcher_environment(env), EmbeddedServer(render=options, models=SERVED) as server:
                    for model, shm, output in WIRES:
                        served = run_perf_analyzer(
                            args.perf_analyzer, server.grpc_url, model, data, 4, shm, args.seconds
                        )
                        row = {"round": round_index, "allocator": allocator, "wire": wire_name(model, shm)}
                        row |= {"in_process_img_s": local[output], **served}
                        row["served_over_in_process"] = served["inferences_s"] / local[output]
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    print_table(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"layout": layout.describe(), "photos": len(images), "rows": rows}
    (args.out_dir / "bench_server_malloc.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out_dir / "bench_server_malloc.png")
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| wire | malloc | img/s per round | served / in-process per round | median ratio |")
    print("|---|---|---|---|---:|")
    for model, shm, _ in WIRES:
        for allocator in ALLOCATORS:
            mine = rows_of(rows, model, shm, allocator)
            rates = ", ".join(f"{r['inferences_s']:.1f}" for r in mine)
            ratios = [r["served_over_in_process"] for r in mine]
            listed = ", ".join(f"{x:.2f}x" for x in ratios)
            print(f"| {wire_name(model, shm)} | {allocator} | {rates} | {listed} | {statistics.median(ratios):.2f}x |")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    with saved_axes(path, (9, 4.5)) as ax:
        width = 0.8 / len(ALLOCATORS)
        for k, allocator in enumerate(ALLOCATORS):
            for i, (model, shm, _) in enumerate(WIRES):
                ratios = [r["served_over_in_process"] for r in rows_of(rows, model, shm, allocator)]
                x = [i + k * width] * len(ratios)
                ax.scatter(x, ratios, color=f"C{k}", label=allocator if i == 0 else None)
        ax.set_xticks([i + width / 2 for i in range(len(WIRES))], [wire_name(m, s) for m, s, _ in WIRES])
        ax.axhline(0.8, color="grey", linestyle="--", label="0.8x target")
        ax.set_ylabel("perf_analyzer img/s / in-process img/s")
        ax.set_title("tritonserver's malloc, the pair served, gRPC concurrency 4 (each round a dot)")
        ax.legend()


if __name__ == "__main__":
    sys.exit(main())
