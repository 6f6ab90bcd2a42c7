"""vLLM's own Kimi-K2.5 processing of the benchmark photos, stock against ours through the plugin.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--repeats 5] [--out-dir bench_results]

Two vLLM processes side by side, each with vLLM's renderer (its API server's input path) built from
a tiny local K2.5 checkpoint (``tests/vllm/checkpoints.py``; only its processor config and tokenizer
matter here) in vLLM's default uint8 mode (normalised on the device) with its defaults otherwise:
stock (``KIMI_PREP_VLLM=off``: vLLM's fused processor and image loader) and ours (the plugin). Each
photo of ``photos.benchmark_photos`` is one request, two ways: (a) ``pil``: the photo opened with
``Image.open`` and handed over in ``multi_modal_data`` (vLLM's parser, hasher, processor, prompt
update); (b) ``chat``: a chat message with the photo as a ``data:`` URL (base64 decode, vLLM's
image loader, then the same). The processor cache is emptied before each request, so each is
hashed and processed as a new image is. Per request, the process's CPU time (all its threads) and
the wall time. The two processes' outputs are checked identical (a digest of each request's
prompt ids, grids and pixels) before any timing; then rounds alternate between them, the side
that goes first swapping each round. Prints per-image means (min and median over rounds) and
stock/ours ratios; writes ``bench_vllm.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

WAYS = ("pil", "chat")
SIDES = ("stock", "ours")
PLACEHOLDER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


# -- a side: one vLLM process ------------------------------------------------------------------------


def request(render: Any, way: str, data: bytes) -> dict:
    """One photo through vLLM's renderer, as request ``way`` brings it; the engine prompt."""
    from PIL import Image
    from vllm.renderers.params import ChatParams

    if way == "pil":
        item = {"type": "image", "image": Image.open(io.BytesIO(data)), "uuid": None}
        return render.render_cmpl(
            [{"prompt": f"describe {PLACEHOLDER}", "multi_modal_data": {"vision_chunk": [item]}}]
        )[0]
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe this"}]
    return render.render_chat([[{"role": "user", "content": content}]], ChatParams())[1][0]


def digest(prompt: dict) -> str:
    """The prompt's token ids, grids and pixels, hashed."""
    hasher = hashlib.sha256(str(prompt["prompt_token_ids"]).encode())
    for item in prompt["mm_kwargs"]["vision_chunk"]:
        hasher.update(item["grid_thws"].data.numpy().tobytes())
        hasher.update(item["pixel_values"].data.numpy().tobytes())
    return hasher.hexdigest()


def worker(checkpoint: Path) -> None:
    """Answer ``WAY`` lines on stdin with one JSON line: per photo, CPU s, wall s and the digest."""
    from photos import benchmark_photos
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    render = renderer_from_config(EngineArgs(model=str(checkpoint), max_model_len=32768).create_engine_config())
    photos = benchmark_photos()
    print(json.dumps({"ready": [name for name, _ in photos]}), flush=True)
    for line in sys.stdin:
        way = line.strip()
        rows = []
        for _, data in photos:
            render.clear_mm_cache()
            cpu, wall = time.process_time(), time.perf_counter()
            prompt = request(render, way, data)
            rows.append([time.process_time() - cpu, time.perf_counter() - wall, digest(prompt)])
        print(json.dumps(rows), flush=True)


# -- the driver --------------------------------------------------------------------------------------


