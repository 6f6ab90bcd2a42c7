"""Idle memory of `kimi-prep serve`: PSS of tritonserver and its Python stubs (issue 11).

For the default model set and for ``--all``, at one instance a model and at this host's layout
(``host_layout``), the server is started from a fresh rendering, left ``--settle`` seconds after
it is ready, and the PSS (``/proc/PID/smaps_rollup``: shared pages counted once, in proportion)
of tritonserver and of every process under it is summed.

    .venv/bin/python benchmarks/bench_idle_memory.py [--settle 10] [--out-dir bench_results]

Writes ``bench_idle_memory.json`` and ``.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from plots import saved_axes

from kimi_vision_server.host import host_layout
from kimi_vision_server.launch.embedded import EmbeddedServer
from kimi_vision_server.render.repository import RenderOptions, default_model_names

KIB = 1024


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def pss_mib(pids: list[int]) -> float:
    """The PSS of ``pids`` together, MiB; a process that exited while it was read counts 0."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += pss_kib(pid)
    return total / KIB


def idle_pss(options: RenderOptions, models: tuple[str, ...] | None, settle_s: float) -> dict[str, Any]:
    with EmbeddedServer(render=options, models=models) as server:
        time.sleep(settle_s)
        pids = server.process_tree()
        return {"models": len(server.model_names), "processes": len(pids), "pss_mib": pss_mib(pids)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    layout = host_layout()
    print(layout.describe(), flush=True)
    rows = []
    for selection, models in (("default", default_model_names()), ("--all", None)):
        for instances in sorted({1, layout.instances}):
            options = RenderOptions(instances, layout.threads, layout.kind)  # type: ignore[arg-type]
            row = {"selection": selection, "instances": instances, **idle_pss(options, models, args.settle)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| served | instances a model | models | processes | idle PSS MiB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['selection']} | {r['instances']} | {r['models']} | {r['processes']} | {r['pss_mib']:.0f} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"layout": layout.describe(), "rows": rows}
    (args.out_dir / "bench_idle_memory.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out_dir / "bench_idle_memory.png")
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    with saved_axes(path, (6, 4)) as ax:
        ax.bar([f"{r['selection']}\n{r['instances']} instance(s)" for r in rows], [r["pss_mib"] for r in rows])
        ax.set_ylabel("idle PSS, MiB (tritonserver + stubs)")
        ax.set_title("kimi-prep serve, idle")


if __name__ == "__main__":
    sys.exit(main())
