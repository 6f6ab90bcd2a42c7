"""The stubs' scratch arena, A/B: perf_analyzer on the pair with ``scratch_cap_bytes`` 0 vs the default (issue 11).

`kimi-prep serve --models kimi_k25_vision kimi_k25_vision_u8` at this host's layout, rendered
alternately as rendered (the models that return pixels keep a 64 MiB
arena: each request's output lands on the last one's pages) and with ``scratch_cap_bytes`` 0
(every request's outputs on fresh pages), ``--rounds`` times. Each server gets perf_analyzer
(gRPC, concurrency 4, the benchmark photos) on the float32 and uint8 wires with system shared
memory; each row records img/s and, from ``/proc``, the server's CPU ms and minor page faults per
request by process (``bench_perf_analyzer.measured_run``): the faults show the mechanism, the CPU
time its cost, both steadier than img/s on a shared host. Then the same server gets
``bench_load_memory``'s load (gRPC concurrency 16 on ``kimi_k25_vision``, good and bad photos):
the PSS peak and median of what the arena keeps.

    .venv/bin/python benchmarks/bench_stub_arena.py [--rounds 2] [--out-dir bench_results]

Writes ``bench_stub_arena.json`` and ``.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load_memory import pss_under_load
from bench_perf_analyzer import measured_run
from bench_server_malloc import wire_name
from photos import benchmark_photos
from plots import saved_axes

from kimi_vision_client.cli.front import perf_input_data
from kimi_vision_server.cli import bench_local
from kimi_vision_server.host import host_layout
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.blocks import SERVING_DEFAULTS
from kimi_vision_server.render.repository import host_rendering, render_repository
from kimi_vision_server.settings import Rendering, setting

SERVED = ("kimi_k25_vision", "kimi_k25_vision_u8")
WIRES = (("kimi_k25_vision", True), ("kimi_k25_vision_u8", True))  # (model, system shared memory)
# The pixel models' scratch cap as rendered (None) and turned off in the rendered configs (0).
SERVED_CAP = setting("scratch_cap_bytes").rendered(Rendering("preprocess", threads=0, patch_budget=0))
ARENAS: dict[str, int | None] = {f"{SERVED_CAP >> 20} MiB (default)": None, "0": 0}  # type: ignore[operator]
SCRATCH = re.compile(r'(key: "scratch_cap_bytes" value: \{ string_value: )"\d+"')


def with_scratch_cap(repository: Path, cap: int | None) -> Path:
    """``repository`` with every ``scratch_cap_bytes`` set to ``cap`` (None: as rendered)."""
    if cap is not None:
        for config in repository.glob("*/config.pbtxt"):
            config.write_text(SCRATCH.sub(rf'\1"{cap}"', config.read_text()))
    return repository


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--perf-analyzer", type=Path, default=Path(".venv-perf/bin/perf_analyzer"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    # bench_load_memory's load, in pss_under_load's names
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--load-seconds", dest="load_seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    layout = host_layout()
    options = host_rendering(layout)
    images = bench_local.bench_images("kimi-k2.5", benchmark_photos())
    print(f"{layout.describe()}; {len(images)} photos", flush=True)
    rows: list[dict[str, Any]] = []
    memories: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.json"
        data.write_text(json.dumps(perf_input_data([im.data for im in images])))
        for round_index in range(args.rounds):
            for arena, cap in ARENAS.items():
                folder = Path(tmp) / f"round{round_index}-scratch{cap}"
                repository = with_scratch_cap(render_repository(folder, options, SERVING_DEFAULTS, SERVED), cap)
                with EmbeddedServer(repository) as server:
                    for model, shm in WIRES:
                        served = measured_run(server, args.perf_analyzer, model, data, 4, shm, args.seconds, [model])
                        row = {"round": round_index, "arena": arena, "wire": wire_name(model, shm), **served}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                    load = argparse.Namespace(**{**vars(args), "seconds": args.load_seconds, "photos": "benchmark"})
                    memory = {"round": round_index, "arena": arena, "wire": "memory"} | pss_under_load(server, load)
                    print(json.dumps({k: v for k, v in memory.items() if not k.startswith("sample")}), flush=True)
                    memories.append(memory)
    print_table(rows, memories)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"layout": layout.describe(), "photos": len(images), "rows": rows, "memory": memories}
    (args.out_dir / "bench_stub_arena.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out_dir / "bench_stub_arena.png")
    return 0


def rows_of(rows: list[dict[str, Any]], wire: str, arena: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["wire"] == wire and r["arena"] == arena]


def print_table(rows: list[dict[str, Any]], memories: list[dict[str, Any]]) -> None:
    print("\n| wire | stub arena | img/s per round | server CPU ms / request per round | median CPU ms "
          "| preprocess stubs' minor faults / request |")  # fmt: skip
    print("|---|---|---|---|---:|---|")
    for model, shm in WIRES:
        for arena in ARENAS:
            mine = rows_of(rows, wire_name(model, shm), arena)
            rates = ", ".join(f"{r['inferences_s']:.1f}" for r in mine)
            cpu = [r["server_cpu_ms"] for r in mine]
            faults = ", ".join(f"{r['minor_faults_by_process']['kimi_k25_preprocess']:.0f}" for r in mine)
            listed, median = ", ".join(f"{x:.1f}" for x in cpu), statistics.median(cpu)
            print(f"| {wire_name(model, shm)} | {arena} | {rates} | {listed} | {median:.1f} | {faults} |")
    print("\n| stub arena | peak PSS MiB per round | median PSS MiB per round | requests/s per round |")
    print("|---|---|---|---|")
    for arena in ARENAS:
        mine = [m for m in memories if m["arena"] == arena]
        columns = [", ".join(f"{m[key]:.{digits}f}" for m in mine) for key, digits in (
            ("peak_pss_mib", 0), ("median_pss_mib", 0), ("requests_s", 1))]  # fmt: skip
        print(f"| {arena} | {' | '.join(columns)} |")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    with saved_axes(path, (9, 4.5)) as ax:
        width = 0.8 / len(ARENAS)
        for k, arena in enumerate(ARENAS):
            for i, (model, shm) in enumerate(WIRES):
                cpu = [r["server_cpu_ms"] for r in rows_of(rows, wire_name(model, shm), arena)]
                ax.scatter([i + k * width] * len(cpu), cpu, color=f"C{k}", label=arena if i == 0 else None)
        ax.set_xticks([i + width / 2 for i in range(len(WIRES))], [wire_name(m, s) for m, s in WIRES])
        ax.set_ylabel("server CPU ms per request (tritonserver + stubs)")
        ax.set_title("the stubs' scratch arena, the pair served, gRPC concurrency 4 (each round a dot)")
        ax.legend()


if __name__ == "__main__":
    sys.exit(main())
