"""bench-local's report: the rows as JSON, the summary per image class, the printed lines, the plot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numba
import numpy as np

from .timing import Timing


def jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: asdict(v) if isinstance(v, Timing) else v for k, v in row.items()} for row in rows]


def format_row(row: dict[str, Any]) -> str:
    im = row["image"]
    parts = [f"{im['name'][:44]:44s} {im['width']}x{im['height']:<5d} {im['image_class']:9s}"]
    for key in ("ours", "reference", "floor", "decode", "pillow_decode", "dali"):
        if key in row:
            parts.append(f"{key}={row[key].median_ms:7.1f}ms")
    if "reference" in row:
        parts.append(f"ref/ours={row['reference'].median_ms / row['ours'].median_ms:5.2f}x")
    parts.append(f"ours/floor={row['ours'].median_ms / row['floor'].median_ms:4.2f}x")
    return "  ".join(parts)


def class_ratio(rows: list[dict[str, Any]], numerator: str, denominator: str) -> float:
    """Ratio of summed medians (a workload of these images, each once)."""
    return sum(r[numerator].median_ms for r in rows) / sum(r[denominator].median_ms for r in rows)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    groups = {"all": rows}
    for name in ("no-resize", "downscale"):
        groups[name] = [r for r in rows if r["image"]["image_class"] == name]
    for name, group in groups.items():
        if not group:
            continue
        entry = {
            "images": len(group),
            "ours_over_floor": class_ratio(group, "ours", "floor"),
            "ours_over_decode": class_ratio(group, "ours", "decode"),
            "decode_over_floor": class_ratio(group, "decode", "floor"),
            "ours_over_pillow_decode": class_ratio(group, "ours", "pillow_decode"),
        }
        if all("reference" in r for r in group):
            entry["reference_over_ours"] = class_ratio(group, "reference", "ours")
        if all("dali" in r for r in group):
            entry["dali_over_ours"] = class_ratio(group, "dali", "ours")
            entry["dali_max_abs_error"] = max(r["dali_max_abs_error"] for r in group)
        summary[name] = entry
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    print(
        "\nclass       images  reference/ours  ours/floor  ours/decode  decode/floor  ours/Pillow-decode  dali/ours"
        "  dali max err"
    )
    for name in ("all", "no-resize", "downscale"):
        if name in summary:
            e = summary[name]
            dali = f"{e['dali_over_ours']:8.2f}x" if "dali_over_ours" in e else "       -"
            reference = f"{e['reference_over_ours']:13.2f}x" if "reference_over_ours" in e else f"{'-':>14s}"
            print(
                f"{name:10s}  {e['images']:6d}  {reference}  {e['ours_over_floor']:9.2f}x"
                f"  {e['ours_over_decode']:10.2f}x  {e['decode_over_floor']:11.2f}x"
                f"  {e['ours_over_pillow_decode']:17.2f}x  {dali}  {e.get('dali_max_abs_error', '-')}"
            )
    print(f"in-process throughput on 2 threads: {summary['throughput_2_threads_img_s']:.1f} img/s")
    batch = summary["batch"]
    print(
        f"preprocess_batch: {batch['single_thread_img_s']:.1f} img/s single-thread, {batch['default_img_s']:.1f} img/s "
        f"default (median of the rounds {batch['default_over_single_thread']:.2f}x: "
        f"{', '.join(f'{r:.2f}x' for r in batch['round_ratios'])}; best over best {batch['best_over_best']:.2f}x)"
    )
    print(
        f"the host's ceiling, the floor decoder on {numba.get_num_threads()} threads over 1, same rounds: median "
        f"{batch['ceiling_over_single_thread']:.2f}x: {', '.join(f'{r:.2f}x' for r in batch['ceiling_round_ratios'])}"
    )


def print_profile(profiles: list[dict[str, Any]]) -> None:
    print("\nsize    image                                    size       path        full  decode  resize  patchify")
    for r in profiles:
        print(
            f"{r['size']:6s}  {r['image'][:40]:40s} {r['width']}x{r['height']:<5d} {r['path']:10s} {r['full_ms']:6.1f} "
            f"{r['decode_ms']:6.1f}  {r['resize_ms']:6.1f}  {r['patchify_ms']:8.1f}  rest {r['rest_ms']:5.1f} ms"
        )


def plot(rows: list[dict[str, Any]], path: Path, preset_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["image"]["name"][:28] for r in rows]
    keys = [k for k in ("ours", "floor", "decode", "pillow_decode", "reference", "dali") if all(k in r for r in rows)]
    x = np.arange(len(rows))
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 5))
    for i, key in enumerate(keys):
        ax.bar(x + i * width, [r[key].median_ms for r in rows], width, label=key)
    ax.set_xticks(x + width * (len(keys) - 1) / 2, names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("median ms per image")
    ax.set_title(f"bench-local ({preset_name}): lower is better")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