class Side:
    def __init__(self, name: str, checkpoint: Path) -> None:
        from checkpoints import vllm_environment

        command = [sys.executable, __file__, "--worker", str(checkpoint)]
        env = vllm_environment(stock=name == "stock")
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.photos: list[str] = self._answer()["ready"]

    def _answer(self) -> Any:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(("{", "[")):
                return json.loads(line)
        raise RuntimeError(f"the worker ended with {self.process.wait()}")

    def run(self, way: str) -> list[list]:
        assert self.process.stdin is not None
        self.process.stdin.write(way + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def main() -> int:
    from checkpoints import write_checkpoint
    from plots import saved_axes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = write_checkpoint(Path(folder) / "kimi-k2.5", "kimi-k2.5")
        sides = {name: Side(name, checkpoint) for name in SIDES}
        photos = sides["ours"].photos
        for way in WAYS:  # warm (numba compiles, caches fill) and exact before any timing
            digests = {name: [row[2] for row in side.run(way)] for name, side in sides.items()}
            differing = [p for p, s, o in zip(photos, digests["stock"], digests["ours"], strict=True) if s != o]
            if differing:
                raise AssertionError(f"{way}: ours differs from stock vLLM on {differing}")
        rounds: dict[str, dict[str, list[dict[str, float]]]] = {way: {name: [] for name in SIDES} for way in WAYS}
        for index in range(args.repeats):
            order = SIDES if index % 2 == 0 else SIDES[::-1]
            for way in WAYS:
                for name in order:
                    rows = sides[name].run(way)
                    rounds[way][name].append(
                        {
                            "cpu_ms": 1e3 * sum(r[0] for r in rows) / len(rows),
                            "wall_ms": 1e3 * sum(r[1] for r in rows) / len(rows),
                        }
                    )
        for side in sides.values():
            side.close()
    summary: dict[str, dict[str, float]] = {}
    for way in WAYS:
        row: dict[str, float] = {}
        for name in SIDES:
            for measure in ("cpu_ms", "wall_ms"):
                values = [r[measure] for r in rounds[way][name]]
                row[f"{name}_{measure}_min"], row[f"{name}_{measure}_median"] = min(values), statistics.median(values)
        for measure in ("cpu_ms", "wall_ms"):
            for stat in ("min", "median"):
                row[f"stock_over_ours_{measure}_{stat}"] = (
                    row[f"stock_{measure}_{stat}"] / row[f"ours_{measure}_{stat}"]
                )
        summary[way] = row
    print(
        f"{len(photos)} benchmark photos, one a request, vLLM's renderer (uint8 mode); "
        f"per image, over {args.repeats} rounds"
    )
    heads = ("stock wall", "ours wall", "ratio", "stock CPU", "ours CPU", "ratio")
    print(f"{'way':5s} " + " ".join(f"{head:>10s}" for head in heads) + "  (median ms; ratio min)")
    for way, row in summary.items():
        print(
            f"{way:5s} {row['stock_wall_ms_median']:10.1f} {row['ours_wall_ms_median']:10.1f} "
            f"{row['stock_over_ours_wall_ms_median']:9.2f}x {row['stock_cpu_ms_median']:10.1f} "
            f"{row['ours_cpu_ms_median']:10.1f} {row['stock_over_ours_cpu_ms_median']:9.2f}x  "
            f"(min {row['stock_over_ours_wall_ms_min']:.2f}x wall, {row['stock_over_ours_cpu_ms_min']:.2f}x CPU)"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "preset": "kimi-k2.5",
        "mode": "uint8",
        "repeats": args.repeats,
        "photos": photos,
        "summary": summary,
        "rounds": rounds,
    }
    (args.out_dir / "bench_vllm.json").write_text(json.dumps(result, indent=2))
    with saved_axes(args.out_dir / "bench_vllm.png", (7, 4)) as ax:
        import numpy as np

        x = np.arange(len(WAYS) * 2)
        labels = [f"{way} {measure}" for way in WAYS for measure in ("wall", "CPU")]
        for offset, name in ((-0.2, "stock"), (0.2, "ours")):
            values = [summary[way][f"{name}_{m}_ms_median"] for way in WAYS for m in ("wall", "cpu")]
            ax.bar(x + offset, values, 0.4, label="stock vLLM" if name == "stock" else "ours (plugin)")
        ax.set_xticks(x, labels)
        ax.set_ylabel(f"ms per image (median of {args.repeats} rounds)")
        ax.set_title(f"vLLM Kimi-K2.5 processing, uint8 mode, {len(photos)} photos")
        ax.legend()
    return 0


if __name__ == "__main__":
    sys.exit(main())
