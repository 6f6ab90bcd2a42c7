"""Served vs in-process throughput of ``kimi_k25_vision`` (ensembles on float32 and uint8 wires, and the fused
single model) on this host, in one run.

In-process: ``bench_local.throughput`` (``preprocess_bytes`` on 2 threads, best of rounds). Served:
the embedded tritonserver started per server setting (instances of every model, the decode,
preprocess and fused models' ``numba_threads``, the decode and fused models' ``codec_threads``
and ``cpu_decode_threads``), swept
with ``bench_server`` over gRPC with and without shared memory, each on three models: the float32
``PIXEL_VALUES`` ensemble (``kimi_k25_vision``), the uint8 ``PIXEL_PATCHES`` ensemble
(``kimi_k25_vision_u8``, expanded into the same float32 ``pixel_values`` by the client, inside the
measured latency) and ``kimi_k25_vision_fused_u8`` (decode + preprocess in one Python model, no
ensemble hop; the client reads its uint8 ``PIXEL_PATCHES`` like the uint8 ensemble's). The best level
is compared with in-process throughput measured right before that sweep (with the server up and
idle), so both sides of a ratio saw the same load from other processes. Client and server share
the host's cores, as a sidecar deployment would.

    .venv/bin/python benchmarks/bench_serving.py [--duration 8] [--settings 1,2,3] [--concurrency 1,2,4,8]
        [--out-dir bench_results]

Writes ``bench_serving.json`` and ``bench_serving.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from photos import benchmark_photos

from kimi_vision_client.cli import bench_server
from kimi_vision_client.cli.arguments import positive_int_list
from kimi_vision_server.cli import bench_local
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.repository import RenderOptions

MODEL, PRESET = "kimi_k25_vision", "kimi-k2.5"
# The pixels' wire (and, for the fused model, the model kind) -> the model serving it (same preset,
# same pixel_values on the client).
WIRES = {"float32": MODEL, "uint8": "kimi_k25_vision_u8", "fused uint8": "kimi_k25_vision_fused_u8"}


@dataclass(frozen=True)
class ServerSetting:
    label: str
    instances: int
    # numba_threads and the decode threads of every instance; 0: all cores (the checked-in value).
    # ``kimi-prep serve --instances N --threads T`` renders the same.
    threads: int


SETTINGS = (
    ServerSetting("1 instance, numba 2 thr, decoder all cores (shipped)", 1, 0),
    ServerSetting("2 instances x 1 numba thr, decoder 1 thr", 2, 1),
    ServerSetting("2 instances, numba 2 thr, decoder all cores", 2, 0),
)


@dataclass
class Row:
    """One sweep and the in-process throughput measured just before it."""

    setting: str
    transport: str
    wire: str
    in_process_img_s: float
    levels: list[bench_server.LevelResult]

    @property
    def best(self) -> bench_server.LevelResult:
        return bench_server.best_level(self.levels)


def measure(
    setting: ServerSetting,
    images: list[bench_local.BenchImage],
    duration_s: float,
    rounds: int,
    concurrency: tuple[int, ...] = (1, 2, 4, 8),
) -> list[Row]:
    """On a fresh server: in-process throughput, then a gRPC sweep; without and with shared memory,
    each with the float32 and the uint8 ensemble and the fused model (adjacent rows)."""
    rows = []
    pairs = [(im.name, im.data) for im in images]
    with EmbeddedServer(render=RenderOptions(setting.instances, setting.threads)) as server:
        for shm in (False, True):
            transport = "grpc + shm" if shm else "grpc"
            for wire, model in WIRES.items():
                in_process = bench_local.throughput(images, PRESET, threads=2, rounds=rounds)
                print(
                    f"\n== {setting.label}, {transport}, {wire} ({model}; in-process just before:"
                    f" {in_process:.2f} img/s)",
                    flush=True,
                )
                config = bench_server.BenchConfig(server.grpc_url, "grpc", model, shm, concurrency, duration_s)
                levels = bench_server.sweep(config, pairs, quiet=True)
                rows.append(Row(setting.label, transport, wire, in_process, levels))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| server setting | transport | wire | in-process img/s | served img/s (best conc.) | served / in-process"
        " | mean / p50 / p99 ms | MB/s out |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        best = row.best
        served = f"{best.images_s:.1f} ({best.concurrency})"
        latency = f"{best.mean_ms:.0f} / {best.p50_ms:.0f} / {best.p99_ms:.0f}"
        ratio = best.images_s / row.in_process_img_s
        lines.append(
            f"| {row.setting} | {row.transport} | {row.wire} | {row.in_process_img_s:.1f} | {served} | {ratio:.2f}x"
            f" | {latency} | {best.mb_out_s:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per concurrency level")
    parser.add_argument("--rounds", type=int, default=5, help="in-process rounds over the image set (best kept)")
    parser.add_argument(
        "--settings",
        type=positive_int_list,
        default=list(range(1, len(SETTINGS) + 1)),
        metavar="I[,I...]",
        help="server settings to run, 1-based: " + "; ".join(f"{i}: {s.label}" for i, s in enumerate(SETTINGS, 1)),
    )
    parser.add_argument(
        "--concurrency", type=positive_int_list, default=[1, 2, 4, 8], metavar="N[,N...]", help="levels per sweep"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    if any(i > len(SETTINGS) for i in args.settings):
        parser.error(f"--settings: there are {len(SETTINGS)} settings")

    images = bench_local.bench_images(PRESET, benchmark_photos())
    settings = [SETTINGS[i - 1] for i in args.settings]
    concurrency = tuple(args.concurrency)
    rows = [row for s in settings for row in measure(s, images, args.duration, args.rounds, concurrency)]
    table = markdown(rows)
    print("\n" + table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "models": WIRES,
        "duration_s_per_level": args.duration,
        "images": [{"name": im.name, "bytes": len(im.data), "width": im.width, "height": im.height} for im in images],
        "rows": [
            {"setting": r.setting, "transport": r.transport, "wire": r.wire}
            | {"in_process_2_threads_img_s": r.in_process_img_s}
            | {"levels": bench_server.jsonable(r.levels)}
            for r in rows
        ],
        "table_markdown": table,
    }
    (args.out_dir / "bench_serving.json").write_text(json.dumps(payload, indent=2))
    plot(payload["rows"], args.out_dir / "bench_serving.png")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Served / in-process throughput against concurrency: one panel per server setting, one line per
    transport and wire, the 0.8x target dashed. ``rows``: the ``rows`` of bench_serving.json (so a
    saved run can be re-plotted: ``plot(json.load(f)["rows"], path)``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 4.2), sharey=True, squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        for row in (r for r in rows if r["setting"] == setting):
            levels = row["levels"]
            ratios = [level["images_s"] / row["in_process_2_threads_img_s"] for level in levels]
            style = "-" if row["transport"] == "grpc + shm" else ":"  # colour: the wire; line: the transport
            color = f"C{list(WIRES).index(row['wire'])}" if row["wire"] in WIRES else None
            x = [level["concurrency"] for level in levels]
            ax.plot(x, ratios, style, color=color, marker="o", label=f"{row['transport']}, {row['wire']}")
        ax.axhline(0.8, color="grey", linestyle="--", linewidth=1, label="target 0.8x")
        ax.set_title(setting, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("served / in-process img/s (higher is better)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("Triton over gRPC vs in-process (2 threads), same host: ensembles (float32, uint8) and fused model")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
