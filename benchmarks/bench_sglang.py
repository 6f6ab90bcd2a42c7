"""SGLang's own Kimi-K2.5 processing of the benchmark photos: stock, ours in process, ours remote,
side by side in one process.

    .venv-sglang/bin/python benchmarks/bench_sglang.py [--repeats 5] [--serving-venv .venv] [--out-dir bench_results]

SGLang 0.5.23's ``KimiK2_5VLImageProcessor`` built three times by its own ``TokenizerManager`` from
the tiny local K2.5 checkpoint of tests/sglang/checkpoints.py (``tests/sglang/sglang_side.py``):
stock (SGLang's exact CPU path: its loader, then the checkpoint's remote-code processor, which in that
checkpoint is the project's plain reference, Pillow and numpy), ours in process
(``KIMI_PREP_SGLANG=local``) and ours remote (the setting a ``kimi-prep serve`` of
``kimi_k25_vision_u8`` on this host, from the serving venv, no response cache). Each photo of
``photos.benchmark_photos`` is one request as SGLang's chat path sends it (a ``data:`` URL), its
preprocess cache emptied first. The three outputs are checked equal before timing; then rounds
alternate the sides, the order rotating each round. Per request: wall time, this process's CPU time
(all its threads) and, for remote, the server's (its process tree) apart. Prints per-image figures
(over photos, each photo's min and median over rounds) and the ratios; writes ``bench_sglang.json``
and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests" / "sglang"), str(ROOT / "tests")]

SIDES = ("stock", "ours", "remote")
SERVED = "kimi_k25_vision_u8"
PACKAGE = "kimi_vision_common.sglang_processors"


def build(checkpoint: Path, setting: str | None) -> Any:
    """SGLang's K2.5 processing of ``checkpoint``, with ours where ``setting`` is given."""
    import importlib

    import sglang_side

    if setting is None:
        os.environ.pop("SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE", None)
    else:
        os.environ["SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"] = PACKAGE
        os.environ["KIMI_PREP_SGLANG"] = setting
        importlib.reload(importlib.import_module(PACKAGE))
        importlib.reload(importlib.import_module(f"{PACKAGE}.kimi"))
    processor = sglang_side.build_processor(checkpoint, "kimi-k2.5")
    os.environ.pop("SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE", None)
    return processor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serving-venv", type=Path, default=ROOT / ".venv")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    args = parser.parse_args()
    import tempfile

    import checkpoints
    import sglang_side
    from make_inputs import ServeProcess
    from photos import benchmark_photos
    from plots import saved_axes
    from process_tree import tree_cpu_s

    photos = benchmark_photos()
    server = ServeProcess(
        "--models", SERVED, "--response-cache-mib", "0", kimi_prep=[str(args.serving_venv / "bin" / "kimi-prep")]
    )
    server.start()
    try:
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = checkpoints.write_checkpoints(Path(folder))["kimi-k2.5"]
            remote = f"grpc://127.0.0.1:{server.ports[1]}?deadline_s=300"
            sides = {
                "stock": build(checkpoint, None),
                "ours": build(checkpoint, "local"),
                "remote": build(checkpoint, remote),
            }
            for name, data in photos:  # equal before timed
                outs = {side: sglang_side.run(p, None, [data])["pixel_values"] for side, p in sides.items()}
                assert all(np.array_equal(outs["stock"], out) for out in outs.values()), name
            server_pid = server.process.pid
            times: dict[str, dict[str, list[tuple[float, float, float]]]] = {
                s: {n: [] for n, _ in photos} for s in SIDES
            }
            for round_index in range(args.repeats):
                order = SIDES[round_index % 3 :] + SIDES[: round_index % 3]
                for name, data in photos:
                    for side in order:
                        wall, cpu, served = time.perf_counter(), time.process_time(), tree_cpu_s(server_pid)
                        sglang_side.run(sides[side], None, [data])
                        times[side][name].append(
                            (
                                time.perf_counter() - wall,
                                time.process_time() - cpu,
                                tree_cpu_s(server_pid) - served,
                            )
                        )
    finally:
        server.stop()
    report = summary(times, [name for name, _ in photos], args.repeats)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_sglang.json").write_text(json.dumps(report, indent=1))
    with saved_axes(args.out_dir / "bench_sglang.png", (7, 3.5)) as ax:
        labels = ["wall", "engine CPU", "server CPU"]
        for index, side in enumerate(SIDES):
            values = [report["per_image_ms"][side][key] for key in ("wall", "cpu", "server_cpu")]
            ax.bar([x + index * 0.27 for x in range(3)], values, width=0.27, label=side)
        ax.set_xticks([x + 0.27 for x in range(3)], labels)
        ax.set_ylabel("ms per image (median)")
        ax.set_title("SGLang 0.5.23, Kimi-K2.5 processing of the benchmark photos")
        ax.legend()
    print("BENCHMARKS.md row:", markdown_row(report))


def markdown_row(report: dict[str, Any]) -> str:
    """The row BENCHMARKS.md's SGLang table gives for ``report`` (tests/test_docs.py checks it)."""
    x, r = report["per_image_ms"], report["ratios"]
    cells = [
        f"{x['stock']['wall']:.1f}", f"{x['ours']['wall']:.1f}", f"{x['remote']['wall']:.1f}",
        f"**{r['stock_over_ours_wall']:.2f}x**", f"{r['stock_over_ours_wall_min']:.2f}x",
        f"{x['stock']['cpu']:.1f}", f"{x['ours']['cpu']:.1f}", f"{x['remote']['cpu']:.1f}",
        f"**{100 * r['remote_engine_cpu_over_stock_cpu']:.1f}%**", f"{x['remote']['server_cpu']:.1f}",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def summary(times: dict, names: list[str], repeats: int) -> dict[str, Any]:
    """Per image (mean over photos of each photo's median over rounds), ms; and the ratios."""

    def per_image(side: str, column: int, pick: Any) -> float:
        return 1000 * statistics.fmean(pick([t[column] for t in times[side][name]]) for name in names)

    figures = {
        side: {
            "wall": per_image(side, 0, statistics.median),
            "wall_min": per_image(side, 0, min),
            "cpu": per_image(side, 1, statistics.median),
            "server_cpu": per_image(side, 2, statistics.median),
        }
        for side in SIDES
    }
    ratios = {
        "stock_over_ours_wall": figures["stock"]["wall"] / figures["ours"]["wall"],
        "stock_over_ours_wall_min": figures["stock"]["wall_min"] / figures["ours"]["wall_min"],
        "remote_engine_cpu_over_stock_cpu": figures["remote"]["cpu"] / figures["stock"]["cpu"],
    }
    print(f"{len(names)} photos, {repeats} rounds; per image, ms (median):")
    for side in SIDES:
        print(f"  {side:6s} " + "  ".join(f"{key} {value:8.1f}" for key, value in figures[side].items()))
    import importlib.metadata

    return {
        "sglang": importlib.metadata.version("sglang"),
        "photos": len(names),
        "repeats": repeats,
        "load_average": os.getloadavg(),
        "per_image_ms": figures,
        "ratios": ratios,
    }


if __name__ == "__main__":
    main()
